"""OpenAI request bodies: any JSON is parsed or refused as a 400 naming a field, never an
exception of another kind (which the HTTP front would answer with a 500), and what parses
becomes a GenerateRequest that protobuf accepts."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.router.api_error import ApiError, refusal_error
from kvroute.router.openai_schema import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    generate_request,
    parse_chat,
    parse_completion,
)
from kvroute.router.refusal import (
    InvalidError,
    RefusedError,
    ShedError,
    TooLargeError,
    UnavailableError,
    UnsupportedError,
)

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True), st.text(max_size=8))
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)
# Mostly the fields each endpoint knows, with good values and with anything at all.
GOOD: dict[str, Any] = {
    "model": st.just("m"), "messages": st.just([{"role": "user", "content": "hi"}]),
    "prompt": st.one_of(st.just("hi"), st.lists(st.integers(0, 300), min_size=1, max_size=5)),
    "max_tokens": st.integers(1, 50), "n": st.integers(1, 4), "temperature": st.floats(0, 2),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3), "logprobs": st.booleans(),
    "response_format": st.sampled_from([{"type": "json_object"}, {"type": "text"}, {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}]),
    "structured_outputs": st.sampled_from([{"regex": "a+"}, {"choice": ["a", "b"]}]),
}


def bodies(fields: frozenset[str]) -> st.SearchStrategy[dict[str, Any]]:
    names = sorted(fields | {"bogus", "frequency_penalty", "echo"})
    value = {n: st.one_of(GOOD.get(n, JSON), JSON) for n in names}
    return st.lists(st.sampled_from(names), max_size=6, unique=True).flatmap(
        lambda ks: st.fixed_dictionaries({k: value[k] for k in ks}))


def check(parse: Any, body: Any) -> None:
    try:
        req = parse(json.loads(json.dumps(body)))
    except ApiError as exc:
        assert exc.status == 400 and exc.message
        assert set(exc.body()["error"]) == {"message", "type", "param", "code"}
        return
    except ValueError:  # json.dumps of NaN round-trips; anything else is a bug
        raise
    msg = generate_request(req, [1, 2, 3], model="m", request_id="r", max_tokens=8)
    assert msg.IsInitialized() and list(msg.token_ids) == [1, 2, 3]
    assert msg.HasField("program") == req.needs_program


@settings(max_examples=400, deadline=None)
@given(bodies(CHAT_FIELDS))
def test_any_chat_body_parses_or_is_a_400(body: dict[str, Any]) -> None:
    check(parse_chat, body)


@settings(max_examples=400, deadline=None)
@given(bodies(COMPLETION_FIELDS))
def test_any_completion_body_parses_or_is_a_400(body: dict[str, Any]) -> None:
    check(parse_completion, body)


@given(JSON)
def test_any_json_value_parses_or_is_a_400(value: Any) -> None:
    check(parse_chat, value)
    check(parse_completion, value)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "seed": -1}, "seed"),
    ({"model": "m", "prompt": "x", "logprobs": 6}, "logprobs"),
    ({"model": "m", "prompt": [[1], []]}, "prompt"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": 1}}, "stream_options"),
    ({"model": "m", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
])
def test_a_bad_field_is_named(body: dict[str, Any], param: str) -> None:
    parse = parse_chat if "messages" in body else parse_completion
    with pytest.raises(ApiError) as exc:
        parse(body)
    assert exc.value.status == 400 and exc.value.param == param


TOOLS = [{"type": "function", "function": {"name": "now", "parameters": {}}}]


@pytest.mark.parametrize(("extra", "mode", "constrained"), [
    ({}, "none", False),
    ({"tools": TOOLS}, "auto", False),
    ({"tools": TOOLS, "tool_choice": "none"}, "none", False),
    ({"tool_choice": "auto"}, "none", False),  # no tools: nothing to call
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, "required",
     True),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "now"}}},
     "named", True),
])
def test_tool_choice_is_read_and_a_forced_call_is_a_schema(extra, mode, constrained) -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert req.tool_choice.mode == mode
    assert (req.constraint is not None) == constrained
    if constrained:
        assert req.constraint.param == "tool_choice" and req.program_params == ["tool_choice"]
        assert json.loads(req.constraint.value) == req.tool_choice.schema(TOOLS)


@pytest.mark.parametrize("extra", [
    {"tool_choice": "required"},
    {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}},
    {"tools": TOOLS, "tool_choice": "sometimes"},
    {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
])
def test_a_tool_choice_that_cannot_be_served_is_a_400(extra) -> None:
    with pytest.raises(ApiError) as exc:
        parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], **extra})
    assert exc.value.status == 400 and exc.value.param in ("tool_choice", "tools[0]")


@pytest.mark.parametrize(("extra", "top_p", "top_k"), [
    ({}, 1.0, 0), ({"top_p": 0.5, "top_k": 40}, 0.5, 40), ({"top_k": -1}, 1.0, 0),
    ({"top_p": 0}, 1.0, 1),  # the most likely token; the proto's 0 would mean "unset"
])
def test_top_p_and_top_k_reach_the_sampling_params(extra, top_p, top_k) -> None:
    req = parse_completion({"model": "m", "prompt": [1], **extra})
    s = generate_request(req, [1], model="m", request_id="r", max_tokens=1).sampling
    assert (s.top_p, s.top_k) == (pytest.approx(top_p), top_k)


def test_top_logprobs_above_0_is_a_400_naming_the_field_and_why() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True}
    assert parse_chat({**chat, "top_logprobs": 0}).logprobs
    with pytest.raises(ApiError) as exc:
        parse_chat({**chat, "top_logprobs": 2})
    assert exc.value.status == 400 and exc.value.param == "top_logprobs"
    assert exc.value.code == "unsupported_parameter"
    assert "only each sampled token's log-probability" in exc.value.message


def test_n_stop_and_constraints_become_one_forked_gen_step() -> None:
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 3,
                      "stop": ["\n"], "max_completion_tokens": 9, "max_tokens": 4,
                      "response_format": {"type": "json_object"}})
    msg = generate_request(req, [5], model="m", request_id="r", max_tokens=req.max_tokens or 1)
    (step,) = msg.program.steps
    assert step.fork.n == 3
    (gen,) = step.fork.branches[0].steps
    assert gen.gen.max_tokens == 9 and list(gen.gen.stop) == ["\n"]  # max_completion_tokens wins
    assert json.loads(gen.gen.constraint.json_schema) == {"type": "object"}
    plain = parse_completion({"model": "m", "prompt": [1, 2], "max_tokens": 5, "user": "u"})
    msg = generate_request(plain, [1, 2], model="m", request_id="r", max_tokens=5,
                           stop_token_ids=[7])
    assert not msg.HasField("program") and msg.sampling.max_tokens == 5
    assert msg.session_id == "u" and list(msg.sampling.stop_token_ids) == [7]


# -- refusals as HTTP errors: by their type and field, never their message --------------

NO_VOCAB = ("program: constraints, text fast-forwards and stop strings need --tokenizer with "
            "the engine's vocabulary (151665 ids; --tokenizer is 'byte')")

@pytest.mark.parametrize(("extra", "param"), [
    ({"stop": ["\n"]}, "stop"),
    ({"response_format": {"type": "json_object"}, "stop": ["\n"]}, "response_format"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),
    ({"n": 3, "temperature": 1.0}, "n"),
    ({"logprobs": True}, "logprobs"),
])
def test_a_refused_program_names_the_field_that_asked_for_it(extra, param) -> None:
    g = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra})
    for code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        err = refusal_error(UnsupportedError(code, NO_VOCAB), "messages", g.program_params)
        assert (err.status, err.param) == (400, param)


# Messages that would have fooled a front reading the text: the type alone decides.
LURE = "fanout exceeds the limit"


@pytest.mark.parametrize(("exc", "status", "param", "code", "retry"), [
    (InvalidError(LURE, "sampling.max_tokens"), 400, "max_tokens", None, None),
    (InvalidError(LURE, "token_ids"), 400, "messages", None, None),
    (TooLargeError(LURE, "token_ids"), 413, "messages", None, None),
    (UnsupportedError(grpc.StatusCode.RESOURCE_EXHAUSTED, LURE, "program.fanout"), 400, "n",
     "resource_exhausted", None),
    (UnsupportedError(grpc.StatusCode.RESOURCE_EXHAUSTED, LURE, "program"), 400, None,
     "resource_exhausted", None),
    (ShedError(LURE), 429, None, "rate_limit_exceeded", "1"),
    (UnavailableError(LURE), 503, None, "no_worker_available", "1"),
    (RefusedError(grpc.StatusCode.DEADLINE_EXCEEDED, LURE), 502, None, "deadline_exceeded",
     None),
])
def test_a_refusal_is_reported_by_its_type(exc, status, param, code, retry) -> None:
    err = refusal_error(exc, "messages")
    assert (err.status, err.param, err.code, err.headers.get("Retry-After")) == \
        (status, param, code, retry)
    assert err.message == LURE
