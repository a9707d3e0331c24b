"""A worker's load: the one record from engine to router, and the view a policy sees.

:class:`EngineLoad` is what a worker reports: its engine's state and limits (``Engine.load``)
and the traffic its agent saw lately. The agent sends it in its heartbeat (its fields flat in
the record's JSON: ``core/redis_schema.Heartbeat``) and answers ``GetLoad`` with it
(:meth:`EngineLoad.to_proto`). A router merges it with its own exact counts into one
:class:`WorkerLoad` per candidate worker (``router/registry.seen_load``), what a policy ranks.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum

from kvroute.v1 import common_pb2

# The window over which a worker's arrival rate is measured: long enough to span a chat
# session's think time (its next turn comes back to the same cache), short enough to follow
# a shift of traffic within a minute.
ARRIVAL_TAU_S = 30.0
# The shortest time a rate is read over after its counting starts: one request 0.1 s in
# reads 1/s, not 10/s.
ARRIVAL_MIN_WINDOW_S = 1.0


def prefill_context(uncached: int, cached: int) -> int:
    """The context the ``uncached`` new tokens of a prefill attend to, in token pairs:
    ``n * (c + n / 2)`` after ``c`` cached tokens (each new token sees the cached ones and,
    on average, half of the new ones). A prefill's work is its tokens plus ``attn`` times
    this (``kvroute.core.policies.kvroute.own_prefill``): a 190k-token prompt takes 4x its
    tokens' linear time, which a count of tokens alone does not show."""
    return uncached * cached + uncached * uncached // 2


class PrefillMode(StrEnum):
    """How an engine admits a prompt longer than the room left in an iteration's prefill
    budget. An agent reports its engine's in its heartbeat; the replay simulator's workers
    admit prompts so."""

    code: int
    """Its number in the gRPC API's ``kvroute.v1.PrefillMode`` enum."""

    def __new__(cls, value: str, code: int) -> PrefillMode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.code = code
        return member

    UNKNOWN = "", 0
    """Not reported (an older agent)."""
    WHOLE = "whole", 1
    """Whole or not at all: it waits for the next iteration (the sim and tiny engines, and
    vLLM with ``--no-enable-chunked-prefill``)."""
    CHUNKED = "chunked", 2
    """Its first ``budget - pending`` tokens join the iteration (vLLM V1's default)."""

    @classmethod
    def of(cls, chunked: bool) -> PrefillMode:
        """The mode of an engine that does or does not chunk long prefills."""
        return cls.CHUNKED if chunked else cls.WHOLE

    @classmethod
    def parse(cls, value: object, what: str = "prefill_mode") -> PrefillMode:
        """``value`` (a member or its string) as a member; ValueError names ``what``."""
        if type(value) is cls:
            return value
        if isinstance(value, str):
            for mode in cls:
                if value == mode.value:
                    return mode
        raise ValueError(f"{what} must be one of {[m.value for m in cls]}, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What a worker reports of its load. Every field but ``prefill_mode`` is a count or a
    rate; 0 means idle or unknown. :class:`WorkerLoad` documents each field."""

    running: int = 0
    queued: int = 0
    free_blocks: int = 0
    capacity_blocks: int = 0
    pending_prefill_tokens: int = 0
    max_running: int = 0
    max_batched_tokens: int = 0
    prefill_mode: PrefillMode = PrefillMode.UNKNOWN
    max_prefill_chunk: int = 0
    arrival_rate: float = 0.0
    """Requests per second the agent received lately, from every router (0 from an engine:
    its agent measures it)."""
    prefill_rate: float = 0.0
    """Uncached prompt tokens per second its engine was given lately (as ``arrival_rate``)."""
    lower_tier_s_per_token: float = 0.0
    """Seconds its engine takes to bring one token's KV from its lower tier (CPU memory)
    into GPU memory (0: no tier, or not reported)."""

    def to_proto(self, worker_id: str) -> common_pb2.WorkerLoad:
        """The gRPC API's ``kvroute.v1.WorkerLoad`` (it carries no rates)."""
        return common_pb2.WorkerLoad(
            worker_id=worker_id, running=self.running, queued=self.queued,
            free_blocks=self.free_blocks, capacity_blocks=self.capacity_blocks,
            pending_prefill_tokens=self.pending_prefill_tokens, max_running=self.max_running,
            max_batched_tokens=self.max_batched_tokens, prefill_mode=self.prefill_mode.code,
            max_prefill_chunk=self.max_prefill_chunk)


ENGINE_LOAD_FIELDS = tuple(EngineLoad.__dataclass_fields__)
"""The names of :class:`EngineLoad`'s fields, in order (a heartbeat's load fields)."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """How busy one worker is. Every field but ``prefill_mode`` is a count; 0 means idle or
    unknown.

    ``inflight`` and ``pending_prefill_tokens`` combine the router's own accounting (exact,
    immediate) with the agent's heartbeat (cluster-wide, up to one heartbeat old).
    ``cached_blocks`` is the size of the worker's prefix cache as the router's index sees it.
    ``max_running`` is the most sequences the engine runs at once (0: unknown).
    ``max_batched_tokens`` is the most prompt tokens the engine prefills in one iteration
    (vLLM's ``--max-num-batched-tokens``; 0: unknown): requests queued together within it are
    admitted together, and each gets its first token only when all their prefills are done.
    ``arrival_rate`` is requests per second sent to the worker lately (:class:`ArrivalRate`;
    not a count), and ``prefill_rate`` the prompt tokens per second sent to it lately that it
    had to prefill (uncached; the larger of the router's own count and the agent's, which
    counts every router's traffic): what comes back to it (a session's next turn, a
    document's next read), and, once its cache is full, how fast it turns over.
    ``pending_prefill_context`` is the context those pending tokens attend to
    (:func:`prefill_context` summed over the pending prefills; the router's own count, as
    engines report tokens only; 0: unknown), so a policy can weigh the pending prefill by
    its attention as well as its length. ``prefill_mode`` is how its engine admits a prompt
    longer than the room left in its prefill budget (:class:`PrefillMode`).
    ``max_prefill_chunk`` is the most tokens of one prefill a chunking engine computes per
    iteration (vLLM's ``--long-prefill-token-threshold``; 0: none but the budget): below
    it, a request queued behind a long prefill joins that prefill's iterations instead of
    waiting it out.
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
    arrival_rate: float = 0.0
    pending_prefill_context: int = 0
    prefill_rate: float = 0.0
    prefill_mode: PrefillMode = PrefillMode.UNKNOWN
    max_prefill_chunk: int = 0
    lower_tier_s_per_token: float = 0.0
    # Derived in __post_init__: a policy reads them for every worker on every decision, and
    # a load changes far less often than it is read (128 workers: ~15 us less per ranking).
    busy: int = field(init=False, repr=False, compare=False)
    used_blocks: int = field(init=False, repr=False, compare=False)
    cache_fill: float = field(init=False, repr=False, compare=False)
    waiting: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # A plain string from a caller becomes the enum; anything else is refused here.
        if type(self.prefill_mode) is not PrefillMode:
            object.__setattr__(self, "prefill_mode", PrefillMode.parse(self.prefill_mode))
        # busy: sequences decoding there (the router's own count when higher);
        # used_blocks: KV blocks held (0 when the capacity is unknown).
        object.__setattr__(self, "busy", max(self.running, self.inflight))
        object.__setattr__(self, "used_blocks", self.capacity_blocks - self.free_blocks
                           if self.capacity_blocks > 0 else 0)
        # cache_fill: the fraction of its blocks the index says hold cached prefixes (0 when
        # the capacity is unknown; an index a little ahead of an eviction reads 1).
        object.__setattr__(self, "cache_fill", min(1.0, self.cached_blocks / self.capacity_blocks)
                           if self.capacity_blocks > 0 else 0.0)
        # waiting: requests sent there and not running yet: the engine's queue, or the
        # router's own count when it is higher (a request in transit, a heartbeat behind).
        object.__setattr__(self, "waiting", self.occupied - self.running)

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


@dataclass(slots=True)
class ArrivalRate:
    """Requests per second sent to one worker lately: each arrival adds ``1 / tau_s`` to a
    rate that decays as ``exp(-elapsed / tau_s)``, so a steady stream of ``r`` requests per
    second reads ``r`` and a worker nobody sends to fades to 0 within a few ``tau_s``.

    Counted from ``start`` (when counting began), that sum reads only
    ``r * (1 - exp(-t / tau_s))`` after ``t`` seconds of the stream, so :meth:`at` divides
    by that factor (``t`` at least ``ARRIVAL_MIN_WINDOW_S``): without it a router that has
    just started reads every rate 30 times too low after 1 s and 3.5 times after 10 s, and
    the policy terms that weigh arrivals sleep through a cold start. ``start`` -inf (the
    default) is a count with no known beginning: no correction.

    The router keeps one per worker for its own traffic, the agent one for all of its
    worker's (its heartbeat's ``arrival_rate``), the replay simulator one per simulated
    worker. Invariant: ``_rate`` is the uncorrected sum at time ``_t``, the latest
    arrival's; reading it (:meth:`at`) changes nothing. Times are seconds on any clock that
    never goes back.
    """

    tau_s: float = ARRIVAL_TAU_S
    start: float = -math.inf
    _rate: float = 0.0
    _t: float = -math.inf

    def __post_init__(self) -> None:
        if not self.tau_s > 0:
            raise ValueError(f"tau_s must be > 0, got {self.tau_s}")
        if math.isnan(self.start) or self.start == math.inf:
            raise ValueError(f"start must be a time or -inf, got {self.start}")

    def add(self, now: float, n: int = 1) -> None:
        """``n`` requests arrived at ``now``."""
        if now > self._t:
            self._rate = self._sum(now)
            self._t = now
        self._rate += n / self.tau_s

    def _sum(self, now: float) -> float:
        """The decayed sum at ``now`` (not before the latest arrival), uncorrected."""
        if now <= self._t or self._rate == 0.0:
            return self._rate
        return self._rate * math.exp((self._t - now) / self.tau_s)

    def at(self, now: float) -> float:
        """The rate at ``now`` (not before the latest arrival), corrected for a recent
        start."""
        rate = self._sum(now)
        counted = max(max(now, self._t) - self.start, ARRIVAL_MIN_WINDOW_S)
        return rate / -math.expm1(-counted / self.tau_s) if rate else rate


@dataclass(slots=True)
class SentTraffic:
    """What a router sent one worker lately, as the load view reads it: requests per second
    (``arrivals``: ``WorkerLoad.arrival_rate``) and the uncached prompt tokens per second
    they brought (``prefills``: ``WorkerLoad.prefill_rate``), both counted from ``start``
    (see :class:`ArrivalRate`). The router keeps one per worker (``registry.begin``) and the
    replay simulator one per simulated worker, so both count alike."""

    start: float = -math.inf
    arrivals: ArrivalRate = field(init=False)
    prefills: ArrivalRate = field(init=False)

    def __post_init__(self) -> None:
        self.arrivals = ArrivalRate(start=self.start)
        self.prefills = ArrivalRate(start=self.start)

    def add(self, now: float, uncached: int) -> None:
        """A request (or a background copy) with ``uncached`` tokens to prefill was sent at
        ``now``."""
        self.arrivals.add(now)
        self.prefills.add(now, uncached)


class PrefixDemand:
    """Requests per second lately per cached prefix: how hot the prefix a request would hit
    is, keyed by the block key its longest cached prefix ends at (``RouteQuery.prefix_rate``).

    A shared document or few-shot block read by many requests keeps one key; a session's
    history ends at a new block each turn, so a session reads ~0. One :class:`ArrivalRate`
    per key, the ``max_keys`` most recently used kept (the oldest forgotten: a prefix nobody
    asked for lately has no demand to remember). The router's decider and the replay
    simulator keep one each; ``now`` is their clock, ``start`` when they began counting
    (every key's rate is corrected for it, as :class:`ArrivalRate` says: a prefix first seen
    long after has had no requests before, which is no bias to correct).

    Invariant: ``_rates`` holds at most ``max_keys`` entries, least recently observed first.
    """

    def __init__(self, tau_s: float = ARRIVAL_TAU_S, max_keys: int = 1 << 16,
                 start: float = -math.inf) -> None:
        if not tau_s > 0 or max_keys < 1:
            raise ValueError(f"tau_s must be > 0 and max_keys >= 1, got {tau_s}, {max_keys}")
        self.tau_s = tau_s
        self.max_keys = max_keys
        self.start = start  # when counting began: every key's, however late it first comes
        self._rates: OrderedDict[int, ArrivalRate] = OrderedDict()

    def observe(self, key: int, now: float) -> float:
        """The rate of the requests seen for ``key`` before this one, at ``now``; then
        counts this one."""
        rates = self._rates
        r = rates.get(key)
        if r is None:
            r = rates[key] = ArrivalRate(self.tau_s, self.start)
            if len(rates) > self.max_keys:
                rates.popitem(last=False)
        else:
            rates.move_to_end(key)
        before = r.at(now)
        r.add(now)
        return before

    def __len__(self) -> int:
        return len(self._rates)

