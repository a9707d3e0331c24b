"""Constrained decoding: a gen's open constraint (llguidance matcher) driven on the engine.

A branch's open region is tracked by its matcher (``Branch.matcher``, invariants in
``branch``). How the engine is held to it depends on the engine:

- Mask engines (tiny, sim): per output token of the engine request the engine calls its
  ``mask_fn``, a :class:`Masker`, on the event loop. It feeds the matcher the tokens
  generated since its last call, then fills llguidance's bitmask (the mask time the
  benchmark measures). The matcher may run ahead of what the consumer has read; after each
  engine request the branch reconciles it (:func:`check_output`: ``Branch.sync_matcher``).
  When the matcher forces :data:`FF_SPLIT_MIN` or more tokens, the Masker records the step
  (``split_at``): the consumer ends the request there and :func:`force` appends the forced
  run, which the next request prefills in one pass instead of decoding one by one.
- Grammar engines (vllm: structured outputs): a constrained gen is one engine request
  carrying the constraint (:func:`region_constraint`), which the engine enforces; the matcher
  only checks and tracks the returned tokens. Such an engine starts every constraint from its
  beginning, so a continued region is sent as the regex of its rest after the region's text
  so far (``continuation``), from the regular constraints :func:`continuation_rests` wrote at
  prepare time; a program continuing a region with any other constraint is refused there.

Every failure is a :class:`ProgramError` with the status the client sees.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import numpy.typing as npt

from kvroute.worker_agent.controller.branch import Branch
from kvroute.worker_agent.controller.continuation import (
    Node,
    NotAPrefixError,
    constraint_node,
    rest_of,
)
from kvroute.worker_agent.controller.grammars import MaskBuffer
from kvroute.worker_agent.controller.program import ConstraintSpec, Gen, ProgramError
from kvroute.worker_agent.controller.unsupported import UnsupportedError
from kvroute.worker_agent.controller.vocab import Vocab
from kvroute.worker_agent.engines.base import GrammarState

FF_SPLIT_MIN = 2
"""Forced tokens worth ending an engine request for (one forced token is just decoded)."""

Rests = Mapping[str, tuple[str, Node]]
"""Regular constraints as (kind, nodes), by ``ConstraintSpec.grammar``: what a continued
region is sent as on an engine that takes a whole grammar per request."""


@dataclass(slots=True)
class Masker:
    """``mask_fn`` of one constrained engine request on a mask engine (see module doc)."""

    branch: Branch
    buf: MaskBuffer
    consumed: int = 0  # of this request's generated tokens
    split_at: int | None = None  # step after which the consumer ends the request (ff)
    mask_times: list[float] | None = None

    def __call__(self, step: int, generated: Sequence[int]) -> npt.NDArray[np.bool_]:
        t0 = time.perf_counter()
        b, m = self.branch, self.branch.matcher
        new = generated[self.consumed:]
        if new:
            m.consume_tokens(list(new))
            self.consumed += len(new)
            b.m_consumed += len(new)
        if self.split_at is None and not m.is_stopped() \
                and len(m.compute_ff_tokens()) >= FF_SPLIT_MIN:
            self.split_at = step  # this step's token is the first forced one
        mask = self.buf.fill(m)
        if self.mask_times is not None:
            self.mask_times.append(time.perf_counter() - t0)
        return mask


def enter_gen(b: Branch, g: Gen, templates: Mapping[str, Any]) -> bool:
    """Set ``b``'s region for gen ``g``: open ``g``'s constraint (a fresh copy of its
    template matcher), keep the open one (``continue_constraint``; INVALID_ARGUMENT when
    there is none), or close it. True when an open constraint was closed (the caller
    reports ``CONSTRAINT_CLOSED``)."""
    if g.constraint is not None:
        b.open_constraint(templates[g.constraint.grammar].deep_copy(), g.constraint.grammar)
    elif g.continue_constraint:
        if b.matcher is None:
            raise ProgramError(grpc.StatusCode.INVALID_ARGUMENT,
                               f"gen.continue_constraint: branch {b.id} has no open "
                               "constraint")
    elif b.matcher is not None:
        b.matcher = None
        return True
    return False


def force(b: Branch, limit: int) -> list[int]:
    """The tokens ``b``'s open constraint forces next (at most ``limit``), consumed by its
    matcher and appended to ``b`` (log-probability 0); [] when it forces none."""
    m = b.matcher
    ff = list(m.compute_ff_tokens()[:limit])
    if ff:
        m.consume_tokens(ff)
        b.m_consumed += len(ff)
        for t in ff:
            b.append(t)
    return ff


def continuation_rests(specs: Sequence[ConstraintSpec], engine_kind: str, max_len: int,
                       json_flexible: bool) -> dict[str, tuple[str, Node]]:
    """Every constraint of a program that continues a region, as the nodes its rest is
    computed from (``json_flexible``: JSON whitespace as the engine's grammar backend writes
    it). UNIMPLEMENTED naming the first that has no regex (lark, a recursive schema...)."""
    rests: dict[str, tuple[str, Node]] = {}
    for spec in specs:
        try:
            rests[spec.grammar] = (spec.kind, constraint_node(
                spec.kind, spec.source, max_len, json_flexible))
        except UnsupportedError as exc:
            raise ProgramError(grpc.StatusCode.UNIMPLEMENTED,
                               f"gen.continue_constraint on the {engine_kind} engine, which "
                               f"takes a whole grammar per request: {exc}") from None
    return rests


def rest_of_region(b: Branch, vocab: Vocab, rests: Rests, max_len: int) -> str | None:
    """The regex an engine taking whole grammars is sent to continue ``b``'s open region:
    its constraint's rest after the text generated in it (None: complete).
    FAILED_PRECONDITION when that text ends mid UTF-8 character or (a schema) left the
    subset its regex writes; RESOURCE_EXHAUSTED past ``max_len`` characters."""
    try:
        text = vocab.decode(b.tokens[b.region_start:], errors="strict")
    except UnicodeDecodeError:
        raise ProgramError(grpc.StatusCode.FAILED_PRECONDITION,
                           f"gen.continue_constraint: branch {b.id}'s constrained text so "
                           f"far ends inside a UTF-8 character; its rest cannot be written "
                           f"as a regex") from None
    kind, node = rests[b.region_grammar]
    try:
        return rest_of(node, text, max_len)
    except UnsupportedError as exc:
        raise ProgramError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"gen.continue_constraint: {exc}") from None
    except NotAPrefixError as exc:
        if kind == "json_schema":  # valid JSON for it, outside the subset written
            raise ProgramError(grpc.StatusCode.FAILED_PRECONDITION,
                               f"gen.continue_constraint: branch {b.id}: {exc} (its "
                               f"regex takes JSON with the schema's properties only, "
                               f"in its order: json_regex)") from None
        # A regex's derivative refusing what the matcher accepted: a bug here.
        raise ProgramError(grpc.StatusCode.INTERNAL,
                           f"gen.continue_constraint: branch {b.id}: {exc}") from None


def region_constraint(b: Branch, g: Gen, vocab: Vocab, rests: Rests, max_len: int,
                      from_state: bool = False
                      ) -> tuple[str, str | tuple[str, ...] | GrammarState] | None:
    """What a grammar engine's request for gen ``g`` on ``b`` (a region open) carries as
    ``(kind, source)``: ``g``'s own constraint; for a continued region, its grammar and
    tokens so far when the engine continues grammars (``from_state``), else the regex of
    its rest; None when the continued region is complete (nothing to ask for)."""
    if g.constraint is not None:
        return g.constraint.kind, g.constraint.source
    if from_state:
        if b.matcher is not None and b.sync_matcher() and b.matcher.is_stopped():
            return None  # nothing but the end is left
        return "state", GrammarState(b.region_grammar, tuple(b.tokens[b.region_start:]))
    rest = rest_of_region(b, vocab, rests, max_len)
    return None if rest is None else ("regex", rest)


def check_output(b: Branch, constraint: tuple[str, Any] | None, engine_kind: str) -> None:
    """Reconcile ``b``'s matcher with its tokens after an engine request. INTERNAL when they
    do not fit it: a grammar engine that ignored ``constraint``, or a masked token the
    constraint rejects."""
    if b.matcher is None or b.sync_matcher():
        return
    if constraint is not None:
        raise ProgramError(grpc.StatusCode.INTERNAL,
                           f"branch {b.id}: the {engine_kind} engine returned output "
                           f"outside the {constraint[0]} constraint (does it take "
                           f"its constraint fields? vLLM outside the supported range, or a "
                           f"structured-outputs backend other than guidance?)")
    raise ProgramError(grpc.StatusCode.INTERNAL,
                       f"branch {b.id}: the constraint rejected a masked token")
