"""The draft service: proposes a token tree per sequence for the verifier that runs the rounds (its engine core
calls it through services/verifier/remote_draft.py). Thin servicer, one error boundary, message conversion in
this file only. Engine calls run one at a time on a worker thread, so that health and Info answer meanwhile.

Ownership: the sequences belong to the verifier instance named in each request (ProposeRequest.owner). A
request from another instance (the verifier restarted) first frees every sequence held: nobody else can
name them any more."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import torch
from google.protobuf.message import DecodeError

from common import validate
from common.config import DraftingConfig
from common.engine.base import Drafter, ProposeInput
from common.errors import InvalidRequest, PeerUnavailable, SpecdecError
from common.ipc import ExportedBuffer, MappedBuffers, gpu_uuid
from common.rpc import describe, status_for
from common.slots import check_unique
from common.tensors import decode
from services.local_link import OK, PROPOSE, RELEASE
from services.sampling import sampling_config
from services.tree_wire import tree_msg
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class DraftServicer(pb_grpc.DraftServicer):
    def __init__(
        self,
        drafter: Drafter,
        drafting: DraftingConfig,
        hidden_width: int,
        vocab_size: int,
        device: torch.device,
        max_sequences: int = 0,
    ) -> None:
        self.drafter, self.drafting, self.hidden_width, self.device = drafter, drafting, hidden_width, device
        self.vocab_size = vocab_size  # the base model's: every token id we are sent must index its embeddings
        self.max_sequences = max_sequences  # 0: no fixed limit (the test oracles)
        self.gpu_uuid = gpu_uuid(device)
        self.instance_id = uuid.uuid4().hex[:12]
        self.link_socket = ""  # set by the service once its same-host link listens (services/local_link.py)
        self._linked = {PROPOSE: (pb.ProposeRequest, self._propose), RELEASE: (pb.ReleaseRequest, self._release)}
        self.mapped = MappedBuffers(device)
        self.owner = ""  # the verifier instance whose sequences are held
        self.held: set[str] = set()
        self.draining = False
        self._engine = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-engine")
        # the engine's step times, measured once before serving, for the verifier's speculation policy
        self.step_costs = [
            pb.StepCost(kind=c.kind, batch=c.batch, size=c.size, seconds=c.seconds) for c in drafter.step_costs()
        ]

    def engine_call(self, fn, request) -> tuple[grpc.StatusCode, object]:
        """The error boundary, on the engine thread: (OK, fn's response), or our exception types -> (a specific
        status code, the details), INTERNAL last."""
        try:
            return grpc.StatusCode.OK, fn(request)
        except Exception as e:  # noqa: BLE001 - the boundary
            if not isinstance(e, SpecdecError):
                log.exception("internal error")
            return status_for(e), describe(e)

    async def _call(self, context: grpc.aio.ServicerContext, fn, request):
        code, out = await asyncio.get_running_loop().run_in_executor(self._engine, self.engine_call, fn, request)
        if code != grpc.StatusCode.OK:
            await context.abort(code, out)
        return out

    def link_call(self, kind: int, payload: bytes) -> tuple[int, bytes]:
        """A frame of the same-host link (services/local_link.py), answered as its gRPC method would be."""
        method = self._linked.get(kind)
        if method is None:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"unknown link method {kind}".encode()
        try:
            request = method[0].FromString(payload)
        except DecodeError as e:
            return grpc.StatusCode.INVALID_ARGUMENT.value[0], f"malformed request: {e}".encode()
        try:
            code, out = self._engine.submit(self.engine_call, method[1], request).result()
        except RuntimeError:  # the executor is shut down: the service is stopping
            return grpc.StatusCode.UNAVAILABLE.value[0], b"the draft is stopping"
        return (OK, out.SerializeToString()) if code == grpc.StatusCode.OK else (code.value[0], out.encode())

    async def Propose(self, request, context):
        return await self._call(context, self._propose, request)

    async def Release(self, request, context):
        return await self._call(context, self._release, request)

    async def ImportBuffer(self, request, context):
        return await self._call(context, self._import, request)

    async def Info(self, request, context):
        d = self.drafting
        return pb.DraftInfoResponse(
            drafter=self.drafter.name,
            drafting_top_k=d.top_k,
            drafting_steps=d.steps,
            verify_tree_size=d.verify_tree_size,
            host_id=socket.gethostname(),
            gpu_uuid=self.gpu_uuid,
            active_sequences=len(self.held),
            draining=self.draining,
            max_sequences=self.max_sequences,
            step_costs=self.step_costs,
            instance_id=self.instance_id,
            link_socket=self.link_socket,
        )

    async def drain(self) -> None:
        """Refuse new sequences; return once the verifier has released every one held."""
        self.draining = True
        while self.held:
            await asyncio.sleep(0.05)

    def close(self) -> None:
        self._engine.shutdown(wait=False, cancel_futures=True)

    # ---- on the engine thread ----
    def _own(self, owner: str) -> None:
        """Sequences held for another verifier instance (it restarted) are freed: nobody can name them now."""
        if owner != self.owner:
            if self.held:
                log.info("verifier %s replaces %s: freeing its %d sequence(s)", owner, self.owner, len(self.held))
                self.drafter.release(list(self.held))
                self.held.clear()
            self.owner = owner

    def _propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        if not request.items:
            raise InvalidRequest("propose request has no items")
        check_unique([it.seq_id for it in request.items])
        self._own(request.owner)
        started = [it.seq_id for it in request.items if it.start]
        if self.draining and any(s not in self.held for s in started):
            raise PeerUnavailable("the draft is shutting down: no new sequences")
        items = [self._item(it) for it in request.items]
        # bytes from the wire are checked; an IPC region is the verifier's own output in its own buffer (only
        # the reference crossed the wire), and checking it would cost a device sync
        inline = [(it, msg) for it, msg in zip(items, request.items) if msg.hidden.WhichOneof("payload") != "ipc"]
        validate.all_finite([it.hidden for it, _ in inline], [f"sequence {it.seq_id!r}" for it, _ in inline])
        self.drafter.release(started)  # start on a sequence held restarts it (a verifier catching it up)
        t0 = time.perf_counter()
        try:
            trees = self.drafter.propose(items)
        except BaseException:
            self.drafter.release(started)
            self.held.difference_update(started)
            raise
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # IPC reads done before we answer
        self.held.update(started)
        resp = pb.ProposeResponse(compute_us=int((time.perf_counter() - t0) * 1e6))
        for it, t in zip(items, trees):  # built in place, no copies of nested messages
            tree_msg(t, resp.results.add(seq_id=it.seq_id).tree)
        return resp

    def _item(self, it: pb.ProposeItem) -> ProposeInput:
        what = f"sequence {it.seq_id!r}"
        validate.token_ids(list(it.token_ids), self.vocab_size, what)
        validate.token_ids(list(it.context_prefix), self.vocab_size, f"{what} context_prefix")
        if it.max_nodes < 0:
            raise InvalidRequest(f"max_nodes must be >= 0, got {it.max_nodes}")
        return ProposeInput(
            seq_id=it.seq_id,
            token_ids=list(it.token_ids),
            hidden=decode(it.hidden, self.device, self.mapped),
            start=it.start,
            context_prefix=list(it.context_prefix),
            max_nodes=min(it.max_nodes or self.drafting.verify_tree_size, self.drafting.verify_tree_size),
            max_depth=it.max_depth,
            sampling=sampling_config(it.sampling),
        )

    def _release(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        self._own(request.owner)
        ids = list(request.seq_ids)
        self.held.difference_update(ids)
        return pb.ReleaseResponse(released=self.drafter.release(ids))

    def _import(self, request: pb.IpcBuffer) -> pb.ImportResponse:
        if self.device.type != "cuda":
            raise InvalidRequest("CUDA IPC needs the draft on a CUDA device")
        self.mapped.add(
            ExportedBuffer(
                buffer_id=request.buffer_id,
                handle=request.handle,
                offset_bytes=request.offset_bytes,
                nbytes=request.nbytes,
            )
        )
        log.info(
            "mapped the verifier's hidden-state buffer %s (%d bytes) by CUDA IPC", request.buffer_id, request.nbytes
        )
        return pb.ImportResponse(mapped=True)
