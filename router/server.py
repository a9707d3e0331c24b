"""The router's gRPC server: validate, decide, forward to the agent, stream back."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import RouterConfig
from kvroute.core.grpc_util import (
    add_handlers,
    add_standard_services,
    bind,
    install_signal_handlers,
    new_server,
    set_serving,
    start_metrics,
    wire_keeping_handler,
)
from kvroute.core.model_source import parse_model_option
from kvroute.core.native import native_builds
from kvroute.core.placement import (
    ForkSegment,
    Overflow,
    fork_segment,
    place_fork,
    program_fanout,
    program_prefill_tokens,
)
from kvroute.core.policies import make_policy
from kvroute.core.redis_conn import connect_config, redact_url
from kvroute.core.redis_schema import RedisKeys
from kvroute.core.tokenizer import Tokenizer, make_tokenizer
from kvroute.core.validate import (
    InvalidRequestError,
    Limits,
    check_names,
    check_sampling,
    check_tokens,
)
from kvroute.core.wire import request_token_ids, with_string_field
from kvroute.router.coalesce import InflightPrefixes, predict_sent
from kvroute.router.copies import PrefixCopier
from kvroute.router.decide import Decider, Decision, NoWorkersError, rerank_confirmed
from kvroute.router.discovery import DiscoveryCollector, make_discovery
from kvroute.router.metrics import RouterMetrics
from kvroute.router.mirror import IndexMirror
from kvroute.router.openai_api import OpenAIFront
from kvroute.router.refusal import RefusedError
from kvroute.router.registry import Vocabulary, WorkerRegistry, parse_static
from kvroute.v1 import common_pb2, router_pb2, router_pb2_grpc

log = logging.getLogger("kvroute.router")

SERVICE = router_pb2.DESCRIPTOR.services_by_name["Router"].full_name
_DOWN_S = 2.0  # how long a worker that refused a request is skipped
_MAX_ATTEMPTS = 2  # the chosen worker, then the next-best once


def add_router_service(service: RouterService, server: grpc.aio.Server) -> None:
    """Serve ``service`` as kvroute.v1.Router, each request keeping its wire bytes."""
    add_handlers(server, router_pb2.DESCRIPTOR.services_by_name["Router"], {
        "Route": wire_keeping_handler(
            service.Route, router_pb2.RouteResponse.SerializeToString, stream=False,
            on_invalid=lambda: service.invalid("Route")),
        "Generate": wire_keeping_handler(
            service.Generate, common_pb2.GenerateResponse.SerializeToString, stream=True,
            on_invalid=lambda: service.invalid("Generate")),
    })


class RouterService(router_pb2_grpc.RouterServicer):
    def __init__(self, cfg: RouterConfig, decider: Decider, mirror: IndexMirror,
                 registry: WorkerRegistry, channels: AgentChannels, metrics: RouterMetrics,
                 tokenizer: Tokenizer | None) -> None:
        self._cfg = cfg
        self._decider = decider
        self._mirror = mirror
        self._registry = registry
        self._channels = channels
        self._m = metrics
        self._tok = tokenizer
        self._limits = Limits(cfg.vocab_size, cfg.max_prompt_tokens, cfg.max_new_tokens)
        # Requests sent on with predicted entries whose first token has not come back.
        self._inflight: InflightPrefixes[asyncio.Event] = InflightPrefixes(cfg.coalesce_share)
        # The policy's background copies of hot prefixes (kvroute's replicate), if it makes any.
        self.copier = PrefixCopier(getattr(decider.policy, "replica", None), registry,
                                   channels, mirror, self._inflight, self._release, metrics,
                                   decider.block_size, cfg.predict_ttl_s, cfg.max_copies)

    def invalid(self, method: str, api: str = "grpc") -> None:
        """Count a request refused as INVALID_ARGUMENT before it reached ``method``."""
        self._m.requests.labels(api, method, "invalid").inc()

    # -- shared front half -------------------------------------------------------------------

    def _prompt(self, req: common_pb2.GenerateRequest, wire: bytes | None) -> Sequence[int]:
        check_names(req, self._cfg.model)
        if req.token_ids and req.text:
            raise InvalidRequestError("text", "give token_ids or text, not both")
        if req.text:
            if self._tok is None:
                raise InvalidRequestError("text", "this router has no tokenizer configured "
                                             "(--tokenizer); send token_ids")
            tokens: Sequence[int] = self._tok.encode(req.text)
            check_tokens(tokens, self._limits, "text")
            return tokens
        tokens, top = request_token_ids(req, wire)
        check_tokens(tokens, self._limits, top=top)
        return tokens

    def _decide(self, tokens: Sequence[int], req: common_pb2.GenerateRequest,
                t0: float) -> Decision:
        """``t0``: when the request's prompt began to be read (``_prompt``): the decision's
        latency includes reading its ids, which at 8k tokens once cost more than the rest."""
        self._registry.revive_due()
        if not self._registry.loads:
            raise NoWorkersError(self._registry.unroutable())  # each worker, and why not
        index = self._mirror.index if self._mirror.available else None
        d = self._decider.decide(tokens, index, self._registry, salt=req.cache_salt,
                                 session_id=req.session_id)
        self._m.decision_seconds.observe(time.perf_counter() - t0)
        return d

    # -- RPCs ------------------------------------------------------------------------------

    async def Route(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
        wire: bytes | None = None,
    ) -> router_pb2.RouteResponse:
        """``wire``: the bytes ``request`` was parsed from (:func:`add_router_service`)."""
        try:
            t0 = time.perf_counter()
            tokens = self._prompt(request, wire)
            d = self._decide(tokens, request, t0)
        except InvalidRequestError as exc:
            self.invalid("Route")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoWorkersError as exc:
            self._m.requests.labels("grpc", "Route", "unavailable").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._m.requests.labels("grpc", "Route", "ok").inc()
        resp = router_pb2.RouteResponse(
            request_id=request.request_id or uuid.uuid4().hex, worker_id=d.best,
            cached_tokens=d.cached_tokens(d.best), prompt_tokens=len(tokens),
            policy=self._decider.policy.name, degraded=not self._mirror.available,
        )
        most = self._cfg.route_candidates
        add, matched = resp.candidates.add, d.query.matched_blocks
        for s in d.ranked[:most] if most else d.ranked:
            # add() then field sets: half the cost of add(**fields) in upb, and at 128
            # workers this list costs more than the decision.
            c = add()
            c.worker_id = s.worker
            c.cost = s.cost
            info = self._registry.get(s.worker)
            if info is not None:
                c.address = info.address
            if s.worker in matched:
                c.cached_tokens = d.cached_tokens(s.worker)
        resp.address = resp.candidates[0].address
        if request.HasField("program") and self._cfg.program_overflow:
            seg = fork_segment(request.program)
            if seg is not None:
                fwd = common_pb2.GenerateRequest()
                self._place(fwd, seg, seg.weights(), d.best, d)
                resp.placement.CopyFrom(fwd.placement)
        return resp

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
        wire: bytes | None = None,
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """``wire``: the bytes ``request`` was parsed from (:func:`add_router_service`)."""
        try:
            # aclosing: a cancelled call ends generate() here and now (its finally blocks
            # cancel the agent call and release the worker's load), not when collected.
            async with contextlib.aclosing(self.generate(request, wire)) as responses:
                async for resp in responses:
                    yield resp
        except RefusedError as exc:
            await context.abort(exc.code, exc.message)

    async def generate(
        self, request: common_pb2.GenerateRequest, wire: bytes | None = None,
        api: str = "grpc",
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The one generation path every API takes: validate, decide (coalescing, copies),
        send to the best worker, retry the next-best once if it fails before its first
        token, stream its responses. Raises :class:`RefusedError` for what it does not serve;
        closing the iterator early (a client gone) cancels the agent call. ``api`` labels
        the request metrics (grpc, http)."""
        t0 = time.perf_counter()
        try:
            tokens = self._prompt(request, wire)
            check_sampling(request, self._limits)
            d = self._decide(tokens, request, t0)
        except InvalidRequestError as exc:
            self.invalid("Generate", api)
            raise RefusedError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), exc.field) from None
        except NoWorkersError as exc:
            self._m.requests.labels(api, "Generate", "unavailable").inc()
            raise RefusedError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None

        rid = request.request_id or uuid.uuid4().hex
        # A plain request goes on as the bytes it came in, with the router's request id
        # appended when it had none: serializing an 8k-token prompt again costs ~0.2 ms (32k:
        # ~0.8 ms). A text prompt, a program or a client's placement is rewritten instead.
        payload = None
        if wire is not None and not request.text and not request.HasField("program") \
                and not request.HasField("placement"):
            payload = wire if request.request_id else with_string_field(wire, "request_id", rid)
        relay = payload is not None
        fwd = common_pb2.GenerateRequest()
        if not relay:
            fwd.CopyFrom(request)
            fwd.request_id = rid
            if request.text:
                fwd.ClearField("text")
                fwd.token_ids.extend(tokens)
        decode_text = bool(request.text) and self._tok is not None
        errors: list[str] = []
        # A program's branches run on the chosen worker (they weigh on its load as that many
        # sequences until it finishes), except fork children it has no room for.
        program = request.program if request.HasField("program") else None
        fanout = program_fanout(program) if program is not None else 1
        # Its fast-forwards are prefill work too, pending until the program ends.
        extra = program_prefill_tokens(program) if program is not None else 0
        seg = fork_segment(program) if program is not None and self._cfg.program_overflow \
            else None
        weights = seg.weights() if seg is not None else []
        predicting = self._cfg.predict_ttl_s > 0 and self._mirror.available and bool(d.keys)
        waited = False
        if predicting:
            d, waited = await self._coalesce(d, rid, api)
        if program is None:
            self.copier.maybe_copy(d, tokens, request, rid)
        sent = 0
        for cand in d.ranked[:_MAX_ATTEMPTS]:
            w = cand.worker
            info = self._registry.get(w)
            if info is None or (waited and w not in self._registry.loads):
                continue  # gone, or marked down while this request waited (its producer's)
            if sent:
                self._m.retries.inc()  # a worker skipped above is not a retry
            sent += 1
            overflow = () if relay else self._place(fwd, seg, weights, w, d)
            self._m.overflow.inc(sum(len(o.children) for o in overflow))
            if overflow:
                log.info("program fork split across workers", extra={"kv": {
                    "request": rid, "worker": w,
                    "overflow": {o.worker: list(o.children) for o in overflow}}})
            uncached, attended = d.prefill(w)
            local = max(1, fanout - sum(o.weight for o in overflow))
            self._registry.begin(w, uncached + extra, local, context=attended)
            # Overflow workers' prefill is pending until their first chunk comes back.
            away = {o.worker: d.prefill(o.worker) for o in overflow}  # tokens, context
            for o in overflow:
                n, attends = away[o.worker]
                self._registry.begin(o.worker, n, o.weight, context=attends)
            started = False
            done = False
            failure: grpc.aio.AioRpcError | None = None
            call = (self._channels.generate_wire(info.address)(payload) if payload is not None
                    else self._channels.stub(info.address).Generate(fwd))
            stored = asyncio.Event()  # set at this attempt's first token, or when it ends
            predicted = None
            if predicting:
                # Siblings arriving before this request's store events find it here, and
                # wait for its first token (see _await_producer). Added just before the
                # try whose finally releases it, so no path leaves it behind.
                # Only predicted blocks can make a sibling wait (InflightPrefixes.producer).
                predicted = predict_sent(self._mirror.index, self._inflight, stored, w,
                                         d.keys, uncached, self._cfg.predict_ttl_s)
            try:
                async for resp in call:
                    if not started:
                        started = True
                        self._release(stored)
                        self._registry.first_token(w, uncached, attended)
                        self._m.ttft.observe(time.perf_counter() - t0)
                        self._m.routed.labels(w).inc()
                        resp.ttft_ms = (time.perf_counter() - t0) * 1000
                    if away and resp.worker_id in away:
                        self._registry.first_token(resp.worker_id, *away.pop(resp.worker_id))
                    if decode_text and resp.token_ids:
                        resp.text = self._tok.decode(resp.token_ids)  # type: ignore[union-attr]
                    if resp.HasField("usage"):
                        self._m.prompt_tokens.inc(resp.usage.prompt_tokens)
                        self._m.cached_tokens.inc(resp.usage.cached_tokens)
                    yield resp
                done = True
            except grpc.aio.AioRpcError as exc:
                failure = exc
            finally:
                # Every begin() gets its end(), however the attempt ended (the client may
                # cancel or close the stream at any await or yield).
                self._release(stored)
                self._registry.first_token(w, (0 if started else uncached) + extra,
                                           0 if started else attended)
                self._registry.end(w, local)
                for o in overflow:
                    if o.worker in away:
                        self._registry.first_token(o.worker, *away.pop(o.worker))
                    self._registry.end(o.worker, o.weight)
                if not done and failure is None:
                    call.cancel()
                    self._m.requests.labels(api, "Generate", "cancelled").inc()
            if done:
                self._m.requests.labels(api, "Generate", "ok").inc()
                return
            assert failure is not None
            if predicted is not None and not started:
                # Refused or failed before its prefill: nothing will store those blocks.
                self._m.withdrawn.inc(predicted.withdraw(self._mirror.index))
            if started:
                # Tokens already reached the client: a retry would repeat them.
                self._m.requests.labels(api, "Generate", "failed_midstream").inc()
                raise RefusedError(grpc.StatusCode.UNAVAILABLE,
                                   f"worker {w} failed mid-stream: {failure.details()}",
                                   midstream=True)
            if failure.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.FAILED_PRECONDITION,  # e.g. a program
                                  grpc.StatusCode.UNIMPLEMENTED):       # the engine can't run
                self._m.requests.labels(api, "Generate", "rejected").inc()
                raise RefusedError(failure.code(), f"worker {w}: {failure.details()}")
            errors.append(f"{w}: {failure.code().name} {failure.details()}")
            log.warning("agent failed before first token; trying next-best",
                        extra={"kv": {"worker": w, "request": rid,
                                      "code": failure.code().name,
                                      "details": failure.details()}})
            self._registry.mark_down(w, _DOWN_S, f"{failure.code().name}: {failure.details()}")
        self._m.requests.labels(api, "Generate", "unavailable").inc()
        raise RefusedError(grpc.StatusCode.UNAVAILABLE,
                           "no worker could serve the request: " + "; ".join(errors))

    async def _coalesce(self, d: Decision, rid: str, api: str) -> tuple[Decision, bool]:
        """Coalescing: when the chosen worker matched the prompt's prefix only by a
        prediction, hold the request until the request that prediction stands for has its
        first token (its prefix is then stored), so it is prefilled once: an engine admits
        a queue in batches, and siblings admitted together each compute the whole prefix.
        Gives up after ``coalesce_wait_s`` and sends it anyway. When that prefill is mostly
        the other request's own (``coalesce_share``), the request is decided again on what
        workers really hold instead of waiting. Returns the decision to send by and whether
        it waited."""
        w = d.best
        index = self._mirror.index
        matched = d.query.matched_blocks.get(w, 0)
        stored = self._inflight.producer(index, w, d.keys, matched)
        if stored is None or stored.is_set():
            return d, False
        if not self._inflight.worth_waiting(stored, index, w, d.keys, matched,
                                            self._decider.block_size):
            self._m.coalesce_declined.inc()
            return rerank_confirmed(self._decider.policy, index, d, d.keys), False
        self._m.coalesced.inc()
        t0 = time.perf_counter()
        # A held request is load on its worker already (other decisions see it queued).
        uncached, attended = d.prefill(w)
        self._registry.begin(w, uncached, arrival=False, context=attended)
        try:
            await asyncio.wait_for(stored.wait(), self._cfg.coalesce_wait_s)
        except TimeoutError:
            log.warning("in-flight sibling's prefill not done; sending anyway",
                        extra={"kv": {"request": rid, "worker": w,
                                      "waited_s": self._cfg.coalesce_wait_s}})
        except asyncio.CancelledError:
            self._m.requests.labels(api, "Generate", "cancelled").inc()
            raise
        finally:
            self._registry.first_token(w, uncached, attended)
            self._registry.end(w)
            self._m.coalesce_wait.observe(time.perf_counter() - t0)
        return d, True

    def _release(self, stored: asyncio.Event) -> None:
        """This request's prefix is stored (first token) or it ended: wake its siblings."""
        if not stored.is_set():
            stored.set()
            self._inflight.drop(stored)

    def _place(self, fwd: common_pb2.GenerateRequest, seg: ForkSegment | None,
               weights: list[int], worker: str, d: Decision) -> tuple[Overflow, ...]:
        """Set ``fwd.placement`` for a program sent to ``worker``: the fork children that
        ``place_fork`` moves to other workers (none while ``worker`` has room)."""
        fwd.ClearField("placement")
        if seg is None:
            return ()
        ranked = [s for s in d.ranked if s.worker == worker]
        ranked += [s for s in d.ranked if s.worker != worker]
        overflow = tuple(o for o in place_fork(ranked, d.query, weights)
                         if self._registry.get(o.worker) is not None)
        if not overflow:
            return ()
        fwd.placement.fork_step = seg.step
        for o in overflow:
            info = self._registry.get(o.worker)
            assert info is not None
            fwd.placement.overflow.add(worker_id=o.worker, address=info.address,
                                       children=o.children)
        return overflow


class RouterApp:
    """The router: mirror + registry + gRPC server + metrics. Start, then stop."""

    def __init__(self, cfg: RouterConfig) -> None:
        try:
            static = parse_static(cfg.workers)
            policy = make_policy(cfg.policy)
            # --model NAME=SOURCE: the model's own tokenizer (and chat template) at the router.
            cfg, chat = load_model(cfg)
            self._tok: Tokenizer | None = chat if chat is not None else \
                make_tokenizer(cfg.tokenizer)
        except ValueError as exc:  # ModelSourceError, ChatTemplateError included
            raise SystemExit(str(exc)) from None
        self.cfg = cfg
        self.chat = chat
        # The ids this router speaks: workers speaking others are left out (and named).
        # A model's own tokenizer has no name agents report: its vocabulary size is compared.
        vocabulary = (Vocabulary("", chat.vocab_size) if chat is not None
                      else Vocabulary(self._tok.name, self._tok.vocab_size)
                      if self._tok is not None else Vocabulary("", cfg.vocab_size))
        self.registry = WorkerRegistry(static, cfg.block_size, vocabulary)
        self.metrics = RouterMetrics()
        self.mirror = IndexMirror(connect_config(cfg, block_timeout_s=cfg.poll_interval_s),
                                  RedisKeys(cfg.model), self.registry,
                                  poll_interval_s=cfg.poll_interval_s,
                                  retry_s=cfg.redis_retry_s)
        self.decider = Decider(cfg.model, cfg.block_size, policy)
        # --discovery kubernetes: only pods that exist and are Ready get traffic.
        self.discovery = make_discovery(cfg, self.registry)
        if self.discovery is not None:
            self.metrics.registry.register(DiscoveryCollector(self.discovery))
        self.channels = AgentChannels()
        self.port = 0
        self.http_port = 0
        self.http: OpenAIFront | None = None  # set at start, with --http-port
        self.service: RouterService | None = None  # set at start
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._mirror_task: asyncio.Task[None] | None = None
        self._metrics_http: Any = None

    async def start(self, *, wait_for_redis_s: float = 0.0) -> int:
        cfg = self.cfg
        # Ports first: a taken one ends the start before anything needs stopping.
        server = new_server()
        self.port = bind(server, cfg.host, cfg.port)
        if cfg.http_port:
            self.http = OpenAIFront(cfg, self._tok)
            self.http_port = await self.http.bind(cfg.host, cfg.http_port)
        try:
            self._metrics_http = start_metrics(cfg.metrics_port, cfg.host,
                                               self.metrics.registry)
        except BaseException:  # a taken metrics port: the HTTP one is not left listening
            if self.http is not None:
                await self.http.stop()
            raise
        self.metrics.watch(self.mirror)
        if self.decider.tail is not None:
            self.metrics.watch_tail(self.decider.tail)
        if self.discovery is not None:
            await self.discovery.start()  # closes the gate before the first heartbeat scan
        self._mirror_task = asyncio.create_task(self.mirror.run(), name="index-mirror")
        if wait_for_redis_s > 0:
            try:
                await asyncio.wait_for(self.mirror.ready.wait(), wait_for_redis_s)
            except TimeoutError:
                log.warning("redis not reachable at start; routing by load alone for now")
            if self.discovery is not None:
                try:
                    await asyncio.wait_for(self.discovery.ready.wait(), wait_for_redis_s)
                except TimeoutError:
                    log.warning("worker pods not listed yet; no traffic until they are")
        self.service = RouterService(cfg, self.decider, self.mirror, self.registry,
                                     self.channels, self.metrics, self._tok)
        add_router_service(self.service, server)
        if self.http is not None:
            self.http.serve(self.service, self.registry)
        self._health = add_standard_services(server, [SERVICE])
        await server.start()
        self._server = server
        await set_serving(self._health, [SERVICE], True)
        native = native_builds()
        log.info("router serving", extra={"kv": {
            "port": self.port, "policy": cfg.policy, "model": cfg.model,
            "block_size": cfg.block_size, "redis": redact_url(cfg.redis),
            "metrics_port": cfg.metrics_port or "off", "http_port": self.http_port or "off",
            "native": native}})
        missing = sorted(name for name, built in native.items() if not built)
        if missing:
            log.warning("C builds missing, their pure-Python paths run (same results, several "
                        "times slower per decision; install with a C compiler)",
                        extra={"kv": {"missing": missing}})
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._health is not None:
            await set_serving(self._health, [SERVICE], False)
        if self.http is not None:
            await self.http.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
        if self.service is not None:
            await self.service.copier.close()
        if self.discovery is not None:
            await self.discovery.stop()
        if self._mirror_task is not None:
            await self.mirror.stop(self._mirror_task)
        await self.channels.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        log.info("router stopped")


def load_model(cfg: RouterConfig) -> tuple[RouterConfig, ChatTokenizer | None]:
    """``cfg`` with its ``model`` the bare NAME, and the tokenizer of ``--model NAME=SOURCE``
    (None for a bare name). With a model tokenizer, token ids are checked against its
    vocabulary: ``vocab_size`` becomes the tokenizer's. ValueError names what is wrong."""
    if "=" not in cfg.model:
        return cfg, None
    name, source = parse_model_option(cfg.model)
    if cfg.tokenizer:
        raise ValueError(f"--model {cfg.model!r} names the model's tokenizer: drop "
                         f"--tokenizer {cfg.tokenizer!r}")
    chat = ChatTokenizer.load(source, name=name)
    return dataclasses.replace(cfg, model=name, vocab_size=chat.vocab_size), chat


async def run_router(cfg: RouterConfig) -> None:
    app = RouterApp(cfg)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    await app.start(wait_for_redis_s=3.0)
    await stop.wait()
    await app.stop()
