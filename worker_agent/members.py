"""Keeping the model's workers set to live workers: the agents' own housekeeping.

Each agent adds itself to the workers set with every write (worker_agent/publisher.py) and
its snapshot and meta expire on their own :data:`~kvroute.core.redis_schema.STATE_TTL_S`
after its last write. A member with neither a heartbeat nor a meta left has then been silent
that long: :func:`prune_dead_members` removes it, with any member that is no worker name.
Routers only read (docs/security.md).

Invariant: a live worker is never lost from the set for longer than one heartbeat: one
that beats re-adds itself in the same transaction as its heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.core.redis_conn import RedisClient
from kvroute.core.redis_schema import RedisKeys, worker_members

PRUNE_EVERY_S = 10.0
"""About how often the agents of a model, together, scan its workers set: each waits this
times the number of members (jittered) between its scans, so the cost to Redis stays one
scan per this period whatever the cluster's size."""
_MGET_CHUNK = 500  # heartbeats one MGET reads


@dataclass(frozen=True)
class Pruned:
    members: int  # in the set when read
    removed: tuple[str, ...]  # worker names (or reprs of invalid members) removed


async def prune_dead_members(client: RedisClient, keys: RedisKeys) -> Pruned:
    """Remove from ``keys.workers`` every member with neither a heartbeat nor a snapshot
    meta, and every member that is no worker name."""
    raw = await client.smembers(keys.workers)
    names, bad = worker_members(raw)
    silent: list[str] = []
    for i in range(0, len(names), _MGET_CHUNK):
        part = names[i:i + _MGET_CHUNK]
        beats = await client.mget([keys.heartbeat(w) for w in part])
        silent += [w for w, hb in zip(part, beats, strict=True) if hb is None]
    dead: list[str] = []
    if silent:
        pipe = client.pipeline(transaction=False)
        for w in silent:
            pipe.exists(keys.meta(w))
        dead = [w for w, n in zip(silent, await pipe.execute(), strict=True) if not n]
    if dead or bad:
        await client.srem(keys.workers, *dead, *bad)
    return Pruned(len(raw), (*dead, *(repr(m)[:80] for m in bad)))
