"""Benchmark: the decision through ext_proc (``kvroute epp``) against the router's own ``Route``.

One real redis-server, ``--agents`` in-process sim agents (each publishing an engine
endpoint) and one in-process ``kvroute epp`` (EppApp: the router, with the ext_proc server
beside its gRPC port), on the tiny engine's byte-vocabulary model (kvroute/demo/
openai_model.py). For chat conversations of about 1k and 8k tokens:

* **ext_proc**: one request's whole request phase as Envoy runs it (router/epp_client.py):
  the headers, the JSON body in 16 KiB chunks, until the picker's headers and body
  responses are back: body parsing, chat template, tokenization and the decision included;
* **Route**: kvroute.v1.Router/Route on the same process with the ids the template gives
  (a client that tokenizes itself), the baseline;
* **template**: ``ChatTokenizer.apply`` alone, to show what the ext_proc path spends on
  tokenizing the body the gateway forwards.

Calls are interleaved one by one, on warm caches (each conversation routed once first).
Printed: p50/p99 of each, and ext_proc/Route ratios measured in this run.

    python bench/epp.py [--agents 4] [--iters 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from http_front import conversation  # bench/ is the script's folder: its sibling

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.core.config import AgentConfig, EppConfig
from kvroute.demo.openai_model import write_byte_model
from kvroute.demo.procs import scratch_redis
from kvroute.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from kvroute.router.epp import EppApp
from kvroute.router.epp_client import exchange
from kvroute.v1 import common_pb2, router_pb2_grpc
from kvroute.worker_agent.server import AgentApp

MODEL = "bench"
LENGTHS = (1024, 8192)


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


async def bench(args: argparse.Namespace, app: EppApp, tok: ChatTokenizer,
                rng: random.Random) -> None:
    print(f"\nrouting decision, {args.agents} sim agents, {args.iters} calls each "
          "(interleaved)")
    print(f"{'tokens':>7} | {'Route p50':>9} {'p99':>8} | {'ext_proc p50':>12} {'p99':>8} | "
          f"{'template p50':>12} | {'ratio p50':>9} {'p99':>6}")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.epp_port}") as epc, \
            grpc.aio.insecure_channel(f"127.0.0.1:{app.router.port}") as rc:
        picker = ep_grpc.ExternalProcessorStub(epc)
        router = router_pb2_grpc.RouterStub(rc)
        for n in LENGTHS:
            convs = [conversation(rng, tok, n) for _ in range(8)]
            bodies = [json.dumps({"model": MODEL, "messages": c, "max_tokens": 16}).encode()
                      for c in convs]
            reqs = [common_pb2.GenerateRequest(
                token_ids=tok.apply(c), model=MODEL,
                sampling=common_pb2.SamplingParams(max_tokens=16)) for c in convs]
            for b in bodies:  # warm: a first exchange of each (and an error would show here)
                out = await exchange(picker, b)
                assert out.immediate is None and out.endpoint, out.responses
            route: list[float] = []
            ext: list[float] = []
            tmpl: list[float] = []
            for i in range(args.iters):
                k = i % len(convs)

                async def via_route(req: common_pb2.GenerateRequest = reqs[k]) -> None:
                    await router.Route(req)

                async def via_epp(body: bytes = bodies[k]) -> None:
                    out = await exchange(picker, body)
                    assert out.endpoint

                pair = [(route, via_route), (ext, via_epp)]
                for into, call in pair if i % 2 else pair[::-1]:
                    t0 = time.perf_counter_ns()
                    await call()
                    into.append((time.perf_counter_ns() - t0) / 1e6)
                t0 = time.perf_counter_ns()
                tok.apply(convs[k])
                tmpl.append((time.perf_counter_ns() - t0) / 1e6)
            print(f"{len(reqs[0].token_ids):>7} | {pct(route, 50):>7.2f}ms "
                  f"{pct(route, 99):>6.2f}ms | {pct(ext, 50):>10.2f}ms {pct(ext, 99):>6.2f}ms | "
                  f"{pct(tmpl, 50):>10.2f}ms | {pct(ext, 50) / pct(route, 50):>8.2f}x "
                  f"{pct(ext, 99) / pct(route, 99):>5.2f}x", flush=True)
    print("ratio: ext_proc / Route (ext_proc parses, templates and tokenizes the body; Route "
          "is given ids)")


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_byte_model(Path(tmp))
        tok = ChatTokenizer.load(str(model_dir), name=MODEL)
        async with scratch_redis() as redis_url:
            common = dict(redis=redis_url, model=MODEL, log_level="warning",
                          max_prompt_tokens=65536)
            agents = [AgentApp(AgentConfig.of(**common, port=0, worker_id=f"a{i}",
                                           time_scale=0.0, heartbeat_s=0.2,
                                           capacity_blocks=65536, model_source=str(model_dir),
                                           engine_endpoint=f"10.0.0.{i + 1}:8000"))
                      for i in range(args.agents)]
            for a in agents:
                await a.start()
            app = EppApp(EppConfig.of(**{**common, "model": f"{MODEL}={model_dir}"}, port=0,
                                   epp_port=0))
            await app.start(wait_for_redis_s=30)
            try:
                while len(app.router.registry.loads) < args.agents:
                    await asyncio.sleep(0.05)
                await bench(args, app, tok, rng)
            finally:
                await app.stop()
                for a in agents:
                    await a.stop()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
