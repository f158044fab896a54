"""The gateway's view of the draft and verifier services: batched calls over grpc.aio channels.
Trees and tensors pass through as messages: the gateway never decodes a TensorRef, so an IPC
reference reaches the draft exactly as the verifier wrote it."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from common.config import SamplingConfig
from common.errors import PeerUnavailable
from common.rpc import CHANNEL_OPTIONS
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class Prefilled:
    next_token: int
    hidden: pb.TensorRef  # [prompt_len, 3H]


@dataclass(frozen=True)
class Verified:
    tokens: list[int]     # [num_accepted + 1]
    hidden: pb.TensorRef  # [num_accepted + 1, 3H]


@dataclass(frozen=True)
class Batched:
    """Per-sequence results of one batched call, and the engine time the service reported."""

    results: list
    compute_s: float


def sampling_msg(s: SamplingConfig) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                             seed=s.seed or 0, has_seed=s.seed is not None)


async def _call(method, request, timeout: float):
    try:
        return await method(request, timeout=timeout)
    except grpc.aio.AioRpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise PeerUnavailable(f"{method._method.decode() if hasattr(method, '_method') else 'peer'}: "
                                  f"{e.details()}") from e
        raise


class VerifierClient:
    def __init__(self, address: str, timeout: float = 120.0) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.VerifierStub(self.channel)
        self.timeout = timeout

    async def info(self) -> pb.InfoResponse:
        return await _call(self.stub.Info, pb.InfoRequest(), self.timeout)

    async def prefill(self, seq_id: str, token_ids: list[int], sampling: SamplingConfig,
                      want_hidden: bool) -> Prefilled:
        req = pb.PrefillRequest(items=[pb.PrefillItem(seq_id=seq_id, token_ids=token_ids,
                                                      sampling=sampling_msg(sampling), want_hidden=want_hidden)])
        r = (await _call(self.stub.Prefill, req, self.timeout)).results[0]
        return Prefilled(next_token=r.next_token, hidden=r.hidden)

    async def verify(self, items: list[tuple[str, pb.DraftTree]]) -> Batched:
        req = pb.VerifyRequest(items=[pb.VerifyItem(seq_id=s, tree=t) for s, t in items])
        resp = await _call(self.stub.Verify, req, self.timeout)
        return Batched([Verified(tokens=list(r.accepted_tokens), hidden=r.hidden) for r in resp.results],
                       resp.compute_us / 1e6)

    async def decode(self, seq_ids: list[str]) -> list[int]:
        req = pb.DecodeRequest(items=[pb.DecodeItem(seq_id=s) for s in seq_ids])
        resp = await _call(self.stub.Decode, req, self.timeout)
        return [r.next_token for r in resp.results]

    async def release(self, seq_ids: list[str]) -> None:
        await _call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), self.timeout)

    async def export_hidden(self, enable: bool) -> pb.IpcBuffer:
        return await _call(self.stub.ExportHidden, pb.ExportRequest(enable=enable), self.timeout)

    async def close(self) -> None:
        await self.channel.close()


class DraftClient:
    def __init__(self, address: str, timeout: float = 120.0) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.DraftStub(self.channel)
        self.timeout = timeout

    async def info(self) -> pb.DraftInfoResponse:
        return await _call(self.stub.Info, pb.InfoRequest(), self.timeout)

    async def propose(self, items: list[pb.ProposeItem]) -> Batched:
        resp = await _call(self.stub.Propose, pb.ProposeRequest(items=items), self.timeout)
        return Batched([r.tree for r in resp.results], resp.compute_us / 1e6)

    async def release(self, seq_ids: list[str]) -> None:
        await _call(self.stub.Release, pb.ReleaseRequest(seq_ids=seq_ids), self.timeout)

    async def import_buffer(self, buf: pb.IpcBuffer) -> None:
        await _call(self.stub.ImportBuffer, buf, self.timeout)

    async def close(self) -> None:
        await self.channel.close()


async def connect_ipc(verifier: VerifierClient, draft: DraftClient, vinfo: pb.InfoResponse,
                      dinfo: pb.DraftInfoResponse) -> bool:
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
