"""Per-call RPC overhead between the gateway and the internal services: unary vs stream.

    python -m bench.rpc_bench --n 500                       # starts the stack on CPU (services.stack.Stack)
    python -m bench.rpc_bench --n 500 --device cuda         # same, on the GPU
    python -m bench.rpc_bench --n 500 --verifier 127.0.0.1:50052 --draft 127.0.0.1:50053   # running services

Uses the gateway's own clients (services/clients.py) with tiny payloads, one call at a time
like the scheduler's rounds, alternating the unary and the streaming variant of each call:

  info            Verifier.Info, unary: a bare round trip (no engine thread)
  verify/*        Verifier.Verify of a one-node tree for one short sequence (Verify vs VerifyStream)
  verify-error/*  an empty VerifyRequest: the engine thread raises INVALID_ARGUMENT (the error path)
  propose/*       Draft.Propose of one new token for one sequence (Propose vs ProposeStream)

For each: mean / p50 / p99 of the call's wall time, and of the RPC overhead (wall minus the engine
time the service reports in compute_us), in microseconds. Sequences are restarted untimed before
they reach the context limit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

import grpc
import torch

from common.config import SamplingConfig
from common.rounds import start_shift
from common.tensors import encode_inline
from services.clients import DraftClient, RoundItem, VerifierClient
from services.tree_wire import draft_tree
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger("bench.rpc_bench")
PROMPT = [1, 9690, 314, 260, 2152, 30]
RESTART_EVERY = 100  # calls per sequence before it is restarted (each call adds 1-2 tokens)


def stats_us(xs: list[float]) -> tuple[float, float, float]:
    s = sorted(xs)
    p = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return statistics.fmean(s) * 1e6, p(0.5) * 1e6, p(0.99) * 1e6


class Bench:
    def __init__(self, v: VerifierClient, d: DraftClient, n: int, warmup: int) -> None:
        self.v, self.d, self.n, self.warmup = v, d, n, warmup
        self.wall: dict[str, list[float]] = {}
        self.overhead: dict[str, list[float]] = {}
        self.width = 0

    def record(self, name: str, wall: float, compute: float | None, i: int) -> None:
        if i < self.warmup:
            return
        self.wall.setdefault(name, []).append(wall)
        if compute is not None:
            self.overhead.setdefault(name, []).append(max(wall - compute, 0.0))

    async def timed(self, name: str, coro, i: int):
        t0 = time.perf_counter()
        r = await coro
        self.record(name, time.perf_counter() - t0, getattr(r, "compute_s", None), i)
        return r

    async def info(self) -> None:
        for i in range(self.warmup + self.n):
            await self.timed("info", self.v.info(), i)

    async def verify(self) -> None:
        one = draft_tree([5], [-1])
        ids = {True: "rb-vs", False: "rb-vu"}
        for i in range(self.warmup + self.n):
            for stream, sid in ids.items():
                if i % RESTART_EVERY == 0:
                    await self.v.release([sid])
                    await self.v.prefill(sid, PROMPT, SamplingConfig(), want_hidden=False)
                await self.timed(
                    f"verify/{'stream' if stream else 'unary'}", self.v.verify([RoundItem(sid, one)], stream=stream), i
                )
        await self.v.release(list(ids.values()))

    async def verify_error(self) -> None:
        empty = pb.VerifyRequest()
        calls = {
            "stream": lambda: self.v._verify(empty),
            "unary": lambda: self.v.stub.Verify(empty, timeout=self.v.timeout),
        }
        for i in range(self.warmup + self.n):
            for name, call in calls.items():
                t0 = time.perf_counter()
                try:
                    await call()
                    raise RuntimeError("an empty VerifyRequest was accepted")
                except grpc.aio.AioRpcError as e:
                    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, e
                self.record(f"verify-error/{name}", time.perf_counter() - t0, None, i)

    async def propose(self) -> None:
        pre = await self.v.prefill("rb-p", PROMPT, SamplingConfig(), want_hidden=True)
        await self.v.release(["rb-p"])
        width = pre.hidden.shape[1]
        hidden = pb.TensorRef()
        encode_inline(torch.zeros(1, width), hidden)
        ids = {True: "rb-ps", False: "rb-pu"}
        for i in range(self.warmup + self.n):
            for stream, sid in ids.items():
                if i % RESTART_EVERY == 0:
                    await self.d.release([sid])
                    token_ids, prefix = start_shift(PROMPT, pre.next_token)
                    first = pb.ProposeItem(
                        seq_id=sid,
                        token_ids=token_ids,
                        hidden=pre.hidden,
                        start=True,
                        context_prefix=prefix,
                        max_nodes=8,
                    )
                    await self.d.propose([first], stream=stream)
                item = pb.ProposeItem(seq_id=sid, token_ids=[5], hidden=hidden, max_nodes=8)
                await self.timed(f"propose/{'stream' if stream else 'unary'}", self.d.propose([item], stream=stream), i)
        await self.d.release(list(ids.values()))

    def report(self) -> None:
        cols = f"{'mean':>10}{'p50':>9}{'p99':>9}"
        print(f"{'':<26}  {'wall (us)':>28}  {'rpc overhead (us)':>28}")
        print(f"{'call':<20}{'n':>6}  {cols}  {cols}")
        for name, xs in self.wall.items():
            w = stats_us(xs)
            o = stats_us(self.overhead[name]) if name in self.overhead else None
            ov = f"{o[0]:>10.0f}{o[1]:>9.0f}{o[2]:>9.0f}" if o else f"{'-':>10}{'-':>9}{'-':>9}"
            print(f"{name:<20}{len(xs):>6}  {w[0]:>10.0f}{w[1]:>9.0f}{w[2]:>9.0f}  {ov}")


async def run(verifier: str, draft: str, n: int, warmup: int) -> None:
    v, d = VerifierClient(verifier), DraftClient(draft)
    try:
        b = Bench(v, d, n, warmup)
        await b.info()
        await b.verify()
        await b.verify_error()
        await b.propose()
        b.report()
    finally:
        await v.close()
        await d.close()


def main() -> None:
    p = argparse.ArgumentParser(
        prog="python -m bench.rpc_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=500, help="timed calls per variant")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--verifier", help="address of a running verifier (else a stack is started)")
    p.add_argument("--draft", help="address of a running draft service")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if a.verifier and a.draft:
        asyncio.run(run(a.verifier, a.draft, a.n, a.warmup))
        return
    from services.stack import Stack

    stack = Stack(
        common_args=["--device", a.device, "--dtype", a.dtype, "--max-context", "512", "--max-sequences", "4"]
    )
    log.info("starting verifier, draft and gateway on %s ...", a.device)
    stack.start()
    try:
        asyncio.run(run(f"127.0.0.1:{stack.ports['verifier']}", f"127.0.0.1:{stack.ports['draft']}", a.n, a.warmup))
    finally:
        stack.stop()


if __name__ == "__main__":
    main()
