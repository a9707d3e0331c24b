"""The whole path over a real 3-node Redis Cluster: every key of a model in one slot."""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvroute.core.redis_schema import RedisKeys
from kvroute.router.app import RouterApp
from kvroute.worker_agent.server import AgentApp
from tests.conftest import agent_config, router_config
from tests.support import (
    LoadLoop,
    RedisProc,
    free_cluster_port,
    generate,
    redis_binary,
    wait_for,
)


def redis_cli() -> str:
    found = shutil.which("redis-cli") or str(Path(redis_binary()).with_name("redis-cli"))
    if not Path(found).exists():
        pytest.fail("redis-cli not found: apt-get install redis-tools")
    return found


cluster_port = free_cluster_port  # tests/e2e/test_redis_tls.py imports it by this name


@contextlib.contextmanager
def cluster_of(masters: int, replicas: int, *extra: str) -> Iterator[list[RedisProc]]:
    """Cluster-enabled redis-servers joined with `redis-cli --cluster create`."""
    with tempfile.TemporaryDirectory() as tmp:
        nodes = [RedisProc(port=cluster_port()) for _ in range(masters * (1 + replicas))]
        for n in nodes:
            # No delay before a replica's first sync (Redis 7 waits 5 s for more replicas).
            n.extra = ["--cluster-enabled", "yes", "--cluster-config-file",
                       f"nodes-{n.port}.conf", "--dir", tmp, "--repl-diskless-sync-delay", "0",
                       *extra]
        try:
            for n in nodes:
                n.start()
            subprocess.run([redis_cli(), "--cluster", "create",
                            *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas",
                            str(replicas), "--cluster-yes"], check=True, capture_output=True,
                           timeout=60)
            wait_cluster_ok(nodes[0].port)
            wait_replicas_synced(nodes)
            yield nodes
        finally:
            for n in nodes:
                n.stop()


def wait_replicas_synced(nodes: list[RedisProc], timeout_s: float = 20) -> None:
    """Until every replica has finished its first sync: one that has not refuses to fail
    over (its data counts as infinitely old), so a failover test would find none."""
    deadline = time.monotonic() + timeout_s
    for n in nodes:
        rc = redis.Redis(port=n.port)
        while True:
            info = rc.info("replication")
            if info.get("role") != "slave" or info.get("master_link_status") == "up":
                break
            if time.monotonic() > deadline:
                pytest.fail(f"replica {n.port} never finished its first sync")
            time.sleep(0.05)
        rc.close()


def wait_cluster_ok(port: int, timeout_s: float = 20) -> None:
    rc = redis.Redis(port=port)
    deadline = time.monotonic() + timeout_s
    while rc.cluster("INFO").get("cluster_state") != "ok":
        if time.monotonic() > deadline:
            pytest.fail("the redis cluster never reached state ok")
        time.sleep(0.05)
    rc.close()


@pytest.fixture
def redis_cluster() -> Iterator[list[int]]:
    """Three masters, no replicas."""
    with cluster_of(3, 0) as nodes:
        yield [n.port for n in nodes]


async def test_routing_over_a_redis_cluster(redis_cluster: list[int]) -> None:
    url = f"redis+cluster://127.0.0.1:{redis_cluster[1]}"
    agents = [AgentApp(agent_config(url, f"w{i}")) for i in range(2)]
    router = RouterApp(router_config(url))
    try:
        for a in agents:
            await a.start()
        await router.start(wait_for_redis_s=10)
        await wait_for(lambda: len(router.registry.loads) == 2, 15, "workers via the cluster")
        rng = random.Random(1)
        shared = [rng.randrange(50257) for _ in range(1024)]
        first = await generate(router.port, [*shared, 1, 2, 3])
        w = first[0].worker_id
        await wait_for(lambda: router.mirror.index.count(w) >= 64, 10, "feed over the cluster")
        second = await generate(router.port, [*shared, 4, 5, 6])
        assert second[0].worker_id == w and second[0].cached_tokens >= 1008
        # Every key kvroute wrote lives in the one slot of the model's hash tag.
        keys = RedisKeys("default")
        rc = redis.RedisCluster(host="127.0.0.1", port=redis_cluster[0])
        slot = rc.keyslot(keys.feed)
        names = [keys.feed, keys.snapshot(w), keys.meta(w), keys.heartbeat(w)]
        assert {rc.keyslot(n) for n in names} == {slot}
        assert rc.exists(*names) == len(names)
        rc.close()
    finally:
        await router.stop(grace_s=0.5)
        for a in agents:
            await a.stop(grace_s=0.5)


async def test_a_failover_to_a_replica_forgets_no_live_worker_and_fails_no_request() -> None:
    """The model's slot master SIGKILLed under load: its replica takes over after the
    cluster's node timeout (1 s here), by when every heartbeat (1 s TTL) has expired."""
    with cluster_of(3, 1, "--cluster-node-timeout", "1000") as nodes:
        url = f"redis+cluster://127.0.0.1:{nodes[0].port}"
        agents = [AgentApp(agent_config(url, f"w{i}")) for i in range(3)]
        router = RouterApp(router_config(url))
        try:
            for a in agents:
                await a.start()
            await router.start(wait_for_redis_s=10)
            workers = {f"w{i}" for i in range(3)}
            await wait_for(lambda: set(router.registry.loads) == workers, 15, "registered")
            await asyncio.sleep(1.5)  # past the router's start-up reprieve
            rc = redis.RedisCluster(host="127.0.0.1", port=nodes[0].port)
            master = rc.get_node_from_key(RedisKeys("default").feed)
            rc.close()
            victim = next(n for n in nodes if n.port == master.port)
            load = LoadLoop(router.port, router).start()
            await asyncio.sleep(0.5)
            assert victim.proc is not None
            victim.proc.kill()
            victim.proc.wait()
            others = [n for n in nodes if n is not victim]
            await asyncio.to_thread(wait_cluster_ok, others[0].port, 30)
            await wait_for(lambda: not router.mirror.lost or not router.mirror.lost.kept,
                           15, "every worker beating again")
            await asyncio.sleep(1.0)
            await load.stop()
            assert not load.failed, load.failed[:3]
            assert load.seen and all(s == workers for s in load.seen), \
                "a live worker was forgotten"
            # The mirror follows the feed again once its client has the new slot map (its
            # retries: ~2-3 s after the heartbeats here).
            await wait_for(lambda: router.mirror.available, 10, "the mirror back")
        finally:
            await router.stop(grace_s=0.5)
            for a in agents:
                await a.stop(grace_s=0.5)
