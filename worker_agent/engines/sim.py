"""``SimEngine``: an inference engine without a model, for tests, benchmarks and the replay sim.

It reproduces what matters to a cache-affinity router: a paged prefix cache with real block
keys (:class:`BlockPool` + :class:`BlockHasher`), continuous batching, and a latency model in
which cached prompt tokens are free and uncached ones cost prefill time.

Scheduling (admission with blocks reserved up front, one token per running sequence per step,
commits, the capped cache hit) is :class:`~kvroute.worker_agent.engines.batching.BatchingEngine`'s,
shared with the tiny engine. The sim adds the latency model: each step sleeps, in seconds::

    step_s = prefill_s_per_token * sum(uncached prompt tokens of requests admitted now)
           + decode_step_base_s + decode_step_per_seq_s * running

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

    def __post_init__(self) -> None:
        for name in ("capacity_blocks", "block_size", "vocab_size", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SimConfig.{name} must be > 0, got {getattr(self, name)}")
        for name in ("prefill_s_per_token", "decode_step_base_s", "decode_step_per_seq_s",
                     "time_scale"):
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
                         model=cfg.model, max_batch=cfg.max_batch)

    def _new_seq(self, **fields: Any) -> Seq:
        request = fields["request"]
        return _Seq(**fields, base=sim_token_base(fields["tokens"], request.seed))

    async def _next_tokens(self, seqs: list[Seq], prefill_tokens: int
                           ) -> Sequence[int | BaseException]:
        cfg = self.config
        step_s = (cfg.prefill_s_per_token * prefill_tokens + cfg.decode_step_base_s
                  + cfg.decode_step_per_seq_s * len(seqs))
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
            allowed = req.mask_fn(step, seq.tokens[seq.prompt_len:])
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
