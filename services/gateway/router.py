"""The gateway's generations in flight: each goes to the verifier as a NewGeneration on the link's stream, and each
engine step's news (GenerateOut) comes back, is committed by the request's rules (services/gateway/sequence.py:
stop token ids and max_tokens again, stop strings, the text) and streamed to its client. A stop string ends a
generation here: the verifier is told to abort it.

When the verifier goes away (its stream breaks), a generation that has streamed tokens cannot be resumed: it
fails with UNAVAILABLE saying so; one that has produced nothing yet waits for the verifier to come back and is
sent again once (within its deadline, which its client's call enforces). Requests that arrive meanwhile wait the
same way. Health is NOT_SERVING while the verifier is down.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from common.errors import CapacityExhausted, InvalidRequest, PeerUnavailable, SpecdecError, UnknownSequence
from services.gateway.link import VerifierLink
from services.gateway.metrics import Metrics
from services.gateway.sequence import Delta, Finish, Generation
from services.sampling import sampling_msg
from specdec.v1 import internal_pb2 as pb

log = logging.getLogger(__name__)
RETRIES = 1  # times a generation that produced nothing is sent again after the verifier restarted
# the verifier's failure codes (google.rpc.Code) -> our exception types, which the error boundary maps back
_FAILURES = {3: InvalidRequest, 5: UnknownSequence, 8: CapacityExhausted, 14: PeerUnavailable}


@dataclass(eq=False)
class Flight:
    """A generation in flight."""

    seq: int  # its number on the verifier's stream
    gen: Generation
    out: asyncio.Queue  # Delta items, then None; or an exception
    started: float = field(default_factory=time.perf_counter)
    sent: bool = False  # on the current stream
    retries: int = 0
    first_token_at: float | None = None


def new_generation(seq: int, gen: Generation) -> pb.NewGeneration:
    req = gen.request
    msg = pb.NewGeneration(
        seq=seq,
        prompt_ids=np.asarray(req.prompt_ids, dtype="<i4").tobytes(),
        sampling=sampling_msg(req.sampling),
        max_new=req.max_tokens,
        stop_ids=np.asarray(sorted(gen.token_stops), dtype="<i4").tobytes(),
        plain=not req.speculative,
    )
    if req.tree is not None:
        msg.tree.depth, msg.tree.nodes = req.tree.depth, req.tree.nodes
    return msg


class Router:
    def __init__(self, address: str, max_in_flight: int, metrics: Metrics | None = None) -> None:
        self.metrics = metrics or Metrics()
        self.max_in_flight = max_in_flight  # generations at once (running and waiting on the verifier)
        self.flights: dict[int, Flight] = {}
        self.draining = False
        self.link = VerifierLink(address, self._news, self._up, self._down)
        self._ids = itertools.count()

    @property
    def serving(self) -> bool:
        return self.link.up and not self.draining

    async def generate(self, gen: Generation) -> AsyncIterator[Delta]:
        """Send a generation and yield its deltas; the last one carries the finish reason."""
        if self.draining:
            raise PeerUnavailable("the gateway is shutting down; retry on another replica")
        if len(self.flights) >= self.max_in_flight:
            raise CapacityExhausted(f"{len(self.flights)} requests are in flight already; try again later")
        f = Flight(next(self._ids), gen, asyncio.Queue())
        self.flights[f.seq] = f
        self.metrics.waiting.set(len(self.flights))
        f.sent = self.link.send(add=[new_generation(f.seq, gen)])
        try:
            while True:
                item = await f.out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self.flights.pop(f.seq, None) is not None and f.sent:  # cancelled, or past its deadline
                gen.abort()
                self.link.send(abort=[f.seq])

    def _news(self, out: pb.GenerateOut) -> None:
        """One engine step's news (the link's reader, on the event loop)."""
        seqs = np.frombuffer(out.seq, dtype="<i8").tolist()
        counts = np.frombuffer(out.count, dtype="<i4")
        tokens = np.frombuffer(out.tokens, dtype="<i4").tolist()
        finish = np.frombuffer(out.finish, dtype="<i4").tolist()
        rounds = np.frombuffer(out.rounds, dtype="<i4").tolist()
        drafted = np.frombuffer(out.drafted, dtype="<i4").tolist()
        accepted = np.frombuffer(out.accepted, dtype="<i4").tolist()
        ends = np.cumsum(counts).tolist()
        failed = {f.seq: f for f in out.failed}
        m = self.metrics
        m.running.set(out.running)
        m.waiting.set(out.waiting)
        m.generation_tokens.inc(len(tokens))
        if out.accepted_at:
            m.accepted_at(np.frombuffer(out.accepted_at, dtype="<i4").tolist())
        now = time.perf_counter()
        start = 0
        for i, seq in enumerate(seqs):
            end = ends[i]
            f = self.flights.get(seq)
            if f is None:  # aborted here already
                start = end
                continue
            gen = f.gen
            if rounds[i]:
                gen.stats.count(rounds[i], drafted[i], accepted[i])
                m.verified(rounds[i], drafted[i], accepted[i])
            if finish[i] == 5:
                why = failed.get(seq)
                code, message = (why.code, why.message) if why is not None else (13, "the verifier failed it")
                self._end(f, _FAILURES.get(code, SpecdecError)(message))
                start = end
                continue
            delta = gen.commit(tokens[start:end]) if end > start or finish[i] else None
            start = end
            if finish[i] and gen.finish is None:  # aborted (4), or its context is full (3): the verifier's end
                gen.finish = Finish.LENGTH if finish[i] == 3 else Finish.ABORT
                delta = Delta(delta.token_ids if delta else [], delta.text if delta else "", gen.finish)
            if delta is None:
                continue
            if f.first_token_at is None and delta.token_ids:
                f.first_token_at = now
                m.ttft.observe(now - f.started)
            if delta.token_ids or delta.text or delta.finish is not None:
                f.out.put_nowait(delta)
            if delta.finish is not None:
                self._finished(f, now)
                if not finish[i]:  # a stop string, found here: the verifier still runs it
                    self.link.send(abort=[seq])

    def _finished(self, f: Flight, now: float) -> None:
        self.flights.pop(f.seq, None)
        f.out.put_nowait(None)
        self.metrics.e2e.observe(now - f.started)
        n = len(f.gen.token_ids)
        if n > 1 and f.first_token_at is not None:
            self.metrics.itl.observe((now - f.first_token_at) / (n - 1))

    def _end(self, f: Flight, e: BaseException) -> None:
        self.flights.pop(f.seq, None)
        f.gen.abort()
        f.out.put_nowait(e)

    def _up(self, info: pb.InfoResponse) -> None:
        """The stream is open: send every generation not on it (new ones, and those waiting for a restart)."""
        waiting = [f for f in self.flights.values() if not f.sent]
        for f in waiting:
            f.sent = True
        if waiting:
            log.info("the verifier is back: sending %d waiting generation(s)", len(waiting))
            self.link.send(add=[new_generation(f.seq, f.gen) for f in waiting])

    def _down(self, why: str) -> None:
        """The stream broke: generations with tokens fail; the others wait for the verifier (once)."""
        failed = 0
        for f in list(self.flights.values()):
            if not f.sent:
                continue
            f.sent = False
            if f.gen.token_ids or f.retries >= RETRIES:
                failed += 1
                self._end(f, PeerUnavailable(f"the verifier restarted while this request was running ({why})"))
            else:
                f.retries += 1
        log.warning("verifier down (%s): %d generation(s) failed, %d wait", why, failed, len(self.flights))

    async def drain(self) -> None:
        """Admit nothing new; return once every generation in flight has finished."""
        self.draining = True
        while self.flights:
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """Generations still running fail with UNAVAILABLE (aborted on the verifier); the link closes."""
        left = list(self.flights.values())
        self.link.send(abort=[f.seq for f in left if f.sent])
        for f in left:
            self._end(f, PeerUnavailable("the gateway shut down before this request finished"))
        await asyncio.sleep(0)  # the aborts go out
        await self.link.close()
