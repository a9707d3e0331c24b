"""Controller programs: the proto's ``ControllerProgram`` parsed into plain dataclasses and
checked against the agent's limits, before any engine work.

Static bounds (``tokens``, ``fanout``, steps, nesting) are computed first, from what the
program claims and without expanding it, by :mod:`kvroute.core.program_bounds` (the walk the
router bounds programs with too); only a program within them is parsed step by step, and
each constraint's claimed size (bytes, options, JSON nesting) is checked before it is parsed.
The agent runs :func:`check_program` off its event loop (``runtime``).

Status codes (the message always starts with the limit's flag name or the field path):

=====================================  ===================
over ``max_program_fanout``            RESOURCE_EXHAUSTED
over ``max_program_tokens``            RESOURCE_EXHAUSTED
over ``grammar_compile_timeout_s``     RESOURCE_EXHAUSTED  (see ``grammars``)
over ``max_grammar_bytes``             INVALID_ARGUMENT
over ``max_choices``                   INVALID_ARGUMENT
over ``max_schema_depth``              INVALID_ARGUMENT
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

from kvroute.core.program_bounds import BoundLimits, ProgramBoundsError, program_bounds
from kvroute.v1 import program_pb2

MAX_NAME = 64
MAX_CHOICES = 1024
"""Most options of one ``choices`` constraint (each is an alternative of its grammar)."""
MAX_SCHEMA_DEPTH = 64
"""Most nesting levels of a JSON schema's text (objects and arrays): the schema-to-grammar
converter recurses over it."""


class SelectMode(IntEnum):
    ALL = program_pb2.SELECT_MODE_ALL
    BEST_LOGPROB = program_pb2.SELECT_MODE_BEST_LOGPROB
    FIRST_FINISHED = program_pb2.SELECT_MODE_FIRST_FINISHED


class ProgramError(Exception):
    """A program the agent will not run (or that failed): reported with ``code``, and the
    request field it is about (``field``) in the status's trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "program") -> None:
        super().__init__(message)
        self.code = code
        self.field = field


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
    max_choices: int = MAX_CHOICES
    max_schema_depth: int = MAX_SCHEMA_DEPTH


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


def json_depth(text: str) -> int:
    """Deepest nesting of objects and arrays in JSON ``text`` (strings skipped), found without
    parsing it: the parser and the schema converter recurse once a level."""
    depth = deepest = 0
    in_str = escaped = False
    for ch in text:
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def constraint_spec(c: program_pb2.Constraint, where: str, max_bytes: int,
                    max_choices: int = MAX_CHOICES,
                    max_schema_depth: int = MAX_SCHEMA_DEPTH) -> ConstraintSpec:
    """The llguidance grammar of one constraint (compiled later, see ``grammars``). Its
    claimed size (bytes, options, nesting) is checked before it is parsed or converted."""
    import llguidance

    kind = c.WhichOneof("kind")
    if kind is None:
        raise _invalid(where, "empty constraint (set json_schema, regex, lark or choices)")
    source: str | tuple[str, ...]
    if kind == "choices":
        if len(c.choices.options) > max_choices:
            raise _invalid(f"max_choices: {where}.choices",
                           f"{len(c.choices.options)} options exceed the limit of "
                           f"{max_choices}")
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
        depth = json_depth(c.json_schema)
        if depth > max_schema_depth:
            raise _invalid(f"max_schema_depth: {where}.json_schema",
                           f"nested {depth} levels deep, over the limit of {max_schema_depth}")
        try:
            schema = json.loads(c.json_schema)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _invalid(f"{where}.json_schema", f"not JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise _invalid(f"{where}.json_schema", "must be a JSON object")
    elif kind == "choices" and (not opts or any(not o for o in opts)):
        raise _invalid(f"{where}.choices", "needs at least one option, none empty")
    try:
        if kind == "json_schema":
            # Compact separators: a random model cannot pad the output with whitespace.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False})
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(c.regex)
        elif kind == "lark":
            grammar = llguidance.LLMatcher.grammar_from_lark(c.lark)
        else:
            # JSON string literals are valid Lark string literals (same escapes).
            grammar = llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(o) for o in opts))
    except (ValueError, TypeError, RecursionError) as exc:  # the converter's refusal
        raise _invalid(f"constraint: {where}.{kind}", str(exc)) from None
    return ConstraintSpec(kind, grammar, size, source)


@dataclass(slots=True)
class _Walk:
    """Parses a program already within its bounds (``program_bounds``): its forks' copies
    are at most ``max_fanout`` and its steps at most ``max_steps``."""

    limits: ProgramLimits
    needs_text: bool = False
    continues: bool = False
    constraints: dict[str, ConstraintSpec] | None = None

    def program(self, p: program_pb2.ControllerProgram, where: str) -> Program:
        out: list[Step] = []
        for i, step in enumerate(p.steps):
            at = f"{where}.steps[{i}]"
            kind = step.WhichOneof("kind")
            if kind == "gen":
                out.append(self.gen(step.gen, f"{at}.gen"))
            elif kind == "fast_forward":
                out.append(self.fast_forward(step.fast_forward, f"{at}.fast_forward"))
            elif kind == "backtrack":
                if step.backtrack.tokens == 0:
                    raise _invalid(f"{at}.backtrack.tokens", "must be > 0")
                out.append(Backtrack(step.backtrack.tokens))
            elif kind == "fork":
                out.append(self.fork(step.fork, f"{at}.fork"))
            elif kind == "select":
                out.append(Select(SelectMode(step.select.mode)))
            else:
                raise _invalid(at, "empty step (set gen, fast_forward, backtrack, fork, select)")
        return tuple(out)

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
            spec = constraint_spec(g.constraint, f"{at}.constraint", lim.max_grammar_bytes,
                                   lim.max_choices, lim.max_schema_depth)
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

    def fork(self, f: program_pb2.Fork, at: str) -> Fork:
        subs = list(f.branches)
        if f.n:
            if len(subs) > 1:
                raise _invalid(f"{at}.n", "with n, give at most one branch (the copy)")
            # n copies of one sub-program: parsed once (n is within max_fanout here).
            one = self.program(subs[0] if subs else program_pb2.ControllerProgram(),
                               f"{at}.branches[0]")
            return Fork((one,) * f.n, SelectMode(f.select))
        if not subs:
            raise _invalid(at, "no branches (set branches or n)")
        return Fork(tuple(self.program(sub, f"{at}.branches[{j}]")
                          for j, sub in enumerate(subs)), SelectMode(f.select))


def check_program(p: program_pb2.ControllerProgram, limits: ProgramLimits) -> Plan:
    """Bound, then parse ``p``; :class:`ProgramError` if it is malformed or over a limit.
    CPU work up to its limits (constraint conversion): run it off the event loop."""
    if not p.steps:
        raise _invalid("program.steps", "empty program")
    try:
        bounds = program_bounds(p, BoundLimits(max_fanout=limits.max_fanout,
                                               max_tokens=limits.max_tokens,
                                               max_steps=limits.max_steps))
    except ProgramBoundsError as exc:
        raise ProgramError(exc.code, str(exc), exc.field) from None
    walk = _Walk(limits, constraints={})
    program = walk.program(p, "program")
    assert walk.constraints is not None
    return Plan(program, bounds.tokens, bounds.fanout, bounds.steps,
                tuple(walk.constraints.values()), walk.needs_text, walk.continues)
