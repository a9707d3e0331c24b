"""Why the router's one generation path did not serve a request, for every API to report.

``RouterService.generate`` raises :class:`RefusedError`; the gRPC ``Generate`` aborts with its
``code``, the HTTP front maps the code to a status (router/openai_api.py).
"""

from __future__ import annotations

import grpc

OUTPUT_SENT = "kvroute-output-sent"
"""Trailer of a stream that failed after output reached the client: the tokens sent (a
retry would repeat them, though the status, UNAVAILABLE, says retryable)."""


class RefusedError(Exception):
    """A request the router would not or could not serve.

    ``code``: the gRPC status the refusal is (INVALID_ARGUMENT: the request is wrong,
    UNAVAILABLE: no worker could serve it now, or a worker's own code for what it refused).
    ``field``: the request field it is about, when it is about one (``sampling.max_tokens``).
    ``midstream``: tokens had already been sent when it failed; ``sent``: how many.
    ``shed``: the router is at ``--max-inflight`` (RESOURCE_EXHAUSTED; HTTP 429).
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "",
                 midstream: bool = False, sent: int = 0, shed: bool = False) -> None:
        super().__init__(message)
        self.shed = shed
        self.code = code
        self.message = message
        self.field = field
        self.midstream = midstream
        self.sent = sent

    def trailer(self) -> tuple[tuple[str, str], ...]:
        """The gRPC trailing metadata to abort with: :data:`OUTPUT_SENT` when midstream."""
        return ((OUTPUT_SENT, str(self.sent)),) if self.midstream else ()
