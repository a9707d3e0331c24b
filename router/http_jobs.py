"""A generation as the HTTP fronts run it: its jobs (one per prompt), their choices, and the
running of a job through the router's generation path (``RouterService.generate``), whose
responses fill the choices. What a front sends (OpenAI's chunks, Anthropic's events) is the
front's; what was generated, where, and from how much cache is here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from kvroute.core.tokenizer import Tokenizer
from kvroute.router.api_error import ApiError
from kvroute.router.openai_schema import STOP_CAPTURE, ChatRequest, CompletionRequest
from kvroute.router.refusal import RefusedError, UnavailableError
from kvroute.router.tool_calls import ToolCall, ToolFormat, ToolStream, split
from kvroute.v1 import common_pb2, program_pb2

if TYPE_CHECKING:
    from aiohttp import web

    from kvroute.core.config import RouterConfig

log = logging.getLogger("kvroute.router.http")


class Generator(Protocol):
    """The router's generation path (``RouterService``)."""

    def generate(self, request: common_pb2.GenerateRequest, wire: bytes | None = None,
                 api: str = "grpc") -> AsyncIterator[common_pb2.GenerateResponse]: ...

    def invalid(self, method: str, api: str = "grpc") -> None: ...

    def admit(self, api: str) -> None:
        """RefusedError (``shed``) when the router is at ``--max-inflight`` now."""


@dataclass(frozen=True)
class FrontModel:
    """A model the front serves (``--model``): its name and tokenizer (a ChatTokenizer when
    the model has a SOURCE)."""

    name: str
    tok: Tokenizer | None
    parent: str = ""
    """A LoRA adapter's base model (``--lora NAME=BASE``); empty for a model."""
    tool_format: ToolFormat | None = None
    """How the model writes tool calls (``--http-tool-parser``; None: it is not known)."""

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
    window: tuple[int, int] | None = (0, 0)
    """Incremental decoding (:func:`unsent_text`): the tokens ``[lo, hi)`` already streamed
    that the next ones are decoded after, as their context. None once the tokens were
    replaced (a program's results): its text is then decoded whole."""
    cut_text: str | None = None
    """The agent's text before a stop string (:data:`STOP_CAPTURE`): when the stop begins
    inside a token, the ids leave that token out but this keeps its text before the stop."""
    stop_hit: str = ""
    """The stop string that ended it (a program's; "" when none did)."""
    tools: ToolStream = field(default_factory=ToolStream)
    """Its output split into text and tool calls (none unless a chat gave tools)."""


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
    model: FrontModel

    @property
    def text_with_start(self) -> bool:
        """Whether the first response's text (if any) comes with its start, as a plain
        request's does: a front may send its opening events with that text."""
        return self.incremental and not self.program

    def restart(self) -> None:
        """Forget what an attempt produced, to run the request again."""
        self.served = Served(self.served.request_id, self.served.prompt_tokens)
        self.choices = [Choice(c.index, tools=c.tools.again()) for c in self.choices]

    def choice_of(self, branch_id: str) -> Choice | None:
        """The choice a program's branch is: "0" for one, fork child "0.k" for choice k."""
        if len(self.choices) == 1:
            return self.choices[0] if branch_id == "0" else None
        head, _, k = branch_id.partition(".")
        if head == "0" and k.isdigit() and int(k) < len(self.choices):
            return self.choices[int(k)]
        return None


class Front(Protocol):
    """What an API's endpoints need of the HTTP front that serves them (``HttpFront``):
    admission, the body, requests made jobs, the answers' common parts."""

    @property
    def cfg(self) -> RouterConfig: ...

    def admit(self) -> Generator: ...

    def ready(self) -> Generator: ...

    async def read_body(self, request: web.Request) -> tuple[Any, int]: ...

    async def chat_jobs(self, body: Any, size: int,
                        parse: Callable[[Any], ChatRequest] = ...
                        ) -> tuple[ChatRequest, list[Job]]: ...

    async def completion_jobs(self, body: Any) -> tuple[CompletionRequest, list[Job]]: ...

    async def render(self, req: ChatRequest, size: int) -> list[int]: ...

    def charge(self, request: web.Request, jobs: Sequence[Job]) -> None: ...

    def refusal(self, exc: RefusedError, g: ChatRequest) -> ApiError: ...

    def headers(self, jobs: Sequence[Job]) -> dict[str, str]: ...


def finish_reason(reason: int | str) -> str:
    """A response's or a program's finish reason as the HTTP APIs word it: ``length`` when
    max_tokens ended it, else ``stop``."""
    return "length" if reason in (common_pb2.FINISH_REASON_LENGTH, "length") else "stop"


def decode(ids: Sequence[int], m: FrontModel) -> str:
    """``ids``' text in model ``m``'s tokenizer ("" without one)."""
    tok = m.tok
    if tok is None:
        return ""
    if hasattr(tok, "apply"):  # a model's own tokenizer: its special tokens left out
        return tok.decode(ids, skip_special_tokens=True)  # type: ignore[call-arg]
    return tok.decode(ids)


def choice_text(c: Choice, m: FrontModel) -> str:
    """``c``'s text: its tokens', or the agent's cut at a stop string where that goes on
    past them (a stop that begins inside a token)."""
    text = decode(c.token_ids, m)
    if c.cut_text is not None and c.cut_text.startswith(text):
        return c.cut_text
    return text


def unsent_text(c: Choice, m: FrontModel) -> str:
    """The text of ``c``'s tokens not streamed yet, short of a trailing partial character.

    Tokens that only grew are decoded incrementally, as vLLM's detokenizer does: the new
    ones after the ones streamed last time (their context: a tokenizer may write a token
    differently after others, such as a word's leading space), not the whole output again,
    which would cost each token time in proportion to the output so far."""
    if c.window is not None and c.cut_text is None:
        lo, hi = c.window
        ids = c.token_ids
        if len(ids) == hi:
            return ""
        before, text = decode(ids[lo:hi], m), decode(ids[lo:], m)
        if text.endswith("\ufffd") and c.finish_reason is None:
            return ""  # a character not complete yet: decoded with the tokens that end it
        if text.startswith(before):
            new = text[len(before):]
            c.window = (hi, len(ids))
            c.sent += new
            return new
        c.window = None  # the new tokens rewrote earlier text: whole from now on
    text = choice_text(c, m)
    if text.endswith("\ufffd") and c.finish_reason is None:
        return ""
    if not text.startswith(c.sent):  # a decoder that rewrites earlier text: resend all
        return ""
    new = text[len(c.sent):]
    c.sent = text
    return new


def reply(c: Choice, m: FrontModel) -> tuple[str, list[ToolCall]]:
    """A finished choice's whole output: its text and tool calls."""
    return split(choice_text(c, m), c.tools)


def reply_delta(c: Choice, m: FrontModel) -> str:
    """The text to stream of ``c``'s new tokens (short of what may begin a tool call)."""
    return c.tools.feed(unsent_text(c, m))


def reply_end(c: Choice, m: FrontModel) -> tuple[str, list[ToolCall]]:
    """A streamed choice's end: the text not streamed yet, and its tool calls."""
    text = reply_delta(c, m)
    rest, calls = c.tools.finish()
    return text + rest, calls


async def run(service: Generator, job: Job) -> AsyncIterator[tuple[str, Choice | None]]:
    """Run ``job`` through the generation path, yielding ("start", None) at its first
    response, ("delta", choice) as a choice's tokens arrive and ("done", choice) for each
    finished choice. Raises RefusedError."""
    s = job.served
    ends: dict[str, program_pb2.ProgramEvent] = {}  # each program branch's GEN_END
    started = False
    async with contextlib.aclosing(service.generate(job.request, None, "http")) as stream:
        async for resp in stream:
            if not started:
                started = True
                s.worker, s.cached_tokens = resp.worker_id, resp.cached_tokens
                yield "start", None
            for c in (_take_program(job, resp, ends) if job.program else _take_plain(job, resp)):
                yield "delta", c
    for kind, c in _ended(job):
        yield kind, c


def _take_plain(job: Job, resp: common_pb2.GenerateResponse) -> list[Choice]:
    """A plain request's response into its one choice; the choice if it changed."""
    s, c = job.served, job.choices[0]
    c.token_ids.extend(resp.token_ids)
    if resp.HasField("usage"):
        s.cached_tokens = resp.usage.cached_tokens or s.cached_tokens
        s.completion_tokens = resp.usage.completion_tokens
    if resp.finish_reason:
        c.finish_reason = finish_reason(resp.finish_reason)
    return [c] if resp.token_ids or c.finish_reason else []


def _take_program(job: Job, resp: common_pb2.GenerateResponse,
                  ends: dict[str, program_pb2.ProgramEvent]) -> list[Choice]:
    """A program's response: a branch's gen ending, its tokens as they come (incremental
    jobs), and at the end each selected branch's final tokens into its choice. The choices
    whose tokens came as they did."""
    for ev in resp.events:
        if ev.kind == program_pb2.ProgramEvent.KIND_GEN_END:
            ends[resp.branch_id] = ev
    if job.incremental and resp.token_ids and not resp.results:
        c = job.choice_of(resp.branch_id)
        if c is not None:
            c.token_ids.extend(resp.token_ids)
            return [c]
    s = job.served
    for r in resp.results:
        c = job.choice_of(r.branch_id)
        if c is None or not r.selected:
            continue
        c.token_ids, c.window = list(r.token_ids), None
        if STOP_CAPTURE in r.variables:
            c.cut_text = r.variables[STOP_CAPTURE].text
        c.logprobs = list(r.token_logprobs)
        end = ends.get(r.branch_id)
        c.finish_reason = finish_reason(end.reason if end else "stop")
        if end is not None and end.reason == "stop":
            c.stop_hit = end.value
        s.completion_tokens += len(r.token_ids)  # forced ones too
        s.cached_tokens = max(s.cached_tokens, r.cached_tokens)
    return []


def _ended(job: Job) -> list[tuple[str, Choice]]:
    """The events of a job whose responses ended: a plain request's last delta when it gave
    no finish reason, then each choice done (``stop`` unless it said otherwise)."""
    out: list[tuple[str, Choice]] = []
    if not job.program:
        c = job.choices[0]
        if c.finish_reason is None:
            c.finish_reason = "stop"
            out.append(("delta", c))
        if not job.served.completion_tokens:
            job.served.completion_tokens = len(c.token_ids)
    for c in job.choices:
        if c.finish_reason is None:
            c.finish_reason = "stop"
        out.append(("done", c))
    return out


async def collect(service: Generator, job: Job) -> None:
    """Run a non-streaming ``job`` to its end. Nothing reaches the client before then, so
    a worker failing after its first tokens costs one more attempt (decided anew, the
    tokens so far dropped), not the request; the generation path already retries a
    worker that fails before them."""
    try:
        async for _ in run(service, job):
            pass
    except RefusedError as exc:
        if not (exc.midstream and isinstance(exc, UnavailableError)):
            raise  # not a worker's failure mid-stream: another run fails alike
        log.warning("worker failed mid-generation of a non-streaming request; nothing "
                    "reached the client, so it runs again", extra={"kv": {
                        "request": job.served.request_id, "worker": job.served.worker,
                        "tokens_dropped": exc.sent, "error": exc.message}})
        job.restart()
        async for _ in run(service, job):
            pass


async def collect_all(service: Generator, jobs: Sequence[Job], concurrency: int) -> None:
    """Run non-streaming ``jobs`` to their ends, at most ``concurrency`` at once. Raises the
    first RefusedError of any (it speaks for all)."""
    if len(jobs) == 1:
        await collect(service, jobs[0])
        return
    pool = asyncio.Semaphore(concurrency)

    async def bounded(job: Job) -> None:
        async with pool:
            await collect(service, job)
    try:
        async with asyncio.TaskGroup() as tg:
            for job in jobs:
                tg.create_task(bounded(job))
    except ExceptionGroup as group:
        refused = [e for e in group.exceptions if isinstance(e, RefusedError)]
        if not refused:
            raise
        raise refused[0] from None
