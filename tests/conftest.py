from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.router.app import RouterApp
from kvroute.worker_agent.server import AgentApp
from tests.support import RedisProc, build_wheel


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kvroute's wheel (:func:`tests.support.build_wheel`), built once per test session."""
    return build_wheel(tmp_path_factory.mktemp("wheel"), tmp_path_factory.mktemp("src"))


@pytest.fixture
def redis_server() -> Iterator[RedisProc]:
    r = RedisProc()
    r.start()
    try:
        yield r
    finally:
        r.stop()


def agent_config(redis_url: str, worker_id: str, **kw: Any) -> AgentConfig:
    base = dict(redis=redis_url, port=0, worker_id=worker_id, time_scale=0.0,
                heartbeat_s=0.1, heartbeat_ttl_s=1.0, capacity_blocks=2048)
    base.update(kw)
    return AgentConfig.of(**base)


def router_config(redis_url: str, **kw: Any) -> RouterConfig:
    base = dict(redis=redis_url, port=0, poll_interval_s=0.1, redis_retry_s=0.2)
    base.update(kw)
    return RouterConfig.of(**base)


@pytest.fixture
async def cluster(redis_server: RedisProc) -> AsyncIterator[Callable[..., Any]]:
    """Start in-process agents and routers (real gRPC servers on free ports); all stopped
    at the end of the test."""
    started: list[AgentApp | RouterApp] = []

    async def start_agent(worker_id: str, **kw: Any) -> AgentApp:
        app = AgentApp(agent_config(redis_server.url, worker_id, **kw))
        await app.start()
        started.append(app)
        return app

    async def start_router(**kw: Any) -> RouterApp:
        app = RouterApp(router_config(redis_server.url, **kw))
        await app.start(wait_for_redis_s=5.0)
        started.append(app)
        return app

    class Cluster:
        redis = redis_server
        agent = staticmethod(start_agent)
        router = staticmethod(start_router)

        @staticmethod
        async def stop(app: AgentApp | RouterApp) -> None:
            started.remove(app)
            await app.stop(grace_s=0.5)

    yield Cluster  # type: ignore[misc]
    for app in reversed(started):
        await app.stop(grace_s=0.5)


