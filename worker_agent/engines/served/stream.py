"""What the HTTP streams of inference servers share: :class:`Chunk` (one piece of a
generation, as an adapter's client yields it) and the server-sent-events reader."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from kvroute.worker_agent.engines.base import EngineError


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    cached_tokens: int | None = None  # the server's exact hit, on the usage chunk (last)
    prompt_tokens: int | None = None
    usage: bool = False  # the final usage chunk
    logprobs: tuple[float, ...] | None = None  # of token_ids, when asked for


def json_object(data: str, product: str) -> dict[str, Any]:
    """One streamed ``data:`` payload as a JSON object; EngineError naming ``product`` when
    it is not one."""
    try:
        obj = json.loads(data)
    except json.JSONDecodeError as exc:
        raise EngineError(f"{product} sent a non-JSON stream chunk: {data[:200]!r}") from exc
    if not isinstance(obj, dict):
        raise EngineError(f"{product} sent an unexpected stream chunk: {data[:200]!r}")
    return obj


def error_text(text: str) -> str:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text[:300]
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:300]
        if "message" in obj:
            return str(obj["message"])[:300]
    return text[:300]


async def sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event (multi-line data joined with newlines)."""
    buf: list[str] = []
    async for line in resp.aiter_lines():
        if not line:
            if buf:
                yield "\n".join(buf)
                buf = []
            continue
        if line.startswith(":"):
            continue  # comment / keep-alive
        name, _, value = line.partition(":")
        if name == "data":
            buf.append(value[1:] if value.startswith(" ") else value)
    if buf:
        yield "\n".join(buf)
