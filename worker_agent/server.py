"""The agent's gRPC server: runs requests on the engine, publishes its cache state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.core.config import AgentConfig
from kvroute.core.grpc_util import (
    REFUSED_FIELD,
    HealthPort,
    add_handlers,
    add_standard_services,
    bind,
    new_server,
    serve_until_signalled,
    set_serving,
    start_metrics,
    wire_keeping_handler,
)
from kvroute.core.load import ArrivalRate
from kvroute.core.redis_conn import REDIS_ERRORS, connect_config
from kvroute.core.redis_schema import Heartbeat, RedisKeys, check_name
from kvroute.core.tls import TlsConfig
from kvroute.core.validate import (
    InvalidRequestError,
    Limits,
    check_names,
    check_sampling,
    check_tokens,
)
from kvroute.core.wire import request_token_ids
from kvroute.v1 import common_pb2, worker_agent_pb2, worker_agent_pb2_grpc
from kvroute.worker_agent.controller import ProgramError, ProgramLimits, ProgramRuntime
from kvroute.worker_agent.engines.base import (
    Engine,
    EngineError,
    EngineRequest,
    RequestRefusedError,
)
from kvroute.worker_agent.metrics import AgentMetrics
from kvroute.worker_agent.publisher import CachePublisher
from kvroute.worker_agent.vocabulary import AgentVocabulary, load_vocabulary

log = logging.getLogger("kvroute.agent")

SERVICE = worker_agent_pb2.DESCRIPTOR.services_by_name["WorkerAgent"].full_name
_FINISH = {"length": common_pb2.FINISH_REASON_LENGTH, "stop": common_pb2.FINISH_REASON_STOP}


def make_engine(cfg: AgentConfig, vocab: AgentVocabulary | None = None) -> Engine:
    """The engine named by ``--engine``, speaking ``vocab``'s ids (default: the flags', by
    :func:`load_vocabulary`). Each engine module offers ``from_agent_config``."""
    vocab = vocab or load_vocabulary(cfg)
    if cfg.engine.kind == "sim":
        from kvroute.worker_agent.engines.sim import SimConfig, SimEngine

        return SimEngine(SimConfig(
            capacity_blocks=cfg.engine.capacity_blocks, block_size=cfg.model.block_size,
            model=cfg.model.name,
            vocab_size=vocab.size, max_batch=cfg.engine.max_batch, time_scale=cfg.sim.time_scale,
            prefill_budget=cfg.engine.max_batched_tokens, chunked_prefill=cfg.sim.chunked_prefill,
            long_prefill_threshold=cfg.sim.long_prefill_threshold,
            host_blocks=cfg.sim.host_blocks, host_load_s_per_token=cfg.tier.s_per_token,
        ))
    if cfg.engine.kind == "tiny":
        from kvroute.worker_agent.engines import tiny

        return tiny.from_agent_config(cfg, vocab)
    if cfg.engine.kind == "vllm":
        from kvroute.worker_agent.engines import vllm

        return vllm.from_agent_config(cfg, vocab)
    if cfg.engine.kind == "sglang":
        from kvroute.worker_agent.engines import sglang

        return sglang.from_agent_config(cfg)
    raise SystemExit(f"unknown engine {cfg.engine.kind!r}; choose sim, tiny, vllm or sglang")


class AgentService(worker_agent_pb2_grpc.WorkerAgentServicer):
    def __init__(self, worker_id: str, model: str, engine: Engine, limits: Limits,
                 metrics: AgentMetrics, programs: ProgramRuntime | None = None) -> None:
        self._worker = worker_id
        self._model = model
        self._engine = engine
        self._limits = limits
        self._m = metrics
        self._programs = programs
        # Requests received (from every router): the heartbeat's arrival_rate, so that each
        # router sees the worker's whole traffic, not only its own.
        self.arrivals = ArrivalRate(start=time.monotonic())
        # ... and the prompt tokens its engine prefilled (the heartbeat's prefill_rate: how
        # fast its cache turns over, whichever router sent them).
        self.prefills = ArrivalRate(start=self.arrivals.start)

    def invalid(self) -> None:
        """Count a request refused as INVALID_ARGUMENT."""
        self._m.requests.labels("invalid").inc()

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
        wire: bytes | None = None,
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """``wire``: the bytes ``request`` was parsed from (:func:`add_agent_service`)."""
        t0 = time.perf_counter()
        try:
            check_names(request, self._model)
            if request.text and not request.token_ids:
                raise InvalidRequestError(
                    "text", "the agent takes token ids; send text to the router")
            max_tokens = check_sampling(request, self._limits)
            prompt, top = request_token_ids(request, wire)
            check_tokens(prompt, self._limits, top=top)
        except InvalidRequestError as exc:
            self.invalid()
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        rid = request.request_id or f"{self._worker}-{time.monotonic_ns():x}"
        self.arrivals.add(time.monotonic())
        if request.HasField("program"):
            async for resp in self._run_program(request, rid, context, t0):
                yield resp
            return
        ereq = EngineRequest(
            request_id=rid, token_ids=list(prompt), max_tokens=max_tokens,
            cache_salt=request.cache_salt, seed=request.sampling.seed,
            stop_token_ids=frozenset(request.sampling.stop_token_ids),
            temperature=request.sampling.temperature, top_p=request.sampling.top_p or 1.0,
            top_k=request.sampling.top_k,
        )
        n_out = 0
        cached = 0
        async with self._outcome(context):
            async for chunk in self._engine.generate(ereq):
                resp = common_pb2.GenerateResponse(
                    request_id=rid, worker_id=self._worker, cached_tokens=chunk.cached_tokens,
                    token_ids=chunk.token_ids,
                )
                # An engine may refine its first estimate (vLLM reports the exact figure on
                # the last chunk): the usage carries the latest.
                cached = chunk.cached_tokens
                if n_out == 0:
                    ttft = time.perf_counter() - t0
                    resp.ttft_ms = ttft * 1000
                    self._m.ttft.observe(ttft)
                    self.prefills.add(time.monotonic(), max(0, len(ereq.token_ids) - cached))
                n_out += len(chunk.token_ids)
                if chunk.finish_reason is not None:
                    resp.finish_reason = _FINISH.get(chunk.finish_reason,
                                                     common_pb2.FINISH_REASON_UNSPECIFIED)
                    resp.usage.CopyFrom(common_pb2.Usage(
                        prompt_tokens=len(ereq.token_ids), completion_tokens=n_out,
                        cached_tokens=cached))
                yield resp
        self._m.prompt_tokens.inc(len(ereq.token_ids))
        self._m.cached_tokens.inc(cached)
        self._m.generated_tokens.inc(n_out)

    async def _run_program(
        self, request: common_pb2.GenerateRequest, rid: str,
        context: grpc.aio.ServicerContext, t0: float,
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """A controller program: checked (limits, grammars) before any engine work."""
        try:
            if self._programs is None:
                raise ProgramError(grpc.StatusCode.UNIMPLEMENTED, "program: not enabled")
            prepared = await self._programs.prepare(
                request.program, request.placement if request.HasField("placement") else None)
        except ProgramError as exc:
            self._m.requests.labels("invalid").inc()
            await context.abort(exc.code, str(exc), ((REFUSED_FIELD, exc.field),))
        except Exception as exc:  # a bug of the checks': said, not an opaque UNKNOWN
            log.exception("program check failed unexpectedly")
            self._m.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"program: unexpected {type(exc).__name__}: {exc}")
        first = True
        async with self._outcome(context):
            async for resp in self._programs.run(prepared, request, rid):
                if first and resp.token_ids:
                    first = False
                    resp.ttft_ms = (time.perf_counter() - t0) * 1000
                    self._m.ttft.observe(resp.ttft_ms / 1000)
                yield resp

    @contextlib.asynccontextmanager
    async def _outcome(self, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        """Count how a request's engine work ended, and turn a failure into its status: the
        request's own fault its code (routers pass it back and mark nothing down), the
        engine's UNAVAILABLE, anything else INTERNAL (never UNKNOWN)."""
        try:
            yield
        except ProgramError as exc:
            self._m.requests.labels("invalid").inc()
            await context.abort(exc.code, str(exc), ((REFUSED_FIELD, exc.field),))
        except RequestRefusedError as exc:
            self._m.requests.labels("invalid").inc()
            await context.abort(grpc.StatusCode[exc.code], f"engine: {exc}")
        except EngineError as exc:
            self._m.requests.labels("engine_error").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"engine: {exc}")
        except asyncio.CancelledError:
            self._m.requests.labels("cancelled").inc()
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug of the agent's: said, not an opaque UNKNOWN
            log.exception("request failed unexpectedly")
            self._m.requests.labels("engine_error").inc()
            await context.abort(grpc.StatusCode.INTERNAL,
                                f"agent: unexpected {type(exc).__name__}: {exc}")
        self._m.requests.labels("ok").inc()

    async def GetLoad(  # noqa: N802 - gRPC method name
        self, request: worker_agent_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> common_pb2.WorkerLoad:
        return self._engine.load().to_proto(self._worker)


def add_agent_service(service: AgentService, server: grpc.aio.Server) -> None:
    """Serve ``service`` as kvroute.v1.WorkerAgent, each Generate keeping its wire bytes."""
    add_handlers(server, worker_agent_pb2.DESCRIPTOR.services_by_name["WorkerAgent"], {
        "Generate": wire_keeping_handler(
            service.Generate, common_pb2.GenerateResponse.SerializeToString, stream=True,
            on_invalid=service.invalid),
        "GetLoad": grpc.unary_unary_rpc_method_handler(
            service.GetLoad, request_deserializer=worker_agent_pb2.GetLoadRequest.FromString,
            response_serializer=common_pb2.WorkerLoad.SerializeToString),
    })


async def claim_worker_id(pub: CachePublisher, worker: str, address: str,
                          wait_s: float) -> None:
    """Refuse ``worker`` (SystemExit) while a live agent at another address holds it: two
    agents under one id overwrite each other's snapshot for ever. A heartbeat from this
    agent's own address is a former run (this process holds the port now). One from another
    address may be a former run elsewhere (a restarted pod's new IP): its heartbeat is given
    ``wait_s`` (a heartbeat TTL) to expire. Unreadable Redis: nothing to check (the publisher
    reports Redis)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            owner = await pub.peer_address(worker)
        except REDIS_ERRORS:
            return
        if owner is None or owner == address:
            return
        if time.monotonic() >= deadline:
            raise SystemExit(
                f"worker id {worker!r} belongs to a live agent at {owner} (its heartbeat in "
                f"Redis is still renewed); give this agent another --worker-id, or stop that "
                "one first")
        await asyncio.sleep(0.25)


class AgentApp:
    """One agent: engine + gRPC server + Redis publisher + metrics. Start, then stop."""

    def __init__(self, cfg: AgentConfig, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.vocabulary = load_vocabulary(cfg)
        self.engine = engine if engine is not None else make_engine(cfg, self.vocabulary)
        self.port = 0
        self.worker_id = cfg.worker.worker_id
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._serving_task: asyncio.Task[None] | None = None  # a health change in flight
        self._metrics_http: Any = None
        self.health_server = HealthPort("", 0)  # --health-port: bound at start
        self.publisher: CachePublisher | None = None
        try:
            self.tls = TlsConfig.from_settings(cfg.tls)
            # To other agents (a program's overflow children): mTLS with --tls-ca.
            self._channels = AgentChannels(self.tls)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        self.programs: ProgramRuntime | None = None
        self.metrics: AgentMetrics | None = None  # set at start
        self.service: AgentService | None = None  # set at start

    async def start(self) -> int:
        cfg = self.cfg
        server = new_server(self.tls)  # --tls-allowed-sans: only those callers
        self.port = bind(server, cfg.listen.host, cfg.listen.port, tls=self.tls)
        self.health_server = HealthPort(cfg.listen.plain_host, cfg.listen.health_port)
        self.worker_id = cfg.worker.worker_id or f"{socket.gethostname()}:{self.port}"
        check_name("worker id", self.worker_id)
        advertise = cfg.worker.advertise or f"{cfg.listen.host}:{self.port}"
        metrics = self.metrics = AgentMetrics(self.worker_id)
        # Before the engine and the publisher start: a taken port then leaves nothing running.
        self._metrics_http = start_metrics(cfg.listen.metrics_port, cfg.listen.plain_host,
                                           metrics.registry)
        # The engine knows its vocabulary (tiny's byte vocab is 258): ids past it are the
        # caller's mistake (INVALID_ARGUMENT), not an engine failure.
        words = self.vocabulary
        vocab = min(words.size, getattr(self.engine, "vocab_size", words.size))
        limits = Limits(vocab, cfg.limits.max_prompt_tokens, cfg.limits.max_new_tokens)
        tokenizer = words.name if vocab == words.size else ""
        programs = ProgramRuntime(self.engine, ProgramLimits(
            max_fanout=cfg.programs.fanout, max_tokens=cfg.programs.tokens,
            max_steps=cfg.programs.steps, max_grammar_bytes=cfg.programs.grammar_bytes,
            compile_timeout_s=cfg.programs.compile_timeout_s,
            max_new_tokens=cfg.limits.max_new_tokens, vocab_size=vocab), words.program_tokenizer,
            self.worker_id,
            channels=self._channels)
        self.programs = programs
        service = self.service = AgentService(self.worker_id, cfg.model.name, self.engine, limits,
                                              metrics, programs)
        add_agent_service(service, server)
        self._health = add_standard_services(server, [SERVICE], cfg.listen.grpc_reflection)
        engine = self.engine

        serving = [engine.healthy()]  # what health checks answer: the engine's health

        def heartbeat() -> Heartbeat | None:
            healthy = engine.healthy()
            if healthy != serving[0]:
                serving[0] = healthy
                self._serving_task = asyncio.create_task(
                    set_serving(self._health, [SERVICE], healthy), name="agent-serving")
                log.log(logging.INFO if healthy else logging.WARNING,
                        "engine %s; %s", "serving" if healthy else "cannot serve",
                        "heartbeating" if healthy else "no heartbeat until it can",
                        extra={"kv": {"worker": self.worker_id}})
            if not healthy:
                return None
            now = time.monotonic()
            load = replace(engine.load(), arrival_rate=service.arrivals.at(now),
                           prefill_rate=service.prefills.at(now))
            return Heartbeat(
                worker_id=self.worker_id, address=advertise, epoch=pub.epoch, load=load,
                block_size=cfg.model.block_size, ttl_s=cfg.worker.heartbeat_ttl_s,
                tokenizer=tokenizer, vocab_size=vocab, engine_endpoint=cfg.engine.endpoint,
            )

        pub = CachePublisher(
            connect_config(cfg.redis), RedisKeys(cfg.model.name), self.worker_id,
            engine.cached_keys, heartbeat, lower=getattr(engine, "lower_keys", None),
            heartbeat_s=cfg.worker.heartbeat_s,
            heartbeat_ttl_s=cfg.worker.heartbeat_ttl_s,
            max_pending=cfg.worker.publish_buffer, feed_maxlen=cfg.worker.feed_maxlen,
        )
        self.publisher = pub
        await claim_worker_id(pub, self.worker_id, advertise,
                              cfg.worker.heartbeat_ttl_s + cfg.worker.heartbeat_s)
        programs.peers = pub.peer_address  # placements go only to live workers
        engine.add_listener(pub.on_event)
        metrics.watch(engine, pub, programs.stats)
        await engine.start()
        await pub.start()
        await server.start()
        self._server = server
        await self.health_server.start(self._health)
        await set_serving(self._health, [SERVICE], serving[0])
        log.info("agent serving", extra={"kv": {
            "worker": self.worker_id, "address": advertise, "engine": cfg.engine.kind,
            "model": cfg.model.name, "block_size": cfg.model.block_size, "epoch": pub.epoch,
            "metrics_port": cfg.listen.metrics_port or "off"}})
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._health is not None:
            await set_serving(self._health, [SERVICE], False)
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.health_server.stop()
        if self.publisher is not None:
            await self.publisher.stop()
        await self.engine.stop()
        await self._channels.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        log.info("agent stopped", extra={"kv": {"worker": self.worker_id}})


async def run_agent(cfg: AgentConfig) -> None:
    app = AgentApp(cfg)
    await serve_until_signalled(app.start, app.stop)
