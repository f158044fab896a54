"""The draft service: proposes a token tree per sequence. Thin servicer, one error boundary,
message conversion in this file only."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

import torch

from common import validate
from common.config import DraftingConfig
from common.engine.base import Accepted, Drafter, ProposeAfter, ProposeInput, Steps
from common.errors import InvalidRequest
from common.ipc import ExportedBuffer, MappedBuffers, gpu_uuid
from common.slots import check_unique
from common.tensors import decode
from common.tree import Tree
from services.draft.follow import Follow
from services.engine_runner import EngineRunner
from services.leasing import SequenceLeases
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
        lease_ttl: float,
        max_sequences: int = 0,
        local_buffers: Callable[[str], torch.Tensor | None] | None = None,
        poll: bool = True,
    ) -> None:
        self.drafter, self.drafting, self.hidden_width, self.device = drafter, drafting, hidden_width, device
        self.vocab_size = vocab_size  # the base model's: every token id we are sent must index its embeddings
        self.max_sequences = max_sequences  # 0: no fixed limit
        self.gpu_uuid = gpu_uuid(device)
        self.mapped = MappedBuffers(device)
        # colocated with the verifier: its exported buffer by id, read in place (no IPC handle to open)
        self.local_buffers = local_buffers
        # per-round calls on the event loop on a GPU, giving it back while the device works (poll), and on
        # the engine thread on CPU (services/engine_runner.py)
        self.runner = EngineRunner("draft", inline=device.type == "cuda", poll=poll)
        self.leases = SequenceLeases(lease_ttl, self.drafter.release, self.runner)
        # the engine's step times, measured once before serving, for the gateway's speculation policy
        self.step_costs = [
            pb.StepCost(kind=c.kind, batch=c.batch, size=c.size, seconds=c.seconds) for c in drafter.step_costs()
        ]

    async def Propose(self, request, context):
        return await self.runner.unary(context, self._owned_propose, request)

    async def ProposeStream(self, request_iterator, context):
        """One response per request, in order; the stream outlives failed calls."""
        async for request in request_iterator:
            yield await self.runner.answer(self._owned_propose, request, pb.ProposeResponse)

    async def propose_here(self, items: list[ProposeInput], owner: str = "") -> tuple[list[Tree], float]:
        """Propose for the verifier of this process (its chain, services/draft/here.py): -> (trees in item
        order, engine seconds). The items are that verifier's outcomes (after a verify, or a prefill's: a
        start item), its engine's tokens and feature rows on the device: nothing to convert, and nothing to
        check that the engine did not make itself (the drafter checks what it always checks: known
        sequences, row counts, depth, context room). Started sequences belong to `owner` (_owned). Errors
        are raised as they are."""
        return await self._owned(items, owner, self._propose_inputs, items)

    def launch_after(self, items: list[ProposeAfter], accepted: Accepted) -> object | None:
        """The verifier of this process, from its verify's `then` (the device chain, common.engine.base.Drafter):
        the items' next trees launched behind its verification, or None when the drafter cannot follow them
        or is busy with a call of its own (its graphs' buffers are that call's until it has read them: never
        waited for, the verifier then hands the outcomes over as the drafter's inputs)."""
        with self.runner.free() as free:
            return self.drafter.launch_after(items, accepted) if free else None

    async def read_here(self, follows: list[Follow], owner: str = "") -> tuple[list[Tree], float]:
        """The trees of one launch after a verify (launch_after: the chain sends a round's outcomes together), for
        the verifier's chain: -> (trees in item order, the drafting's device seconds). Reading takes no engine
        lock (what it reads was copied out of the graphs' buffers at the launch): it waits for the device like a
        call's steps, on the event loop."""
        launched = follows[0].launched
        if any(f.launched is not launched for f in follows):
            raise ValueError("the follows of one call come from one launch (one verify's)")
        self.leases.touch([f.seq_id for f in follows])
        trees = await self.runner.unlocked(self.drafter.read_after_steps, launched, [f.row for f in follows])
        return trees, self.drafter.seconds_after(launched)

    def _propose_inputs(self, items: list[ProposeInput]) -> Steps[tuple[list[Tree], float]]:
        # no synchronisation before answering, unlike _propose: the rows are the verifier's own tensors,
        # not a region it rewrites, and the drafter's result reached the host after its reads of them
        t0 = time.perf_counter()
        trees = yield from self.drafter.propose_steps(items)
        return trees, time.perf_counter() - t0

    async def Release(self, request, context):
        return await self.runner.unary(context, self._release_owned, request)

    async def Lease(self, request, context):
        return await self.runner.unary(context, self.leases.lease, request)

    async def _release_owned(self, request: pb.ReleaseRequest) -> pb.ReleaseResponse:
        ids = list(request.seq_ids)
        n = await self.runner.between(self.drafter.release, ids)
        self.leases.removed(ids)
        return pb.ReleaseResponse(released=n)

    async def _owned_propose(self, request: pb.ProposeRequest) -> pb.ProposeResponse:
        return await self._owned(request.items, request.owner, self._propose, request)

    async def _owned(self, items, owner: str, fn, *args):
        """fn(*args), the engine call of a proposal of `items` (ProposeItems or the drafter's inputs), with the
        ownership around it: started sequences are new (refused while draining) and belong to `owner` once it
        succeeds; a failed call leaves none of them behind; the others are touched."""
        started = [it.seq_id for it in items if it.start]
        self.leases.admit(len(started))
        self.leases.touch([it.seq_id for it in items if not it.start])
        try:
            out = await self.runner.steps(fn, *args)
        except BaseException:
            if started:
                await self.runner.between(self.drafter.release, started)
                self.leases.removed(started)
            raise
        self.leases.added(started, owner)
        return out

    async def ImportBuffer(self, request, context):
        return await self.runner.unary(context, self._import, request)

    def _import(self, request: pb.IpcBuffer) -> pb.ImportResponse:
        if self.device.type != "cuda":
            raise InvalidRequest("CUDA IPC needs the draft on a CUDA device")
        local = self.local_buffers(request.buffer_id) if self.local_buffers is not None else None
        if local is not None:
            self.mapped.add_local(request.buffer_id, local)
            log.info("reading the verifier's hidden-state buffer %s in place (same process)", request.buffer_id)
            return pb.ImportResponse(mapped=True)
        self.mapped.add(
            ExportedBuffer(
                buffer_id=request.buffer_id,
                handle=request.handle,
                offset_bytes=request.offset_bytes,
                nbytes=request.nbytes,
            )
        )
        log.info(
            "mapped the verifier's hidden-state buffer %s (%d bytes) through CUDA IPC",
            request.buffer_id,
            request.nbytes,
        )
        return pb.ImportResponse(mapped=True)

    async def Info(self, request, context):
        d = self.drafting
        return pb.DraftInfoResponse(
            drafter=self.drafter.name,
            drafting_top_k=d.top_k,
            drafting_steps=d.steps,
            verify_tree_size=d.verify_tree_size,
            host_id=socket.gethostname(),
            gpu_uuid=self.gpu_uuid,
            active_sequences=len(self.leases.table),
            draining=self.leases.draining,
            max_sequences=self.max_sequences,
            step_costs=self.step_costs,
        )

    def _propose(self, request: pb.ProposeRequest) -> Steps[pb.ProposeResponse]:
        if not request.items:
            raise InvalidRequest("propose request has no items")
        check_unique([it.seq_id for it in request.items])
        items = []
        for it in request.items:
            what = f"sequence {it.seq_id!r}"
            hidden = decode(it.hidden, self.device, self.mapped)
            validate.token_ids(list(it.token_ids), self.vocab_size, what)
            validate.token_ids(list(it.context_prefix), self.vocab_size, f"{what} context_prefix")
            if it.max_nodes < 0:
                raise InvalidRequest(f"max_nodes must be >= 0, got {it.max_nodes}")
            items.append(
                ProposeInput(
                    seq_id=it.seq_id,
                    token_ids=list(it.token_ids),
                    hidden=hidden,
                    start=it.start,
                    context_prefix=list(it.context_prefix),
                    max_nodes=min(it.max_nodes or self.drafting.verify_tree_size, self.drafting.verify_tree_size),
                    max_depth=it.max_depth,
                    sampling=sampling_config(it.sampling),
                )
            )
        # bytes from the wire are checked; an IPC region is the verifier's own output in its own buffer (only
        # the reference crossed the wire), and checking it would cost a device sync in every round
        inline = [(it, msg) for it, msg in zip(items, request.items) if msg.hidden.WhichOneof("payload") != "ipc"]
        validate.all_finite([it.hidden for it, _ in inline], [f"sequence {it.seq_id!r}" for it, _ in inline])
        restarted = [it.seq_id for it in items if it.start]
        self.drafter.release(restarted)  # start on a sequence we hold restarts it (a gateway catching us up)
        t0 = time.perf_counter()
        trees = yield from self.drafter.propose_steps(items)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # IPC reads done before we answer
        compute_us = int((time.perf_counter() - t0) * 1e6)
        resp = pb.ProposeResponse(compute_us=compute_us)
        for it, t in zip(items, trees):  # built in place, no copies of nested messages
            tree_msg(t, resp.results.add(seq_id=it.seq_id).tree)
        return resp
