"""``TinyEngine`` (``--engine tiny``): a real, small transformer on a real paged KV cache.

The model is :class:`~kvroute.worker_agent.engines.tiny_model.TinyModel` (randomly initialised,
seeded, numpy, float32); its K/V live in a :class:`PagedKV` indexed by the physical block ids
of the engine's :class:`BlockPool`. Scheduling is the shared
:class:`~kvroute.worker_agent.engines.batching.BatchingEngine` (the sim engine's; whole
prompts, no budget, as its forward computes each admitted prompt at once): so the
tiny engine keys, shares, evicts and reports blocks exactly as the sim does, and emits the
same cache events for the same requests. What the blocks hold is real here: a request whose
prefix is cached pins those blocks and prefills only ``[cached_tokens, prompt_len)``,
attending over the cached K/V. Because the model is exact by construction (see
``tiny_model``), its logits equal an uncached run's bit for bit.

Each step runs one forward pass (prefill of newly admitted requests + one decode token for
the others) in the engine's one worker thread, so the event loop (gRPC, heartbeats) stays
responsive and forwards never overlap (``stop`` waits for the one in flight). The token masks
of the step are computed on the event loop *while* that forward runs: a mask depends only on
the tokens generated so far, never on the logits being computed, and both numpy and
llguidance release the GIL, so mask time hides behind the forward (as vLLM and SGLang overlap
grammar work with the GPU step). ``mask_waits``, when set, gets per step how long the masks
kept the step waiting after its forward had finished (0 when fully hidden). Token choice
(masking, sampling) then runs on the event loop. Per request, per output token::

    logits  = the model's logits for the last token, float32 [vocab]
    allowed = request.mask_fn(step, generated) if mask_fn else None   (True = allowed)
    logits  = where(allowed, logits, -inf)
    token   = argmax(logits)                                       temperature == 0 (default)
            = inverse-CDF draw of softmax(logits / temperature)    otherwise, with one uniform
              over its top_k, then its top_p, most likely tokens   u ~ rng per step

with ``rng = numpy.random.default_rng(seed)``, ``seed = request.seed`` or, when 0, a hash of
the prompt: the same request always gives the same tokens, whatever the batch or cache state.
There is no implicit end-of-sequence stop: requests stop on their ``stop_token_ids`` (e.g.
:attr:`TinyEngine.eos_token_id`) or ``max_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import numpy.typing as npt
import xxhash

from kvroute.core import tokenizer as tokenizers
from kvroute.core.blocks import tokens_to_bytes
from kvroute.core.config import AgentConfig
from kvroute.worker_agent.engines.base import EngineError, EngineRequest, RequestRefusedError
from kvroute.worker_agent.engines.batching import BatchingEngine, Seq
from kvroute.worker_agent.engines.tiny_model import (
    ForwardItem,
    TinyModel,
    TinyModelConfig,
)
from kvroute.worker_agent.vocabulary import AgentVocabulary, load_vocabulary

log = logging.getLogger(__name__)

LogitsObserver = Callable[[str, int, npt.NDArray[np.float32]], None]
"""``observer(request_id, step, logits)``: sees each request's raw logits (before the mask)
for output token ``step``, on the event loop; must not modify them."""


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Tiny engine settings: the cache and batching (as the sim's) and the model's shape."""

    capacity_blocks: int = 4096
    """KV cache size in blocks; K/V memory = capacity * layers * 2 * block_size * dim * 4 B."""
    block_size: int = 16
    model: str = "tiny"
    max_batch: int = 64
    vocab_size: int = tokenizers.ByteTokenizer.vocab_size
    eos_token_id: int | None = tokenizers.ByteTokenizer.eos_token_id
    dim: int = 64
    layers: int = 2
    heads: int = 4
    seed: int = 0
    """Weight initialisation seed: equal seeds and shapes give identical models."""
    threaded: bool = True
    """Run forward passes in a worker thread (False: on the event loop, for profiling)."""

    def __post_init__(self) -> None:
        for name in ("capacity_blocks", "block_size", "max_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TinyConfig.{name} must be > 0, got {getattr(self, name)}")
        self.model_config()  # validates the shape

    def model_config(self) -> TinyModelConfig:
        return TinyModelConfig(vocab_size=self.vocab_size, dim=self.dim, layers=self.layers,
                               heads=self.heads, seed=self.seed)


@dataclass(eq=False, slots=True)
class _TinySeq(Seq):
    rng: np.random.Generator | None = None  # temperature sampling only


def sample_token(logits: npt.NDArray[np.float32], temperature: float, u: float,
                 top_p: float = 1.0, top_k: int = 0) -> int:
    """Inverse-CDF draw from ``softmax(logits / temperature)`` with ``u`` in ``[0, 1)``, over
    the ``top_k`` most likely tokens (0: all), then the most likely of those whose
    probabilities reach ``top_p`` (as vLLM filters: top-k first, then top-p over what is left,
    renormalized; the most likely token always stays).

    ``-inf`` logits (masked) have probability 0 and are never drawn; at least one must be finite.
    """
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    if 0 < top_k < np.count_nonzero(p):
        p[p < np.partition(p, -top_k)[-top_k]] = 0.0
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass = np.cumsum(p[order]) / p.sum()
        keep = int(np.searchsorted(mass, top_p, side="left")) + 1  # the first to reach top_p
        p[order[keep:]] = 0.0
    cdf = np.cumsum(p)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    # u * total can round up to total: fall back to the last token with p > 0.
    return idx if idx < len(p) and p[idx] > 0 else int(np.flatnonzero(p)[-1])


class TinyEngine(BatchingEngine):
    """Implements the :class:`~kvroute.worker_agent.engines.base.Engine` protocol; see module doc.

    ``transformer`` is the model, ``kv`` its paged cache (``kv.data[block]`` is pool block
    ``block``). Set ``logits_observer`` to see every step's logits (tests, controllers).
    """

    kind = "tiny"

    def __init__(self, config: TinyConfig | None = None) -> None:
        self.config = cfg = config or TinyConfig()
        super().__init__(capacity_blocks=cfg.capacity_blocks, block_size=cfg.block_size,
                         model=cfg.model, max_batch=cfg.max_batch)
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.transformer = TinyModel(cfg.model_config(),
                                     max_positions=cfg.capacity_blocks * cfg.block_size)
        self.kv = self.transformer.new_cache(cfg.capacity_blocks, cfg.block_size)
        self.logits_observer: LogitsObserver | None = None
        self.mask_waits: list[float] | None = None
        """When set (benchmarks): per step with masks, seconds the masks finished after the
        forward did (see module doc)."""
        self._executor: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        if self.config.threaded and self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"tiny:{self.model}")
        await super().start()

    async def stop(self) -> None:
        await super().stop()
        executor, self._executor = self._executor, None
        if executor is not None:
            # A cancelled step's forward may still be writing K/V: let it finish.
            await asyncio.to_thread(executor.shutdown)

    # -- BatchingEngine hooks -------------------------------------------------------------

    def _validate(self, request: EngineRequest) -> None:
        rid = request.request_id
        ids = request.token_ids
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise RequestRefusedError(
                f"request {rid}: token id out of range [0, {self.vocab_size})")
        t = request.temperature
        if not math.isfinite(t) or t < 0:
            raise RequestRefusedError(f"request {rid}: temperature must be >= 0, got {t}")

    def _new_seq(self, **fields: Any) -> Seq:
        request: EngineRequest = fields["request"]
        rng = None
        if request.temperature > 0:
            seed = request.seed or xxhash.xxh3_64_intdigest(tokens_to_bytes(fields["tokens"]))
            rng = np.random.default_rng(seed)
        return _TinySeq(**fields, rng=rng)

    async def _next_tokens(self, seqs: list[Seq], prefill_tokens: int, loaded_tokens: int = 0
                           ) -> Sequence[int | BaseException]:
        # Snapshot inputs on the loop: the thread must not read objects the loop may change.
        items = [ForwardItem(seq.tokens[seq.kv_tokens:], seq.kv_tokens, list(seq.blocks))
                 for seq in seqs]
        forward = self.transformer.forward
        if self._executor is not None:
            kv, finished = self.kv, [0.0]

            def run() -> list[npt.NDArray[np.float32]]:
                out = forward(kv, items)
                finished[0] = time.perf_counter()
                return out

            fut = asyncio.get_running_loop().run_in_executor(self._executor, run)
            masks = self._masks(seqs)  # while the forward runs
            masked_at = time.perf_counter()
            logits = await fut
            if masks and self.mask_waits is not None:
                self.mask_waits.append(max(0.0, masked_at - finished[0]))
        else:
            logits = forward(self.kv, items)
            masks = self._masks(seqs)
            await asyncio.sleep(0)
        return [0 if seq.done else self._choose(cast(_TinySeq, seq), lg, masks.get(seq))
                for seq, lg in zip(seqs, logits, strict=True)]

    def _masks(self, seqs: list[Seq]) -> dict[Seq, npt.NDArray[np.bool_] | BaseException]:
        """This step's masks of the sequences that have a ``mask_fn`` (module doc)."""
        out: dict[Seq, npt.NDArray[np.bool_] | BaseException] = {}
        for seq in seqs:
            req = seq.request
            if req.mask_fn is None or seq.done:
                continue
            try:
                allowed = req.mask_fn(seq.n_out, seq.tokens[seq.prompt_tokens:])
            except Exception as exc:
                log.exception("mask_fn of request %s failed", req.request_id)
                out[seq] = EngineError(f"request {req.request_id}: mask_fn failed: {exc!r}")
                continue
            if allowed is not None:
                out[seq] = np.asarray(allowed, dtype=bool)
        return out

    # -- token choice ----------------------------------------------------------------------

    def _choose(self, seq: _TinySeq, logits: npt.NDArray[np.float32],
                mask: npt.NDArray[np.bool_] | BaseException | None) -> int | BaseException:
        """Mask, then argmax or sample (module doc). A failing or empty mask fails only this
        request, with :class:`EngineError`."""
        req, step = seq.request, seq.n_out
        if self.logits_observer is not None:
            self.logits_observer(req.request_id, step, logits)
        if isinstance(mask, BaseException):
            return mask
        if mask is not None:
            if mask.ndim != 1 or mask.shape[0] < self.vocab_size:
                return EngineError(f"request {req.request_id}: mask of shape {mask.shape},"
                                   f" need a 1-d mask of >= {self.vocab_size} entries")
            mask = mask[: self.vocab_size]
            if not mask.any():
                return EngineError(f"request {req.request_id}: token mask at step {step} "
                                   "allows no token")
            logits = np.where(mask, logits, np.float32(-np.inf))
        if seq.rng is None:
            return int(np.argmax(logits))
        return sample_token(logits, req.temperature, float(seq.rng.random()), req.top_p,
                            req.top_k)


def from_agent_config(cfg: AgentConfig, vocab: AgentVocabulary | None = None) -> TinyEngine:
    """The engine ``kvroute agent --engine tiny`` runs: the vocabulary and EOS are the
    agent's tokenizer's (``--model-source``'s, else ``--tokenizer``: byte 258, gpt2 50257),
    heads of 16 dims (``--tiny-dim 64``: 4 heads)."""
    vocab = vocab or load_vocabulary(cfg)
    if vocab.chat is not None:
        eos: int | None = vocab.chat.eos_token_id if vocab.chat.eos_token_id >= 0 else None
    else:
        eos = (tokenizers.ByteTokenizer.eos_token_id if vocab.name == "byte"
               else tokenizers.GPT2Tokenizer.eos_token_id)
    try:
        config = TinyConfig(
            capacity_blocks=cfg.engine.capacity_blocks, block_size=cfg.model.block_size,
            model=cfg.model.name, max_batch=cfg.engine.max_batch, vocab_size=vocab.size,
            eos_token_id=eos, dim=cfg.tiny.dim, layers=cfg.tiny.layers,
            heads=max(1, cfg.tiny.dim // 16), seed=cfg.tiny.seed,
        )
    except ValueError as exc:
        raise SystemExit(f"tiny engine: {exc}") from None
    return TinyEngine(config)
