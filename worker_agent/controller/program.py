"""Controller programs: the proto's ``ControllerProgram`` parsed into plain dataclasses and
checked against the agent's limits, before any engine work.

Static bounds (what the limits are checked against), over the whole program tree:

- ``tokens``: every gen's ``max_tokens`` plus every fast-forward's length (text: its UTF-8
  byte count, an upper bound for both byte-level vocabularies), times the number of
  branches the step can run in.
- ``fanout``: the most branches that can be live at once (a fork of N children in each of
  L live branches makes L*N; a best/first-finished join brings them back down).

Status codes (the message always starts with the limit's flag name or the field path):

=====================================  ===================
over ``max_program_fanout``            RESOURCE_EXHAUSTED
over ``max_program_tokens``            RESOURCE_EXHAUSTED
over ``grammar_compile_timeout_s``     RESOURCE_EXHAUSTED  (see ``grammars``)
over ``max_grammar_bytes``             INVALID_ARGUMENT
over ``max_program_steps`` / depth     INVALID_ARGUMENT
a malformed step or grammar            INVALID_ARGUMENT
=====================================  ===================
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from enum import IntEnum

import grpc

from kvroute.v1 import program_pb2

MAX_DEPTH = 16
"""Fork nesting limit (keeps the recursive runtime's stack small)."""
MAX_NAME = 64


class SelectMode(IntEnum):
    ALL = program_pb2.SELECT_MODE_ALL
    BEST_LOGPROB = program_pb2.SELECT_MODE_BEST_LOGPROB
    FIRST_FINISHED = program_pb2.SELECT_MODE_FIRST_FINISHED


class ProgramError(Exception):
    """A program the agent will not run (or that failed): reported with ``code``."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _invalid(where: str, problem: str) -> ProgramError:
    return ProgramError(grpc.StatusCode.INVALID_ARGUMENT, f"{where}: {problem}")


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """``kind`` is json_schema, regex, lark or choices; ``grammar`` is llguidance's input."""

    kind: str
    grammar: str
    size: int
    """Bytes of the client's constraint (what ``max_grammar_bytes`` bounds)."""
    source: str | tuple[str, ...] = ""
    """The client's constraint as given: schema JSON text, regex, Lark text, or the options
    (engines that take grammars per request, vllm, are sent this)."""


@dataclass(frozen=True, slots=True)
class Gen:
    max_tokens: int
    stop: tuple[bytes, ...] = ()
    temperature: float | None = None
    constraint: ConstraintSpec | None = None
    capture: str = ""
    continue_constraint: bool = False


@dataclass(frozen=True, slots=True)
class FastForward:
    text: str | None = None
    tokens: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Backtrack:
    tokens: int


@dataclass(frozen=True, slots=True)
class Fork:
    branches: tuple[tuple[Step, ...], ...]
    select: SelectMode = SelectMode.ALL


@dataclass(frozen=True, slots=True)
class Select:
    mode: SelectMode


Step = Gen | FastForward | Backtrack | Fork | Select
Program = tuple[Step, ...]


@dataclass(frozen=True, slots=True)
class ProgramLimits:
    max_fanout: int
    max_tokens: int
    max_steps: int
    max_grammar_bytes: int
    compile_timeout_s: float
    max_new_tokens: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked program and its static bounds."""

    program: Program
    tokens: int
    fanout: int
    steps: int
    constraints: tuple[ConstraintSpec, ...]
    needs_text: bool
    """Text fast-forwards or stop strings: the agent needs a tokenizer matching the engine."""
    continues_constraint: bool = False
    """Some gen sets ``continue_constraint`` (an engine that takes per-step masks continues
    any constraint; one that takes a whole grammar per request, a regular one only)."""


def constraint_spec(c: program_pb2.Constraint, where: str, max_bytes: int) -> ConstraintSpec:
    """The llguidance grammar of one constraint (compiled later, see ``grammars``)."""
    import llguidance

    kind = c.WhichOneof("kind")
    if kind is None:
        raise _invalid(where, "empty constraint (set json_schema, regex, lark or choices)")
    source: str | tuple[str, ...]
    if kind == "choices":
        opts = list(c.choices.options)
        size = sum(len(o.encode()) for o in opts)
        source = tuple(opts)
    else:
        source = getattr(c, kind)
        size = len(source.encode())
    if size > max_bytes:
        raise _invalid(f"max_grammar_bytes: {where}.{kind}",
                       f"{size} bytes exceeds the limit of {max_bytes}")
    if kind == "json_schema":
        try:
            schema = json.loads(c.json_schema)
        except json.JSONDecodeError as exc:
            raise _invalid(f"{where}.json_schema", f"not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise _invalid(f"{where}.json_schema", "must be a JSON object")
        # Compact separators: a random model cannot pad the output with whitespace forever.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    elif kind == "regex":
        grammar = llguidance.LLMatcher.grammar_from_regex(c.regex)
    elif kind == "lark":
        grammar = llguidance.LLMatcher.grammar_from_lark(c.lark)
    else:
        if not opts or any(not o for o in opts):
            raise _invalid(f"{where}.choices", "needs at least one option, none empty")
        # JSON string literals are valid Lark string literals (same escapes).
        grammar = llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(o) for o in opts))
    return ConstraintSpec(kind, grammar, size, source)


@dataclass(slots=True)
class _Walk:
    limits: ProgramLimits
    steps: int = 0
    tokens: int = 0
    needs_text: bool = False
    continues: bool = False
    constraints: dict[str, ConstraintSpec] | None = None

    def program(self, p: program_pb2.ControllerProgram, where: str, live: int,
                depth: int) -> tuple[Program, int, int]:
        """Parse ``p``, run as ``live`` independent instances (one per parent branch); return
        it, the live count after it and its peak live count (over all instances)."""
        instances = live
        if depth > MAX_DEPTH:
            raise _invalid(f"max_program_steps: {where}", f"forks nested deeper than {MAX_DEPTH}")
        out: list[Step] = []
        peak = live
        for i, step in enumerate(p.steps):
            self.steps += 1
            if self.steps > self.limits.max_steps:
                raise _invalid("max_program_steps",
                               f"program has more than {self.limits.max_steps} steps")
            at = f"{where}.steps[{i}]"
            kind = step.WhichOneof("kind")
            if kind == "gen":
                out.append(self.gen(step.gen, f"{at}.gen"))
                self.tokens += live * step.gen.max_tokens
            elif kind == "fast_forward":
                ff = self.fast_forward(step.fast_forward, f"{at}.fast_forward")
                self.tokens += live * (len(ff.text.encode()) if ff.text is not None
                                       else len(ff.tokens))
                out.append(ff)
            elif kind == "backtrack":
                if step.backtrack.tokens == 0:
                    raise _invalid(f"{at}.backtrack.tokens", "must be > 0")
                out.append(Backtrack(step.backtrack.tokens))
            elif kind == "fork":
                fork, live, fork_peak = self.fork(step.fork, f"{at}.fork", live, depth)
                peak = max(peak, fork_peak)
                out.append(fork)
            elif kind == "select":
                mode = SelectMode(step.select.mode)
                if mode != SelectMode.ALL:
                    live = instances  # one survivor per instance
                out.append(Select(mode))
            else:
                raise _invalid(at, "empty step (set gen, fast_forward, backtrack, fork, select)")
            if peak > self.limits.max_fanout:
                break
        return tuple(out), live, peak

    def gen(self, g: program_pb2.Gen, at: str) -> Gen:
        lim = self.limits
        if not 0 < g.max_tokens <= lim.max_new_tokens:
            raise _invalid(f"{at}.max_tokens", f"must be in [1, {lim.max_new_tokens}], "
                           f"got {g.max_tokens}")
        temperature = g.temperature if g.HasField("temperature") else None
        if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
            raise _invalid(f"{at}.temperature", f"must be >= 0, got {temperature}")
        if any(not s for s in g.stop):
            raise _invalid(f"{at}.stop", "stop strings must not be empty")
        if len(g.capture) > MAX_NAME:
            raise _invalid(f"{at}.capture", f"names are at most {MAX_NAME} characters")
        if g.continue_constraint and g.HasField("constraint"):
            raise _invalid(f"{at}.continue_constraint", "give a constraint or continue one")
        spec = None
        if g.HasField("constraint"):
            spec = constraint_spec(g.constraint, f"{at}.constraint", lim.max_grammar_bytes)
            assert self.constraints is not None
            spec = self.constraints.setdefault(spec.grammar, spec)
        self.needs_text |= bool(g.stop)
        self.continues |= g.continue_constraint
        return Gen(g.max_tokens, tuple(s.encode() for s in g.stop), temperature, spec,
                   g.capture, g.continue_constraint)

    def fast_forward(self, f: program_pb2.FastForward, at: str) -> FastForward:
        kind = f.WhichOneof("kind")
        if kind == "text":
            if not f.text:
                raise _invalid(f"{at}.text", "empty")
            self.needs_text = True
            return FastForward(text=f.text)
        if kind == "tokens" and f.tokens.ids:
            bad = [t for t in f.tokens.ids if t >= self.limits.vocab_size]
            if bad:
                raise _invalid(f"{at}.tokens", f"token id {bad[0]} is out of range "
                               f"[0, {self.limits.vocab_size})")
            return FastForward(tokens=tuple(f.tokens.ids))
        raise _invalid(at, "give text or (non-empty) tokens")

    def fork(self, f: program_pb2.Fork, at: str, live: int,
             depth: int) -> tuple[Fork, int, int]:
        subs = list(f.branches)
        if f.n:
            if len(subs) > 1:
                raise _invalid(f"{at}.n", "with n, give at most one branch (the copy)")
            subs = (subs or [program_pb2.ControllerProgram()]) * f.n
        if not subs:
            raise _invalid(at, "no branches (set branches or n)")
        # Children run concurrently: the fork's peak is the sum of its children's peaks,
        # in each of the `live` parents.
        if live * len(subs) > self.limits.max_fanout:
            return Fork((), SelectMode(f.select)), live * len(subs), live * len(subs)
        parsed: dict[int, tuple[Program, int, int, int]] = {}
        progs: list[Program] = []
        outs: list[int] = []
        peaks = 0
        for j, sub in enumerate(subs):
            key = id(sub)
            if key not in parsed:  # n copies of one sub-program are checked once
                before = self.tokens
                prog, sub_live, sub_peak = self.program(
                    sub, f"{at}.branches[{min(j, max(len(f.branches) - 1, 0))}]", live,
                    depth + 1)
                parsed[key] = (prog, sub_live, sub_peak, self.tokens - before)
            else:
                prog, sub_live, sub_peak, tokens = parsed[key]
                self.tokens += tokens
            progs.append(prog)
            outs.append(sub_live)
            peaks += sub_peak
        mode = SelectMode(f.select)
        # Sub-programs were walked in all `live` parents at once: counts are already scaled.
        after = {SelectMode.ALL: sum(outs), SelectMode.BEST_LOGPROB: live,
                 SelectMode.FIRST_FINISHED: max(outs)}[mode]
        return Fork(tuple(progs), mode), after, peaks


def check_program(p: program_pb2.ControllerProgram, limits: ProgramLimits) -> Plan:
    """Parse and bound ``p``; :class:`ProgramError` if it is malformed or over a limit."""
    if not p.steps:
        raise _invalid("program.steps", "empty program")
    walk = _Walk(limits, constraints={})
    program, _, peak = walk.program(p, "program", 1, 0)
    if peak > limits.max_fanout:
        raise ProgramError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"max_program_fanout: the program can run {peak} branches at "
                           f"once, over the limit of {limits.max_fanout}")
    if walk.tokens > limits.max_tokens:
        raise ProgramError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"max_program_tokens: the program can produce {walk.tokens} "
                           f"tokens over all branches, over the limit of {limits.max_tokens}")
    assert walk.constraints is not None
    return Plan(program, walk.tokens, peak, walk.steps, tuple(walk.constraints.values()),
                walk.needs_text, walk.continues)
