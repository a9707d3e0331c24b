"""Reading an HTTP request's JSON body: a clear 400 for what no API can take."""

from __future__ import annotations

import json
import re
from typing import Any

from kvroute.router.api_error import ApiError

# A JSON escape of a UTF-16 surrogate: only a body holding one can decode to a lone one
# (raw UTF-8 cannot encode them; a valid pair decodes to one character).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def decode_body(raw: bytes) -> Any:
    """A request body's JSON; ApiError 400 when it is not JSON (invalid_json) or a string in
    it has a lone UTF-16 surrogate, which no tokenizer can encode (param: where it is)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}",
                       code="invalid_json") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(body, "")
        if where is not None:
            raise ApiError(400, f"{where or 'the body'}: a string holds a lone UTF-16 "
                           "surrogate (not valid Unicode text)", param=where or None)
    return body


def _lone_surrogate(value: Any, path: str) -> str | None:
    """The path (``messages[0].content``) of the first string under ``value`` that has a
    lone surrogate, keys included; None if there is none."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if _lone_surrogate(k, where) is not None:
                return where
            found = _lone_surrogate(v, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None
