"""The mirrored cache state: the prefix index and, per worker, the feed position it holds.

Invariant: a worker's blocks in :attr:`MirroredCache.index` are exactly its snapshot at
(epoch, seq) plus the feed's entries of that epoch up to ``seq``, applied in order, and
nothing else changes them. :meth:`MirroredCache.apply` applies an entry only when it is the
next one; it skips a duplicate and says when the worker's snapshot must be read again (a gap,
an unannounced epoch). ``clear`` or ``resync`` at seq 1 start a new epoch.
"""

from __future__ import annotations

import base64
import logging
from collections import deque
from dataclasses import dataclass, field

from kvroute.core.index import PrefixIndex
from kvroute.core.redis_schema import FeedEvent, Op, RecordError, pack_keys, parse_meta
from kvroute.router.mirror.stats import MirrorStats, Rejects

log = logging.getLogger("kvroute.router.mirror")


# Feed positions whose chain a mirror keeps per worker: a heartbeat's (seq, chain) is checked
# when its seq is among them. Agents beat every second; this covers far more entries than a
# worker writes in one.
RECENT_CHAINS = 256


@dataclass
class FeedPosition:
    """The last feed entry applied (its epoch and seq) and the chain at the most recent
    ones (seq -> FeedEvent.chained, consecutive seqs ending at ``seq``)."""

    epoch: str
    seq: int
    chain: int = 0
    recent: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=RECENT_CHAINS))

    def __post_init__(self) -> None:
        self.recent.append((self.seq, self.chain))

    def advance(self, ev: FeedEvent) -> None:
        """``ev``, the next entry, applied."""
        self.seq, self.chain = ev.seq, ev.chained(self.chain)
        self.recent.append((self.seq, self.chain))

    def chain_at(self, seq: int) -> int | None:
        """The chain after entry ``seq``; None when it is not among the recent ones."""
        if not self.recent or not self.recent[0][0] <= seq <= self.seq:
            return None
        return self.recent[seq - self.recent[0][0]][1]


class MirroredCache:
    """The index and feed positions; one instance for the mirror's life (:meth:`reset`
    starts both afresh)."""

    def __init__(self, stats: MirrorStats, reject: Rejects) -> None:
        self.index = PrefixIndex()
        self.positions: dict[str, FeedPosition] = {}
        self._stats = stats
        self._reject = reject

    def reset(self) -> None:
        self.index = PrefixIndex()
        self.positions.clear()

    def holds(self, worker: str) -> bool:
        """Whether ``worker``'s cache state is known (a snapshot or a new epoch applied)."""
        return worker in self.positions

    def remove(self, worker: str) -> int:
        """Forget ``worker``; returns the blocks dropped."""
        self.positions.pop(worker, None)
        return self.index.remove_worker(worker)

    def install(self, worker: str, meta: dict[bytes, bytes], members: list[bytes] | bytes,
                lower: list[bytes] | bytes = b"") -> None:
        """Make ``worker``'s cache its snapshot as read, ``lower`` the members it holds
        only in its lower tier (no meta: no state; a malformed one is rejected and leaves
        no state either)."""
        self._stats.snapshot_loads += 1
        if not meta:
            self.remove(worker)
            return
        try:
            # The meta checked here; the members decoded (and checked) by the index in C,
            # not into an int object per key first: a bootstrap reads millions.
            epoch, seq, chain = parse_meta(meta)
            try:
                self.index.replace_worker_packed(worker, members, lower)
            except ValueError as exc:  # a member not one 8-byte key: no change made
                raise RecordError(f"{exc}", "bad_type") from exc
        except RecordError as exc:
            self._reject("snapshot", exc.reason, worker, exc)
            self.remove(worker)
            return
        self.positions[worker] = FeedPosition(epoch, seq, chain)

    def apply(self, ev: FeedEvent) -> bool:
        """Apply one feed event; False when the worker's snapshot must be read instead."""
        pos = self.positions.get(ev.worker)
        if pos is None or pos.epoch != ev.epoch:
            if ev.seq == 1 and ev.op is Op.CLEAR:
                self.index.clear_worker(ev.worker)
                self.positions[ev.worker] = FeedPosition(ev.epoch, 1, ev.chained(0))
                self._stats.events_applied += 1
                return True
            if ev.op is not Op.RESYNC:
                self._stats.gaps += 1
            return False
        if ev.seq <= pos.seq:
            return True  # already in the snapshot we loaded, or a re-sent batch
        if ev.seq != pos.seq + 1:
            self._stats.gaps += 1
            log.warning("feed gap; reloading snapshot", extra={"kv": {
                "worker": ev.worker, "expected": pos.seq + 1, "got": ev.seq}})
            return False
        if ev.op is Op.STORE or ev.op is Op.LOWER:
            self.index.add(ev.worker, ev.keys, lower=ev.op is Op.LOWER)
        elif ev.op is Op.EVICT:
            self.index.remove(ev.worker, ev.keys)
        elif ev.op is Op.CLEAR:
            self.index.clear_worker(ev.worker)
        else:  # RESYNC within an epoch is not something agents send; be safe
            return False
        pos.advance(ev)
        self._stats.events_applied += 1
        return True

    def view(self, keys: bool = False) -> dict[str, dict[str, object]]:
        """What is held per worker, for comparing routers (``/debug/mirror``): the feed
        position applied (``epoch``, ``seq``), the real blocks held (``blocks``) and
        ``sum``, their keys' sum mod 2^64 (a digest: equal views give equal sums); with
        ``keys``, the keys themselves (``keys_b64``: sorted, 8-byte big-endian, base64).
        Call it on the mirror's event loop: it is then one consistent moment."""
        out: dict[str, dict[str, object]] = {}
        for w in self.index.workers():
            held = self.index.keys_of(w)
            pos = self.positions.get(w)
            row: dict[str, object] = {"epoch": pos.epoch if pos else "",
                                      "seq": pos.seq if pos else 0, "blocks": len(held),
                                      "sum": sum(held) % (1 << 64)}
            if keys:
                row["keys_b64"] = base64.b64encode(pack_keys(sorted(held))).decode()
            out[w] = row
        return out
