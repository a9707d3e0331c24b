"""The router's mirror against a real redis-server, fed by hand-written feed entries."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import FeedEvent, Heartbeat, Op, RedisKeys, pack_keys
from kvroute.router.mirror import IndexMirror
from kvroute.router.registry import WorkerRegistry
from tests.support import collector_visits, wait_for

KEYS = RedisKeys("default")


def publish(client, ev: FeedEvent, snapshot: set[int] | None = None) -> None:
    """What an agent does, written out by hand: feed entry + snapshot + meta."""
    pipe = client.pipeline(transaction=True)
    pipe.xadd(KEYS.feed, ev.to_fields())
    if snapshot is not None:
        pipe.delete(KEYS.snapshot(ev.worker))
        if snapshot:
            pipe.sadd(KEYS.snapshot(ev.worker), *(pack_keys((k,)) for k in snapshot))
    pipe.hset(KEYS.meta(ev.worker), mapping={"epoch": ev.epoch, "seq": ev.seq})
    pipe.sadd(KEYS.workers, ev.worker)
    pipe.execute()


def beat(client, worker: str, block_size: int = 16) -> None:
    hb = Heartbeat(worker, "127.0.0.1:1", "e", block_size=block_size, ttl_s=1.0)
    client.set(KEYS.heartbeat(worker), hb.to_json(), px=1000)
    client.sadd(KEYS.workers, worker)


@pytest.fixture
async def mirror(redis_server) -> AsyncIterator[IndexMirror]:
    m = IndexMirror(connect(redis_server.url, block_timeout_s=0.05), KEYS,
                    WorkerRegistry({}, 16), poll_interval_s=0.05, retry_s=0.1)
    task = asyncio.create_task(m.run())
    await asyncio.wait_for(m.ready.wait(), 5)
    yield m
    await m.stop(task)


async def test_feed_is_applied_in_order(redis_server, mirror) -> None:
    c = redis_server.client()
    beat(c, "w")
    publish(c, FeedEvent("w", "e1", 1, Op.CLEAR))
    publish(c, FeedEvent("w", "e1", 2, Op.STORE, (1, 2, 3)))
    publish(c, FeedEvent("w", "e1", 3, Op.EVICT, (3,)))
    await wait_for(lambda: mirror.index.keys_of("w") == {1, 2}, what="events applied")
    assert mirror.index.match([1, 2, 3]) == {"w": 2}


async def test_a_gap_reloads_the_snapshot(redis_server, mirror) -> None:
    c = redis_server.client()
    beat(c, "w")
    publish(c, FeedEvent("w", "e1", 1, Op.CLEAR), snapshot=set())
    publish(c, FeedEvent("w", "e1", 2, Op.STORE, (1,)), snapshot={1})
    await wait_for(lambda: mirror.index.keys_of("w") == {1}, what="first events")
    # Seq 3 and 4 never reach the feed (e.g. trimmed); the snapshot has their effect.
    publish(c, FeedEvent("w", "e1", 5, Op.STORE, (9,)), snapshot={1, 7, 8, 9})
    await wait_for(lambda: mirror.index.keys_of("w") == {1, 7, 8, 9}, what="healed")
    assert mirror.stats.gaps == 1


async def test_unknown_epoch_mid_stream_reloads_and_clear_starts_fresh(redis_server,
                                                                      mirror) -> None:
    c = redis_server.client()
    beat(c, "w")
    publish(c, FeedEvent("w", "e1", 1, Op.CLEAR), snapshot=set())
    publish(c, FeedEvent("w", "e1", 2, Op.STORE, (1, 2)), snapshot={1, 2})
    await wait_for(lambda: mirror.index.count("w") == 2, what="first epoch")
    publish(c, FeedEvent("w", "e2", 1, Op.CLEAR), snapshot=set())  # agent restarted
    await wait_for(lambda: mirror.index.count("w") == 0, what="stale blocks dropped")
    publish(c, FeedEvent("w", "e3", 1, Op.RESYNC), snapshot={5, 6})
    await wait_for(lambda: mirror.index.keys_of("w") == {5, 6}, what="resync loaded")


async def test_malformed_entries_are_skipped_and_counted(redis_server, mirror) -> None:
    c = redis_server.client()
    beat(c, "w")
    c.xadd(KEYS.feed, {"w": "w", "op": "store"})
    c.set(KEYS.heartbeat("bad"), "not json")
    c.sadd(KEYS.workers, "bad")
    publish(c, FeedEvent("w", "e1", 1, Op.CLEAR))
    publish(c, FeedEvent("w", "e1", 2, Op.STORE, (4,)))
    await wait_for(lambda: mirror.index.keys_of("w") == {4}, what="good entries applied")
    await wait_for(lambda: mirror.stats.malformed >= 2, what="both malformed inputs counted")
    assert "bad" not in mirror.registry.loads


async def test_block_size_mismatch_is_flagged_and_ignored_for_matching(redis_server,
                                                                       mirror) -> None:
    c = redis_server.client()
    beat(c, "w32", block_size=32)
    await wait_for(lambda: "w32" in mirror.registry.loads, what="worker registered")
    assert not mirror.registry.compatible("w32")


async def test_a_worker_that_returns_without_an_event_is_read_from_its_snapshot(
        redis_server, mirror) -> None:
    """After a Redis restart a worker may rewrite its snapshot and beat again after the
    mirror bootstrapped, then send no event for a long while: the heartbeat scan reads its
    snapshot instead of waiting for one."""
    c = redis_server.client()
    pipe = c.pipeline(transaction=True)  # snapshot and meta, but no feed entry
    pipe.sadd(KEYS.snapshot("w"), *(pack_keys((k,)) for k in (4, 5, 6)))
    pipe.hset(KEYS.meta("w"), mapping={"epoch": "e2", "seq": 1})
    pipe.execute()
    beat(c, "w")
    await wait_for(lambda: mirror.index.keys_of("w") == {4, 5, 6}, what="snapshot read")
    assert mirror.registry.loads["w"].cached_blocks == 3
    # Its next event follows on from that snapshot.
    publish(c, FeedEvent("w", "e2", 2, Op.STORE, (7,)), snapshot={4, 5, 6, 7})
    await wait_for(lambda: mirror.index.keys_of("w") == {4, 5, 6, 7}, what="event applied")
    assert mirror.stats.gaps == 0


async def test_a_worker_without_readable_state_is_not_read_at_every_scan(
        redis_server, mirror) -> None:
    """A live worker whose snapshot is malformed is read (and counted) once, then again
    only after _SNAPSHOT_RETRY_S: not at every heartbeat scan."""
    c = redis_server.client()
    c.hset(KEYS.meta("w"), mapping={"epoch": "e1"})  # no seq: malformed
    beat(c, "w")
    await wait_for(lambda: mirror.stats.malformed == 1, what="its snapshot read")
    loads = mirror.stats.snapshot_loads
    await asyncio.sleep(10 * 0.05)  # ten heartbeat scans
    assert mirror.stats.snapshot_loads == loads and mirror.stats.malformed == 1
    assert "w" in mirror.registry.loads and mirror.index.count("w") == 0


async def test_expired_heartbeat_removes_worker_and_blocks(redis_server, mirror) -> None:
    c = redis_server.client()
    beat(c, "w")
    publish(c, FeedEvent("w", "e1", 1, Op.CLEAR))
    publish(c, FeedEvent("w", "e1", 2, Op.STORE, (1, 2)))
    await wait_for(lambda: mirror.index.count("w") == 2 and "w" in mirror.registry.loads,
                   what="indexed and registered")
    # No more heartbeats: the key's TTL (1 s) runs out.
    await wait_for(lambda: "w" not in mirror.registry.loads, 5, "expiry")
    assert mirror.index.count("w") == 0


async def test_the_bootstrapped_index_adds_nothing_per_block_to_a_full_collection(
        redis_server) -> None:
    # Every full collection walks whatever of the index the collector tracks: with a set
    # per worker, 1M entries made each one a ~100 ms stall of every routing decision.
    c = redis_server.client()
    for i, w in enumerate(("a", "b")):
        beat(c, w)
        publish(c, FeedEvent(w, "e1", 1, Op.RESYNC), snapshot=set(range(i, 2000 * (i + 1))))
    m = IndexMirror(connect(redis_server.url, block_timeout_s=0.05), KEYS,
                    WorkerRegistry({}, 16), poll_interval_s=0.05, retry_s=0.1)
    task = asyncio.create_task(m.run())
    try:
        await asyncio.wait_for(m.ready.wait(), 5)
        assert m.index.count("a") == 2000 and m.index.count("b") == 3999  # bootstrap loaded
        for w in ("a", "b"):
            beat(c, w)  # 1 s TTL: keep both alive through the test
        publish(c, FeedEvent("a", "e1", 2, Op.STORE, tuple(range(5000, 6000))))
        publish(c, FeedEvent("a", "e1", 3, Op.EVICT, tuple(range(500))))
        publish(c, FeedEvent("b", "e2", 1, Op.RESYNC), snapshot=set(range(7000, 9000)))
        await wait_for(lambda: m.index.count("a") == 2500 and m.index.count("b") == 2000,
                       what="feed applied and b resynced")
        one_block_each = PrefixIndex()
        for w in m.index.workers():
            one_block_each.add(w, [0])
        assert collector_visits(m.index) == collector_visits(one_block_each)
    finally:
        await m.stop(task)
