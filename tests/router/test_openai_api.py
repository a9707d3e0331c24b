"""How a worker's refusal of a request becomes an HTTP error (router/openai_api.py)."""

from __future__ import annotations

import grpc
import pytest

from kvroute.router.openai_api import refusal_error
from kvroute.router.openai_schema import parse_chat
from kvroute.router.refusal import RefusedError

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
        err = refusal_error(RefusedError(code, NO_VOCAB), "messages", g.program_params)
        assert (err.status, err.param) == (400, param)
