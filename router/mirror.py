"""The router's in-memory mirror of the cluster's cache state, fed from Redis.

It bootstraps from every worker's snapshot, then follows the model's change feed. Per worker it
tracks (epoch, seq): a duplicate is skipped, a gap or an unannounced new epoch reloads that
worker's snapshot, and ``clear``/``resync`` at seq 1 start a new epoch. Heartbeats are scanned
beside the feed, in a task of their own (:meth:`IndexMirror._follow` says why and how the two
share the index): new workers join the registry, expired ones leave it and the index.

Routing never waits on any of this: it reads :attr:`index` and :attr:`available`, both
updated only by these two tasks. When Redis fails, ``available`` turns False (routing falls back to
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
    dumped_keys,
    pack_keys,
    parse_meta,
)
from kvroute.router.lost import LostWorkers, Probe
from kvroute.router.registry import Vocabulary, WorkerRegistry

if TYPE_CHECKING:
    from kvroute.router.shared import SharedDecisions

log = logging.getLogger("kvroute.router.mirror")

_XREAD_COUNT = 1000
# Heartbeats one scan reads (one MGET) and applies at a time before the feed gets its turn:
# a whole scan of 1,000 workers in one go (~15-40 ms of CPU on a quiet core, 50-100 ms on a
# loaded machine) made every feed entry that arrived meanwhile wait for all of it.
_SCAN_CHUNK = 100
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
    snapshot_smembers: int = 0  # of them read by SMEMBERS: DUMP's payload another encoding
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
        probe: Probe | None = None,
    ) -> None:
        """``probe``: whether an agent answers; with it, a worker whose heartbeat is gone
        stays while its agent answers (router/lost.py); without it, it leaves with its
        heartbeat."""
        self._r = client
        self.lost = LostWorkers(probe) if probe is not None else None
        self._dump = True  # snapshots read by DUMP (False: its ACL refused it; SMEMBERS)
        # SMEMBERS replies as the list the parser built, not redis-py's set of it: a
        # snapshot read by SMEMBERS (_read_snapshot) has 10k members a worker, and building
        # and freeing that set cost ~60-90 ns a member (1,000 x 10k: 0.6-0.9 s) for nothing:
        # Redis sends each member once, the index's C load takes any sequence, _members
        # either. (This client is the mirror's; nothing else on it reads a set.)
        client.set_response_callback("SMEMBERS", _listed)
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
        # Held by the feed while it applies a batch and by the heartbeat scan while it loads
        # snapshots or removes workers: the two tasks never interleave on cache state
        # (_follow).
        self._apply_lock = asyncio.Lock()
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
                await self._follow()
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
        await self._poll_heartbeats(load=False)
        # Every member's snapshot in one _load_snapshots, whose reads overlap its loads (the
        # scan loads a group at a time, for the feed to apply between them: none yet here),
        # in the set's order, as the scan registered them: loaded sorted by name instead,
        # the gRPC decision's p50 at 1,000 workers was 1.3-1.7 ms, not 0.86 (scaling.md).
        await self._load_snapshots(self._members(await self._r.smembers(self._keys.workers)))
        for w in self.index.workers():
            self.registry.set_cached_blocks(w, self.index.count(w))
        self.stats.bootstraps += 1
        log.info("mirror bootstrapped", extra={"kv": {
            "workers": len(self._feeds), "blocks": self.index.entries(),
            "feed_from": self._last_id.decode()}})

    async def _load_snapshots(self, workers: list[str]) -> None:
        """Read several workers' snapshots, :data:`_LOAD_CONCURRENCY` round trips at once
        (each worker's own keys only: the order among them does not matter), and load each
        batch into the index while Redis serves the next: a node writes its replies only
        once it has served all the reads it holds, so a batch read and loaded in turn
        left Redis idle while the index loaded and the index while Redis read."""
        batches = [workers[i:i + _LOAD_CONCURRENCY]
                   for i in range(0, len(workers), _LOAD_CONCURRENCY)]
        reading = self._read_batch(batches[0]) if batches else None
        for i, batch in enumerate(batches):
            assert reading is not None
            # Every read ends before a failure is raised: none may still be in flight when
            # the loop reconnects and bootstraps a new index.
            done = await reading
            reading = self._read_batch(batches[i + 1]) if i + 1 < len(batches) else None
            failed = next((x for x in done if isinstance(x, BaseException)), None)
            if failed is not None:
                if reading is not None:
                    await reading
                raise failed
            for w, read in zip(batch, done, strict=True):
                self._install_snapshot(w, *read)
                await asyncio.sleep(0)  # the next batch's reads go out meanwhile

    def _read_batch(self, workers: list[str]) -> asyncio.Future[list]:
        return asyncio.gather(*(self._read_checked(w) for w in workers),
                              return_exceptions=True)

    async def _load_snapshot(self, worker: str) -> None:
        self._install_snapshot(worker, *await self._read_checked(worker))

    async def _read_checked(self, worker: str
                            ) -> tuple[dict[bytes, bytes], list[bytes] | bytes]:
        """:meth:`_read_snapshot`, with a snapshot or meta key that is not a set / hash
        read as no state (and counted)."""
        try:
            return await self._read_snapshot(worker)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            self._reject("snapshot", "wrong_type", worker, exc)
            return {}, []

    def _install_snapshot(self, worker: str, meta: dict[bytes, bytes],
                          members: list[bytes] | bytes) -> None:
        """Make ``worker``'s cache in the index its snapshot as read (none: no meta)."""
        self.stats.snapshot_loads += 1
        if not meta:
            self.index.remove_worker(worker)
            self._feeds.pop(worker, None)
            return
        try:
            # The meta checked here; the members decoded (and checked) by the index in C,
            # not into an int object per key first: a bootstrap reads millions.
            epoch, seq = parse_meta(meta)
            try:
                self.index.replace_worker_packed(worker, members)
            except ValueError as exc:  # a member not one 8-byte key: no change made
                raise RecordError(f"{exc}", "bad_type") from exc
        except RecordError as exc:
            self._reject("snapshot", exc.reason, worker, exc)
            self.index.remove_worker(worker)
            self._feeds.pop(worker, None)
            return
        self._feeds[worker] = _WorkerFeed(epoch, seq)

    async def _read_snapshot(self, worker: str
                             ) -> tuple[dict[bytes, bytes], list[bytes] | bytes]:
        """``worker``'s meta and snapshot members as of one moment: the members as one
        ``bytes`` of 8-byte keys end to end (read by DUMP) or as a list (SMEMBERS, for a set
        DUMP gives in another encoding or when the ACL refuses DUMP).

        One pipeline (one round trip; both keys share the model's slot) reads the meta, the
        members, then the meta again: every write to a snapshot is in the agent's MULTI/EXEC
        that also writes the meta's (epoch, seq), to a seq never written before in that
        epoch, so two equal meta reads bracket members of exactly that (epoch, seq). Only if
        they differ (the agent wrote meanwhile) is the atomic script run. Not the script
        always: converting 10k members to a Lua table and back took 3x the Redis CPU of the
        SMEMBERS itself (2.8 against 0.9 ms), and a bootstrap reads every worker's
        snapshot from the one node holding the model's slot. (A MULTI would do, but
        redis-py's cluster transactions cannot run SMEMBERS.)"""
        if self._dump:
            # The snapshot as DUMP's one payload (redis_schema.dumped_keys): hiredis then
            # parses one bulk string, not one object per member (0.5 of 1.7 ms a 10k
            # snapshot on this side, the node's own cost the same).
            try:
                before, payload, after = await self._bracketed(worker, "dump")
            except NoPermissionError as exc:  # an ACL from before DUMP was needed
                if self._dump:  # once, not for each read of the batch it refused
                    self._dump = False
                    log.warning("Redis refuses DUMP to this router; reading snapshots with "
                                "SMEMBERS (slower: add +dump to its ACL, docs/security.md)",
                                extra={"kv": {"error": str(exc)}})
                return await self._read_snapshot(worker)
            members = dumped_keys(payload)
            if members is None:  # another encoding (small, numeric)
                self.stats.snapshot_smembers += 1
                before, members, after = await self._bracketed(worker, "smembers")
        else:
            before, members, after = await self._bracketed(worker, "smembers")
        if before == after:
            return before, members
        k = self._keys
        flat, members = await self._r.eval(_SNAPSHOT_SCRIPT, 2, k.meta(worker),
                                           k.snapshot(worker))
        return dict(zip(flat[::2], flat[1::2], strict=True)), members

    async def _bracketed(self, worker: str, read: str) -> list:
        """``worker``'s meta, its snapshot read by ``read`` (``dump`` or ``smembers``) and
        its meta again, in one pipeline (:meth:`_read_snapshot`)."""
        k = self._keys
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(k.meta(worker))
        getattr(pipe, read)(k.snapshot(worker))
        pipe.hgetall(k.meta(worker))
        return await pipe.execute()

    # -- following -------------------------------------------------------------------------

    async def _follow(self) -> None:
        """Follow the feed (:meth:`_step`) and scan heartbeats (:meth:`_scan_loop`), as two
        tasks, until :meth:`stop` or the first failure of either, which is raised once both
        have ended.

        Why two tasks: on one loop, every entry that arrived during a scan of all workers'
        heartbeats waited for the whole of it (1,000 workers: feed propagation p99 ~60-100
        ms against p50 ~3 ms). Now the feed waits at most for one part of a scan
        (:data:`_SCAN_CHUNK` heartbeats) or for what the scan does holding the lock.

        Why it is safe, at each await where the two interleave:

        * Cache state (``index``, ``_feeds``) is changed by the feed only while it holds
          ``_apply_lock`` (a whole XREAD batch, its snapshot reloads included) and by the
          scan only while it holds it too (loading new workers' snapshots, removing expired
          and pruned workers), so a worker's (epoch, seq) and blocks change as on one loop:
          no snapshot load overlaps another load or the feed's events of that worker, and
          none completes after the worker was removed. The scan decides whom to load
          before taking the lock and checks ``_feeds`` again under it (the feed may have
          loaded a worker meanwhile, from a fresher snapshot).
        * The registry is changed by the scan without the lock: each of its calls is
          synchronous, and the feed only sets block counts, a no-op for a worker the scan
          forgot. Between parts of a scan some workers show this scan's heartbeat and
          others the last one's, as a scan of heartbeats written at different times always
          did.
        * Everything else the scan keeps (heartbeat cache, rejected records, missing and
          due times) only the scan (or the bootstrap, with no task running) touches.
        * A failure of one cancels the other at its current await (neither then writes
          any more) and both have ended before :meth:`run` bootstraps a new index.
        """
        tasks = (asyncio.create_task(self._follow_feed()),
                 asyncio.create_task(self._scan_loop()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            # Returned: one failed (end the other now) or both stopped; else cancelled.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks:
            exc = None if t.cancelled() else t.exception()
            if exc is not None:
                raise exc

    async def _follow_feed(self) -> None:
        while not self._stopping.is_set():
            await self._step()

    async def _scan_loop(self) -> None:
        """Scan heartbeats every ``poll_s``, start to start, until :meth:`stop` (the
        bootstrap has just scanned)."""
        due = time.monotonic() + self._poll_s
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), max(0.0, due - time.monotonic()))
            if self._stopping.is_set():
                return
            due = time.monotonic() + self._poll_s
            await self._poll_heartbeats()

    async def _step(self) -> None:
        """One XREAD of the feed (and the shared decisions) and what it brought applied.
        It waits at most ``poll_s`` for entries: the expiries below run that often."""
        now = time.monotonic()
        self.index.expire(now)  # predicted entries past their deadline (--predict-ttl-s)
        shared = self.shared
        streams = {self._keys.feed: self._last_id}
        if shared is not None:
            shared.expire(now)
            streams[shared.key] = shared.last_id  # same hash tag: one slot, one XREAD
        block_ms = max(1, int(self._poll_s * 1000))
        resp = await self._r.xread(streams, count=_XREAD_COUNT, block=block_ms)
        async with self._apply_lock:
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

    async def _poll_heartbeats(self, load: bool = True) -> None:
        """One scan of every worker's heartbeat: new workers join the registry and their
        snapshots are read, workers whose heartbeat expired leave it and the index, and
        members without one for ``prune_after_s`` are pruned from Redis (``load`` False:
        no snapshot is read; the bootstrap reads them all after it).

        It runs beside the feed (:meth:`_follow`), so it comes in parts: each reads (one
        MGET), parses and applies to the registry :data:`_SCAN_CHUNK` heartbeats, and the
        feed applies what arrived while a part waited on Redis. What it changes in the
        index or ``_feeds`` it changes holding ``_apply_lock``."""
        k = self._keys
        registry = self.registry
        members = self._members(await self._r.smembers(k.workers))
        registry.revive_due()
        beats: dict[str, Heartbeat] = {}
        added: list[str] = []
        for i in range(0, len(members), _SCAN_CHUNK):
            part = members[i:i + _SCAN_CHUNK]
            got = self._parse_beats(part, await self._r.mget([k.heartbeat(w) for w in part]))
            beats.update(got)
            added += registry.update_heartbeats(got)
        for w in self._bad_beats.keys() - set(members):
            del self._bad_beats[w]
        for w in self._beat_cache.keys() - beats.keys():
            del self._beat_cache[w]
        expire = time.monotonic() >= self._expire_from
        kept: set[str] = set()
        if expire and self.lost is not None:
            missing = [i.worker_id for i in registry.all()
                       if not i.static and i.worker_id not in beats]
            kept = await self.lost.keep(registry, missing)
        expired = registry.expire_missing(beats.keys() | kept, expire=expire)
        for w in added:
            hb = beats[w]
            log.info("worker joined", extra={"kv": {
                "worker": w, "address": hb.address,
                "vocabulary": str(Vocabulary(hb.tokenizer, hb.vocab_size))}})
            # The feed may have indexed its blocks before its first heartbeat came.
            registry.set_cached_blocks(w, self.index.count(w))
        # A live worker we hold no cache state for: it registered after our bootstrap (as after
        # a Redis restart, when its heartbeat may come back after we bootstrapped) and may send
        # no event for a long while, so read its snapshot now rather than wait for one.
        # One with none to read yet (or a malformed one) is read again after a while.
        now = time.monotonic()
        due = self._snapshot_due
        dead = set(expired)
        wanted = [w for w in beats if load and w not in self._feeds and w not in dead
                  and due.get(w, 0.0) <= now]
        loaded: list[str] = []
        for i in range(0, len(wanted), _LOAD_CONCURRENCY):
            # A group at a time, the feed applying between them (many may be due at once,
            # after a Redis restart); checked again under the lock: the feed may have
            # loaded a worker meanwhile, and its snapshot is then at least as fresh.
            async with self._apply_lock:
                group = [w for w in wanted[i:i + _LOAD_CONCURRENCY] if w not in self._feeds]
                await self._load_snapshots(group)
            for w in group:
                registry.set_cached_blocks(w, self.index.count(w))
                if w in self._feeds:
                    due.pop(w, None)
                else:
                    due[w] = now + _SNAPSHOT_RETRY_S
            loaded += group
        for w in members:
            if w in beats:
                self._missing_since.pop(w, None)
            else:
                self._missing_since.setdefault(w, now)
        # A member without a heartbeat for a while is dead, unless its agent answers (kept);
        # one that only just registered may not have sent its first heartbeat yet.
        gone = [w for w in members if w not in beats and w not in kept
                and now - self._missing_since[w] >= self._prune_after_s]
        if expired:
            async with self._apply_lock:
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
            async with self._apply_lock:
                for w in gone:
                    self._missing_since.pop(w, None)
                    due.pop(w, None)
                    if w not in dead:
                        self.index.remove_worker(w)
                        self._feeds.pop(w, None)
        if added or expired or any(w in self._feeds for w in loaded):
            self._on_change()

    def _parse_beats(self, workers: list[str], raws: list[bytes | None]
                     ) -> dict[str, Heartbeat]:
        """The valid heartbeats of ``workers`` (``raws``: their records as read, None: no
        record). A record read unchanged is not parsed again; a malformed one is rejected,
        counted once while it stays the same."""
        beats: dict[str, Heartbeat] = {}
        cache = self._beat_cache
        for w, raw in zip(workers, raws, strict=True):
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
        return beats


def _listed(reply: list[bytes] | None) -> list[bytes]:
    """An SMEMBERS reply as it came (the mirror's response callback: see __init__)."""
    return reply or []


def _name(stream: bytes | str) -> str:
    return stream.decode() if isinstance(stream, bytes) else stream
