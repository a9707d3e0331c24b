"""The server-sent-events reader and the HTTP client adapters stream generations with, against
a real aiohttp server on loopback."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from kvroute.worker_agent.engines.base import EngineError, RequestRefusedError
from kvroute.worker_agent.engines.served.stream import ServerHttp, sse_data
from tests.support import free_port

EVENTS = ["a", "two\nlines", "", json.dumps({"ids": list(range(50_000))}), "[DONE]"]
WIRE = (b": keep-alive\r\n\r\n" + b"data: a\n\n" + b"data: two\r\ndata: lines\r\n\r\n"
        + b"data:\n\n" + b"data: " + EVENTS[3].encode() + b"\n\n" + b"data: [DONE]\n\n")


async def pieces(data: bytes, cuts: list[int]) -> AsyncIterator[bytes]:
    at = 0
    for cut in [*sorted(cuts), len(data)]:
        yield data[at:cut]
        at = cut


@pytest.mark.parametrize("seed", range(20))
async def test_events_cut_anywhere_read_the_same(seed: int) -> None:
    rng = random.Random(seed)
    cuts = rng.sample(range(1, len(WIRE)), rng.randint(0, 40))
    assert [d async for d in sse_data(pieces(WIRE, cuts))] == EVENTS


async def test_a_last_event_without_its_blank_line_is_read() -> None:
    assert [d async for d in sse_data(pieces(b"data: x\n\ndata: y", [3]))] == ["x", "y"]


@pytest.fixture
async def server() -> AsyncIterator[str]:
    """/stream echoes the prompt (as vLLM's first chunk does), then WIRE in pieces;
    /refuse a 400; /broken a 500; /version JSON."""
    async def stream(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        echo = json.dumps({"prompt_token_ids": body["prompt"]}).encode()
        await resp.write(b"data: " + echo + b"\n\n")
        for i in range(0, len(WIRE), 7000):
            await resp.write(WIRE[i:i + 7000])
        return resp

    async def refuse(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    async def broken(_: web.Request) -> web.Response:
        return web.Response(status=500, text="engine died")

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "1"})

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/stream", stream)
    app.router.add_post("/refuse", refuse)
    app.router.add_post("/broken", broken)
    app.router.add_get("/version", version)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}/"
    await runner.cleanup()


async def test_a_stream_with_a_line_of_megabytes_and_the_errors(server: str) -> None:
    http = ServerHttp(server, "srv", {400: "INVALID_ARGUMENT"})
    try:
        prompt = list(range(200_000))  # its echo alone is a line of over a megabyte
        got = [d async for d in http.events("/stream", {"prompt": prompt})]
        assert len(got[0]) > 1 << 20
        assert json.loads(got[0]) == {"prompt_token_ids": prompt}
        assert got[1:] == EVENTS
        assert await http.get("/version") == (200, '{"version": "1"}')
        with pytest.raises(RequestRefusedError, match="srv HTTP 400: prompt too long") as exc:
            [d async for d in http.events("/refuse", {})]
        assert exc.value.code == "INVALID_ARGUMENT"
        with pytest.raises(EngineError, match="srv HTTP 500: engine died"):
            [d async for d in http.events("/broken", {})]
    finally:
        await http.aclose()
    gone = ServerHttp(f"http://127.0.0.1:{free_port()}", "srv", {})
    try:
        assert await gone.get("/version") is None
        with pytest.raises(EngineError, match="srv request failed: ClientConnectorError"):
            [d async for d in gone.events("/stream", {})]
    finally:
        await gone.aclose()
