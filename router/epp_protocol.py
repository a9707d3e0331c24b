"""The pieces of Envoy's ``ext_proc`` stream an endpoint picker reads and writes, as the
Gateway API Inference Extension's endpoint-picker protocol defines them
(docs/proposals/004-endpoint-picker-protocol, v1.0.0): request headers and metadata (the
subset hint, the endpoint that served), the destination it answers with, immediate
responses, and the usage in a response body (router/epp.py runs the exchange)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict

from kvroute.envoy_api.envoy.config.core.v3 import base_pb2
from kvroute.envoy_api.envoy.service.ext_proc.v3 import (
    external_processor_pb2 as ep,
)
from kvroute.envoy_api.envoy.type.v3 import http_status_pb2
from kvroute.router.api_error import ApiError

DESTINATION = "x-gateway-destination-endpoint"
FALLBACK = "x-gateway-destination-endpoint-fallback"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
MAX_USAGE_BYTES = 4 << 20  # a non-streamed response read for its usage; past it, not counted


def header_map(headers: ep.HttpHeaders) -> dict[str, str]:
    """An ext_proc header map as lower-case name -> value (Envoy sends ``raw_value``; older
    versions ``value``). A repeated header keeps its last value."""
    out = {}
    for h in headers.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _metadata(md: base_pb2.Metadata, namespace: str) -> Mapping[str, Any]:
    if namespace not in md.filter_metadata:
        return {}
    return _struct(md.filter_metadata[namespace])


def _struct(s: struct_pb2.Struct) -> dict[str, Any]:
    return MessageToDict(s)


def _endpoints(value: Any) -> list[str]:
    """``ip:port,ip:port`` or a list of such strings -> the endpoints, in order."""
    items = value if isinstance(value, list) else [value]
    return [e.strip() for item in items if isinstance(item, str)
            for e in item.split(",") if e.strip()]


def subset_hint(md: base_pb2.Metadata) -> list[str] | None:
    """The endpoints the gateway allows (``envoy.lb.subset_hint``), or None: any pod."""
    hint = _metadata(md, SUBSET_NAMESPACE)
    if SUBSET not in hint:
        return None
    return _endpoints(hint[SUBSET])


def served_endpoint(md: base_pb2.Metadata) -> str:
    """The endpoint that served the request, as the gateway reports it in the response
    phase (``envoy.lb`` / ``x-gateway-destination-endpoint-served``); "" when not reported."""
    got = _endpoints(_metadata(md, LB_NAMESPACE).get(SERVED, ""))
    return got[0] if got else ""


def destination(primary: str, fallback: Sequence[str]) -> tuple[ep.CommonResponse,
                                                                 struct_pb2.Struct]:
    """The common response setting the destination header (route cache cleared), and the
    dynamic metadata carrying the same value (and the fallbacks) under ``envoy.lb``."""
    common = ep.CommonResponse(clear_route_cache=True)
    common.header_mutation.set_headers.append(base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DESTINATION, raw_value=primary.encode()),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD))
    meta = struct_pb2.Struct()
    lb = {DESTINATION: primary}
    if fallback:
        lb[FALLBACK] = ",".join(fallback)
    meta.update({LB_NAMESPACE: lb})
    return common, meta


_STATUS = {400: "BadRequest", 404: "NotFound", 413: "PayloadTooLarge", 429: "TooManyRequests",
           500: "InternalServerError", 503: "ServiceUnavailable"}


def immediate(exc: ApiError) -> ep.ProcessingResponse:
    """An ImmediateResponse answering the client with ``exc`` (OpenAI's error JSON)."""
    code = http_status_pb2.StatusCode.Value(_STATUS.get(exc.status, "InternalServerError"))
    resp = ep.ImmediateResponse(status=http_status_pb2.HttpStatus(code=code),
                                body=json.dumps(exc.body()).encode(), details=exc.message[:200])
    for k, v in {"content-type": "application/json", **exc.headers}.items():
        resp.headers.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k.lower(), raw_value=str(v).encode())))
    return ep.ProcessingResponse(immediate_response=resp)


class UsageReader:
    """The ``usage`` of a response body read in chunks: one JSON document, or server-sent
    events whose last ``data:`` object with a usage carries it (``stream_options``)."""

    def __init__(self, content_type: str) -> None:
        self.events = content_type.startswith("text/event-stream")
        self._buf = bytearray()
        self.usage: dict[str, Any] | None = None
        self.overflow = False

    def feed(self, chunk: bytes, end: bool) -> None:
        self._buf += chunk
        if self.events:
            *lines, rest = self._buf.split(b"\n")
            self._buf = bytearray(rest if not end else b"")
            if end and rest:
                lines.append(rest)
            for line in lines:
                if line.startswith(b"data:") and b'"usage"' in line:
                    self._take(line[5:])
        elif len(self._buf) > MAX_USAGE_BYTES:
            self.overflow, self._buf = True, bytearray()
        elif end and not self.overflow:
            self._take(bytes(self._buf))
        if len(self._buf) > MAX_USAGE_BYTES:  # one event line without an end
            self._buf = bytearray()

    def _take(self, raw: bytes) -> None:
        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError):
            return  # not JSON (an engine's error page): nothing to count
        usage = doc.get("usage") if isinstance(doc, dict) else None
        if isinstance(usage, dict):
            self.usage = usage

    def tokens(self) -> tuple[int, int]:
        """(prompt tokens, cached prompt tokens) the usage reports; zeros if none."""
        u = self.usage or {}
        details = u.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        prompt = u.get("prompt_tokens")
        return (prompt if _count(prompt) else 0, cached if _count(cached) else 0)


def _count(v: Any) -> bool:
    """A token count a response may claim: an int, not absurd (a hostile engine's usage
    must not overflow the counters)."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 40
