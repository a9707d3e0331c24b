"""Benchmark: what the router adds to a request, over real gRPC and a real Redis.

A real redis-server; one real ``CachePublisher`` per worker (as each agent runs) writes its
snapshot and heartbeat: ``--entries`` (block, worker) entries in all, each query prompt's
prefix cached to a random depth on 1-4 workers. A real router (``RouterApp``) mirrors them.
A client on loopback then times, interleaved call by call on one channel:

* **bare RPC** -- the baseline: a unary RPC that takes the same GenerateRequest (parsed as
  the generated code parses it) and answers with an empty message, served in the same
  process: gRPC's own round trip carrying the prompt;
* **Route** -- ``kvroute.v1.Router/Route`` with the prompt's token ids: the full decision,
  and a RouteResponse listing every worker;
* **Route, generated registration** -- the same servicer registered with the generated
  ``add_RouterServicer_to_server`` on a second port: the request's wire bytes are not kept,
  so its token ids are read from the request re-serialized (``core/wire.py``).

Then the main path: ``Generate`` (one token) through a router in front of ``--agents`` real
agents (``sim`` engine, no modelled latency), against the same request sent straight to the
agent the router chose, interleaved call by call: the difference is the router's hop --
the decision, coalescing bookkeeping, a second gRPC call, and relaying the stream.

    python bench/router_rpc.py [--workers 128] [--entries 200000] [--iters 300]
                               [--route-candidates 0] [--agents 4]

Prints p50/p99 in microseconds and what Route adds over the bare RPC at p50 (the decision,
the servicer's bookkeeping and the RouteResponse: every live worker, best first), then what
the router adds to Generate over a direct call at p50.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc

from kvroute.core.blocks import BlockHasher
from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.core.grpc_util import new_server
from kvroute.core.load import EngineLoad
from kvroute.core.redis_conn import connect
from kvroute.core.redis_schema import Heartbeat, RedisKeys
from kvroute.demo.procs import scratch_redis
from kvroute.router.app import RouterApp
from kvroute.v1 import common_pb2, router_pb2_grpc, worker_agent_pb2_grpc
from kvroute.worker_agent.publisher import CachePublisher
from kvroute.worker_agent.server import AgentApp

BLOCK = 16
MODEL = "bench"
LENGTHS = (1024, 8192, 32768)


def worker_keys(workers: int, entries: int, prompts: list[list[int]], rng: random.Random
                ) -> dict[str, list[int]]:
    """Each worker's cached keys: the query prompts' prefixes, then random background."""
    hasher = BlockHasher(BLOCK, MODEL)
    held: dict[str, set[int]] = {f"w{i:03d}": set() for i in range(workers)}
    names = list(held)
    for p in prompts:
        keys = hasher.keys(p)
        for w in rng.sample(names, rng.randint(1, 4)):
            held[w].update(keys[: rng.randint(len(keys) // 4, len(keys))])
    per_worker = max(0, entries - sum(map(len, held.values()))) // workers
    for w in names:
        held[w].update(rng.getrandbits(64) for _ in range(per_worker))
    return {w: list(ks) for w, ks in held.items()}


async def timed(call: Callable[[], Awaitable[object]]) -> float:
    t0 = time.perf_counter_ns()
    await call()
    return (time.perf_counter_ns() - t0) / 1000


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def run(args: argparse.Namespace) -> None:
    async with scratch_redis() as redis_url:
        await measure(args, redis_url)
        await measure_generate(args, redis_url)


async def measure_generate(args: argparse.Namespace, redis_url: str) -> None:
    model = f"{MODEL}-generate"  # its own Redis keys: none of the synthetic workers above
    agents = [AgentApp(AgentConfig.of(redis=redis_url, port=0, model=model, block_size=BLOCK,
                                   worker_id=f"a{i}", time_scale=0.0, heartbeat_s=0.2,
                                   capacity_blocks=65536, log_level="warning",
                                   max_prompt_tokens=65536))
              for i in range(args.agents)]
    for a in agents:
        await a.start()
    router = RouterApp(RouterConfig.of(redis=redis_url, port=0, model=model, block_size=BLOCK,
                                    log_level="warning", max_prompt_tokens=65536))
    await router.start(wait_for_redis_s=30)
    try:
        while len(router.registry.loads) < args.agents:
            await asyncio.sleep(0.05)
        rng = random.Random(args.seed + 1)
        print(f"\nGenerate, 1 token, {args.agents} sim agents (no modelled latency)")
        print(f"{'prompt':>7} | {'direct p50':>10} {'p99':>7} | {'via router p50':>14} {'p99':>7}"
              f" | {'added p50':>9}")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            via = router_pb2_grpc.RouterStub(ch).Generate
            direct = {a.worker_id: worker_agent_pb2_grpc.WorkerAgentStub(
                grpc.aio.insecure_channel(f"127.0.0.1:{a.port}")).Generate for a in agents}
            for n in LENGTHS:
                reqs = [common_pb2.GenerateRequest(
                    token_ids=[rng.randrange(50257) for _ in range(n)], model=model,
                    sampling=common_pb2.SamplingParams(max_tokens=1)) for _ in range(10)]
                home = {}
                for i, r in enumerate(reqs):  # cache each prompt; learn where it lives
                    first = [x async for x in via(r)]
                    home[i] = first[0].worker_id
                calls: dict[str, list[float]] = {"direct": [], "via": []}
                for i in range(args.iters):
                    r = reqs[i % len(reqs)]
                    order = [("direct", direct[home[i % len(reqs)]]), ("via", via)]
                    for name, stub in order if i % 2 else order[::-1]:
                        t0 = time.perf_counter_ns()
                        out = [x async for x in stub(r)]
                        calls[name].append((time.perf_counter_ns() - t0) / 1000)
                        assert out[-1].usage.prompt_tokens == n
                d, v = calls["direct"], calls["via"]
                print(f"{n:>7} | {pct(d, 50):>8.0f}us {pct(d, 99):>5.0f}us |"
                      f" {pct(v, 50):>12.0f}us {pct(v, 99):>5.0f}us |"
                      f" {pct(v, 50) - pct(d, 50):>7.0f}us", flush=True)
    finally:
        await router.stop()
        for a in agents:
            await a.stop()


async def measure(args: argparse.Namespace, redis_url: str) -> None:
    rng = random.Random(args.seed)
    prompts = {n: [[rng.randrange(50257) for _ in range(n)] for _ in range(10)]
               for n in LENGTHS}
    held = worker_keys(args.workers, args.entries,
                       [p for ps in prompts.values() for p in ps], rng)
    keys = RedisKeys(MODEL)
    pubs_by: dict[str, CachePublisher] = {}
    for w, ks in held.items():
        load = dict(running=rng.randint(0, 8), pending_prefill_tokens=rng.randint(0, 4000),
                    capacity_blocks=100_000, free_blocks=100_000 - len(ks), max_running=64)

        def beat(w: str = w, load: dict[str, int] = load) -> Heartbeat:
            return Heartbeat(w, "127.0.0.1:1", pubs_by[w].epoch, block_size=BLOCK,
                             ttl_s=30.0, load=EngineLoad(**load))

        pubs_by[w] = CachePublisher(connect(redis_url), keys, w, lambda ks=ks: ks, beat,
                                    heartbeat_s=5.0, heartbeat_ttl_s=30.0)
    pubs = list(pubs_by.values())
    t0 = time.perf_counter()
    for p in pubs:
        await p.start()
    while not all(p.seq for p in pubs):
        await asyncio.sleep(0.05)
    total = sum(map(len, held.values()))
    router = RouterApp(RouterConfig.of(redis=redis_url, port=0, model=MODEL, block_size=BLOCK,
                                    log_level="warning", max_prompt_tokens=65536,
                                    route_candidates=args.route_candidates))
    await router.start(wait_for_redis_s=30)
    deadline = time.monotonic() + 120
    while (router.mirror.index.entries() < total
           or len(router.registry.loads) < args.workers):
        if time.monotonic() > deadline:
            raise SystemExit(f"the router mirrored {router.mirror.index.entries()} of {total} "
                             f"entries, {len(router.registry.loads)} of {args.workers} workers")
        await asyncio.sleep(0.1)
    print(f"{args.workers} workers, {total:,} index entries written and mirrored in "
          f"{time.perf_counter() - t0:.1f}s")

    async def take(_req: common_pb2.GenerateRequest, _ctx: object) -> bytes:
        return b""

    generated = new_server()
    router_pb2_grpc.add_RouterServicer_to_server(router.front, generated)
    generated.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Null", {
        "Take": grpc.unary_unary_rpc_method_handler(
            take, request_deserializer=common_pb2.GenerateRequest.FromString,
            response_serializer=bytes)}),))
    gen_port = generated.add_insecure_port("127.0.0.1:0")
    await generated.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{router.port}") as ch, \
                grpc.aio.insecure_channel(f"127.0.0.1:{gen_port}") as ch2:
            route = router_pb2_grpc.RouterStub(ch).Route
            route_gen = router_pb2_grpc.RouterStub(ch2).Route
            bare_call = ch2.unary_unary(
                "/bench.Null/Take",
                request_serializer=common_pb2.GenerateRequest.SerializeToString,
                response_deserializer=bytes)
            print(f"{'prompt':>7} | {'bare RPC p50':>12} {'p99':>7} | {'Route p50':>9} {'p99':>7}"
                  f" | {'added p50':>9} | {'generated reg. p50':>18} {'p99':>7}")
            for n in LENGTHS:
                reqs = [common_pb2.GenerateRequest(token_ids=p, model=MODEL)
                        for p in prompts[n]]
                for r in reqs:  # same answer on both registrations, and warm channels
                    a, b = await route(r), await route_gen(r)
                    assert (a.worker_id, a.cached_tokens) == (b.worker_id, b.cached_tokens)
                calls: dict[str, list[float]] = {"bare": [], "route": [], "gen": []}
                for i in range(args.iters):
                    r = reqs[i % len(reqs)]
                    order = [("bare", lambda r=r: bare_call(r)),
                             ("route", lambda r=r: route(r)),
                             ("gen", lambda r=r: route_gen(r))]
                    for name, call in order[i % 3:] + order[: i % 3]:
                        calls[name].append(await timed(call))
                bare, ours, gen = calls["bare"], calls["route"], calls["gen"]
                print(f"{n:>7} | {pct(bare, 50):>10.0f}us {pct(bare, 99):>5.0f}us |"
                      f" {pct(ours, 50):>7.0f}us {pct(ours, 99):>5.0f}us |"
                      f" {pct(ours, 50) - pct(bare, 50):>7.0f}us |"
                      f" {pct(gen, 50):>16.0f}us {pct(gen, 99):>5.0f}us", flush=True)
    finally:
        await generated.stop(0)
        await router.stop()
        for p in pubs:
            await p.stop(deregister=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=128)
    ap.add_argument("--entries", type=int, default=200_000, help="index size")
    ap.add_argument("--iters", type=int, default=300, help="calls timed per prompt length")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--agents", type=int, default=4, help="real agents behind Generate")
    ap.add_argument("--route-candidates", type=int, default=0,
                    help="the router's --route-candidates (0: list every worker)")
    args = ap.parse_args()
    asyncio.run(run(args))

if __name__ == "__main__":
    main()
