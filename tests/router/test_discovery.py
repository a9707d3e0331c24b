"""Kubernetes discovery: the real ``kubernetes`` client against a local server speaking the
pods list/watch protocol (tests/kube_api.py). No Kubernetes cluster runs here."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from kvroute.core.redis_schema import Heartbeat
from kvroute.router.discovery import (
    DiscoveryCollector,
    KubernetesDiscovery,
    WatchSettings,
    make_discovery,
)
from kvroute.router.registry import WorkerRegistry
from tests.conftest import router_config
from tests.kube_api import FakeKubeApi
from tests.support import RedisProc, free_port, route, wait_for

SELECTOR = "app.kubernetes.io/component=worker"
FAST = WatchSettings(watch_timeout_s=30, request_timeout_s=2.0, backoff_min_s=0.05,
                     backoff_max_s=0.2, page_size=500)


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi()
    api.start()
    try:
        yield api
    finally:
        api.stop()


def api_client(url: str) -> client.ApiClient:
    conf = client.Configuration()
    conf.host = url
    return client.ApiClient(conf)


def beats(*workers: str) -> dict[str, Heartbeat]:
    return {w: Heartbeat(w, f"{w}.old:50061", "e1") for w in workers}


@pytest.fixture
async def discover(kube: FakeKubeApi) -> AsyncIterator[Callable[..., Any]]:
    started: list[KubernetesDiscovery] = []

    async def make(registry: WorkerRegistry, *, settings: WatchSettings = FAST,
                   url: str | None = None, selector: str = SELECTOR,
                   wait: bool = True) -> KubernetesDiscovery:
        d = KubernetesDiscovery(api_client(url or kube.url), kube.namespace, selector, 50061,
                                registry, settings)
        await d.start()
        started.append(d)
        if wait:
            await asyncio.wait_for(d.ready.wait(), 10)
        return d

    yield make
    for d in started:
        await d.stop()


def routable(reg: WorkerRegistry) -> set[str]:
    return set(reg.loads)


async def test_list_then_watch_follows_readiness(kube: FakeKubeApi,
                                                 discover: Callable[..., Any]) -> None:
    kube.upsert_pod("w0", ip="10.1.0.1")
    kube.upsert_pod("w1", ip="10.1.0.2", ready=False)
    kube.upsert_pod("other", ip="10.1.0.9", labels={"app.kubernetes.io/component": "router"})
    reg = WorkerRegistry({"static": "s:1"}, 16)
    reg.apply_heartbeats(beats("w0", "w1", "w2", "other"))
    d = await discover(reg)

    # Listed: only the Ready pod's worker (and the static one) is routable, at the pod IP.
    assert routable(reg) == {"static", "w0"}
    assert reg.get("w0").address == "10.1.0.1:50061"  # type: ignore[union-attr]
    first = kube.requests[0]
    assert not first.watch and first.query["labelSelector"] == SELECTOR
    await wait_for(lambda: kube.watch_requests() != [], what="watch request")
    w = kube.watch_requests()[0]
    assert w.query["resourceVersion"] == str(kube.resource_version)
    assert w.query["allowWatchBookmarks"] == "true" and w.query["labelSelector"] == SELECTOR

    kube.upsert_pod("w1", ip="10.1.0.2", ready=True)  # MODIFIED: becomes Ready
    await wait_for(lambda: routable(reg) == {"static", "w0", "w1"}, what="w1 ready")
    kube.upsert_pod("w0", ip="10.1.0.1", ready=False)  # MODIFIED: readiness probe fails
    await wait_for(lambda: routable(reg) == {"static", "w1"}, what="w0 not ready")
    kube.upsert_pod("w0", ip="10.1.0.1", ready=True)
    await wait_for(lambda: "w0" in routable(reg), what="w0 back")
    kube.upsert_pod("w0", ip="10.1.0.1", terminating=True)  # deletionTimestamp set
    await wait_for(lambda: routable(reg) == {"static", "w1"}, what="w0 terminating")
    kube.delete_pod("w1")  # DELETED
    await wait_for(lambda: routable(reg) == {"static"}, what="w1 deleted")
    kube.upsert_pod("w2", ip="10.1.0.3")  # ADDED while watching
    await wait_for(lambda: routable(reg) == {"static", "w2"}, what="w2 added")

    # The heartbeat alone never makes a pod routable again: still gated after a new scan.
    reg.apply_heartbeats(beats("w0", "w1", "w2", "other"))
    assert routable(reg) == {"static", "w2"}
    assert d.stats.lists == 1 and d.stats.events == 6 and d.stats.errors == 0
    assert d.stats.ready == 1 and d.stats.not_ready == 1


async def test_gate_closed_until_first_list(kube: FakeKubeApi,
                                            discover: Callable[..., Any]) -> None:
    kube.upsert_pod("w0", ip="10.1.0.1")
    kube.fail_next(503, 2)
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats(beats("w0"))
    assert routable(reg) == {"w0"}  # no gate yet
    d = await discover(reg, wait=False)
    assert routable(reg) == set()  # closed before anything was listed
    await asyncio.wait_for(d.ready.wait(), 10)
    assert routable(reg) == {"w0"}
    assert d.stats.errors == 2 and d.stats.up


async def test_bookmark_moves_the_resume_point(kube: FakeKubeApi,
                                               discover: Callable[..., Any]) -> None:
    kube.upsert_pod("w0")
    reg = WorkerRegistry({}, 16)
    d = await discover(reg)
    await wait_for(lambda: kube.open_watches() == 1, what="watch open")
    bm = kube.bookmark()
    await wait_for(lambda: d.stats.bookmarks == 1, what="bookmark seen")
    # History up to the bookmark is compacted; resuming from it must not need a re-list.
    kube.compact()
    kube.end_watches()
    await wait_for(lambda: len(kube.watch_requests()) == 2, what="watch resumed")
    assert kube.watch_requests()[1].query["resourceVersion"] == str(bm)
    await wait_for(lambda: kube.open_watches() == 1, what="second watch open")
    assert d.stats.relists_gone == 0 and len(kube.list_requests()) == 1


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists_and_catches_up(kube: FakeKubeApi, discover: Callable[..., Any],
                                               gone_as_status: bool) -> None:
    kube.gone_as_status = gone_as_status
    kube.upsert_pod("w0", ip="10.1.0.1")
    kube.upsert_pod("w1", ip="10.1.0.2")
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats(beats("w0", "w1", "w3"))
    d = await discover(reg)
    assert routable(reg) == {"w0", "w1"}
    await wait_for(lambda: kube.open_watches() == 1, what="watch open")
    # The router is cut off; meanwhile w0 goes away, w3 arrives and history is compacted.
    kube.end_watches(hold=True)
    await wait_for(lambda: len(kube.watch_requests()) == 2, what="watch retried")
    kube.delete_pod("w0")
    kube.upsert_pod("w3", ip="10.1.0.4")
    kube.compact()
    kube.release()
    await wait_for(lambda: d.stats.relists_gone == 1, what="410 seen")
    await wait_for(lambda: routable(reg) == {"w1", "w3"}, what="relisted view")
    assert len(kube.list_requests()) == 2
    assert d.stats.errors == 0  # a 410 is routine, not an error
    await wait_for(lambda: kube.open_watches() == 1, what="watching again")
    last = kube.watch_requests()[-1]
    assert int(last.query["resourceVersion"]) == kube.resource_version


async def test_paged_list_and_expired_continue_token(kube: FakeKubeApi,
                                                     discover: Callable[..., Any]) -> None:
    for i in range(5):
        kube.upsert_pod(f"w{i}", ip=f"10.1.0.{i + 1}")
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats(beats(*(f"w{i}" for i in range(5))))
    paged = WatchSettings(**{**FAST.__dict__, "page_size": 2})
    d = await discover(reg, settings=paged)
    await wait_for(lambda: kube.open_watches() == 1, what="watch open")
    lists = kube.list_requests()
    assert [r.query.get("limit") for r in lists] == ["2", "2", "2"]
    assert "continue" not in lists[0].query and all("continue" in r.query for r in lists[1:])
    assert routable(reg) == {f"w{i}" for i in range(5)}

    # A continue token that expired mid-list (410) restarts the list from the top.
    kube.end_watches(hold=True)
    await wait_for(lambda: len(kube.watch_requests()) == 2, what="watch held")
    kube.delete_pod("w4")
    kube.compact()
    kube.release()
    await wait_for(lambda: d.stats.relists_gone >= 1 and d.stats.lists >= 2, what="relist")
    await wait_for(lambda: routable(reg) == {f"w{i}" for i in range(4)}, what="w4 gone")


async def test_errors_back_off_and_keep_last_known_pods(
        kube: FakeKubeApi, discover: Callable[..., Any],
        caplog: pytest.LogCaptureFixture) -> None:
    kube.upsert_pod("w0", ip="10.1.0.1")
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats(beats("w0"))
    d = await discover(reg)
    await wait_for(lambda: kube.open_watches() == 1, what="watch open")
    caplog.set_level(logging.WARNING, "kvroute.router.discovery")
    n = len(kube.requests)
    kube.fail_next(403, 3)  # RBAC trouble for a while
    kube.kill_watches()  # and the open stream breaks off
    await wait_for(lambda: d.stats.errors >= 4, what="errors counted")
    assert routable(reg) == {"w0"}  # last known pods keep their traffic
    assert any("RBAC" in str(getattr(r, "kv", {}).get("hint", "")) for r in caplog.records)
    await wait_for(lambda: kube.open_watches() == 1 and d.stats.up, what="recovered")
    # Backoff doubles from 0.05 s up to the 0.2 s cap (each with +-20% jitter). After a
    # failure the view is rebuilt with a list (which also proves the API is back).
    retries = kube.requests[n:]
    assert [r.watch for r in retries] == [False, False, False, False, True], retries
    gaps = [b.at - a.at for a, b in itertools.pairwise(retries)]
    assert gaps[0] >= 0.1 * 0.8 and gaps[1] >= 0.2 * 0.8 and gaps[2] >= 0.2 * 0.8, gaps
    kube.upsert_pod("w0", ip="10.1.0.1", ready=False)
    await wait_for(lambda: routable(reg) == set(), what="events flow again")


async def test_api_server_unreachable(discover: Callable[..., Any]) -> None:
    reg = WorkerRegistry({}, 16)
    reg.apply_heartbeats(beats("w0"))
    d = await discover(reg, url=f"http://127.0.0.1:{free_port()}", wait=False)
    await wait_for(lambda: d.stats.errors >= 2, what="connection errors")
    assert not d.stats.up and not d.ready.is_set()
    assert routable(reg) == set()
    text = "\n".join(str(m) for m in DiscoveryCollector(d).collect())
    assert "kvroute_router_discovery_up" in text


async def test_stop_interrupts_an_open_watch_quickly(kube: FakeKubeApi) -> None:
    kube.upsert_pod("w0")
    reg = WorkerRegistry({}, 16)
    slow = WatchSettings(**{**FAST.__dict__, "watch_timeout_s": 600})
    d = KubernetesDiscovery(api_client(kube.url), kube.namespace, SELECTOR, 50061, reg, slow)
    await d.start()
    await wait_for(lambda: kube.open_watches() == 1, what="watch open")
    t0 = time.monotonic()
    await d.stop(timeout_s=5)
    assert time.monotonic() - t0 < 2.0
    assert d._thread is not None and not d._thread.is_alive()
    await wait_for(lambda: kube.open_watches() == 0, what="server saw the watch end")


def test_bad_discovery_name_is_a_clear_error() -> None:
    reg = WorkerRegistry({}, 16)
    with pytest.raises(SystemExit, match=r"--discovery .*must be one of redis, kubernetes"):
        make_discovery(router_config("redis://x", discovery="consul"), reg)
    assert make_discovery(router_config("redis://x"), reg) is None


def test_no_kubeconfig_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                        ) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SystemExit, match="no usable kubeconfig"):
        make_discovery(router_config("redis://x", discovery="kubernetes"),
                       WorkerRegistry({}, 16))


async def test_router_routes_only_to_ready_pods(
        kube: FakeKubeApi, redis_server: RedisProc, cluster: Any, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole path: RouterApp with --discovery kubernetes (kubeconfig -> fake API),
    agents on distinct loopback addresses standing in for pod IPs, one agent port."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(kube.kubeconfig())
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    port = free_port()
    ips = {"worker-0": "127.0.0.2", "worker-1": "127.0.0.3"}
    for name, ip in ips.items():
        await cluster.agent(name, host=ip, port=port)
    kube.upsert_pod("worker-0", ip=ips["worker-0"])
    kube.upsert_pod("worker-1", ip=ips["worker-1"], ready=False)
    router = await cluster.router(discovery="kubernetes", k8s_port=port,
                                  k8s_selector=SELECTOR)
    assert router.discovery is not None and router.discovery.namespace == kube.namespace
    await wait_for(lambda: set(router.registry.loads) == {"worker-0"}, what="gate applied")
    # Both heartbeats are alive; only the Ready pod gets traffic.
    assert {"worker-0", "worker-1"} <= {i.worker_id for i in router.registry.all()}
    for i in range(6):
        r = await route(router.port, list(range(i * 40, i * 40 + 40)))
        assert r.worker_id == "worker-0" and r.address == f"127.0.0.2:{port}"  # type: ignore[attr-defined]

    kube.upsert_pod("worker-1", ip=ips["worker-1"], ready=True)
    kube.upsert_pod("worker-0", ip=ips["worker-0"], ready=False)
    await wait_for(lambda: set(router.registry.loads) == {"worker-1"}, what="swap")
    r = await route(router.port, list(range(64)))
    assert r.worker_id == "worker-1"  # type: ignore[attr-defined]

    kube.delete_pod("worker-1")  # its agent still heartbeats: no traffic all the same
    await wait_for(lambda: not router.registry.loads, what="no ready pods")
    import grpc

    with pytest.raises(grpc.aio.AioRpcError) as err:
        await route(router.port, list(range(64)))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    text = "\n".join(str(m) for m in DiscoveryCollector(router.discovery).collect())
    assert "kvroute_router_discovery_up" in text


def test_registry_gate(caplog: pytest.LogCaptureFixture) -> None:
    reg = WorkerRegistry({"s": "h:9"}, 16)
    reg.apply_heartbeats(beats("a", "b", "stray"))
    reg.set_gate({}, listed=False)  # before the first list: closed, nothing reported
    assert set(reg.loads) == {"s"}
    assert not [r for r in caplog.records if "no pod of that name" in r.getMessage()]
    caplog.set_level(logging.WARNING, "kvroute.router.registry")
    reg.set_gate({"a": "10.0.0.1:50061"}, known={"a", "b"})
    assert set(reg.loads) == {"s", "a"}  # static workers are never gated
    assert reg.get("a").address == "10.0.0.1:50061"  # type: ignore[union-attr]
    reg.apply_heartbeats(beats("a", "b", "stray"))  # heartbeats do not reopen the gate
    assert set(reg.loads) == {"s", "a"}
    assert reg.get("a").address == "10.0.0.1:50061"  # type: ignore[union-attr]
    stray = [r for r in caplog.records if "no pod of that name" in r.getMessage()]
    assert [r.kv["worker"] for r in stray] == ["stray"]  # type: ignore[attr-defined]
    reg.mark_down("a", 0.0)
    reg.revive_due()
    assert set(reg.loads) == {"s", "a"}
    reg.begin("b", 10)  # accounting on a gated worker is harmless and keeps it out
    reg.end("b")
    assert "b" not in reg.loads
    reg.set_gate(None)  # lifted: heartbeats alone decide again
    assert set(reg.loads) == {"s", "a", "b", "stray"}
