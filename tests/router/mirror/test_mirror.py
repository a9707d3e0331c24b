"""The router's mirror against a real redis-server, fed by hand-written feed entries."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import FeedEvent, Heartbeat, Op, RedisKeys, pack_keys, unpack_keys
from kvroute.router.mirror import IndexMirror
from kvroute.router.registry import WorkerRegistry
from tests.support import collector_visits, wait_for

KEYS = RedisKeys("default")


def publish(client, ev: FeedEvent, snapshot: set[int] | None = None) -> None:
    """What an agent does, written out by hand: feed entry + snapshot + meta, and its
    heartbeat (its registration) under the entry's epoch, keeping a TTL :func:`beat` gave
    it (else one of a minute)."""
    pipe = client.pipeline(transaction=True)
    pipe.xadd(KEYS.feed, ev.to_fields())
    if snapshot is not None:
        pipe.delete(KEYS.snapshot(ev.worker))
        if snapshot:
            pipe.sadd(KEYS.snapshot(ev.worker), *(pack_keys((k,)) for k in snapshot))
    pipe.hset(KEYS.meta(ev.worker), mapping={"epoch": ev.epoch, "seq": ev.seq})
    hb = Heartbeat(ev.worker, "127.0.0.1:1", ev.epoch, ttl_s=1.0)
    pipe.set(KEYS.heartbeat(ev.worker), hb.to_json(), keepttl=True)
    pipe.pexpire(KEYS.heartbeat(ev.worker), 60_000, nx=True)
    pipe.execute()


def read_keys(members: list[bytes] | bytes) -> set[int]:
    """The keys of a snapshot as the mirror read it (DUMP's blob or SMEMBERS' members)."""
    if isinstance(members, bytes):
        return set(unpack_keys(members))
    return {unpack_keys(m)[0] for m in members}


def beat(client, worker: str, block_size: int = 16, epoch: str = "e1") -> None:
    """A heartbeat as an agent writes it (3 s TTL), once. A worker that only beats, with no
    feed entry, is found by the mirror's next SCAN of heartbeat keys (1 s apart here)."""
    hb = Heartbeat(worker, "127.0.0.1:1", epoch, block_size=block_size, ttl_s=3.0)
    client.set(KEYS.heartbeat(worker), hb.to_json(), px=3000)


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
    # No more heartbeats: the key's TTL (3 s) runs out.
    await wait_for(lambda: "w" not in mirror.registry.loads, 10, "expiry")
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
            beat(c, w)  # keep both alive through the test
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


def raw_beat(client, worker: str, **fields: object) -> str:
    """A heartbeat JSON as anyone with write access could put it, ``fields`` overriding a
    valid one's."""
    import json
    data = json.loads(Heartbeat(worker, "127.0.0.1:1", "e", ttl_s=1.0).to_json())
    data.update(fields)
    raw = json.dumps(data)
    client.set(KEYS.heartbeat(worker), raw, px=5000)
    return raw


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("running", 2 * 10 ** 70, "out_of_range"),
    ("pending_prefill_tokens", 10 ** 30, "out_of_range"),
    ("capacity_blocks", 1 << 63, "out_of_range"),
    ("max_running", 1 << 64, "out_of_range"),
    ("ttl_s", 1e300, "out_of_range"),
    ("ttl_s", float("nan"), "out_of_range"),
    ("ttl_s", 0, "out_of_range"),
    ("arrival_rate", 1e300, "out_of_range"),
    ("worker_id", "other", "mismatch"),
    ("queued", "7", "bad_type"),
])
async def test_a_hostile_heartbeat_is_rejected_counted_once_and_others_stay(
        redis_server, mirror, field: str, value: object, reason: str) -> None:
    c = redis_server.client()
    raw_beat(c, "good")
    raw_beat(c, "evil", **{field: value})
    await wait_for(lambda: "good" in mirror.registry.loads, what="the good worker joined")
    await wait_for(lambda: mirror.stats.rejected["heartbeat", reason] == 1,
                   what=f"the {field}={value!r} heartbeat counted as {reason}")
    await asyncio.sleep(0.3)  # several scans: the same record is not counted again
    assert mirror.stats.rejected["heartbeat", reason] == 1
    assert "evil" not in mirror.registry.loads
    assert mirror.available


async def test_garbage_heartbeats_feed_entries_snapshots_and_members_are_rejected(
        redis_server, mirror) -> None:
    c = redis_server.client()
    raw_beat(c, "good")
    for name, raw in (("deep", "[" * 50_000), ("huge", "x" * 100_000), ("bytes", b"\xff\xfe")):
        c.set(KEYS.heartbeat(name), raw, px=5000)
    bad_keys = [KEYS.heartbeat("").encode() + b"\xff\xfe", KEYS.heartbeat("bad name*")]
    for key in bad_keys:  # heartbeat keys naming no worker at all
        c.set(key, Heartbeat("x", "127.0.0.1:1", "e").to_json(), px=5000)
    # Snapshots: a member that is not one 8-byte key, a meta that is not a hash, a huge seq.
    raw_beat(c, "snap16")
    c.hset(KEYS.meta("snap16"), mapping={"epoch": "e", "seq": 1})
    c.sadd(KEYS.snapshot("snap16"), b"\x00" * 16)
    raw_beat(c, "snaptype")
    c.set(KEYS.meta("snaptype"), "a string, not a hash")
    raw_beat(c, "snapseq")
    c.hset(KEYS.meta("snapseq"), mapping={"epoch": "e", "seq": str(1 << 70)})
    # Feed entries: a 2e70 seq, a seq too long to be a number, bad UTF-8, a bad worker name.
    for fields in ({"w": "good", "e": "e", "s": str(2 * 10 ** 70), "op": "store", "k": b""},
                   {"w": "good", "e": "e", "s": "9" * 5000, "op": "store"},
                   {"w": b"\xff", "e": "e", "s": 1, "op": "clear"},
                   {"w": "no spaces", "e": "e", "s": 1, "op": "clear"}):
        c.xadd(KEYS.feed, fields)
    publish(c, FeedEvent("good", "e1", 1, Op.CLEAR))
    publish(c, FeedEvent("good", "e1", 2, Op.STORE, (7,)))
    await wait_for(lambda: mirror.index.keys_of("good") == {7}, what="good events applied")
    rej = mirror.stats.rejected
    # Each worker's snapshot is loaded on its own schedule: wait for every kind, not one.
    await wait_for(lambda: rej["snapshot", "wrong_type"] >= 1 and rej["member", "bad_name"] >= 2
                   and rej["snapshot", "bad_type"] >= 1 and rej["snapshot", "out_of_range"] >= 1,
                   what="every garbage record rejected")
    assert rej["heartbeat", "not_json"] == 2  # deep nesting and bad UTF-8
    assert rej["heartbeat", "too_large"] == 1
    assert rej["snapshot", "bad_type"] >= 1 and rej["snapshot", "out_of_range"] >= 1
    assert rej["feed", "out_of_range"] == 1 and rej["feed", "bad_type"] == 2
    assert rej["feed", "bad_name"] == 1
    # Keys naming no worker are counted once, not at every scan; the router leaves them (it
    # writes nothing: they expire).
    await asyncio.sleep(0.3)
    assert rej["member", "bad_name"] == 2
    assert c.exists(*bad_keys) == 2
    assert mirror.available and "good" in mirror.registry.loads
    for w in ("snap16", "snaptype", "snapseq"):  # live, but with no cache believed
        assert w in mirror.registry.loads and mirror.index.count(w) == 0


async def test_rejections_are_exported_and_logged_at_most_once_a_while(
        redis_server, mirror, caplog) -> None:
    from prometheus_client import generate_latest

    from kvroute.router.metrics import RouterMetrics

    metrics = RouterMetrics()
    metrics.watch(mirror)
    c = redis_server.client()
    with caplog.at_level("WARNING", logger="kvroute.router.mirror"):
        for i in range(5):  # five different bad records of one worker
            raw_beat(c, "evil", running=10 ** 40 + i)
            await wait_for(lambda i=i: mirror.stats.rejected["heartbeat", "out_of_range"] == i + 1,
                           what=f"bad heartbeat {i} counted")
    text = generate_latest(metrics.registry).decode()
    assert ('kvroute_router_records_rejected_total{kind="heartbeat",reason="out_of_range"} 5.0'
            in text)
    assert 'kvroute_router_records_rejected_total{kind="feed",reason="bad_type"} 0.0' in text
    logged = [r for r in caplog.records if "rejected a malformed heartbeat" in r.getMessage()]
    assert len(logged) == 1


class ScanProbe(WorkerRegistry):
    """A real registry that also notes, for one heartbeat scan, whether a feed entry is in
    the mirror's index at each part of the scan it is given: once armed, at the first part
    of the next scan it writes the entry (``write``), then at each later part and at the
    scan's end (expire_missing) it asks ``visible``."""

    def __init__(self, write, visible) -> None:
        super().__init__({}, 16)
        self._write, self._visible = write, visible
        self.state = "idle"  # -> "armed" -> "next scan" -> "probing" -> "done"
        self.parts: list[bool] = []  # per part of the probed scan after the first: visible?
        self.at_end: bool | None = None

    def update_heartbeats(self, beats):
        if self.state == "next scan":
            self._write()  # the scan has just begun: the entry arrives during it
            self.state = "probing"
        elif self.state == "probing":
            self.parts.append(self._visible())
        return super().update_heartbeats(beats)

    def expire_missing(self, live, *, expire=True):
        if self.state == "armed":
            self.state = "next scan"
        elif self.state == "probing":
            self.at_end, self.state = self._visible(), "done"
        return super().expire_missing(live, expire=expire)


async def test_feed_entries_are_applied_while_a_large_heartbeat_scan_runs(
        redis_server) -> None:
    """The heartbeat scan of many workers runs beside the feed, in parts: an entry written
    while a scan of 2,000 heartbeats has just begun is in the index before that scan's
    last part, not only once the whole scan is done (as when the scan ran on the feed's
    loop and every entry that arrived during it waited for all of it)."""
    c = redis_server.client()
    n = 2000
    pipe = c.pipeline(transaction=False)
    for i in range(n):  # long-lived heartbeats, no snapshots
        w = f"hb{i:05d}"
        pipe.set(KEYS.heartbeat(w), Heartbeat(w, "127.0.0.1:1", "e", ttl_s=60.0).to_json(),
                 px=60_000)
    pipe.execute()
    publish(c, FeedEvent("w", "e1", 1, Op.CLEAR))
    box: list[IndexMirror] = []
    probe = ScanProbe(lambda: publish(c, FeedEvent("w", "e1", 2, Op.STORE, (7,))),
                      lambda: 7 in box[0].index.keys_of("w"))
    m = IndexMirror(connect(redis_server.url, block_timeout_s=0.05), KEYS, probe,
                    poll_interval_s=0.05, retry_s=0.1)
    box.append(m)
    task = asyncio.create_task(m.run())
    try:
        await asyncio.wait_for(m.ready.wait(), 30)
        await wait_for(lambda: m.index.count("w") == 0 and "w" in m.view(),
                       what="seq 1 applied")
        assert len(m.registry.loads) == n + 1  # and "w", registered by its heartbeat
        probe.state = "armed"
        await wait_for(lambda: probe.state == "done", 30, "a probed scan")
        assert len(probe.parts) == n // 100  # the scan's parts after the first (n + 1 members)
        assert probe.at_end and m.index.keys_of("w") == {7}
        assert True in probe.parts[:-1], probe.parts  # applied before the scan's last part
    finally:
        await m.stop(task)


async def test_a_snapshot_read_agrees_with_its_meta_while_the_agent_writes(redis_server,
                                                                         mirror) -> None:
    """Members and (epoch, seq) read together are of one write, however the reads fall
    between an agent's MULTIs (the equal-meta pipeline, else the script)."""
    def members_of(seq: int) -> set[int]:
        if seq % 3 == 0:  # numeric members, which Redis keeps as an intset: read by SMEMBERS
            return {int.from_bytes(b"%d" % (10**7 + seq * 100 + i), "big")
                    for i in range(seq % 40 + 1)}
        return {seq * 1000 + i for i in range(seq % 40 + 1)}

    def lower_of(seq: int) -> set[int]:  # what it holds only in its lower tier
        return set(sorted(members_of(seq))[::2])

    stop = threading.Event()

    def agent() -> None:  # an agent rewriting its snapshot as fast as it can
        c = redis_server.client()
        seq = 0
        while not stop.is_set():
            seq += 1
            pipe = c.pipeline(transaction=True)
            pipe.delete(KEYS.snapshot("w"), KEYS.lower("w"))
            pipe.sadd(KEYS.snapshot("w"), *(pack_keys((k,)) for k in members_of(seq)))
            pipe.sadd(KEYS.lower("w"), *(pack_keys((k,)) for k in lower_of(seq)))
            pipe.hset(KEYS.meta("w"), mapping={"epoch": "e1", "seq": seq})
            pipe.execute()

    writer = threading.Thread(target=agent)
    writer.start()
    try:
        seen = set()
        for _ in range(300):
            meta, members, lower = await mirror.snapshots.read("w")
            if not meta:
                continue  # before the first write
            seq = int(meta[b"seq"])
            assert read_keys(members) == members_of(seq)
            assert read_keys(lower) == lower_of(seq)  # the lower tier of the same moment
            seen.add(seq)
        assert len(seen) > 10  # the reads did fall between many writes
        assert mirror.stats.snapshot_smembers > 0  # both kinds of read were made
        assert {s % 3 for s in seen} == {0, 1, 2}
        assert writer.is_alive()  # it wrote all along (an error would have ended it)
    finally:
        stop.set()
        writer.join()


@pytest.mark.parametrize("dump_allowed", [True, False])
async def test_a_bootstrap_reads_snapshots_whole_and_falls_back_to_smembers(
        redis_server, caplog, dump_allowed: bool) -> None:
    """Snapshots come by DUMP (one reply each); one Redis keeps in another encoding
    (numeric members: an intset), and every one when the router's ACL refuses DUMP, by
    SMEMBERS: the index is the same either way."""
    from kvroute.core.redis_schema import acl_rules

    c = redis_server.client()
    big = set(range(1 << 40, (1 << 40) + 3000))
    numeric = {int.from_bytes(b"%d" % (10**7 + i), "big") for i in range(300)}
    for w, keys in (("big", big), ("numeric", numeric), ("empty", set())):
        beat(c, w)
        publish(c, FeedEvent(w, "e1", 1, Op.RESYNC), snapshot=keys)
    rules = acl_rules("router", "default")
    if not dump_allowed:  # a router's ACL from before DUMP was read
        rules = [r for r in rules if r != "+dump"]
    c.execute_command("ACL", "SETUSER", "router", "reset", "on", ">pw", *rules)
    url = redis_server.url.replace("redis://", "redis://router:pw@")
    m = IndexMirror(connect(url, block_timeout_s=0.05), KEYS, WorkerRegistry({}, 16),
                    poll_interval_s=0.05, retry_s=0.1)
    task = asyncio.create_task(m.run())
    try:
        await asyncio.wait_for(m.ready.wait(), 5)
        assert m.index.keys_of("big") == big and m.index.keys_of("numeric") == numeric
        assert m.index.count("empty") == 0 and m.stats.snapshot_loads == 3
        # Counted: SMEMBERS after a DUMP in another encoding (the intset); without DUMP,
        # every read is SMEMBERS and none of them is.
        assert m.stats.snapshot_smembers == (1 if dump_allowed else 0)
        assert ("refuses DUMP" in caplog.text) is not dump_allowed
        assert m.snapshots.dump is dump_allowed
    finally:
        await m.stop(task)


async def test_a_new_epoch_forged_in_a_workers_name_is_undone_by_its_heartbeat(
        redis_server, mirror) -> None:
    """Any agent may append to the feed: an entry in another worker's name that starts an
    epoch (a ``clear``) empties that worker's cache on the routers. Its heartbeat, which only
    its own agent writes, still names its real epoch: after two scans the mirror reads its
    snapshot again, and the cache is back."""
    c = redis_server.client()
    publish(c, FeedEvent("w", "e1", 1, Op.RESYNC), snapshot={1, 2, 3})
    await wait_for(lambda: mirror.index.keys_of("w") == {1, 2, 3}, what="w indexed")
    c.xadd(KEYS.feed, FeedEvent("w", "forged", 1, Op.CLEAR).to_fields())
    await wait_for(lambda: mirror.stats.heartbeat_mismatches["epoch"] == 1
                   and mirror.index.keys_of("w") == {1, 2, 3}, 5, "the forged epoch undone")
    assert mirror.cache.positions["w"].epoch == "e1"
    await asyncio.sleep(0.3)  # several scans: nothing more to heal
    assert mirror.stats.heartbeat_mismatches["epoch"] == 1


async def test_the_registry_scan_is_spaced_and_the_feed_names_new_workers(
        redis_server, mirror) -> None:
    """A SCAN of heartbeat keys examines every key of the node (a second on a Redis shared
    with a million other keys), so the mirror runs it at the bootstrap and then at least a
    second (and 20 of its durations) apart, not at each heartbeat scan (0.05 s here). A new
    agent's first feed entry and heartbeat are one write: the feed names it, and it joins
    without a SCAN. A worker that only beats is found by the next SCAN."""
    import time

    from kvroute.router.mirror.heartbeats import FULL_SCAN_MIN_S

    c = redis_server.client()
    scans = mirror.heartbeats
    first, since = scans.full_scans, time.monotonic()
    await asyncio.sleep(2.5)
    # Bounded by the time that passed (a loaded machine sleeps longer), not the 2.5 s asked.
    assert 1 <= scans.full_scans - first <= (time.monotonic() - since) / FULL_SCAN_MIN_S + 1
    scans._full_scan_due = time.monotonic() + 3600  # no SCAN from here
    publish(c, FeedEvent("new", "e1", 1, Op.RESYNC), snapshot={9})
    await wait_for(lambda: "new" in mirror.registry.loads, 5, "a worker named by the feed")
    beat(c, "quiet")
    await asyncio.sleep(0.5)
    assert "quiet" not in mirror.registry.loads  # beating, but named by no feed entry
    scans._full_scan_due = 0.0
    await wait_for(lambda: "quiet" in mirror.registry.loads, 5, "found by the next SCAN")
