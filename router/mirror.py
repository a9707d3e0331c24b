"""The router's in-memory mirror of the cluster's cache state, fed from Redis.

It bootstraps from every worker's snapshot, then follows the model's change feed. Per worker it
tracks (epoch, seq): a duplicate is skipped, a gap or an unannounced new epoch reloads that
worker's snapshot, and ``clear``/``resync`` at seq 1 start a new epoch. Heartbeats are scanned
on the same loop: new workers join the registry, expired ones leave it and the index.

Routing never waits on any of this: it reads :attr:`index` and :attr:`available`, both
updated only by this loop. When Redis fails, ``available`` turns False (routing falls back to
load alone) and the loop reconnects and bootstraps from scratch.

Whatever anyone wrote into Redis, one record never takes the loop down: a heartbeat, feed
entry, snapshot or workers-set member that breaks the schema (:class:`RecordError`, a key of
the wrong type) is rejected, counted in :attr:`MirrorStats.rejected` by kind and reason, and
logged at most once per :data:`_REJECT_LOG_S` per kind and worker. Only what the record is
about is left out: a heartbeat's worker, a snapshot's cache, one feed entry, one member.
"""

from __future__ import annotations

import asyncio
import base64
import bisect
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from redis.exceptions import AuthenticationError, NoPermissionError, ResponseError

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import REDIS_ERRORS, RedisClient, explain
from kvroute.core.redis_schema import (
    FeedError,
    FeedEvent,
    Heartbeat,
    Op,
    RecordError,
    RedisKeys,
    check_name,
    pack_keys,
    parse_snapshot,
)
from kvroute.router.registry import Vocabulary, WorkerRegistry

if TYPE_CHECKING:
    from kvroute.router.shared import SharedDecisions

log = logging.getLogger("kvroute.router.mirror")

_XREAD_COUNT = 1000
# Snapshots read at once when many are due (a bootstrap, many workers joining): each is one
# round trip, so 1,000 workers read one by one took 1,000 round trips end to end.
_LOAD_CONCURRENCY = 32
# Least seconds between two updates of the registry's per-worker block counts while the feed
# has a backlog: each update rebuilds the worker's load, which cost more than applying the
# entries themselves when a batch of 1,000 entries touched 1,000 workers.
_COUNTS_EVERY_S = 0.05
# How long before a live worker whose snapshot held no readable state (none written yet, or
# malformed) is read again: at every heartbeat scan, a malformed one would be logged and
# counted twice a second.
_SNAPSHOT_RETRY_S = 5.0
_SNAPSHOT_SCRIPT = "return {redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2])}"
# Least seconds between two log lines about rejected records of one kind and worker.
_REJECT_LOG_S = 30.0


# Bounds of the propagation histogram (seconds); entry ids carry milliseconds.
PROPAGATION_BOUNDS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class MirrorStats:
    events_applied: int = 0
    snapshot_loads: int = 0
    gaps: int = 0
    malformed: int = 0
    bootstraps: int = 0
    # Records refused, by (kind, reason): redis_schema's RECORD_KINDS and REJECT_REASONS.
    rejected: Counter[tuple[str, str]] = field(default_factory=Counter)
    lag_s: float = 0.0
    last_event_at: float = field(default=0.0)
    # Feed propagation: each applied entry's age (Redis's XADD time, in its id, to now),
    # counted per bound of PROPAGATION_BOUNDS_S (the last count: beyond every bound).
    propagation: list[int] = field(default_factory=lambda: [0] * (len(PROPAGATION_BOUNDS_S) + 1))
    propagation_sum_s: float = 0.0


@dataclass
class _WorkerFeed:
    epoch: str
    seq: int


class IndexMirror:
    def __init__(
        self,
        client: RedisClient,
        keys: RedisKeys,
        registry: WorkerRegistry,
        *,
        poll_interval_s: float = 0.5,
        retry_s: float = 1.0,
        prune_after_s: float = 10.0,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self._r = client
        self._keys = keys
        self.registry = registry
        self.index = PrefixIndex()
        self.available = False
        self.stats = MirrorStats()
        self._feeds: dict[str, _WorkerFeed] = {}
        self._poll_s = poll_interval_s
        self._retry_s = retry_s
        self._on_change = on_change or (lambda: None)
        self._last_id = b"0-0"
        self._next_poll = 0.0
        self._missing_since: dict[str, float] = {}
        # When a live worker whose snapshot held no readable state may be read again.
        self._snapshot_due: dict[str, float] = {}
        self._prune_after_s = prune_after_s
        self._stopping = asyncio.Event()
        self._expire_from = 0.0
        self.ready = asyncio.Event()  # set after the first successful bootstrap
        self._reported: bool | None = None  # the Redis state last logged (None: not yet)
        self.last_error = ""  # why Redis last failed, in words (redis_conn.explain)
        self._reject_logged: dict[tuple[str, str], float] = {}  # (kind, worker) -> when
        self._bad_beats: dict[str, bytes] = {}  # worker -> its rejected heartbeat, counted once
        self._bad_members: set[bytes] = set()  # invalid workers-set members, to remove
        self._touched: set[str] = set()  # workers whose block count the registry lacks
        self._counts_due = 0.0
        # worker -> (its heartbeat as last read, parsed): an unchanged record is not parsed
        # again at the next scan (agents beat every second, routers scan twice as often).
        self._beat_cache: dict[str, tuple[bytes, Heartbeat]] = {}
        # The other routers' decisions, read in the same XREAD as the feed (router/shared.py;
        # None: --share-decisions off).
        self.shared: SharedDecisions | None = None

    async def run(self) -> None:
        """Follow Redis until :meth:`stop`; on failure degrade, reconnect, bootstrap again."""
        while not self._stopping.is_set():
            try:
                await self._bootstrap()
                self._set_available(True)
                while not self._stopping.is_set():
                    await self._step()
            except REDIS_ERRORS as exc:
                if self._stopping.is_set():
                    break
                self._set_available(False, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self._retry_s)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Let ``task`` (running :meth:`run`) finish its current command, then close Redis.

        Cancelling redis-py mid-command can leave a connection waiting out its socket
        timeout, so the loop is asked to stop between commands and only cancelled if it
        does not within a bounded time.
        """
        self._stopping.set()
        done, _ = await asyncio.wait([task], timeout=self._poll_s + 1.0)
        if not done:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        # Closing is best effort; redis-py's cluster client can fail to close a connection
        # whose node it already dropped (RuntimeError: event loop is closed).
        with contextlib.suppress(*REDIS_ERRORS, RuntimeError):
            await self._r.aclose()

    def view(self, keys: bool = False) -> dict[str, dict[str, object]]:
        """What this mirror holds per worker, for comparing routers (``/debug/mirror``):
        the feed position applied (``epoch``, ``seq``), the real blocks held (``blocks``)
        and ``sum``, their keys' sum mod 2^64 (a digest: equal views give equal sums); with
        ``keys``, the keys themselves (``keys_b64``: sorted, 8-byte big-endian, base64).
        Call it on the mirror's event loop: it is then one consistent moment."""
        out: dict[str, dict[str, object]] = {}
        for w in self.index.workers():
            held = self.index.keys_of(w)
            feed = self._feeds.get(w)
            row: dict[str, object] = {"epoch": feed.epoch if feed else "",
                                      "seq": feed.seq if feed else 0, "blocks": len(held),
                                      "sum": sum(held) % (1 << 64)}
            if keys:
                row["keys_b64"] = base64.b64encode(pack_keys(sorted(held))).decode()
            out[w] = row
        return out

    def _set_available(self, up: bool, exc: BaseException | None = None) -> None:
        # Logged on each change, and the first time either way: a Redis never reached (a
        # wrong address, CA or password) is said at start, in words that name the cause.
        if up:
            self.last_error = ""
        elif exc is not None:
            self.last_error = explain(self._r, exc)
        if up != self._reported:
            self._reported = up
            if up:
                log.info("redis reachable; routing by cache", extra={"kv": {
                    "workers": len(self.registry.loads), "blocks": self.index.entries()}})
            elif isinstance(exc, AuthenticationError | NoPermissionError):
                log.error(f"{self.last_error}; routing by load alone until it is fixed")
            else:
                log.warning(f"{self.last_error}; routing by load alone until it is back")
        self.available = up
        if up:
            self.ready.set()
        self._on_change()

    def _reject(self, kind: str, reason: str, worker: str, error: object) -> None:
        """Count a refused record; log it unless this kind and worker were logged lately."""
        self.stats.rejected[kind, reason] += 1
        self.stats.malformed += 1
        now = time.monotonic()
        if now - self._reject_logged.get((kind, worker), -_REJECT_LOG_S) >= _REJECT_LOG_S:
            if len(self._reject_logged) > 10_000:  # garbage under many names: stay bounded
                self._reject_logged.clear()
            self._reject_logged[kind, worker] = now
            log.warning(f"rejected a malformed {kind} record",
                        extra={"kv": {"worker": worker, "reason": reason,
                                      "error": f"{error}"[:300]}})

    def _members(self, raw: set[bytes] | list[bytes]) -> list[str]:
        """The workers set's members that are valid worker names; others are rejected and
        removed by the pruning (:meth:`_poll_heartbeats`)."""
        out = []
        for m in raw:
            try:
                out.append(check_name("worker", m.decode()))
            except ValueError as exc:  # also bad UTF-8
                self._bad_members.add(m)
                self._reject("member", "bad_name", repr(m)[:80], exc)
        return out

    # -- bootstrap -------------------------------------------------------------------------

    async def _bootstrap(self) -> None:
        # Take the feed position first: every event after it is either newer than the
        # snapshots we load next or a duplicate their seq lets us skip.
        last = await self._r.xrevrange(self._keys.feed, "+", "-", count=1)
        self._last_id = last[0][0] if last else b"0-0"
        if self.shared is not None:
            # The new index holds none of the others' predictions: count them afresh, from
            # now (an older decision is either done or soon past its max age).
            self.shared.reset()
            last = await self._r.xrevrange(self.shared.key, "+", "-", count=1)
            self.shared.last_id = last[0][0] if last else b"0-0"
        self._feeds.clear()
        self._touched.clear()
        self.index = PrefixIndex()
        # A Redis that restarted empty shows no heartbeats until agents beat again: give
        # them one TTL before treating silence as death.
        self._expire_from = time.monotonic() + self.registry.max_ttl_s() + self._poll_s
        self._snapshot_due.clear()  # Redis may have restarted: read every worker afresh
        await self._poll_heartbeats()
        members = self._members(await self._r.smembers(self._keys.workers))
        await self._load_snapshots(sorted(set(members) - self._feeds.keys()))  # live: loaded
        for w in self.index.workers():
            self.registry.set_cached_blocks(w, self.index.count(w))
        self.stats.bootstraps += 1
        log.info("mirror bootstrapped", extra={"kv": {
            "workers": len(self._feeds), "blocks": self.index.entries(),
            "feed_from": self._last_id.decode()}})

    async def _load_snapshots(self, workers: list[str]) -> None:
        """Read several workers' snapshots, :data:`_LOAD_CONCURRENCY` round trips at once
        (each worker's own keys only: the order among them does not matter)."""
        for i in range(0, len(workers), _LOAD_CONCURRENCY):
            # Every read ends before a failure is raised: none may still be writing into
            # the index when the loop reconnects and bootstraps a new one.
            done = await asyncio.gather(*(self._load_snapshot(w)
                                          for w in workers[i:i + _LOAD_CONCURRENCY]),
                                        return_exceptions=True)
            failed = next((x for x in done if isinstance(x, BaseException)), None)
            if failed is not None:
                raise failed

    async def _load_snapshot(self, worker: str) -> None:
        k = self._keys
        # One script reads meta and members atomically (a MULTI would too, but redis-py's
        # cluster transactions cannot run SMEMBERS); both keys share the model's slot.
        try:
            flat, members = await self._r.eval(_SNAPSHOT_SCRIPT, 2, k.meta(worker),
                                               k.snapshot(worker))
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            flat, members = [], []  # a snapshot or meta key that is not a set / hash
            self._reject("snapshot", "wrong_type", worker, exc)
        meta = dict(zip(flat[::2], flat[1::2], strict=True))
        self.stats.snapshot_loads += 1
        if not meta:
            self.index.remove_worker(worker)
            self._feeds.pop(worker, None)
            return
        try:
            epoch, seq, keys = parse_snapshot(meta, members)
        except RecordError as exc:
            self._reject("snapshot", exc.reason, worker, exc)
            self.index.remove_worker(worker)
            self._feeds.pop(worker, None)
            return
        self.index.replace_worker(worker, keys)
        self._feeds[worker] = _WorkerFeed(epoch, seq)

    # -- following -------------------------------------------------------------------------

    async def _step(self) -> None:
        now = time.monotonic()
        self.index.expire(now)  # predicted entries past their deadline (--predict-ttl-s)
        if now >= self._next_poll:
            await self._poll_heartbeats()
            self._next_poll = now + self._poll_s
        shared = self.shared
        streams = {self._keys.feed: self._last_id}
        if shared is not None:
            shared.expire(now)
            streams[shared.key] = shared.last_id  # same hash tag: one slot, one XREAD
        block_ms = max(1, int((self._next_poll - time.monotonic()) * 1000))
        resp = await self._r.xread(streams, count=_XREAD_COUNT, block=block_ms)
        touched = self._touched
        read = 0
        for stream, entries in resp or ():
            if shared is not None and _name(stream) == shared.key:
                for entry_id, fields in entries:
                    shared.last_id = entry_id
                    shared.apply(fields)
                continue
            read += len(entries)
            for entry_id, fields in entries:
                self._last_id = entry_id
                worker = await self._apply_raw(entry_id, fields)
                if worker:
                    touched.add(worker)
        # Caught up (a short read): counts now. Behind: at most every _COUNTS_EVERY_S.
        now = time.monotonic()
        if touched and (read < _XREAD_COUNT or now >= self._counts_due):
            for w in touched:
                self.registry.set_cached_blocks(w, self.index.count(w))
            touched.clear()
            self._counts_due = now + _COUNTS_EVERY_S
        if resp:
            self._on_change()

    async def _apply_raw(self, entry_id: bytes, fields: dict[bytes, bytes]) -> str | None:
        """Apply one stream entry; returns the worker it was about (None if malformed)."""
        try:
            ev = FeedEvent.from_fields(fields)
        except FeedError as exc:
            worker = fields.get(b"w", b"?").decode(errors="replace")[:80]
            self._reject("feed", exc.reason, worker, f"entry {entry_id.decode()}: {exc}")
            return None
        ms = int(entry_id.split(b"-")[0])
        st = self.stats
        st.lag_s = lag = max(0.0, time.time() - ms / 1000)
        st.propagation[bisect.bisect_left(PROPAGATION_BOUNDS_S, lag)] += 1
        st.propagation_sum_s += lag
        self.stats.last_event_at = time.time()
        await self.apply(ev)
        return ev.worker

    async def apply(self, ev: FeedEvent) -> None:
        """Apply one feed event, healing from the snapshot on a gap or unknown epoch."""
        feed = self._feeds.get(ev.worker)
        if feed is None or feed.epoch != ev.epoch:
            if ev.seq == 1 and ev.op is Op.CLEAR:
                self.index.clear_worker(ev.worker)
                self._feeds[ev.worker] = _WorkerFeed(ev.epoch, 1)
                self.stats.events_applied += 1
            else:
                if ev.op is not Op.RESYNC:
                    self.stats.gaps += 1
                await self._load_snapshot(ev.worker)
            return
        if ev.seq <= feed.seq:
            return  # already in the snapshot we loaded, or a re-sent batch
        if ev.seq != feed.seq + 1:
            self.stats.gaps += 1
            log.warning("feed gap; reloading snapshot", extra={"kv": {
                "worker": ev.worker, "expected": feed.seq + 1, "got": ev.seq}})
            await self._load_snapshot(ev.worker)
            return
        if ev.op is Op.STORE:
            self.index.add(ev.worker, ev.keys)
        elif ev.op is Op.EVICT:
            self.index.remove(ev.worker, ev.keys)
        elif ev.op is Op.CLEAR:
            self.index.clear_worker(ev.worker)
        else:  # RESYNC within an epoch is not something agents send; be safe
            await self._load_snapshot(ev.worker)
            return
        feed.seq = ev.seq
        self.stats.events_applied += 1

    async def _poll_heartbeats(self) -> None:
        k = self._keys
        members = self._members(await self._r.smembers(k.workers))
        raws = await self._r.mget([k.heartbeat(w) for w in members]) if members else []
        beats: dict[str, Heartbeat] = {}
        cache = self._beat_cache
        for w, raw in zip(members, raws, strict=True):
            if raw is None:
                continue
            seen = cache.get(w)
            if seen is not None and seen[0] == raw:
                beats[w] = seen[1]  # the very record already checked (Heartbeat is frozen)
                continue
            try:
                hb = Heartbeat.from_json(raw)
                if hb.worker_id != w:
                    raise RecordError(f"heartbeat of {w!r} names worker {hb.worker_id!r}",
                                      "mismatch")
            except RecordError as exc:
                cache.pop(w, None)
                # A record read again unchanged at the next scan is not counted again.
                if self._bad_beats.get(w) != raw:
                    self._bad_beats[w] = raw
                    self._reject("heartbeat", exc.reason, w, exc)
                continue
            self._bad_beats.pop(w, None)
            cache[w] = (raw, hb)
            beats[w] = hb
        for w in self._bad_beats.keys() - set(members):
            del self._bad_beats[w]
        for w in cache.keys() - beats.keys():
            del cache[w]
        self.registry.revive_due()
        added, expired = self.registry.apply_heartbeats(
            beats, expire=time.monotonic() >= self._expire_from)
        for w in added:
            hb = beats[w]
            log.info("worker joined", extra={"kv": {
                "worker": w, "address": hb.address,
                "vocabulary": str(Vocabulary(hb.tokenizer, hb.vocab_size))}})
        # A live worker we hold no cache state for: it registered after our bootstrap (as after
        # a Redis restart, when its heartbeat may come back after we bootstrapped) and may send
        # no event for a long while, so read its snapshot now rather than wait for one.
        # One with none to read yet (or a malformed one) is read again after a while.
        now = time.monotonic()
        due = self._snapshot_due
        loaded = [w for w in beats
                  if w not in self._feeds and w not in expired and due.get(w, 0.0) <= now]
        await self._load_snapshots(loaded)
        for w in loaded:
            self.registry.set_cached_blocks(w, self.index.count(w))
            if w in self._feeds:
                due.pop(w, None)
            else:
                due[w] = now + _SNAPSHOT_RETRY_S
        for w in members:
            if w in beats:
                self._missing_since.pop(w, None)
            else:
                self._missing_since.setdefault(w, now)
        # A member without a heartbeat for a while is dead; one that only just registered
        # may not have sent its first heartbeat yet.
        gone = [w for w in members
                if w not in beats and now - self._missing_since[w] >= self._prune_after_s]
        for w in expired:
            dropped = self.index.remove_worker(w)
            self._feeds.pop(w, None)
            due.pop(w, None)
            log.warning("worker heartbeat expired; forgetting it",
                        extra={"kv": {"worker": w, "blocks_dropped": dropped}})
        if self._bad_members:
            # Not a worker name: no worker can own it, and it would be rejected at every scan.
            await self._r.srem(k.workers, *self._bad_members)
            self._bad_members.clear()
        if gone:
            # Prune dead members so the scan stays small. A worker restarting under the same
            # id re-adds itself on its next heartbeat and resyncs if its snapshot went away.
            pipe = self._r.pipeline(transaction=True)
            pipe.srem(k.workers, *gone)
            for w in gone:
                pipe.delete(k.snapshot(w), k.meta(w))
            await pipe.execute()
            for w in gone:
                self._missing_since.pop(w, None)
                due.pop(w, None)
                if w not in expired:
                    self.index.remove_worker(w)
                    self._feeds.pop(w, None)
        if added or expired or any(w in self._feeds for w in loaded):
            self._on_change()


def _name(stream: bytes | str) -> str:
    return stream.decode() if isinstance(stream, bytes) else stream
