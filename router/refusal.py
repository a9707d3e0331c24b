"""Why the router's one generation path did not serve a request, as typed errors every API
reports by type, never by message text.

``RouterService.generate`` raises a :class:`RefusedError` subclass. Each carries its gRPC
status (``code``; the gRPC front aborts with it), its HTTP status and OpenAI error ``code``
(the HTTP fronts answer with them), and the request field it is about (``field``: a
``GenerateRequest`` field such as ``sampling.max_tokens``, or ``program.fanout``; each front
names its own parameter for it).
"""

from __future__ import annotations

from typing import ClassVar

import grpc

from kvroute.core.grpc_util import REFUSED_FIELD
from kvroute.core.validate import InvalidRequestError

OUTPUT_SENT = "kvroute-output-sent"
"""Trailer of a stream that failed after output reached the client: the tokens sent (a
retry would repeat them, though the status, UNAVAILABLE, says retryable)."""


class RefusedError(Exception):
    """A request the router would not or could not serve.

    ``code``: the gRPC status it is; ``http_status`` and ``error_code`` (None: none) what an
    HTTP front answers; ``retry_after``: the client may retry after that many seconds (0:
    not as it is). ``field``: the request field it is about, when it is about one.
    ``midstream``: tokens had already been sent when it failed; ``sent``: how many.
    """

    http_status: ClassVar[int] = 502
    retry_after: ClassVar[int] = 0

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "",
                 midstream: bool = False, sent: int = 0) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.midstream = midstream
        self.sent = sent

    @property
    def error_code(self) -> str | None:
        return self.code.name.lower()

    def trailer(self) -> tuple[tuple[str, str], ...]:
        """The gRPC trailing metadata to abort with: :data:`OUTPUT_SENT` when midstream."""
        return ((OUTPUT_SENT, str(self.sent)),) if self.midstream else ()


class InvalidError(RefusedError):
    """A field of the request is wrong (INVALID_ARGUMENT, HTTP 400)."""

    http_status = 400

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, message, field)

    @property
    def error_code(self) -> str | None:
        return None


class TooLargeError(InvalidError):
    """The prompt is longer than the router takes (INVALID_ARGUMENT, HTTP 413)."""

    http_status = 413


class UnsupportedError(RefusedError):
    """What the request asks cannot be done here: a program over a limit, a constraint a
    worker's engine cannot apply (the router's or the worker's own status: RESOURCE_EXHAUSTED,
    FAILED_PRECONDITION, UNIMPLEMENTED, INVALID_ARGUMENT, OUT_OF_RANGE; HTTP 400). The
    request's to change, not to retry."""

    http_status = 400


class ShedError(RefusedError):
    """The router is at ``--max-inflight`` (RESOURCE_EXHAUSTED, HTTP 429): retry shortly."""

    http_status = 429
    retry_after = 1

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, message)

    @property
    def error_code(self) -> str | None:
        return "rate_limit_exceeded"


class UnavailableError(RefusedError):
    """No worker could serve it now, or its worker failed mid-stream (UNAVAILABLE, HTTP
    503): retry shortly (but a retry after ``midstream`` repeats what was sent)."""

    http_status = 503
    retry_after = 1

    def __init__(self, message: str, midstream: bool = False, sent: int = 0) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message, midstream=midstream, sent=sent)

    @property
    def error_code(self) -> str | None:
        return "no_worker_available"


def invalid_request(exc: InvalidRequestError) -> InvalidError:
    """The refusal a failed validation is: :class:`TooLargeError` for a prompt over the limit."""
    return (TooLargeError if exc.too_large else InvalidError)(str(exc), exc.field)


def refused_field(failure: grpc.aio.AioRpcError) -> str:
    """The field a worker's refusal names (its :data:`REFUSED_FIELD` trailer), or ""."""
    for key, value in failure.trailing_metadata() or ():
        if key == REFUSED_FIELD:
            return str(value)
    return ""
