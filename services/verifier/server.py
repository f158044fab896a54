"""The verifier service: owns the base model and its KV cache. Thin servicer, one error boundary,
message conversion in this file only. It also sends each chained sequence's verified outcome to the draft
(the round protocol, services/verifier/chain.py)."""

from __future__ import annotations

import logging
import socket
import time
import uuid

import torch

from common.config import SamplingConfig
from common.engine.base import PrefillInput, VerifierEngine, VerifyInput
from common.errors import CapacityExhausted, InvalidRequest, UnknownSequence
from common.ipc import HiddenExport, gpu_uuid
from common.slots import check_unique
from common.tensors import encode_inline, encode_ipc
from services.clients import DraftClient
from services.engine_runner import EngineRunner
from services.leasing import SequenceLeases
from services.sampling import sampling_config
from services.tree_wire import size as tree_size
from services.tree_wire import tree_of
from services.verifier.chain import DraftChain
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
MAX_DECODE_STEPS = 64  # per Decode call: bounds one call's time and the tokens wasted past a stop


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
    ) -> None:
        if not 1 <= max_sequences < engine.info.max_sequences:
            raise ValueError(
                f"max_sequences must be in [1, {engine.info.max_sequences}) (one engine slot is "
                f"the spare for Features), got {max_sequences}"
            )
        self.engine, self.hidden_width, self.max_sequences = engine, hidden_width, max_sequences
        self.device = torch.device(engine.info.device)
        self.gpu_uuid = gpu_uuid(self.device)
        # per-round calls inline on the event loop on a GPU (milliseconds: the thread hop costs more than it
        # saves, see services/engine_runner.py); on CPU a call takes long enough to hold up lease renewals
        # and health checks, so it stays on the engine thread
        self.inline = self.device.type == "cuda"
        self.export: HiddenExport | None = None  # set once the draft has mapped our buffer
        self.runner = EngineRunner("verifier")
        self.leases = SequenceLeases(lease_ttl, self._release_ids, self.runner)
        # the next trees of chained sequences (a propose not answered within draft_timeout fails its items)
        self.chain = DraftChain(lambda address: DraftClient(address, timeout=draft_timeout))
        self._spare_id = f"~features-{uuid.uuid4().hex}"  # no client can name it
        # sequences whose prompt is partly prefilled (more chunks due) -> the hidden states of their chunks
        # so far (those that want them), returned whole with the last chunk
        self._chunks: dict[str, list[torch.Tensor]] = {}
        # the engine's step times, measured once before serving, for the gateway's speculation policy
        self.step_costs = [
            pb.StepCost(kind=c.kind, batch=c.batch, size=c.size, seconds=c.seconds) for c in engine.step_costs()
        ]

    async def Prefill(self, request, context):
        return await self.runner.unary(context, self._admit_prefill, request)

    async def Verify(self, request, context):
        return await self.runner.unary(context, self._touched_verify, request)

    async def VerifyStream(self, request_iterator, context):
        """One response per request, in order; the stream outlives failed calls."""
        async for request in request_iterator:
            yield await self.runner.answer(self._touched_verify, request, pb.VerifyResponse)

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
        """New sequences are admitted (capacity, draining); chunks that continue one are not new."""
        ids = [it.seq_id for it in request.items]
        check_unique(ids)
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
            resp = await self.runner.run(self._prefill, request)
        except BaseException:
            self.leases.removed(continued)  # the failed call freed them (see _prefill)
            raise
        self.leases.added(new, request.owner)
        return resp

    async def _touched_verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        """The chained items' trees from the draft (waiting for what is not done yet), the verify, then the
        outcome of every item with next_nodes to the draft for its next tree (see chain.py)."""
        self._check_chain(request)
        self.leases.touch([it.seq_id for it in request.items])
        return await self.chain.verify(request, self._run_verify)

    async def _run_verify(self, request: pb.VerifyRequest, failed: dict[str, str]) -> pb.VerifyResponse:
        return await self.runner.run(self._verify, request, failed, inline=self.inline)

    def _check_chain(self, request: pb.VerifyRequest) -> None:
        """Known, distinct sequences and well-formed protocol fields, checked before anything runs."""
        if not request.items:
            raise InvalidRequest("verify request has no items")
        check_unique([it.seq_id for it in request.items])
        for it in request.items:
            if self.leases.table.owner_of(it.seq_id) is None:
                raise UnknownSequence(f"unknown sequence id {it.seq_id!r}")
        self.chain.check(request)

    async def _touched_decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        self.leases.touch([it.seq_id for it in request.items])
        await self.chain.settle([it.seq_id for it in request.items])
        return await self.runner.run(self._decode, request, inline=self.inline)

    async def _release_owned(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        ids = list(request.seq_ids)
        await self.chain.settle(ids)  # the draft answers for them before anyone frees its copies
        n = await self.runner.run(self._release_ids, ids)
        self.leases.removed(ids)
        return pb.ReleaseResponse(released=n)

    async def _held_features(self, request: pb.FeaturesRequest) -> pb.FeaturesResponse:
        if not request.items:
            raise InvalidRequest("features request has no items")
        for it in request.items:
            if self.leases.table.owner_of(it.seq_id) is None:
                raise UnknownSequence(f"unknown sequence id {it.seq_id!r}")
        await self.chain.settle([it.seq_id for it in request.items])
        return await self.runner.run(self._features, request)

    # ---- conversion + engine calls (run on the engine thread) ----
    def _published(self) -> None:
        """Wait once for a call's copies into the exported buffer (see common/ipc.py, rule 1)."""
        if self.export is not None:
            self.export.wait()

    def _hidden(self, seq_id: str, hidden: torch.Tensor, msg: pb.TensorRef, row: int = 0) -> None:
        """Hidden states out: a reference into the exported buffer when the draft mapped it (written from
        row `row` of the sequence's region on), else bytes."""
        if self.export is None:
            encode_inline(hidden, msg)
            return
        offset, writes = self.export.write(seq_id, hidden, row)
        encode_ipc(hidden, msg, self.export.exported.buffer_id, offset, writes)

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

    def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        """Every item in one engine call (prompts of similar length share a forward). All or nothing: a
        failed call frees every sequence it created or continued (the engine's rule), and nothing else."""
        if not request.items:
            raise InvalidRequest("prefill request has no items")
        inputs = [
            PrefillInput(
                seq_id=it.seq_id, token_ids=list(it.token_ids), sampling=sampling_config(it.sampling), more=it.more
            )
            for it in request.items
        ]
        try:
            outs = self.engine.prefill_batch(inputs)
        except BaseException:
            for it in request.items:
                self._chunks.pop(it.seq_id, None)
            raise
        resp = pb.PrefillResponse()
        try:
            for it, out in zip(request.items, outs):
                chunks = self._chunks.pop(it.seq_id, [])
                if it.want_hidden:
                    chunks.append(out.hidden)
                if it.more:
                    self._chunks[it.seq_id] = chunks
                    resp.results.add(seq_id=it.seq_id)
                    continue
                r = resp.results.add(seq_id=it.seq_id, next_token=out.next_token)
                if it.want_hidden:
                    self._hidden(it.seq_id, torch.cat(chunks) if len(chunks) > 1 else chunks[0], r.hidden)
        except BaseException:
            self._release_ids([it.seq_id for it in request.items])  # all ours: the engine call succeeded
            raise
        self._published()
        return resp

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

    def _verify(self, request: pb.VerifyRequest, failed: dict[str, str]) -> pb.VerifyResponse:
        """Every item but the `failed` ones (chained trees that never came: answered with draft_error)."""
        info = self.engine.info
        todo = [it for it in request.items if it.seq_id not in failed]
        items = [
            VerifyInput(seq_id=it.seq_id, tree=tree_of(it.tree, info.max_tree_nodes, info.vocab_size)) for it in todo
        ]
        if any(it.tree.size == 0 for it in items):
            raise InvalidRequest("a tree has no nodes")
        t0 = time.perf_counter()
        outs = dict(zip([it.seq_id for it in items], self.engine.verify(items) if items else []))
        resp = pb.VerifyResponse(compute_us=int((time.perf_counter() - t0) * 1e6))
        for it in request.items:  # built in place: hidden bytes are written once, not copied
            if it.seq_id in failed:
                resp.results.add(seq_id=it.seq_id, draft_error=failed[it.seq_id])
                continue
            out = outs[it.seq_id]
            r = resp.results.add(seq_id=it.seq_id, accepted_tokens=out.tokens, tree_nodes=tree_size(it.tree))
            self._hidden(it.seq_id, out.hidden, r.hidden)
        self._published()
        return resp

    def _decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if not request.items:
            raise InvalidRequest("decode request has no items")
        if not 0 <= request.steps <= MAX_DECODE_STEPS:
            raise InvalidRequest(f"decode steps must be in [0, {MAX_DECODE_STEPS}], got {request.steps}")
        ids = [it.seq_id for it in request.items]
        t0 = time.perf_counter()
        want = any(it.want_hidden for it in request.items)
        out = self.engine.decode_steps(ids, max(request.steps, 1), with_hidden=want)
        resp = pb.DecodeResponse(compute_us=int((time.perf_counter() - t0) * 1e6))
        for i, (it, tokens) in enumerate(zip(request.items, out.tokens)):
            r = resp.results.add(seq_id=it.seq_id, next_token=tokens[0], tokens=tokens)
            if it.want_hidden:
                self._hidden(it.seq_id, out.hidden[i], r.hidden, it.hidden_row)
        self._published()
        return resp
