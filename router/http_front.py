"""The router's HTTP server (aiohttp), served beside its gRPC port: OpenAI's API
(:mod:`kvroute.router.openai_api`) and Anthropic's Messages API
(:mod:`kvroute.router.anthropic_api`) on one port, ``GET /v1/models`` and ``GET /health``.

The front owns what both APIs share: the models served and their tokenizers, the request
limits, API keys (a middleware), admission, rendering and tokenizing prompts (off the event
loop when long), the jobs a request becomes, and errors in the called API's shape. A job goes
through the router's one generation path (``RouterService.generate``: the decider,
coalescing, retries, metrics with ``api="http"``, programs): no routing is decided here. The
engine gets token ids, so the router's block keys and the engine's cache hash the same ids.

A client that goes away cancels its handler (aiohttp's handler cancellation), which closes the
generation and so cancels the agent call: the engine frees the sequence.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from aiohttp import web

from kvroute.core.chat_template import ChatTemplateError
from kvroute.core.config import RouterConfig
from kvroute.core.ports import describe, refuse_port
from kvroute.core.tls import ServerContext, TlsConfig, TlsError
from kvroute.core.tokenizer import Tokenizer
from kvroute.router.anthropic_api import MESSAGES_PATH, MessagesApi
from kvroute.router.anthropic_schema import error_body
from kvroute.router.api_error import ApiError, refusal_error
from kvroute.router.auth import CHARGE_MORE
from kvroute.router.http_body import decode_body
from kvroute.router.http_guard import ConnectionGuard
from kvroute.router.http_jobs import Choice, FrontModel, Generator, Job, Served
from kvroute.router.openai_api import OpenAIApi
from kvroute.router.openai_schema import (
    ChatRequest,
    CompletionRequest,
    Generation,
    check_generations,
    generate_request,
    parse_chat,
    parse_completion,
)
from kvroute.router.refusal import RefusedError
from kvroute.router.tool_calls import ToolChoice, ToolFormat, ToolStream, tool_format

log = logging.getLogger("kvroute.router.http")

SHUTDOWN_S = 2.0
"""How long a stopping router lets open HTTP streams finish before it cancels them."""
TOKENIZE_THREADS = 2
"""Threads that render and tokenize long prompts off the event loop (tokenizers releases the
GIL while it encodes, so they run beside the loop rather than stalling every other stream)."""
INLINE_BODY_BYTES = 4096
"""A request body up to this size is tokenized on the loop: its render + encode (~0.2 ms at
1k tokens) costs about what the hop to a thread and back does (~0.08 ms p50, more at p99)."""


class Workers(Protocol):
    """What /health reports of the router's pools (``PooledService``)."""

    def routable(self) -> Mapping[str, int]: ...


def charge_more(request: web.Request, jobs: Sequence[Job]) -> None:
    """Count a request's generations past its first against its API key's rate (the auth
    middleware, when keys are on, counted the first)."""
    more = sum(len(j.choices) for j in jobs) - 1
    charge = request.get(CHARGE_MORE)
    if charge is not None and more > 0:
        charge(more)


class HttpFront:
    """The HTTP server: :meth:`bind` (before the router serves), :meth:`serve` (once its
    generation path exists; until then requests get 503), :meth:`stop`."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer | None,
                 middlewares: Sequence[Any] = (),
                 models: Mapping[str, Tokenizer | None] | None = None,
                 adapters: Mapping[str, str] | None = None) -> None:
        """``models``: every model served and its tokenizer (default: ``cfg.model.name`` and
        ``tokenizer``); the first is the default. ``adapters``: LoRA adapter -> base model,
        served as models of their own with the base model's tokenizer."""
        self._cfg = cfg
        self._models = {name: FrontModel(name, tok, tool_format=self._tool_format(tok))
                        for name, tok in (models or {cfg.model.name: tokenizer}).items()}
        self._default = next(iter(self._models.values()))
        for name, base in (adapters or {}).items():
            of = self._models[base]
            self._models[name] = FrontModel(name, of.tok, parent=base,
                                            tool_format=of.tool_format)
        # Run inside _errors (which words what they raise): API keys (router/auth.py).
        self._middlewares = list(middlewares)
        self._tls_watch: asyncio.Task[None] | None = None
        self._service: Generator | None = None
        self._workers: Workers | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.Server | None = None
        self.guard: ConnectionGuard | None = None  # set at bind
        self._created = int(time.time())
        self._pool: ThreadPoolExecutor | None = None  # made at bind, shut at stop

    @property
    def cfg(self) -> RouterConfig:
        return self._cfg

    def _tool_format(self, tok: Tokenizer | None) -> ToolFormat | None:
        templates = getattr(tok, "templates", None) or {}
        return tool_format(self._cfg.http.tool_parser, list(templates.values()))

    # -- lifecycle -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._cfg.http.max_body_bytes,
                              middlewares=[self._errors, *self._middlewares])
        OpenAIApi(self).add_routes(app)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        MessagesApi(self).add_routes(app)
        return app

    async def bind(self, host: str, port: int, tls: TlsConfig | None = None) -> int:
        """Listen on ``host:port`` (0: a free one) and return the port; a port it cannot
        listen on ends the start as the gRPC one does (``--http-port``). ``tls.serving``:
        HTTPS, its certificate reloaded when its files change (core/tls.py)."""
        ssl_ctx = None
        if tls is not None and tls.serving:
            try:
                served = ServerContext(tls)
            except TlsError as exc:
                raise SystemExit(str(exc)) from None
            ssl_ctx = served.context
        # handler_cancellation: a client that disconnects cancels its handler, and so the
        # generation and the engine's work, at once (not at the next write).
        runner = web.AppRunner(self.app(), handler_cancellation=True, access_log=None,
                               shutdown_timeout=SHUTDOWN_S)
        await runner.setup()
        assert runner.server is not None
        # Listening ourselves (not a TCPSite): every connection passes the guard first.
        self.guard = ConnectionGuard(runner.server, self._cfg.http.header_timeout_s,
                                     self._cfg.http.max_connections_per_client)
        try:
            listener = await asyncio.get_running_loop().create_server(
                self.guard, host, port, ssl=ssl_ctx, reuse_address=True)
        except OSError as exc:
            await runner.cleanup()
            raise refuse_port("http_port", host, port, describe(exc)) from None
        self._runner, self._listener = runner, listener
        if ssl_ctx is not None:
            self._tls_watch = asyncio.create_task(served.watch(), name="http-tls-watch")
        port = int(listener.sockets[0].getsockname()[1])  # the port picked, for 0
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS,
                                        thread_name_prefix=f"kvroute-tokenize-{port}")
        return port

    def serve(self, service: Generator, workers: Workers) -> None:
        self._service = service
        self._workers = workers

    async def stop(self) -> None:
        """Stop listening; open streams get SHUTDOWN_S to end before they are cancelled."""
        if self._tls_watch is not None:
            self._tls_watch.cancel()
            self._tls_watch = None
        if self._listener is not None:
            self._listener.close()  # no new connections; open ones drain below
        if self._runner is not None:
            await self._runner.shutdown()
            await self._runner.cleanup()
            self._runner = None
        if self._listener is not None:
            await self._listener.wait_closed()
            self._listener = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- errors ----------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every error in OpenAI's shape: ours, aiohttp's (404 path, 405, 413 body), and an
        unexpected one (500, logged)."""
        try:
            return await handler(request)
        except ApiError as exc:
            return self._error(exc, request)
        except web.HTTPRequestEntityTooLarge:
            return self._error(ApiError(
                413, f"the request body exceeds the limit of {self._cfg.http.max_body_bytes} "
                "bytes (--http-max-body-bytes)", code="request_too_large"), request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error(ApiError(exc.status, f"{request.method} {request.path}: "
                                        f"{exc.reason}", code=exc.reason.lower().replace(" ", "_")),
                               request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("HTTP front: unexpected error", extra={"kv": {"path": request.path}})
            return self._error(ApiError(500, "internal error (logged by the router)",
                                        code="internal_error"), request)

    @staticmethod
    def _error(exc: ApiError, request: web.Request) -> web.Response:
        """``exc`` in the shape of the API the request called."""
        body = error_body(exc) if request.path.startswith(MESSAGES_PATH) else exc.body()
        return web.json_response(body, status=exc.status, headers=exc.headers)

    # -- small endpoints -------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        """OpenAI's model list, or Anthropic's to a client that sends ``anthropic-version``
        (the path is the same)."""
        if "anthropic-version" in request.headers:
            created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._created))
            data = [{"type": "model", "id": m.name, "display_name": m.name,
                     "created_at": created} for m in self._models.values()]
            return web.json_response({"data": data, "has_more": False,
                                      "first_id": data[0]["id"], "last_id": data[-1]["id"]})
        return web.json_response({"object": "list", "data": [{
            "id": m.name, "object": "model", "created": self._created,
            "owned_by": "kvroute", "root": m.parent or m.name, "parent": m.parent or None}
            for m in self._models.values()]})

    async def health(self, request: web.Request) -> web.Response:
        """200 while the router runs (workers may come later: ``workers`` says how many
        are routable now, ``models`` how many of each model's)."""
        per = dict(self._workers.routable()) if self._workers is not None else {}
        return web.json_response({"status": "ok" if self._service is not None else "starting",
                                  "model": self._default.name, "workers": sum(per.values()),
                                  "models": per})

    # -- requests to jobs ------------------------------------------------------------------

    async def read_body(self, request: web.Request) -> tuple[Any, int]:
        """The parsed body and its size in bytes."""
        raw = await request.read()  # HTTPRequestEntityTooLarge past client_max_size
        return decode_body(raw), len(raw)

    def ready(self) -> Generator:
        if self._service is None:
            raise ApiError(503, "the router is starting", headers={"Retry-After": "1"})
        return self._service

    def admit(self) -> Generator:
        """The generation path, unless the router sheds this request now (429, before its
        body is read and tokenized; the generation path counts and enforces the limit)."""
        service = self.ready()
        try:
            service.admit("http")
        except RefusedError as exc:
            raise refusal_error(exc, "") from None
        return service

    def model_of(self, g: Generation) -> FrontModel:
        """The model ``g`` names; 404 ``model_not_found`` if it is not served here."""
        m = self._models.get(g.model)
        if m is None:
            raise ApiError(404, f"The model `{g.model}` does not exist (this router serves "
                           f"{', '.join(map(repr, self._models))}; see /v1/models)",
                           param="model", code="model_not_found")
        return m

    async def off_loop(self, size: int, work: Callable[[], list[int]]) -> list[int]:
        """``work()`` (render and/or tokenize a prompt from a body of ``size`` bytes): on the
        loop when small, else on the tokenizing threads."""
        if size <= INLINE_BODY_BYTES or self._pool is None:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def max_tokens(self, g: Generation) -> int:
        cfg = self._cfg
        if g.max_tokens is not None and g.max_tokens > cfg.limits.max_new_tokens:
            raise ApiError(400, f"max_tokens: {g.max_tokens} exceeds the limit of "
                           f"{cfg.limits.max_new_tokens} (--max-new-tokens)", param="max_tokens")
        return g.max_tokens if g.max_tokens is not None else min(cfg.http.max_tokens,
                                                                  cfg.limits.max_new_tokens)

    def check_length(self, tokens: Sequence[int], param: str) -> None:
        limit = self._cfg.limits.max_prompt_tokens
        if len(tokens) > limit:
            raise ApiError(413, f"{param}: the prompt is {len(tokens)} tokens, over the limit "
                           f"of {limit} tokens (--max-prompt-tokens)", param=param,
                           code="context_length_exceeded")

    def make_jobs(self, g: Generation, prompts: Sequence[Sequence[int]]) -> list[Job]:
        check_generations(len(prompts), g.n, self._cfg.http.max_generations)
        rid = uuid.uuid4().hex
        max_tokens = self.max_tokens(g)
        m = self.model_of(g)
        stops = getattr(m.tok, "stop_token_ids", ())
        tools = g.tool_choice if isinstance(g, ChatRequest) else ToolChoice("none")
        jobs = []
        for i, tokens in enumerate(prompts):
            req = generate_request(g, tokens, model=m.name, max_tokens=max_tokens,
                                   request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                                   stop_token_ids=stops)
            choices = [Choice(i * g.n + k, tools=ToolStream(tools, m.tool_format))
                       for k in range(g.n)]
            jobs.append(Job(req, Served(rid, len(tokens)), choices, g.needs_program,
                            incremental=not g.stop, model=m))
        return jobs

    async def chat_jobs(self, body: Any, size: int,
                        parse: Callable[[Any], ChatRequest] = parse_chat
                        ) -> tuple[ChatRequest, list[Job]]:
        """A decoded chat body (``size`` bytes) as its one job: parsed (by ``parse``: a
        Messages body renders as a chat), its model checked, rendered and tokenized, its
        length checked; ApiError as the endpoint answers. kvroute epp reads the bodies a
        gateway forwards with it too (router/epp.py)."""
        req = parse(body)
        m = self.model_of(req)
        if req.tool_choice.mode == "auto" and m.tool_format is None \
                and self._cfg.http.tool_parser == "auto":
            raise ApiError(400, f"tool_choice: model {m.name!r} has no tool-call format "
                           f"kvroute reads (its chat template writes neither <tool_call> "
                           f"(hermes) nor <|python_tag|> (llama3_json)): start the router with "
                           f"--http-tool-parser hermes, llama3_json or none (calls left as "
                           f"text), or force a call with tool_choice", param="tool_choice")
        return req, self.make_jobs(req, [await self.render(req, size)])

    async def render(self, req: ChatRequest, size: int) -> list[int]:
        """``req``'s prompt ids: its model checked, rendered with the model's template, its
        length checked."""
        self.model_of(req)
        tokens = await self.off_loop(size, lambda: self.chat_tokens(req))
        self.check_length(tokens, "messages")
        return tokens

    def chat_tokens(self, req: ChatRequest) -> list[int]:
        chat = self.model_of(req).chat
        if chat is None:
            raise ApiError(400, "messages: this router has no chat template (start it with "
                           "--model NAME=SOURCE); send a prompt to /v1/completions",
                           param="messages")
        names = chat.template_names
        if req.chat_template is not None and req.chat_template not in names:
            # A template's text would be code the router runs (sandboxed, but unbounded in
            # time) and compiles once per distinct text: only the model's own, by name.
            raise ApiError(400, f"chat_template: name one of the model's templates "
                           f"({', '.join(names) or 'none'}); template text is not accepted",
                           param="chat_template")
        try:
            return list(chat.apply(
                req.messages, tools=req.tools, documents=req.documents,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs))
        except ChatTemplateError as exc:
            raise ApiError(400, f"messages: {exc}", param="messages") from None

    async def completion_jobs(self, body: Any) -> tuple[CompletionRequest, list[Job]]:
        """A decoded completions body as its jobs (one per prompt), checked and tokenized as
        :meth:`chat_jobs` does."""
        cfg = self._cfg
        req = parse_completion(body, cfg.http.max_generations)
        tok = self.model_of(req).tok
        prompts: list[Sequence[int]] = []
        total = 0
        for p in req.prompts:
            if isinstance(p, str):
                if tok is None:
                    raise ApiError(400, "prompt: this router has no tokenizer (--model "
                                   "NAME=SOURCE or --tokenizer); send token ids",
                                   param="prompt")
                p = await self.off_loop(len(p), lambda tok=tok, p=p: list(tok.encode(p)))
            if not p:
                raise ApiError(400, "prompt: the prompt is empty", param="prompt")
            self.check_length(p, "prompt")
            total += len(p)
            if total > cfg.http.max_batch_tokens:
                raise ApiError(413, f"prompt: the prompts hold more than "
                               f"{cfg.http.max_batch_tokens} tokens together "
                               "(--http-max-batch-tokens)", param="prompt")
            prompts.append(p)
        return req, self.make_jobs(req, prompts)

    # -- answers ---------------------------------------------------------------------------

    charge = staticmethod(charge_more)

    @staticmethod
    def refusal(exc: RefusedError, g: ChatRequest) -> ApiError:
        """A chat's refusal as its HTTP error."""
        return refusal_error(exc, "messages", g.program_params)

    def headers(self, jobs: Sequence[Job]) -> dict[str, str]:
        return {"x-kvroute-worker": ",".join(j.served.worker for j in jobs),
                "x-kvroute-cached-tokens": ",".join(str(j.served.cached_tokens) for j in jobs),
                "x-request-id": jobs[0].served.request_id}
