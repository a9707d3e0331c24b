"""``kvroute epp``: kvroute's decision as the Endpoint Picker (EPP) of a Gateway API Inference
Extension ``InferencePool``, over Envoy's ``ext_proc`` gRPC protocol (docs/gateway.md).

The gateway carries the bytes; the EPP only chooses the pod. For each HTTP request the
gateway opens one ``ExternalProcessor.Process`` stream and sends, in order: the request
headers, the body in chunks up to ``end_of_stream``, then (once the upstream answers) the
response headers and body. The EPP reads the whole request body, parses and tokenizes it as
the HTTP front does (router/http_front.py), decides with the router's own path
(``RouterService.decide_request``: the same decider, index mirror, registry and metrics, and
the same coalescing and predictions as ``generate``), and answers with

* the request headers response: ``x-gateway-destination-endpoint: <pod ip>:<engine port>``
  set (and the route cache cleared, so the gateway routes on it), the same value in the
  dynamic metadata ``envoy.lb``, and ``x-gateway-destination-endpoint-fallback`` there too:
  the next-best pods, comma-separated, for the gateway's retries;
* the request body response: the body as it came (``streamed_response`` in the
  FULL_DUPLEX_STREAMED mode the protocol requires; the gateway forwards only what the EPP
  sends back), or a plain continue in BUFFERED mode.

Refusals are ``ImmediateResponse`` with the status the protocol and the HTTP front give: 400
for a malformed body (OpenAI's error JSON as the body), 404 for a model this pool does not
serve, 413 past ``--http-max-body-bytes``, 503 when no pod is ready (or none of a
``envoy.lb.subset_hint`` subset). The response phase is read for accounting: the
response's first body bytes stand for the first token (the load the decision added becomes
decode load, the prediction's siblings stop waiting; an engine sends its headers before
its first token) and the end of the body for the request's end;
``usage`` in the response (JSON or server-sent events) counts prompt and cached tokens.

Protocol as published by kubernetes-sigs/gateway-api-inference-extension,
docs/proposals/004-endpoint-picker-protocol (v1.0.0 of the protocol; checked against the
repository at v1.6.0), and Envoy's ext_proc v3 API (the vendored protos, proto/envoy_api).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc
from google.protobuf import struct_pb2
from google.protobuf.json_format import MessageToDict

from kvroute.core.config import EppConfig
from kvroute.core.grpc_util import (
    add_standard_services,
    bind,
    new_server,
    serve_until_signalled,
    set_serving,
)
from kvroute.envoy_api.envoy.config.core.v3 import base_pb2
from kvroute.envoy_api.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from kvroute.envoy_api.envoy.service.ext_proc.v3 import (
    external_processor_pb2 as ep,
)
from kvroute.envoy_api.envoy.service.ext_proc.v3 import (
    external_processor_pb2_grpc as ep_grpc,
)
from kvroute.envoy_api.envoy.type.v3 import http_status_pb2
from kvroute.router.app import RouterApp
from kvroute.router.decide import Decision
from kvroute.router.http_body import decode_body
from kvroute.router.http_front import HttpFront
from kvroute.router.lifecycle import Stay
from kvroute.router.openai_schema import ApiError, refusal_error
from kvroute.router.refusal import RefusedError, UnavailableError
from kvroute.router.registry import WorkerInfo
from kvroute.router.server import RouterService

log = logging.getLogger("kvroute.router.epp")

SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
# The health services the protocol names (gRPC health checking), besides "".
HEALTH_SERVICES = (SERVICE, "liveness", "readiness")
DESTINATION = "x-gateway-destination-endpoint"
FALLBACK = "x-gateway-destination-endpoint-fallback"
SERVED = "x-gateway-destination-endpoint-served"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
API = "epp"  # the api label of the router's request metrics
RPC = "Process"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MAX_USAGE_BYTES = 4 << 20  # a non-streamed response read for its usage; past it, not counted
_MODE = processing_mode_pb2.ProcessingMode


# -- the protocol's pieces, as plain functions (tests/router/test_epp.py) ----------------------

def engine_endpoint(info: WorkerInfo, target_port: int) -> str:
    """Where the gateway sends a worker's requests: the engine endpoint its heartbeat carries,
    else its agent's host (the pod IP, the agent runs beside the engine) at ``target_port``."""
    hb = info.heartbeat
    if hb is not None and hb.engine_endpoint:
        return hb.engine_endpoint
    host = info.address.rsplit(":", 1)[0]  # "[v6]:port" keeps its brackets
    return f"{host}:{target_port}"


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


def _refusal(exc: RefusedError, prompt_param: str) -> ApiError:
    """The OpenAI front's error for ``exc``; no ready pod said so."""
    err = refusal_error(exc, prompt_param)
    if isinstance(exc, UnavailableError):
        err.message = f"no ready endpoint: {exc.message}"
    return err


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


# -- one request's exchange --------------------------------------------------------------------

@dataclass
class _Routed:
    """A request sent to ``endpoint``: its stay on the worker behind it (router/lifecycle.py),
    undone as the response goes."""

    stay: Stay
    endpoint: str
    t0: float = 0.0  # when the request's body was complete (perf_counter)
    status_ok: bool = True  # the upstream answered 2xx


class EndpointPicker(ep_grpc.ExternalProcessorServicer):
    """The ext_proc server: one ``Process`` stream per HTTP request."""

    def __init__(self, cfg: EppConfig, app: RouterApp, service: RouterService,
                 front: HttpFront) -> None:
        self._cfg = cfg
        self._app = app
        self._service = service
        self._front = front

    async def Process(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[ep.ProcessingRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[ep.ProcessingResponse]:
        # FULL_DUPLEX_STREAMED (what the protocol requires) unless the first message's
        # protocol_config says otherwise (recent Envoy versions send one; older ones none).
        duplex = resp_duplex = True
        body = bytearray()
        headers: dict[str, str] = {}
        subset: list[str] | None = None
        routed: _Routed | None = None
        usage: UsageReader | None = None
        try:
            async for msg in request_iterator:
                kind = msg.WhichOneof("request")
                if msg.HasField("protocol_config"):
                    mode = msg.protocol_config.request_body_mode
                    if mode not in (_MODE.FULL_DUPLEX_STREAMED, _MODE.BUFFERED):
                        yield immediate(ApiError(500, "kvroute epp needs the gateway's "
                                                 "request_body_mode FULL_DUPLEX_STREAMED (or "
                                                 f"BUFFERED), not {_MODE.BodySendMode.Name(mode)}"))
                        return
                    duplex = mode == _MODE.FULL_DUPLEX_STREAMED
                    resp_duplex = (msg.protocol_config.response_body_mode
                                   == _MODE.FULL_DUPLEX_STREAMED)
                if kind == "request_headers":
                    headers = header_map(msg.request_headers)
                    subset = subset_hint(msg.metadata_context)
                    if msg.request_headers.end_of_stream:
                        # No body (GET /v1/models): any ready pod, the least busy.
                        picked = self._any_pod(subset)
                        if isinstance(picked, ApiError):
                            yield immediate(picked)
                            return
                        common, meta = destination(picked, ())
                        yield ep.ProcessingResponse(
                            request_headers=ep.HeadersResponse(response=common),
                            dynamic_metadata=meta)
                    elif not duplex:
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif kind == "request_body":
                    chunk = msg.request_body
                    body += chunk.body
                    if len(body) > self._cfg.http.max_body_bytes:
                        self._service.invalid(RPC, API)
                        yield immediate(ApiError(413, f"the request body exceeds "
                                                 f"{self._cfg.http.max_body_bytes} bytes "
                                                 "(--http-max-body-bytes)"))
                        return
                    if not chunk.end_of_stream:
                        if not duplex:
                            yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                        continue
                    out = await self._pick(headers, bytes(body), subset)
                    if isinstance(out, ApiError):
                        yield immediate(out)
                        return
                    routed, fallback = out
                    common, meta = destination(routed.endpoint, fallback)
                    if duplex:
                        yield ep.ProcessingResponse(
                            request_headers=ep.HeadersResponse(response=common),
                            dynamic_metadata=meta)
                        echo = ep.CommonResponse()
                        echo.body_mutation.streamed_response.body = bytes(body)
                        echo.body_mutation.streamed_response.end_of_stream = True
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=echo))
                    else:  # BUFFERED: the headers wait for this answer, mutations apply
                        yield ep.ProcessingResponse(request_body=ep.BodyResponse(
                            response=common), dynamic_metadata=meta)
                    body = bytearray()
                elif kind == "request_trailers":
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind == "response_headers":
                    got = header_map(msg.response_headers)
                    usage = UsageReader(got.get("content-type", ""))
                    if routed is not None:
                        self._served(routed, served_endpoint(msg.metadata_context))
                        routed.status_ok = got.get(":status", "200")[:1] == "2"
                        if msg.response_headers.end_of_stream:
                            self._end(routed, usage)
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                elif kind == "response_body":
                    chunk = msg.response_body
                    if routed is not None and not routed.stay.started:
                        # The first bytes: a streamed response's first token (an engine
                        # sends its headers before it), a whole response's end.
                        self._first_token(routed, ok=routed.status_ok)
                        if usage is not None and usage.events and routed.status_ok:
                            self._app.metrics.ttft.observe(time.perf_counter() - routed.t0)
                    if usage is not None:
                        usage.feed(chunk.body, chunk.end_of_stream)
                    if chunk.end_of_stream and routed is not None:
                        self._end(routed, usage)
                    if resp_duplex:
                        echo = ep.CommonResponse()
                        echo.body_mutation.streamed_response.body = chunk.body
                        echo.body_mutation.streamed_response.end_of_stream = chunk.end_of_stream
                        yield ep.ProcessingResponse(response_body=ep.BodyResponse(response=echo))
                    else:
                        yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif kind == "response_trailers":
                    if routed is not None:
                        self._end(routed, usage)
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        finally:
            # However the stream ended (the client gone, the gateway's timeout), the load
            # and the predictions this request added are undone.
            if routed is not None and not routed.stay.ended:
                self._first_token(routed, ok=routed.stay.started)
                self._finish(routed, "cancelled")

    # -- deciding --------------------------------------------------------------------------

    async def _pick(self, headers: Mapping[str, str], raw: bytes, subset: list[str] | None
                    ) -> tuple[_Routed, list[str]] | ApiError:
        t0 = time.perf_counter()
        path = headers.get(":path", CHAT_PATH).split("?", 1)[0]
        completions = path.endswith(COMPLETIONS_PATH) and not path.endswith(CHAT_PATH)
        try:
            body = decode_body(raw)
            if completions:
                _, jobs = await self._front.completion_jobs(body)
            else:
                _, jobs = await self._front.chat_jobs(body, len(raw))
        except ApiError as exc:
            if 400 <= exc.status < 500:
                self._service.invalid(RPC, API)
            return exc
        # A completions body with several prompts goes to one pod (the gateway sends it
        # whole): its first prompt decides.
        request = jobs[0].request
        try:
            _, d = self._service.decide_request(request, api=API, rpc=RPC, t0=t0)
        except RefusedError as exc:
            return _refusal(exc, "prompt" if completions else "messages")
        rid = request.request_id or uuid.uuid4().hex
        app = self._app
        predicting = (self._cfg.policy.predict_ttl_s > 0 and app.mirror.available and bool(d.keys))
        if predicting:
            d, _ = await self._service.coalesce(d, rid, API)
        chosen = self._ranked(d, subset)
        if not chosen:
            self._app.metrics.requests.labels(API, RPC, "unavailable").inc()
            return ApiError(503, "no ready endpoint in the gateway's subset"
                            if subset is not None else "no ready endpoint",
                            headers={"Retry-After": "1"})
        (w, endpoint), rest = chosen[0], chosen[1:]
        stay = self._service.lifecycle.begin(rid, w, *d.prefill(w), d.keys, predict=predicting)
        routed = _Routed(stay, endpoint, t0=t0)
        app.metrics.routed.labels(w).inc()
        log.debug("picked", extra={"kv": {"request": rid, "worker": w, "endpoint": endpoint,
                                          "cached_tokens": d.cached_tokens(w)}})
        return routed, [e for _, e in rest[: self._cfg.epp.fallbacks]]

    def _ranked(self, d: Decision, subset: Iterable[str] | None) -> list[tuple[str, str]]:
        """(worker, endpoint) best first, of the workers still live (and in ``subset``)."""
        allowed = set(subset) if subset is not None else None
        out = []
        for s in d.ranked:
            info = self._app.registry.get(s.worker)
            if info is None or s.worker not in self._app.registry.loads:
                continue
            e = engine_endpoint(info, self._cfg.epp.target_port)
            if allowed is None or e in allowed:
                out.append((s.worker, e))
        return out

    def _any_pod(self, subset: Iterable[str] | None) -> str | ApiError:
        reg = self._app.registry
        reg.revive_due()
        allowed = set(subset) if subset is not None else None
        pods = sorted((ld.inflight, w) for w, ld in reg.loads.items())
        for _, w in pods:
            info = reg.get(w)
            if info is None:
                continue
            e = engine_endpoint(info, self._cfg.epp.target_port)
            if allowed is None or e in allowed:
                return e
        self._app.metrics.requests.labels(API, RPC, "unavailable").inc()
        return ApiError(503, "no ready endpoint", headers={"Retry-After": "1"})

    # -- the response phase: accounting ------------------------------------------------------

    def _served(self, r: _Routed, served: str) -> None:
        """The gateway fell back to another endpoint: move the request's load there."""
        if not served or served == r.endpoint:
            return
        for info in self._app.registry.all():
            if engine_endpoint(info, self._cfg.epp.target_port) == served:
                self._service.lifecycle.move(r.stay, info.worker_id)
                r.endpoint = served
                return

    def _first_token(self, r: _Routed, ok: bool) -> None:
        if r.stay.started:
            return
        life = self._service.lifecycle
        life.first_token(r.stay)
        if not ok:
            life.withdraw(r.stay)  # an error response stored nothing

    def _end(self, r: _Routed, usage: UsageReader | None) -> None:
        if r.stay.ended:
            return
        self._first_token(r, ok=True)
        if usage is not None:
            prompt, cached = usage.tokens()
            self._app.metrics.prompt_tokens.inc(prompt)
            self._app.metrics.cached_tokens.inc(cached)
        self._finish(r, "ok" if r.status_ok else "upstream_error")

    def _finish(self, r: _Routed, outcome: str) -> None:
        life = self._service.lifecycle
        if outcome != "ok" and not r.stay.started:
            life.withdraw(r.stay)
        life.end(r.stay)
        self._app.metrics.requests.labels(API, RPC, outcome).inc()


class EppApp:
    """A router (mirror, registry, discovery, decider, metrics, and kvroute.v1.Router on
    ``--port``) with the ext_proc server on ``--epp-port``."""

    def __init__(self, cfg: EppConfig) -> None:
        self.cfg = cfg
        self.router = RouterApp(cfg)
        self.epp_port = 0
        self._server: grpc.aio.Server | None = None
        self._health: Any = None

    async def start(self, *, wait_for_redis_s: float = 0.0) -> int:
        # The router's TLS settings (--tls-cert/--tls-key) serve ext_proc too: gateways
        # commonly call their endpoint picker over TLS.
        tls = self.router.tls
        server = new_server(tls)
        self.epp_port = bind(server, self.cfg.listen.host, self.cfg.epp.port, "epp_port", tls=tls)
        await self.router.start(wait_for_redis_s=wait_for_redis_s)
        service = self.router.service
        assert service is not None
        # The router's own config (--model NAME=SOURCE made it the bare name) and tokenizer;
        # the pods' engines read their tool calls, not the picker.
        front = HttpFront(self.router.cfg.replace(http_tool_parser="none"),
                          self.router.pools[0].model.tokenizer)
        picker = EndpointPicker(self.cfg, self.router, service, front)
        ep_grpc.add_ExternalProcessorServicer_to_server(picker, server)
        self._health = add_standard_services(server, HEALTH_SERVICES,
                                             self.cfg.listen.grpc_reflection)
        await server.start()
        self._server = server
        await set_serving(self._health, HEALTH_SERVICES, True)
        log.info("endpoint picker serving", extra={"kv": {
            "epp_port": self.epp_port, "router_port": self.router.port,
            "target_port": self.cfg.epp.target_port, "model": self.router.cfg.model.name}})
        return self.epp_port

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._health is not None:
            await set_serving(self._health, HEALTH_SERVICES, False)
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.router.stop(grace_s)


async def run_epp(cfg: EppConfig) -> None:
    app = EppApp(cfg)
    await serve_until_signalled(partial(app.start, wait_for_redis_s=3.0), app.stop)
