"""The engine interface the agent drives. Engines: ``sim``, ``tiny`` and ``vllm``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvroute.core.cache_events import CacheListener
from kvroute.core.load import EngineLoad

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

TokenMaskFn = Callable[[int, Sequence[int]], "npt.NDArray[np.bool_] | None"]
"""``mask_fn(step, generated) -> allowed | None``: called once per output token, before it is
chosen, with ``step == len(generated)`` and ``generated`` the request's output ids so far.
``allowed`` is a boolean array of at least the engine's vocabulary size (True = may be chosen;
entries past the vocabulary are ignored); None means no constraint at this step."""


@dataclass(frozen=True, slots=True)
class GrammarState:
    """A constraint continued from a state: llguidance's ``grammar`` after the region's
    tokens so far (``prefix``, at the end of the prompt). Only an engine that continues
    grammars takes it (vLLM with kvroute's mask plugin)."""

    grammar: str
    prefix: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    token_ids: Sequence[int]
    max_tokens: int
    cache_salt: str = ""
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    """0 = greedy; > 0 samples from softmax(logits / temperature), seeded by ``seed``."""
    top_p: float = 1.0
    """Sampling draws from the most likely tokens whose probabilities reach ``top_p`` (1: all)."""
    top_k: int = 0
    """Sampling draws from the ``top_k`` most likely tokens (0: all)."""
    mask_fn: TokenMaskFn | None = None
    """Per-step token mask (constrained decoding): tiny applies it to its logits, sim picks
    the first allowed id at or after its deterministic token; vllm refuses it (it takes
    grammars per request instead)."""
    logprobs: bool = False
    """Ask the engine for each generated token's log-probability (``TokenChunk.logprobs``);
    engines that hand out logits another way (tiny: ``logits_observer``) ignore it."""


@dataclass(frozen=True, slots=True)
class TokenChunk:
    """New tokens of one request. ``cached_tokens`` is the prompt's cache hit (constant per
    request); ``finish_reason`` is "length" or "stop" on the last chunk, else None.

    An engine that learns the exact hit only at the end (vllm: the usage chunk) carries its
    prediction on the earlier chunks and the engine's own figure on the last one."""

    token_ids: tuple[int, ...]
    cached_tokens: int
    finish_reason: str | None = None
    logprobs: tuple[float, ...] | None = None
    """One per token id, when the request asked for them and the engine gives them."""


class EngineError(RuntimeError):
    """The engine cannot take or finish a request (reported to the caller as UNAVAILABLE:
    routers then try another worker and skip this one for a while)."""


class RequestRefusedError(EngineError):
    """The engine refuses a request for what the request itself asks (a prompt larger than
    its whole KV cache, an id past its vocabulary): the caller's doing, not a failure of the
    worker, so reported as ``code`` (INVALID_ARGUMENT, RESOURCE_EXHAUSTED), which routers pass
    back without marking the worker down or trying another."""

    def __init__(self, message: str, code: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.code = code
        """A ``grpc.StatusCode`` name (engines do not import grpc)."""


class Engine(Protocol):
    """Optional: ``metric_families() -> Iterable[prometheus Metric]``, which the agent's
    /metrics exports alongside its own (the vllm adapter's frame and replay counters), and
    ``lower_keys() -> list[int]``, the keys of ``cached_keys`` held only in a lower tier
    (an engine with tiers: core/cache_events.py)."""

    block_size: int
    model: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[TokenChunk]: ...

    def load(self) -> EngineLoad: ...

    def healthy(self) -> bool:
        """Whether the engine can serve now. While it cannot, the agent withholds its
        heartbeat (routers forget the worker) and answers health checks NOT_SERVING."""
        ...

    def cached_keys(self) -> list[int]:
        """Every block key currently in the prefix cache (for a full snapshot)."""
        ...

    def add_listener(self, listener: CacheListener) -> None:
        """Call ``listener`` synchronously for every cache event, in order."""
        ...
