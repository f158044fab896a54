"""What every service's gRPC server shares: start-up with health and reflection, the mapping from our
exception types to status codes, and the generated stubs' import."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer
from grpc_reflection.v1alpha._base import _file_descriptor_response, _not_found_error

from common.errors import CapacityExhausted, InvalidRequest, PeerUnavailable, UnknownSequence

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def status_for(exc: BaseException) -> grpc.StatusCode:
    """Our exception types -> gRPC status codes; anything unexpected is INTERNAL."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, UnknownSequence):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, CapacityExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, PeerUnavailable):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code()
    return grpc.StatusCode.INTERNAL


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.details() or str(exc.code())
    return str(exc)


class MethodAwareReflection(ReflectionServicer):
    """Stock grpcio-reflection answers `file_containing_symbol` only for messages and services, so
    `grpcurl describe pkg.Service.Method` (and ghz's `--call` resolution) fails (grpc issue 34743).
    A method's file is its service's file: fall back to that."""

    def _file_containing_symbol(self, request, fully_qualified_name):
        try:
            descriptor = self._pool.FindFileContainingSymbol(fully_qualified_name)
        except KeyError:
            service_name, _, method = fully_qualified_name.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name)
            except KeyError:
                return _not_found_error(request)
            if method not in service.methods_by_name:
                return _not_found_error(request)
            descriptor = service.file
        return _file_descriptor_response(descriptor, request)


@dataclass
class Server:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer

    async def stop(self, grace: float = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_server(address: str, register: Iterable[tuple[Callable, object]],
                       service_names: Iterable[str]) -> Server:
    """Start a grpc.aio server on `address` ("127.0.0.1:0" picks a free port) with our servicers,
    grpc.health.v1 (SERVING for "" and each service) and method-aware reflection."""
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    for add, servicer in register:
        add(servicer, server)
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        MethodAwareReflection(names + ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"],
                              pool=descriptor_pool.Default()), server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    for name in [""] + names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d", ", ".join(names), port)
    return Server(server=server, port=port, health=health_servicer)


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]
