"""Reading workers' snapshots from Redis, each as of one moment, many at once.

A snapshot is a worker's meta hash (epoch, seq), its set of 8-byte block keys and the set of
those held only in its lower tier (absent without tiers); every agent write to the sets is in
the transaction that also moves the meta's (epoch, seq)
(worker_agent/publisher.py), so a read bracketed by two equal meta reads is one moment.
"""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import NoPermissionError, ResponseError

from kvroute.core.redis_conn import RedisClient
from kvroute.core.redis_schema import RedisKeys, dumped_keys
from kvroute.router.mirror.cache import MirroredCache
from kvroute.router.mirror.stats import MirrorStats, Rejects

log = logging.getLogger("kvroute.router.mirror")

# Snapshots read at once when many are due (a bootstrap, many workers joining): each is one
# round trip, so 1,000 workers read one by one took 1,000 round trips end to end.
LOAD_CONCURRENCY = 32
_SNAPSHOT_SCRIPT = ("return {redis.call('HGETALL', KEYS[1]), redis.call('SMEMBERS', KEYS[2]), "
                    "redis.call('SMEMBERS', KEYS[3])}")

Snapshot = tuple[dict[bytes, bytes], list[bytes] | bytes, list[bytes]]
"""A worker's meta as read (empty: none), its members: one ``bytes`` of 8-byte keys end to
end (read by DUMP) or a list of them (SMEMBERS), and those of its lower tier (a list)."""


class SnapshotReader:
    """Reads snapshots with ``client`` (its SMEMBERS replying with the parser's list: see
    :func:`listed`) and installs them into ``cache``."""

    def __init__(self, client: RedisClient, keys: RedisKeys, cache: MirroredCache,
                 stats: MirrorStats, reject: Rejects) -> None:
        self._r = client
        self._keys = keys
        self._cache = cache
        self._stats = stats
        self._reject = reject
        self.dump = True  # snapshots read by DUMP (False: its ACL refused it; SMEMBERS)

    async def load(self, worker: str) -> None:
        """Read ``worker``'s snapshot and install it."""
        self._cache.install(worker, *await self.read(worker))

    async def load_many(self, workers: list[str]) -> None:
        """Read several workers' snapshots, :data:`LOAD_CONCURRENCY` round trips at once
        (each worker's own keys only: the order among them does not matter), and install
        each batch while Redis serves the next: a node writes its replies only once it has
        served all the reads it holds, so a batch read and installed in turn left Redis
        idle while the index loaded and the index while Redis read."""
        batches = [workers[i:i + LOAD_CONCURRENCY]
                   for i in range(0, len(workers), LOAD_CONCURRENCY)]
        reading = self._read_batch(batches[0]) if batches else None
        for i, batch in enumerate(batches):
            assert reading is not None
            # Every read ends before a failure is raised: none may still be in flight when
            # the mirror reconnects and bootstraps a new index.
            done = await reading
            reading = self._read_batch(batches[i + 1]) if i + 1 < len(batches) else None
            failed = next((x for x in done if isinstance(x, BaseException)), None)
            if failed is not None:
                if reading is not None:
                    await reading
                raise failed
            for w, read in zip(batch, done, strict=True):
                self._cache.install(w, *read)
                await asyncio.sleep(0)  # the next batch's reads go out meanwhile

    def _read_batch(self, workers: list[str]) -> asyncio.Future[list]:
        return asyncio.gather(*(self.read(w) for w in workers), return_exceptions=True)

    async def read(self, worker: str) -> Snapshot:
        """``worker``'s snapshot as of one moment; a snapshot or meta key that is not a
        set / hash is read as no state (and counted)."""
        try:
            return await self._read(worker)
        except ResponseError as exc:
            if "WRONGTYPE" not in str(exc):
                raise
            self._reject("snapshot", "wrong_type", worker, exc)
            return {}, [], []

    async def _read(self, worker: str) -> Snapshot:
        """One pipeline (one round trip; both keys share the model's slot) reads the meta,
        the members, then the meta again: every write to a snapshot is in the agent's
        MULTI/EXEC that also writes the meta's (epoch, seq), to a seq never written before
        in that epoch, so two equal meta reads bracket members of exactly that (epoch,
        seq). Only if they differ (the agent wrote meanwhile) is the atomic script (EVAL_RO)
        run. Not
        the script always: converting 10k members to a Lua table and back took 3x the
        Redis CPU of the SMEMBERS itself (2.8 against 0.9 ms), and a bootstrap reads every
        worker's snapshot from the one node holding the model's slot. (A MULTI would do,
        but redis-py's cluster transactions cannot run SMEMBERS.)"""
        if self.dump:
            # The snapshot as DUMP's one payload (redis_schema.dumped_keys): hiredis then
            # parses one bulk string, not one object per member (0.5 of 1.7 ms a 10k
            # snapshot on this side, the node's own cost the same).
            try:
                before, payload, lower, after = await self._bracketed(worker, "dump")
            except NoPermissionError as exc:  # an ACL from before DUMP was needed
                if self.dump:  # once, not for each read of the batch it refused
                    self.dump = False
                    log.warning("Redis refuses DUMP to this router; reading snapshots with "
                                "SMEMBERS (slower: add +dump to its ACL, docs/security.md)",
                                extra={"kv": {"error": str(exc)}})
                return await self._read(worker)
            members = dumped_keys(payload)
            if members is None:  # another encoding (small, numeric)
                self._stats.snapshot_smembers += 1
                before, members, lower, after = await self._bracketed(worker, "smembers")
        else:
            before, members, lower, after = await self._bracketed(worker, "smembers")
        if before == after:
            return before, members, lower
        k = self._keys
        flat, members, lower = await self._r.eval_ro(_SNAPSHOT_SCRIPT, 3, k.meta(worker),
                                                  k.snapshot(worker), k.lower(worker))
        return dict(zip(flat[::2], flat[1::2], strict=True)), members, lower

    async def _bracketed(self, worker: str, read: str) -> list:
        """``worker``'s meta, its snapshot read by ``read`` (``dump`` or ``smembers``), its
        lower-tier set and its meta again, in one pipeline."""
        k = self._keys
        pipe = self._r.pipeline(transaction=False)
        pipe.hgetall(k.meta(worker))
        getattr(pipe, read)(k.snapshot(worker))
        pipe.smembers(k.lower(worker))
        pipe.hgetall(k.meta(worker))
        return await pipe.execute()


def listed(reply: list[bytes] | None) -> list[bytes]:
    """An SMEMBERS reply as it came, for ``client.set_response_callback("SMEMBERS", ...)``:
    not redis-py's set of it. A snapshot read by SMEMBERS has 10k members a worker, and
    building and freeing that set cost ~60-90 ns a member (1,000 x 10k: 0.6-0.9 s) for
    nothing: Redis sends each member once, and the index's C load takes any sequence."""
    return reply or []
