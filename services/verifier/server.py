"""The verifier service: owns the base model and its KV cache. Thin servicer, one error boundary,
message conversion in this file only."""

from __future__ import annotations

import logging
import socket
import time

import torch

from common.config import SamplingConfig
from common.engine.base import PrefillInput, VerifierEngine, VerifyInput
from common.errors import InvalidRequest
from common.ipc import HiddenExport, gpu_uuid
from common.tensors import encode_inline, encode_ipc
from common.tree import validate_tree
from services.engine_runner import EngineRunner
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def sampling_config(msg: pb.SamplingParams) -> SamplingConfig:
    try:
        return SamplingConfig(temperature=msg.temperature, top_p=msg.top_p or 1.0, top_k=msg.top_k,
                              seed=msg.seed if msg.has_seed else None)
    except ValueError as e:
        raise InvalidRequest(str(e)) from e


class VerifierServicer(pb_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, hidden_width: int) -> None:
        self.engine, self.hidden_width = engine, hidden_width
        self.device = torch.device(engine.info.device)
        self.gpu_uuid = gpu_uuid(self.device)
        self.export: HiddenExport | None = None  # set once the draft has mapped our buffer
        self.runner = EngineRunner("verifier")

    async def Prefill(self, request, context):
        return await self.runner.unary(context, self._prefill, request)

    async def Verify(self, request, context):
        return await self.runner.unary(context, self._verify, request)

    async def VerifyStream(self, request_iterator, context):
        """One response per request, in order; the stream outlives failed calls."""
        async for request in request_iterator:
            yield await self.runner.answer(self._verify, request, pb.VerifyResponse)

    async def Decode(self, request, context):
        return await self.runner.unary(context, self._decode, request)

    async def Release(self, request, context):
        return await self.runner.unary(context, self._release, request)

    async def ExportHidden(self, request, context):
        return await self.runner.unary(context, self._export_hidden, request)

    async def Info(self, request, context):
        i = self.engine.info
        return pb.InfoResponse(model=i.model, vocab_size=i.vocab_size, max_context=i.max_context,
                               max_sequences=i.max_sequences, max_tree_nodes=i.max_tree_nodes, dtype=i.dtype,
                               device=i.device, host_id=socket.gethostname(), gpu_uuid=self.gpu_uuid)

    # ---- conversion + engine calls (run on the engine thread) ----
    def _hidden(self, seq_id: str, hidden: torch.Tensor, msg: pb.TensorRef) -> None:
        """Hidden states out: a reference into the exported buffer when the draft mapped it, else bytes."""
        if self.export is None:
            encode_inline(hidden, msg)
            return
        offset, writes = self.export.write(seq_id, hidden)
        encode_ipc(hidden, msg, self.export.exported.buffer_id, offset, writes)

    def _export_hidden(self, request: pb.ExportRequest) -> pb.IpcBuffer:
        if not request.enable:
            self.export = None
            return pb.IpcBuffer()
        if self.device.type != "cuda":
            raise InvalidRequest("CUDA IPC needs the verifier on a CUDA device")
        if self.export is None:
            i = self.engine.info
            self.export = HiddenExport(i.max_sequences, i.max_context, self.hidden_width,
                                       self._engine_dtype(), self.device)
        e = self.export.exported
        return pb.IpcBuffer(buffer_id=e.buffer_id, handle=e.handle, offset_bytes=e.offset_bytes, nbytes=e.nbytes)

    def _engine_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.engine.info.dtype]

    def _release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        ids = list(request.seq_ids)
        if self.export is not None:
            for s in ids:
                self.export.release(s)
        return pb.ReleaseResponse(released=self.engine.release(ids))

    def _prefill(self, request: pb.PrefillRequest) -> pb.PrefillResponse:
        if not request.items:
            raise InvalidRequest("prefill request has no items")
        resp = pb.PrefillResponse()
        for it in request.items:  # prefill is eager and per sequence
            out = self.engine.prefill(PrefillInput(seq_id=it.seq_id, token_ids=list(it.token_ids),
                                                   sampling=sampling_config(it.sampling)))
            r = resp.results.add(seq_id=it.seq_id, next_token=out.next_token)
            if it.want_hidden:
                self._hidden(it.seq_id, out.hidden, r.hidden)
        return resp

    def _verify(self, request: pb.VerifyRequest) -> pb.VerifyResponse:
        if not request.items:
            raise InvalidRequest("verify request has no items")
        info = self.engine.info
        items = [VerifyInput(seq_id=it.seq_id,
                             tree=validate_tree(list(it.tree.token_ids), list(it.tree.parents),
                                                list(it.tree.draft_probs), max_nodes=info.max_tree_nodes,
                                                vocab_size=info.vocab_size))
                 for it in request.items]
        if any(it.tree.size == 0 for it in items):
            raise InvalidRequest("a tree has no nodes")
        t0 = time.perf_counter()
        outs = self.engine.verify(items)
        compute_us = int((time.perf_counter() - t0) * 1e6)
        resp = pb.VerifyResponse(compute_us=compute_us)
        for it, out in zip(items, outs):  # built in place: hidden bytes are written once, not copied
            r = resp.results.add(seq_id=it.seq_id, accepted_tokens=out.tokens)
            self._hidden(it.seq_id, out.hidden, r.hidden)
        return resp

    def _decode(self, request: pb.DecodeRequest) -> pb.DecodeResponse:
        if not request.items:
            raise InvalidRequest("decode request has no items")
        ids = [it.seq_id for it in request.items]
        return pb.DecodeResponse(results=[pb.DecodeResult(seq_id=s, next_token=t)
                                          for s, t in zip(ids, self.engine.decode(ids))])
