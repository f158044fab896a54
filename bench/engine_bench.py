"""The engine core in process: the rounds the verifier service runs, without the services around them.

    python -m bench.engine_bench --device cuda --out DIR [--concurrency 1,16,64] \\
        [--methods plain,policy,tree:6x60,tree:3x8] [--max-new-tokens 128] [--requests N] [--temperature 0.7]
        [--rounds-per-step 4] [--call-rounds 32] [--profile]

The engines and the core are built as `python -m services.verifier --draft-here` builds them (services/verifier/
__main__.py: build), the policy calibrated the same way. Each concurrency c runs each method in a closed loop: c
requests in flight, each finished one replaced by the next, N = max(48, 4c) requests in all, the held-out mixed
prompts (bench/prompts/heldout-mixed.jsonl) round-robin with the chat template, EOS stops. Methods: plain
(requests that do not speculate), policy (the default: the adaptive policy), tree:DxN (every request pins that
tree). The policy's state carries over from one run to the next, as a server's does. Per run it prints and
writes (DIR/engine_bench.json, .md): tokens/s in all and per request, rounds, mean acceptance length, the
rounds per shape the core ran, and the ratio to plain at that concurrency (measured in the same process).
--profile (CUDA) runs each (c, method) a second time under torch.profiler: the device's time a round or plain call
(the CUDA kernels' summed durations over the core's steps) against the unprofiled run's wall a step, which says how
much of a step the device is busy (the rest is host work it waits for), the host's launches a step (kernels launched
one by one, outside a CUDA graph, and graph replays) and the kernels that take the most.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from common.config import SamplingConfig
from common.engine.core_parts import PLAIN_PHASES, ROUND_PHASES
from common.policy import Shape
from common.sequence import Finish, Request

log = logging.getLogger("bench.engine_bench")
PROMPTS = Path(__file__).resolve().parent / "prompts" / "heldout-mixed.jsonl"
# the host's CUDA calls --profile counts: a kernel launched on its own (the runtime's, or Triton's through the
# driver) or a CUDA graph's replay
LAUNCHES = {
    "cudaLaunchKernel": "kernel",
    "cuLaunchKernel": "kernel",
    "cuLaunchKernelEx": "kernel",
    "cudaGraphLaunch": "graph",
}


@dataclass
class RunResult:
    method: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tok_s_total: float
    tok_s_per_request: float  # mean over requests of tokens / (finish - arrival)
    rounds: int  # verification rounds, summed over sequences
    acceptance_length: float | None  # tokens per verification round, the bonus included
    choices: dict  # the core's rounds per shape in this run
    # where a step's time went, ms: per round (choose, trees, joining, verify, commit) or plain call (plain,
    # plain_commit), and per step (setup: admission and prefill; retire: releases and outputs)
    phases: dict
    ratio_to_plain: float | None = None
    profile: dict | None = None  # --profile: device ms a step, its share of the wall a step, the top kernels


def prompts(tok) -> list[list[int]]:
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [tok.encode_chat([("user", r["prompt"])]) for r in rows]


def run(core, load: list[list[int]], method: str, c: int, n: int, max_new: int, sampling: SamplingConfig, eos: int):
    """One closed-loop run of n requests, c in flight."""
    tree = Shape.parse(method.split(":", 1)[1]) if method.startswith("tree:") else None
    before, times_before, calls_before = dict(core.choices), dict(core.times), dict(core.calls)
    started: dict[str, float] = {}
    tokens: dict[str, int] = {}
    per_request: list[float] = []
    rounds = accepted = 0
    sent = 0
    t0 = time.perf_counter()

    def send() -> None:
        nonlocal sent
        sid = f"{method}-{c}-{sent}"
        prompt, spec = load[sent % len(load)], method != "plain"
        core.add(Request(sid, prompt, sampling, max_new, frozenset({eos}), speculative=spec, tree=tree))
        started[sid], tokens[sid] = time.perf_counter(), 0
        sent += 1

    for _ in range(min(c, n)):
        send()
    while core.seqs or sent < n or core._inbox:
        for o in core.step():
            tokens[o.seq_id] += len(o.tokens)
            rounds += o.rounds
            accepted += o.accepted
            if o.finish is not Finish.NONE:
                per_request.append(tokens[o.seq_id] / (time.perf_counter() - started[o.seq_id]))
                if sent < n:
                    send()
    wall = time.perf_counter() - t0
    total = sum(tokens.values())
    choices = {str(s): k - before.get(s, 0) for s, k in core.choices.items() if k - before.get(s, 0)}
    spent = {k: v - times_before.get(k, 0) for k, v in core.times.items()}
    calls = {k: v - calls_before.get(k, 0) for k, v in core.calls.items()}
    phases = {}
    for count, names in (("rounds", ROUND_PHASES), ("plain_calls", PLAIN_PHASES)):
        for name in names:
            if calls.get(count):
                phases[name] = round(1e3 * spent.get(name, 0.0) / calls[count], 3)
    phases["steps"] = calls.get("rounds", 0) + calls.get("plain_calls", 0)
    for name in ("setup", "retire"):
        phases[name] = round(1e3 * spent.get(name, 0.0) / max(phases["steps"], 1), 3)
    return RunResult(
        method=method,
        concurrency=c,
        requests=n,
        tokens=total,
        wall_s=round(wall, 3),
        tok_s_total=round(total / wall, 1),
        tok_s_per_request=round(sum(per_request) / len(per_request), 1),
        rounds=rounds,
        acceptance_length=round((accepted + rounds) / rounds, 3) if rounds else None,
        choices=choices,
        phases=phases,
    )


def profiled(core, load: list[list[int]], r: RunResult, max_new: int, sampling: SamplingConfig, eos: int) -> dict:
    """r's run again under torch.profiler (the CUDA kernels and the host's CUDA calls): the device's ms a step (a
    round or a plain call: the kernels' summed durations over the core's steps), over r's unprofiled wall a step
    (the profiler slows the host, not the kernels), the host's kernel launches and graph replays a step, and the 8
    kernels that took the most."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        again = run(core, load, r.method, r.concurrency, r.requests, max_new, sampling, eos)
        torch.cuda.synchronize()
    kernels: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    # the host's launches: kernels one by one (the runtime's and Triton's), and graph replays
    launches: collections.Counter[str] = collections.Counter()
    for e in prof.events():
        if e.device_type.name == "CUDA":
            kernels[e.name[:80]] += e.time_range.elapsed_us()
            counts[e.name[:80]] += 1
        elif e.name in LAUNCHES:
            launches[LAUNCHES[e.name]] += 1
    steps = max(again.phases["steps"], 1)
    busy_ms = sum(kernels.values()) / 1e3
    device = busy_ms / steps
    wall = 1e3 * r.wall_s / max(r.phases["steps"], 1)
    top = [{"kernel": k, "ms": round(us / 1e3, 1), "launches": counts[k]} for k, us in kernels.most_common(8)]
    share = round(device / wall, 3)
    return {
        "device_ms_a_step": round(device, 3),
        "wall_ms_a_step": round(wall, 3),
        "device_share": share,
        "kernel_launches_a_step": round(launches["kernel"] / steps, 1),
        "graph_replays_a_step": round(launches["graph"] / steps, 1),
        "top_kernels": top,
    }


def profile_table(results: list[RunResult]) -> str:
    lines = [
        "| c | method | device ms a step | wall ms a step | device busy | kernel launches a step "
        "| graph replays a step | top kernels (ms in the profiled run) |",
        "|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        p = r.profile
        top = ", ".join(f"{k['kernel']} {k['ms']}" for k in p["top_kernels"][:4])
        lines.append(
            f"| {r.concurrency} | {r.method} | {p['device_ms_a_step']:.3f} | {p['wall_ms_a_step']:.3f} | "
            f"{p['device_share']:.0%} | {p['kernel_launches_a_step']} | {p['graph_replays_a_step']} | {top} |"
        )
    return "\n".join(lines) + "\n"


def table(results: list[RunResult]) -> str:
    lines = [
        "| c | method | requests | tokens | tok/s total | tok/s per request | x plain | acceptance | rounds by shape "
        "| ms per round or plain call |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        ratio = f"{r.ratio_to_plain:.2f}" if r.ratio_to_plain is not None else "-"
        acc = f"{r.acceptance_length:.2f}" if r.acceptance_length is not None else "-"
        shapes = ", ".join(f"{s} {k}" for s, k in sorted(r.choices.items()))
        phases = ", ".join(f"{k} {v:.2f}" for k, v in r.phases.items() if k != "steps" and v)
        lines.append(
            f"| {r.concurrency} | {r.method} | {r.requests} | {r.tokens} | {r.tok_s_total:.0f} | "
            f"{r.tok_s_per_request:.0f} | {ratio} | {acc} | {shapes} | {phases} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--methods", default="plain,policy,tree:6x60,tree:3x8")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=0, help="requests per run (0: max(48, 4 x concurrency))")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-context", type=int, default=1024)
    ap.add_argument("--rounds-per-step", type=int, default=None, help="the verifier's (default: its own)")
    ap.add_argument("--call-rounds", type=int, default=None, help="the verifier's (4: no call goes on)")
    ap.add_argument("--profile", action="store_true", help="each run again under torch.profiler (CUDA)")
    args = ap.parse_args()
    if args.profile and args.device == "cpu":
        ap.error("--profile times CUDA kernels: it needs --device cuda")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from common.model_path import default_model_path
    from common.tokenizer import Tokenizer
    from services.verifier.__main__ import VerifierServiceConfig, build

    concurrency = [int(x) for x in args.concurrency.split(",")]
    cfg = VerifierServiceConfig(
        device=args.device, draft_here=True, max_context=args.max_context, max_sequences=max(concurrency)
    )
    if args.rounds_per_step is not None:
        cfg = dataclasses.replace(cfg, rounds_per_step=args.rounds_per_step)
    if args.call_rounds is not None:
        cfg = dataclasses.replace(cfg, call_rounds=args.call_rounds)
    built = build(cfg)
    tok = Tokenizer(default_model_path())
    load = prompts(tok)
    sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p)
    methods = args.methods.split(",")
    # untimed: the first requests of each method pay one-time costs (allocator, kernels' first runs)
    for m in methods:
        run(built.core, load, m, 4, 8, 16, sampling, tok.eos_token_id)
    results = []
    for c in concurrency:
        n = args.requests or max(48, 4 * c)
        here = [run(built.core, load, m, c, n, args.max_new_tokens, sampling, tok.eos_token_id) for m in methods]
        for r in here if args.profile else []:
            r.profile = profiled(built.core, load, r, args.max_new_tokens, sampling, tok.eos_token_id)
        plain = next((r for r in here if r.method == "plain"), None)
        for r in here:
            r.ratio_to_plain = round(r.tok_s_total / plain.tok_s_total, 3) if plain else None
            log.info("c=%d %s: %.0f tok/s (x%s plain)", c, r.method, r.tok_s_total, r.ratio_to_plain)
        results += here
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine_bench.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
    md = table(results) + ("\n" + profile_table(results) if args.profile else "")
    (out / "engine_bench.md").write_text(md)
    sys.stdout.write(md)


if __name__ == "__main__":
    main()
