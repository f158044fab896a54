"""Issue 8's headline ratio, the services against the engine in process, measured so that the host's drift
falls on both: the two take turns on one machine, window after window, in one run.

    python -m bench.split_ratio --device cuda --head models/eagle3-smollm2 --concurrency 1,16,64 \
        --reps 4 --requests-per-worker 8 --out DIR

Why: on the H100 VMs the host's speed drifts by 15-40% within minutes (session 19: in one
process, the engine's closed loop at concurrency 1 ran 1,185 tok/s per request right after 1,598 in waves on
the same workload), so a ratio of one services run to one engine run taken minutes apart says more about
the drift than about the split.

This process holds the engines (bench.engine_bench's closed loop: speculative_loop, a request replaced as
soon as one finishes, the prompts cycled) and drives the colocated services (services.stack.Stack with the
defaults, the draft in the verifier's process) through the gateway, closed loop too, with the same chat
prompts, 128 new tokens and the same pinned tree (tree:6x60 requests; the engine's --tree-size 60 at the
drafter's 6 steps). For each rep and concurrency, an engine window and a services window, the two orders
alternating from rep to rep (engine first in even reps). The engines sit idle during the services' windows
and the services during the engine's (their processes are up, serving nothing). Prints and writes
DIR/split_ratio.json: per concurrency, each window's tok/s per request, the means, the ratio of the means
and each rep's own ratio (its two windows side by side in time)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from statistics import mean

from bench.engine_bench import (
    QUESTIONS,
    build_engines,
    closed_loop_requests,
    encode_prompts,
    run_spec_closed,
    summarize,
    warm_up,
)
from bench.services_bench import closed_loop, engine_flags
from common.engine.factory import pick_dtype
from common.weights import load_checkpoint
from services.draft.__main__ import DEFAULT_HEAD
from services.stack import Stack

log = logging.getLogger("bench.split_ratio")


def stack_for(args, max_sequences: int) -> Stack:
    common, draft = engine_flags(args, max_sequences)
    gateway = ["--max-active", str(max_sequences)]
    return Stack(common_args=common, draft_args=draft, gateway_args=gateway, colocate=True)


def run(args) -> dict:
    conc = [int(c) for c in args.concurrency.split(",")]
    ckpt = load_checkpoint(args.model)
    dtype = pick_dtype(args.device, args.dtype)
    tokens = encode_prompts(ckpt, args.prompts)  # the chat prompts the gateway builds from the same questions
    texts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    eng = build_engines(ckpt, args, dtype, max(conc))
    mode = f"tree:{args.steps}x{args.tree_size}"
    windows: dict[int, dict[str, list[float]]] = {c: {"engine": [], "services": []} for c in conc}

    def engine(c: int) -> float:
        n = closed_loop_requests(args.prompts, args.requests_per_worker, c)
        r = run_spec_closed(eng.verifier, eng.drafter, tokens, args.max_new_tokens, c, args.tree_size, n)
        return r.tok_s_per_request

    def services(c: int, gateway: str) -> float:
        n = closed_loop_requests(args.prompts, args.requests_per_worker, c)
        load = [texts[i % len(texts)] for i in range(n)]
        traces, _, wall = asyncio.run(closed_loop(gateway, load, args.max_new_tokens, c, mode))
        return summarize("services", c, traces, wall).tok_s_per_request

    warm_up(eng, tokens, args.tree_size)
    with stack_for(args, max(conc)) as stack:
        asyncio.run(closed_loop(stack.gateway, texts[:2], 16, 1, mode))  # the services' warm-up (their streams)
        for rep in range(args.reps):
            for c in conc:
                order = ("engine", "services") if rep % 2 == 0 else ("services", "engine")
                for side in order:
                    tps = engine(c) if side == "engine" else services(c, stack.gateway)
                    windows[c][side].append(tps)
                    log.info("rep %d c=%d %s: %.1f tok/s per request", rep + 1, c, side, tps)
    report = {"reps": args.reps, "mode": mode, "concurrency": {}}
    for c, w in windows.items():
        e, s = mean(w["engine"]), mean(w["services"])
        report["concurrency"][str(c)] = {
            "engine": w["engine"],
            "services": w["services"],
            "engine_mean": e,
            "services_mean": s,
            "ratio_of_means": s / e,
            "rep_ratios": [b / a for a, b in zip(w["engine"], w["services"])],
        }
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.split_ratio", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--model", default=None, help="GGUF file or HF folder (default: the embedded SmolLM2)")
    p.add_argument(
        "--head", default=str(DEFAULT_HEAD), help="EAGLE-3 head folder, the services' draft's and the engine's"
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument("--reps", type=int, default=4, help="windows of each side per concurrency")
    p.add_argument("--requests-per-worker", type=int, default=8, help="requests = max(prompts, this x concurrency)")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tree-size", type=int, default=60)
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    a.graphs = a.device.startswith("cuda")  # build_engines: CUDA graphs on a GPU, as the services capture them
    if a.reps < 1:
        p.error("--reps must be >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    report = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "split_ratio.json").write_text(json.dumps(report, indent=2))
    for c, r in report["concurrency"].items():
        log.info(
            "c=%s: engine %.1f, services %.1f tok/s per request (means of %d windows): %.2fx; reps %s",
            c,
            r["engine_mean"],
            r["services_mean"],
            report["reps"],
            r["ratio_of_means"],
            ", ".join(f"{x:.2f}" for x in r["rep_ratios"]),
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
