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

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import grpc

from kvroute.core.config import EppConfig
from kvroute.core.grpc_util import (
    add_standard_services,
    bind,
    new_server,
    serve_until_signalled,
    set_serving,
)
from kvroute.envoy_api.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from kvroute.envoy_api.envoy.service.ext_proc.v3 import (
    external_processor_pb2 as ep,
)
from kvroute.envoy_api.envoy.service.ext_proc.v3 import (
    external_processor_pb2_grpc as ep_grpc,
)
from kvroute.router.api_error import ApiError, refusal_error
from kvroute.router.app import RouterApp
from kvroute.router.decide import Decision
from kvroute.router.epp_protocol import (
    UsageReader,
    destination,
    header_map,
    immediate,
    served_endpoint,
    subset_hint,
)
from kvroute.router.http_body import decode_body
from kvroute.router.http_front import HttpFront
from kvroute.router.lifecycle import Stay
from kvroute.router.refusal import RefusedError, UnavailableError
from kvroute.router.registry import WorkerInfo
from kvroute.router.server import RouterService

log = logging.getLogger("kvroute.router.epp")

SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
# The health services the protocol names (gRPC health checking), besides "".
HEALTH_SERVICES = (SERVICE, "liveness", "readiness")
API = "epp"  # the api label of the router's request metrics
RPC = "Process"
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
_MODE = processing_mode_pb2.ProcessingMode


def engine_endpoint(info: WorkerInfo, target_port: int) -> str:
    """Where the gateway sends a worker's requests: the engine endpoint its heartbeat carries,
    else its agent's host (the pod IP, the agent runs beside the engine) at ``target_port``."""
    hb = info.heartbeat
    if hb is not None and hb.engine_endpoint:
        return hb.engine_endpoint
    host = info.address.rsplit(":", 1)[0]  # "[v6]:port" keeps its brackets
    return f"{host}:{target_port}"


def _refusal(exc: RefusedError, prompt_param: str) -> ApiError:
    """The OpenAI front's error for ``exc``; no ready pod said so."""
    err = refusal_error(exc, prompt_param)
    if isinstance(exc, UnavailableError):
        err.message = f"no ready endpoint: {exc.message}"
    return err


# -- one request's exchange --------------------------------------------------------------------

@dataclass
class _Routed:
    """A request sent to ``endpoint``: its stay on the worker behind it (router/lifecycle.py),
    undone as the response goes."""

    stay: Stay
    endpoint: str
    t0: float = 0.0  # when the request's body was complete (perf_counter)
    status_ok: bool = True  # the upstream answered 2xx


@dataclass
class _Exchange:
    """One ``Process`` stream: its modes, the request read so far, where it went."""

    # FULL_DUPLEX_STREAMED (what the protocol requires) unless the first message's
    # protocol_config says otherwise (recent Envoy versions send one; older ones none).
    duplex: bool = True
    resp_duplex: bool = True
    body: bytearray = field(default_factory=bytearray)
    headers: dict[str, str] = field(default_factory=dict)
    subset: list[str] | None = None  # the gateway's subset hint; None: any pod
    routed: _Routed | None = None
    usage: UsageReader | None = None
    done: bool = False  # answered with an immediate response: the stream ends

    def end(self, exc: ApiError) -> list[ep.ProcessingResponse]:
        """Answer the client with ``exc`` now; the stream ends."""
        self.done = True
        return [immediate(exc)]


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
        ex = _Exchange()
        try:
            async for msg in request_iterator:
                for resp in await self._handle(ex, msg):
                    yield resp
                if ex.done:
                    return
        finally:
            # However the stream ended (the client gone, the gateway's timeout), the load
            # and the predictions this request added are undone.
            routed = ex.routed
            if routed is not None and not routed.stay.ended:
                self._first_token(routed, ok=routed.stay.started)
                self._finish(routed, "cancelled")

    async def _handle(self, ex: _Exchange, msg: ep.ProcessingRequest
                      ) -> list[ep.ProcessingResponse]:
        """The answers to one message of the stream (``ex.done`` after an immediate one)."""
        if msg.HasField("protocol_config"):
            mode = msg.protocol_config.request_body_mode
            if mode not in (_MODE.FULL_DUPLEX_STREAMED, _MODE.BUFFERED):
                return ex.end(ApiError(500, "kvroute epp needs the gateway's request_body_mode "
                                       "FULL_DUPLEX_STREAMED (or BUFFERED), not "
                                       f"{_MODE.BodySendMode.Name(mode)}"))
            ex.duplex = mode == _MODE.FULL_DUPLEX_STREAMED
            ex.resp_duplex = (msg.protocol_config.response_body_mode
                              == _MODE.FULL_DUPLEX_STREAMED)
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(ex, msg)
        if kind == "request_body":
            return await self._request_body(ex, msg.request_body)
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            return self._response_headers(ex, msg)
        if kind == "response_body":
            return self._response_body(ex, msg.response_body)
        if kind == "response_trailers":
            if ex.routed is not None:
                self._end(ex.routed, ex.usage)
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    def _request_headers(self, ex: _Exchange, msg: ep.ProcessingRequest
                         ) -> list[ep.ProcessingResponse]:
        ex.headers = header_map(msg.request_headers)
        ex.subset = subset_hint(msg.metadata_context)
        if msg.request_headers.end_of_stream:
            # No body (GET /v1/models): any ready pod, the least busy.
            picked = self._any_pod(ex.subset)
            if isinstance(picked, ApiError):
                return ex.end(picked)
            common, meta = destination(picked, ())
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                          dynamic_metadata=meta)]
        return [] if ex.duplex else [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]

    async def _request_body(self, ex: _Exchange, chunk: ep.HttpBody
                            ) -> list[ep.ProcessingResponse]:
        """A body chunk; at the last, the decision: the destination, and the body sent back
        (FULL_DUPLEX_STREAMED: the gateway forwards only what the picker sends)."""
        ex.body += chunk.body
        limit = self._cfg.http.max_body_bytes
        if len(ex.body) > limit:
            self._service.invalid(RPC, API)
            return ex.end(ApiError(413, f"the request body exceeds {limit} bytes "
                                   "(--http-max-body-bytes)"))
        if not chunk.end_of_stream:
            return [] if ex.duplex else [ep.ProcessingResponse(request_body=ep.BodyResponse())]
        out = await self._pick(ex.headers, bytes(ex.body), ex.subset)
        if isinstance(out, ApiError):
            return ex.end(out)
        ex.routed, fallback = out
        common, meta = destination(ex.routed.endpoint, fallback)
        body, ex.body = bytes(ex.body), bytearray()
        if not ex.duplex:  # BUFFERED: the headers wait for this answer, mutations apply
            return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common),
                                          dynamic_metadata=meta)]
        echo = ep.CommonResponse()
        echo.body_mutation.streamed_response.body = body
        echo.body_mutation.streamed_response.end_of_stream = True
        return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                      dynamic_metadata=meta),
                ep.ProcessingResponse(request_body=ep.BodyResponse(response=echo))]

    def _response_headers(self, ex: _Exchange, msg: ep.ProcessingRequest
                          ) -> list[ep.ProcessingResponse]:
        got = header_map(msg.response_headers)
        ex.usage = UsageReader(got.get("content-type", ""))
        routed = ex.routed
        if routed is not None:
            self._served(routed, served_endpoint(msg.metadata_context))
            routed.status_ok = got.get(":status", "200")[:1] == "2"
            if msg.response_headers.end_of_stream:
                self._end(routed, ex.usage)
        return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]

    def _response_body(self, ex: _Exchange, chunk: ep.HttpBody
                       ) -> list[ep.ProcessingResponse]:
        """A response chunk, read for accounting: the first bytes stand for the first token
        (an engine sends its headers before it; a whole response's end), the last for the
        end; the usage is read on the way."""
        routed, usage = ex.routed, ex.usage
        if routed is not None and not routed.stay.started:
            self._first_token(routed, ok=routed.status_ok)
            if usage is not None and usage.events and routed.status_ok:
                self._app.metrics.ttft.observe(time.perf_counter() - routed.t0)
        if usage is not None:
            usage.feed(chunk.body, chunk.end_of_stream)
        if chunk.end_of_stream and routed is not None:
            self._end(routed, usage)
        if not ex.resp_duplex:
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        echo = ep.CommonResponse()
        echo.body_mutation.streamed_response.body = chunk.body
        echo.body_mutation.streamed_response.end_of_stream = chunk.end_of_stream
        return [ep.ProcessingResponse(response_body=ep.BodyResponse(response=echo))]

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
        """(worker, endpoint) best first, of the workers still live (and in ``subset``):
        the choice and its fallbacks, no more (a ranking sorts only as far as it is
        read)."""
        allowed = set(subset) if subset is not None else None
        out: list[tuple[str, str]] = []
        for s in d.ranked:
            info = self._app.registry.get(s.worker)
            if info is None or s.worker not in self._app.registry.loads:
                continue
            e = engine_endpoint(info, self._cfg.epp.target_port)
            if allowed is None or e in allowed:
                out.append((s.worker, e))
                if len(out) > self._cfg.epp.fallbacks:
                    break
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
