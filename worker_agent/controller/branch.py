"""One branch of a running program: its token sequence and everything derived from it.

Invariants:
- ``tokens[:prompt_len]`` is the request's prompt and is never dropped; ``lps`` has one
  entry per token after it (0.0 for fast-forwarded tokens), so ``logprob`` is the sum of the
  model's log-probabilities of the generated tokens still in the branch.
- While a constraint is open (``matcher`` set), the matcher has consumed exactly
  ``tokens[region_start:]`` once a gen step has reconciled it (``sync_matcher``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class CaptureValue:
    text: str
    token_ids: tuple[int, ...]
    complete: bool


@dataclass(eq=False, slots=True)
class Branch:
    id: str
    tokens: list[int]
    prompt_len: int
    lps: list[float] = field(default_factory=list)
    variables: dict[str, CaptureValue] = field(default_factory=dict)
    matcher: Any = None  # llguidance.LLMatcher of the open constraint, or None
    region_start: int = 0
    region_grammar: str = ""
    """The open region's constraint (its ``ConstraintSpec.grammar``)."""
    m_consumed: int = 0
    """Tokens of the open region the matcher has consumed (may run ahead of ``tokens``
    while an engine request is in flight; reconciled after it)."""
    first_cached: int | None = None
    last_cached: int = 0
    engine_requests: int = 0
    prefill_tokens: int = 0
    generated: int = 0
    finished_at: float = 0.0
    on_prefill: list[asyncio.Event] = field(default_factory=list)
    """Set once an engine request of its sequence has its first token out: a fork's leading
    child's siblings wait for it (and, when that child leads a fork of its own, so do its
    parent's siblings; see ``fork_lead``)."""

    @property
    def logprob(self) -> float:
        return float(sum(self.lps))

    @property
    def appended(self) -> int:
        return len(self.tokens) - self.prompt_len

    def append(self, token: int, lp: float = 0.0) -> None:
        self.tokens.append(token)
        self.lps.append(lp)

    def truncate(self, k: int) -> None:
        """Drop the last ``k`` tokens (k <= appended)."""
        if k:
            del self.tokens[-k:]
            del self.lps[-k:]

    def open_constraint(self, matcher: Any, grammar: str) -> None:
        self.matcher = matcher
        self.region_grammar = grammar
        self.region_start = len(self.tokens)
        self.m_consumed = 0

    def sync_matcher(self) -> bool:
        """Bring the matcher to exactly ``tokens[region_start:]`` (rollback or consume);
        False if the tokens do not fit it (then the constraint is closed)."""
        m = self.matcher
        if m is None:
            return True
        target = len(self.tokens) - self.region_start
        if target < 0:
            self.matcher = None
            return False
        if self.m_consumed > target:
            m.rollback(self.m_consumed - target)
        elif self.m_consumed < target:
            rest = self.tokens[self.region_start + self.m_consumed:]
            if m.validate_tokens(rest) < len(rest):
                self.matcher = None
                return False
            m.consume_tokens(rest)
        self.m_consumed = target
        return not m.is_error()

    def child(self, branch_id: str) -> Branch:
        """A copy sharing nothing mutable (the matcher is deep-copied: llguidance fork)."""
        return Branch(
            id=branch_id, tokens=list(self.tokens), prompt_len=self.prompt_len,
            lps=list(self.lps), variables=dict(self.variables),
            matcher=self.matcher.deep_copy() if self.matcher is not None else None,
            region_start=self.region_start, region_grammar=self.region_grammar,
            m_consumed=self.m_consumed,
            first_cached=None, last_cached=self.last_cached,
        )

    def prefilled(self) -> None:
        """Its sequence so far is cached: release whoever waits for that."""
        for e in self.on_prefill:
            e.set()

    def mark_finished(self) -> None:
        self.finished_at = time.monotonic()
