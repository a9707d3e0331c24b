"""What an engine's prefix cache reports: blocks stored, moved to a lower tier, evicted, or all
dropped, as kvroute block keys. The agent publishes these to Redis; the replay simulator feeds
them to its router after the propagation delay.

Tiers: an engine may keep blocks below its GPU cache (vLLM's CPU offloading, SGLang's HiCache
host memory). A key's *tier* is the best one holding it: ``Op.STORE`` says the keys are in GPU
memory now (new, or brought back up), ``Op.LOWER`` that they are held only in a lower tier
now (new there, or evicted from the GPU while a lower tier keeps a copy), ``Op.EVICT`` that no
tier holds them. An engine without tiers never emits ``Op.LOWER``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.core.redis_schema import Op


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """Blocks stored in (``Op.STORE``: GPU; ``Op.LOWER``: a lower tier only) or evicted
    from the engine's prefix cache, as kvroute block keys. ``Op.CLEAR`` drops everything
    (keys empty)."""

    op: Op
    keys: tuple[int, ...] = field(default=())


CacheListener = Callable[[CacheEvent], None]
