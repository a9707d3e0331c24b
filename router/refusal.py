"""Why the router's one generation path did not serve a request, for every API to report.

``RouterService.generate`` raises :class:`RefusedError`; the gRPC ``Generate`` aborts with its
``code``, the HTTP front maps the code to a status (router/openai_api.py).
"""

from __future__ import annotations

import grpc


class RefusedError(Exception):
    """A request the router would not or could not serve.

    ``code``: the gRPC status the refusal is (INVALID_ARGUMENT: the request is wrong,
    UNAVAILABLE: no worker could serve it now, or a worker's own code for what it refused).
    ``field``: the request field it is about, when it is about one (``sampling.max_tokens``).
    ``midstream``: tokens had already been sent when it failed.
    """

    def __init__(self, code: grpc.StatusCode, message: str, field: str = "",
                 midstream: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field
        self.midstream = midstream
