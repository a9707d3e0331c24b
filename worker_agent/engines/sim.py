"""``SimEngine``: an inference engine without a model, for tests, benchmarks and the replay sim.

It reproduces what matters to a cache-affinity router: a paged prefix cache with real block
keys (:class:`BlockPool` + :class:`BlockHasher`), continuous batching, and a latency model in
which cached prompt tokens are free and uncached ones cost prefill time.

Scheduling (admission with blocks reserved up front, the prefill budget, chunked prefill and
its cap, one token per running sequence per step, commits, the capped cache hit) is
:class:`~kvroute.core.scheduler.Scheduler`'s, driven by
:class:`~kvroute.worker_agent.engines.batching.BatchingEngine` as for the tiny engine; the replay
simulator's workers run the same scheduler. The defaults admit whole prompts with no budget
(prefill_mode whole). The sim adds the latency model: each step sleeps, in seconds::

    step_s = prefill_s_per_token * (prompt tokens computed in the step)
           + decode_step_base_s + decode_step_per_seq_s * (sequences given a token)
           + host_load_s_per_token * (prompt tokens loaded from the host tier in the step)

The prompt tokens of a step are the uncached prompts admitted in it, or with
``chunked_prefill`` the chunks the shared scheduler sizes under ``prefill_budget``.

times ``time_scale`` (``time_scale = 0`` still yields to the event loop).

Output tokens are deterministic (see :func:`sim_tokens`): the same prompt and seed always give
the same tokens, whatever the cache state, batch or timing.

Token masks (``EngineRequest.mask_fn``, constrained decoding): the sim has no logits, so under
a mask its token ``t = sim_token(base, step, vocab_size)`` becomes the first allowed id at or
after ``t``, cycling past the end of the vocabulary to 0 (:func:`masked_token`) -- still
deterministic for a given prompt, seed and mask sequence. As on the tiny engine, a mask that
allows no token, is too short, or a ``mask_fn`` that raises fails only that request with
:class:`~kvroute.worker_agent.engines.base.EngineError`; ``None`` means no constraint.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import xxhash

from kvroute.core.blocks import tokens_to_bytes
from kvroute.worker_agent.engines.base import EngineError
from kvroute.worker_agent.engines.batching import BatchingEngine, EngineStats, Seq

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_h64 = xxhash.xxh3_64_intdigest
_pack_qq = struct.Struct("<QQ").pack


def sim_token_base(token_ids: Sequence[int], seed: int = 0) -> int:
    """Per-request output seed: ``xxh3_64(le32 tokens of the prompt, seed=seed mod 2**64)``."""
    return _h64(tokens_to_bytes(token_ids), seed=seed & _MASK64)


def sim_token(base: int, t: int, vocab_size: int) -> int:
    """Output token ``t`` (0-based): ``xxh3_64(le64(base) + le64(t)) mod vocab_size``."""
    return _h64(_pack_qq(base, t)) % vocab_size


def sim_tokens(token_ids: Sequence[int], seed: int, n: int, vocab_size: int) -> list[int]:
    """The first ``n`` tokens the sim generates for this prompt and seed (ignoring stops)."""
    base = sim_token_base(token_ids, seed)
    return [sim_token(base, t, vocab_size) for t in range(n)]


def masked_token(t: int, allowed: npt.NDArray[np.bool_]) -> int | None:
    """The first ``i >= t`` with ``allowed[i]``, else the first ``i < t`` (cyclic); None if
    ``allowed`` has no True entry."""
    rest = allowed[t:]
    if rest.any():
        return t + int(rest.argmax())
    head = allowed[:t]
    return int(head.argmax()) if head.any() else None


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Sim engine settings. Defaults: a mid-size GPU serving a ~7B model, roughly."""

    capacity_blocks: int = 4096
    """KV cache size in blocks (4096 * 16 = 65536 tokens)."""
    block_size: int = 16
    model: str = "sim-model"
    vocab_size: int = 50257
    max_batch: int = 64
    """Most sequences running at once."""
    prefill_s_per_token: float = 1e-4
    """Prefill cost per uncached prompt token (~10k tokens/s)."""
    decode_step_base_s: float = 0.01
    """Fixed cost of one decode step (weights read once per step)."""
    decode_step_per_seq_s: float = 2e-4
    """Extra decode-step cost per running sequence."""
    time_scale: float = 1.0
    """Multiplies every sleep; 0 = no sleeping (tests), still yields to the event loop."""
    prefill_budget: int = 0
    """Most prompt tokens computed per step (vLLM's --max-num-batched-tokens; 0: no limit)."""
    chunked_prefill: bool = False
    """Split prefills across steps under ``prefill_budget`` as vLLM V1 does (reported as
    prefill_mode chunked); else whole prompts are admitted (prefill_mode whole)."""
    long_prefill_threshold: int = 0
    """With ``chunked_prefill``: most tokens of one prefill per step (vLLM's
    --long-prefill-token-threshold, reported as max_prefill_chunk; 0: the budget)."""
    host_blocks: int = 0
    """Blocks of a host (CPU) tier behind the cache: evicted blocks go there and a prompt
    loads them back instead of computing them (0: none)."""
    host_load_s_per_token: float = 131072 / 25e9
    """Seconds a token's KV takes to load back from the host tier (reported to routers):
    the cost model's PCIe 4.0 x16 rate."""

    def __post_init__(self) -> None:
        for name in ("capacity_blocks", "block_size", "vocab_size", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_budget", "long_prefill_threshold", "host_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.chunked_prefill and self.prefill_budget <= 0:
            raise ValueError("SimConfig.chunked_prefill needs a prefill_budget > 0 (the token "
                             "budget each step's chunks share)")
        if self.long_prefill_threshold and not self.chunked_prefill:
            raise ValueError("SimConfig.long_prefill_threshold caps the chunks of a chunked "
                             "prefill: it needs chunked_prefill")
        for name in ("prefill_s_per_token", "decode_step_base_s", "decode_step_per_seq_s",
                     "time_scale", "host_load_s_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"SimConfig.{name} must be >= 0, got {getattr(self, name)}")


SimStats = EngineStats
"""The sim's counters (the shared :class:`EngineStats`)."""


@dataclass(eq=False, slots=True)
class _Seq(Seq):
    base: int = 0  # sim_token_base of the prompt and seed


class SimEngine(BatchingEngine):
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol; see module doc.

    Consumers should close ``generate()`` when they stop early (``contextlib.aclosing``);
    cancelling the consuming task does so and frees the request's blocks at once.
    """

    kind = "sim"

    def __init__(self, config: SimConfig | None = None) -> None:
        self.config = config or SimConfig()
        cfg = self.config
        super().__init__(capacity_blocks=cfg.capacity_blocks, block_size=cfg.block_size,
                         model=cfg.model, max_batch=cfg.max_batch,
                         prefill_budget=cfg.prefill_budget, chunked_prefill=cfg.chunked_prefill,
                         long_prefill_threshold=cfg.long_prefill_threshold,
                         host_blocks=cfg.host_blocks,
                         lower_tier_s_per_token=cfg.host_load_s_per_token)

    def _new_seq(self, **fields: Any) -> Seq:
        request = fields["request"]
        return _Seq(**fields, base=sim_token_base(fields["tokens"], request.seed))

    async def _next_tokens(self, seqs: list[Seq], prefill_tokens: int, loaded_tokens: int = 0
                           ) -> Sequence[int | BaseException]:
        cfg = self.config
        step_s = (cfg.prefill_s_per_token * prefill_tokens + cfg.decode_step_base_s
                  + cfg.decode_step_per_seq_s * len(seqs)
                  + cfg.host_load_s_per_token * loaded_tokens)
        await asyncio.sleep(step_s * cfg.time_scale)
        vocab = cfg.vocab_size
        return [0 if seq.done else self._choose(cast(_Seq, seq), vocab) for seq in seqs]

    def _choose(self, seq: _Seq, vocab: int) -> int | BaseException:
        """The sim token, moved to the first allowed id under a mask (module doc)."""
        t = sim_token(seq.base, seq.n_out, vocab)
        req = seq.request
        if req.mask_fn is None:
            return t
        step = seq.n_out
        try:
            allowed = req.mask_fn(step, seq.tokens[seq.prompt_tokens:])
        except Exception as exc:
            log.exception("mask_fn of request %s failed", req.request_id)
            return EngineError(f"request {req.request_id}: mask_fn failed: {exc!r}")
        if allowed is None:
            return t
        mask = np.asarray(allowed, dtype=bool)
        if mask.ndim != 1 or mask.shape[0] < vocab:
            return EngineError(f"request {req.request_id}: mask of shape {mask.shape}, need a "
                               f"1-d mask of >= {vocab} entries")
        tok = masked_token(t, mask[:vocab])
        if tok is None:
            return EngineError(f"request {req.request_id}: token mask at step {step} allows "
                               "no token")
        return tok
