"""What every service's gRPC server shares: start-up with health and reflection, the mapping from our
exception types to status codes, and the generated stubs' import."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc
from grpc_reflection.v1alpha._async import ReflectionServicer
from grpc_reflection.v1alpha._base import _file_descriptor_response, _not_found_error

from common.errors import CapacityExhausted, InvalidRequest, PeerUnavailable, UnknownSequence

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20  # internal links: a whole context's hidden states travel inline
# Reconnection after a peer restarts: gRPC's defaults back off from 1 s by 1.6x up to 120 s, so a
# service that was down for a minute is noticed up to a minute late. Here: retry every 100 ms at
# first, never waiting more than 1 s (a loopback connect attempt costs nothing).
RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    *RECONNECT_OPTIONS,
]


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


class _Undecodable:
    """What a request that is not a valid message deserializes to; the handler answers INVALID_ARGUMENT."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserialize: Callable) -> Callable:
    def parse(raw: bytes):
        try:
            return deserialize(raw)
        except DecodeError as e:
            return _Undecodable(e)

    return parse


async def _reject_undecodable(request, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {request.error}")


async def _checked_stream(requests, context: grpc.aio.ServicerContext):
    async for r in requests:
        await _reject_undecodable(r, context)
        yield r


def _guard_unary_request(behavior: Callable) -> Callable:
    if inspect.isasyncgenfunction(behavior):  # unary request, streamed response

        async def stream_out(request, context):
            await _reject_undecodable(request, context)
            async for r in behavior(request, context):
                yield r

        return stream_out

    async def unary_out(request, context):
        await _reject_undecodable(request, context)
        return await behavior(request, context)

    return unary_out


def _guard_stream_request(behavior: Callable) -> Callable:
    if inspect.isasyncgenfunction(behavior):

        async def stream_out(requests, context):
            async for r in behavior(_checked_stream(requests, context), context):
                yield r

        return stream_out

    async def unary_out(requests, context):
        return await behavior(_checked_stream(requests, context), context)

    return unary_out


class DecodeErrorsAreInvalid(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse as the method's message end the call with INVALID_ARGUMENT
    (grpc's own answer is UNKNOWN, "Unexpected error"). Applies to our services (`prefix`); handlers
    are wrapped once per method."""

    def __init__(self, prefix: str = "/specdec.") -> None:
        self.prefix = prefix
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            wrapped = self._wrapped[details.method] = _guard(handler)
        return wrapped


def _guard(h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse, ser = _tolerant(h.request_deserializer), h.response_serializer
    if h.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_guard_unary_request(h.unary_unary), parse, ser)
    if h.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_guard_unary_request(h.unary_stream), parse, ser)
    if h.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_guard_stream_request(h.stream_unary), parse, ser)
    return grpc.stream_stream_rpc_method_handler(_guard_stream_request(h.stream_stream), parse, ser)


@dataclass
class Server:
    server: grpc.aio.Server
    port: int
    health: health.aio.HealthServicer
    names: list[str]  # "" and each service, as health reports them

    async def not_serving(self) -> None:
        """Health says NOT_SERVING for every service from now on; calls are still served."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float = 1.0) -> None:
        await self.not_serving()
        await self.server.stop(grace)

    async def set_serving(self, serving: bool) -> None:
        """The whole server's health (ignored once shutting down)."""
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.names:
            await self.health.set(name, status)


async def start_server(
    address: str,
    register: Iterable[tuple[Callable, object]],
    service_names: Iterable[str],
    max_request_bytes: int = MAX_MESSAGE_BYTES,
) -> Server:
    """Start a grpc.aio server on `address` ("127.0.0.1:0" picks a free port) with our servicers,
    grpc.health.v1 (SERVING for "" and each service) and method-aware reflection. Requests larger
    than `max_request_bytes` are refused by gRPC (RESOURCE_EXHAUSTED) before they are parsed."""
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_request_bytes),
    ]
    server = grpc.aio.server(options=options, interceptors=[DecodeErrorsAreInvalid()])
    for add, servicer in register:
        add(servicer, server)
    names = list(service_names)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
        MethodAwareReflection(
            names + ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"],
            pool=descriptor_pool.Default(),
        ),
        server,
    )
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    await server.start()
    for name in [""] + names:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("serving %s on port %d", ", ".join(names), port)
    return Server(server=server, port=port, health=health_servicer, names=[""] + names)


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]
