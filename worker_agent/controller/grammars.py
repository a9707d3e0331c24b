"""Compiling a program's constraints into llguidance matchers, with a time limit.

Each distinct constraint is compiled once per program (``LLMatcher(tokenizer, grammar)``, in
a thread: llguidance drops the GIL while it builds the lexer) into a *template* matcher in its
initial state; every gen that uses it starts from ``template.deep_copy()``, which is cheap.
A compile that runs past ``grammar_compile_timeout_s`` fails the program with
RESOURCE_EXHAUSTED before any engine work; its thread finishes in the background (llguidance's
own parser limits bound it).

For an engine that enforces the grammar itself (vllm: structured outputs), the matchers only
check and track what it returned; JSON schemas are then compiled with flexible whitespace
(``json_whitespace_flexible``), as vLLM's guidance backend does by default, so that valid
vLLM output is never rejected for its spacing.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence

import grpc
import llguidance
import numpy as np
import numpy.typing as npt

from kvroute.worker_agent.controller.program import ConstraintSpec, ProgramError
from kvroute.worker_agent.controller.vocab import Vocab


def _compile(vocab: Vocab, spec: ConstraintSpec, json_flexible: bool) -> llguidance.LLMatcher:
    grammar = spec.grammar
    if json_flexible and spec.kind == "json_schema":
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            json.loads(str(spec.source)), defaults={"whitespace_flexible": True})
    return llguidance.LLMatcher(vocab.ll, grammar, log_level=0)


async def compile_constraints(specs: Sequence[ConstraintSpec], vocab: Vocab,
                              timeout_s: float, *, json_whitespace_flexible: bool = False
                              ) -> dict[str, llguidance.LLMatcher]:
    """Template matchers keyed by ``spec.grammar`` (see the module doc for
    ``json_whitespace_flexible``). ProgramError: INVALID_ARGUMENT for a bad grammar,
    RESOURCE_EXHAUSTED past the time limit."""
    out: dict[str, llguidance.LLMatcher] = {}
    for spec in specs:
        try:
            m = await asyncio.wait_for(asyncio.to_thread(
                _compile, vocab, spec, json_whitespace_flexible), timeout_s)
        except TimeoutError:
            raise ProgramError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"grammar_compile_timeout_s: compiling a {spec.kind} constraint took longer "
                f"than {timeout_s} s") from None
        if m.is_error():
            raise ProgramError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"constraint ({spec.kind}): {m.get_error()}")
        if not m.is_accepting() and not _can_start(m, vocab):
            # E.g. a schema whose $refs only loop: no output satisfies it. Said now, not as a
            # masked token rejected mid-run.
            raise ProgramError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"constraint ({spec.kind}): no output can satisfy it")
        out[spec.grammar] = m
    return out


def _can_start(matcher: llguidance.LLMatcher, vocab: Vocab) -> bool:
    """Whether the matcher allows some first token other than end-of-sequence (which an
    empty language offers, then rejects)."""
    allowed = MaskBuffer(vocab.size).fill(matcher).copy()
    if 0 <= vocab.eos_token_id < vocab.size:
        allowed[vocab.eos_token_id] = False
    return bool(allowed.any())


class MaskBuffer:
    """One reusable llguidance bitmask and its boolean expansion for a vocabulary of ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.bits = np.full((1, (n + 31) // 32), -1, dtype=np.int32)

    def fill(self, matcher: llguidance.LLMatcher) -> npt.NDArray[np.bool_]:
        """The matcher's next-token mask as booleans (True = allowed), length ``n``."""
        row = self.bits[0]
        matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return np.unpackbits(row.view(np.uint8), bitorder="little")[: self.n].view(np.bool_)
