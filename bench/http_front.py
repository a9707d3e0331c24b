"""Benchmark: what the OpenAI-compatible HTTP front adds over gRPC ``Generate``.

One real redis-server, ``--agents`` in-process sim agents (no modelled latency) and one router
with ``--http-port`` and ``--model bench=DIR``, DIR the tiny engine's byte-vocabulary model
(kvroute/demo/openai_model.py) unless ``--model-dir`` names another (its vocabulary size is
given to the agents).

1. **Template + tokenization** at the router (``ChatTokenizer.apply``): p50/p99 for
   conversations of about 1k, 8k and 32k tokens (8 turns).
2. **HTTP chat vs gRPC Generate**, streaming ``--tokens`` tokens, interleaved call by call on
   the same router and agents: the gRPC client sends the ids the template gives (what a
   client that tokenizes itself sends), the HTTP client the messages; whole-request latency
   p50/p99 and the ratio. Then requests/s with ``--concurrency`` streams at once.
2b. **Messages vs chat completions**: the same conversations streamed through Anthropic's
   ``/v1/messages`` and ``/v1/chat/completions``, interleaved: p50/p99 and the ratio.
2c. **Reading tool calls**: the same chats with tools streamed with ``tool_choice`` ``auto``
   (read for calls as they stream) and ``none``, interleaved: p50/p99 and the ratio.
3. **Multi-turn hit ratio**: the same conversations, turn by turn, through each API (each its
   own ``cache_salt``, so neither reuses the other's cache): cached / prompt tokens.
4. **Event-loop stall**: the longest gap of a 1 ms ticker on the router's loop while 32k-token
   chats arrive at once, tokenized on the loop vs on the tokenizing threads.

    python bench/http_front.py [--agents 4] [--iters 100] [--tokens 64] [--concurrency 64]
                               [--requests 512] [--model-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import string
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.demo.openai_model import write_byte_model
from kvroute.demo.procs import scratch_redis
from kvroute.router import http_front
from kvroute.router.app import RouterApp
from kvroute.v1 import common_pb2, router_pb2_grpc
from kvroute.worker_agent.server import AgentApp

MODEL = "bench"
LENGTHS = (1024, 8192, 32768)
TURNS = 8


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def conversation(rng: random.Random, tok: ChatTokenizer, tokens: int) -> list[dict[str, str]]:
    """A system prompt and ``TURNS`` user/assistant turns, about ``tokens`` long."""
    per = max(8, tokens // (2 * TURNS + 1))
    chars_per_token = max(1.0, len(words(rng, 2000)) / len(tok.encode(words(rng, 2000),
                                                                      add_special_tokens=False)))
    msgs = [{"role": "system", "content": words(rng, int(per * chars_per_token))}]
    for i in range(2 * TURNS):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant",
                     "content": words(rng, int(per * chars_per_token))})
    return msgs


def bench_template(tok: ChatTokenizer, rng: random.Random, iters: int) -> None:
    print("\n1. chat template + tokenization at the router (ChatTokenizer.apply), its two parts "
          "(p50), and tokenizers' plain encode (with offsets, holding the GIL) as the baseline")
    print(f"{'tokens':>7} | {'p50':>8} {'p99':>8} | {'render':>8} {'encode':>8} | "
          f"{'plain':>8} {'ratio':>6}")
    for n in LENGTHS:
        convs = [conversation(rng, tok, n) for _ in range(4)]
        times, render, encode, plain = [], [], [], []
        for i in range(iters):
            t0 = time.perf_counter_ns()
            ids = tok.apply(convs[i % len(convs)])
            times.append((time.perf_counter_ns() - t0) / 1e6)
            t0 = time.perf_counter_ns()
            text = tok.render(convs[i % len(convs)])
            t1 = time.perf_counter_ns()
            tok.encode(text, add_special_tokens=False)
            t2 = time.perf_counter_ns()
            tok.hf.encode(text, add_special_tokens=False)
            render.append((t1 - t0) / 1e6)
            encode.append((t2 - t1) / 1e6)
            plain.append((time.perf_counter_ns() - t2) / 1e6)
        print(f"{len(ids):>7} | {pct(times, 50):>6.2f}ms {pct(times, 99):>6.2f}ms | "
              f"{pct(render, 50):>6.2f}ms {pct(encode, 50):>6.2f}ms | "
              f"{pct(plain, 50):>6.2f}ms {pct(encode, 50) / pct(plain, 50):>5.2f}x", flush=True)


async def http_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                    ) -> dict[str, Any]:
    """Stream one chat completion to [DONE]; the last chunk's usage."""
    usage: dict[str, Any] = {}
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    return usage


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter_ns()
    await call()
    return (time.perf_counter_ns() - t0) / 1e6


def against(base: list[float], other: list[float]) -> str:
    """Table cells: the baseline's p50 and p99, the other's, and their ratios."""
    return (f"{pct(base, 50):>7.2f}ms {pct(base, 99):>6.2f}ms | "
            f"{pct(other, 50):>7.2f}ms {pct(other, 99):>6.2f}ms | "
            f"{pct(other, 50) / pct(base, 50):>8.2f}x {pct(other, 99) / pct(base, 99):>5.2f}x")


async def interleaved(a: Callable[[int], Awaitable[None]], b: Callable[[int], Awaitable[None]],
                      warm: int, iters: int) -> tuple[list[float], list[float]]:
    """The latencies (ms) of ``a(i)`` and ``b(i)`` over ``iters`` calls each, interleaved
    call by call (which goes first alternates), after ``warm`` calls each of both (each
    prompt then cached where it lands)."""
    for i in range(warm):
        await a(i)
        await b(i)
    a_ms: list[float] = []
    b_ms: list[float] = []
    for i in range(iters):
        pair = [(a_ms, a), (b_ms, b)]
        for into, call in pair if i % 2 else pair[::-1]:
            into.append(await timed(lambda c=call, i=i: c(i)))
    return a_ms, b_ms


async def bench_fronts(args: argparse.Namespace, router: RouterApp, tok: ChatTokenizer,
                       rng: random.Random) -> None:
    url = f"http://127.0.0.1:{router.http_port}/v1/chat/completions"
    print(f"\n2. HTTP chat vs gRPC Generate, streaming {args.tokens} tokens, {args.agents} sim "
          "agents")
    print(f"{'prompt':>7} | {'gRPC p50':>9} {'p99':>8} | {'HTTP p50':>9} {'p99':>8} | "
          f"{'ratio p50':>9} {'p99':>6} | {'gRPC req/s':>10} {'HTTP req/s':>10} {'ratio':>6}")
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session, \
            grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for n in LENGTHS[:2]:
            convs = [conversation(rng, tok, n) for _ in range(8)]
            ids = [tok.apply(c) for c in convs]
            bodies = [{"model": MODEL, "messages": c, "max_tokens": args.tokens, "stream": True,
                       "stream_options": {"include_usage": True}} for c in convs]
            # The same request as the HTTP front builds: EOS stops it (the sim draws the
            # same tokens for the same prompt, so both stop at the same place).
            reqs = [common_pb2.GenerateRequest(
                token_ids=t, model=MODEL, sampling=common_pb2.SamplingParams(
                    max_tokens=args.tokens, temperature=1.0, top_p=1.0,
                    stop_token_ids=tok.stop_token_ids)) for t in ids]
            made = {"grpc": 0, "http": 0}

            async def grpc_call(i: int, reqs: list[Any] = reqs,
                                made: dict[str, int] = made) -> None:
                out = [x async for x in stub.Generate(reqs[i % len(reqs)])]
                made["grpc"] += sum(len(x.token_ids) for x in out)

            async def http_call(i: int, bodies: list[Any] = bodies,
                                made: dict[str, int] = made) -> None:
                usage = await http_chat(session, url, bodies[i % len(bodies)])
                made["http"] += usage["completion_tokens"]

            g, h = await interleaved(grpc_call, http_call, len(convs), args.iters)
            rates = []
            for call in (grpc_call, http_call):
                sem = asyncio.Semaphore(args.concurrency)

                async def one(i: int, c: Callable[[int], Awaitable[None]] = call,
                              sem: asyncio.Semaphore = sem) -> None:
                    async with sem:
                        await c(i)

                t0 = time.perf_counter()
                await asyncio.gather(*(one(i) for i in range(args.requests)))
                rates.append(args.requests / (time.perf_counter() - t0))
            print(f"{len(ids[0]):>7} | {against(g, h)} | "
                  f"{rates[0]:>10.0f} {rates[1]:>10.0f} {rates[1] / rates[0]:>5.2f}x",
                  flush=True)
            if made["grpc"] != made["http"]:
                print(f"        (tokens generated differ: gRPC {made['grpc']}, HTTP "
                      f"{made['http']})")


async def http_messages(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                        ) -> int:
    """Stream one Messages request to message_stop; the output tokens."""
    out = 0
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"message_delta"' in line:
                out = json.loads(line[6:])["usage"]["output_tokens"]
    return out


def as_messages(conv: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    """A chat's body as Anthropic's Messages API takes it (the system prompt apart)."""
    return {"model": MODEL, "max_tokens": tokens, "stream": True, "system": conv[0]["content"],
            "messages": conv[1:]}


async def bench_messages(args: argparse.Namespace, router: RouterApp, tok: ChatTokenizer,
                         rng: random.Random) -> None:
    """Anthropic's Messages API against chat completions: the same conversations streamed
    through each, interleaved call by call (each renders to the same ids)."""
    base = f"http://127.0.0.1:{router.http_port}/v1"
    print(f"\n2b. Messages vs chat completions, streaming {args.tokens} tokens")
    print(f"{'prompt':>7} | {'chat p50':>9} {'p99':>8} | {'msgs p50':>9} {'p99':>8} | "
          f"{'ratio p50':>9} {'p99':>6}")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for n in LENGTHS[:2]:
            # Ending on the user's turn: a last assistant message is a Messages prefill.
            convs = [conversation(rng, tok, n)[:-1] for _ in range(8)]
            chats = [{"model": MODEL, "messages": c, "max_tokens": args.tokens, "stream": True,
                      "stream_options": {"include_usage": True}} for c in convs]
            msgs = [as_messages(c, args.tokens) for c in convs]
            made = {"chat": 0, "messages": 0}

            async def chat(i: int, made: dict[str, int] = made,
                           chats: list[Any] = chats) -> None:
                usage = await http_chat(session, base + "/chat/completions",
                                        chats[i % len(chats)])
                made["chat"] += usage["completion_tokens"]

            async def messages(i: int, made: dict[str, int] = made,
                               msgs: list[Any] = msgs) -> None:
                made["messages"] += await http_messages(session, base + "/messages",
                                                        msgs[i % len(msgs)])

            c_ms, m_ms = await interleaved(chat, messages, len(convs), args.iters)
            print(f"{len(tok.apply(convs[0])):>7} | {against(c_ms, m_ms)}", flush=True)
            if made["chat"] != made["messages"]:
                print(f"        (tokens generated differ: chat {made['chat']}, Messages "
                      f"{made['messages']})")


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


async def bench_tools(args: argparse.Namespace, router: RouterApp, tok: ChatTokenizer,
                      rng: random.Random) -> None:
    """What reading tool calls out of a stream costs: the same chats with tools, streamed
    with ``tool_choice`` ``auto`` (the output read for calls as it streams) and ``none``
    (passed as it comes), interleaved call by call; the prompts are the same."""
    url = f"http://127.0.0.1:{router.http_port}/v1/chat/completions"
    print(f"\n2c. Reading tool calls: tool_choice auto vs none, streaming {args.tokens} tokens")
    print(f"{'prompt':>7} | {'none p50':>9} {'p99':>8} | {'auto p50':>9} {'p99':>8} | "
          f"{'ratio p50':>9} {'p99':>6}")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        convs = [conversation(rng, tok, LENGTHS[0])[:-1] for _ in range(8)]

        def call(choice: str) -> Callable[[int], Awaitable[None]]:
            async def one(i: int) -> None:
                await http_chat(session, url, {
                    "model": MODEL, "messages": convs[i % len(convs)], "tools": TOOLS,
                    "tool_choice": choice, "max_tokens": args.tokens, "stream": True})
            return one

        n_ms, a_ms = await interleaved(call("none"), call("auto"), len(convs), args.iters)
        print(f"{len(tok.apply(convs[0], tools=TOOLS)):>7} | {against(n_ms, a_ms)}",
              flush=True)


async def bench_hits(args: argparse.Namespace, router: RouterApp, tok: ChatTokenizer,
                     rng: random.Random) -> None:
    url = f"http://127.0.0.1:{router.http_port}/v1/chat/completions"
    print(f"\n3. multi-turn chat, {args.conversations} conversations x {TURNS} turns: "
          "hit ratio (cached / prompt tokens)")
    totals = {"grpc": [0, 0], "http": [0, 0]}
    async with aiohttp.ClientSession() as session, \
            grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        for _ in range(args.conversations):
            system = {"role": "system", "content": words(rng, 600)}
            turns = [words(rng, 200) for _ in range(TURNS)]
            for api in ("grpc", "http"):
                msgs = [system]
                for t in turns:
                    msgs.append({"role": "user", "content": t})
                    if api == "http":
                        body = {"model": MODEL, "messages": msgs, "max_tokens": 16,
                                "cache_salt": "http"}
                        async with session.post(url, json=body) as resp:
                            out = await resp.json()
                        answer = out["choices"][0]["message"]["content"]
                        u = out["usage"]
                        prompt, cached = u["prompt_tokens"], \
                            u["prompt_tokens_details"]["cached_tokens"]
                    else:
                        ids = tok.apply(msgs)
                        res = [x async for x in stub.Generate(common_pb2.GenerateRequest(
                            token_ids=ids, model=MODEL, cache_salt="grpc",
                            sampling=common_pb2.SamplingParams(max_tokens=16)))]
                        answer = tok.decode([i for x in res for i in x.token_ids],
                                            skip_special_tokens=True)
                        prompt, cached = res[-1].usage.prompt_tokens, res[-1].usage.cached_tokens
                    totals[api][0] += cached
                    totals[api][1] += prompt
                    msgs.append({"role": "assistant", "content": answer})
                await asyncio.sleep(0.3)  # the last turns' store events reach the index
    g, h = (totals[a][0] / max(1, totals[a][1]) for a in ("grpc", "http"))
    print(f"gRPC {g:.1%}  HTTP {h:.1%}  (HTTP/gRPC {h / g if g else float('nan'):.3f})")


async def ticker(done: asyncio.Event) -> float:
    """The longest a 1 ms sleep overslept until ``done``, in seconds."""
    worst = 0.0
    last = time.perf_counter()
    while not done.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        worst = max(worst, now - last - 0.001)
        last = now
    return worst


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> None:
    async with session.post(url, json=body) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def bench_stall(args: argparse.Namespace, router: RouterApp, tok: ChatTokenizer,
                      rng: random.Random) -> None:
    """The longest the event loop (the router's, and here the agents') goes without running
    a 1 ms ticker while ``--concurrency`` 32k-token chats arrive at once: tokenized on the
    loop (every body inline) vs on the tokenizing threads (the default)."""
    url = f"http://127.0.0.1:{router.http_port}/v1/chat/completions"
    print(f"\n4. event-loop stall: longest gap of a 1 ms ticker while {args.concurrency} chats "
          f"of {LENGTHS[-1]} tokens arrive at once")
    convs = [conversation(rng, tok, LENGTHS[-1]) for _ in range(args.concurrency)]
    bodies = [{"model": MODEL, "messages": c, "max_tokens": 1} for c in convs]
    gaps: dict[str, float] = {}
    inline = http_front.INLINE_BODY_BYTES
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for label, bound in (("on the loop", 1 << 62), ("on threads", inline)):
            http_front.INLINE_BODY_BYTES = bound  # read at each request (_off_loop)
            done = asyncio.Event()
            tick = asyncio.create_task(ticker(done))
            for _ in range(3):
                await asyncio.gather(*(post(session, url, b) for b in bodies))
            done.set()
            gaps[label] = await tick * 1000
    http_front.INLINE_BODY_BYTES = inline
    print(f"on the loop {gaps['on the loop']:.2f}ms  on threads {gaps['on threads']:.2f}ms  "
          f"(threads/loop {gaps['on threads'] / max(gaps['on the loop'], 1e-9):.2f})")


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else write_byte_model(Path(tmp))
        tok = ChatTokenizer.load(str(model_dir), name=MODEL)
        bench_template(tok, rng, args.iters)
        async with scratch_redis() as redis_url:
            common = dict(redis=redis_url, model=MODEL, log_level="warning",
                          max_prompt_tokens=65536)
            agents = [AgentApp(AgentConfig.of(**common, port=0, worker_id=f"a{i}",
                                           time_scale=0.0, heartbeat_s=0.2,
                                           capacity_blocks=65536, model_source=str(model_dir),
                                           max_batch=256))
                      for i in range(args.agents)]
            for a in agents:
                await a.start()
            router = RouterApp(RouterConfig.of(**{**common, "model": f"{MODEL}={model_dir}"},
                                            port=0, http_port=args.http_port))
            await router.start(wait_for_redis_s=30)
            try:
                while len(router.registry.loads) < args.agents:
                    await asyncio.sleep(0.05)
                await bench_fronts(args, router, tok, rng)
                await bench_messages(args, router, tok, rng)
                await bench_tools(args, router, tok, rng)
                await bench_hits(args, router, tok, rng)
                await bench_stall(args, router, tok, rng)
            finally:
                await router.stop()
                for a in agents:
                    await a.stop()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--tokens", type=int, default=64, help="tokens streamed per request")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--requests", type=int, default=512, help="requests of each throughput run")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--model-dir", default="", help="a HF model directory (default: the byte "
                   "model)")
    p.add_argument("--http-port", type=int, default=0, help="0: a free one")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    args = parse()
    if not args.http_port:
        from kvroute.core.ports import PortPool

        args.http_port = PortPool().take()
    asyncio.run(main(args))
