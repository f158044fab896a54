"""One training step of the EAGLE-3 head with training-time test (TTT): the dense-mask attention (the
PyTorch math kernel over a [T, (j+1)T] mask per step, what training ran before) against the fused one
(common.kernels.ttt), same batch, same initial weights, same run.

    python -m bench.ttt_step --out DIR                                        # CPU smoke (small)
    python -m bench.ttt_step --device cuda --batch 8,16,32 --seq 1024 --steps 6 --out DIR

A step is training.train.optimize_step, the function the Trainer runs: `steps` unrolled head forwards
(bf16 autocast on CUDA), backward, gradient clipping and AdamW. The head has the shipped head's shapes
(models/eagle3-smollm2/config.json: hidden 576, 9/3 heads of 64, draft vocabulary 8192) with random
weights; the batch is random features (timing does not depend on their values). Each path runs --warmup
steps first (not timed; on CUDA they include kernel selection), then --iters timed steps, each ended by a
device synchronisation. Figures per batch size and path: ms per step (mean and min), samples/s
(batch / mean step time), peak GPU memory, the first step's loss (the paths must agree), and the fused
path's speed-up. A path that runs out of GPU memory is recorded as such. Writes DIR/ttt_step.json and
DIR/ttt_step.md and prints the markdown.
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
from pathlib import Path

import torch

from common.model.eagle3 import Eagle3Config, Eagle3Head
from common.model.eagle3_io import config_from_json
from training.train import TrainConfig, TTTInputs, make_optimizer, optimize_step
from training.ttt import DenseMaskAttention, FusedAttention, StepAttention, TTTTargets

log = logging.getLogger("bench.ttt_step")

HEAD_CONFIG = Path(__file__).resolve().parents[1] / "models" / "eagle3-smollm2" / "config.json"
PATHS: dict[str, StepAttention] = {"dense": DenseMaskAttention(), "fused": FusedAttention()}


def random_inputs(hcfg: Eagle3Config, batch: int, seq: int, device: torch.device, seed: int) -> TTTInputs:
    """Random features and targets: embeds [B, T, H], aux [B, T, 3H], a target distribution [B, T, Vd]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    vd = hcfg.draft_vocab_size
    return TTTInputs(
        embeds=torch.randn(batch, seq, hcfg.hidden_size, generator=g).to(device),
        aux=torch.randn(batch, seq, 3 * hcfg.target_hidden_size, generator=g).to(device),
        targets=TTTTargets(
            target_p=torch.softmax(3 * torch.randn(batch, seq, vd, generator=g), dim=-1).to(device),
            base_top=torch.randint(0, vd, (batch, seq), generator=g).to(device),
            in_draft=torch.ones(batch, seq, dtype=torch.bool, device=device),
            valid=torch.ones(batch, seq, dtype=torch.bool, device=device),
        ),
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_path(
    head: Eagle3Head, inputs: TTTInputs, cfg: TrainConfig, attention: StepAttention, warmup: int, iters: int
) -> dict:
    """Fresh copies of the head and its optimizer; returns the timings of `iters` steps after `warmup`."""
    device = inputs.embeds.device
    head = copy.deepcopy(head)
    opt = make_optimizer(head, cfg)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    first_loss = None
    times = []
    for i in range(warmup + iters):
        sync(device)
        t0 = time.perf_counter()
        res = optimize_step(head, opt, inputs, cfg, cfg.lr, attention).result
        sync(device)
        if first_loss is None:
            first_loss = float(res.loss.detach())
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    batch = inputs.embeds.shape[0]
    mean = statistics.fmean(times)
    out = {
        "ms_per_step": 1e3 * mean,
        "ms_min": 1e3 * min(times),
        "samples_per_s": batch / mean,
        "first_loss": first_loss,
    }
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return out


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
        for name in args.paths:
            try:
                row[name] = time_path(head, inputs, cfg, PATHS[name], args.warmup, args.iters)
            except torch.OutOfMemoryError:
                row[name] = {"oom": True}
            log.info("batch %d %s: %s", batch, name, row[name])
        if "ms_per_step" in row.get("dense", {}) and "ms_per_step" in row.get("fused", {}):
            row["speedup"] = row["dense"]["ms_per_step"] / row["fused"]["ms_per_step"]
            row["loss_diff"] = abs(row["dense"]["first_loss"] - row["fused"]["first_loss"])
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
        "| batch | path | ms/step | min ms | samples/s | peak GiB | first loss |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        for name in ("dense", "fused"):
            r = row.get(name)
            if r is None:
                continue
            if r.get("oom"):
                lines.append(f"| {row['batch']} | {name} | out of memory | | | | |")
                continue
            mem = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "-"
            lines.append(
                f"| {row['batch']} | {name} | {r['ms_per_step']:.1f} | {r['ms_min']:.1f} | "
                f"{r['samples_per_s']:.2f} | {mem} | {r['first_loss']:.5f} |"
            )
        if "speedup" in row:
            lines.append(f"| {row['batch']} | **speed-up** | **{row['speedup']:.2f}x** | | | | |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m bench.ttt_step", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", default="2", help="comma-separated batch sizes, e.g. 8,16,32")
    ap.add_argument("--seq", type=int, default=128, help="tokens per sequence (T)")
    ap.add_argument("--steps", type=int, default=6, help="TTT steps")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--paths", default="dense,fused", help="dense, fused or both")
    ap.add_argument("--head-config", default=str(HEAD_CONFIG), help="EAGLE-3 config.json giving the shapes")
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
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
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ttt_step.json").write_text(json.dumps(report, indent=2) + "\n")
    md = markdown(report)
    (args.out / "ttt_step.md").write_text(md)
    sys.stdout.write(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
