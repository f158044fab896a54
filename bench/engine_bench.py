"""In-process engine benchmark: Hugging Face generate vs. plain decoding vs. speculative decoding.

    python -m bench.engine_bench --device cuda --dtype bfloat16 --prompts 16 --max-new-tokens 128 \
        --concurrency 1,4,16 --head DIR --out bench_out
    python -m bench.engine_bench --device cuda --check-equal --out bench_out

Every method generates exactly --max-new-tokens tokens per prompt (EOS is ignored, so all methods do
the same work; Hugging Face gets min_new_tokens for the same reason). Prompts run in waves of
`concurrency` sequences; a wave's sequences share one propose and one verify (or decode) call per round
and leave the batch when done. Figures per method and concurrency:
  tok/s per request  (tokens - 1) / (last token time - first token time), averaged over requests
  tok/s total        all tokens / wall time of all waves
  TTFT               first token time - wave start (prefills of a wave run one after the other)
  ITL                mean gap between a request's tokens (speculative tokens arrive in bursts)
  acceptance length  mean tokens committed per sequence per round (accepted drafts + the bonus)
  round breakdown    draft ms, verify (or decode) ms and host/orchestration ms per round
`--methods closed` adds speculative decoding in a closed loop (speculative-closed): `concurrency` requests in
flight, each finished one replaced by the next, prefilled between two rounds of the others, as
bench.services_bench loads the gateway (max(prompts, --requests-per-worker x concurrency) requests).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from common.config import DraftingConfig, SamplingConfig
from common.engine.base import PrefillInput
from common.engine.cuda_graphs import GraphConfig
from common.engine.factory import make_drafter, make_verifier, pick_dtype
from common.engine.loop import Round, speculative_loop
from common.engine.verifier import VerifierConfig, torch_dtype
from common.model.eagle3 import Eagle3Config, Eagle3Head

log = logging.getLogger("bench.engine_bench")

QUESTIONS = [
    "What is the capital of France, and why is it famous?",
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the ocean at night.",
    "What are three tips for learning a new language?",
    "How do vaccines train the immune system?",
    "Give me a simple recipe for pancakes.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "Why is the sky blue?",
    "How does a binary search work? Give an example.",
    "What should I pack for a weekend hiking trip?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Describe the rules of chess in brief.",
    "What are the health benefits of regular exercise?",
]


@dataclass
class RequestTrace:
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)  # arrival time of each token (seconds, wave clock)
    arrival: float = 0.0


@dataclass
class RunResult:
    method: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tok_s_per_request: float
    tok_s_total: float
    ttft_ms: float
    itl_ms: float
    # mean time from a request's first token to the next ones: how long a joiner waits for its first round
    # (in a closed loop, for the round or call it can join)
    second_ms: float = 0.0
    acceptance_length: float | None = None
    rounds: int = 0
    draft_ms_per_round: float | None = None
    verify_ms_per_round: float | None = None
    host_ms_per_round: float | None = None
    # the drafting's device time a round, over the rounds whose trees were launched behind a verify (in process)
    draft_device_ms_per_round: float | None = None
    rpc_ms_per_round: float | None = None  # through the services only
    draft_wait_ms_per_round: float | None = None  # the verifier waiting for chained trees (services only)
    round_ms: float | None = None  # a round's wall time, all phases (services only)
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def summarize(
    method: str,
    concurrency: int,
    traces: list[RequestTrace],
    wall: float,
    rounds: int = 0,
    draft: float = 0.0,
    verify: float = 0.0,
    host: float = 0.0,
    accepted: list[int] | None = None,
) -> RunResult:
    per_req, ttft, itl, second = [], [], [], []
    for tr in traces:
        ttft.append(tr.times[0] - tr.arrival)
        later = next((t for t in tr.times if t > tr.times[0]), None)  # the first message may carry several
        if later is not None:
            second.append(later - tr.times[0])
        span = tr.times[-1] - tr.times[0]
        if len(tr.tokens) > 1 and span > 0:
            per_req.append((len(tr.tokens) - 1) / span)
            itl.append(span / (len(tr.tokens) - 1))
    total = sum(len(tr.tokens) for tr in traces)
    r = max(rounds, 1)
    return RunResult(
        method=method,
        concurrency=concurrency,
        requests=len(traces),
        tokens=total,
        wall_s=wall,
        tok_s_per_request=float(np.mean(per_req)) if per_req else 0.0,
        tok_s_total=total / wall,
        ttft_ms=1e3 * float(np.mean(ttft)),
        itl_ms=1e3 * float(np.mean(itl)) if itl else 0.0,
        second_ms=1e3 * float(np.mean(second)) if second else 0.0,
        acceptance_length=float(np.mean(accepted)) if accepted else None,
        rounds=rounds,
        draft_ms_per_round=1e3 * draft / r if rounds and draft else None,
        verify_ms_per_round=1e3 * verify / r if rounds else None,
        host_ms_per_round=1e3 * host / r if rounds else None,
        outputs=[tr.tokens for tr in traces],
    )


def waves(prompts: list[list[int]], concurrency: int) -> list[list[tuple[int, list[int]]]]:
    indexed = list(enumerate(prompts))
    return [indexed[i : i + concurrency] for i in range(0, len(indexed), concurrency)]


def filled(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts, cycled until one wave holds `concurrency` sequences. With fewer prompts than that, the
    only wave would run at the prompts' batch, a smaller one than the services' closed loop keeps in flight
    at that concurrency (session 10's c=64 baseline ran 32 sequences). Example: 3 prompts [a, b, c] at
    concurrency 7 -> [a, b, c, a, b, c, a]; at concurrency 2 -> [a, b, c] (two waves, of 2 and 1)."""
    if concurrency <= len(prompts):
        return prompts
    return [prompts[i % len(prompts)] for i in range(concurrency)]


# ---- methods ----
def run_plain(verifier, prompts: list[list[int]], max_new: int, concurrency: int) -> RunResult:
    traces = [RequestTrace() for _ in prompts]
    rounds, decode_s, host_s = 0, 0.0, 0.0
    t_start = time.perf_counter()
    for wave in waves(prompts, concurrency):
        t0 = time.perf_counter()
        ids = []
        for i, p in wave:
            sid = f"plain-{i}"
            out = verifier.prefill(PrefillInput(sid, p, SamplingConfig()))
            traces[i].arrival, traces[i].tokens, traces[i].times = t0, [out.next_token], [time.perf_counter()]
            ids.append((sid, i))
        while ids:
            t_a = time.perf_counter()
            toks = verifier.decode([sid for sid, _ in ids])
            t_b = time.perf_counter()
            for (_, i), tok in zip(ids, toks):
                traces[i].tokens.append(tok)
                traces[i].times.append(t_b)
            done = [sid for sid, i in ids if len(traces[i].tokens) >= max_new]
            verifier.release(done)
            ids = [(sid, i) for sid, i in ids if sid not in done]
            rounds += 1
            decode_s += t_b - t_a
            host_s += time.perf_counter() - t_b
    return summarize("plain", concurrency, traces, time.perf_counter() - t_start, rounds, 0.0, decode_s, host_s)


def _committer(traces: list[RequestTrace], owner: dict[str, int], max_new: int):
    """speculative_loop's commit for requests traced in `traces` (seq id -> its index in `owner`): each
    request's tokens up to max_new, stamped with their arrival time; it goes on while it has fewer."""

    def commit(sid: str, tokens: list[int]) -> bool:
        tr, now = traces[owner[sid]], time.perf_counter()
        got = tokens[: max_new - len(tr.tokens)]
        tr.tokens.extend(got)
        tr.times.extend([now] * len(got))
        return len(tr.tokens) < max_new

    return commit


def _summarize_rounds(name: str, concurrency: int, traces: list[RequestTrace], t_start: float, rounds: list[Round]):
    """summarize() over speculative_loop's rounds (host time: the bookkeeping and any joiners' prefill)."""
    wall = time.perf_counter() - t_start
    accepted = [c for r in rounds for c in r.committed]
    draft_s, verify_s = sum(r.draft_s for r in rounds), sum(r.verify_s for r in rounds)
    host_s = sum(r.host_s + r.prefill_s for r in rounds)
    out = summarize(name, concurrency, traces, wall, len(rounds), draft_s, verify_s, host_s, accepted)
    chained = [r.draft_device_s for r in rounds if r.draft_device_s is not None]
    out.draft_device_ms_per_round = 1e3 * sum(chained) / len(chained) if chained else None
    return out


def _device_drafting(r: RunResult) -> str:
    """The drafting's device time for a summary line (bench.split_ratio and policy.sh read the lines' start)."""
    ms = r.draft_device_ms_per_round
    return f", drafting on the device {ms:.2f} ms a round" if ms is not None else ""


def closed_loop_requests(prompts: int, per_worker: int, concurrency: int) -> int:
    """Requests of a closed-loop run: every worker busy for the whole run (bench.services_bench too)."""
    return max(prompts, per_worker * concurrency)


def run_spec(
    verifier,
    drafter,
    prompts: list[list[int]],
    max_new: int,
    concurrency: int,
    tree_size: int,
    name: str = "speculative",
) -> RunResult:
    traces = [RequestTrace() for _ in prompts]
    owner: dict[str, int] = {}
    commit = _committer(traces, owner, max_new)
    rounds: list[Round] = []
    t_start = time.perf_counter()
    for wave in waves(prompts, concurrency):
        t0 = time.perf_counter()
        for i, _ in wave:
            owner[f"spec-{i}"] = i
            traces[i].arrival = t0
        speculative_loop(verifier, drafter, {f"spec-{i}": p for i, p in wave}, tree_size, commit, rounds.append)
    return _summarize_rounds(name, concurrency, traces, t_start, rounds)


def run_spec_closed(
    verifier, drafter, prompts: list[list[int]], max_new: int, concurrency: int, tree_size: int, requests: int
) -> RunResult:
    """Speculative decoding in a closed loop, the services bench's workload in process: `concurrency`
    requests in flight and each finished one replaced by the next (prompts cycled, `requests` in all), its
    prefill between two rounds of the others (speculative_loop's `more`). Figures as the waves'; the rounds'
    prefill time is in the wall and in the running requests' token times, as it is through the gateway."""
    load = [prompts[i % len(prompts)] for i in range(requests)]
    traces = [RequestTrace() for _ in load]
    owner: dict[str, int] = {}
    rounds: list[Round] = []
    nxt = 0

    def take(n: int) -> dict[str, list[int]]:
        nonlocal nxt
        now, new = time.perf_counter(), {}
        for i in range(nxt, min(nxt + n, len(load))):
            owner[f"closed-{i}"] = i
            traces[i].arrival = now
            new[f"closed-{i}"] = load[i]
        nxt = min(nxt + n, len(load))
        return new

    t_start = time.perf_counter()
    commit = _committer(traces, owner, max_new)
    speculative_loop(verifier, drafter, take(concurrency), tree_size, commit, rounds.append, more=take)
    return _summarize_rounds("speculative-closed", concurrency, traces, t_start, rounds)


def run_hf(model_path: Path, device: torch.device, dtype: str, prompts: list[list[int]], max_new: int) -> RunResult:
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    if model_path.is_dir():
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch_dtype(dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch_dtype(dtype)
        )
    model.to(device).eval()

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.skip_prompt = True

        def put(self, value) -> None:
            if self.skip_prompt:
                self.skip_prompt = False
                return
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def generate(p: list[int], n: int, streamer=None):
        ids = torch.tensor([p], device=device)
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            streamer=streamer,
            pad_token_id=model.config.eos_token_id,
        )

    with torch.inference_mode():
        generate(prompts[0], 4)  # warm-up
        traces = []
        t_start = time.perf_counter()
        for p in prompts:
            clock = Clock()
            t0 = time.perf_counter()
            out = generate(p, max_new, clock)
            traces.append(RequestTrace(tokens=out[0, len(p) :].tolist(), times=clock.times, arrival=t0))
        wall = time.perf_counter() - t_start
    return summarize("hf-generate", 1, traces, wall)


# ---- set-up ----
def load_head(head_dir: str | None, base_cfg, device: torch.device, dtype: str) -> Eagle3Head:
    head = None
    if head_dir:
        try:
            from common.model.eagle3_io import load_eagle3

            head, _ = load_eagle3(head_dir)
        except (ImportError, FileNotFoundError, OSError) as exc:
            log.warning("could not load an EAGLE-3 head from %s (%s): using a random head", head_dir, exc)
    if head is None:
        if not head_dir:
            log.warning("no --head given: using a randomly initialised EAGLE-3 head (low acceptance)")
        torch.manual_seed(0)
        head = Eagle3Head(Eagle3Config.for_base(base_cfg, draft_vocab_size=min(8192, base_cfg.vocab_size)))
        head.set_vocab_map(torch.arange(head.cfg.draft_vocab_size))
    head.to(device=device, dtype=torch_dtype(dtype)).eval()
    return head


@dataclass
class Engines:
    verifier: object
    drafter: object
    drafting: DraftingConfig


def build_engines(ckpt, args, dtype: str, max_sequences: int) -> Engines:
    drafting = DraftingConfig(top_k=args.top_k, steps=args.steps, verify_tree_size=args.tree_size)
    max_nodes = max(64, args.tree_size)
    graph_cfg = GraphConfig(tree_buckets=(16, 32, args.tree_size + 1, max_nodes + 1))
    vcfg = VerifierConfig(
        max_sequences=max_sequences,
        max_context=args.max_context,
        max_tree_nodes=max_nodes,
        dtype=dtype,
        device=args.device,
    )
    verifier = make_verifier(ckpt, vcfg, args.graphs, graph_cfg)
    head = load_head(args.head, ckpt.config, torch.device(args.device), dtype)
    drafter = make_drafter(
        head,
        verifier.model.embed_tokens,
        drafting,
        max_sequences,
        args.max_context,
        args.device,
        args.graphs,
        graph_cfg,
    )
    return Engines(verifier, drafter, drafting)


def warm_up(eng: Engines, prompts: list[list[int]], tree_size: int) -> None:
    """The engines' first calls (their graphs were captured at construction), then the heap frozen as
    services/launch.py freeze_heap does before a service serves (the same collector's work per round on both
    sides; not imported: the A/B runs put this bench beside older services without it, policy.sh ab15)."""
    run_plain(eng.verifier, prompts[:1], 8, 1)
    run_spec(eng.verifier, eng.drafter, prompts[:1], 8, 1, tree_size)
    gc.collect()
    gc.freeze()


def encode_prompts(ckpt, n: int) -> list[list[int]]:
    from common.tokenizer import Tokenizer

    tok = Tokenizer(ckpt.path)
    return [tok.encode_chat([("user", QUESTIONS[i % len(QUESTIONS)])]) for i in range(n)]


# ---- reports ----
def markdown(results: list[RunResult], meta: dict) -> str:
    lines = [
        f"# Engine benchmark ({meta['device_name']}, {meta['dtype']}, graphs={meta['graphs']})",
        "",
        f"{meta['prompts']} prompts, {meta['max_new_tokens']} new tokens each, head: {meta['head']}",
        "",
        "| method | conc. | tok/s/req | tok/s total | TTFT ms | ITL ms | accept len | rounds "
        "| draft ms | verify ms | host ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for r in results:
        lines.append(
            f"| {r.method} | {r.concurrency} | {r.tok_s_per_request:.1f} | {r.tok_s_total:.1f} "
            f"| {r.ttft_ms:.1f} | {r.itl_ms:.2f} | {f(r.acceptance_length, '{:.2f}')} | {r.rounds} "
            f"| {f(r.draft_ms_per_round, '{:.2f}')} | {f(r.verify_ms_per_round, '{:.2f}')} "
            f"| {f(r.host_ms_per_round, '{:.2f}')} |"
        )
    plain = {r.concurrency: r for r in results if r.method == "plain"}
    speedups = [
        f"c={r.concurrency}: {r.tok_s_total / plain[r.concurrency].tok_s_total:.2f}x"
        for r in results
        if r.method == "speculative" and r.concurrency in plain
    ]
    if speedups:
        lines += ["", "Speculative / plain total throughput: " + ", ".join(speedups)]
    return "\n".join(lines) + "\n"


def plot(results: list[RunResult], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method in dict.fromkeys(r.method for r in results):
        rs = sorted((r for r in results if r.method == method), key=lambda r: r.concurrency)
        xs = [r.concurrency for r in rs]
        axes[0].plot(xs, [r.tok_s_per_request for r in rs], marker="o", label=method)
        axes[1].plot(xs, [r.tok_s_total for r in rs], marker="o", label=method)
    for ax, title in zip(axes, ("tokens/s per request", "tokens/s total")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def device_name(device: str) -> str:
    d = torch.device(device)
    return torch.cuda.get_device_name(d) if d.type == "cuda" else "cpu"


# ---- modes ----
def bench(args, ckpt) -> int:
    dtype = pick_dtype(args.device, args.dtype)
    prompts = encode_prompts(ckpt, args.prompts)
    longest = max(len(p) for p in prompts) + args.max_new_tokens + args.steps + 2
    if longest > args.max_context:
        raise SystemExit(f"--max-context {args.max_context} is too small: prompts need up to {longest}")
    conc = sorted({int(c) for c in args.concurrency.split(",")})
    results: list[RunResult] = []
    if "hf" in args.methods:
        hf_prompts = prompts[: args.hf_prompts]
        results.append(run_hf(ckpt.path, torch.device(args.device), dtype, hf_prompts, args.max_new_tokens))
        print(f"hf-generate: {results[-1].tok_s_per_request:.1f} tok/s per request", flush=True)
    eng = build_engines(ckpt, args, dtype, max(conc))
    warm_up(eng, prompts, args.tree_size)
    for c in conc:
        ps = filled(prompts, c)
        if "plain" in args.methods:
            results.append(run_plain(eng.verifier, ps, args.max_new_tokens, c))
            print(
                f"plain c={c}: {results[-1].tok_s_per_request:.1f} tok/s/req, "
                f"{results[-1].tok_s_total:.1f} tok/s total",
                flush=True,
            )
        if "spec" in args.methods:
            results.append(run_spec(eng.verifier, eng.drafter, ps, args.max_new_tokens, c, args.tree_size))
            r = results[-1]
            print(
                f"speculative c={c}: {r.tok_s_per_request:.1f} tok/s/req, {r.tok_s_total:.1f} tok/s total, "
                f"accept {r.acceptance_length:.2f}{_device_drafting(r)}",
                flush=True,
            )
        if "closed" in args.methods:  # the services bench's closed loop, in process: requests as it counts them
            n = closed_loop_requests(len(prompts), args.requests_per_worker, c)
            closed = run_spec_closed(eng.verifier, eng.drafter, prompts, args.max_new_tokens, c, args.tree_size, n)
            results.append(closed)
            r = results[-1]
            print(
                f"speculative-closed c={c}: {r.tok_s_per_request:.1f} tok/s/req, {r.tok_s_total:.1f} tok/s total, "
                f"accept {r.acceptance_length:.2f}{_device_drafting(r)}",
                flush=True,
            )
    meta = {
        "device": args.device,
        "device_name": device_name(args.device),
        "dtype": dtype,
        "graphs": args.graphs,
        "verifier": type(eng.verifier).__name__,
        "drafter": type(eng.drafter).__name__,
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "head": args.head or "random",
        "drafting": asdict(eng.drafting),
        "torch": torch.__version__,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"meta": meta, "results": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results]}
    (out / "engine_bench.json").write_text(json.dumps(payload, indent=2))
    table = markdown(results, meta)
    (out / "engine_bench.md").write_text(table)
    print(table)
    if plot(results, out / "engine_bench.png"):
        print(f"plot: {out / 'engine_bench.png'}")
    return 0


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Token-position agreement and the mean index of the first divergence (len if none)."""
    same = [int(x == y) for ta, tb in zip(a, b) for x, y in zip(ta, tb)]
    first = [next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta)) for ta, tb in zip(a, b)]
    return {
        "token_agreement": float(np.mean(same)),
        "identical_sequences": sum(ta == tb for ta, tb in zip(a, b)),
        "mean_first_divergence": float(np.mean(first)),
    }


def check_equal(args, ckpt) -> int:
    """float32 greedy: speculative (batch 1 and batched, EAGLE head and greedy oracle) == plain, token for
    token (default 8 prompts x 64 tokens); with bfloat16 (the CUDA default) also its agreement rate."""
    from common.engine.oracle import GreedyOracleDrafter

    n_prompts, n_tokens = args.check_prompts, args.check_tokens
    prompts = encode_prompts(ckpt, n_prompts)
    report: dict = {"device": args.device, "graphs": args.graphs}
    ok = True
    dtypes = ["float32"] + (["bfloat16"] if pick_dtype(args.device, args.dtype) == "bfloat16" else [])
    for dtype in dtypes:
        eng = build_engines(ckpt, args, dtype, n_prompts)
        plain = run_plain(eng.verifier, prompts, n_tokens, 1).outputs
        oracle = GreedyOracleDrafter(eng.verifier.model, args.steps, torch.device(args.device))
        runs = {
            "eagle3 c=1": run_spec(eng.verifier, eng.drafter, prompts, n_tokens, 1, args.tree_size).outputs,
            f"eagle3 c={n_prompts}": run_spec(
                eng.verifier, eng.drafter, prompts, n_tokens, n_prompts, args.tree_size
            ).outputs,
            f"oracle c={n_prompts}": run_spec(
                eng.verifier, oracle, prompts, n_tokens, n_prompts, args.tree_size
            ).outputs,
        }
        report[dtype] = {name: agreement(plain, out) for name, out in runs.items()}
        for name in runs:
            stats = report[dtype][name]
            equal = stats["identical_sequences"] == n_prompts
            if dtype == "float32":
                ok &= equal
                print(
                    f"{dtype} {name}: {'EQUAL' if equal else 'DIFFERENT'} "
                    f"({stats['identical_sequences']}/{n_prompts} sequences, "
                    f"token agreement {stats['token_agreement']:.4f})"
                )
            else:
                print(
                    f"{dtype} {name}: token agreement {stats['token_agreement']:.4f}, "
                    f"{stats['identical_sequences']}/{n_prompts} identical, "
                    f"first divergence at {stats['mean_first_divergence']:.1f} on average"
                )
        del eng
    report["float32_equal"] = ok
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "check_equal.json").write_text(json.dumps(report, indent=2))
    print("float32 speculative == plain:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.engine_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="auto: bfloat16 on CUDA, float32 on CPU",
    )
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    p.add_argument("--head", default=None, help="EAGLE-3 head folder (default: a random head)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument(
        "--methods",
        default="hf,plain,spec",
        help="comma list of hf, plain, spec (waves), closed (speculative in a closed loop, as bench.services_bench)",
    )
    p.add_argument(
        "--requests-per-worker", type=int, default=2, help="closed: requests = max(prompts, this x concurrency)"
    )
    p.add_argument("--hf-prompts", type=int, default=3, help="prompts for the (slow) HF generate baseline")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tree-size", type=int, default=60)
    p.add_argument(
        "--graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="CUDA-graph engines on CUDA (--no-graphs: the eager ones)",
    )
    p.add_argument(
        "--check-equal",
        action="store_true",
        help="float32 greedy speculative == plain on 8 prompts x 64 tokens; bf16 agreement too",
    )
    p.add_argument("--check-prompts", type=int, default=8)
    p.add_argument("--check-tokens", type=int, default=64)
    p.add_argument("--out", default="bench_out")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    args.methods = {m.strip() for m in args.methods.split(",") if m.strip()}
    if not args.methods <= {"hf", "plain", "spec", "closed"}:
        p.error(f"unknown methods {sorted(args.methods - {'hf', 'plain', 'spec', 'closed'})}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from common.weights import load_checkpoint

    ckpt = load_checkpoint(args.model)
    return check_equal(args, ckpt) if args.check_equal else bench(args, ckpt)


if __name__ == "__main__":
    sys.exit(main())
