"""The engine interface the agent drives. Engines: ``sim`` (here), later ``tiny`` and ``vllm``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvroute.core.redis_schema import Op


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    token_ids: Sequence[int]
    max_tokens: int
    cache_salt: str = ""
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens of one request. ``cached_tokens`` is the prompt's cache hit (constant per
    request); ``finish_reason`` is "length" or "stop" on the last chunk, else None."""

    token_ids: tuple[int, ...]
    cached_tokens: int
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class EngineLoad:
    running: int
    queued: int
    free_blocks: int
    capacity_blocks: int
    pending_prefill_tokens: int


@dataclass(frozen=True, slots=True)
class CacheEvent:
    """Blocks stored in or evicted from the engine's prefix cache, as kvroute block keys.
    ``Op.CLEAR`` drops everything (keys empty)."""

    op: Op
    keys: tuple[int, ...] = field(default=())


CacheListener = Callable[[CacheEvent], None]


class EngineError(RuntimeError):
    """The engine cannot take or finish a request (reported to the caller as UNAVAILABLE)."""


class Engine(Protocol):
    block_size: int
    model: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]: ...

    def load(self) -> EngineLoad: ...

    def cached_keys(self) -> list[int]:
        """Every block key currently in the prefix cache (for a full snapshot)."""
        ...

    def add_listener(self, listener: CacheListener) -> None:
        """Call ``listener`` synchronously for every cache event, in order."""
        ...
