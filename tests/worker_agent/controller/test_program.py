"""Static checks of controller programs: parsing, bounds, and which limit a program breaks."""

from __future__ import annotations

import grpc
import pytest

from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from kvroute.worker_agent.controller.program import (
    ProgramError,
    ProgramLimits,
    SelectMode,
    check_program,
)

LIMITS = ProgramLimits(max_fanout=8, max_tokens=1000, max_steps=20, max_grammar_bytes=200,
                       compile_timeout_s=1.0, max_new_tokens=500, vocab_size=258)


def gen(n: int, **kw: object) -> P.Step:
    return P.Step(gen=P.Gen(max_tokens=n, **kw))


def fork(*subs: list[P.Step], n: int = 0, select: int = 0) -> P.Step:
    return P.Step(fork=P.Fork(branches=[P.ControllerProgram(steps=s) for s in subs], n=n,
                              select=select))


def prog(*steps: P.Step) -> P.ControllerProgram:
    return P.ControllerProgram(steps=steps)


def test_bounds_count_tokens_in_every_branch_and_the_peak_fanout() -> None:
    p = prog(P.Step(fast_forward=P.FastForward(text="héllo")),  # 6 bytes
             fork([gen(10)], n=3),                                  # 3 x 10, live 3
             gen(5),                                                # 3 x 5
             fork([gen(2)], [gen(1)], select=P.SELECT_MODE_BEST_LOGPROB),  # 3 x 3, peak 6
             P.Step(select=P.Select(mode=P.SELECT_MODE_BEST_LOGPROB)),
             gen(7))                                                # 1 x 7
    plan = check_program(p, LIMITS)
    assert plan.tokens == 6 + 30 + 15 + 9 + 7
    assert plan.fanout == 6
    assert plan.needs_text and not plan.constraints
    assert plan.program[-2].mode == SelectMode.BEST_LOGPROB


@pytest.mark.parametrize(("program", "code", "limit"), [
    (prog(fork([gen(1)], n=9)), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_fanout"),
    (prog(fork([fork([gen(1)], n=3)], n=3)), grpc.StatusCode.RESOURCE_EXHAUSTED,
     "max_program_fanout"),
    (prog(fork([gen(400)], n=3)), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_program_tokens"),
    (prog(*[gen(1)] * 21), grpc.StatusCode.INVALID_ARGUMENT, "max_program_steps"),
    (prog(gen(5, constraint=P.Constraint(regex="a" * 201))), grpc.StatusCode.INVALID_ARGUMENT,
     "max_grammar_bytes"),
    (prog(gen(5, constraint=P.Constraint(choices=P.Choices(options=["x" * 150, "y" * 60])))),
     grpc.StatusCode.INVALID_ARGUMENT, "max_grammar_bytes"),
    (prog(gen(501)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (prog(gen(0)), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
    (prog(P.Step(backtrack=P.Backtrack(tokens=0))), grpc.StatusCode.INVALID_ARGUMENT,
     "backtrack.tokens"),
    (prog(P.Step(fast_forward=P.FastForward(tokens=P.TokenIds(ids=[300])))),
     grpc.StatusCode.INVALID_ARGUMENT, "out of range"),
    (prog(gen(3, constraint=P.Constraint(json_schema="{nope"))),
     grpc.StatusCode.INVALID_ARGUMENT, "json_schema"),
    (prog(gen(3, continue_constraint=True, constraint=P.Constraint(regex="a"))),
     grpc.StatusCode.INVALID_ARGUMENT, "continue_constraint"),
    (prog(P.Step()), grpc.StatusCode.INVALID_ARGUMENT, "empty step"),
    (P.ControllerProgram(), grpc.StatusCode.INVALID_ARGUMENT, "empty program"),
])
def test_each_limit_and_malformed_step_names_itself(program: P.ControllerProgram,
                                                     code: grpc.StatusCode, limit: str) -> None:
    with pytest.raises(ProgramError) as err:
        check_program(program, LIMITS)
    assert err.value.code == code
    assert limit in str(err.value)


def test_identical_constraints_are_compiled_once() -> None:
    c = P.Constraint(regex="[ab]+")
    plan = check_program(prog(gen(3, constraint=c), fork([gen(3, constraint=c)], n=2)), LIMITS)
    assert len(plan.constraints) == 1 and plan.constraints[0].kind == "regex"
