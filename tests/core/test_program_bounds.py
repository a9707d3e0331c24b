"""A program's static bounds from what it claims: copies walked once, limits before work."""

from __future__ import annotations

import grpc
import pytest

from kvroute.core.program_bounds import (
    BoundLimits,
    ProgramBoundsError,
    program_bounds,
)
from kvroute.v1 import program_pb2 as P  # noqa: N812


def gen(n: int) -> P.Step:
    return P.Step(gen=P.Gen(max_tokens=n))


def fork(*subs: list[P.Step], n: int = 0, select: int = 0) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=s) for s in subs], n=n,
                              select=select))


def prog(*steps: P.Step) -> P.ControllerProgram:
    return P.ControllerProgram(steps=steps)


def test_copies_are_walked_once_and_multiplied() -> None:
    ff = P.Step(fast_forward=P.FastForward(text="abc"))
    b = program_bounds(prog(fork([ff, gen(5)], n=1000), gen(2)))
    assert (b.fanout, b.tokens, b.prefill_tokens) == (1000, 1000 * 8 + 1000 * 2, 3000)
    assert b.steps == 4  # the fork, its branch's two steps once, the gen after
    # A claim of 4x10^9 branches in 16 levels costs a walk of 16 steps, not its size.
    nested = [gen(1)]
    for _ in range(16):
        nested = [fork(nested, n=4 * 10 ** 9)]
    assert program_bounds(prog(*nested)).fanout == (4 * 10 ** 9) ** 16


def test_a_join_brings_the_live_count_back() -> None:
    best = fork([gen(1)], n=4, select=P.SELECT_MODE_BEST_LOGPROB)
    b = program_bounds(prog(best, fork([gen(1)], n=3)))
    assert b.fanout == 4  # best-of-4 leaves one branch, which then forks in 3
    first = fork([fork([gen(1)], n=2)], [gen(1)], select=P.SELECT_MODE_FIRST_FINISHED)
    assert program_bounds(prog(first, fork([gen(1)], n=5))).fanout == 10  # 2 live, then x5


@pytest.mark.parametrize(("program", "limits", "code", "name"), [
    (prog(fork([gen(1)], n=10 ** 6)), BoundLimits(max_fanout=16),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_fanout"),
    (prog(fork([gen(100)], n=4)), BoundLimits(max_tokens=300),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_tokens"),
    (prog(*[gen(1)] * 11), BoundLimits(max_steps=10), grpc.StatusCode.INVALID_ARGUMENT,
     "max_program_steps"),
    (prog(fork([fork([gen(1)], n=2)], n=2)), BoundLimits(max_depth=1),
     grpc.StatusCode.INVALID_ARGUMENT, "max_program_depth"),
    (prog(gen(1), P.Step(select=P.Select(mode=77))), BoundLimits(),
     grpc.StatusCode.INVALID_ARGUMENT, "unknown select mode 77"),
    (prog(fork([gen(1)], n=2, select=9)), BoundLimits(), grpc.StatusCode.INVALID_ARGUMENT,
     "program.steps[0].fork.select"),
], ids=["fanout", "tokens", "steps", "depth", "select", "fork_select"])
def test_each_limit_is_named(program: P.ControllerProgram, limits: BoundLimits,
                             code: grpc.StatusCode, name: str) -> None:
    with pytest.raises(ProgramBoundsError) as err:
        program_bounds(program, limits)
    assert err.value.code == code and name in str(err.value)
