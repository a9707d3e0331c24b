"""Constrained decoding on real llguidance matchers (the byte vocabulary): the mask_fn, the
grammar's forced runs, the region's rest for engines taking whole grammars, and the check of
what an engine returned."""

from __future__ import annotations

import json
import re

import grpc
import numpy as np
import pytest

from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from kvroute.worker_agent.controller.branch import Branch
from kvroute.worker_agent.controller.constrained import (
    FF_SPLIT_MIN,
    Masker,
    check_output,
    continuation_rests,
    enter_gen,
    force,
    region_constraint,
    rest_of_region,
)
from kvroute.worker_agent.controller.grammars import MaskBuffer, compile_constraints
from kvroute.worker_agent.controller.program import (
    ConstraintSpec,
    Gen,
    ProgramError,
    constraint_spec,
)
from kvroute.worker_agent.controller.vocab import Vocab, make_vocab
from kvroute.worker_agent.engines.base import GrammarState

PROMPT = [1, 2, 3]
REGEX = "a[bc]xyz"


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return make_vocab("byte")


def spec(max_bytes: int = 500, **kind: object) -> ConstraintSpec:
    return constraint_spec(P.Constraint(**kind), "gen.constraint", max_bytes)


async def opened(vocab: Vocab, s: ConstraintSpec) -> Branch:
    """A branch after the prompt with ``s``'s region just opened (as a gen step opens it)."""
    templates = await compile_constraints([s], vocab, 5.0)
    b = Branch("0", list(PROMPT), len(PROMPT))
    assert not enter_gen(b, Gen(max_tokens=8, constraint=s), templates)
    return b


def allowed(mask: np.ndarray) -> set[int]:
    return set(np.flatnonzero(mask).tolist())


async def test_the_masker_allows_only_the_grammar_and_marks_a_forced_run(vocab: Vocab) -> None:
    b = await opened(vocab, spec(regex=REGEX))
    times: list[float] = []
    masker = Masker(b, MaskBuffer(vocab.size), mask_times=times)
    assert allowed(masker(0, [])) == {ord("a")}
    assert masker.split_at is None  # one forced token is just decoded
    assert allowed(masker(1, [ord("a")])) == {ord("b"), ord("c")}
    assert masker.split_at is None
    # After "ab" the grammar forces "xyz" (3 >= FF_SPLIT_MIN): the request ends at this step.
    assert allowed(masker(2, [ord("a"), ord("b")])) == {ord("x")}
    assert FF_SPLIT_MIN <= 3 and masker.split_at == 2
    assert masker.consumed == b.m_consumed == 2  # ahead of the branch, which has none yet
    assert len(times) == 3 and all(t >= 0 for t in times)
    # The consumer appends what it read; the branch and matcher agree again.
    b.append(ord("a"))
    b.append(ord("b"))
    check_output(b, None, "tiny")
    assert b.matcher is not None and b.m_consumed == 2


async def test_force_appends_the_forced_run_up_to_the_limit(vocab: Vocab) -> None:
    b = await opened(vocab, spec(regex=REGEX))
    assert force(b, 5) == [ord("a")]
    assert force(b, 5) == []  # b or c: nothing forced
    b.append(ord("c"))
    check_output(b, None, "tiny")
    assert force(b, 2) == [ord("x"), ord("y")]
    assert force(b, 5) == [ord("z")]
    assert bytes(b.tokens[len(PROMPT):]) == b"acxyz"
    assert b.lps == [0.0] * 5 and b.m_consumed == 5
    assert b.matcher.is_accepting()


async def test_enter_gen_opens_keeps_or_closes_the_region(vocab: Vocab) -> None:
    s = spec(regex=REGEX)
    b = await opened(vocab, s)
    m = b.matcher
    assert b.region_start == len(PROMPT) and b.region_grammar == s.grammar
    assert not enter_gen(b, Gen(max_tokens=4, continue_constraint=True), {})
    assert b.matcher is m
    assert enter_gen(b, Gen(max_tokens=4), {})  # closed: the caller reports it
    assert b.matcher is None
    assert not enter_gen(b, Gen(max_tokens=4), {})  # nothing open, nothing closed
    with pytest.raises(ProgramError, match="branch 0 has no open constraint") as exc:
        enter_gen(b, Gen(max_tokens=4, continue_constraint=True), {})
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_check_output_names_what_left_the_constraint(vocab: Vocab) -> None:
    for constraint, why in ((None, "rejected a masked token"),
                            (("regex", REGEX), "vllm engine returned output outside the "
                                               "regex constraint")):
        b = await opened(vocab, spec(regex=REGEX))
        b.append(ord("a"))
        b.append(ord("q"))
        with pytest.raises(ProgramError, match=why) as exc:
            check_output(b, constraint, "vllm")
        assert exc.value.code == grpc.StatusCode.INTERNAL
        assert b.matcher is None  # the constraint is closed


def test_continuation_rests_refuse_a_context_free_constraint() -> None:
    ok = spec(regex=REGEX)
    rests = continuation_rests([ok, spec(choices=P.Choices(options=["yes", "no"]))], "vllm",
                               500, False)
    assert set(rests) == {ok.grammar, spec(choices=P.Choices(options=["yes", "no"])).grammar}
    assert rests[ok.grammar][0] == "regex"
    with pytest.raises(ProgramError, match="on the vllm engine, which takes a whole grammar "
                                           "per request: a lark constraint") as exc:
        continuation_rests([ok, spec(lark='start: "a"+')], "vllm", 500, False)
    assert exc.value.code == grpc.StatusCode.UNIMPLEMENTED


async def test_the_rest_of_a_region_is_what_completes_it(vocab: Vocab) -> None:
    s = spec(regex=REGEX)
    rests = continuation_rests([s], "vllm", 500, False)
    b = await opened(vocab, s)
    b.tokens += list(b"ab")
    rest = rest_of_region(b, vocab, rests, 500)
    assert rest is not None
    assert re.fullmatch(rest, "xyz") and not re.fullmatch(rest, "cxyz")
    # What a grammar engine's request carries: the gen's own constraint, else the rest.
    assert region_constraint(b, Gen(max_tokens=4, constraint=s), vocab, rests, 500) \
        == ("regex", REGEX)
    assert region_constraint(b, Gen(max_tokens=4, continue_constraint=True), vocab, rests,
                             500) == ("regex", rest)
    b.tokens += list(b"xyz")
    assert rest_of_region(b, vocab, rests, 500) is None
    assert region_constraint(b, Gen(max_tokens=4, continue_constraint=True), vocab, rests,
                             500) is None


async def test_a_continued_region_goes_as_its_grammar_and_tokens_to_the_mask_plugin(
        vocab: Vocab) -> None:
    # An engine that continues grammars (vLLM with kvroute's mask plugin) is sent the
    # region's grammar and its tokens so far: a context-free constraint continues too.
    s = spec(lark='start: "(" "a"+ ")"')
    b = await opened(vocab, s)
    b.tokens += list(b"(aa")
    got = region_constraint(b, Gen(max_tokens=4, continue_constraint=True), vocab, {}, 500,
                            from_state=True)
    assert got == ("state", GrammarState(s.grammar, tuple(b"(aa")))
    # The gen's own constraint still goes as itself; a complete region asks for nothing.
    assert region_constraint(b, Gen(max_tokens=4, constraint=s), vocab, {}, 500,
                             from_state=True) == ("lark", s.source)
    b.tokens += list(b")")
    assert region_constraint(b, Gen(max_tokens=4, continue_constraint=True), vocab, {}, 500,
                             from_state=True) is None


@pytest.mark.parametrize(("kind", "text", "max_len", "code", "why"), [
    ({"regex": "é+x"}, "é".encode()[:1], 500, grpc.StatusCode.FAILED_PRECONDITION,
     "ends inside a UTF-8 character"),
    ({"regex": "a(b|c)" + "d" * 40}, b"a", 10, grpc.StatusCode.RESOURCE_EXHAUSTED,
     "more than max_grammar_bytes"),
    ({"json_schema": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})},
     b'{"b"', 500, grpc.StatusCode.FAILED_PRECONDITION, "the schema's properties only"),
    ({"regex": REGEX}, b"q", 500, grpc.StatusCode.INTERNAL, "does not start anything"),
])
async def test_a_rest_that_cannot_be_written_fails_clearly(
        vocab: Vocab, kind: dict[str, str], text: bytes, max_len: int,
        code: grpc.StatusCode, why: str) -> None:
    s = spec(**kind)
    rests = continuation_rests([s], "vllm", 500, False)
    b = Branch("0", list(PROMPT), len(PROMPT))
    b.open_constraint(object(), s.grammar)  # only the region's bounds are read
    b.tokens += list(text)
    with pytest.raises(ProgramError, match=why) as exc:
        rest_of_region(b, vocab, rests, max_len)
    assert exc.value.code == code
