"""What a long prompt does to the requests already running: a closed loop of `concurrency` streaming
requests through the gateway, then one request with a long prompt (about --prompt-tokens tokens) joins;
the running requests' inter-token gaps while it is prefilled are compared with their gaps before it.

    python -m bench.prefill_stall --out DIR [--device cuda] [--concurrency 16] [--prompt-tokens 2000]
                                  [--prefill-chunk 0,512]

Each --prefill-chunk value is the gateway's (0 = the prompt in one call), on a stack of its own.

Figures (milliseconds, over the running streams' messages; a speculative round's tokens come in one
message): the median gap between a stream's messages in the two seconds before the long request is sent
("before"), and the mean and the largest gap overlapping the time from its sending to its answer
("during"). "ratio" = during mean / before median (the issue's target: at most 2).

Where the time went: the gateway's metrics (bench.services_bench.scrape_rounds) are read every
--scrape-ms from just before the long request is sent until every stream's gap around it is over. The JSON
row holds the largest gap's place (ms from the sending: `max_gap_at_ms`, start and end), the rounds'
phases in the window ("window_ms_per_round": mean ms per round of each phase, as the services bench's
breakdown; `window_rounds`), and `trace`: per scrape interval (ms from the sending), each metric whose
seconds grew there, with the growth (ms) and the count added. --colocate auto|on|off as the stack's (auto: the draft
in the verifier's process on a GPU; session 21's and earlier figures ran three processes, `--colocate off`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import time
from pathlib import Path

import grpc

from bench.engine_bench import QUESTIONS
from bench.services_bench import free_port, per_round, scrape_rounds
from services.stack import Stack, colocate_argument, colocated
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc

log = logging.getLogger("bench.prefill_stall")


async def scrapes(port: int, every_s: float, stop: asyncio.Event) -> list[tuple[float, dict]]:
    """(time, scrape_rounds) every every_s until stop is set (and once more then)."""
    out = []
    while True:
        out.append((time.perf_counter(), await asyncio.to_thread(scrape_rounds, port)))
        if stop.is_set():
            return out
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def trace(snaps: list[tuple[float, dict]], sent: float) -> list[dict]:
    """Per interval between scrapes: its start (ms from the sending) and each metric whose seconds grew,
    {key: [growth ms, count added]}."""
    rows = []
    for (t0, a), (_, b) in zip(snaps, snaps[1:]):
        grew = {}
        for key, (s1, n1) in b.items():
            s0, n0 = a.get(key, (0.0, 0.0))
            if key != "verify_calls" and s1 > s0:
                grew[key] = [round(1e3 * (s1 - s0), 2), n1 - n0]
        rows.append({"at_ms": round(1e3 * (t0 - sent), 1), "grew": grew})
    return rows


async def measure(
    addr: str, concurrency: int, prompt_tokens: int, speculative: bool, metrics_port: int, scrape_s: float
) -> dict:
    arrivals: list[list[float]] = [[] for _ in range(concurrency)]  # message arrival times per stream
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = gpb_grpc.GenerationStub(ch)

        async def running(i: int, text: str) -> None:
            req = gpb.GenerateRequest(
                messages=[gpb.ChatMessage(role="user", content=text)],
                max_tokens=4000,
                ignore_eos=True,
                speculative=speculative,
            )
            async for msg in stub.Generate(req):
                if msg.token_ids:
                    arrivals[i].append(time.perf_counter())

        tasks = [asyncio.create_task(running(i, QUESTIONS[i % len(QUESTIONS)])) for i in range(concurrency)]
        await asyncio.sleep(3.0)  # every stream past its prefill
        stop = asyncio.Event()
        scraping = asyncio.create_task(scrapes(metrics_port, scrape_s, stop))
        await asyncio.sleep(scrape_s)
        sent, sent_at = time.perf_counter(), time.strftime("%H:%M:%S")  # sent_at: to find it in the services' logs
        long_prompt = "Summarize the following text. " + "The quick brown fox jumps over the lazy dog. " * (
            prompt_tokens // 10
        )
        long_req = gpb.GenerateRequest(
            messages=[gpb.ChatMessage(role="user", content=long_prompt)], max_tokens=1, speculative=speculative
        )
        first = await stub.Complete(long_req)
        done = time.perf_counter()
        # a gap that overlaps the prefill ends with the stream's next message: wait for every stream's (a
        # CPU round can take longer than any fixed wait)
        deadline = done + 60
        while any(not t or t[-1] <= done for t in arrivals) and time.perf_counter() < deadline:
            await asyncio.sleep(0.02)
        stop.set()
        snaps = await scraping
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    pairs = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    gaps_before = [b - a for a, b in pairs if sent - 2.0 <= a and b < sent]
    gaps_during = [b - a for a, b in pairs if b >= sent and a <= done]
    if not gaps_before:  # every stream stalled for the two seconds before: no baseline
        log.warning("no stream sent two messages in the two seconds before the long request")
    before = statistics.median(gaps_before) * 1e3 if gaps_before else float("nan")
    during_mean = statistics.mean(gaps_during) * 1e3 if gaps_during else (done - sent) * 1e3
    during_max = max(gaps_during) * 1e3 if gaps_during else (done - sent) * 1e3
    widest = max(((b - a, a, b) for a, b in pairs if b >= sent and a <= done), default=(0.0, sent, done))
    at = next((i for i, (t, _) in enumerate(snaps) if t >= sent), len(snaps) - 1)
    base, last = snaps[max(at - 1, 0)][1], snaps[-1][1]  # the scrape before the sending, the final one
    window = per_round(base, last)
    return {
        "speculative": speculative,
        "sent_at": sent_at,
        "concurrency": concurrency,
        "prompt_tokens": first.usage.prompt_tokens,
        "prefill_wall_ms": (done - sent) * 1e3,
        "gap_before_median_ms": before,
        "gap_during_mean_ms": during_mean,
        "gap_during_max_ms": during_max,
        "ratio": during_mean / before,
        "max_gap_at_ms": [round(1e3 * (widest[1] - sent), 1), round(1e3 * (widest[2] - sent), 1)],
        "window_ms_per_round": {k: round(v, 3) for k, v in window.items()},
        "window_rounds": last.get("total", (0, 0))[1] - base.get("total", (0, 0))[1],
        "trace": trace(snaps, sent),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--prefill-chunk", default="0,512", help="comma list of the gateway's --prefill-chunk")
    colocate_argument(ap)  # the stack's default: the draft in the verifier's process on a GPU
    ap.add_argument("--scrape-ms", type=float, default=50.0, help="how often the gateway's metrics are read")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = []
    for chunk in [int(c) for c in args.prefill_chunk.split(",")]:
        common = ["--device", args.device, "--max-context", "4096"]
        port = free_port()
        gateway = ["--prefill-chunk", str(chunk), "--metrics-port", str(port)]
        here = colocated(args.colocate, args.device)
        with Stack(common_args=common, gateway_args=gateway, colocate=here) as stack:
            for speculative in (True, False):
                row = asyncio.run(
                    measure(
                        stack.gateway, args.concurrency, args.prompt_tokens, speculative, port, args.scrape_ms / 1e3
                    )
                )
                rows.append({"prefill_chunk": chunk, **row})
                log.info("%s", {k: v for k, v in row.items() if k != "trace"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_stall.json").write_text(json.dumps(rows, indent=1))
    lines = [
        f"# Long prompt under load ({args.device}, concurrency {args.concurrency})",
        "",
        "| prefill chunk | mode | prompt tokens | prefill wall ms | gap before ms (median) "
        "| gap during ms (mean / max) | ratio |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['prefill_chunk'] or 'whole'} | {'speculative' if r['speculative'] else 'plain'} "
            f"| {r['prompt_tokens']} "
            f"| {r['prefill_wall_ms']:.1f} | {r['gap_before_median_ms']:.2f} "
            f"| {r['gap_during_mean_ms']:.2f} / {r['gap_during_max_ms']:.2f} | {r['ratio']:.2f} |"
        )
    (out / "prefill_stall.md").write_text("\n".join(lines) + "\n")
    log.info("\n%s", "\n".join(lines))


if __name__ == "__main__":
    main()
