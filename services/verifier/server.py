"""The verifier service: the base model, its KV cache and the engine core (common/engine/core.py) that runs the
rounds with the drafter, on a thread of its own. Thin servicer, one error boundary, message conversion in this
file only.

A gateway opens one Generate stream: generations come in (NewGeneration, checked here: a bad one fails alone
with INVALID_ARGUMENT and never reaches the core), each engine step's news goes out in one columnar
GenerateOut per stream. When a stream ends, its generations are aborted: a gateway that goes away leaves
nothing held.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from dataclasses import dataclass, field

import grpc
import numpy as np

from common.engine.base import EngineInfo
from common.engine.core import EngineCore
from common.errors import InvalidRequest, PeerUnavailable
from common.policy import Shape
from common.rpc import describe, status_for
from common.sequence import Finish, Request, SeqOutput
from services.sampling import sampling_config
from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftLimits:
    """What the drafter drafts: the largest tree a request may pin."""

    name: str
    top_k: int
    steps: int
    verify_tree_size: int

    def check(self, shape: Shape, max_tree_nodes: int) -> None:
        """A pinned tree within what the drafter drafts and the verifier takes (InvalidRequest)."""
        k = self.top_k
        drafted = k + (shape.depth - 1) * k * k
        most = min(self.verify_tree_size, drafted, max_tree_nodes)
        if shape.depth > self.steps or shape.nodes > most:
            raise InvalidRequest(
                f"tree {shape} is beyond the draft's: depth at most {self.steps}, nodes at most {most} at depth "
                f"{shape.depth}"
            )


@dataclass(eq=False)
class _Stream:
    """One gateway's stream: its generations (seq id -> its number) and its outputs, step by step."""

    id: int
    seqs: dict[str, int] = field(default_factory=dict)
    # per step its list[SeqOutput], or a GenerateOut made already (a refusal); None: the end
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    closing: bool = False  # its sender is done: it ends once its generations have


def _ints(data: bytes, what: str) -> np.ndarray:
    if len(data) % 4:
        raise InvalidRequest(f"{what} is {len(data)} bytes, not whole int32s")
    return np.frombuffer(data, dtype="<i4")


def _estimate(e) -> gpb.PolicyEstimate:
    """common.policy.Estimate -> its message (None: the optional field unset)."""
    msg = gpb.PolicyEstimate(
        batch=e.batch,
        tree=gpb.TreeShape(depth=e.shape.depth, nodes=e.shape.nodes),
        tokens=e.tokens,
        samples=e.samples,
        band=e.band,
        source=e.source,
    )
    for name in ("tokens_per_s", "seconds", "stale_rounds"):
        if getattr(e, name) is not None:
            setattr(msg, name, getattr(e, name))
    return msg


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(
        self,
        core: EngineCore,
        info: EngineInfo,
        max_sequences: int,
        drafter: DraftLimits | None,
        policy_name: str,
    ) -> None:
        self.core, self.info, self.max_sequences = core, info, max_sequences
        self.drafter, self.policy_name = drafter, policy_name
        self.streams: dict[int, _Stream] = {}
        self.owner: dict[str, _Stream] = {}  # seq id -> its stream
        self.draining = False
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- the engine thread ----
    def start(self) -> None:
        """Run the core on its own thread; each step's outputs reach their streams on this event loop."""
        self._loop = asyncio.get_running_loop()
        self.core.publish = lambda outs: self._loop.call_soon_threadsafe(self._route, outs)  # a call going on
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            self.core.wait(0.5)
            try:
                outs = self.core.step()
            except Exception:  # noqa: BLE001 - a bug in a step: log it, fail what it held, keep serving
                log.exception("an engine step failed: its sequences fail")
                outs = self.core.fail_all(PeerUnavailable("the verifier's engine failed"))
            if outs:
                self._loop.call_soon_threadsafe(self._route, outs)

    def stop(self) -> None:
        self._stopping = True
        self.core.abort_all()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _route(self, outs: list[SeqOutput]) -> None:
        """A step's outputs to their streams (on the event loop)."""
        by_stream: dict[_Stream, list[SeqOutput]] = {}
        for o in outs:
            st = self.owner.get(o.seq_id)
            if st is None:
                continue
            by_stream.setdefault(st, []).append(o)
            if o.finish is not Finish.NONE:
                del self.owner[o.seq_id]
        for st, mine in by_stream.items():
            st.out.put_nowait(mine)

    # ---- RPCs ----
    async def Generate(self, request_iterator, context):
        st = _Stream(next(self._ids))
        self.streams[st.id] = st
        reader = asyncio.ensure_future(self._read(request_iterator, st))
        try:
            while True:
                outs = await st.out.get()
                if outs is None:
                    return
                yield outs if isinstance(outs, pb.GenerateOut) else self._pack(st, outs)
                if st.closing and not st.seqs:
                    return
        finally:
            reader.cancel()
            for seq_id in st.seqs:  # the gateway went away: its generations end with the stream
                self.core.abort(seq_id)
            del self.streams[st.id]

    async def _read(self, requests, st: _Stream) -> None:
        try:
            async for msg in requests:
                for add in msg.add:
                    self._add(st, add)
                for seq in msg.abort:
                    self.core.abort(f"{st.id}-{seq}")
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass
        finally:
            st.closing = True
            if not st.seqs:
                st.out.put_nowait(None)

    def _add(self, st: _Stream, add: pb.NewGeneration) -> None:
        seq_id = f"{st.id}-{add.seq}"
        if seq_id in st.seqs:
            self._refuse(st, add.seq, InvalidRequest(f"generation {add.seq} is already running on this stream"))
            return
        try:
            if self.draining:
                raise PeerUnavailable("the verifier is shutting down; retry on another replica")
            req = self._request(seq_id, add)
        except Exception as e:  # noqa: BLE001 - the boundary of one generation: it fails alone
            self._refuse(st, add.seq, e)
            return
        st.seqs[seq_id] = add.seq
        self.owner[seq_id] = st
        self.core.add(req)

    @staticmethod
    def _refuse(st: _Stream, seq: int, e: BaseException) -> None:
        """A generation that never reaches the core: its failure goes out on its own."""
        finish = np.array([int(Finish.ERROR)], dtype="<i4").tobytes()
        zero = np.zeros(1, dtype="<i4").tobytes()
        st.out.put_nowait(
            pb.GenerateOut(
                seq=np.array([seq], dtype="<i8").tobytes(),
                count=zero,
                finish=finish,
                rounds=zero,
                drafted=zero,
                accepted=zero,
                failed=[pb.Failure(seq=seq, code=status_for(e).value[0], message=describe(e))],
            )
        )

    def _request(self, seq_id: str, add: pb.NewGeneration) -> Request:
        """A NewGeneration, checked (InvalidRequest naming what is wrong)."""
        info = self.info
        prompt = _ints(add.prompt_ids, "prompt_ids")
        if not prompt.size:
            raise InvalidRequest("the prompt is empty")
        if prompt.size >= info.max_context:
            raise InvalidRequest(f"the prompt has {prompt.size} tokens; the context holds {info.max_context}")
        stops = _ints(add.stop_ids, "stop_ids")
        for what, ids in (("prompt", prompt), ("stop_ids", stops)):
            if ids.size and (ids.min() < 0 or ids.max() >= info.vocab_size):
                raise InvalidRequest(f"{what} has token ids outside the vocabulary [0, {info.vocab_size})")
        if add.max_new < 1:
            raise InvalidRequest(f"max_new must be >= 1, got {add.max_new}")
        tree = None
        if add.HasField("tree"):
            try:
                tree = Shape(add.tree.depth, add.tree.nodes)
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
            if tree.plain:
                tree = None
            elif self.drafter is None:
                raise InvalidRequest("this verifier has no draft: a tree cannot be pinned")
            else:
                self.drafter.check(tree, info.max_tree_nodes)
        return Request(
            seq_id=seq_id,
            prompt_ids=prompt.tolist(),
            sampling=sampling_config(add.sampling),
            max_new=add.max_new,
            stop_ids=frozenset(stops.tolist()),
            speculative=not add.plain,
            tree=tree,
        )

    def _pack(self, st: _Stream, outs: list[SeqOutput]) -> pb.GenerateOut:
        """A step's outputs of one stream, columnar (see GenerateOut); finished ones leave the stream."""
        n = len(outs)
        seq, count, fin, rounds, drafted, accepted = (np.empty(n, dtype=t) for t in ("<i8", *["<i4"] * 5))
        tokens: list[int] = []
        failed = []
        at = np.zeros(16, dtype="<i4")  # [P] rounds that accepted more than p tokens (p < 16)
        for i, o in enumerate(outs):
            number = st.seqs[o.seq_id] if o.finish is Finish.NONE else st.seqs.pop(o.seq_id)
            seq[i], count[i], fin[i] = number, len(o.tokens), int(o.finish)
            rounds[i], drafted[i], accepted[i] = o.rounds, o.drafted, o.accepted
            tokens += o.tokens
            if o.accepted_at:
                k = min(len(o.accepted_at), at.shape[0])
                at[:k] += o.accepted_at[:k]
            if o.finish is Finish.ERROR:
                failed.append(pb.Failure(seq=number, code=status_for(o.error).value[0], message=describe(o.error)))
        snap = self.core.snapshot()
        return pb.GenerateOut(
            seq=seq.tobytes(),
            count=count.tobytes(),
            tokens=np.asarray(tokens, dtype="<i4").tobytes(),
            finish=fin.tobytes(),
            rounds=rounds.tobytes(),
            drafted=drafted.tobytes(),
            accepted=accepted.tobytes(),
            failed=failed,
            running=snap.running,
            waiting=snap.waiting,
            accepted_at=at[: int(np.flatnonzero(at)[-1]) + 1].tobytes() if at.any() else b"",
        )

    async def Info(self, request, context):
        i, snap, d = self.info, self.core.snapshot(), self.drafter
        return pb.InfoResponse(
            model=i.model,
            vocab_size=i.vocab_size,
            max_context=i.max_context,
            max_sequences=self.max_sequences,
            max_tree_nodes=i.max_tree_nodes,
            dtype=i.dtype,
            device=i.device,
            running=snap.running,
            waiting=snap.waiting,
            draining=self.draining,
            drafter=d.name if d else "",
            drafting_top_k=d.top_k if d else 0,
            drafting_steps=d.steps if d else 0,
            verify_tree_size=d.verify_tree_size if d else 0,
            speculation_degraded=snap.degraded,
            speculation_policy=self.policy_name,
            policy_choices=[
                gpb.PolicyChoice(tree=gpb.TreeShape(depth=s.depth, nodes=s.nodes), rounds=n)
                for s, n in sorted(snap.choices.items())
            ],
            policy_estimates=[_estimate(e) for e in snap.estimates],
            engine_time=snap.times,
            engine_calls=snap.calls,
        )

    async def drain(self) -> None:
        """Refuse new generations; return once every running one has finished."""
        self.draining = True
        while self.owner:
            await asyncio.sleep(0.05)
