"""One engine request of a gen step, taken into its branch: the request's seed, the gen's
progress (:class:`GenState`), the engine's cache figures and its tokens (kept up to a stop
id, each with its log-probability) as the chunks come."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import xxhash

from kvroute.worker_agent.controller.branch import Branch
from kvroute.worker_agent.controller.constrained import Masker
from kvroute.worker_agent.controller.logprobs import token_logprob
from kvroute.worker_agent.engines.base import TokenChunk

ROOT_BRANCH = "0"


def engine_seed(seed: int, branch: str, n: int) -> int:
    """The sampling seed of ``branch``'s ``n``-th engine request. The root's first request
    takes the caller's seed as it is (when set), so a program of one ``gen`` (a request with
    stop strings) samples the text the plain request would; every other seed is derived from
    (seed, branch, n), independent of the request id, so reruns repeat and a fork's siblings
    sample differently."""
    if seed and branch == ROOT_BRANCH and n == 0:
        return seed
    return xxhash.xxh3_64_intdigest(f"{seed}/{branch}/{n}".encode()) & ((1 << 63) - 1) or 1


@dataclass(slots=True)
class GenState:
    """One gen step's progress on a branch."""

    start: int
    remaining: int
    stops: tuple[bytes, ...]
    reason: str | None = None
    split: bool = False
    """The current engine request ends for a grammar fast-forward."""
    text: bytearray = field(default_factory=bytearray)
    ends: list[int] = field(default_factory=list)
    stop_text: bytes | None = None
    stop_hit: bytes = b""
    """The stop string that ended it (the first in the text; of two there, the first given)."""


def count_cached(b: Branch, cached: int, prompt_len: int, *, first: bool,
                 first_request: bool) -> None:
    """A chunk's ``cached`` prompt tokens (of ``prompt_len``) into ``b``'s figures: at a
    request's ``first`` chunk its prefill is done (siblings may start); a later figure that
    differs is the engine's exact hit, known only then (vllm: its usage), and corrects them
    (``first_request``: the branch's first request, whose hit is ``first_cached``)."""
    if first:
        b.prefilled()
        b.engine_requests += 1
        b.prefill_tokens += prompt_len - cached
        b.last_cached = cached
        if b.first_cached is None:
            b.first_cached = cached
    elif cached != b.last_cached:
        b.prefill_tokens += b.last_cached - cached
        b.last_cached = cached
        if first_request:
            b.first_cached = cached


@dataclass(slots=True)
class TakenTokens:
    """One engine request's tokens as they are appended to its branch."""

    stop_ids: frozenset[int]
    masker: Masker | None
    step: int = 0  # output tokens seen (the logits' step)
    chunks: int = 0

    def take(self, b: Branch, s: GenState, chunk: TokenChunk,
             logits: dict[int, np.ndarray]) -> list[int]:
        """Append ``chunk``'s tokens to ``b`` up to a stop id (which ends the gen: ``eos``, or
        ``grammar`` in a constrained region) and return those kept; ``s.split`` when the
        mask's grammar fast-forward begins at one of them."""
        self.chunks += 1
        kept: list[int] = []
        lps = chunk.logprobs
        for j, tok in enumerate(chunk.token_ids):
            lg = logits.pop(self.step, None)  # the tap's, when it has them
            at, self.step = self.step, self.step + 1
            if tok in self.stop_ids:
                s.reason = "grammar" if b.matcher is not None else "eos"
                break
            b.append(tok, lps[j] if lps is not None and lg is None else token_logprob(lg, tok))
            b.generated += 1
            s.remaining -= 1
            kept.append(tok)
            if self.masker is not None and self.masker.split_at == at:
                s.split = True
        return kept
