"""What an engine's prefix cache reports: blocks stored, evicted, or all dropped, as kvroute
block keys. The agent publishes these to Redis; the replay simulator feeds them to its router
after the propagation delay."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvroute.core.redis_schema import Op


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """Blocks stored in or evicted from the engine's prefix cache, as kvroute block keys.
    ``Op.CLEAR`` drops everything (keys empty)."""

    op: Op
    keys: tuple[int, ...] = field(default=())


CacheListener = Callable[[CacheEvent], None]
