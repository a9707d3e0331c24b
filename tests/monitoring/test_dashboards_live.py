"""A real Prometheus scrapes a running router and three agents under load; every query of
every Grafana dashboard (and every template variable) must return data from it, and the
chart's rules must evaluate without errors.

The router runs with --discovery kubernetes against the local pods list/watch server (no
cluster here), so the discovery panels have data too; the agents listen on 127.0.0.2-4
standing in for pod IPs. Scrape labels mimic the chart's ServiceMonitors (namespace, and
worker = pod name on agent series)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvroute.v1 import common_pb2, program_pb2, router_pb2_grpc
from tests.helm.chart import CHART
from tests.kube_api import FakeKubeApi
from tests.monitoring.prom import PrometheusProc
from tests.support import free_port, wait_for

NAMESPACE = "kvroute-test"
WORKERS = {"worker-0": "127.0.0.2", "worker-1": "127.0.0.3", "worker-2": "127.0.0.4"}
RATE_WINDOW = "20s"  # stands in for Grafana's $__rate_interval (scrapes are 1 s apart)
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi(namespace=NAMESPACE)
    api.start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture
async def prometheus(prom_tools: tuple[str, str], tmp_path: Path) -> AsyncIterator[PrometheusProc]:
    p = PrometheusProc(prom_tools[0], tmp_path)
    try:
        yield p
    finally:
        p.stop()


async def load(port: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """Chats over three shared system prompts, some decision-only calls, a few invalid
    requests (so error panels have data). Bounded by ``stop`` and by the test's timeout."""
    rng = random.Random(7)
    systems = [[rng.randrange(1, 50000) for _ in range(96)] for _ in range(3)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        async def one(i: int) -> None:
            prompt = systems[i % 3] + [rng.randrange(1, 50000) for _ in range(rng.randrange(8, 40))]
            sampling = common_pb2.SamplingParams(max_tokens=4)
            if i % 17 == 0:
                req = common_pb2.GenerateRequest(token_ids=[60000, 1], sampling=sampling)
            elif i % 13 == 0:  # a controller program's fork (the programs panels)
                fork = program_pb2.Fork(n=2, branches=[program_pb2.ControllerProgram(
                    steps=[program_pb2.Step(gen=program_pb2.Gen(max_tokens=4))])])
                req = common_pb2.GenerateRequest(
                    token_ids=prompt, sampling=sampling, program=program_pb2.ControllerProgram(
                        steps=[program_pb2.Step(fork=fork)]))
            else:
                req = common_pb2.GenerateRequest(token_ids=prompt, sampling=sampling,
                                                 session_id=f"s{i % 9}")
            try:
                if i % 5 == 0:
                    await stub.Route(req, timeout=5)
                else:
                    async for _ in stub.Generate(req, timeout=5):
                        pass
                counts["ok"] += 1
            except grpc.aio.AioRpcError:
                counts["error"] += 1

        i = 0
        while not stop.is_set():
            await asyncio.gather(*(one(i + k) for k in range(4)))
            i += 4
            await asyncio.sleep(0.02)


def variable_values(prom: PrometheusProc, var: dict[str, Any], chosen: dict[str, str]
                    ) -> list[str]:
    q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q.strip())
    assert m, f"unsupported variable query {q!r}"
    selector = substitute(m.group(1), chosen)
    return list(prom.api(f"label/{m.group(2)}/values", **{"match[]": selector}))


def substitute(expr: str, chosen: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_WINDOW)
    for name, value in chosen.items():
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    assert "$" not in expr, f"unresolved variable in {expr!r}"
    return expr


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for p in dashboard["panels"]:
        if p["type"] == "row":
            yield from p.get("panels", [])
        else:
            yield p


def check_dashboard(prom: PrometheusProc, dashboard: dict[str, Any]) -> list[str]:
    """Problems found: variables without values, queries without (finite) data."""
    problems: list[str] = []
    chosen: dict[str, str] = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        values = variable_values(prom, var, chosen)
        if not values:
            problems.append(f"variable ${var['name']}: no values")
            return problems
        chosen[var["name"]] = sorted(values)[0]
    for p in panels(dashboard):
        for t in p["targets"]:
            expr = substitute(t["expr"], chosen)
            result = prom.query(expr)
            values = [float(r["value"][1]) for r in result]
            if not result:
                problems.append(f"{p['title']!r}: no data: {expr}")
            elif not any(math.isfinite(v) for v in values):
                problems.append(f"{p['title']!r}: only NaN/Inf: {expr}")
    return problems


async def test_every_dashboard_query_returns_data(
        kube: FakeKubeApi, cluster: Any, prometheus: PrometheusProc, rules_file: Path,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert len(DASHBOARDS) >= 2
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube.kubeconfig())
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)

    agent_port = free_port()
    targets: list[dict[str, Any]] = []
    for name, ip in WORKERS.items():
        mport = free_port()
        await cluster.agent(name, host=ip, port=agent_port, metrics_port=mport,
                            capacity_blocks=64, time_scale=0.05)
        kube.upsert_pod(name, ip=ip)
        targets.append({"targets": [f"{ip}:{mport}"],
                        "labels": {"namespace": NAMESPACE, "worker": name, "pod": name}})
    rport = free_port()
    router = await cluster.router(discovery="kubernetes", k8s_port=agent_port,
                                  metrics_port=rport)
    await wait_for(lambda: set(router.registry.loads) == set(WORKERS), what="3 workers")

    prometheus.start({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s",
                   "scrape_timeout": "900ms"},
        "rule_files": [str(rules_file)],
        "scrape_configs": [
            {"job_name": "kvroute-router", "static_configs": [
                {"targets": [f"127.0.0.1:{rport}"],
                 "labels": {"namespace": NAMESPACE, "pod": "router-0"}}]},
            {"job_name": "kvroute-worker", "static_configs": targets},
        ],
    })

    stop = asyncio.Event()
    counts = {"ok": 0, "error": 0}
    loader = asyncio.create_task(load(router.port, stop, counts))
    try:
        async def q(expr: str) -> list[dict[str, Any]]:
            return await asyncio.to_thread(prometheus.query, expr)

        # Every target scraped, and a few seconds of traffic in the TSDB.
        deadline = time.monotonic() + 30
        while True:
            ups = await q("up")
            busy = await q(f"sum(rate(kvroute_router_requests_total[{RATE_WINDOW}])) > 0")
            if len(ups) == 4 and all(r["value"][1] == "1" for r in ups) and busy:
                break
            assert time.monotonic() < deadline, f"targets {ups}; log:\n{prometheus.log_tail()}"
            await asyncio.sleep(0.5)
        await asyncio.sleep(4)

        problems: list[str] = []
        deadline = time.monotonic() + 20
        while True:
            problems = []
            for path in DASHBOARDS:
                dash = json.loads(path.read_text())
                found = await asyncio.to_thread(check_dashboard, prometheus, dash)
                problems += [f"{path.name}: {p}" for p in found]
            if not problems or time.monotonic() > deadline:
                break
            await asyncio.sleep(1)
        assert not problems, "\n".join(problems)

        # The shipped rules evaluate cleanly against the real series, and nothing alerts on
        # a healthy cluster.
        groups = (await asyncio.to_thread(prometheus.api, "rules"))["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) >= 10
        bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
        assert not bad, bad
        assert await q("kvroute:prefix_hit_ratio:rate5m")
        firing = await q('ALERTS{alertname=~"KvrouteNoHealthyWorkers|KvrouteRedisUnreachable'
                         '|KvrouteDiscoveryDown|KvrouteWorkerKeyMismatch"}')
        assert not firing, firing
        routable = await q("sum(kvroute_router_worker_routable)")
        assert float(routable[0]["value"][1]) == 3
        forks = await q("sum(kvroute_agent_program_forks_total)")  # the programs panels' data
        assert float(forks[0]["value"][1]) > 0
    finally:
        stop.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(loader, 10)
    assert counts["ok"] > 50 and counts["error"] > 0
