"""What both gRPC servers share: health checking, reflection, metrics endpoint, shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, start_http_server

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


def start_metrics(port: int, host: str, registry: CollectorRegistry) -> Any:
    """Serve ``registry`` on http://host:port/metrics; returns the HTTP server (or None)."""
    if port <= 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind an insecure port; a clear error if it is taken."""
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {host}:{port} (in use or not permitted)")
    return bound


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
