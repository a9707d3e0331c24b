"""How a refusal of a request becomes an HTTP error (router/openai_api.py): by its type and
field, never its message."""

from __future__ import annotations

import grpc
import pytest

from kvroute.router.openai_api import refusal_error
from kvroute.router.openai_schema import parse_chat
from kvroute.router.refusal import (
    InvalidError,
    RefusedError,
    ShedError,
    TooLargeError,
    UnavailableError,
    UnsupportedError,
)

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
