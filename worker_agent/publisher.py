"""Publishes an engine's cache state to Redis: change feed, snapshot and heartbeat.

Invariants:

* Events reach Redis in the order the engine emitted them, each feed entry with the next
  ``seq`` of the current ``epoch``; the snapshot and meta change in the same transaction.
* An event leaves the pending buffer only after its transaction succeeded; a failed write is
  retried, never dropped (a retry after an ambiguous failure re-sends the same seqs, which
  readers ignore as duplicates).
* When the buffer overflows, or Redis has lost our state (restart without persistence), the
  agent starts a new epoch and rewrites its whole snapshot from the engine (``op=resync``):
  buffered events are subsumed by that snapshot, so nothing is lost, only re-sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvroute.core.cache_events import CacheEvent
from kvroute.core.redis_conn import REDIS_ERRORS, RedisClient, refusal
from kvroute.core.redis_schema import (
    STATE_TTL_S,
    FeedEvent,
    Heartbeat,
    Op,
    RecordError,
    RedisKeys,
    pack_keys,
)

log = logging.getLogger("kvroute.agent.publisher")

_SADD_CHUNK = 10000  # keys per SADD: bounds one command's size on a big resync
# What the loops survive and retry: Redis errors, and the RuntimeError ("Event loop is
# closed") redis-py's cluster client raises when it drops a connection it cannot close. It
# once ended the first heartbeat loop of a process silently: the worker's heartbeat stopped
# while the agent ran on, and routers pruned it (bench/scale.py, docs/scaling.md).
_LOOP_ERRORS = (*REDIS_ERRORS, RuntimeError)


def new_epoch() -> str:
    """Unique per agent start or resync: millisecond time plus randomness."""
    return f"{int(time.time() * 1000):x}-{os.urandom(4).hex()}"


@dataclass
class PublisherStats:
    events_published: int = 0
    entries_written: int = 0
    resyncs: int = 0
    state_losses: int = 0  # times Redis was found without our epoch or snapshot
    redis_up: bool = False
    pending: int = 0


class CachePublisher:
    """Feeds one worker's cache events to Redis and heartbeats its load."""

    def __init__(
        self,
        client: RedisClient,
        keys: RedisKeys,
        worker_id: str,
        snapshot: Callable[[], list[int]],
        heartbeat: Callable[[], Heartbeat | None],
        *,
        lower: Callable[[], list[int]] | None = None,
        heartbeat_s: float = 1.0,
        heartbeat_ttl_s: float = 3.0,
        max_pending: int = 100_000,
        feed_maxlen: int = 1_000_000,
        max_batch_events: int = 512,
        state_ttl_s: float = STATE_TTL_S,
    ) -> None:
        """``snapshot``: every key the engine caches, whatever its tier; ``lower``: those
        held only in a lower tier (None: an engine without tiers);
        ``state_ttl_s``: how long our snapshot and meta outlive our last write."""
        self._r = client
        self._keys = keys
        self._worker = worker_id
        self._snapshot = snapshot
        self._lower = lower
        # Whether we may have written a lower-tier set: until then its writes are skipped.
        self._tiered = False
        self._heartbeat = heartbeat
        self._hb_s = heartbeat_s
        self._ttl_ms = max(1, int(heartbeat_ttl_s * 1000))
        self._state_ttl_ms = max(1, int(state_ttl_s * 1000))
        self._max_pending = max_pending
        self._maxlen = feed_maxlen
        self._max_batch = max_batch_events
        self._pending: deque[CacheEvent] = deque()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._needs_resync = True  # the first write declares our epoch
        self._synced = False  # True while Redis holds our current epoch's snapshot
        self._reported: bool | None = None  # the Redis state last logged (None: not yet)
        self.epoch = new_epoch()
        self.seq = 0
        self.chain = 0  # the feed chain at self.seq (FeedEvent.chained)
        self._size = 0  # members our writes left in the snapshot set (SADD/SREM replies)
        # Held across each write and each heartbeat with its check: a check then compares
        # Redis with a size that counts every write Redis has applied.
        self._io = asyncio.Lock()
        self.stats = PublisherStats()
        self._tasks: list[asyncio.Task[None]] = []

    # -- engine side (synchronous, called from the engine's listener) ----------------------

    def on_event(self, event: CacheEvent) -> None:
        if self._needs_resync:
            return  # the coming resync reads the engine's state directly
        if len(self._pending) >= self._max_pending:
            log.warning("publish buffer full; will resync from a fresh snapshot",
                        extra={"kv": {"pending": len(self._pending)}})
            self._pending.clear()
            self._needs_resync = True
        else:
            self._pending.append(event)
        self.stats.pending = len(self._pending)
        self._wake.set()

    async def peer_address(self, worker: str) -> str | None:
        """The address in ``worker``'s live heartbeat; None when it has none (expired, never
        registered, or malformed). Redis errors propagate (nothing can be verified)."""
        raw = await self._r.get(self._keys.heartbeat(worker))
        if raw is None:
            return None
        try:
            hb = Heartbeat.from_json(raw)
        except RecordError:
            return None
        return hb.address if hb.worker_id == worker else None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._wake.set()  # declare our epoch at once
        self._tasks = [
            asyncio.create_task(self._feed_loop(), name="publisher-feed"),
            asyncio.create_task(self._heartbeat_loop(), name="publisher-heartbeat"),
        ]

    async def stop(self, *, deregister: bool = True) -> None:
        """Flush what is pending (best effort), then stop. A clean stop (``deregister``)
        removes our heartbeat (our registration), snapshot and meta, so routers forget us at once
        instead of after the TTL.

        The loops are asked to stop between Redis commands (cancelling redis-py mid-command
        can leave a connection waiting out its socket timeout) and cancelled only if they
        do not within a bounded time."""
        self._stopping.set()
        self._wake.set()
        if self._tasks:
            _, late = await asyncio.wait(self._tasks, timeout=3.0)
            for t in late:
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await asyncio.wait_for(self.flush(), timeout=2.0)
            if deregister:
                await self._deregister()
        except (TimeoutError, *REDIS_ERRORS):
            pass
        # Closing is best effort; redis-py's cluster client can fail to close a connection
        # whose node it already dropped (RuntimeError: event loop is closed).
        with contextlib.suppress(*REDIS_ERRORS, RuntimeError):
            await self._r.aclose()

    async def _feed_loop(self) -> None:
        backoff = 0.05
        while not self._stopping.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._stopping.is_set():
                break
            await asyncio.sleep(0.002)  # let a burst of engine events coalesce
            try:
                while await self.flush():
                    pass
                backoff = 0.05
            except _LOOP_ERRORS as exc:
                self._set_up(False, exc)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), backoff)
                backoff = min(backoff * 2, 2.0)
                self._wake.set()

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._beat()
                self._set_up(True)
            except _LOOP_ERRORS as exc:
                self._set_up(False, exc)
            except Exception:  # a bug (of the engine's load, say): said, and beaten again
                log.exception("heartbeat failed", extra={"kv": {"worker": self._worker}})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._hb_s)

    async def _deregister(self) -> None:
        k = self._keys
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(k.heartbeat(self._worker), k.snapshot(self._worker), k.meta(self._worker),
                    k.lower(self._worker))
        await pipe.execute()

    def _set_up(self, up: bool, exc: BaseException | None = None) -> None:
        # Logged on each change, and the first time either way: a Redis never reached (a
        # wrong address or password) is said at start, not only a Redis lost later.
        if up != self._reported:
            self._reported = up
            if up:
                log.info("redis reachable", extra={"kv": {"worker": self._worker}})
            else:
                # Refused credentials, a denied command or a failed TLS handshake are named
                # as such (never with the password), not as unreachability.
                why = refusal(self._r, exc) if exc is not None else None
                log.warning(f"{why or 'redis unreachable'}; buffering cache events",
                            extra={"kv": {"worker": self._worker, "error": exc}})
        self.stats.redis_up = up

    async def _beat(self) -> None:
        hb = self._heartbeat()
        if hb is None:
            # The engine cannot serve: no heartbeat, so routers forget this worker now.
            await self._r.delete(self._keys.heartbeat(self._worker))
            return
        k = self._keys
        async with self._io:
            # The epoch and size we expect Redis to hold; None while a resync is pending.
            expected = (self.epoch, self._size) if self._synced else None
            pipe = self._r.pipeline(transaction=True)
            pipe.hget(k.meta(self._worker), "epoch")
            pipe.scard(k.snapshot(self._worker))
            self._beat_in(pipe, self.epoch, self.seq, self.chain, hb)
            epoch, size, *_ = await pipe.execute()
            if expected is not None:
                self._check_state(expected, epoch, size)

    def _beat_in(self, pipe: Any, epoch: str, seq: int, chain: int,
                 hb: Heartbeat | None = None) -> None:
        """Add the heartbeat (under ``epoch``, the feed at ``seq`` and ``chain``; our
        registration) and our state's new TTL to ``pipe``, a transaction that writes this
        worker's record (after the snapshot's writes: a key a DEL recreated needs its TTL
        again): after Redis lost
        them, the first write brings back the record and the heartbeat together, so
        routers keep the worker on its agent's health check no longer than that
        (router/lost.py). No heartbeat while the engine cannot serve."""
        k = self._keys
        pipe.pexpire(k.snapshot(self._worker), self._state_ttl_ms)
        pipe.pexpire(k.meta(self._worker), self._state_ttl_ms)
        if self._tiered:
            pipe.pexpire(k.lower(self._worker), self._state_ttl_ms)
        hb = hb or self._heartbeat()
        if hb is None:  # deleted with this write: no heartbeat names a seq behind the feed
            pipe.delete(k.heartbeat(self._worker))
            return
        hb = replace(hb, epoch=epoch, feed_seq=seq, feed_chain=chain)
        pipe.set(k.heartbeat(self._worker), hb.to_json(), px=self._ttl_ms)

    def _check_state(self, expected: tuple[str, int], epoch: bytes | None, size: int) -> None:
        """Redis's copy of our state against what we wrote: a missing or other epoch, or a
        snapshot of another size, means Redis lost data (restart, FLUSHALL, failover with
        lost writes, an evicted key) or another writer: rewrite it whole, new epoch."""
        want_epoch, want_size = expected
        if epoch is not None and epoch.decode() == want_epoch and size == want_size:
            return
        log.warning("redis lost this worker's state; rewriting its snapshot under a new "
                    "epoch", extra={"kv": {"worker": self._worker, "epoch": want_epoch,
                                           "redis_epoch": epoch.decode() if epoch else None,
                                           "size": want_size, "redis_size": size}})
        self.stats.state_losses += 1
        self._synced = False
        self._needs_resync = True
        self._wake.set()

    # -- writing ---------------------------------------------------------------------------

    async def flush(self) -> bool:
        """Write one batch. Returns True if more work remains."""
        async with self._io:
            return await self._flush()

    async def _flush(self) -> bool:
        if self._needs_resync:
            await self._resync()
            return bool(self._pending)
        if not self._pending:
            return False
        batch = [self._pending[i] for i in range(min(self._max_batch, len(self._pending)))]
        entries = _coalesce(batch)
        k = self._keys
        pipe = self._r.pipeline(transaction=True)
        # Before this batch's writes, in its transaction: what Redis held of us.
        pipe.hget(k.meta(self._worker), "epoch")
        pipe.scard(k.snapshot(self._worker))
        expected = (self.epoch, self._size)
        writes: list[str] = []  # the command of each reply after those two
        seq, chain = self.seq, self.chain
        for op, keys in entries:
            seq += 1
            ev = FeedEvent(self._worker, self.epoch, seq, op, tuple(keys))
            chain = ev.chained(chain)
            pipe.xadd(k.feed, ev.to_fields(), maxlen=self._maxlen, approximate=True)
            writes.append("xadd")
            writes.extend(self._write_op(pipe, op, keys))
        pipe.hset(k.meta(self._worker), mapping={"epoch": self.epoch, "seq": seq, "h": chain})
        self._beat_in(pipe, self.epoch, seq, chain)  # its replies come after those read below
        epoch, size, *replies = await pipe.execute()
        for command, n in zip(writes, replies, strict=False):  # the HSET's reply is last
            if command == "sadd":
                self._size += int(n)
            elif command == "srem":
                self._size -= int(n)
            elif command == "del":
                self._size = 0
        if self._synced:
            self._check_state(expected, epoch, size)
        # Success: only now do the events leave the buffer.
        for _ in batch:
            self._pending.popleft()
        self.seq, self.chain = seq, chain
        self.stats.events_published += len(batch)
        self.stats.entries_written += len(entries)
        self.stats.pending = len(self._pending)
        self._set_up(True)
        return bool(self._pending)

    def _write_op(self, pipe: Any, op: Op, keys: list[int]) -> list[str]:
        """Add one feed entry's change of the snapshot (and lower-tier set) to ``pipe``;
        returns the name of each command whose reply counts the snapshot's size ("sadd",
        "srem", "del"), "" for the others."""
        k, w = self._keys, self._worker
        if op is Op.CLEAR:
            pipe.delete(k.snapshot(w), k.lower(w))
            return ["del"]
        if not keys:
            return []
        members = [pack_keys((x,)) for x in keys]
        if op is Op.LOWER:
            self._tiered = True
            pipe.sadd(k.snapshot(w), *members)
            pipe.sadd(k.lower(w), *members)
            return ["sadd", ""]
        if op is Op.STORE:
            pipe.sadd(k.snapshot(w), *members)
            written = ["sadd"]
        else:
            pipe.srem(k.snapshot(w), *members)
            written = ["srem"]
        if self._tiered:
            pipe.srem(k.lower(w), *members)
            written.append("")
        return written

    async def _resync(self) -> None:
        # Read the engine's state and drop the buffer in one synchronous step: every buffered
        # event is already reflected in this snapshot.
        keys = self._snapshot()
        lower = self._lower() if self._lower is not None else []
        self._pending.clear()
        self.stats.pending = 0  # else the pending gauge keeps the pre-resync count
        self._needs_resync = False  # events from here on queue behind this snapshot
        self._synced = False  # until this snapshot is in Redis
        # The first snapshot declares the epoch the agent announced at start; each later one
        # is a new epoch.
        epoch = self.epoch if self.stats.resyncs == 0 else new_epoch()
        op = Op.RESYNC if keys else Op.CLEAR
        k = self._keys
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(k.snapshot(self._worker), k.lower(self._worker))
        for key, members in ((k.snapshot(self._worker), keys), (k.lower(self._worker), lower)):
            for i in range(0, len(members), _SADD_CHUNK):
                chunk = members[i : i + _SADD_CHUNK]
                pipe.sadd(key, *(pack_keys((x,)) for x in chunk))
        self._tiered = self._tiered or bool(lower)
        ev = FeedEvent(self._worker, epoch, 1, op)
        chain = ev.chained(0)
        pipe.hset(k.meta(self._worker), mapping={"epoch": epoch, "seq": 1, "h": chain})
        self._beat_in(pipe, epoch, 1, chain)
        pipe.xadd(k.feed, ev.to_fields(), maxlen=self._maxlen, approximate=True)
        try:
            await pipe.execute()
        except REDIS_ERRORS:
            self._needs_resync = True
            raise
        self.epoch, self.seq, self.chain = epoch, 1, chain
        self._size = len(set(keys))
        self._synced = True
        self.stats.resyncs += 1
        self._set_up(True)
        log.info("published snapshot", extra={"kv": {
            "worker": self._worker, "epoch": epoch, "blocks": len(keys),
            "lower_blocks": len(lower), "op": op.value}})


def _coalesce(events: list[CacheEvent]) -> list[tuple[Op, list[int]]]:
    """Merge runs of same-op events into one feed entry each (order preserved)."""
    out: list[tuple[Op, list[int]]] = []
    for ev in events:
        if out and out[-1][0] is ev.op and ev.op in (Op.STORE, Op.LOWER, Op.EVICT):
            out[-1][1].extend(ev.keys)
        else:
            out.append((ev.op, list(ev.keys)))
    return out
