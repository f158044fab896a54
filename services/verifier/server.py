"""The verifier service: owns the base model and its KV cache. Thin servicer, one error boundary,
message conversion in this file only. It also sends each chained sequence's verified outcome to the draft
and, when a Verify asks for several rounds, runs them one after the other with the draft's next trees
(the round protocol, services/verifier/chain.py; its bookkeeping, services/verifier/rounds.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import time
import uuid
from typing import TYPE_CHECKING

import torch

from common.config import SamplingConfig
from common.engine.base import (
    LaunchAfter,
    PrefillInput,
    PrefillOutput,
    ProposeAfter,
    ProposeInput,
    Steps,
    VerifierEngine,
    VerifyInput,
)
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence
from common.ipc import HiddenExport, gpu_uuid
from common.slots import check_unique
from common.tensors import encode_inline, encode_ipc
from common.tree import Tree
from services.clients import DraftClient, start_item
from services.draft.follow import Follow
from services.engine_runner import EngineRunner
from services.leasing import SequenceLeases
from services.sampling import sampling_config
from services.tree_wire import trees_of
from services.verifier.chain import DraftChain
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from collections.abc import Callable

    from services.draft.server import DraftServicer

log = logging.getLogger(__name__)
MAX_DECODE_STEPS = 64  # per Decode call: bounds one call's time and the tokens wasted past a stop
# a Prefill call of more prompt tokens than this runs on the engine thread even with prefill_between: on the
# event loop it would hold the rounds (and everything else the process answers) for its whole pass. The
# gateway's chunks (--prefill-chunk, 512 by default) keep its calls within it
PREFILL_BETWEEN_TOKENS = 512


class VerifierServicer(pb_grpc.VerifierServicer):
    """`engine` has one slot more than `max_sequences`: the spare one recomputes a sequence's features
    for a draft that catches up (Features), so that never waits for capacity."""

    def __init__(
        self,
        engine: VerifierEngine,
        hidden_width: int,
        max_sequences: int,
        lease_ttl: float,
        draft_timeout: float = 10.0,
        draft_here: DraftServicer | None = None,  # this process's draft (--draft-here): chained proposals call it
        poll: bool = True,  # per-round engine calls give the event loop back while the device works (EngineRunner)
        prefill_between: bool = True,  # a GPU's Prefill runs on the event loop between the rounds' calls
    ) -> None:
        if not 1 <= max_sequences < engine.info.max_sequences:
            raise ValueError(
                f"max_sequences must be in [1, {engine.info.max_sequences}) (one engine slot is "
                f"the spare for Features), got {max_sequences}"
            )
        self.engine, self.hidden_width, self.max_sequences = engine, hidden_width, max_sequences
        self.device = torch.device(engine.info.device)
        self.gpu_uuid = gpu_uuid(self.device)
        self.export: HiddenExport | None = None  # set once the draft has mapped our buffer
        # per-round calls on the event loop on a GPU, giving it back while the device works (poll), and on
        # the engine thread on CPU, where a call takes long enough to hold up lease renewals and health checks
        # (services/engine_runner.py)
        self.runner = EngineRunner("verifier", inline=self.device.type == "cuda", poll=poll)
        # Prefill between the rounds' calls on the event loop (EngineRunner.between: no thread contending with
        # the rounds' inline calls for the interpreter lock and the GPU; session 18, H100: faster rounds and
        # prefills at c=1, 16 and 64), or beside them on the engine thread (prefill_between False)
        self.prefill_between_tokens = PREFILL_BETWEEN_TOKENS if prefill_between else 0  # larger: engine thread
        self.leases = SequenceLeases(lease_ttl, self._release_ids, self.runner)
        # the next trees of chained sequences (a propose not answered within draft_timeout fails its items)
        self.hand_over = False  # the draft is here (colocate)
        self._draft_here: DraftServicer | None = None
        self.chain = DraftChain(lambda address: DraftClient(address, timeout=draft_timeout))
        if draft_here is not None:
            self.colocate(draft_here)
        self._spare_id = f"~features-{uuid.uuid4().hex}"  # no client can name it
        # sequences whose prompt is partly prefilled (more chunks due) -> (the prompt's tokens so far, the
        # hidden states of its chunks so far when it wants them), whole with the last chunk
        self._chunks: dict[str, tuple[list[int], list[torch.Tensor]]] = {}
        # the engine's step times, measured once before serving, for the gateway's speculation policy
        self.step_costs = [
            pb.StepCost(kind=c.kind, batch=c.batch, size=c.size, seconds=c.seconds) for c in engine.step_costs()
        ]

    def colocate(self, draft: DraftServicer) -> None:
        """Chained proposals go to this process's draft, whatever address a Verify names: outcomes handed
        over as its engine's inputs (or its trees launched behind the verify on the device), its trees
        verified as they come (services/verifier/chain.py)."""
        from services.draft.here import LocalDraftClient

        self.hand_over = True
        self._draft_here = draft
        self.chain = DraftChain(lambda address: LocalDraftClient(draft))

    async def Prefill(self, request, context):
        return await self.runner.unary(context, self._admit_prefill, request)

    async def Verify(self, request, context):
        return await self.runner.unary(context, self._touched_verify, request)

    async def VerifyStream(self, request_iterator, context):
        """One response per request, in order; the stream outlives failed calls (answers_in_order)."""

        def answer(request: pb.VerifyRequest, cut: asyncio.Event, early: Callable[[pb.VerifyResponse], None]):
            verify = functools.partial(self._touched_verify, cut=cut, early=early)
            return self.runner.answer(verify, request, pb.VerifyResponse)

        async for response in answers_in_order(request_iterator, answer):
            yield response

    async def Decode(self, request, context):
        return await self.runner.unary(context, self._touched_decode, request)

    async def Release(self, request, context):
        return await self.runner.unary(context, self._release_owned, request)

    async def ExportHidden(self, request, context):
        return await self.runner.unary(context, self._export_hidden, request)

    async def Lease(self, request, context):
        return await self.runner.unary(context, self.leases.lease, request)

    async def Features(self, request, context):
        return await self.runner.unary(context, self._held_features, request)

    async def Info(self, request, context):
        i = self.engine.info
        return pb.InfoResponse(
            model=i.model,
            vocab_size=i.vocab_size,
            max_context=i.max_context,
            max_sequences=self.max_sequences,
            max_tree_nodes=i.max_tree_nodes,
            dtype=i.dtype,
            device=i.device,
            host_id=socket.gethostname(),
            gpu_uuid=self.gpu_uuid,
            active_sequences=len(self.leases.table),
            draining=self.leases.draining,
            step_costs=self.step_costs,
        )

    # ---- ownership (on the event loop), then the engine call (on the engine thread) ----
    async def _admit_prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """New sequences are admitted (capacity, draining); chunks that continue one are not new. Items
        with next_nodes: their first proposes go to the draft when the call is over (DraftChain.send), and
        their trees wait here for the sequences' first Verify, as after a round."""
        t0 = time.perf_counter()
        ids = [it.seq_id for it in request.items]
        check_unique(ids)
        self.chain.check_prefill(request)
        new = [s for s in ids if s not in self._chunks]
        self.leases.admit(len(new))
        held = len(self.leases.table)
        if held + len(new) > self.max_sequences:
            raise CapacityExhausted(
                f"{held} of {self.max_sequences} sequence slots are in use; {len(new)} more do not fit"
            )
        continued = [s for s in ids if s in self._chunks]
        self.leases.touch(continued)
        try:
            tokens = sum(len(it.token_ids) for it in request.items)
            runs = self.runner.between if tokens <= self.prefill_between_tokens else self.runner.run
            resp, first = await runs(self._prefill, request)
        except BaseException:
            self.leases.removed(continued)  # the failed call freed them (see _prefill)
            raise
        self.leases.added(new, request.owner)
        self.chain.send(request.draft, request.owner, first)
        resp.wall_us = int((time.perf_counter() - t0) * 1e6)
        return resp

    async def _touched_verify(
        self,
        request: pb.VerifyRequest,
        cut: asyncio.Event | None = None,
        early: Callable[[pb.VerifyResponse], None] | None = None,
    ) -> pb.VerifyResponse:
        """The chained items' trees from the draft (waiting for what is not done yet), the verify, then the
        outcome of every item with next_nodes to the draft for its next tree; round after round when the
        request asks for several (see chain.py). On a stream, `cut` and `early` (answers_in_order)."""
        t0 = time.perf_counter()
        ids = [it.seq_id for it in request.items]
        self._check_chain(request, ids)
        self.leases.touch(ids)
        gone = self._gone(request)
        resp = await self.chain.verify(request, self._run_verify, self.engine.room, gone, cut, early)
        resp.wall_us = int((time.perf_counter() - t0) * 1e6)
        return resp

    def _gone(self, request: pb.VerifyRequest) -> frozenset[str]:
        """Items that follow a call which stopped their sequence, already released by its gateway (it
        releases a sequence the call's rules stopped without waiting for the queued call): answered with
        nothing, like any item whose call before stopped it."""
        owner_of = self.leases.table.owner_of
        return frozenset(it.seq_id for it in request.items if it.follows and owner_of(it.seq_id) is None)

    async def _run_verify(
        self, request: pb.VerifyRequest, failed: dict[str, str], chained: dict[str, object]
    ) -> tuple[pb.VerifyResponse, dict[str, ProposeInput | Follow]]:
        return await self.runner.steps(self._verify, request, failed, chained)

    def _check_chain(self, request: pb.VerifyRequest, ids: list[str]) -> None:
        """Known, distinct sequences (ids: the items' ids) and well-formed protocol fields, checked before
        anything runs."""
        if not ids:
            raise InvalidRequest("verify request has no items")
        check_unique(ids)
        self._check_held([it.seq_id for it in request.items if not it.follows])  # see _gone
        self.chain.check(request)

    def _check_held(self, ids: list[str]) -> None:
        owner_of = self.leases.table.owner_of
        for s in ids:
            if owner_of(s) is None:
                raise UnknownSequence(f"unknown sequence id {s!r}")

    async def _touched_decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        ids = [it.seq_id for it in request.items]
        self.leases.touch(ids)
        await self.chain.settle(ids)
        return await self.runner.steps(self._decode, request)

    async def _release_owned(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        ids = list(request.seq_ids)
        await self.chain.settle(ids)  # the draft answers for them before anyone frees its copies
        n = await self.runner.between(self._release_ids, ids)
        self.leases.removed(ids)
        return pb.ReleaseResponse(released=n)

    async def _held_features(self, request: pb.FeaturesRequest) -> pb.FeaturesResponse:
        if not request.items:
            raise InvalidRequest("features request has no items")
        ids = [it.seq_id for it in request.items]
        self._check_held(ids)
        await self.chain.settle(ids)
        return await self.runner.run(self._features, request)

    # ---- conversion + engine calls (run on the engine thread) ----
    def _published(self) -> None:
        """Wait once for a call's copies into the exported buffer (see common/ipc.py, rule 1)."""
        if self.export is not None:
            self.export.wait()

    def _hidden(self, seq_id: str, hidden: torch.Tensor, msg: pb.TensorRef, row: int = 0) -> None:
        """Hidden states out: a reference into the exported buffer when the draft mapped it (written from
        row `row` of the sequence's region on), else bytes."""
        self._hiddens([seq_id], hidden, [hidden.shape[0]], [msg], [row])

    def _hiddens(
        self,
        seq_ids: list[str],
        hidden: torch.Tensor,
        counts: list[int],
        msgs: list[pb.TensorRef],
        rows: list[int] | None = None,
    ) -> None:
        """_hidden of several distinct sequences with one copy: hidden [sum(counts), 3H] holds their rows one
        sequence after the other (counts[i] of them into msgs[i]); all go into the exported buffer at once,
        or to the host at once for bytes (one synchronisation)."""
        if not seq_ids:
            return
        if self.export is None:
            for h, msg in zip(hidden.cpu().split_with_sizes(counts), msgs):
                encode_inline(h, msg)
            return
        buffer_id = self.export.exported.buffer_id
        placed = self.export.write_many(seq_ids, hidden, counts, rows)
        for h, msg, (offset, writes) in zip(hidden.split_with_sizes(counts), msgs, placed):
            encode_ipc(h, msg, buffer_id, offset, writes)

    def _export_hidden(self, request: pb.ExportRequest) -> pb.IpcBuffer:
        if not request.enable:
            self.export = None
            return pb.IpcBuffer()
        if self.device.type != "cuda":
            raise InvalidRequest("CUDA IPC needs the verifier on a CUDA device")
        if self.export is None:
            i = self.engine.info
            self.export = HiddenExport(
                i.max_sequences, i.max_context, self.hidden_width, self._engine_dtype(), self.device
            )
        e = self.export.exported
        return pb.IpcBuffer(buffer_id=e.buffer_id, handle=e.handle, offset_bytes=e.offset_bytes, nbytes=e.nbytes)

    def _engine_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.engine.info.dtype]

    def _release_ids(self, ids: list[str]) -> int:
        self.chain.forget(ids)
        for s in ids:
            self._chunks.pop(s, None)
        if self.export is not None:
            for s in ids:
                self.export.release(s)
        return self.engine.release(ids)

    def _prefill(self, request: pb.PrefillRequest) -> tuple[pb.PrefillResponse, list]:
        """Every item in one engine call (prompts of similar length share a forward). All or nothing: a
        failed call frees every sequence it created or continued (the engine's rule), and nothing else.
        Returns the response and the first proposes of the items with next_nodes (_start_item), whose
        results carry no hidden states."""
        if not request.items:
            raise InvalidRequest("prefill request has no items")
        inputs = [
            PrefillInput(
                seq_id=it.seq_id, token_ids=list(it.token_ids), sampling=sampling_config(it.sampling), more=it.more
            )
            for it in request.items
        ]
        t0 = time.perf_counter()
        try:
            outs = self.engine.prefill_batch(inputs)
        except BaseException:
            for it in request.items:
                self._chunks.pop(it.seq_id, None)
            raise
        resp = pb.PrefillResponse(compute_us=int((time.perf_counter() - t0) * 1e6))
        first: list = []  # ProposeInput (the draft here) or pb.ProposeItem, in item order
        try:
            for it, inp, out in zip(request.items, inputs, outs):
                prompt, chunks = self._chunks.pop(it.seq_id, ([], []))
                prompt += inp.token_ids
                if it.want_hidden:
                    chunks.append(out.hidden)
                if it.more:
                    self._chunks[it.seq_id] = (prompt, chunks)
                    resp.results.add(seq_id=it.seq_id)
                    continue
                r = resp.results.add(seq_id=it.seq_id, next_token=out.next_token, chained=it.next_nodes > 0)
                if not it.want_hidden:
                    continue
                hidden = torch.cat(chunks) if len(chunks) > 1 else chunks[0]  # [prompt_len, 3H]
                if r.chained:
                    first.append(self._start_item(it, inp, prompt, hidden, out.next_token))
                else:
                    self._hidden(it.seq_id, hidden, r.hidden)
        except BaseException:
            self._release_ids([it.seq_id for it in request.items])  # all ours: the engine call succeeded
            raise
        self._published()
        return resp, first

    def _start_item(
        self, it: pb.PrefillItem, inp: PrefillInput, prompt: list[int], hidden: torch.Tensor, first_token: int
    ) -> ProposeInput | pb.ProposeItem:
        """The draft's first propose of a prefilled prompt (PrefillItem.next_nodes): prompt [prompt_len] all
        its tokens, hidden [prompt_len, 3H] their features, paired by common.rounds.start_shift. The drafter's
        own input with the draft here (the engine's rows, not copied), else a ProposeItem whose features are
        written for the draft as a round's are."""
        if self.hand_over:
            prefilled = PrefillOutput(first_token, hidden)
            return ProposeInput.after_prefill(it.seq_id, prompt, prefilled, it.next_nodes, inp.sampling, it.next_depth)
        msg = start_item(it.seq_id, prompt, first_token, None, it.sampling, (it.next_depth, it.next_nodes))
        self._hidden(it.seq_id, hidden, msg.hidden)
        return msg

    def _features(self, request: pb.FeaturesRequest) -> pb.FeaturesResponse:
        """Each sequence's tokens prefilled in the spare slot, which is released again at once; the
        next token it picks is ignored (the sequence's own state is untouched)."""
        resp = pb.FeaturesResponse()
        for it in request.items:
            try:
                out = self.engine.prefill(
                    PrefillInput(seq_id=self._spare_id, token_ids=list(it.token_ids), sampling=SamplingConfig())
                )
            finally:
                self.engine.release([self._spare_id])
            self._hidden(it.seq_id, out.hidden, resp.results.add(seq_id=it.seq_id).hidden)
        self._published()
        return resp

    def _verify(
        self, request: pb.VerifyRequest, failed: dict[str, str], chained: dict[str, object]
    ) -> Steps[tuple[pb.VerifyResponse, dict[str, ProposeInput | Follow]]]:
        """Every item but the `failed` ones (chained trees that never came: answered with draft_error), each
        with its tree in `chained` (seq id -> a message from a draft service, or the engine tree of the draft
        here, verified as it is) or else its own. With the draft here, the outcome of each item that asks
        for a next tree is handed over and its result carries no hidden states: the draft gets them, or the
        item stopped (a sequence whose commit does not stop it, if there were one, would catch up: the
        gateway's propose of it fails for want of features). Handed over as a Follow when every verified
        item asks for a next tree and the draft launched them behind the verification on the device (the
        device chain: the draft's `launch_after`, called by the engine once the verify is launched), else as
        the drafter's input ({seq id: ProposeInput}, its features the engine's rows, not copied)."""
        info = self.engine.info
        items = request.items
        ids = [it.seq_id for it in items]
        todo = [i for i, s in enumerate(ids) if s not in failed]  # the items verified
        given = [chained.get(ids[i]) for i in todo]  # [len(todo)] None: the item's own tree
        wire = [j for j, t in enumerate(given) if not isinstance(t, Tree)]  # trees to read and check
        msgs = [given[j] if given[j] is not None else items[todo[j]].tree for j in wire]
        trees = given
        for j, t in zip(wire, trees_of(msgs, info.max_tree_nodes, info.vocab_size)):
            trees[j] = t
        if any(t.size == 0 or t.size > info.max_tree_nodes for t in trees):
            raise InvalidRequest(f"a tree has no nodes or more than {info.max_tree_nodes}")
        t0 = time.perf_counter()
        outs = []
        launch = None  # the draft's launch behind the verification (the device chain)
        if self.hand_over and todo and all(items[i].next_nodes > 0 for i in todo):
            after = [ProposeAfter(ids[i], items[i].next_nodes, items[i].next_depth) for i in todo]
            launch = LaunchAfter(self._draft_here, after)
        if todo:
            outs = yield from self.engine.verify_steps([VerifyInput(ids[i], t) for i, t in zip(todo, trees)], launch)
        # the engine call's wall: with the loop polling (EngineRunner.steps) it holds what the loop did meanwhile
        resp = pb.VerifyResponse(compute_us=int((time.perf_counter() - t0) * 1e6))
        add = resp.results.add
        results = []  # the verified items' results, in item order
        verified = iter(zip(trees, outs))
        for s in ids:  # built in place: hidden bytes are written once, not copied
            if s in failed:
                add(seq_id=s, draft_error=failed[s])
                continue
            tree, out = next(verified)
            results.append(add(seq_id=s, accepted_tokens=out.tokens, tree_nodes=tree.size))
        handed: dict[str, ProposeInput | Follow] = {}
        if launch is not None and launch.handle is not None:  # every item's next tree is on its way
            handed = {ids[i]: Follow(ids[i], launch.handle, row) for row, i in enumerate(todo)}
        elif self.hand_over:
            for i, out in zip(todo, outs):
                it = items[i]
                if it.next_nodes > 0:
                    handed[it.seq_id] = ProposeInput(
                        it.seq_id, out.tokens, out.hidden, False, [], it.next_nodes, it.next_depth
                    )
        keep = [j for j, i in enumerate(todo) if ids[i] not in handed]  # results that carry hidden states
        if keep:
            counts = [outs[j].hidden.shape[0] for j in keep]  # [K] rows of each
            # [sum(counts), 3H]
            hidden = torch.cat([outs[j].hidden for j in keep]) if len(keep) > 1 else outs[keep[0]].hidden
            self._hiddens([ids[todo[j]] for j in keep], hidden, counts, [results[j].hidden for j in keep])
        self._published()
        return resp, handed

    def _decode(self, request: pb.DecodeRequest) -> Steps[pb.DecodeResponse]:
        if not request.items:
            raise InvalidRequest("decode request has no items")
        if not 0 <= request.steps <= MAX_DECODE_STEPS:
            raise InvalidRequest(f"decode steps must be in [0, {MAX_DECODE_STEPS}], got {request.steps}")
        items = request.items
        ids = [it.seq_id for it in items]
        want = [i for i, it in enumerate(items) if it.want_hidden]  # the items that want their features
        t0 = time.perf_counter()
        out = yield from self.engine.decode_many_steps(ids, max(request.steps, 1), with_hidden=bool(want))
        resp = pb.DecodeResponse(compute_us=int((time.perf_counter() - t0) * 1e6))
        add = resp.results.add
        results = [add(seq_id=s, next_token=tokens[0], tokens=tokens) for s, tokens in zip(ids, out.tokens)]
        if want:
            steps = len(out.tokens[0])
            # [len(want), steps, 3H]: every item's rows as they lie when all want them, else gathered
            hidden = out.hidden if len(want) == len(ids) else out.hidden[want]
            rows = [items[i].hidden_row for i in want]
            msgs = [results[i].hidden for i in want]
            self._hiddens([ids[i] for i in want], hidden.flatten(0, 1), [steps] * len(want), msgs, rows)
        self._published()
        return resp


async def answers_in_order(requests, answer):
    """A VerifyStream's answers: `answer(request, cut, early)` (awaitable) for each request, one after the
    other, in order. The requests are read ahead of the answers, so that one with VerifyRequest.cut that
    arrives while the call before it runs sets that call's `cut` (asyncio.Event; chain.py ends the call
    before its next round); one that arrives between calls cuts nothing. A call's early answers
    (VerifyRequest.early: `early(response)` while it runs) go out as they come, before its own. Each answer
    says how long the loop waited for its request after answering the one before (idle_us; 0 when it was
    there already: queued)."""
    calls: asyncio.Queue = asyncio.Queue()  # requests read and not begun; None: the stream ended
    running: asyncio.Event | None = None  # the cut signal of the call in flight, while one is

    async def read() -> None:
        try:
            async for request in requests:
                if request.cut and running is not None:
                    running.set()
                calls.put_nowait(request)
        finally:
            calls.put_nowait(None)

    reader = asyncio.ensure_future(read())
    reader.add_done_callback(lambda t: t.cancelled() or t.exception())  # a broken stream just ends the loop
    try:
        while True:
            waited, t0 = calls.empty(), time.perf_counter()
            if (request := await calls.get()) is None:
                break
            idle = time.perf_counter() - t0 if waited else 0.0
            running = cut = asyncio.Event()
            # a call that may answer early runs in a task of its own (its answers go out while it runs); only a
            # call of several items and rounds can, the others stay inline (no task and queue hop a call)
            if request.early and request.rounds > 1 and len(request.items) > 1:
                said: asyncio.Queue = asyncio.Queue()  # the call's early answers, then None
                call = asyncio.ensure_future(answer(request, cut, said.put_nowait))
                call.add_done_callback(lambda _, said=said: said.put_nowait(None))
                try:
                    while (early := await said.get()) is not None:
                        yield early
                finally:
                    call.cancel()  # the stream ended (no-op when the call is over)
                response = call.result()
            else:
                response = await answer(request, cut, None)
            running = None
            response.idle_us = int(idle * 1e6)
            yield response
    finally:
        reader.cancel()
