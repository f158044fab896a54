"""One training step of the EAGLE-3 head with training-time test (TTT), three ways on the same batch with
the same initial weights in the same run:

  dense        the dense [T, (j+1)T] mask through the PyTorch attention, eager: training before this change
  fused-eager  common.kernels.ttt (causal flash kernel + diagonal, log-sum-exp merge), eager
  fused        the same, each TTT step (head forward, attention, loss) through torch.compile with dynamic
               shapes: training now

    python -m training.ttt_step --out DIR                                        # CPU smoke (small)
    python -m training.ttt_step --device cuda --batch 8,16,32 --seq 1024 --steps 6 --out DIR

A step is training.train.optimize_step, the function the Trainer runs: `steps` unrolled head forwards
(bf16 autocast on CUDA), backward, gradient clipping and AdamW. The head has the shipped head's shapes
(models/eagle3-smollm2/config.json: hidden 576, 9/3 heads of 64, draft vocabulary 8192) with random
weights; the batch is random features (timing does not depend on their values). Each path runs --warmup
steps first (not timed; they include torch.compile's compilation, reported as warm-up s), then --iters
timed steps, each ended by a device synchronisation. Figures per batch size and path: ms per step (mean
and min), samples/s (batch / mean step time), speed-up over dense, peak GPU memory, the first step's loss
(the paths must agree), the first step's gradients against the first path's (grad diff: the largest
|g - g_ref| / |g_ref| over the parameters; bf16 noise is about 0.01 on a GPU, a wrong backward with a right
loss once gave 1.3) and the warm-up time. A path that runs out of GPU memory is recorded as such. On CPU
torch.compile is not used, so fused is fused-eager. Writes DIR/ttt_step.json and DIR/ttt_step.md
and prints the markdown.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.model.eagle3_io import config_from_json
from training.train import TrainConfig, TTTInputs, make_optimizer, optimize_step
from training.ttt import DenseMaskAttention, FusedAttention, StepAttention, TTTTargets

log = logging.getLogger("bench.ttt_step")

HEAD_CONFIG = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2" / "config.json"


@dataclass(frozen=True)
class StepVariant:
    attention: StepAttention
    compile: bool  # torch.compile the TTT step (CUDA only; ignored on CPU)


PATHS = {
    "dense": StepVariant(DenseMaskAttention(), compile=False),  # training before this change
    "fused-eager": StepVariant(FusedAttention(), compile=False),
    "fused": StepVariant(FusedAttention(), compile=True),  # training now (TrainConfig's default)
}


def random_inputs(hcfg: Eagle3Config, batch: int, seq: int, device: torch.device, seed: int) -> TTTInputs:
    """Random features and targets: embeds [B, T, H], aux [B, T, 3H], the base's logits over the draft
    vocabulary [B, T, Vd] in the dtype training gets them in (the base's: bf16 on a GPU, float32 on CPU)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    logits_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    vd = hcfg.draft_vocab_size
    return TTTInputs(
        embeds=torch.randn(batch, seq, hcfg.hidden_size, generator=g).to(device),
        aux=torch.randn(batch, seq, 3 * hcfg.target_hidden_size, generator=g).to(device),
        targets=TTTTargets.of(
            (3 * torch.randn(batch, seq, vd, generator=g)).to(device, logits_dtype),
            base_top=torch.randint(0, vd, (batch, seq), generator=g).to(device),
            in_draft=torch.ones(batch, seq, dtype=torch.bool, device=device),
            valid=torch.ones(batch, seq, dtype=torch.bool, device=device),
        ),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_path(
    head: Eagle3Head,
    inputs: TTTInputs,
    cfg: TrainConfig,
    path: StepVariant,
    warmup: int,
    iters: int,
    reference: dict[str, torch.Tensor] | None = None,
    profile: Path | None = None,
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Fresh copies of the head and its optimizer; returns the timings of `iters` steps after `warmup`
    (warmup_s: the warm-up steps' total, torch.compile's compilation included) and the first step's
    gradients (after clipping, float32). With `reference` (another path's first gradients) the timings get
    grad_diff: the largest |g - g_ref| / |g_ref| over the parameters (a wrong backward with a right loss
    shows here, not in the first loss)."""
    device = inputs.embeds.device
    cfg = replace(cfg, compile=path.compile)
    head = copy.deepcopy(head)
    opt = make_optimizer(head, cfg)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    first_loss, grads = None, {}
    times, warm = [], 0.0
    for i in range(warmup + iters):
        sync(device)
        t0 = time.perf_counter()
        res = optimize_step(head, opt, inputs, cfg, cfg.lr, path.attention).result
        sync(device)
        if first_loss is None:
            first_loss = float(res.loss.detach())
            grads = {n: p.grad.float().clone() for n, p in head.named_parameters() if p.grad is not None}
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        else:
            warm += time.perf_counter() - t0
    batch = inputs.embeds.shape[0]
    mean = statistics.fmean(times)
    out = {
        "ms_per_step": 1e3 * mean,
        "ms_min": 1e3 * min(times),
        "samples_per_s": batch / mean,
        "first_loss": first_loss,
        "warmup_s": warm,
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if reference is not None:
        out["grad_diff"] = grad_diff(grads, reference)
    if profile is not None:
        out["profile"] = profile_steps(head, opt, inputs, cfg, path, profile)
    return out, grads


def profile_steps(
    head: Eagle3Head, opt: torch.optim.Optimizer, inputs: TTTInputs, cfg: TrainConfig, path: StepVariant, out: Path
) -> str:
    """Two more steps under torch.profiler; writes their kernels and operators by device time (self) to
    `out` and returns its name."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if inputs.embeds.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            optimize_step(head, opt, inputs, cfg, cfg.lr, path.attention)
        sync(inputs.embeds.device)
    key = "self_device_time_total" if inputs.embeds.is_cuda else "self_cpu_time_total"
    out.write_text(prof.key_averages().table(sort_by=key, row_limit=60, max_name_column_width=90) + "\n")
    return out.name


def grad_diff(grads: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest |g - g_ref| / |g_ref| over the parameters of `reference` (name -> gradient): about 0.01
    between two right bf16 steps on a GPU, 1.3 for the wrong backward of session 13."""
    return max(float((grads[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in reference.items())


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    hcfg = config_from_json(json.loads(Path(args.head_config).read_text()))
    cfg = TrainConfig(draft_vocab=hcfg.draft_vocab_size, ttt_steps=args.steps)
    torch.manual_seed(0)
    head = Eagle3Head(hcfg)
    head.set_vocab_map(torch.arange(hcfg.draft_vocab_size))
    head.to(device).train()
    results = []
    for batch in args.batch:
        inputs = random_inputs(hcfg, batch, args.seq, device, seed=batch)
        row: dict = {"batch": batch}
        reference = None  # the first path's first gradients (dense when it runs)
        for name in args.paths:
            try:
                prof = args.out / f"profile-{name}-{batch}.txt" if args.profile else None
                row[name], grads = time_path(head, inputs, cfg, PATHS[name], args.warmup, args.iters, reference, prof)
                reference = reference if reference is not None else grads
            except torch.OutOfMemoryError:
                row[name] = {"oom": True}
            log.info("batch %d %s: %s", batch, name, row[name])
        base = row.get("dense", {})
        for name in args.paths:
            if name != "dense" and "ms_per_step" in base and "ms_per_step" in row[name]:
                row[name]["speedup"] = base["ms_per_step"] / row[name]["ms_per_step"]
                row[name]["loss_diff"] = abs(base["first_loss"] - row[name]["first_loss"])
        results.append(row)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "compute": "bf16 autocast" if device.type == "cuda" else "float32",
        "seq": args.seq,
        "ttt_steps": args.steps,
        "warmup": args.warmup,
        "iters": args.iters,
        "head": f"hidden {hcfg.hidden_size}, heads {hcfg.num_heads}/{hcfg.num_kv_heads}x{hcfg.head_dim}, "
        f"draft vocab {hcfg.draft_vocab_size}",
    }
    return {"meta": meta, "results": results}


def markdown(report: dict) -> str:
    m = report["meta"]
    lines = [
        f"TTT training step ({m['ttt_steps']} steps, seq {m['seq']}, {m['compute']}) on {m['device']}, "
        f"torch {m['torch']}; mean of {m['iters']} steps after {m['warmup']} warm-up",
        "",
        "| batch | path | ms/step | min ms | samples/s | speed-up vs dense | peak GiB | first loss | grad diff "
        "| warm-up s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        for name in PATHS:
            r = row.get(name)
            if r is None:
                continue
            if r.get("oom"):
                lines.append(f"| {row['batch']} | {name} | out of memory | | | | | | | |")
                continue
            mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
            speedup = f"**{r['speedup']:.2f}x**" if "speedup" in r else "-"
            diff = f"{r['grad_diff']:.4f}" if "grad_diff" in r else "-"
            lines.append(
                f"| {row['batch']} | {name} | {r['ms_per_step']:.1f} | {r['ms_min']:.1f} | "
                f"{r['samples_per_s']:.2f} | {speedup} | {mem} | {r['first_loss']:.5f} | {diff} | {r['warmup_s']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m training.ttt_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="2", help="comma-separated batch sizes, e.g. 8,16,32")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (T)")
    ap.add_argument("--steps", type=int, default=6, help="TTT steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument(
        "--paths",
        default=None,
        help=f"comma-separated, of {', '.join(PATHS)} (default: all on CUDA; dense,fused on CPU, where fused "
        "runs eagerly)",
    )
    ap.add_argument(
        "--profile", action="store_true", help="after each path's timing, profile two steps: DIR/profile-PATH-B.txt"
    )
    ap.add_argument("--head-config", default=str(HEAD_CONFIG), help="EAGLE-3 config.json giving the shapes")
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    if args.paths is None:
        args.paths = ",".join(PATHS) if args.device.startswith("cuda") else "dense,fused"
    args.paths = [p.strip() for p in args.paths.split(",")]
    bad = [p for p in args.paths if p not in PATHS]
    if bad:
        ap.error(f"unknown path {bad[0]!r}: choose from {', '.join(PATHS)}")
    if min(args.batch) < 1 or args.seq < 2 or args.iters < 1 or args.warmup < 0:
        ap.error("--batch and --iters must be >= 1, --seq >= 2, --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    report = run(args)
    (args.out / "ttt_step.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (args.out / "ttt_step.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
