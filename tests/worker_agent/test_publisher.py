"""The agent's publisher against a real redis-server and a real SimEngine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import AsyncIterator
from typing import Any

from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import FeedEvent, Heartbeat, Op, RedisKeys, unpack_keys
from kvroute.worker_agent.engines.base import EngineRequest
from kvroute.worker_agent.engines.sim import SimConfig, SimEngine
from kvroute.worker_agent.publisher import CachePublisher
from tests.support import wait_for

KEYS = RedisKeys("default")


def make(redis_url: str, capacity: int = 256, host_blocks: int = 0,
         **kw: object) -> tuple[SimEngine, CachePublisher]:
    engine = SimEngine(SimConfig(capacity_blocks=capacity, model="default", time_scale=0.0,
                                 host_blocks=host_blocks))
    pub = CachePublisher(
        connect(redis_url), KEYS, "w1", engine.cached_keys,
        lambda: Heartbeat("w1", "127.0.0.1:1", pub.epoch), lower=engine.lower_keys,
        **{"heartbeat_s": 0.05, "heartbeat_ttl_s": 1.0, **kw})  # type: ignore[arg-type]
    engine.add_listener(pub.on_event)
    return engine, pub


async def run(engine: SimEngine, n_tokens: int, seed: int) -> None:
    rng = random.Random(seed)
    req = EngineRequest(f"r{seed}", [rng.randrange(50000) for _ in range(n_tokens)], 4)
    [c async for c in engine.generate(req)]


def snapshot(client, worker: str = "w1") -> set[int]:
    return {unpack_keys(m)[0] for m in client.smembers(KEYS.snapshot(worker))}


def lower_set(client, worker: str = "w1") -> set[int]:
    return {unpack_keys(m)[0] for m in client.smembers(KEYS.lower(worker))}


def feed(client) -> list[FeedEvent]:
    return [FeedEvent.from_fields(f) for _, f in client.xrange(KEYS.feed)]


async def test_feed_and_snapshot_follow_the_engine(redis_server) -> None:
    engine, pub = make(redis_server.url, capacity=64)
    announced = pub.epoch  # what the agent logs and registers at start
    await engine.start()
    await pub.start()
    client = redis_server.client()
    try:
        await wait_for(lambda: pub.seq == 1, what="first epoch declared")
        assert pub.epoch == announced, "the start-up snapshot is under the announced epoch"
        for i in range(12):  # 12 x 20 blocks through a 64-block cache: evictions happen
            await run(engine, 320, i)
        await wait_for(lambda: pub.stats.pending == 0 and snapshot(client)
                       == set(engine.cached_keys()), what="snapshot equals engine state")
        events = feed(client)
        assert events[0].op is Op.CLEAR and events[0].seq == 1
        assert [e.seq for e in events] == list(range(1, len(events) + 1))
        assert {e.epoch for e in events} == {pub.epoch}
        assert any(e.op is Op.EVICT for e in events)
        # Replaying the feed gives exactly the snapshot.
        state: set[int] = set()
        for e in events:
            if e.op is Op.STORE:
                state |= set(e.keys)
            elif e.op is Op.EVICT:
                state -= set(e.keys)
        assert state == snapshot(client)
        meta = client.hgetall(KEYS.meta("w1"))
        assert int(meta[b"seq"]) == events[-1].seq
        await wait_for(lambda: Heartbeat.from_json(client.get(KEYS.heartbeat("w1"))).epoch
                       == pub.epoch, what="heartbeat names the current epoch")
        assert client.pttl(KEYS.heartbeat("w1")) > 0
    finally:
        await pub.stop()
        await engine.stop()
    assert client.get(KEYS.heartbeat("w1")) is None  # a clean stop deregisters


async def test_overflow_while_redis_is_down_resyncs_with_nothing_lost(redis_server) -> None:
    engine, pub = make(redis_server.url, max_pending=3)
    await engine.start()
    await pub.start()
    client = redis_server.client()
    try:
        await wait_for(lambda: pub.seq == 1, what="first epoch declared")
        first_epoch = pub.epoch
        redis_server.stop()
        for i in range(6):
            await run(engine, 64, i)
        await wait_for(lambda: not pub.stats.redis_up, what="publisher saw redis down")
        redis_server.start()
        client = redis_server.client()
        await wait_for(lambda: pub.epoch != first_epoch and pub.stats.pending == 0, 10,
                       "resync after the outage")
        await wait_for(lambda: snapshot(client) == set(engine.cached_keys()), 10,
                       "snapshot equals engine state")
        assert len(snapshot(client)) == 6 * 4
    finally:
        await pub.stop()
        await engine.stop()


@contextlib.asynccontextmanager
async def ten_blocks_published(redis_server, **kw: object
                               ) -> AsyncIterator[tuple[SimEngine, CachePublisher, Any]]:
    """A running engine and publisher whose first 10 blocks Redis holds; stopped after."""
    engine, pub = make(redis_server.url, **kw)
    await engine.start()
    await pub.start()
    client = redis_server.client()
    try:
        await run(engine, 160, 1)
        await wait_for(lambda: len(snapshot(client)) == 10 and pub.stats.pending == 0,
                       what="published")
        yield engine, pub, client
    finally:
        await pub.stop()
        await engine.stop()


async def test_a_host_tier_is_published_beside_the_snapshot(redis_server) -> None:
    """Blocks evicted to the host tier: LOWER entries, the lower-tier set equal to the
    engine's; a resync rewrites it whole; replaying the feed gives both sets."""
    engine, pub = make(redis_server.url, capacity=64, host_blocks=48)
    await engine.start()
    await pub.start()
    client = redis_server.client()
    try:
        # The feed is replayed below from the agent's first entry, which declares its epoch
        # (with the engine still empty, a CLEAR): blocks stored before that entry is
        # written would go in a RESYNC's snapshot instead, not in the feed.
        await wait_for(lambda: [e.op for e in feed(client)] == [Op.CLEAR], what="the epoch")
        for i in range(8):  # 8 x 20 blocks through 64 GPU + 48 host blocks: both evict
            await run(engine, 320, i)
        await wait_for(lambda: pub.stats.pending == 0 and snapshot(client)
                       == set(engine.cached_keys()) and lower_set(client)
                       == set(engine.lower_keys()), what="both sets equal the engine's")
        assert 0 < len(lower_set(client)) <= 48
        events = feed(client)
        assert {Op.LOWER, Op.EVICT, Op.STORE} <= {e.op for e in events}
        held: dict[int, Op] = {}  # key -> its best tier, replayed from the feed
        for e in events:
            for key in e.keys:
                if e.op is Op.EVICT:
                    held.pop(key, None)
                else:
                    held[key] = e.op
        assert set(held) == snapshot(client)
        assert {k for k, op in held.items() if op is Op.LOWER} == lower_set(client)
        client.delete(KEYS.snapshot("w1"))  # a lost key: the resync rewrites both sets
        old = pub.epoch
        await wait_for(lambda: pub.epoch != old and lower_set(client)
                       == set(engine.lower_keys()) and snapshot(client)
                       == set(engine.cached_keys()), 5, "rewritten whole")
        assert client.pttl(KEYS.lower("w1")) > 0  # it expires with the snapshot
    finally:
        await pub.stop()
        await engine.stop()
    assert not client.exists(KEYS.lower("w1"))  # a clean stop deregisters it too


async def test_lost_snapshot_is_rewritten_under_a_new_epoch(redis_server) -> None:
    async with ten_blocks_published(redis_server) as (_, pub, client):
        old = pub.epoch
        client.flushall()
        await wait_for(lambda: len(snapshot(client)) == 10 and pub.epoch != old, 10,
                       "snapshot rewritten")
        events = feed(client)
        assert events[0].op is Op.RESYNC and events[0].epoch == pub.epoch


async def test_a_flush_found_by_the_next_write_is_healed_whole(redis_server) -> None:
    # The write right after a FLUSHALL recreates the snapshot and meta under the same epoch:
    # only what it wrote would be left, for good, were it not checked. No heartbeat check
    # here: the write itself must notice.
    async with ten_blocks_published(redis_server, heartbeat_s=3600.0) as (engine, pub, client):
        old = pub.epoch
        client.flushall()
        await run(engine, 64, 2)  # 4 more blocks, written into the emptied Redis
        await wait_for(lambda: pub.epoch != old and snapshot(client)
                       == set(engine.cached_keys()), 5, "the whole snapshot rewritten")
        assert len(snapshot(client)) == 14 and pub.stats.state_losses == 1


async def test_an_evicted_snapshot_key_is_rewritten(redis_server) -> None:
    # maxmemory eviction takes the set alone; the meta and its epoch stay.
    async with ten_blocks_published(redis_server) as (engine, pub, client):
        old = pub.epoch
        client.delete(KEYS.snapshot("w1"))
        await wait_for(lambda: pub.epoch != old and len(snapshot(client)) == 10, 5,
                       "snapshot rewritten after the heartbeat saw it gone")
        assert pub.stats.state_losses == 1
        await run(engine, 64, 2)  # and the size kept since then matches what Redis holds
        await wait_for(lambda: snapshot(client) == set(engine.cached_keys()), 5, "followed")
        await wait_for(lambda: pub.stats.pending == 0, what="flushed")
        await asyncio.sleep(0.3)  # several heartbeats: no further loss is seen
        assert pub.stats.state_losses == 1


async def test_a_redis_never_reached_is_logged_at_start(caplog) -> None:
    # The first state is logged too: a wrong address or password used to go unsaid (the
    # warning came only on a change from reachable to not).
    from tests.support import free_port

    engine, pub = make(f"redis://127.0.0.1:{free_port()}")
    await engine.start()
    with caplog.at_level(logging.WARNING, logger="kvroute"):
        await pub.start()
        try:
            await wait_for(lambda: "redis unreachable; buffering cache events" in caplog.text,
                           what="the warning")
            assert not pub.stats.redis_up
        finally:
            await pub.stop()
            await engine.stop()
    assert caplog.text.count("redis unreachable") == 1  # said once, not at every retry


async def test_the_heartbeat_loop_survives_the_cluster_clients_runtime_error(
        redis_server) -> None:
    # redis-py's cluster client can raise RuntimeError("Event loop is closed") when it drops
    # a connection; it once ended a heartbeat loop for good, and routers pruned the worker
    # while its agent ran on (bench/scale.py at 1,000 workers).
    engine = SimEngine(SimConfig(capacity_blocks=64, model="default", time_scale=0.0))
    calls = []

    def beat() -> Heartbeat:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("Event loop is closed")
        return Heartbeat("w1", "127.0.0.1:1", pub.epoch)

    pub = CachePublisher(connect(redis_server.url), KEYS, "w1", engine.cached_keys, beat,
                         heartbeat_s=0.05, heartbeat_ttl_s=1.0)
    client = redis_server.client()
    client.delete(KEYS.heartbeat("w1"))  # an earlier test's worker w1 may have beaten
    await pub.start()
    try:
        await wait_for(lambda: client.exists(KEYS.heartbeat("w1")), 10, "a heartbeat")
        assert len(calls) >= 2
        await wait_for(lambda: pub.stats.redis_up, 10, "redis up")
    finally:
        await pub.stop()
