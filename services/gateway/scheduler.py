"""Continuous batching of generations over the draft and verifier services.

One loop owns every active sequence. Each iteration admits waiting requests (prefill on the
verifier), then runs one round for all of them: propose, verify, commit, stream. Sequences join
after their prefill and leave when finished, between rounds, without stalling the others.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from common.errors import CapacityExhausted
from services.gateway.clients import DraftClient, VerifierClient
from services.gateway.metrics import Metrics
from services.gateway.sequence import Delta, Finish, Generation
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger(__name__)


@dataclass
class Active:
    seq_id: str
    gen: Generation
    out: asyncio.Queue  # Delta items, then None; or an exception
    next_propose: pb.ProposeItem | None = None  # the draft's input for the next round (speculative)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_active: int = 8     # sequences in the rounds at once (<= the services' slots)
    max_waiting: int = 64   # queued requests beyond that before RESOURCE_EXHAUSTED
    tree_size: int = 60     # nodes the draft proposes per sequence and round

    def __post_init__(self) -> None:
        if self.max_active < 1 or self.max_waiting < 0 or self.tree_size < 1:
            raise ValueError("max_active and tree_size must be >= 1, max_waiting >= 0")


class Scheduler:
    def __init__(self, verifier: VerifierClient, draft: DraftClient | None, cfg: SchedulerConfig,
                 metrics: Metrics | None = None) -> None:
        self.verifier, self.draft, self.cfg = verifier, draft, cfg
        self.metrics = metrics or Metrics()
        self.waiting: list[Active] = []
        self.active: list[Active] = []
        self._wake = asyncio.Event()
        self._ids = itertools.count()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def generate(self, gen: Generation) -> AsyncIterator[Delta]:
        """Queue a generation and yield its deltas; the last one carries the finish reason."""
        if len(self.waiting) >= self.cfg.max_waiting:
            raise CapacityExhausted(f"{len(self.waiting)} requests are already waiting; try again later")
        a = Active(seq_id=f"g{next(self._ids)}", gen=gen, out=asyncio.Queue())
        self.waiting.append(a)
        self._wake.set()
        try:
            while True:
                item = await a.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            gen.abort()  # no-op when finished; a cancelled client's sequence leaves at the next round

    # ---- the loop ----
    async def _loop(self) -> None:
        while True:
            if not self.active and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            await self._admit()
            if self.active:
                await self._guarded(self.active, self._round())

    async def _round(self) -> None:
        spec = [a for a in self.active if a.next_propose is not None]
        plain = [a for a in self.active if a.next_propose is None]
        if spec:
            t0 = time.perf_counter()
            proposed = await self.draft.propose([a.next_propose for a in spec])                   # propose
            t1 = time.perf_counter()
            verified = await self.verifier.verify([(a.seq_id, t) for a, t in zip(spec, proposed.results)])  # verify
            t2 = time.perf_counter()
            for a, tree, r in zip(spec, proposed.results, verified.results):
                self._count_round(a, len(tree.token_ids), len(r.tokens) - 1)
                a.next_propose = pb.ProposeItem(seq_id=a.seq_id, token_ids=r.tokens, hidden=r.hidden,
                                                max_nodes=self.cfg.tree_size)
                self._emit(a, a.gen.commit(r.tokens))                                          # commit, stream
            self._time_round(t0, t1, t2, proposed.compute_s, verified.compute_s)
        if plain:
            for a, t in zip(plain, await self.verifier.decode([a.seq_id for a in plain])):
                self._emit(a, a.gen.commit([t]))
        await self._retire()

    def _count_round(self, a: Active, drafted: int, accepted: int) -> None:
        a.gen.stats.rounds += 1
        a.gen.stats.drafted += drafted
        a.gen.stats.accepted += accepted
        self.metrics.drafts.inc()
        self.metrics.draft_tokens.inc(drafted)
        self.metrics.accepted(accepted)

    def _time_round(self, t0: float, t1: float, t2: float, draft_s: float, verify_s: float) -> None:
        """Round breakdown: engine time in each service, RPC (call wall minus engine time), and the
        gateway's own orchestration (commit, detokenize, stream)."""
        phase = self.metrics.round_phase
        phase["draft"].observe(draft_s)
        phase["verify"].observe(verify_s)
        phase["rpc"].observe(max((t1 - t0) - draft_s, 0) + max((t2 - t1) - verify_s, 0))
        t3 = time.perf_counter()
        phase["orchestration"].observe(t3 - t2)
        phase["total"].observe(t3 - t0)

    async def _admit(self) -> None:
        self.metrics.running.set(len(self.active))
        self.metrics.waiting.set(len(self.waiting))
        while self.waiting and len(self.active) < self.cfg.max_active:
            a = self.waiting.pop(0)
            if a.gen.finish is not None:  # cancelled while waiting
                continue
            await self._guarded([a], self._prefill(a))
        await self._retire()

    async def _prefill(self, a: Active) -> None:
        req = a.gen.request
        self.active.append(a)
        speculative = req.speculative and self.draft is not None
        self.metrics.prompt_tokens.inc(len(req.prompt_ids))
        pre = await self.verifier.prefill(a.seq_id, req.prompt_ids, req.sampling, want_hidden=speculative)
        if speculative:
            a.next_propose = pb.ProposeItem(seq_id=a.seq_id, token_ids=req.prompt_ids[1:] + [pre.next_token],
                                            hidden=pre.hidden, start=True, context_prefix=req.prompt_ids[:1],
                                            max_nodes=self.cfg.tree_size)
        self._emit(a, a.gen.commit([pre.next_token]))

    def _emit(self, a: Active, delta: Delta) -> None:
        now = time.perf_counter()
        m = self.metrics
        m.generation_tokens.inc(len(delta.token_ids))
        if a.first_token_at is None and delta.token_ids:
            a.first_token_at = now
            m.ttft.observe(now - a.started)
        if delta.token_ids or delta.text or delta.finish is not None:
            a.out.put_nowait(delta)
        if delta.finish is not None:
            a.out.put_nowait(None)
            m.e2e.observe(now - a.started)
            n = len(a.gen.token_ids)
            if n > 1 and a.first_token_at is not None:
                m.itl.observe((now - a.first_token_at) / (n - 1))

    async def _retire(self) -> None:
        done = [a for a in self.active if a.gen.finish is not None]
        if not done:
            return
        self.active = [a for a in self.active if a.gen.finish is None]
        await self._release(done)

    async def _release(self, done: list[Active]) -> None:
        ids = [a.seq_id for a in done]
        calls = [self.verifier.release(ids)]
        if self.draft is not None:
            calls.append(self.draft.release(ids))  # unknown ids are ignored there
        results = await asyncio.gather(*calls, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                log.warning("release of %s failed: %s", ids, r)

    async def _guarded(self, group: list[Active], work) -> None:
        """Run one step; if it fails, fail the requests it was for (others keep going)."""
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the step's requests get the error; the loop and other requests go on
            log.warning("step failed for %d sequence(s): %s", len(group), e)
            for a in group:
                if a.gen.finish is None:
                    a.gen.finish = Finish.ABORT
                    a.out.put_nowait(e)
            self.active = [a for a in self.active if a not in group]
            await self._release(group)
