"""A streamed HTTP response of server-sent events, as both HTTP APIs send theirs."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web


class EventStream:
    """One response's events, written in batches: the events one response of the
    generation becomes go out in one write (:meth:`flush`), so the client is woken once
    for them, not once per event (its first token, say, as a role chunk and a content
    chunk). The headers go with the first write."""

    def __init__(self) -> None:
        self.resp: web.StreamResponse | None = None
        self._held: list[bytes] = []

    async def open(self, request: web.Request, headers: Mapping[str, str]) -> None:
        """Start the response (once): 200, ``text/event-stream``, ``headers``."""
        if self.resp is None:
            self.resp = web.StreamResponse(headers={
                "content-type": "text/event-stream", "cache-control": "no-cache", **headers})
            await self.resp.prepare(request)

    def add(self, event: bytes) -> None:
        """Queue one event for the next :meth:`flush`."""
        self._held.append(event)

    async def flush(self) -> None:
        """Write what is queued."""
        if self._held and self.resp is not None:
            data = b"".join(self._held)
            self._held.clear()
            await self.resp.write(data)

    async def end(self) -> web.StreamResponse:
        """Write what is queued and end the response."""
        await self.flush()
        assert self.resp is not None
        await self.resp.write_eof()
        return self.resp
