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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from pathlib import Path

import grpc

from bench.engine_bench import QUESTIONS
from services.stack import Stack
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc

log = logging.getLogger("bench.prefill_stall")


async def measure(addr: str, concurrency: int, prompt_tokens: int, speculative: bool) -> dict:
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
        sent = time.perf_counter()
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
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    pairs = [(a, b) for times in arrivals for a, b in zip(times, times[1:])]
    gaps_before = [b - a for a, b in pairs if sent - 2.0 <= a and b < sent]
    gaps_during = [b - a for a, b in pairs if b >= sent and a <= done]
    before = statistics.median(gaps_before) * 1e3
    during_mean = statistics.mean(gaps_during) * 1e3 if gaps_during else (done - sent) * 1e3
    during_max = max(gaps_during) * 1e3 if gaps_during else (done - sent) * 1e3
    return {
        "speculative": speculative,
        "concurrency": concurrency,
        "prompt_tokens": first.usage.prompt_tokens,
        "prefill_wall_ms": (done - sent) * 1e3,
        "gap_before_median_ms": before,
        "gap_during_mean_ms": during_mean,
        "gap_during_max_ms": during_max,
        "ratio": during_mean / before,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--prefill-chunk", default="0,512", help="comma list of the gateway's --prefill-chunk")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    rows = []
    for chunk in [int(c) for c in args.prefill_chunk.split(",")]:
        common = ["--device", args.device, "--max-context", "4096"]
        with Stack(common_args=common, gateway_args=["--prefill-chunk", str(chunk)]) as stack:
            for speculative in (True, False):
                row = asyncio.run(measure(stack.gateway, args.concurrency, args.prompt_tokens, speculative))
                rows.append({"prefill_chunk": chunk, **row})
                log.info("%s", rows[-1])
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
