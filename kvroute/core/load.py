"""The load view a policy sees: one :class:`WorkerLoad` per candidate worker."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """How busy one worker is. Every field is a count; 0 means idle or unknown.

    ``inflight`` and ``pending_prefill_tokens`` combine the router's own accounting (exact,
    immediate) with the agent's heartbeat (cluster-wide, up to one heartbeat old).
    ``cached_blocks`` is the size of the worker's prefix cache as the router's index sees it.
    ``max_running`` is the most sequences the engine runs at once (0: unknown).
    ``max_batched_tokens`` is the most prompt tokens the engine prefills in one iteration
    (vLLM's ``--max-num-batched-tokens``; 0: unknown): requests queued together within it are
    admitted together, and each gets its first token only when all their prefills are done.
    """

    inflight: int = 0
    running: int = 0
    queued: int = 0
    free_blocks: int = 0
    capacity_blocks: int = 0
    pending_prefill_tokens: int = 0
    cached_blocks: int = 0
    max_running: int = 0
    max_batched_tokens: int = 0
    # Derived in __post_init__: a policy reads them for every worker on every decision, and
    # a load changes far less often than it is read (128 workers: ~15 us less per ranking).
    busy: int = field(init=False, repr=False, compare=False)
    used_blocks: int = field(init=False, repr=False, compare=False)
    # What the C build of kvroute's policy reads, one attribute per worker instead of seven
    # (kvroute/core/_native/kvcost.c): pending_prefill_tokens, busy, used_blocks, queued,
    # max_batched_tokens, max_running, occupied.
    packed: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # busy: sequences decoding there (the router's own count when higher);
        # used_blocks: KV blocks held (0 when the capacity is unknown).
        object.__setattr__(self, "busy", max(self.running, self.inflight))
        object.__setattr__(self, "used_blocks", self.capacity_blocks - self.free_blocks
                           if self.capacity_blocks > 0 else 0)
        object.__setattr__(self, "packed", (
            self.pending_prefill_tokens, self.busy, self.used_blocks, self.queued,
            self.max_batched_tokens, self.max_running, self.occupied))

    @property
    def occupied(self) -> int:
        """Sequences running or waiting there (the router's own count when it is higher):
        what ``max_running`` bounds."""
        return max(self.running + self.queued, self.inflight)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (0 when the capacity is unknown)."""
        if self.capacity_blocks <= 0:
            return 0.0
        return self.used_blocks / self.capacity_blocks
