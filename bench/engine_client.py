"""Benchmark: what streaming one generation from an inference server costs the agent's side
of the HTTP hop, the agent's client (``ServerHttp``, aiohttp) against httpx (the baseline:
what the agent used before, and what most Python clients use).

A server process (aiohttp, pinned to another core when there is one) answers ``POST
/v1/completions`` with ``--tokens`` server-sent events shaped like vLLM's chunks, as fast as
it can. The client times, one request at a time, alternating clients in rounds: the first
event's arrival (what a request's time to first token pays) and the whole stream, p50; and
its own CPU time per request (``time.process_time``), which on a core shared with the router
every request and token pays.

    python bench/engine_client.py [--requests 400] [--tokens 32] [--prompt 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import httpx

from kvroute.worker_agent.engines.served.stream import ServerHttp, sse_data


async def serve(port: int, tokens: int) -> None:
    from aiohttp import web

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(tokens):
            chunk = {"id": "cmpl-1", "object": "text_completion", "choices": [{
                "index": 0, "text": " t", "token_ids": [i], "finish_reason":
                "length" if i == tokens - 1 else None,
                "prompt_token_ids": body["prompt"] if i == 0 else None}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("READY", flush=True)
    await asyncio.Event().wait()


Events = Callable[[dict[str, object]], AsyncIterator[str]]


def ours(http: ServerHttp) -> Events:
    return lambda body: http.events("/v1/completions", body)


def baseline(http: httpx.AsyncClient) -> Events:
    async def events(body: dict[str, object]) -> AsyncIterator[str]:
        async with http.stream("POST", "/v1/completions", json=body) as resp:
            async for data in sse_data(resp.aiter_bytes()):
                yield data
    return events


async def timed(events: Events, body: dict[str, object]) -> tuple[float, float]:
    """(the first event's arrival, the whole stream's), in seconds."""
    t0 = time.perf_counter()
    first = 0.0
    async with contextlib.aclosing(events(body)) as stream:
        async for data in stream:
            if not first:
                first = time.perf_counter() - t0
            if data == "[DONE]":
                break
    return first, time.perf_counter() - t0


async def measure(args: argparse.Namespace, url: str) -> None:
    body = {"prompt": list(range(args.prompt)), "max_tokens": args.tokens, "stream": True}
    aio = ServerHttp(url, "bench", {})
    hx = httpx.AsyncClient(base_url=url, timeout=30)
    clients = {"httpx (baseline)": baseline(hx), "ServerHttp (aiohttp)": ours(aio)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in clients}
    cpu = dict.fromkeys(clients, 0.0)
    try:
        for one in clients.values():  # connections and first-call costs off the record
            for _ in range(20):
                await timed(one, body)
        rounds = 10
        for _ in range(rounds):
            for name, one in clients.items():
                c0 = time.process_time()
                for _ in range(args.requests // rounds):
                    times[name].append(await timed(one, body))
                cpu[name] += time.process_time() - c0
    finally:
        await aio.aclose()
        await hx.aclose()
    print(f"{args.requests} streams each, {args.tokens} events, a {args.prompt}-token prompt "
          "echoed in the first")
    print(f"{'client':<22} {'first event p50':>16} {'whole p50':>10} {'CPU/request':>12}")
    base = None
    for name in clients:
        first = statistics.median(t[0] for t in times[name]) * 1e3
        whole = statistics.median(t[1] for t in times[name]) * 1e3
        per = cpu[name] / len(times[name]) * 1e3
        print(f"{name:<22} {first:>13.3f} ms {whole:>7.3f} ms {per:>9.3f} ms")
        if base is None:
            base = (first, whole, per)
        else:
            print(f"{'ratio to the baseline':<22} {first / base[0]:>15.2f}x "
                  f"{whole / base[1]:>9.2f}x {per / base[2]:>11.2f}x")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400, help="streams per client")
    p.add_argument("--tokens", type=int, default=32, help="events per stream")
    p.add_argument("--prompt", type=int, default=1000, help="prompt ids echoed back")
    p.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve, args.tokens))
        return
    port = free_port()
    pin = ["taskset", "-c", "0"] if (os.cpu_count() or 1) > 1 and shutil.which("taskset") else []
    server = subprocess.Popen([*pin, sys.executable, __file__, "--serve", str(port),
                               "--tokens", str(args.tokens)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "READY"
        if pin:
            os.sched_setaffinity(0, {1})
        asyncio.run(measure(args, f"http://127.0.0.1:{port}"))
    finally:
        server.terminate()
        server.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
