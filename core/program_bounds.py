"""A controller program's static bounds, computed from what it claims without doing work
proportional to it: the one walk both the router (placement weights, its own limits) and the
agent (its limits, before parsing) run first.

A fork of ``n`` copies of one branch is walked once and its figures multiplied, so a program
claiming 4x10^9 branches costs as little to refuse as one claiming 4; the walk stops at the
first limit passed, and at most ``max_steps`` steps (counted as the agent counts them: the
copies of a fork's one branch once) and ``max_depth`` levels are ever visited.

Figures, over the whole program tree:

- ``fanout``: the most branches live at once (a fork of N children in each of L live
  branches makes L*N; a best/first-finished join brings them back down);
- ``tokens``: every gen's ``max_tokens`` plus every fast-forward's length (text: its UTF-8
  byte count, an upper bound for byte-level vocabularies), times the branches it runs in;
- ``prefill_tokens``: the fast-forwards' part of ``tokens`` (prefill work beyond the prompt).

Status codes (the message starts with the limit's flag name): over ``max_program_fanout`` or
``max_program_tokens``: RESOURCE_EXHAUSTED; over ``max_program_steps`` or the nesting depth,
an unknown select mode: INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc

from kvroute.v1 import program_pb2

MAX_DEPTH = 16
"""Fork nesting limit (keeps the agent's recursive runtime's stack small)."""
SELECT_MODES = frozenset(program_pb2.SelectMode.values())
UNLIMITED = math.inf


class ProgramBoundsError(Exception):
    """A program over a limit or malformed in its shape: reported with ``code``; ``field``
    the request field it is about (``program.fanout`` for its width, else ``program``)."""

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "program") -> None:
        super().__init__(message)
        self.code = code
        self.field = field


@dataclass(frozen=True, slots=True)
class BoundLimits:
    max_fanout: float = UNLIMITED
    max_tokens: float = UNLIMITED
    max_steps: float = UNLIMITED
    max_depth: int = MAX_DEPTH


@dataclass(frozen=True, slots=True)
class Bounds:
    fanout: int
    tokens: int
    prefill_tokens: int
    steps: int


@dataclass(slots=True)
class _Walk:
    limits: BoundLimits
    steps: int = 0
    tokens: int = 0
    prefill: int = 0

    def program(self, p: program_pb2.ControllerProgram, where: str, live: int,
                depth: int) -> tuple[int, int]:
        """``p`` run in ``live`` parent branches: the live count after it and its peak."""
        if depth > self.limits.max_depth:
            raise ProgramBoundsError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"max_program_depth: {where}: forks nested deeper "
                                     f"than {self.limits.max_depth}")
        instances = peak = live
        lim = self.limits
        if self.steps + len(p.steps) > lim.max_steps:  # before walking any of them
            raise ProgramBoundsError(grpc.StatusCode.INVALID_ARGUMENT,
                                     f"max_program_steps: program has more than "
                                     f"{lim.max_steps} steps")
        self.steps += len(p.steps)
        for i, step in enumerate(p.steps):
            kind = step.WhichOneof("kind")
            if kind == "gen":
                self.tokens += live * step.gen.max_tokens
            elif kind == "fast_forward":
                f = step.fast_forward
                n = len(f.tokens.ids) if f.HasField("tokens") else len(f.text.encode())
                self.tokens += live * n
                self.prefill += live * n
            elif kind == "fork":
                live, fork_peak = self.fork(step.fork, f"{where}.steps[{i}].fork", live,
                                            depth)
                peak = max(peak, fork_peak)
            elif kind == "select":
                mode = _select(step.select.mode, f"{where}.steps[{i}].select.mode")
                if mode != program_pb2.SELECT_MODE_ALL:
                    live = instances  # one survivor per instance
            else:
                continue
            if self.tokens > lim.max_tokens or peak > lim.max_fanout:
                self._check(peak)
        return live, peak

    def fork(self, f: program_pb2.Fork, at: str, live: int, depth: int) -> tuple[int, int]:
        mode = _select(f.select, f"{at}.select")
        if f.n and len(f.branches) <= 1:
            # n copies of one sub-program: walked once, its figures scaled by n.
            sub = f.branches[0] if f.branches else program_pb2.ControllerProgram()
            copies = [(sub, f.n)]
        else:
            copies = [(b, 1) for b in f.branches]
        width = sum(k for _, k in copies)
        self._check(live * width)  # before walking any child
        outs: list[tuple[int, int]] = []
        peaks = 0
        for j, (sub, k) in enumerate(copies):
            tokens, prefill = self.tokens, self.prefill
            sub_live, sub_peak = self.program(sub, f"{at}.branches[{j}]", live, depth + 1)
            self.tokens += (k - 1) * (self.tokens - tokens)
            self.prefill += (k - 1) * (self.prefill - prefill)
            outs.append((sub_live, k))
            peaks += k * sub_peak
            self._check(peaks)
        if mode == program_pb2.SELECT_MODE_ALL:
            after = sum(out * k for out, k in outs)
        elif mode == program_pb2.SELECT_MODE_BEST_LOGPROB:
            after = live
        else:
            after = max((out for out, _ in outs), default=live)
        return after, peaks

    def _check(self, fanout: int) -> None:
        lim = self.limits
        if fanout > lim.max_fanout:
            raise ProgramBoundsError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"max_program_fanout: the program can run {fanout} "
                                     f"branches at once, over the limit of {lim.max_fanout}",
                                     field="program.fanout")
        if self.tokens > lim.max_tokens:
            raise ProgramBoundsError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     f"max_program_tokens: the program can produce "
                                     f"{self.tokens} tokens over all branches, over the limit "
                                     f"of {lim.max_tokens}")


def _select(mode: int, where: str) -> int:
    if mode not in SELECT_MODES:
        raise ProgramBoundsError(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"{where}: unknown select mode {mode}")
    return mode


def program_bounds(program: program_pb2.ControllerProgram,
                   limits: BoundLimits = BoundLimits()) -> Bounds:
    """The program's figures (see module doc); :class:`ProgramBoundsError` at the first
    limit passed, or for an unknown select mode."""
    walk = _Walk(limits)
    _, peak = walk.program(program, "program", 1, 0)
    return Bounds(peak, walk.tokens, walk.prefill, walk.steps)
