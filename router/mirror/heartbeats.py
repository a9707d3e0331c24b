"""Scanning workers' heartbeats: who joins the registry, who leaves it and the index.

Each agent registers by its own heartbeat key, which expires on its own, so no agent edits a
shared list. A scan reads the heartbeat of every worker it knows: those a SCAN of the
heartbeat keys found (at the bootstrap, and then every :data:`FULL_SCAN_MIN_S` or more:
SCAN examines every key of the node, which on a Redis shared with millions of other keys
takes a second), those the feed named (a new agent's first entry and heartbeat are one
write), and those with a heartbeat within :data:`KNOWN_FOR_S`. A new worker joins the
registry and its snapshot is read; a worker whose heartbeat expired leaves the registry and
the index (unless its agent still answers: router/lost.py). It only reads Redis. It runs
beside the feed, in parts (:data:`SCAN_CHUNK` heartbeats each), and changes the cache only
holding the mirror's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from kvroute.core.redis_schema import STATE_TTL_S, Heartbeat, RecordError, heartbeat_workers
from kvroute.router.lost import LostWorkers
from kvroute.router.mirror.parts import MirrorParts, MirrorTask
from kvroute.router.mirror.snapshots import LOAD_CONCURRENCY
from kvroute.router.mirror.stats import MirrorStats
from kvroute.router.registry import Vocabulary

log = logging.getLogger("kvroute.router.mirror")

# Heartbeats one scan reads (one MGET) and applies at a time before the feed gets its turn:
# a whole scan of 1,000 workers in one go (~15-40 ms of CPU on a quiet core, 50-100 ms on a
# loaded machine) made every feed entry that arrived meanwhile wait for all of it.
SCAN_CHUNK = 100
# Keys one SCAN call examines: the model's keys are ~4 a worker, so 1,000 workers take a few
# calls (per primary, on a Redis Cluster).
SCAN_COUNT = 2000
# The least seconds between two SCANs of the heartbeat keys, and how many times its last
# duration they are apart at least: Redis spends at most 1/FULL_SCAN_COST of its time on them.
FULL_SCAN_MIN_S = 1.0
FULL_SCAN_COST = 20.0
# How long a worker is looked for after its last heartbeat without a SCAN finding it: an agent
# stopped or cut off from Redis that long has lost its state too (STATE_TTL_S).
KNOWN_FOR_S = STATE_TTL_S
# How long before a live worker whose snapshot held no readable state (none written yet, or
# malformed) is read again: at every scan, a malformed one would be logged and counted twice
# a second.
_SNAPSHOT_RETRY_S = 5.0


class HeartbeatScan(MirrorTask):
    """One instance for the mirror's life; :meth:`reset` before each bootstrap."""

    def __init__(self, parts: MirrorParts, stats: MirrorStats, lost: LostWorkers | None
                 ) -> None:
        super().__init__(parts)
        self._stats = stats
        self._lost = lost
        self._expire_from = 0.0
        # When a live worker whose snapshot held no readable state may be read again.
        self._snapshot_due: dict[str, float] = {}
        self._bad_beats: dict[str, bytes] = {}  # worker -> its rejected heartbeat, counted once
        self._bad_members: set[bytes] = set()  # bad heartbeat keys seen, each counted once
        # Workers the cache held that the last scan's members lacked (_unlisted_twice).
        self._unlisted: set[str] = set()
        # worker -> (its heartbeat as last read, parsed): an unchanged record is not parsed
        # again at the next scan (agents beat every second, routers scan twice as often).
        self._beat_cache: dict[str, tuple[bytes, Heartbeat]] = {}
        # worker -> (what, its heartbeat's epoch or seq) where the last scan found its cache
        # apart from its heartbeat in a way that needs a second look (_heal).
        self._suspect: dict[str, tuple[str, object]] = {}
        self._known: dict[str, float] = {}  # worker -> when last found or beating (monotonic)
        self._full_scan_due = 0.0
        self.full_scans = 0

    def reset(self) -> None:
        """Before a bootstrap: Redis may have restarted empty, and then shows no heartbeats
        until agents beat again, so silence is not death for one TTL; every worker's
        snapshot is read afresh."""
        self._expire_from = time.monotonic() + self._registry.max_ttl_s() + self._poll_s
        self._snapshot_due.clear()
        self._full_scan_due = 0.0

    async def _members(self) -> list[str]:
        """The workers whose heartbeats this scan reads: found by the last SCAN (one is due:
        run it) or beating within :data:`KNOWN_FOR_S`, and those the feed named."""
        now = time.monotonic()
        if now >= self._full_scan_due:
            for w in await self._scan_keys():
                self._known[w] = now
            took = time.monotonic() - now
            self._full_scan_due = now + max(FULL_SCAN_MIN_S, FULL_SCAN_COST * took)
        for w in [w for w, t in self._known.items() if now - t > KNOWN_FOR_S]:
            del self._known[w]
        return list(dict.fromkeys([*self._known, *self._cache.positions]))

    async def _scan_keys(self) -> list[str]:
        """The workers whose heartbeat keys a SCAN finds; a key that names no valid worker
        is rejected, counted once while it stays."""
        k = self._keys
        names, bad = heartbeat_workers(k, [key async for key in self._r.scan_iter(
            match=k.heartbeat_match, count=SCAN_COUNT)])
        for m, exc in bad.items():
            if m not in self._bad_members:
                self._reject("member", "bad_name", repr(m)[:80], exc)
        self._bad_members = set(bad)
        self.full_scans += 1
        return names

    async def run(self, stopping: asyncio.Event) -> None:
        """Scan every ``poll_s``, start to start, until ``stopping`` (the bootstrap has
        just scanned)."""
        due = time.monotonic() + self._poll_s
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), max(0.0, due - time.monotonic()))
            if stopping.is_set():
                return
            due = time.monotonic() + self._poll_s
            await self.scan()

    async def scan(self, load: bool = True) -> list[str]:
        """One scan of every worker's heartbeat (``load`` False: no snapshot is read; the
        bootstrap reads them all after it). Returns the workers it found beating, in the
        order it read them."""
        members = await self._members()
        self._registry.revive_due()
        beats, added = await self._read_beats(members)
        now = time.monotonic()
        self._known.update(dict.fromkeys(beats, now))
        expire = now >= self._expire_from
        kept: set[str] = set()
        if expire and self._lost is not None:
            missing = [i.worker_id for i in self._registry.all()
                       if not i.static and i.worker_id not in beats]
            kept = await self._lost.keep(self._registry, missing)
        expired = self._registry.expire_missing(beats.keys() | kept, expire=expire)
        self._joined(added, beats)
        await self._heal(beats)
        loaded = await self._load_new(beats, set(expired)) if load else []
        await self._forget(expired, self._unlisted_twice(list(beats)))
        if added or expired or any(self._cache.holds(w) for w in loaded):
            self._on_change()
        return list(beats)

    async def _heal(self, beats: dict[str, Heartbeat]) -> None:
        """Read again the snapshot of each worker whose cache the mirror holds apart from
        what its heartbeat says. Only its own agent writes that, in the same transaction as
        every snapshot, meta and feed entry of its own; any agent may append to the feed.

        * ``chain``: another feed chain at the heartbeat's seq (:meth:`FeedEvent.chained`):
          an entry was applied that the agent never wrote, or one of its own was lost.
        * ``epoch``: another epoch, at two scans running with the same heartbeat epoch (one
          can fall between an agent's resync and the feed's applying its entry): the feed
          lost the new epoch's entry, or carried one the agent never wrote (a ``clear``).
        * ``seq``: entries applied past the heartbeat's seq, at two scans running with the
          same heartbeat (one can fall between its read and an entry written after it):
          entries the agent never wrote (docs/security.md)."""
        positions = self._cache.positions
        suspect: dict[str, tuple[str, object]] = {}
        chain_off: list[str] = []
        for w, hb in beats.items():
            pos = positions.get(w)
            if pos is None:
                continue
            if pos.epoch != hb.epoch:
                suspect[w] = ("epoch", hb.epoch)
            elif hb.feed_chain:  # 0: an agent that reports no chain
                held = pos.chain_at(hb.feed_seq)
                if held is not None and held != hb.feed_chain:
                    chain_off.append(w)
                elif pos.seq > hb.feed_seq:
                    suspect[w] = ("seq", hb.feed_seq)
        due = {w: what for w, (what, _) in suspect.items() if self._suspect.get(w) == suspect[w]}
        self._suspect = {w: s for w, s in suspect.items() if w not in due}
        due.update(dict.fromkeys(chain_off, "chain"))
        if not due:
            return
        for w, what in due.items():
            self._stats.heartbeat_mismatches[what] += 1
            log.warning(f"worker's cache is held apart from its heartbeat ({what}); reloading "
                        "its snapshot", extra={"kv": {
                            "worker": w, "held_epoch": positions[w].epoch,
                            "held_seq": positions[w].seq, "heartbeat_epoch": beats[w].epoch,
                            "heartbeat_seq": beats[w].feed_seq}})
        async with self._lock:
            await self._snapshots.load_many(list(due))

    async def _read_beats(self, members: list[str]) -> tuple[dict[str, Heartbeat], list[str]]:
        """Every member's valid heartbeat, read, parsed and given to the registry a part at
        a time; and the workers that joined it."""
        k = self._keys
        beats: dict[str, Heartbeat] = {}
        added: list[str] = []
        for i in range(0, len(members), SCAN_CHUNK):
            part = members[i:i + SCAN_CHUNK]
            got = self._parse_beats(part, await self._r.mget([k.heartbeat(w) for w in part]))
            beats.update(got)
            added += self._registry.update_heartbeats(got)
        for w in self._bad_beats.keys() - set(members):
            del self._bad_beats[w]
        for w in self._beat_cache.keys() - beats.keys():
            del self._beat_cache[w]
        return beats, added

    def _joined(self, added: list[str], beats: dict[str, Heartbeat]) -> None:
        for w in added:
            hb = beats[w]
            log.info("worker joined", extra={"kv": {
                "worker": w, "address": hb.address,
                "vocabulary": str(Vocabulary(hb.tokenizer, hb.vocab_size))}})
            # The feed may have indexed its blocks before its first heartbeat came.
            self._registry.set_cached_blocks(w, self._cache.index.gpu_count(w))

    async def _load_new(self, beats: dict[str, Heartbeat], dead: set[str]) -> list[str]:
        """Read the snapshot of each live worker the cache holds nothing of: it registered
        after the bootstrap (as after a Redis restart, when its heartbeat may come back
        after it) and may send no event for a long while. One with none to read yet (or a
        malformed one) is read again after a while. Returns the workers read."""
        now = time.monotonic()
        due = self._snapshot_due
        cache = self._cache
        wanted = [w for w in beats if not cache.holds(w) and w not in dead
                  and due.get(w, 0.0) <= now]
        loaded: list[str] = []
        for i in range(0, len(wanted), LOAD_CONCURRENCY):
            # A group at a time, the feed applying between them (many may be due at once,
            # after a Redis restart); checked again under the lock: the feed may have
            # loaded a worker meanwhile, and its snapshot is then at least as fresh.
            async with self._lock:
                group = [w for w in wanted[i:i + LOAD_CONCURRENCY] if not cache.holds(w)]
                await self._snapshots.load_many(group)
            for w in group:
                self._registry.set_cached_blocks(w, cache.index.gpu_count(w))
                if cache.holds(w):
                    due.pop(w, None)
                else:
                    due[w] = now + _SNAPSHOT_RETRY_S
            loaded += group
        return loaded

    def _unlisted_twice(self, beating: list[str]) -> list[str]:
        """Workers the cache holds that neither this scan nor the last one found beating:
        their heartbeats are gone (dead, never registered, or named only by a feed entry
        another agent wrote). Twice, because a worker's first feed entry and its heartbeat
        are one write, which may fall between this scan's read of heartbeats and the feed's
        applying that entry."""
        listed = set(beating)
        unlisted = {w for w in self._cache.positions if w not in listed}
        twice, self._unlisted = unlisted & self._unlisted, unlisted
        return sorted(twice)

    async def _forget(self, expired: list[str], unlisted: list[str]) -> None:
        if not expired and not unlisted:
            return
        async with self._lock:
            for w in expired:
                dropped = self._cache.remove(w)
                self._snapshot_due.pop(w, None)
                log.warning("worker heartbeat expired; forgetting it",
                            extra={"kv": {"worker": w, "blocks_dropped": dropped}})
            for w in unlisted:
                if w not in self._registry:  # a static worker's may be unlisted
                    self._cache.remove(w)

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
