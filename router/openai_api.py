"""OpenAI's API on the router's HTTP port (:class:`~kvroute.router.http_front.HttpFront`):
``POST /v1/chat/completions`` and ``POST /v1/completions``.

A request is parsed (:mod:`kvroute.router.openai_schema`), its prompt rendered with the model's
chat template and tokenized by the front, and its jobs run through the router's one
generation path. Streaming is Server-Sent Events as OpenAI sends them (``data: {chunk}``
lines, ``data: [DONE]``).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from kvroute.router.api_error import ApiError, refusal_error
from kvroute.router.http_jobs import (
    Choice,
    Front,
    FrontModel,
    Job,
    collect_all,
    decode,
    reply,
    reply_delta,
    reply_end,
    run,
)
from kvroute.router.openai_schema import ChatRequest, CompletionRequest, Generation
from kvroute.router.refusal import RefusedError
from kvroute.router.sse import EventStream
from kvroute.router.tool_calls import ToolCall


def tool_call(t: ToolCall) -> dict[str, Any]:
    """A call as a chat message's ``tool_calls`` entry."""
    return {"id": "call_" + t.id, "type": "function",
            "function": {"name": t.name, "arguments": t.arguments}}


def finish(c: Choice, calls: Sequence[ToolCall]) -> str | None:
    """A choice's ``finish_reason``: ``tool_calls`` when it ended with calls."""
    return "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason


class OpenAIApi:
    """OpenAI's endpoints of one HTTP front (which owns models, limits and jobs)."""

    def __init__(self, front: Front) -> None:
        self._front = front

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        service = self._front.admit()
        try:
            req, jobs = await self._front.chat_jobs(*await self._front.read_body(request))
        except ApiError as exc:
            if 400 <= exc.status < 500:
                service.invalid("Generate", "http")
            raise
        self._front.charge(request, jobs)
        return await self._respond(request, req, jobs, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        service = self._front.admit()
        try:
            body, _ = await self._front.read_body(request)
            req, jobs = await self._front.completion_jobs(body)
        except ApiError as exc:
            if 400 <= exc.status < 500:
                service.invalid("Generate", "http")
            raise
        self._front.charge(request, jobs)
        return await self._respond(request, req, jobs, chat=False)

    async def _respond(self, request: web.Request, g: ChatRequest | CompletionRequest,
                       jobs: list[Job], *, chat: bool) -> web.StreamResponse:
        param = "messages" if chat else "prompt"
        if g.stream:
            return await self._stream(request, g, jobs, chat=chat, param=param)
        try:
            await collect_all(self._front.ready(), jobs, self._front.cfg.http.batch_concurrency)
        except RefusedError as exc:
            raise refusal_error(exc, param, g.program_params) from None
        body = self._completion_body(g, jobs, chat=chat)
        return web.json_response(body, headers=self._front.headers(jobs))

    def _usage(self, jobs: Sequence[Job]) -> dict[str, Any]:
        prompt = sum(j.served.prompt_tokens for j in jobs)
        completion = sum(j.served.completion_tokens for j in jobs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {
                    "cached_tokens": sum(j.served.cached_tokens for j in jobs)}}

    @staticmethod
    def _logprobs(c: Choice, chat: bool, m: FrontModel) -> dict[str, Any] | None:
        if c.logprobs is None or len(c.logprobs) != len(c.token_ids):
            return None
        pieces = [decode([t], m) for t in c.token_ids]
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
                text, calls = reply(c, job.model)
                lp = self._logprobs(c, chat, job.model) if g.logprobs else None
                if chat:
                    message: dict[str, Any] = {"role": "assistant",
                                               "content": text or (None if calls else "")}
                    if calls:
                        message["tool_calls"] = [tool_call(t) for t in calls]
                    choice: dict[str, Any] = {
                        "index": c.index, "message": message, "logprobs": lp,
                        "finish_reason": finish(c, calls)}
                else:
                    choice = {"index": c.index, "text": text, "logprobs": lp,
                              "finish_reason": c.finish_reason}
                if job.model.tok is None:
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
        sse = _Chunks(request, g, jobs[0].served.request_id, chat)
        for n, job in enumerate(jobs):
            try:
                # aclosing: a failed write (the client gone) ends the generation now.
                async with contextlib.aclosing(run(self._front.ready(), job)) as events:
                    async for kind, c in events:
                        if kind == "start":
                            await sse.start(job, self._front.headers([job]),
                                            hold=job.text_with_start)
                        elif kind == "delta":
                            assert c is not None
                            await sse.text(c, reply_delta(c, job.model))
                        else:
                            assert c is not None
                            lp = self._logprobs(c, chat, job.model) if g.logprobs else None
                            await sse.end(c, *reply_end(c, job.model), lp)
            except RefusedError as exc:
                err = refusal_error(exc, param, g.program_params)
                if sse.out.resp is None and n == 0:
                    raise err from None
                return await sse.fail(err)  # tokens were sent: the stream's last event
        return await sse.close(self._usage(jobs) if g.include_usage else None)


class _Chunks:
    """One response's OpenAI chunks as server-sent events."""

    def __init__(self, request: web.Request, g: Generation, rid: str, chat: bool) -> None:
        self._request, self._g, self._chat = request, g, chat
        self._base = {"id": ("chatcmpl-" if chat else "cmpl-") + rid,
                      "object": "chat.completion.chunk" if chat else "text_completion",
                      "created": int(time.time()), "model": g.model}
        self.out = EventStream()

    def _add(self, choice: dict[str, Any] | None, usage: dict[str, Any] | None = None,
             raw: dict[str, Any] | None = None) -> None:
        if raw is None:
            raw = {**self._base, "choices": [choice] if choice is not None else []}
            if self._g.include_usage:
                raw["usage"] = usage
        self.out.add(b"data: " + json.dumps(raw).encode() + b"\n\n")

    def _chunk(self, c: Choice, text: str, finish: str | None, first: bool = False,
               lp: dict[str, Any] | None = None) -> dict[str, Any]:
        if not self._chat:
            return {"index": c.index, "text": text, "logprobs": lp, "finish_reason": finish}
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first \
            else ({"content": text} if text else {})
        return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    async def start(self, job: Job, headers: dict[str, str], *, hold: bool) -> None:
        """A job's first response: the stream opens (at the first job), each chat choice's
        role goes (``hold``: with the next write)."""
        await self.out.open(self._request, headers)
        if self._chat:
            for ch in job.choices:
                self._add(self._chunk(ch, "", None, first=True))
        if not hold:
            await self.out.flush()

    async def text(self, c: Choice, text: str) -> None:
        if text:
            self._add(self._chunk(c, text, None))
        await self.out.flush()

    async def end(self, c: Choice, text: str, calls: Sequence[ToolCall],
                  lp: dict[str, Any] | None) -> None:
        """A choice's end: its last text (and log-probabilities), its tool calls, its
        finish reason."""
        if text or lp:
            self._add(self._chunk(c, text, None, lp=lp))
        if calls:
            self._add({"index": c.index, "delta": {"tool_calls": [
                {"index": k, **tool_call(t)} for k, t in enumerate(calls)]},
                "logprobs": None, "finish_reason": None})
        self._add(self._chunk(c, "", finish(c, calls)))
        await self.out.flush()

    async def fail(self, err: ApiError) -> web.StreamResponse:
        """The error as the stream's last event (vLLM's way), then [DONE]."""
        await self.out.open(self._request, {})
        self._add(None, raw=err.body())
        self.out.add(b"data: [DONE]\n\n")
        await self.out.flush()
        assert self.out.resp is not None
        return self.out.resp

    async def close(self, usage: dict[str, Any] | None) -> web.StreamResponse:
        """The usage chunk (with include_usage), then [DONE]."""
        if usage is not None:
            self._add(None, usage=usage)
        self.out.add(b"data: [DONE]\n\n")
        return await self.out.end()
