"""Anthropic's Messages API on the router's HTTP port: ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

A Messages request is parsed (:mod:`kvroute.router.anthropic_schema`) into the chat request
it renders as, and from there takes the chat front's path: the model's template and
tokenizer, the limits, the jobs, the one generation path. Only the shapes differ: the message
object, Anthropic's SSE events (``message_start``, ``content_block_start``, ``ping``,
``content_block_delta``, ``content_block_stop``, ``message_delta``, ``message_stop``; a
failure after the first event is an ``error`` event), its errors and its usage, where
``cache_read_input_tokens`` is the prompt tokens served from the worker's prefix cache and
``input_tokens`` the rest.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvroute.router.anthropic_schema import MessagesRequest, error_body, parse_messages
from kvroute.router.api_error import ApiError
from kvroute.router.http_jobs import (
    Choice,
    Front,
    Job,
    collect_all,
    reply,
    reply_delta,
    reply_end,
    run,
)
from kvroute.router.refusal import RefusedError
from kvroute.router.sse import EventStream
from kvroute.router.tool_calls import ToolCall

MESSAGES_PATH = "/v1/messages"


def stop_reason(c: Choice, calls: Sequence[ToolCall] = ()) -> str:
    """Anthropic's ``stop_reason`` for a finished choice (``calls``: its tool calls)."""
    if c.finish_reason == "length":
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if c.stop_hit else "end_turn"


def tool_use(t: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + t.id, "name": t.name, "input": t.input}


def content(text: str, calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """A message's content blocks: its text (unless empty before calls), its calls."""
    blocks = [{"type": "text", "text": text}] if text or not calls else []
    return blocks + [tool_use(t) for t in calls]


def usage(job: Job) -> dict[str, int]:
    s = job.served
    cached = min(s.cached_tokens, s.prompt_tokens)
    return {"input_tokens": s.prompt_tokens - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": s.completion_tokens}


def message(req: MessagesRequest, job: Job, blocks: Sequence[dict[str, Any]],
            stopped: Choice | None, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    """The message object (``stopped``: its choice once finished, else a stream's start)."""
    return {"id": "msg_" + job.served.request_id, "type": "message", "role": "assistant",
            "model": req.model, "content": list(blocks),
            "stop_reason": stop_reason(stopped, calls) if stopped else None,
            "stop_sequence": (stopped.stop_hit or None) if stopped and not calls else None,
            "usage": usage(job)}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


class _Blocks:
    """A stream's content blocks as events: a text block opened at its first text, each
    tool call a block of its own."""

    def __init__(self, out: EventStream) -> None:
        self._out = out
        self._count = 0
        self._text_open = False

    def text(self, text: str) -> None:
        if not text:
            return
        if not self._text_open:
            self._start({"type": "text", "text": ""})
            self._text_open = True
        self._out.add(_event("content_block_delta", {
            "index": self._count - 1, "delta": {"type": "text_delta", "text": text}}))

    def end(self, text: str, calls: Sequence[ToolCall]) -> None:
        """The last text and the calls; an empty text block when there is nothing else
        (as the message object has)."""
        self.text(text)
        if not self._count and not calls:
            self._start({"type": "text", "text": ""})
            self._text_open = True
        if self._text_open:
            self._stop()
        for t in calls:
            self._start({**tool_use(t), "input": {}})
            self._out.add(_event("content_block_delta", {
                "index": self._count - 1,
                "delta": {"type": "input_json_delta", "partial_json": t.arguments}}))
            self._stop()

    def _start(self, block: dict[str, Any]) -> None:
        self._out.add(_event("content_block_start",
                             {"index": self._count, "content_block": block}))
        self._count += 1

    def _stop(self) -> None:
        self._out.add(_event("content_block_stop", {"index": self._count - 1}))
        self._text_open = False


class MessagesApi:
    """The Messages endpoints of one HTTP front (which owns models, limits and jobs)."""

    def __init__(self, front: Front) -> None:
        self._front = front

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post(MESSAGES_PATH, self.create)
        app.router.add_post(MESSAGES_PATH + "/count_tokens", self.count_tokens)

    async def count_tokens(self, request: web.Request) -> web.Response:
        body, size = await self._front.read_body(request)
        req = parse_messages(body, counting=True)
        tokens = await self._front.render(req, size)
        return web.json_response({"input_tokens": len(tokens)})

    async def create(self, request: web.Request) -> web.StreamResponse:
        front = self._front
        service = front.admit()
        try:
            body, size = await front.read_body(request)
            req, jobs = await front.chat_jobs(body, size, parse=parse_messages)
        except ApiError as exc:
            if 400 <= exc.status < 500:
                service.invalid("Generate", "http")
            raise
        assert isinstance(req, MessagesRequest)
        front.charge(request, jobs)
        (job,) = jobs
        if req.stream:
            return await self._stream(request, req, job)
        try:
            await collect_all(front.ready(), jobs, 1)
        except RefusedError as exc:
            raise front.refusal(exc, req) from None
        (c,) = job.choices
        text, calls = reply(c, job.model)
        return web.json_response(message(req, job, content(text, calls), c, calls),
                                 headers=self._headers(job))

    def _headers(self, job: Job) -> dict[str, str]:
        return {**self._front.headers([job]), "request-id": "req_" + job.served.request_id}

    async def _stream(self, request: web.Request, req: MessagesRequest,
                      job: Job) -> web.StreamResponse:
        """Anthropic's event sequence: the text block, then a block per tool call; the
        usage in ``message_start`` holds the prompt's (the cache known at the first token),
        ``message_delta`` the output's."""
        out = EventStream()
        blocks = _Blocks(out)
        try:
            async with contextlib.aclosing(run(self._front.ready(), job)) as events:
                async for kind, c in events:
                    if kind == "start":
                        await out.open(request, self._headers(job))
                        out.add(_event("message_start",
                                       {"message": message(req, job, [], None)}))
                        out.add(_event("ping", {}))
                        if not job.text_with_start:
                            await out.flush()
                        continue
                    assert c is not None
                    if kind == "delta":
                        blocks.text(reply_delta(c, job.model))
                        await out.flush()
                        continue
                    text, calls = reply_end(c, job.model)
                    blocks.end(text, calls)
                    out.add(_event("message_delta", {
                        "delta": {"stop_reason": stop_reason(c, calls),
                                  "stop_sequence": (c.stop_hit or None) if not calls else None},
                        "usage": {"output_tokens": job.served.completion_tokens}}))
                    out.add(_event("message_stop", {}))
        except RefusedError as exc:
            err = self._front.refusal(exc, req)
            if out.resp is None:
                raise err from None
            # Text was sent: the failure is the stream's last event.
            out.add(_event("error", {"error": error_body(err)["error"]}))
            await out.flush()
            return out.resp
        return await out.end()
