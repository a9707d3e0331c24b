"""What the mirror's two tasks, the feed and the heartbeat scan, share (:class:`MirrorParts`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from kvroute.core.redis_conn import RedisClient
from kvroute.core.redis_schema import RedisKeys
from kvroute.router.mirror.cache import MirroredCache
from kvroute.router.mirror.snapshots import SnapshotReader
from kvroute.router.mirror.stats import Rejects
from kvroute.router.registry import WorkerRegistry


@dataclass(frozen=True)
class MirrorParts:
    """One mirror's Redis client and keys, its cache and snapshot reader, the registry it
    feeds, how it refuses records, the lock its tasks change the cache under, how often they
    poll, and whom they tell of a change."""

    client: RedisClient
    keys: RedisKeys
    cache: MirroredCache
    snapshots: SnapshotReader
    registry: WorkerRegistry
    reject: Rejects
    lock: asyncio.Lock
    poll_s: float
    on_change: Callable[[], None]


class MirrorTask:
    """A task of the mirror: the parts it shares, as its own attributes."""

    def __init__(self, parts: MirrorParts) -> None:
        self._r = parts.client
        self._keys = parts.keys
        self._cache = parts.cache
        self._snapshots = parts.snapshots
        self._registry = parts.registry
        self._reject = parts.reject
        self._lock = parts.lock
        self._poll_s = parts.poll_s
        self._on_change = parts.on_change
