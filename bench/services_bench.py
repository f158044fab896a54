"""Speculative decoding through the three services over gRPC, with CUDA IPC and with inline bytes.

    python -m bench.services_bench --device cuda --prompts 16 --max-new-tokens 128 --concurrency 1,4,16 \
        --rounds-per-call 1,0

Starts verifier, draft and gateway on loopback (Stack; --colocate, default auto as the stack's: on a GPU the
draft in the verifier's process, else three processes; before session 21 the default was off), streams the same chat
prompts as bench.engine_bench through the gateway at each concurrency (a closed loop: `concurrency`
requests in flight, each new one sent when one finishes), and reads the round breakdown from the
gateway's Prometheus metrics, per round (a Verify of several rounds counts as its rounds). --rounds-per-call
runs one stack per value (the gateway's --rounds-per-call; 0 = its default), so one run shows a round
per Verify beside several; runs at a value other than 0 are named with a -k<value> suffix and leave plain
decoding out (plain rounds make no Verify). --queue-calls off,on runs each stack with the gateway sending one
Verify at a time and with each sent before the last is answered (named -queued). Figures use the
definitions of bench.engine_bench.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

import grpc

from bench.engine_bench import QUESTIONS, RequestTrace, RunResult, closed_loop_requests, summarize
from services.stack import Stack, colocated
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc

log = logging.getLogger("bench.services_bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request_for(text: str, max_new: int, mode: str = "spec") -> gpb.GenerateRequest:
    """mode: "spec" (the gateway's speculation policy), "plain", or "tree:DxN" (a pinned tree)."""
    req = gpb.GenerateRequest(
        messages=[gpb.ChatMessage(role="user", content=text)],
        max_tokens=max_new,
        ignore_eos=True,
        speculative=mode != "plain",
    )
    if mode.startswith("tree:"):
        req.tree.depth, req.tree.nodes = (int(x) for x in mode[5:].split("x"))
    return req


async def one_request(
    stub, text: str, max_new: int, t_start: float, mode: str = "spec"
) -> tuple[RequestTrace, gpb.GenerateResponse]:
    req = request_for(text, max_new, mode)
    tr = RequestTrace(arrival=t_start)
    last = None
    async for msg in stub.Generate(req):
        now = time.perf_counter()
        tr.tokens += list(msg.token_ids)
        tr.times += [now] * len(msg.token_ids)
        last = msg
    return tr, last


async def closed_loop(
    addr: str, prompts: list[str], max_new: int, concurrency: int, mode: str = "spec", until: float | None = None
):
    """`concurrency` workers each send one request at a time until the prompts are used up (or, with
    `until`, a time.perf_counter() deadline, passed: no request starts after it)."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = gpb_grpc.GenerationStub(ch)
        queue = list(prompts)
        traces, finals = [], []

        async def worker():
            while queue and (until is None or time.perf_counter() < until):
                text = queue.pop(0)
                tr, fin = await one_request(stub, text, max_new, time.perf_counter(), mode)
                traces.append(tr)
                finals.append(fin)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return traces, finals, time.perf_counter() - t0


def policy_choices(addr: str) -> dict[str, int]:
    """The gateway's group rounds per shape since it started (GetModelInfo), e.g. {"plain": 3, "6x60": 40}."""
    with grpc.insecure_channel(addr) as ch:
        info = gpb_grpc.GenerationStub(ch).GetModelInfo(gpb.ModelInfoRequest(), timeout=10)
    return {f"{c.tree.depth}x{c.tree.nodes}" if c.tree.depth else "plain": c.rounds for c in info.policy_choices}


def per_round(before: dict, after: dict) -> dict[str, float]:
    """Mean milliseconds per batched round of each phase between two scrapes."""
    out = {}
    for phase, (s1, n1) in after.items():
        s0, n0 = before.get(phase, (0.0, 0.0))
        if n1 > n0:
            out[phase] = 1000 * (s1 - s0) / (n1 - n0)
    return out


# the gateway's histograms read per round or per request: metric -> (its label, the prefix of our keys)
SCRAPED = {
    "specdec_round_seconds": ("phase", ""),
    "specdec_request_stage_seconds": ("stage", "stage:"),
    "specdec_prefill_call_seconds": ("part", "stage:prefill_"),
}


def scrape_rounds(metrics_port: int) -> dict[str, tuple[float, float]]:
    """(sum of seconds, count) of each round phase, from the gateway's specdec_round_seconds histogram, of
    each stage of a request's way into the rounds and each part of a Prefill call ("stage:NAME",
    "stage:prefill_PART"; SCRAPED), and under "verify_calls" (calls, 0): its specdec_verify_calls_total
    (with the rounds' count, the rounds a call ran on average)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    calls = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("specdec_verify_calls_total"):
            calls += float(value)
            continue
        metric, _, labels = name.partition("{")
        family = metric.removesuffix("_sum").removesuffix("_count")
        if family in SCRAPED and metric != family:
            label, prefix = SCRAPED[family]
            key = prefix + labels.split(f'{label}="')[1].split('"')[0]
            (sums if metric.endswith("_sum") else counts)[key] = float(value)
    return {p: (sums[p], counts.get(p, 0.0)) for p in sums} | {"verify_calls": (calls, 0.0)}


def engine_flags(args, max_sequences: int) -> tuple[list[str], list[str]]:
    """(the flags both engine services take, the draft's own) from the bench's arguments (device, dtype,
    max_context, top_k, steps, tree_size, head)."""
    common = ["--device", args.device, "--dtype", args.dtype, "--max-context", str(args.max_context)]
    common += ["--max-sequences", str(max_sequences)]
    draft = ["--top-k", str(args.top_k), "--steps", str(args.steps), "--verify-tree-size", str(args.tree_size)]
    return common, draft + (["--head", args.head] if args.head else [])


def run(args) -> list[RunResult]:
    prompts = [QUESTIONS[i % len(QUESTIONS)] for i in range(args.prompts)]
    results = []
    stacks = [(i, c, h) for i in args.ipc_modes for c in args.chain_modes for h in args.colocate_modes]
    runs = [
        (st, k, q, e, b)
        for st in stacks
        for k in args.rounds_per_call
        for q in args.queue_modes
        for e in args.early
        for b in args.between
    ]
    for n, ((ipc, chain, here), k, queue, early, between) in enumerate(runs, 1):
        mport = free_port()
        common, draft = engine_flags(args, max(args.concurrency))
        gw = (
            [
                "--metrics-port",
                str(mport),
                "--max-active",
                str(max(args.concurrency)),
                "--round-groups",
                str(args.round_groups),
                "--policy",
                args.policy,
                "--rounds-per-call",
                str(k),
                "--queue-calls",
                queue,
                "--early-answers",
                early,
            ]
            + ([] if ipc else ["--no-ipc"])
            + ([] if chain else ["--verifier-draft", "none"])
        )
        engines = ["--block-on-device"] if args.block_on_device else []  # the draft's and the verifier's flags
        engines += ["--cpu-affinity", args.engine_cpus] if args.engine_cpus else []
        verifier = engines + (["--prefill-between"] if between == "on" else ["--no-prefill-between"])
        logs = Path(args.out) / "logs" / f"stack-{n}"  # the services' logs, kept
        logs.mkdir(parents=True, exist_ok=True)
        stack_args = dict(
            common_args=common, draft_args=draft + engines, gateway_args=gw, verifier_args=verifier, log_dir=logs
        )
        with Stack(**stack_args, colocate=here) as stack:
            gw_log = (stack.log_dir / "gateway.log").read_text()
            mode = "ipc" if "CUDA IPC" in gw_log.split("hidden states between")[-1][:40] else "inline"
            mode = f"colocated-{mode}" if here else mode
            mode = f"blocking-{mode}" if args.block_on_device else mode
            mode = f"cpus{args.engine_cpus}-{mode}" if args.engine_cpus else mode
            asyncio.run(closed_loop(stack.gateway, prompts[:2], 16, 1))  # warm-up
            # plain makes no Verify: once, on the default rounds' first stack
            first = k == 0 and queue == args.queue_modes[0] and early == args.early[0] and between == args.between[0]
            modes = [m for m in args.spec_modes if m != "plain" or first]
            for c, m in [(c, m) for c in args.concurrency for m in modes]:
                n = closed_loop_requests(len(prompts), args.requests_per_worker, c)
                load = [prompts[i % len(prompts)] for i in range(n)]
                log.info("%s c=%d: load starts", mode, c)  # bench.gcprobe.summary's windows
                before, chosen = scrape_rounds(mport), policy_choices(stack.gateway)
                traces, finals, wall = asyncio.run(closed_loop(stack.gateway, load, args.max_new_tokens, c, m))
                speculative = m != "plain"
                rounds = sum(f.speculation.rounds for f in finals)
                after = scrape_rounds(mport)
                suffix = {"spec": "", "plain": "-plain"}.get(m, "-" + m.replace(":", "-"))
                suffix += "" if chain or m == "plain" else "-unchained"
                suffix += f"-k{k}" if k else ""
                suffix += "-queued" if queue == "on" and m != "plain" else ""
                suffix += "-early" if early == "on" and m != "plain" else ""
                suffix += "-beside" if between == "off" else ""
                r = summarize(f"services-{mode}{suffix}", c, traces, wall, rounds=rounds)
                accepted = sum(f.speculation.accepted_tokens for f in finals)  # tokens per round, bonus included
                r.acceptance_length = (accepted + rounds) / rounds if speculative and rounds else None
                phase = per_round(before, after)
                stages = {k.split(":")[1]: round(phase.pop(k), 2) for k in list(phase) if k.startswith("stage:")}
                calls = after["verify_calls"][0] - before["verify_calls"][0]
                verified = after.get("total", (0, 0))[1] - before.get("total", (0, 0))[1]  # rounds with a Verify
                r.draft_ms_per_round = phase.get("draft")
                r.verify_ms_per_round = phase.get("verify")
                r.rpc_ms_per_round = phase.get("rpc")
                r.draft_wait_ms_per_round = phase.get("draft_wait")
                r.host_ms_per_round = phase.get("orchestration")
                r.round_ms = phase.get("total")
                now = policy_choices(stack.gateway)
                chosen = {k: v - chosen.get(k, 0) for k, v in now.items() if v - chosen.get(k, 0)}
                log.info(
                    "%s c=%d: %.1f tok/s total, %.1f tok/s per request, acceptance %s, rounds per shape %s, "
                    "rounds per Verify %s, ms per round %s, ttft %.1f ms, first to next token %.1f ms, "
                    "ms per request stage %s",
                    r.method,
                    c,
                    r.tok_s_total,
                    r.tok_s_per_request,
                    r.acceptance_length,
                    chosen,
                    round(verified / calls, 2) if calls else None,
                    {k: round(v, 3) for k, v in phase.items()},
                    r.ttft_ms,
                    r.second_ms,
                    stages,
                )
                results.append(r)
    return results


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m bench.services_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--head", default=None)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tree-size", type=int, default=60)
    p.add_argument("--ipc", default="on,off", help="comma list: on (IPC when colocated), off (inline bytes)")
    p.add_argument("--round-groups", type=int, default=1, help="the gateway's --round-groups")
    p.add_argument("--block-on-device", action="store_true", help="the engine services' --block-on-device (see there)")
    p.add_argument("--engine-cpus", default="", help="the engine services' --cpu-affinity (see there)")
    p.add_argument(
        "--colocate",
        default="auto",
        help="comma list: off (draft and verifier in two processes), on (the draft in the verifier's process: "
        "python -m services.verifier --draft-here), auto (the stack's default: on with a CUDA device)",
    )
    p.add_argument(
        "--chain",
        default="on",
        help="comma list: on (the verifier sends each round's outcome to the draft: one gateway hop a round), "
        "off (the gateway's --verifier-draft none: it proposes every tree itself)",
    )
    p.add_argument(
        "--modes",
        default="spec",
        help="comma list: spec (speculative requests, the gateway's policy), plain, tree:DxN (a pinned tree)",
    )
    p.add_argument("--policy", default="adaptive", help="the gateway's --policy")
    p.add_argument(
        "--rounds-per-call",
        default="0",
        help="comma list of the gateway's --rounds-per-call, one stack each (0 = its default: 4 on a GPU, 1 on a "
        "CPU), e.g. 1,0 for one round per Verify beside the default",
    )
    p.add_argument(
        "--queue-calls",
        default="on",
        help="comma list of the gateway's --queue-calls, one stack each: on (a Verify sent before the last is "
        "answered; runs named -queued) or off (one call at a time), e.g. off,on for the A/B",
    )
    p.add_argument(
        "--early-answers",
        default="off",
        help="comma list of the gateway's --early-answers, one stack each: on (runs named -early) or off (the "
        "default: a finished sequence's last tokens wait for its Verify's last round), e.g. off,on for the A/B",
    )
    p.add_argument(
        "--prefill-between",
        default="on",
        help="comma list, one stack each: on (the verifier's default: Prefill between the rounds' calls on its "
        "event loop) or off (--no-prefill-between: beside them on its engine thread; runs named -beside)",
    )
    p.add_argument("--requests-per-worker", type=int, default=2, help="requests = max(prompts, this x concurrency)")
    p.add_argument("--out", default="bench_out")
    a = p.parse_args(argv)
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    a.ipc_modes = [m == "on" for m in a.ipc.split(",")]
    a.chain_modes = [m == "on" for m in a.chain.split(",")]
    try:
        a.colocate_modes = [colocated(m, a.device) for m in a.colocate.split(",")]
    except ValueError as e:
        p.error(str(e))
    a.spec_modes = a.modes.split(",")
    a.rounds_per_call = [int(k) for k in a.rounds_per_call.split(",")]
    a.queue_modes = a.queue_calls.split(",")
    if not set(a.queue_modes) <= {"on", "off"}:
        p.error(f"--queue-calls takes on and off, got {a.queue_calls!r}")
    a.between = a.prefill_between.split(",")
    if not set(a.between) <= {"on", "off"}:
        p.error(f"--prefill-between takes on and off, got {a.prefill_between!r}")
    a.early = a.early_answers.split(",")
    if not set(a.early) <= {"on", "off"}:
        p.error(f"--early-answers takes on and off, got {a.early_answers!r}")
    return a


def main(argv=None) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(argv)
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in results]
    (out / "services.json").write_text(json.dumps({"results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
