"""The HTTP fronts' errors: :class:`ApiError` (an HTTP status and OpenAI's error object,
which the Messages API words in Anthropic's shape), and a refusal of the generation path as
one (:func:`refusal_error`: its type's status and code, the request field it is about)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvroute.router.refusal import InvalidError, RefusedError, UnsupportedError


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

    ``headers``: extra response headers (``Retry-After`` on a 503)."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500
                                       else "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


_TYPES = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error",
          503: "service_unavailable_error"}


def invalid(param: str, problem: str, code: str | None = None) -> ApiError:
    return ApiError(400, f"{param}: {problem}", param=param, code=code)


# GenerateRequest fields (core/validate.py names them) as the request's fields.
_PARAMS = {"sampling.max_tokens": "max_tokens", "sampling.temperature": "temperature",
           "sampling.top_p": "top_p", "sampling.top_k": "top_k",
           "sampling.stop_token_ids": "stop", "model": "model",
           "cache_salt": "cache_salt", "request_id": None, "program.fanout": "n"}


def refusal_error(exc: RefusedError, prompt_param: str,
                  program_params: Sequence[str] = ()) -> ApiError:
    """The HTTP error a refusal of the generation path is: its type's status and code, the
    parameter its field is. ``program_params``: the request's fields that made it a program
    (:attr:`Generation.program_params`); a refused program not about one field names the
    first."""
    param: str | None = None
    if isinstance(exc, InvalidError):
        param = _PARAMS.get(exc.field, prompt_param) if exc.field else None
    elif isinstance(exc, UnsupportedError):
        param = _PARAMS[exc.field] if exc.field in _PARAMS else \
            (program_params[0] if program_params else None)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    return ApiError(exc.http_status, exc.message, param=param, code=exc.error_code,
                    headers=headers)
