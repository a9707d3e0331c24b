"""The router's OpenAI-compatible HTTP front (aiohttp), served beside its gRPC port.

``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``.
A request is parsed (:mod:`kvroute.router.openai_schema`), its prompt rendered with the model's
chat template and tokenized here, and the kvroute.v1 GenerateRequest it becomes goes through
the router's one generation path (``RouterService.generate``: the decider, coalescing,
retries, metrics with ``api="http"``, programs): no routing is decided here. The engine gets
token ids, so the router's block keys and the engine's cache hash the same ids.

Streaming is Server-Sent Events as OpenAI sends them (``data: {chunk}`` lines, ``data:
[DONE]``). A client that goes away cancels its handler (aiohttp's handler cancellation), which
closes the generation and so cancels the agent call: the engine frees the sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from kvroute.core.chat_template import ChatTemplateError
from kvroute.core.config import RouterConfig
from kvroute.core.ports import describe, refuse_port
from kvroute.core.tls import ServerContext, TlsConfig, TlsError
from kvroute.core.tokenizer import Tokenizer
from kvroute.router.auth import CHARGE_MORE
from kvroute.router.http_guard import ConnectionGuard
from kvroute.router.openai_schema import (
    STOP_CAPTURE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    Generation,
    check_generations,
    generate_request,
    parse_chat,
    parse_completion,
)
from kvroute.router.refusal import InvalidError, RefusedError, UnsupportedError
from kvroute.v1 import common_pb2, program_pb2

log = logging.getLogger("kvroute.router.http")

"""``Retry-After`` of a 503: workers come back within a heartbeat or two."""
SHUTDOWN_S = 2.0
"""How long a stopping router lets open HTTP streams finish before it cancels them."""
TOKENIZE_THREADS = 2
"""Threads that render and tokenize long prompts off the event loop (tokenizers releases the
GIL while it encodes, so they run beside the loop rather than stalling every other stream)."""
INLINE_BODY_BYTES = 4096
"""A request body up to this size is tokenized on the loop: its render + encode (~0.2 ms at
1k tokens) costs about what the hop to a thread and back does (~0.08 ms p50, more at p99)."""

# GenerateRequest fields (core/validate.py names them) as the request's fields.
_PARAMS = {"sampling.max_tokens": "max_tokens", "sampling.temperature": "temperature",
           "sampling.top_p": "top_p", "sampling.stop_token_ids": "stop", "model": "model",
           "cache_salt": "cache_salt", "request_id": None, "program.fanout": "n"}


class Generator(Protocol):
    """The router's generation path (``RouterService``)."""

    def generate(self, request: common_pb2.GenerateRequest, wire: bytes | None = None,
                 api: str = "grpc") -> AsyncIterator[common_pb2.GenerateResponse]: ...

    def invalid(self, method: str, api: str = "grpc") -> None: ...

    def admit(self, api: str) -> None:
        """RefusedError (``shed``) when the router is at ``--max-inflight`` now."""


class Workers(Protocol):
    """What /health reports of the router's pools (``PooledService``)."""

    def routable(self) -> Mapping[str, int]: ...


@dataclass(frozen=True)
class FrontModel:
    """A model the front serves (``--model``): its name and tokenizer (a ChatTokenizer when
    the model has a SOURCE)."""

    name: str
    tok: Tokenizer | None
    parent: str = ""
    """A LoRA adapter's base model (``--lora NAME=BASE``); empty for a model."""

    @property
    def chat(self) -> Any:
        """The chat tokenizer (``apply``, ``template_names``), or None."""
        return self.tok if hasattr(self.tok, "apply") else None


@dataclass
class Choice:
    """One choice's output so far."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    sent: str = ""
    """The text streamed so far (a UTF-8 character split across tokens waits for its end)."""
    cut_text: str | None = None
    """The agent's text before a stop string (:data:`STOP_CAPTURE`): when the stop begins
    inside a token, the ids leave that token out but this keeps its text before the stop."""


@dataclass
class Served:
    """Where a request ran and what it cost, from its responses."""

    request_id: str
    prompt_tokens: int
    worker: str = ""
    cached_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Job:
    """One prompt's generation: its request and the choices it fills.

    ``program``: it runs as a controller program, whose last response holds each choice's
    final tokens. ``incremental``: its tokens stream as they come (a program's too, unless
    stop strings may cut text already generated: then each choice comes at its end)."""

    request: common_pb2.GenerateRequest
    served: Served
    choices: list[Choice]
    program: bool
    incremental: bool
    model: FrontModel | None = None
    """The model it is for (None: the front's default)."""

    def restart(self) -> None:
        """Forget what an attempt produced, to run the request again."""
        self.served = Served(self.served.request_id, self.served.prompt_tokens)
        self.choices = [Choice(c.index) for c in self.choices]

    def choice_of(self, branch_id: str) -> Choice | None:
        """The choice a program's branch is: "0" for one, fork child "0.k" for choice k."""
        if len(self.choices) == 1:
            return self.choices[0] if branch_id == "0" else None
        head, _, k = branch_id.partition(".")
        if head == "0" and k.isdigit() and int(k) < len(self.choices):
            return self.choices[int(k)]
        return None


def _finish(reason: int | str) -> str:
    return "length" if reason in (common_pb2.FINISH_REASON_LENGTH, "length") else "stop"


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


def _charge(request: web.Request, jobs: Sequence[Job]) -> None:
    """Count a request's generations past its first against its API key's rate (the auth
    middleware, when keys are on, counted the first)."""
    more = sum(len(j.choices) for j in jobs) - 1
    charge = request.get(CHARGE_MORE)
    if charge is not None and more > 0:
        charge(more)


def refusal_error(exc: RefusedError, prompt_param: str,
                  program_params: Sequence[str] = ()) -> ApiError:
    """The HTTP error a refusal of the generation path is: its type's status and code, the
    parameter its field is. ``program_params``: the request's fields that made it a program
    (:attr:`Generation.program_params`); a refused program not about one field names the
    first."""
    param: str | None = None
    if isinstance(exc, InvalidError):
        param = _PARAMS.get(exc.field, prompt_param) if exc.field else None
    elif isinstance(exc, UnsupportedError):
        param = _PARAMS[exc.field] if exc.field in _PARAMS else \
            (program_params[0] if program_params else None)
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    return ApiError(exc.http_status, exc.message, param=param, code=exc.error_code,
                    headers=headers)


class OpenAIFront:
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
        self._models = {name: FrontModel(name, tok) for name, tok in
                        (models or {cfg.model.name: tokenizer}).items()}
        self._default = next(iter(self._models.values()))
        for name, base in (adapters or {}).items():
            self._models[name] = FrontModel(name, self._models[base].tok, parent=base)
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

    # -- lifecycle ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._cfg.http.max_body_bytes,
                              middlewares=[self._errors, *self._middlewares])
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
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

    # -- errors ------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every error in OpenAI's shape: ours, aiohttp's (404 path, 405, 413 body), and an
        unexpected one (500, logged)."""
        try:
            return await handler(request)
        except ApiError as exc:
            return self._error(exc)
        except web.HTTPRequestEntityTooLarge:
            return self._error(ApiError(
                413, f"the request body exceeds the limit of {self._cfg.http.max_body_bytes} "
                "bytes (--http-max-body-bytes)", code="request_too_large"))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return self._error(ApiError(exc.status, f"{request.method} {request.path}: "
                                        f"{exc.reason}", code=exc.reason.lower().replace(" ", "_")))
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:
            log.exception("HTTP front: unexpected error", extra={"kv": {"path": request.path}})
            return self._error(ApiError(500, "internal error (logged by the router)",
                                        code="internal_error"))

    @staticmethod
    def _error(exc: ApiError) -> web.Response:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)

    # -- small endpoints ---------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
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

    # -- generation --------------------------------------------------------------------------

    async def _body(self, request: web.Request) -> tuple[Any, int]:
        """The parsed body and its size in bytes."""
        raw = await request.read()  # HTTPRequestEntityTooLarge past client_max_size
        return decode_body(raw), len(raw)

    def _ready(self) -> Generator:
        if self._service is None:
            raise ApiError(503, "the router is starting", headers={"Retry-After": "1"})
        return self._service

    def _admit(self) -> Generator:
        """The generation path, unless the router sheds this request now (429, before its
        body is read and tokenized; the generation path counts and enforces the limit)."""
        service = self._ready()
        try:
            service.admit("http")
        except RefusedError as exc:
            raise refusal_error(exc, "") from None
        return service

    def _check_model(self, g: Generation) -> FrontModel:
        """The model ``g`` names; 404 ``model_not_found`` if it is not served here."""
        m = self._models.get(g.model)
        if m is None:
            raise ApiError(404, f"The model `{g.model}` does not exist (this router serves "
                           f"{', '.join(map(repr, self._models))}; see /v1/models)",
                           param="model", code="model_not_found")
        return m

    async def _off_loop(self, size: int, work: Callable[[], list[int]]) -> list[int]:
        """``work()`` (render and/or tokenize a prompt from a body of ``size`` bytes): on the
        loop when small, else on the tokenizing threads."""
        if size <= INLINE_BODY_BYTES or self._pool is None:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._pool, work)

    def _max_tokens(self, g: Generation) -> int:
        cfg = self._cfg
        if g.max_tokens is not None and g.max_tokens > cfg.limits.max_new_tokens:
            raise ApiError(400, f"max_tokens: {g.max_tokens} exceeds the limit of "
                           f"{cfg.limits.max_new_tokens} (--max-new-tokens)", param="max_tokens")
        return g.max_tokens if g.max_tokens is not None else min(cfg.http.max_tokens,
                                                                  cfg.limits.max_new_tokens)

    def _check_length(self, tokens: Sequence[int], param: str) -> None:
        limit = self._cfg.limits.max_prompt_tokens
        if len(tokens) > limit:
            raise ApiError(413, f"{param}: the prompt is {len(tokens)} tokens, over the limit "
                           f"of {limit} tokens (--max-prompt-tokens)", param=param,
                           code="context_length_exceeded")

    def _jobs(self, g: Generation, prompts: Sequence[Sequence[int]]) -> list[Job]:
        check_generations(len(prompts), g.n, self._cfg.http.max_generations)
        rid = uuid.uuid4().hex
        max_tokens = self._max_tokens(g)
        m = self._check_model(g)
        stops = getattr(m.tok, "stop_token_ids", ())
        jobs = []
        for i, tokens in enumerate(prompts):
            req = generate_request(g, tokens, model=m.name, max_tokens=max_tokens,
                                   request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                                   stop_token_ids=stops)
            jobs.append(Job(req, Served(rid, len(tokens)),
                            [Choice(i * g.n + k) for k in range(g.n)], g.needs_program,
                            incremental=not g.stop, model=m))
        return jobs

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        service = self._admit()
        try:
            req, jobs = await self.chat_jobs(*await self._body(request))
        except ApiError as exc:
            if 400 <= exc.status < 500:
                service.invalid("Generate", "http")
            raise
        _charge(request, jobs)
        return await self._respond(request, req, jobs, chat=True)

    async def chat_jobs(self, body: Any, size: int) -> tuple[ChatRequest, list[Job]]:
        """A decoded chat body (``size`` bytes) as its one job: parsed, its model checked,
        rendered and tokenized, its length checked; ApiError as the endpoint answers. kvroute
        epp reads the bodies a gateway forwards with it too (router/epp.py)."""
        req = parse_chat(body)
        self._check_model(req)
        tokens = await self._off_loop(size, lambda: self._chat_tokens(req))
        self._check_length(tokens, "messages")
        return req, self._jobs(req, [tokens])

    def _chat_tokens(self, req: ChatRequest) -> list[int]:
        chat = self._check_model(req).chat
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

    async def completions(self, request: web.Request) -> web.StreamResponse:
        service = self._admit()
        try:
            body, _ = await self._body(request)
            req, jobs = await self.completion_jobs(body)
        except ApiError as exc:
            if 400 <= exc.status < 500:
                service.invalid("Generate", "http")
            raise
        _charge(request, jobs)
        return await self._respond(request, req, jobs, chat=False)

    async def completion_jobs(self, body: Any) -> tuple[CompletionRequest, list[Job]]:
        """A decoded completions body as its jobs (one per prompt), checked and tokenized as
        :meth:`chat_jobs` does."""
        cfg = self._cfg
        req = parse_completion(body, cfg.http.max_generations)
        tok = self._check_model(req).tok
        prompts: list[Sequence[int]] = []
        total = 0
        for p in req.prompts:
            if isinstance(p, str):
                if tok is None:
                    raise ApiError(400, "prompt: this router has no tokenizer (--model "
                                   "NAME=SOURCE or --tokenizer); send token ids",
                                   param="prompt")
                p = await self._off_loop(len(p), lambda tok=tok, p=p: list(tok.encode(p)))
            if not p:
                raise ApiError(400, "prompt: the prompt is empty", param="prompt")
            self._check_length(p, "prompt")
            total += len(p)
            if total > cfg.http.max_batch_tokens:
                raise ApiError(413, f"prompt: the prompts hold more than "
                               f"{cfg.http.max_batch_tokens} tokens together "
                               "(--http-max-batch-tokens)", param="prompt")
            prompts.append(p)
        return req, self._jobs(req, prompts)

    # -- running jobs ------------------------------------------------------------------------

    def _decode(self, ids: Sequence[int], m: FrontModel | None) -> str:
        """``ids``' text in model ``m``'s tokenizer (None: the default model)."""
        tok = (m or self._default).tok
        if tok is None:
            return ""
        if hasattr(tok, "apply"):  # a model's own tokenizer: its special tokens left out
            return tok.decode(ids, skip_special_tokens=True)  # type: ignore[call-arg]
        return tok.decode(ids)

    def _text(self, c: Choice, m: FrontModel | None) -> str:
        """``c``'s text: its tokens', or the agent's cut at a stop string where that goes on
        past them (a stop that begins inside a token)."""
        text = self._decode(c.token_ids, m)
        if c.cut_text is not None and c.cut_text.startswith(text):
            return c.cut_text
        return text

    def _new_text(self, c: Choice, m: FrontModel | None) -> str:
        """The text of ``c``'s tokens not streamed yet, short of a trailing partial
        character."""
        text = self._text(c, m)
        if text.endswith("\ufffd") and c.finish_reason is None:
            return ""
        if not text.startswith(c.sent):  # a decoder that rewrites earlier text: resend all
            return ""
        new = text[len(c.sent):]
        c.sent = text
        return new

    async def _run(self, job: Job) -> AsyncIterator[tuple[str, Choice | None]]:
        """Run ``job`` through the generation path, yielding ("start", None) at its first
        response, ("delta", choice) as a plain request's tokens arrive and ("done", choice)
        for each finished choice. Raises RefusedError."""
        service = self._ready()
        s = job.served
        finish: dict[str, str] = {}
        started = False
        async with contextlib.aclosing(service.generate(job.request, None, "http")) as stream:
            async for resp in stream:
                if not started:
                    started = True
                    s.worker, s.cached_tokens = resp.worker_id, resp.cached_tokens
                    yield "start", None
                if not job.program:
                    c = job.choices[0]
                    c.token_ids.extend(resp.token_ids)
                    if resp.HasField("usage"):
                        s.cached_tokens = resp.usage.cached_tokens or s.cached_tokens
                        s.completion_tokens = resp.usage.completion_tokens
                    if resp.finish_reason:
                        c.finish_reason = _finish(resp.finish_reason)
                    if resp.token_ids or c.finish_reason:
                        yield "delta", c
                    continue
                for ev in resp.events:
                    if ev.kind == program_pb2.ProgramEvent.KIND_GEN_END:
                        finish[resp.branch_id] = ev.reason
                if job.incremental and resp.token_ids and not resp.results:
                    c = job.choice_of(resp.branch_id)
                    if c is not None:
                        c.token_ids.extend(resp.token_ids)
                        yield "delta", c
                if resp.results:
                    for r in resp.results:
                        c = job.choice_of(r.branch_id)
                        if c is None or not r.selected:
                            continue
                        c.token_ids = list(r.token_ids)
                        if STOP_CAPTURE in r.variables:
                            c.cut_text = r.variables[STOP_CAPTURE].text
                        c.logprobs = list(r.token_logprobs)
                        c.finish_reason = _finish(finish.get(r.branch_id, "stop"))
                        s.completion_tokens += len(r.token_ids)  # forced ones too
                        s.cached_tokens = max(s.cached_tokens, r.cached_tokens)
        if not job.program:
            c = job.choices[0]
            if c.finish_reason is None:
                c.finish_reason = "stop"
                yield "delta", c
            if not s.completion_tokens:
                s.completion_tokens = len(c.token_ids)
        for c in job.choices:
            if c.finish_reason is None:
                c.finish_reason = "stop"
            yield "done", c

    async def _collect(self, job: Job) -> None:
        """Run a non-streaming ``job`` to its end. Nothing reaches the client before then, so
        a worker failing after its first tokens costs one more attempt (decided anew, the
        tokens so far dropped), not the request; the generation path already retries a
        worker that fails before them."""
        try:
            async for _ in self._run(job):
                pass
        except RefusedError as exc:
            if not exc.midstream:
                raise
            log.warning("worker failed mid-generation of a non-streaming request; nothing "
                        "reached the client, so it runs again", extra={"kv": {
                            "request": job.served.request_id, "worker": job.served.worker,
                            "tokens_dropped": exc.sent, "error": exc.message}})
            job.restart()
            async for _ in self._run(job):
                pass

    async def _respond(self, request: web.Request, g: ChatRequest | CompletionRequest,
                       jobs: list[Job], *, chat: bool) -> web.StreamResponse:
        param = "messages" if chat else "prompt"
        if g.stream:
            return await self._stream(request, g, jobs, chat=chat, param=param)
        try:
            if len(jobs) == 1:
                await self._collect(jobs[0])
            else:
                pool = asyncio.Semaphore(self._cfg.http.batch_concurrency)

                async def bounded(job: Job) -> None:
                    async with pool:
                        await self._collect(job)
                async with asyncio.TaskGroup() as tg:
                    for job in jobs:
                        tg.create_task(bounded(job))
        except RefusedError as exc:
            raise refusal_error(exc, param, g.program_params) from None
        except ExceptionGroup as group:  # several prompts: the first refusal speaks for all
            refused = [e for e in group.exceptions if isinstance(e, RefusedError)]
            if not refused:
                raise
            raise refusal_error(refused[0], param, g.program_params) from None
        body = self._completion_body(g, jobs, chat=chat)
        return web.json_response(body, headers=self._headers(jobs))

    def _headers(self, jobs: Sequence[Job]) -> dict[str, str]:
        return {"x-kvroute-worker": ",".join(j.served.worker for j in jobs),
                "x-kvroute-cached-tokens": ",".join(str(j.served.cached_tokens) for j in jobs),
                "x-request-id": jobs[0].served.request_id}

    def _usage(self, jobs: Sequence[Job]) -> dict[str, Any]:
        prompt = sum(j.served.prompt_tokens for j in jobs)
        completion = sum(j.served.completion_tokens for j in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(j.served.cached_tokens for j in jobs)}}

    def _logprobs(self, c: Choice, chat: bool, m: FrontModel | None
                  ) -> dict[str, Any] | None:
        if c.logprobs is None or len(c.logprobs) != len(c.token_ids):
            return None
        pieces = [self._decode([t], m) for t in c.token_ids]
        if chat:
            # A token that is part of a character decodes to U+FFFD: its bytes are unknown.
            return {"content": [{"token": p, "logprob": lp,
                                 "bytes": None if "\ufffd" in p else list(p.encode()),
                                 "top_logprobs": []}
                                for p, lp in zip(pieces, c.logprobs, strict=True)]}
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        return {"tokens": pieces, "token_logprobs": c.logprobs,
                "top_logprobs": [{p: lp} for p, lp in zip(pieces, c.logprobs, strict=True)],
                "text_offset": offsets}

    def _completion_body(self, g: Generation, jobs: Sequence[Job], *,
                         chat: bool) -> dict[str, Any]:
        rid = jobs[0].served.request_id
        choices = []
        for job in jobs:
            for c in job.choices:
                text = self._text(c, job.model)
                lp = self._logprobs(c, chat, job.model) if g.logprobs else None
                if chat:
                    choice: dict[str, Any] = {
                        "index": c.index, "message": {"role": "assistant", "content": text},
                        "logprobs": lp, "finish_reason": c.finish_reason}
                else:
                    choice = {"index": c.index, "text": text, "logprobs": lp,
                              "finish_reason": c.finish_reason}
                if (job.model or self._default).tok is None:
                    choice["token_ids"] = c.token_ids  # a token-id router cannot detokenize
                choices.append(choice)
        return {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": g.model, "choices": choices,
                "usage": self._usage(jobs)}

    async def _stream(self, request: web.Request, g: Generation, jobs: list[Job], *,
                      chat: bool, param: str) -> web.StreamResponse:
        """SSE as OpenAI streams: with chat, each choice's first chunk carries its role;
        a choice's last chunk its finish_reason; with include_usage every chunk has
        ``usage: null`` and a last chunk has the usage and no choices. The prompts of a
        batched completion run one after another."""
        rid = jobs[0].served.request_id
        base = {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": g.model}
        resp: web.StreamResponse | None = None

        async def send(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None,
                       raw: dict[str, Any] | None = None) -> None:
            assert resp is not None
            if raw is None:
                raw = {**base, "choices": [choice] if choice is not None else []}
                if g.include_usage:
                    raw["usage"] = usage
            await resp.write(b"data: " + json.dumps(raw).encode() + b"\n\n")

        def chunk(c: Choice, text: str, finish: str | None, first: bool = False,
                  lp: dict[str, Any] | None = None) -> dict[str, Any]:
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": text} if first \
                    else ({"content": text} if text else {})
                return {"index": c.index, "delta": delta, "logprobs": lp,
                        "finish_reason": finish}
            return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}

        for n, job in enumerate(jobs):
            try:
                # aclosing: a failed write (the client gone) ends the generation now.
                async with contextlib.aclosing(self._run(job)) as events:
                    async for kind, c in events:
                        if kind == "start":
                            if resp is None:
                                resp = web.StreamResponse(headers={
                                    "content-type": "text/event-stream",
                                    "cache-control": "no-cache", **self._headers([job])})
                                await resp.prepare(request)
                            if chat:
                                for ch in job.choices:
                                    await send(chunk(ch, "", None, first=True))
                            continue
                        assert c is not None
                        if kind == "delta":
                            text = self._new_text(c, job.model)
                            if text:
                                await send(chunk(c, text, None))
                        elif kind == "done":
                            text = self._new_text(c, job.model)  # the last tokens' text
                            lp = self._logprobs(c, chat, job.model) if g.logprobs else None
                            if text or lp:
                                await send(chunk(c, text, None, lp=lp))
                            await send(chunk(c, "", c.finish_reason))
            except RefusedError as exc:
                err = refusal_error(exc, param, g.program_params)
                if resp is None:
                    if n == 0:
                        raise err from None
                    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                    await resp.prepare(request)
                # Tokens were sent: the error is the stream's last event (vLLM's way).
                await send(None, raw=err.body())
                await resp.write(b"data: [DONE]\n\n")
                return resp
        assert resp is not None
        if g.include_usage:
            await send(None, usage=self._usage(jobs))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
