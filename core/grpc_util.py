"""What both gRPC servers share: a server owning its port, health checking, reflection, metrics
endpoint, shutdown, and handlers that keep a GenerateRequest's wire bytes."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

from kvroute.core.ports import address, describe, refuse_port, why_unbindable
from kvroute.v1 import common_pb2

log = logging.getLogger("kvroute")


def add_standard_services(server: grpc.aio.Server, services: Iterable[str]) -> Any:
    """Register grpc.health.v1 (every service SERVING) and server reflection."""
    names = list(services)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    reflection.enable_server_reflection(
        [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME],
        server,
    )
    return hs


async def set_serving(hs: Any, services: Iterable[str], serving: bool) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ["", *services]:
        await hs.set(name, status)


def start_metrics(port: int, host: str, registry: CollectorRegistry,
                  setting: str = "metrics_port") -> Any:
    """Serve ``registry`` on http://host:port/metrics; returns the HTTP server (or None).
    A port it cannot take ends the process naming config field ``setting``'s flag and
    environment variable, as for the gRPC port (:func:`bind`): call it before starting
    anything that would have to be stopped."""
    if port <= 0:
        return None
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise refuse_port(setting, host, port, describe(exc)) from None
    return server


# SO_REUSEPORT (gRPC's default) would let a second server bind a port one already serves,
# and the kernel then spreads connections over both: a second agent given a running one's
# port would start and take half its calls.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)


def new_server() -> grpc.aio.Server:
    """A gRPC server that owns the port it binds (:data:`SERVER_OPTIONS`): every server the
    project starts is made here."""
    return grpc.aio.server(options=SERVER_OPTIONS)


def bind(server: grpc.aio.Server, host: str, port: int, setting: str = "port") -> int:
    """Bind an insecure port and return it (the one picked, for port 0). A port it cannot
    bind ends the process naming config field ``setting``'s flag and environment variable
    and why: ``--port 50061 (KVROUTE_PORT): address 127.0.0.1:50061 is already in use``."""
    try:
        bound = server.add_insecure_port(address(host, port))
    except RuntimeError:  # grpcio >= 1.53 raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise refuse_port(setting, host, port, why_unbindable(host, port))
    return bound


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


@dataclass(frozen=True, slots=True)
class Received:
    """A GenerateRequest as gRPC delivered it: parsed, and the bytes it was parsed from, in
    which its token ids are read without a Python int each (:mod:`kvroute.core.wire`).
    Bytes that do not parse give ``msg`` None and the reason in ``error``: raised in a
    deserializer, the failure would reach the client as INTERNAL, not INVALID_ARGUMENT."""

    msg: common_pb2.GenerateRequest | None
    wire: bytes
    error: str = ""

    @classmethod
    def parse(cls, wire: bytes) -> Received:
        try:
            return cls(common_pb2.GenerateRequest.FromString(wire), wire)
        except DecodeError as exc:
            return cls(None, wire, f"malformed GenerateRequest ({len(wire)} bytes): {exc}")


def wire_keeping_handler(
    method: Callable[..., Any], response_serializer: Callable[[Any], bytes], *, stream: bool,
    on_invalid: Callable[[], None],
) -> grpc.RpcMethodHandler:
    """The handler of an RPC taking a GenerateRequest, for a servicer method called as
    ``method(request, context, wire)`` (``wire``: the bytes ``request`` was parsed from). A
    body that does not parse is refused with INVALID_ARGUMENT after ``on_invalid()``."""

    async def refuse(r: Received, context: grpc.aio.ServicerContext) -> None:
        on_invalid()
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, r.error)

    if stream:
        async def streamed(r: Received, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[Any]:
            if r.msg is None:
                await refuse(r, context)
            async for resp in method(r.msg, context, r.wire):
                yield resp

        return grpc.unary_stream_rpc_method_handler(
            streamed, request_deserializer=Received.parse,
            response_serializer=response_serializer)

    async def unary(r: Received, context: grpc.aio.ServicerContext) -> Any:
        if r.msg is None:
            await refuse(r, context)
        reply: Awaitable[Any] = method(r.msg, context, r.wire)
        return await reply

    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=Received.parse, response_serializer=response_serializer)


def add_handlers(server: grpc.aio.Server, service: ServiceDescriptor,
                 handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
    """Serve ``handlers`` as ``service``, as generated ``add_*Servicer_to_server`` code
    does; every method of the service must have one."""
    missing = set(service.methods_by_name) - set(handlers)
    if missing:  # a method added to the .proto must be added to the handlers too
        raise RuntimeError(f"{service.full_name} methods without a handler: {sorted(missing)}")
    handlers = dict(handlers)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
