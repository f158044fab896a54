"""A draft service in another process as the engine core's Drafter (common.engine.base.Drafter): blocking calls
from the engine thread. Hidden states travel as CUDA IPC regions when the draft shares this host and GPU (the
verifier exports one buffer, the draft maps it once), else as inline bytes. On the draft's host, Propose and Release
go over its Unix socket (services/local_link.py), else through gRPC.

Failures never fail a request: the core turns every error into plain decoding (common/engine/core.py). This
class says which kind it was: the draft is down or too slow (PeerUnavailable: every sequence waits for it),
or it restarted and no longer knows the sequences (UnknownSequence: they are caught up), or it refused
these inputs (the other SpecdecErrors). A restarted draft is found by its Info's instance id; the IPC
buffer is imported into it again."""

from __future__ import annotations

import logging
import socket

import grpc
import torch

from common.engine.base import Accepted, ProposeAfter, ProposeInput, StepTime
from common.errors import CapacityExhausted, InvalidRequest, PeerUnavailable, UnknownSequence
from common.ipc import HiddenExport, gpu_uuid
from common.rpc import CHANNEL_OPTIONS
from common.tensors import encode_inline, encode_ipc
from common.tree import Tree
from services import local_link
from services.sampling import sampling_msg
from services.tree_wire import trees_of
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 1.0
_ERRORS = {
    grpc.StatusCode.NOT_FOUND: UnknownSequence,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
}
_CODES = {c.value[0]: c for c in grpc.StatusCode}
# the methods the same-host link takes: (frame kind, response type)
_LINKED = {"Propose": (local_link.PROPOSE, pb.ProposeResponse), "Release": (local_link.RELEASE, pb.ReleaseResponse)}


class RemoteDrafter:
    def __init__(
        self,
        address: str,
        owner: str,
        timeout_s: float,
        device: torch.device,
        vocab_size: int,
        export_shape: tuple[int, int, int, torch.dtype] | None = None,
    ) -> None:
        """owner: this verifier's instance id. export_shape: (regions, rows, width, dtype) of the hidden-state
        buffer to export when the draft turns out to share this GPU (None: inline bytes only)."""
        self.address, self.owner, self.timeout_s, self.device = address, owner, timeout_s, device
        self.vocab_size = vocab_size  # the base model's: the trees' tokens are checked against it
        self.channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.DraftStub(self.channel)
        self.info: pb.DraftInfoResponse | None = None
        self.name = "remote"
        self._export_shape = export_shape
        self.export: HiddenExport | None = None  # set while the draft has our buffer mapped
        self.link: socket.socket | None = None  # the draft's same-host link, while connected
        self._relink = False  # a call broke the link: the next call connects again

    # ---- the draft's state ----
    def connect(self, wait_s: float) -> pb.DraftInfoResponse | None:
        """Wait up to wait_s for the draft to answer: its Info, or None (the verifier starts without it and
        catches up once it answers)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            log.warning("the draft at %s did not answer within %.0f s: starting without it", self.address, wait_s)
            return None
        return self.info if self.available() else None

    def available(self) -> bool:
        """Whether the draft answers; a new instance (it restarted) gets the IPC buffer imported again."""
        try:
            info = self.stub.Info(pb.InfoRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return False
        if self.info is None or info.instance_id != self.info.instance_id:
            self.info = info
            self.name = info.drafter
            self._share(info)
            self._link(info)
        return True

    def _link(self, info: pb.DraftInfoResponse) -> None:
        """Connect to the draft's same-host link when it runs on this host (else, or when the socket cannot be
        reached, the calls stay on gRPC)."""
        self._drop_link()
        if not info.link_socket or info.host_id != socket.gethostname():
            return
        try:
            self.link = local_link.connect(info.link_socket, self.timeout_s)
        except OSError as e:
            log.warning(
                "the draft's link %s cannot be reached (%s): Propose and Release through gRPC", info.link_socket, e
            )
            return
        log.info("Propose and Release to the draft at %s: its Unix socket %s", self.address, info.link_socket)

    def _drop_link(self) -> None:
        if self.link is not None:
            self.link.close()
            self.link = None

    def _share(self, info: pb.DraftInfoResponse) -> None:
        """Export our hidden-state buffer to the draft when it is on this GPU (CUDA IPC)."""
        self.export = None
        if self._export_shape is None or self.device.type != "cuda" or info.gpu_uuid != gpu_uuid(self.device):
            log.info("hidden states to the draft at %s: inline bytes", self.address)
            return
        regions, rows, width, dtype = self._export_shape
        export = HiddenExport(regions, rows, width, dtype, self.device)
        e = export.exported
        try:
            self.stub.ImportBuffer(
                pb.IpcBuffer(buffer_id=e.buffer_id, handle=e.handle, offset_bytes=e.offset_bytes, nbytes=e.nbytes),
                timeout=self.timeout_s,
            )
        except grpc.RpcError as err:
            log.warning("CUDA IPC set-up with the draft failed (%s): hidden states travel inline", err.details())
            return
        self.export = export
        log.info("hidden states to the draft at %s: CUDA IPC", self.address)

    # ---- the Drafter protocol ----
    def propose(self, items: list[ProposeInput]) -> list[Tree]:
        req = pb.ProposeRequest(owner=self.owner)
        msgs = []
        for it in items:
            msg = req.items.add(
                seq_id=it.seq_id,
                token_ids=it.token_ids,
                start=it.start,
                max_nodes=it.max_nodes,
                context_prefix=it.context_prefix,
                max_depth=it.max_depth,
            )
            if it.start:
                msg.sampling.CopyFrom(sampling_msg(it.sampling))
            msgs.append(msg)
        self._hidden(items, msgs)
        resp = self._call("Propose", req)
        if len(resp.results) != len(items):
            raise PeerUnavailable(f"the draft at {self.address} answered {len(resp.results)} trees for {len(items)}")
        nodes = max(it.max_nodes for it in items)
        return trees_of([r.tree for r in resp.results], nodes, self.vocab_size)

    def _hidden(self, items: list[ProposeInput], msgs: list[pb.ProposeItem]) -> None:
        """The items' features into their messages: one copy into the exported buffer (each sequence's rows
        from the start of its region: the draft has read the last call's before answering it), or bytes."""
        if self.export is None:
            for it, msg in zip(items, msgs):
                encode_inline(it.hidden, msg.hidden)
            return
        counts = [it.hidden.shape[0] for it in items]
        hidden = torch.cat([it.hidden for it in items]) if len(items) > 1 else items[0].hidden  # [sum, 3H]
        placed = self.export.write_many([it.seq_id for it in items], hidden, counts)
        buffer_id = self.export.exported.buffer_id
        for it, msg, (offset, writes) in zip(items, msgs, placed):
            encode_ipc(it.hidden, msg.hidden, buffer_id, offset, writes)
        self.export.wait()

    def _call(self, name: str, request):
        """The draft's method `name` (Propose, Release) on the link when there is one, else through gRPC; its
        errors as our exception types."""
        if self._relink and self.info is not None:
            self._relink = False
            self._link(self.info)
        if self.link is not None:
            kind, response = _LINKED[name]
            try:
                local_link.send_frame(self.link, kind, request.SerializeToString())
                code, payload = local_link.recv_frame(self.link)
            except OSError as e:  # closed, broken or timed out: a late answer would come out of turn
                self._drop_link()
                self._relink = True
                raise PeerUnavailable(f"the draft at {self.address}: its link: {e or type(e).__name__}") from None
            if code == local_link.OK:
                return response.FromString(payload)
            self._failed(_CODES.get(code, grpc.StatusCode.UNKNOWN), payload.decode(errors="replace"))
        try:
            return getattr(self.stub, name)(request, timeout=self.timeout_s)
        except grpc.RpcError as e:
            self._failed(e.code(), e.details())

    def _failed(self, code: grpc.StatusCode, details: str) -> None:
        """Raise the error a call that ended with `code` means (a restarted draft: UnknownSequence)."""
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):
            raise PeerUnavailable(f"the draft at {self.address}: {code.name}: {details}")
        before = self.info.instance_id if self.info is not None else ""
        if self.available() and self.info.instance_id != before:
            raise UnknownSequence(f"the draft at {self.address} restarted")
        raise _ERRORS.get(code, PeerUnavailable)(f"the draft at {self.address}: {details}")

    def release(self, seq_ids: list[str]) -> int:
        if self.export is not None:
            for s in seq_ids:
                self.export.release(s)
        return self._call("Release", pb.ReleaseRequest(seq_ids=seq_ids, owner=self.owner)).released

    def launch_after(self, items: list[ProposeAfter], accepted: Accepted, after: object = None) -> None:
        return None  # the device chain needs the drafter in this process: the core proposes instead

    def take(self, items: list[ProposeInput]) -> bool:
        return False  # nothing drafts behind a verify in another process: the core proposes them

    def settle_after(self, launched: object) -> None:
        raise NotImplementedError("RemoteDrafter.launch_after never launches")

    def read_after(self, launched: object, rows: list[int]) -> list[Tree]:
        raise NotImplementedError("RemoteDrafter.launch_after never launches")

    def read_after_steps(self, launched: object, rows: list[int]):
        raise NotImplementedError("RemoteDrafter.launch_after never launches")

    def propose_steps(self, items: list[ProposeInput]):
        return self.propose(items)
        yield  # a generator that never waits: the call blocks

    def step_costs(self) -> list[StepTime]:
        info = self.info
        return [StepTime(c.kind, c.batch, c.size, c.seconds) for c in info.step_costs] if info is not None else []

    def close(self) -> None:
        self._drop_link()
        self.channel.close()
