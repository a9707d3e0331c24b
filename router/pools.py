"""Several models per router: each ``--model`` is a pool of the workers serving it.

A pool holds what one model's routing needs: its tokenizer (and chat template), its own
registry of the workers whose heartbeats name the model, its own mirror of the model's Redis
keys (core/redis_schema.py keys them per model) and its own decider (block keys hash the
model's name, core/blocks.py). A request is routed within the pool of the model it names
(``GenerateRequest.model``; none: the first ``--model``), so only that pool's workers are
ranked. :class:`PooledService` is the router's entry for every API: it picks the pool, sheds
load past ``--max-inflight`` and hands the request to the pool's ``RouterService.generate``,
the one generation path.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvroute.core.blocks import adapter_salt
from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import RouterConfig
from kvroute.core.model_source import ModelSourceError, parse_model_option
from kvroute.core.tokenizer import Tokenizer, make_tokenizer
from kvroute.core.validate import InvalidRequestError
from kvroute.router.refusal import RefusedError, ShedError, UnavailableError, invalid_request
from kvroute.v1 import common_pb2, router_pb2

log = logging.getLogger("kvroute.router.pools")


@dataclass(frozen=True)
class ModelSpec:
    """One ``--model`` value: NAME, or NAME=SOURCE (``source`` then the tokenizer's)."""

    name: str
    source: str = ""


def parse_models(value: str) -> list[ModelSpec]:
    """The ``--model`` values (repeated flags arrive comma-joined, as the environment writes
    them). ModelSourceError names what is wrong: an empty or repeated name, a bad NAME=SOURCE."""
    specs: list[ModelSpec] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            raise ModelSourceError(f"--model {value!r}: an empty model name")
        if "=" in item:
            specs.append(ModelSpec(*parse_model_option(item)))
        else:
            specs.append(ModelSpec(item))
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ModelSourceError(f"--model {value!r}: {', '.join(twice)} given more than once")
    return specs


def parse_adapters(value: str, models: Sequence[str]) -> dict[str, str]:
    """``--lora`` values (NAME=BASE, comma-joined) -> {adapter: base model}. ModelSourceError
    for a bad name, an unknown BASE or a name already a model's or another adapter's."""
    adapters: dict[str, str] = {}
    for item in filter(None, (i.strip() for i in value.split(","))):
        try:
            name, base = parse_model_option(item)
        except ModelSourceError:
            raise ModelSourceError(
                f"--lora {item!r}: expected NAME=BASE, NAME the adapter (letters, digits and "
                ". _ - : / only) and BASE one of the --model names") from None
        if base not in models:
            raise ModelSourceError(f"--lora {item!r}: {base!r} is not a --model of this "
                                   f"router ({', '.join(models)})")
        if name in models or name in adapters:
            raise ModelSourceError(f"--lora {item!r}: {name!r} is already a model's name")
        adapters[name] = base
    return adapters


@dataclass
class PoolModel:
    """A pool's model as loaded: its config (``model`` the bare name, ``vocab_size`` its
    tokenizer's), its tokenizer and, with a SOURCE, its chat tokenizer."""

    cfg: RouterConfig
    tokenizer: Tokenizer | None
    chat: ChatTokenizer | None

    @property
    def name(self) -> str:
        return self.cfg.model.name


def load_models(cfg: RouterConfig) -> list[PoolModel]:
    """Each ``--model``'s config and tokenizer, the first the default. A bare NAME takes
    ``--tokenizer`` (byte, gpt2, or none); NAME=SOURCE its own, and ids are then checked
    against its vocabulary. ValueError names what is wrong."""
    specs = parse_models(cfg.model.name)
    if cfg.model.tokenizer and any(s.source for s in specs):
        named = next(s for s in specs if s.source)
        raise ValueError(f"--model {named.name}={named.source} names the model's tokenizer: "
                         f"drop --tokenizer {cfg.model.tokenizer!r}")
    if len(specs) > 1 and cfg.workers.discovery != "redis":
        raise ValueError(f"--discovery {cfg.workers.discovery} serves one --model per router "
                         "for now (run a router per model)")
    models = []
    for s in specs:
        if s.source:
            chat = ChatTokenizer.load(s.source, name=s.name)
            models.append(PoolModel(cfg.replace(model=s.name, vocab_size=chat.vocab_size),
                                    chat, chat))
        else:
            models.append(PoolModel(cfg.replace(model=s.name),
                                    make_tokenizer(cfg.model.tokenizer), None))
    return models


class PoolService(Protocol):
    """A pool's generation path (``RouterService``)."""

    def generate(self, request: common_pb2.GenerateRequest, wire: bytes | None = None,
                 api: str = "grpc") -> AsyncIterator[common_pb2.GenerateResponse]: ...

    async def Route(self, request: common_pb2.GenerateRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext, wire: bytes | None = None
                    ) -> router_pb2.RouteResponse: ...

    def invalid(self, method: str, api: str = "grpc") -> None: ...


class Counter(Protocol):
    def labels(self, *values: str) -> Any: ...


@dataclass
class ModelPool:
    """One model's routing: ``registry`` (a ``WorkerRegistry``), ``mirror`` (an
    ``IndexMirror`` of its keys), ``decider`` and, once the router starts, ``service``."""

    model: PoolModel
    registry: Any
    mirror: Any
    decider: Any
    service: PoolService | None = None

    @property
    def name(self) -> str:
        return self.model.name


class Shedder:
    """``--max-inflight``: how many requests the router serves at once (0: no limit)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight = 0

    @property
    def full(self) -> bool:
        return 0 < self.limit <= self.inflight

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.inflight += 1
        try:
            yield
        finally:
            self.inflight -= 1



class PooledService:
    """The router's RPCs and generation path over its pools (gRPC and HTTP both enter here):
    the request's model picks the pool; past ``--max-inflight`` a Generate is shed."""

    def __init__(self, pools: Sequence[ModelPool], max_inflight: int,
                 requests: Counter, adapters: Mapping[str, str] | None = None) -> None:
        self.pools: dict[str, ModelPool] = {p.name: p for p in pools}
        self.adapters = dict(adapters or {})
        """LoRA adapter -> its base model (``--lora``)."""
        self.default = pools[0]
        self.shedder = Shedder(max_inflight)
        self._requests = requests  # kvroute_router_requests_total

    def pool(self, model: str) -> ModelPool:
        """The pool of ``model`` (empty: the default; an adapter: its base model's);
        InvalidRequestError if none serves it."""
        if not model:
            return self.default
        pool = self.pools.get(self.adapters.get(model, model))
        if pool is None:
            # Cut: the message goes back in a trailer, which gRPC caps at 16 KiB.
            raise InvalidRequestError("model", f"{model[:80]!r} is not served here (serving "
                                      f"{', '.join(map(repr, [*self.pools, *self.adapters]))})")
        return pool

    def _admit_request(self, request: common_pb2.GenerateRequest) -> ModelPool:
        """The request's pool; an adapter's request rewritten to its base model with the
        adapter's salt (core/blocks.py ``adapter_salt``: keyed apart from the base model's
        blocks, and the agent asks its engine for the adapter). InvalidRequestError."""
        pool = self.pool(request.model)
        if "\x00" in request.cache_salt:
            # NUL separates an adapter's salt from the caller's (adapter_salt).
            raise InvalidRequestError("cache_salt", "holds a NUL character")
        adapter = request.model if request.model in self.adapters else ""
        if adapter:
            request.model = pool.name
            request.cache_salt = adapter_salt(adapter, request.cache_salt)
        return pool

    def _service(self, pool: ModelPool) -> PoolService:
        if pool.service is None:
            raise UnavailableError("the router is starting")
        return pool.service

    def invalid(self, method: str, api: str = "grpc") -> None:
        self._requests.labels(api, method, "invalid").inc()

    def admit(self, api: str) -> None:
        """Shed now (a ShedError, counted) if the router is at ``--max-inflight``: the HTTP
        front asks before it reads and tokenizes a body."""
        if self.shedder.full:
            raise self.shed_error(api)

    def shed_error(self, api: str) -> RefusedError:
        """Count a request shed and say why (RESOURCE_EXHAUSTED; HTTP 429)."""
        self._requests.labels(api, "Generate", "shed").inc()
        return ShedError(f"the router is serving its most requests at once "
                         f"({self.shedder.limit}, --max-inflight); retry shortly")

    async def generate(self, request: common_pb2.GenerateRequest, wire: bytes | None = None,
                       api: str = "grpc", deadline: float | None = None,
                       ) -> AsyncIterator[common_pb2.GenerateResponse]:
        """The pool's ``generate`` for the request's model; RefusedError as it raises, an
        unknown model INVALID_ARGUMENT (field ``model``), past the limit RESOURCE_EXHAUSTED."""
        try:
            model = request.model
            pool = self._admit_request(request)
        except InvalidRequestError as exc:
            self.invalid("Generate", api)
            raise invalid_request(exc) from None
        if request.model != model:
            wire = None  # rewritten (an adapter's): its wire bytes are not what goes on
        self.admit(api)
        service = self._service(pool)
        with self.shedder.hold():
            async with contextlib.aclosing(
                    service.generate(request, wire, api, deadline=deadline)) as responses:
                async for resp in responses:
                    yield resp

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
        wire: bytes | None = None,
    ) -> AsyncIterator[common_pb2.GenerateResponse]:
        try:
            # aclosing: a cancelled call ends the generation here and now (its finally
            # blocks cancel the agent call and release the worker's load). The client's
            # deadline bounds the agent calls too (router/server.py).
            remaining = context.time_remaining()
            deadline = None if remaining is None else time.monotonic() + remaining
            async with contextlib.aclosing(
                    self.generate(request, wire, deadline=deadline)) as responses:
                async for resp in responses:
                    yield resp
        except RefusedError as exc:
            await context.abort(exc.code, exc.message, trailing_metadata=exc.trailer())

    async def Route(  # noqa: N802 - gRPC method name
        self, request: common_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
        wire: bytes | None = None,
    ) -> router_pb2.RouteResponse:
        try:
            model = request.model
            service = self._service(self._admit_request(request))
            if request.model != model:
                wire = None
        except InvalidRequestError as exc:
            self.invalid("Route")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RefusedError as exc:
            await context.abort(exc.code, exc.message)
        return await service.Route(request, context, wire)

    def routable(self) -> Mapping[str, int]:
        """Each model's routable workers now (for /health)."""
        return {name: len(p.registry.loads) for name, p in self.pools.items()}
