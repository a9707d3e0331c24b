"""The router process: its pools (each model's registry, index mirror and decider), the gRPC
server of :class:`~kvroute.router.server.RouterService`, the HTTP front, metrics, health,
discovery and API keys, started and stopped together."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

import grpc

from kvroute.core.agent_client import AgentChannels
from kvroute.core.config import RouterConfig
from kvroute.core.grpc_util import (
    HealthPort,
    add_standard_services,
    bind,
    new_server,
    serve_until_signalled,
    set_serving,
    start_metrics,
)
from kvroute.core.native import native_builds
from kvroute.core.policies import make_policy
from kvroute.core.redis_conn import connect_config, redact_url
from kvroute.core.redis_schema import RedisKeys
from kvroute.core.tls import TlsConfig
from kvroute.core.tokenizer import Tokenizer
from kvroute.router.auth import api_interceptors, api_middlewares, load_key_ring
from kvroute.router.decide import Decider
from kvroute.router.discovery import DiscoveryCollector, make_discovery
from kvroute.router.http_front import HttpFront
from kvroute.router.http_guard import GuardCollector
from kvroute.router.lost import Probe
from kvroute.router.metrics import RouterMetrics
from kvroute.router.mirror import IndexMirror
from kvroute.router.pools import (
    ModelPool,
    PooledService,
    PoolModel,
    load_models,
    parse_adapters,
)
from kvroute.router.registry import Vocabulary, WorkerRegistry, parse_static
from kvroute.router.server import SERVICE, RouterService, add_router_service
from kvroute.router.shared import SharedDecisions

log = logging.getLogger("kvroute.router")


class RouterApp:
    """The router: mirror + registry + gRPC server + metrics. Start, then stop."""

    def __init__(self, cfg: RouterConfig) -> None:
        try:
            static = parse_static(cfg.workers.static)
            make_policy(cfg.policy.name)  # an unknown policy ends the start before any model loads
            # Each --model a pool; NAME=SOURCE: the model's own tokenizer (and chat template).
            models = load_models(cfg)
            # --lora NAME=BASE: adapters routed in their base model's pool.
            self.adapters = parse_adapters(cfg.model.lora, [m.name for m in models])
            self.tls = TlsConfig.from_settings(cfg.tls)
        except ValueError as exc:  # ModelSourceError, ChatTemplateError, TlsError included
            raise SystemExit(str(exc)) from None
        # The default (first) model's config, tokenizer, registry, mirror and decider are
        # the router's own attributes; every model's are its pool's (router/pools.py).
        try:
            self.channels = AgentChannels(self.tls)  # --tls-ca: mTLS to agents
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        self.pools = [_pool(m, static if i == 0 else {}, self.channels.serving)
                      for i, m in enumerate(models)]
        default = self.pools[0]
        cfg = self.cfg = default.model.cfg
        self.chat = default.model.chat
        self._tok: Tokenizer | None = default.model.tokenizer
        self.registry = default.registry
        self.mirror = default.mirror
        self.decider = default.decider
        self.metrics = RouterMetrics()
        self.front: PooledService | None = None  # set at start: the pools' one entry
        # --discovery kubernetes: only pods that exist and are Ready get traffic.
        self.discovery = make_discovery(cfg, self.registry)
        if self.discovery is not None:
            self.metrics.registry.register(DiscoveryCollector(self.discovery))
        self.keys = load_key_ring(cfg.auth.keys_file, self.metrics.registry)
        self.port = 0
        self.http_port = 0
        self.http: HttpFront | None = None  # set at start, with --http-port
        self.service: RouterService | None = None  # set at start
        self._server: grpc.aio.Server | None = None
        self._health: Any = None
        self._mirror_task: asyncio.Task[None] | None = None
        self._mirror_tasks: list[asyncio.Task[None]] = []
        self._metrics_http: Any = None
        self.health_server = HealthPort("", 0)  # --health-port: bound at start

    async def start(self, *, wait_for_redis_s: float = 0.0) -> int:
        """Listen (ports first: a taken one ends the start before anything needs stopping),
        follow Redis, and serve; the gRPC port."""
        cfg = self.cfg
        self._loop = asyncio.get_running_loop()  # where /debug/mirror reads the mirror
        server = new_server(self.tls, api_interceptors(self.keys, [SERVICE], cfg.model.name))
        self.port = bind(server, cfg.listen.host, cfg.listen.port, tls=self.tls)
        self.health_server = HealthPort(cfg.listen.plain_host, cfg.listen.health_port)
        await self._bind_http_and_metrics()
        if len(self.pools) == 1:
            self.metrics.watch(self.mirror)
        else:  # each pool's index and workers, labelled with its model
            self.metrics.watch_pools({p.name: p.mirror for p in self.pools})
        if self.discovery is not None:
            await self.discovery.start()  # closes the gate before the first heartbeat scan
        self._mirror_tasks = [asyncio.create_task(p.mirror.run(), name=f"index-mirror-{p.name}")
                              for p in self.pools]
        self._mirror_task = self._mirror_tasks[0]
        if wait_for_redis_s > 0:
            await self._wait_ready(wait_for_redis_s)
        for p in self.pools:
            p.service = RouterService(p.model.cfg, p.decider, p.mirror, p.registry,
                                      self.channels, self.metrics, p.model.tokenizer)
        self.service = self.pools[0].service
        self.front = PooledService(self.pools, cfg.limits.max_inflight, self.metrics.requests,
                                   self.adapters)
        add_router_service(self.front, server)  # type: ignore[arg-type]
        if self.http is not None:
            self.http.serve(self.front, self.front)
        self._health = add_standard_services(server, [SERVICE], cfg.listen.grpc_reflection)
        await server.start()
        self._server = server
        await self.health_server.start(self._health)
        await set_serving(self._health, [SERVICE], True)
        self._log_serving()
        return self.port

    async def _bind_http_and_metrics(self) -> None:
        cfg = self.cfg
        if cfg.http.port:
            self.http = HttpFront(cfg, self._tok,
                                  middlewares=api_middlewares(self.keys, cfg.model.name),
                                  models={p.name: p.model.tokenizer for p in self.pools},
                                  adapters=self.adapters)
            self.http_port = await self.http.bind(cfg.listen.host, cfg.http.port, tls=self.tls)
            assert self.http.guard is not None
            self.metrics.registry.register(GuardCollector(self.http.guard))
        try:
            self._metrics_http = start_metrics(cfg.listen.metrics_port, cfg.listen.plain_host,
                                               self.metrics.registry,
                                               routes={"/debug/mirror": self._debug_mirror})
        except BaseException:  # a taken metrics port: the HTTP one is not left listening
            if self.http is not None:
                await self.http.stop()
            raise

    async def _wait_ready(self, timeout_s: float) -> None:
        """Up to ``timeout_s`` for every pool's mirror (and the pod list, with discovery);
        the router serves anyway after, by load alone."""
        try:
            await asyncio.wait_for(asyncio.gather(*(p.mirror.ready.wait()
                                                    for p in self.pools)), timeout_s)
        except TimeoutError:
            # Why, as the mirror classified it (refused credentials, an ACL, TLS).
            log.warning(f"redis not ready at start ({self.mirror.last_error or 'no answer'})"
                        "; routing by load alone for now")
        if self.discovery is not None:
            try:
                await asyncio.wait_for(self.discovery.ready.wait(), timeout_s)
            except TimeoutError:
                log.warning("worker pods not listed yet; no traffic until they are")

    def _log_serving(self) -> None:
        cfg = self.cfg
        native = native_builds()
        log.info("router serving", extra={"kv": {
            "port": self.port, "policy": cfg.policy.name, "model": cfg.model.name,
            "block_size": cfg.model.block_size, "redis": redact_url(cfg.redis.url),
            "metrics_port": cfg.listen.metrics_port or "off", "http_port": self.http_port or "off",
            "native": native}})
        missing = sorted(name for name, built in native.items() if not built)
        if missing:
            log.warning("C builds missing, their pure-Python paths run (same results, several "
                        "times slower per decision; install with a C compiler)",
                        extra={"kv": {"missing": missing}})

    def _debug_mirror(self, query: dict[str, list[str]]) -> object:
        """``/debug/mirror[?keys=1][?workers=0]`` on the metrics port: the mirror's counters
        and per-worker view (:meth:`IndexMirror.view`; ``workers=0``: counters only), read on
        the event loop so it is one moment's. Served by the metrics thread; bench/scale.py
        compares routers with it (docs/scaling.md)."""
        keys = query.get("keys", ["0"])[0] not in ("", "0")
        per_worker = query.get("workers", ["1"])[0] not in ("", "0")  # ?workers=0: totals

        async def read() -> object:
            st = self.mirror.stats
            return {"available": self.mirror.available, "events_applied": st.events_applied,
                    "gaps": st.gaps, "heartbeat_mismatches": dict(st.heartbeat_mismatches),
                    "snapshot_loads": st.snapshot_loads,
                    "bootstraps": st.bootstraps, "lag_s": st.lag_s,
                    "entries": self.mirror.index.entries(),
                    "workers": self.mirror.view(keys) if per_worker else {}}

        return asyncio.run_coroutine_threadsafe(read(), self._loop).result(30)

    async def stop(self, grace_s: float = 5.0) -> None:
        if self._health is not None:
            await set_serving(self._health, [SERVICE], False)
        if self.http is not None:
            await self.http.stop()
        if self._server is not None:
            await self._server.stop(grace_s)
        await self.health_server.stop()
        for p in self.pools:
            if p.service is not None:
                await p.service.copier.close()  # type: ignore[attr-defined]
        if self.discovery is not None:
            await self.discovery.stop()
        for p, task in zip(self.pools, self._mirror_tasks, strict=False):
            if p.mirror.shared is not None:
                await p.mirror.shared.close()  # its last entries, before the client closes
            await p.mirror.stop(task)
        await self.channels.close()
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        log.info("router stopped")


def _pool(model: PoolModel, static: Mapping[str, str], probe: Probe) -> ModelPool:
    """One model's registry, mirror of its Redis keys and decider (its own policy object:
    policies keep per-model state, such as hot-prefix replicas). ``probe``: whether an
    agent answers (router/lost.py)."""
    cfg, chat, tok = model.cfg, model.chat, model.tokenizer
    # The ids this pool speaks: workers speaking others are left out (and named).
    # A model's own tokenizer is named by its fingerprint, as agents given the same
    # --model-source report it.
    vocabulary = (Vocabulary(chat.fingerprint, chat.vocab_size) if chat is not None
                  else Vocabulary(tok.name, tok.vocab_size)
                  if tok is not None else Vocabulary("", cfg.model.vocab_size))
    registry = WorkerRegistry(static, cfg.model.block_size, vocabulary)
    client = connect_config(cfg.redis, block_timeout_s=cfg.workers.poll_interval_s)
    mirror = IndexMirror(client, RedisKeys(cfg.model.name), registry,
                         poll_interval_s=cfg.workers.poll_interval_s, retry_s=cfg.redis.retry_s,
                         probe=probe)
    if cfg.policy.share_decisions:
        mirror.shared = SharedDecisions(client, RedisKeys(cfg.model.name), mirror,
                                        cfg.policy.predict_ttl_s, cfg.policy.share_max_age_s)
    return ModelPool(model, registry, mirror, Decider(cfg.model.name, cfg.model.block_size,
                                                      make_policy(cfg.policy.name)))


async def run_router(cfg: RouterConfig) -> None:
    app = RouterApp(cfg)
    await serve_until_signalled(partial(app.start, wait_for_redis_s=3.0), app.stop)
