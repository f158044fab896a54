"""The gateway's view of the draft and verifier services: batched calls over grpc.aio channels.
Trees and tensors pass through as messages: the gateway never decodes a TensorRef, so an IPC
reference reaches the draft exactly as the verifier wrote it.

The two per-round calls (Draft.Propose, Verifier.Verify) travel on one long-lived bidirectional
stream each (ProposeStream, VerifyStream): a stream round trip costs a fraction of a unary call's
set-up. Each call writes one request and gets exactly one response, in the order written (calls may
overlap: StreamedCall); a call that failed on the service comes back as a response carrying `error`,
raised here as the AioRpcError the unary call would have raised, and the stream stays open. A timeout or
a transport failure drops the stream and the next call opens a new one."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from common.config import SamplingConfig
from common.errors import PeerUnavailable
from common.rounds import start_shift
from common.rpc import CHANNEL_OPTIONS
from services.packed import unpack_ints
from services.sampling import sampling_msg
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Prefilled:
    next_token: int
    hidden: pb.TensorRef  # [prompt_len, 3H]
    engine_s: float = 0.0  # the call's engine time (every result of a call has the call's figures)
    verifier_s: float = 0.0  # the call at the verifier, from taking it up to its answer
    chained: bool = False  # its first tree was asked for (PrefillItem.next_nodes): it waits at the verifier


def prefill_item(
    seq_id: str,
    token_ids: list[int],
    sampling: SamplingConfig,
    want_hidden: bool,
    more: bool = False,
    first_tree: tuple[int, int] | None = None,
) -> pb.PrefillItem:
    """first_tree: (depth, nodes) of the first tree for the verifier to ask the draft for (PrefillItem.next_nodes)."""
    depth, nodes = first_tree or (0, 0)
    return pb.PrefillItem(
        seq_id=seq_id,
        token_ids=token_ids,
        sampling=sampling_msg(sampling),
        want_hidden=want_hidden,
        more=more,
        next_nodes=nodes,
        next_depth=depth,
    )


def start_item(
    seq_id: str,
    prompt_ids: list[int],
    first_token: int,
    hidden: pb.TensorRef | None,
    sampling: pb.SamplingParams,
    first_tree: tuple[int, int] | None = None,
) -> pb.ProposeItem:
    """A sequence's first ProposeItem (start): the prompt's tokens and its first token paired with the prompt's
    features (hidden [prompt_len, 3H]; None: the caller writes them) by common.rounds.start_shift;
    first_tree: (depth, nodes) of its tree (None: the call's)."""
    token_ids, prefix = start_shift(prompt_ids, first_token)
    depth, nodes = first_tree or (0, 0)
    msg = pb.ProposeItem(
        seq_id=seq_id,
        token_ids=token_ids,
        start=True,
        context_prefix=prefix,
        sampling=sampling,
        max_nodes=nodes,
        max_depth=depth,
    )
    if hidden is not None:
        msg.hidden.CopyFrom(hidden)
    return msg


@dataclass(frozen=True)
class Verified:
    """One sequence's outcome of a Verify of one round or several (see VerifyResult)."""

    tokens: list[int]  # [committed] every round's accepted tokens and bonus token; empty on a round-1 draft_error
    hidden: pb.TensorRef  # [num_accepted + 1, 3H] of a single round; unset when chained or after several
    nodes: int = 0  # nodes of the trees verified, all rounds
    chained: bool = False  # the draft has the outcome and its next tree waits at the verifier
    draft_error: str = ""  # a chained tree that never came: that round not verified, the draft lost the sequence
    accepted: list[int] = field(default_factory=list)  # [rounds run] drafted tokens accepted in each round
    round_nodes: list[int] = field(default_factory=list)  # [rounds run] nodes of each round's tree


def _verified(r: pb.VerifyResult) -> Verified:
    return Verified(
        tokens=list(r.accepted_tokens),
        hidden=r.hidden,
        nodes=r.tree_nodes,
        chained=r.chained,
        draft_error=r.draft_error,
        accepted=unpack_ints(r.round_accepted, "round_accepted"),
        round_nodes=unpack_ints(r.round_nodes, "round_nodes"),
    )


@dataclass(frozen=True)
class RoundItem:
    """One sequence of a Verify (see VerifyItem): its tree, or None when the verifier holds it (chained);
    `next` the tree (depth, nodes) to ask the draft for right after, or None. For a call of several rounds:
    `max_new` tokens it may still commit and its end-of-sequence and stop token ids."""

    seq_id: str
    tree: pb.DraftTree | None
    next: tuple[int, int] | None = None
    max_new: int = 0
    stop_ids: bytes = b""  # int32 [num_stop_ids] packed (services/packed.py)
    follows: bool = False  # sent before the answer of the call before, which named it too (VerifyItem.follows)


@dataclass(frozen=True)
class VerifiedRound:
    """A Verify's results (in item order), its engine time, and the chained trees' draft calls: engine
    time, largest batch, and how long the verifier waited for them."""

    results: list[Verified]
    compute_s: float  # all rounds
    draft_s: float = 0.0  # all rounds
    draft_batch: int = 0
    wait_s: float = 0.0  # all rounds
    rounds: int = 1  # rounds the call ran
    wall_s: float = 0.0  # the verifier's time in the call (all rounds)
    idle_s: float = 0.0  # how long the verifier had nothing to do before it (VerifyStream)


@dataclass(frozen=True)
class Batched:
    """Per-sequence results of one batched call, and the engine time the service reported."""

    results: list
    compute_s: float


def _method_name(method) -> str:
    return method._method.decode() if hasattr(method, "_method") else "peer"


def _peer_error(e: grpc.aio.AioRpcError, name: str) -> Exception:
    """What a failed call raises: PeerUnavailable when the service could not answer, else the error."""
    if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return PeerUnavailable(f"{name.lstrip('/')} unavailable: {e.details()}")
    return e


async def _call(method, request, timeout: float):
    try:
        return await method(request, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        err = _peer_error(e, _method_name(method))
        if err is e:
            raise
        raise err from e


_CODES = {c.value[0]: c for c in grpc.StatusCode}


class StreamedCall:
    """A unary-shaped batched call carried on one long-lived bidirectional stream: each call writes one
    request and gets exactly one response, the service answering a stream's requests in order. Calls may
    overlap: a second call's request goes out while the first is still answered (the gateway queues the
    next Verify at the verifier that way, services/gateway/scheduler.py), and one reader pairs responses
    with the calls in the order they were written. A caller that is cancelled or gives up leaves its place
    in that order, and its late answer is dropped when it comes, so it can never reach another call. A
    timeout (the service does not answer), a transport failure or the end of the stream fails every call
    waiting on it and drops the stream; the next call opens a new one. A service without the streaming
    method (UNIMPLEMENTED) gets the unary method from then on. A call may take early answers (a response
    marked `early`, VerifyRequest.early): each goes to the call's `early` callback as it comes, and the call's
    own response, which follows them, ends it; a callback that raises fails its call (not the stream)."""

    def __init__(self, stream_method, unary_method, timeout: float) -> None:
        self._open, self._unary, self.timeout = stream_method, unary_method, timeout
        self._name = _method_name(stream_method)
        self._label = self._name.lstrip("/")  # in errors
        self._stream: grpc.aio.StreamStreamCall | None = None
        # the stream's calls, in order: (the future of its answer, its early answers' callback or None)
        self._waiting: collections.deque[tuple[asyncio.Future, Callable | None]] = collections.deque()
        self._reader: asyncio.Task | None = None
        self._write = asyncio.Lock()  # one request written at a time: the order of the writes is the order
        self.streaming = True  # False once the service said UNIMPLEMENTED

    async def __call__(self, request, early: Callable | None = None):
        """The call's response; early(response) for each early answer before it (on the stream only)."""
        if not self.streaming:
            return await _call(self._unary, request, self.timeout)
        try:
            async with asyncio.timeout(self.timeout):
                answer = await self._send(request, early)
                resp = await asyncio.shield(answer)  # a cancelled caller leaves the answer to the reader
        except TimeoutError as e:
            err = PeerUnavailable(f"{self._label}: no answer within {self.timeout:g} s")
            self._fail_all(err)  # the service is stuck: the calls behind this one wait in vain too
            raise err from e
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older service: go unary
                self.streaming = False
                return await _call(self._unary, request, self.timeout)
            err = _peer_error(e, self._name)
            if err is not e:
                raise err from e
            raise
        if resp.HasField("error"):
            raise _peer_error(
                grpc.aio.AioRpcError(
                    _CODES.get(resp.error.code, grpc.StatusCode.UNKNOWN),
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details=resp.error.message,
                ),
                self._name,
            )
        return resp

    async def _send(self, request, early: Callable | None) -> asyncio.Future:
        """Write the request on the stream (opened on first use, or after a failure) and return the future
        its answer will resolve: its place in the stream's order."""
        async with self._write:
            if self._stream is None or self._stream.done():  # first call, or the service ended it
                if self._stream is not None:  # calls still waiting on it are lost with it
                    self._fail_all(PeerUnavailable(f"{self._label}: the service ended the stream"))
                self._stream = self._open()
                self._reader = asyncio.get_running_loop().create_task(self._read(self._stream))
            answer = asyncio.get_running_loop().create_future()
            self._waiting.append((answer, early))
            try:
                await self._stream.write(request)
            except BaseException as e:
                self._fail_all(e if isinstance(e, grpc.aio.AioRpcError) else PeerUnavailable(f"{self._label}: {e!r}"))
                raise
            return answer

    async def _read(self, stream: grpc.aio.StreamStreamCall) -> None:
        """Each response to the oldest call waiting (one whose caller left drops it); an early answer to
        that call's callback, the call still waiting."""
        try:
            while True:
                resp = await stream.read()
                if resp is grpc.aio.EOF:
                    raise PeerUnavailable(f"{self._label}: the service ended the stream")
                if not self._waiting:  # an answer nobody asked for: the pairing is lost
                    raise PeerUnavailable(f"{self._label}: an answer with no call waiting")
                answer, early = self._waiting[0]
                if early is not None and resp.early:  # only a call that asked for early answers gets them
                    if not answer.done():
                        try:
                            early(resp)
                        except Exception as e:  # noqa: BLE001 - the caller's failure is its call's, not the stream's
                            answer.set_exception(e)
                    continue
                self._waiting.popleft()
                if not answer.done():
                    answer.set_result(resp)
        except asyncio.CancelledError:
            raise  # dropped by _fail_all, which failed the calls waiting first
        except BaseException as e:  # noqa: BLE001 - every waiting call gets the stream's failure
            if stream is self._stream:
                self._fail_all(e)

    def _fail_all(self, e: BaseException) -> None:
        """Every call waiting on the stream fails with e; the stream is dropped (the next call opens one)."""
        waiting, self._waiting = self._waiting, collections.deque()
        for answer, _ in waiting:
            if not answer.done():
                answer.set_exception(e)
                answer.exception()  # a caller that left never reads it: seen here
        self._drop()

    def _drop(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None

    def close(self) -> None:
        self._fail_all(PeerUnavailable(f"{self._label}: the client was closed"))


class _ServiceClient:
    """What the gateway's clients of both services share: the channel, Info, Release and the lease."""

    service = "peer"

    def __init__(self, address: str, timeout: float, stub_class, stream_method: str, unary_method: str) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.timeout = timeout
        self.stub = stub_class(self.channel)
        # the per-round call, on its long-lived stream
        self.streamed = StreamedCall(getattr(self.stub, stream_method), getattr(self.stub, unary_method), timeout)

    async def info(self, timeout: float | None = None):
        return await _call(self.stub.Info, pb.InfoRequest(), timeout or self.timeout)

    async def release(self, seq_ids: list[str]) -> None:
        await _call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), self.timeout)

    async def lease(self, instance_id: str, name: str, takeover: bool) -> pb.LeaseResponse:
        return await _call(
            self.stub.Lease, pb.LeaseRequest(instance_id=instance_id, name=name, takeover=takeover), self.timeout
        )

    def reachable(self) -> bool:
        """Whether a call now has a connection to go on (asks the channel to connect if idle); never waits."""
        state = self.channel.get_state(try_to_connect=True)
        return state in (grpc.ChannelConnectivity.READY, grpc.ChannelConnectivity.IDLE)

    async def close(self) -> None:
        self.streamed.close()
        await self.channel.close()


class VerifierClient(_ServiceClient):
    """Verify calls go on one stream per lane (the gateway's round groups): the verifier answers a stream's
    calls one after the other and different streams' side by side, so that one group's call does not wait
    for all of another's rounds."""

    service = "verifier"

    def __init__(self, address: str, timeout: float = 120.0) -> None:
        super().__init__(address, timeout, pb_grpc.VerifierStub, "VerifyStream", "Verify")
        self._lanes: dict[int, StreamedCall] = {}  # lanes after the first (`streamed`), made on first use

    def lane(self, i: int) -> StreamedCall:
        if i == 0:
            return self.streamed
        if i not in self._lanes:
            self._lanes[i] = StreamedCall(self.stub.VerifyStream, self.stub.Verify, self.timeout)
        return self._lanes[i]

    async def close(self) -> None:
        for lane in self._lanes.values():
            lane.close()
        await super().close()

    @property
    def _verify(self) -> StreamedCall:  # the name bench/rpc_bench.py uses
        return self.streamed

    async def prefill(
        self,
        seq_id: str,
        token_ids: list[int],
        sampling: SamplingConfig,
        want_hidden: bool,
        owner: str = "",
        more: bool = False,
    ) -> Prefilled:
        """One prompt, or its next chunk (more: chunks follow; then the result carries nothing)."""
        item = prefill_item(seq_id, token_ids, sampling, want_hidden, more)
        return (await self.prefill_many([item], owner))[0]

    async def prefill_many(self, items: list[pb.PrefillItem], owner: str = "", draft: str = "") -> list[Prefilled]:
        """Several prompts or chunks in one call, all or nothing (see Verifier.Prefill); draft: the draft's
        address as the verifier reaches it (items with next_nodes)."""
        req = pb.PrefillRequest(items=items, owner=owner, draft=draft)
        resp = await _call(self.stub.Prefill, req, self.timeout)
        engine_s, verifier_s = resp.compute_us / 1e6, resp.wall_us / 1e6
        return [Prefilled(r.next_token, r.hidden, engine_s, verifier_s, r.chained) for r in resp.results]

    async def verify(
        self,
        items: list[RoundItem],
        draft: str = "",
        owner: str = "",
        stream: bool = True,
        rounds: int = 1,
        cut: bool = False,
        lane: int = 0,
        early: Callable[[list[tuple[str, Verified]]], None] | None = None,
    ) -> VerifiedRound:
        """draft: the draft's address as the verifier reaches it (for items with `next`); rounds: at most
        this many rounds in the call (VerifyRequest.rounds); cut: the call before it on the stream stops
        after its current round (VerifyRequest.cut); lane: the stream it goes on (a round group's); early:
        takes each early answer's (seq id, result) pairs while the call runs (VerifyRequest.early; the
        results come again in the call's own answer)."""
        early = early if stream and rounds > 1 else None
        req = pb.VerifyRequest(
            draft=draft, owner=owner, rounds=rounds if rounds > 1 else 0, cut=cut, early=early is not None
        )
        add = req.items.add
        for it in items:  # one copy of each tree (a VerifyItem list would copy twice)
            depth, nodes = it.next or (0, 0)
            rules = {"max_new": it.max_new, "stop_ids": it.stop_ids}  # read with rounds > 1 or follows
            if it.tree is None:
                add(seq_id=it.seq_id, chained=True, next_depth=depth, next_nodes=nodes, follows=it.follows, **rules)
            else:
                add(seq_id=it.seq_id, tree=it.tree, next_depth=depth, next_nodes=nodes, **rules)
        if early is None:
            said = None
        else:

            def said(resp: pb.VerifyResponse) -> None:
                early([(r.seq_id, _verified(r)) for r in resp.results])

        resp = await (self.lane(lane)(req, said) if stream else _call(self.stub.Verify, req, self.timeout))
        results = [_verified(r) for r in resp.results]
        return VerifiedRound(
            results,
            resp.compute_us / 1e6,
            resp.draft_compute_us / 1e6,
            resp.draft_batch,
            resp.draft_wait_us / 1e6,
            max(resp.rounds_run, 1),
            resp.wall_us / 1e6,
            resp.idle_us / 1e6,
        )

    async def decode(
        self, seq_ids: list[str], steps: int = 1, follow: dict[str, int] | None = None
    ) -> pb.DecodeResponse:
        """Plain decoding: up to `steps` tokens per sequence in one call (every sequence gets as many).
        follow: {seq id: rows already pending in its hidden region} for sequences whose features the
        draft needs (DecodeItem.want_hidden)."""
        follow = follow or {}
        req = pb.DecodeRequest(steps=steps)
        for s in seq_ids:
            req.items.add(seq_id=s, want_hidden=s in follow, hidden_row=follow.get(s, 0))
        return await _call(self.stub.Decode, req, self.timeout)

    async def features(self, items: list[tuple[str, list[int]]]) -> list[pb.TensorRef]:
        """(seq id, tokens in its KV cache) -> hidden [num_cached, 3H] for each, recomputed."""
        req = pb.FeaturesRequest(items=[pb.FeaturesItem(seq_id=s, token_ids=t) for s, t in items])
        return [r.hidden for r in (await _call(self.stub.Features, req, self.timeout)).results]

    async def export_hidden(self, enable: bool) -> pb.IpcBuffer:
        return await _call(self.stub.ExportHidden, pb.ExportRequest(enable=enable), self.timeout)


class DraftClient(_ServiceClient):
    service = "draft"

    def __init__(self, address: str, timeout: float = 120.0) -> None:
        super().__init__(address, timeout, pb_grpc.DraftStub, "ProposeStream", "Propose")

    async def propose(self, items: list[pb.ProposeItem], stream: bool = True, owner: str = "") -> Batched:
        req = pb.ProposeRequest(items=items, owner=owner)
        resp = await (self.streamed(req) if stream else _call(self.stub.Propose, req, self.timeout))
        return Batched([r.tree for r in resp.results], resp.compute_us / 1e6)

    async def import_buffer(self, buf: pb.IpcBuffer) -> None:
        await _call(self.stub.ImportBuffer, buf, self.timeout)


async def connect_ipc(
    verifier: VerifierClient, draft: DraftClient, vinfo: pb.InfoResponse, dinfo: pb.DraftInfoResponse
) -> bool:
    """Connection set-up: when draft and verifier share a host and a GPU, the verifier exports its
    hidden-state buffer once and the draft maps it. Returns whether hidden states now travel by IPC."""
    if not (vinfo.gpu_uuid and vinfo.host_id == dinfo.host_id and vinfo.gpu_uuid == dinfo.gpu_uuid):
        return False
    buf = await verifier.export_hidden(True)
    try:
        await draft.import_buffer(buf)
    except Exception:
        await verifier.export_hidden(False)  # back to inline bytes
        raise
    return True
