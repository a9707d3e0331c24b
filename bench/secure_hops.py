"""Benchmark: what TLS, mTLS and API keys add to a request through the router.

Four clusters side by side on one real redis-server, each a real router (``RouterApp``) in
front of ``--agents`` real agents (``sim`` engine, no modelled latency), one model each:

* **plain** -- the baseline: plaintext everywhere;
* **tls** -- the router's gRPC port serves TLS (``--tls-cert``); router -> agent plaintext;
* **mtls** -- that, and router -> agent over mTLS with the agents' SAN check
  (``--tls-ca``, ``--tls-client-ca``, ``--tls-allowed-sans``);
* **mtls+key** -- that, and an API key on every call (``--api-keys-file``, a rate limit
  high enough never to refuse): the auth interceptor's cost.

A client then times ``Generate`` (one token), interleaved call by call over one open channel
per cluster (handshakes are not in these figures), and then a new connection per call (its
handshake included) for plain and tls. Prints p50/p99 in microseconds and each one's ratio
to plain, measured in the same run. Certificates are made with ``cryptography`` (the
test suite's ``tests/certs.py``).

    python bench/secure_hops.py [--iters 400] [--agents 2] [--connects 50]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.certs, run from anywhere

from kvroute.core.config import AgentConfig, RouterConfig
from kvroute.demo.procs import scratch_redis
from kvroute.router.app import RouterApp
from kvroute.router.auth import hash_key
from kvroute.v1 import common_pb2, router_pb2_grpc
from kvroute.worker_agent.server import AgentApp
from tests.certs import Ca

KEY = "kvr-bench-key"
KINDS = ("plain", "tls", "mtls", "mtls+key")


def pct(xs: list[float], q: int) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1]


async def cluster(kind: str, redis_url: str, d: Path, ca: Ca, agents: int
                  ) -> tuple[RouterApp, list[AgentApp]]:
    model = "bench-" + kind.replace("+", "-")
    router_pair = ca.issue("router", ("DNS:kvroute-router", "IP:127.0.0.1"))
    agent_pair = ca.issue("agent", ("DNS:kvroute-agent", "IP:127.0.0.1"))
    a_kw: dict[str, Any] = {}
    r_kw: dict[str, Any] = {}
    if kind != "plain":
        r_kw.update(tls_cert=str(router_pair.cert), tls_key=str(router_pair.key))
    if kind.startswith("mtls"):
        a_kw.update(tls_cert=str(agent_pair.cert), tls_key=str(agent_pair.key),
                    tls_client_ca=str(ca.crt), tls_allowed_sans="kvroute-router")
        r_kw.update(tls_ca=str(ca.crt))
    if kind.endswith("+key"):
        keys = d / "keys.jsonl"
        keys.write_text(f'{{"name": "bench", "sha256": "{hash_key(KEY)}", "rate": 1e6}}\n')
        r_kw.update(api_keys_file=str(keys))
    apps = [AgentApp(AgentConfig.of(redis=redis_url, port=0, model=model, worker_id=f"{kind}-{i}",
                                 time_scale=0.0, heartbeat_s=0.2, heartbeat_ttl_s=2.0, **a_kw))
            for i in range(agents)]
    for a in apps:
        await a.start()
    router = RouterApp(RouterConfig.of(redis=redis_url, port=0, model=model, poll_interval_s=0.1,
                                    log_level="warning", **r_kw))
    await router.start(wait_for_redis_s=5.0)
    deadline = time.monotonic() + 10
    while len(router.registry.loads) < agents:
        if time.monotonic() > deadline:
            raise SystemExit(f"{kind}: agents not registered")
        await asyncio.sleep(0.05)
    return router, apps


def channel(kind: str, port: int, ca: Ca) -> grpc.aio.Channel:
    target = f"127.0.0.1:{port}"
    if kind == "plain":
        return grpc.aio.insecure_channel(target)
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca.crt.read_bytes()))


async def call(ch: grpc.aio.Channel, kind: str, i: int) -> None:
    req = common_pb2.GenerateRequest(token_ids=list(range(1 + i % 7, 257)),
                                     sampling=common_pb2.SamplingParams(max_tokens=1))
    md = (("authorization", f"Bearer {KEY}"),) if kind.endswith("+key") else ()
    async for _ in router_pb2_grpc.RouterStub(ch).Generate(req, metadata=md, timeout=10):
        pass


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ca = Ca(d / "ca", "bench-ca")
        async with scratch_redis() as redis_url:
            started = {k: await cluster(k, redis_url, d, ca, args.agents) for k in KINDS}
            try:
                chans = {k: channel(k, r.port, ca) for k, (r, _) in started.items()}
                times: dict[str, list[float]] = {k: [] for k in KINDS}
                for i in range(args.iters + 20):
                    for k in KINDS:
                        t0 = time.perf_counter()
                        await call(chans[k], k, i)
                        if i >= 20:  # warm-up: first handshakes, lazy channels to agents
                            times[k].append((time.perf_counter() - t0) * 1e6)
                connects: dict[str, list[float]] = {"plain": [], "tls": []}
                for i in range(args.connects):
                    for k in connects:
                        t0 = time.perf_counter()
                        async with channel(k, started[k][0].port, ca) as ch:
                            await call(ch, k, i)
                        connects[k].append((time.perf_counter() - t0) * 1e6)
                for ch in chans.values():
                    await ch.close()
            finally:
                for r, agents in started.values():
                    await r.stop(grace_s=0.1)
                    for a in agents:
                        await a.stop(grace_s=0.1)
    base50, base99 = pct(times["plain"], 50), pct(times["plain"], 99)
    print(f"Generate, 1 token, {args.agents} sim agents, {args.iters} calls each, interleaved,"
          " one open channel (us)")
    print(f"{'':10} {'p50':>8} {'p99':>8} {'p50/plain':>10} {'p99/plain':>10}")
    for k in KINDS:
        p50, p99 = pct(times[k], 50), pct(times[k], 99)
        print(f"{k:10} {p50:8.0f} {p99:8.0f} {p50 / base50:10.2f} {p99 / base99:10.2f}")
    c50 = pct(connects["plain"], 50)
    print(f"new connection per call, {args.connects} each (handshake included; us)")
    for k, xs in connects.items():
        print(f"{k:10} {pct(xs, 50):8.0f} {pct(xs, 99):8.0f} {pct(xs, 50) / c50:10.2f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=400)
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--connects", type=int, default=50)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(p.parse_args()))
