"""What the HTTP streams of inference servers share: :class:`Chunk` (one piece of a
generation, as an adapter's client yields it), the server-sent-events reader and
:class:`ServerHttp`, the HTTP client an adapter streams generations with."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvroute.worker_agent.engines.base import EngineError, RequestRefusedError


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


async def sse_data(pieces: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event in a stream of bytes, cut anywhere (multi-line
    data joined with newlines). No line is too long: a vLLM chunk echoing a 1M-token prompt's
    ids is one line of megabytes."""
    buf: list[str] = []
    partial: list[bytes] = []
    async for piece in pieces:
        partial.append(piece)
        if b"\n" not in piece:
            continue
        *lines, rest = b"".join(partial).split(b"\n")
        partial = [rest] if rest else []
        for raw in lines:
            if (data := _sse_line(raw, buf)) is not None:
                yield data
    if partial:
        _sse_line(b"".join(partial), buf)
    if buf:
        yield "\n".join(buf)


def _sse_line(raw: bytes, buf: list[str]) -> str | None:
    """One line of an event stream: a ``data`` field's value into ``buf``; at the blank
    line that ends an event, its data (``buf`` emptied). Comments and other fields are
    skipped."""
    line = raw.decode("utf-8", "replace").removesuffix("\r")
    if not line:
        data = "\n".join(buf) if buf else None
        buf.clear()
        return data
    name, _, value = line.partition(":")
    if name == "data":
        buf.append(value.removeprefix(" "))
    return None


class ServerHttp:
    """An inference server's HTTP API, as an adapter calls it: streamed generations
    (:meth:`events`) and small JSON reads (:meth:`get`).

    aiohttp rather than httpx: on loopback its streamed request takes ~0.7 ms of CPU against
    httpx's ~1.7 ms, and its first event arrives ~0.45 ms sooner; the agent shares its core
    with the router on small machines, and every request and token pays it. The session is
    opened on first use, inside the event loop that uses it.

    ``product`` names the server in errors; ``request_caused``: HTTP statuses that are the
    request's own doing (raised as :class:`RequestRefusedError` with that gRPC code)."""

    def __init__(self, base_url: str, product: str, request_caused: Mapping[int, str], *,
                 connect_timeout_s: float = 5.0, read_timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._product, self._request_caused = product, request_caused
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                              sock_read=read_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, limit_per_host=0), timeout=self._timeout)
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def get(self, path: str, timeout_s: float = 5.0) -> tuple[int, str] | None:
        """(status, body) of ``GET path``; None when the server does not answer."""
        try:
            async with self._open().get(self.base_url + path, timeout=aiohttp.ClientTimeout(
                    total=timeout_s)) as resp:
                return resp.status, await resp.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError):
            return None

    async def events(self, path: str, body: dict[str, Any],
                     headers: Mapping[str, str] | None = None) -> AsyncIterator[str]:
        """The ``data`` of each event ``POST path`` streams back. HTTP errors raise
        :class:`RequestRefusedError` (the request's own) or :class:`EngineError`, as does a
        server that cannot be reached or breaks off. Closing the iterator closes the
        connection (the server aborts the generation)."""
        product = self._product
        try:
            async with self._open().post(self.base_url + path, json=body, headers={
                    "Accept": "text/event-stream", **(headers or {})}) as resp:
                if resp.status >= 400:
                    text = await resp.text(errors="replace")
                    message = f"{product} HTTP {resp.status}: {error_text(text)}"
                    code = self._request_caused.get(resp.status)
                    if code is not None:  # e.g. a prompt longer than the context
                        raise RequestRefusedError(message, code)
                    raise EngineError(message)
                async for data in sse_data(resp.content.iter_any()):
                    yield data
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineError(f"{product} request failed: {type(exc).__name__}: {exc}"
                              ) from exc
