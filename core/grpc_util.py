"""What both gRPC servers share: a server owning its port, health checking, reflection, metrics
endpoint, shutdown, and handlers that keep a GenerateRequest's wire bytes."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, make_wsgi_app, start_http_server
from prometheus_client.exposition import ThreadingWSGIServer

from kvroute.core.ports import address, describe, refuse_port, why_unbindable
from kvroute.core.tls import TlsConfig, TlsError, san_guard, server_credentials
from kvroute.v1 import common_pb2

log = logging.getLogger("kvroute")


def add_standard_services(server: grpc.aio.Server, services: Iterable[str],
                          with_reflection: bool = True) -> Any:
    """Register grpc.health.v1 (every service SERVING) and, with ``with_reflection`` (the
    config's ``grpc_reflection``), server reflection: grpcurl needs it without .proto files,
    but it also tells anyone who reaches the port every method, so the chart turns it off."""
    names = list(services)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    if with_reflection:
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


# A route beside /metrics: the query string's parameters -> a JSON-serialisable answer.
DebugRoute = Callable[[dict[str, list[str]]], object]


def start_metrics(port: int, host: str, registry: CollectorRegistry,
                  setting: str = "metrics_port",
                  routes: Mapping[str, DebugRoute] | None = None) -> Any:
    """Serve ``registry`` on http://host:port/metrics; returns the HTTP server (or None).
    ``routes`` adds JSON paths beside it (e.g. the router's ``/debug/mirror``).
    A port it cannot take ends the process naming config field ``setting``'s flag and
    environment variable, as for the gRPC port (:func:`bind`): call it before starting
    anything that would have to be stopped."""
    if port <= 0:
        return None
    try:
        if not routes:
            server, _thread = start_http_server(port, addr=host, registry=registry)
            return server
        server = make_server(host, port, _with_routes(make_wsgi_app(registry), routes),
                             ThreadingWSGIServer, handler_class=_QuietHandler)
    except OSError as exc:
        raise refuse_port(setting, host, port, describe(exc)) from None
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass  # a scrape per second is not worth a log line


def _with_routes(metrics_app: Any, routes: Mapping[str, DebugRoute]) -> Any:
    def app(environ: dict[str, Any], start_response: Any) -> Any:
        route = routes.get(environ.get("PATH_INFO", ""))
        if route is None:
            return metrics_app(environ, start_response)
        try:
            body, status = json.dumps(route(parse_qs(environ.get("QUERY_STRING", "")))), "200 OK"
        except Exception as exc:  # a debug answer must not take the server down
            body, status = json.dumps({"error": f"{exc}"}), "500 Internal Server Error"
        data = body.encode()
        start_response(status, [("Content-Type", "application/json"),
                                ("Content-Length", str(len(data)))])
        return [data]
    return app


# SO_REUSEPORT (gRPC's default) would let a second server bind a port one already serves,
# and the kernel then spreads connections over both: a second agent given a running one's
# port would start and take half its calls.
SERVER_OPTIONS = (("grpc.so_reuseport", 0),)

REFUSED_FIELD = "kvroute-refused-field"
"""Trailing metadata of a refusal: the request field it is about (``program.fanout``), so a
caller reports it by field, not by reading the message."""


def new_server(tls: TlsConfig | None = None,
               interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A gRPC server that owns the port it binds (:data:`SERVER_OPTIONS`): every server the
    project starts is made here. ``tls.allowed_sans`` puts :func:`san_guard` before
    ``interceptors`` (a call from a certificate not allowed goes no further)."""
    guards = [san_guard(tls.allowed_sans)] if tls is not None and tls.allowed_sans else []
    return grpc.aio.server(options=SERVER_OPTIONS, interceptors=[*guards, *interceptors])


def bind(server: grpc.aio.Server, host: str, port: int, setting: str = "port",
         tls: TlsConfig | None = None) -> int:
    """Bind a port and return it (the one picked, for port 0): TLS when ``tls.serving``
    (:func:`kvroute.core.tls.server_credentials`), else plaintext. A port it cannot
    bind ends the process naming config field ``setting``'s flag and environment variable
    and why: ``--port 50061 (KVROUTE_PORT): address 127.0.0.1:50061 is already in use``; so
    does a certificate that does not load."""
    try:
        if tls is not None and tls.serving:
            try:
                creds = server_credentials(tls)
            except TlsError as exc:
                raise SystemExit(str(exc)) from None
            bound = server.add_secure_port(address(host, port), creds)
        else:
            bound = server.add_insecure_port(address(host, port))
    except RuntimeError:  # grpcio >= 1.53 raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise refuse_port(setting, host, port, why_unbindable(host, port))
    return bound


class HealthPort:
    """``--health-port``: a plaintext gRPC port serving only grpc.health.v1, with the main
    server's health servicer, for probes that cannot do TLS or present a client certificate
    (the kubelet's gRPC probes). Bound at once (a taken port ends the start before anything
    runs), served by :meth:`start`."""

    def __init__(self, host: str, port: int) -> None:
        self.server: grpc.aio.Server | None = None
        self.port = 0
        if port:
            self.server = new_server()
            self.port = bind(self.server, host, port, "health_port")

    async def start(self, hs: Any) -> None:
        if self.server is not None:
            health_pb2_grpc.add_HealthServicer_to_server(hs, self.server)
            await self.server.start()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
            self.server = None


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)


async def serve_until_signalled(start: Callable[[], Awaitable[Any]],
                                stop: Callable[[], Awaitable[None]]) -> None:
    """A process's life: ``start()``, serve until SIGINT or SIGTERM, ``stop()``."""
    signalled = asyncio.Event()
    install_signal_handlers(signalled)
    await start()
    await signalled.wait()
    await stop()


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
