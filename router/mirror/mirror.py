"""The router's in-memory mirror of the cluster's cache state, fed from Redis.

It bootstraps from every worker's snapshot (:mod:`.snapshots`), then follows the model's
change feed (:mod:`.feed`) into the cache state (:mod:`.cache`: the index and each worker's
feed position) while scanning heartbeats (:mod:`.heartbeats`): new workers join the registry,
expired ones leave it and the index.

Routing never waits on any of this: it reads :attr:`IndexMirror.index` and
:attr:`IndexMirror.available`, both changed only by the mirror's tasks. When Redis fails,
``available`` turns False (routing falls back to load alone) and the mirror reconnects and
bootstraps from scratch. A record that breaks the schema is rejected (:mod:`.stats`), never
taken as state and never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.exceptions import AuthenticationError, NoPermissionError

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_conn import REDIS_ERRORS, RedisClient, explain
from kvroute.core.redis_schema import FeedEvent, RedisKeys
from kvroute.router.lost import LostWorkers, Probe
from kvroute.router.mirror.cache import MirroredCache
from kvroute.router.mirror.feed import FeedFollower
from kvroute.router.mirror.heartbeats import HeartbeatScan
from kvroute.router.mirror.parts import MirrorParts
from kvroute.router.mirror.snapshots import SnapshotReader, listed
from kvroute.router.mirror.stats import MirrorStats, Rejects
from kvroute.router.registry import WorkerRegistry

if TYPE_CHECKING:
    from kvroute.router.shared import SharedDecisions

log = logging.getLogger("kvroute.router.mirror")


class IndexMirror:
    def __init__(
        self,
        client: RedisClient,
        keys: RedisKeys,
        registry: WorkerRegistry,
        *,
        poll_interval_s: float = 0.5,
        retry_s: float = 1.0,
        on_change: Callable[[], None] | None = None,
        probe: Probe | None = None,
    ) -> None:
        """``client`` is the mirror's own (its SMEMBERS replies change: see
        :func:`.snapshots.listed`). ``probe``: whether an agent answers; with it, a worker
        whose heartbeat is gone stays while its agent answers (router/lost.py); without
        it, it leaves with its heartbeat."""
        self._r = client
        client.set_response_callback("SMEMBERS", listed)
        self.registry = registry
        self.lost = LostWorkers(probe) if probe is not None else None
        self.available = False
        self.stats = MirrorStats()
        self.ready = asyncio.Event()  # set after the first successful bootstrap
        self.last_error = ""  # why Redis last failed, in words (redis_conn.explain)
        self._poll_s = poll_interval_s
        self._retry_s = retry_s
        self._on_change = on_change or (lambda: None)
        self._stopping = asyncio.Event()
        self._reported: bool | None = None  # the Redis state last logged (None: not yet)
        reject = Rejects(self.stats)
        self.cache = MirroredCache(self.stats, reject)
        self.snapshots = SnapshotReader(client, keys, self.cache, self.stats, reject)
        # Held by the feed while it applies a batch and by the heartbeat scan while it loads
        # snapshots or removes workers: the two never interleave on cache state (_follow).
        lock = asyncio.Lock()
        parts = MirrorParts(client, keys, self.cache, self.snapshots, registry, reject, lock,
                            poll_interval_s, self._on_change)
        self.feed = FeedFollower(parts, self.stats)
        self.heartbeats = HeartbeatScan(parts, self.stats, self.lost)

    @property
    def index(self) -> PrefixIndex:
        """The cache state routing reads (a bootstrap replaces it: read it at each use)."""
        return self.cache.index

    @property
    def shared(self) -> SharedDecisions | None:
        """The other routers' decisions, read with the feed (None: --share-decisions off)."""
        return self.feed.shared

    @shared.setter
    def shared(self, shared: SharedDecisions | None) -> None:
        self.feed.shared = shared

    async def apply(self, ev: FeedEvent) -> None:
        """Apply one feed event as if read from the feed."""
        await self.feed.apply(ev)

    def view(self, keys: bool = False) -> dict[str, dict[str, object]]:
        """:meth:`.cache.MirroredCache.view`."""
        return self.cache.view(keys)

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

    async def _bootstrap(self) -> None:
        """A new index: the feed's position first, then every member's heartbeat and
        snapshot. Every snapshot in one :meth:`SnapshotReader.load_many`, in the order the
        registry's SCAN found and registered them: loaded sorted by name instead, the gRPC
        decision's p50 at 1,000 workers was 1.3-1.7 ms, not 0.86 (docs/scaling.md)."""
        await self.feed.start_here()
        self.cache.reset()
        self.heartbeats.reset()
        await self.snapshots.load_many(await self.heartbeats.scan(load=False))
        for w in self.index.workers():
            self.registry.set_cached_blocks(w, self.index.gpu_count(w))
        self.stats.bootstraps += 1
        log.info("mirror bootstrapped", extra={"kv": {
            "workers": len(self.cache.positions), "blocks": self.index.entries(),
            "feed_from": self.feed.last_id.decode()}})

    async def _follow(self) -> None:
        """Follow the feed and scan heartbeats, as two tasks, until :meth:`stop` or the
        first failure of either, which is raised once both have ended.

        Why two tasks: on one loop, every entry that arrived during a scan of all workers'
        heartbeats waited for the whole of it (1,000 workers: feed propagation p99 ~60-100
        ms against p50 ~3 ms). Now the feed waits at most for one part of a scan
        (:data:`.heartbeats.SCAN_CHUNK` heartbeats) or for what the scan does holding the
        lock.

        Why it is safe, at each await where the two interleave:

        * Cache state is changed by the feed only while it holds the lock (a whole XREAD
          batch, its snapshot reloads included) and by the scan only while it holds it too
          (loading new workers' snapshots, removing expired and unlisted workers), so a
          worker's (epoch, seq) and blocks change as on one loop: no snapshot load overlaps
          another load or the feed's events of that worker, and none completes after the
          worker was removed. The scan decides whom to load before taking the lock and
          checks the cache again under it (the feed may have loaded a worker meanwhile,
          from a fresher snapshot).
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
                 asyncio.create_task(self.heartbeats.run(self._stopping)))
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
            await self.feed.step()
