"""Following the model's change feed (and the other routers' decisions, in the same XREAD).

Each entry is applied to the :class:`~kvroute.router.mirror.cache.MirroredCache` in order;
where the cache says a worker's snapshot must be read instead (a gap, an unannounced epoch),
it is read then and there, before the next entry. A batch is applied holding the mirror's
lock (:meth:`kvroute.router.mirror.mirror.IndexMirror._follow` says why).
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from kvroute.core.redis_schema import FeedError, FeedEvent
from kvroute.router.mirror.parts import MirrorParts, MirrorTask
from kvroute.router.mirror.stats import PROPAGATION_BOUNDS_S, MirrorStats

if TYPE_CHECKING:
    from kvroute.router.shared import SharedDecisions

XREAD_COUNT = 1000
# Least seconds between two updates of the registry's per-worker block counts while the feed
# has a backlog: each update rebuilds the worker's load, which cost more than applying the
# entries themselves when a batch of 1,000 entries touched 1,000 workers.
_COUNTS_EVERY_S = 0.05


class FeedFollower(MirrorTask):
    """Reads the feed from :attr:`last_id` on; :meth:`start_here` sets it."""

    def __init__(self, parts: MirrorParts, stats: MirrorStats) -> None:
        super().__init__(parts)
        self._stats = stats
        self.last_id = b"0-0"
        # The other routers' decisions, read in the same XREAD (None: --share-decisions off).
        self.shared: SharedDecisions | None = None
        self._touched: set[str] = set()  # workers whose block count the registry lacks
        self._counts_due = 0.0

    async def start_here(self) -> None:
        """Take the feed's (and the decisions') current end as the position to read from.
        Taken before the snapshots are read: every entry after it is then either newer than
        them or a duplicate their seq lets the cache skip."""
        last = await self._r.xrevrange(self._keys.feed, "+", "-", count=1)
        self.last_id = last[0][0] if last else b"0-0"
        self._touched.clear()
        if self.shared is not None:
            # The new index holds none of the others' predictions: count them afresh, from
            # now (an older decision is either done or soon past its max age).
            self.shared.reset()
            last = await self._r.xrevrange(self.shared.key, "+", "-", count=1)
            self.shared.last_id = last[0][0] if last else b"0-0"

    async def step(self) -> None:
        """One XREAD of the feed (and the shared decisions) and what it brought applied.
        It waits at most ``poll_s`` for entries: the expiries below run that often."""
        now = time.monotonic()
        self._cache.index.expire(now)  # predicted entries past their deadline (--predict-ttl-s)
        shared = self.shared
        streams = {self._keys.feed: self.last_id}
        if shared is not None:
            shared.expire(now)
            streams[shared.key] = shared.last_id  # same hash tag: one slot, one XREAD
        block_ms = max(1, int(self._poll_s * 1000))
        resp = await self._r.xread(streams, count=XREAD_COUNT, block=block_ms)
        async with self._lock:
            read = 0
            for stream, entries in resp or ():
                if shared is not None and _name(stream) == shared.key:
                    for entry_id, fields in entries:
                        shared.last_id = entry_id
                        shared.apply(fields)
                    continue
                read += len(entries)
                for entry_id, fields in entries:
                    self.last_id = entry_id
                    await self._apply_entry(entry_id, fields)
            self._count_blocks(caught_up=read < XREAD_COUNT)
        if resp:
            self._on_change()

    def _count_blocks(self, caught_up: bool) -> None:
        """The registry's block counts of the workers the feed touched: now when caught up
        (a short read), at most every :data:`_COUNTS_EVERY_S` when behind."""
        now = time.monotonic()
        if self._touched and (caught_up or now >= self._counts_due):
            for w in self._touched:
                self._registry.set_cached_blocks(w, self._cache.index.gpu_count(w))
            self._touched.clear()
            self._counts_due = now + _COUNTS_EVERY_S

    async def _apply_entry(self, entry_id: bytes, fields: dict[bytes, bytes]) -> None:
        """Apply one stream entry (a malformed one is rejected)."""
        try:
            ev = FeedEvent.from_fields(fields)
        except FeedError as exc:
            worker = fields.get(b"w", b"?").decode(errors="replace")[:80]
            self._reject("feed", exc.reason, worker, f"entry {entry_id.decode()}: {exc}")
            return
        ms = int(entry_id.split(b"-")[0])
        st = self._stats
        st.lag_s = lag = max(0.0, time.time() - ms / 1000)
        st.propagation[bisect.bisect_left(PROPAGATION_BOUNDS_S, lag)] += 1
        st.propagation_sum_s += lag
        st.last_event_at = time.time()
        await self.apply(ev)
        self._touched.add(ev.worker)

    async def apply(self, ev: FeedEvent) -> None:
        """Apply one feed event, healing from the snapshot on a gap or unknown epoch."""
        if not self._cache.apply(ev):
            await self._snapshots.load(ev.worker)


def _name(stream: bytes | str) -> str:
    return stream.decode() if isinstance(stream, bytes) else stream
