"""Helpers of the fault tests: streams that run in threads while a test kills a service, probes of the
services' state, and the figures the tests log (requests sent, failed, seconds to recover)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import generation_pb2 as gpb
from specdec.v1 import generation_pb2_grpc as gpb_grpc
from specdec.v1 import internal_pb2 as pb
from specdec.v1 import internal_pb2_grpc as pb_grpc

log = logging.getLogger("faults")


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)  # [completion_tokens] streamed so far
    error: grpc.RpcError | None = None
    last: gpb.GenerateResponse | None = None


class Streams:
    """Generate calls running in threads (one channel each); `wait_tokens` blocks until every stream has
    produced at least n tokens, so a fault lands mid-generation."""

    def __init__(self, addr: str, requests: list[gpb.GenerateRequest], timeout: float = 300) -> None:
        self.outcomes = [Outcome() for _ in requests]
        self._threads = [
            threading.Thread(target=self._run, args=(addr, r, o, timeout), daemon=True)
            for r, o in zip(requests, self.outcomes)
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _run(addr: str, request: gpb.GenerateRequest, out: Outcome, timeout: float) -> None:
        with grpc.insecure_channel(addr) as ch:
            try:
                for msg in gpb_grpc.GenerationStub(ch).Generate(request, timeout=timeout):
                    out.tokens.extend(msg.token_ids)
                    out.last = msg
            except grpc.RpcError as e:
                out.error = e

    def wait_tokens(self, n: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while any(len(o.tokens) < n and o.error is None for o in self.outcomes):
            if time.monotonic() > deadline:
                raise TimeoutError(f"streams did not reach {n} tokens within {timeout} s")
            time.sleep(0.02)

    def join(self, timeout: float = 300) -> list[Outcome]:
        for t in self._threads:
            t.join(timeout)
        return self.outcomes

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.error is not None]


def info(addr: str, draft: bool = False):
    with grpc.insecure_channel(addr) as ch:
        stub = pb_grpc.DraftStub(ch) if draft else pb_grpc.VerifierStub(ch)
        return stub.Info(pb.InfoRequest(), timeout=10)


def held(stack) -> tuple[int, int]:
    """(verifier, draft) sequences held now."""
    return (info(stack.address("verifier")).active_sequences, info(stack.address("draft"), draft=True).active_sequences)


def wait_for(predicate, timeout: float, interval: float = 0.1) -> float:
    """Seconds until predicate() is true; TimeoutError past `timeout`."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - t0


def health(addr: str, timeout: float = 2.0) -> str:
    """The server's overall health: SERVING, NOT_SERVING, or UNREACHABLE."""
    with grpc.insecure_channel(addr) as ch:
        try:
            r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def complete(addr: str, request: gpb.GenerateRequest, timeout: float = 120) -> gpb.CompleteResponse:
    with grpc.insecure_channel(addr) as ch:
        return gpb_grpc.GenerationStub(ch).Complete(request, timeout=timeout)


def figures(name: str, **numbers) -> None:
    """The measured figures of one fault, in one greppable line."""
    log.info(
        "FAULT %s: %s",
        name,
        ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items()),
    )
