"""Worker discovery through the Kubernetes API (``--discovery kubernetes``).

The router lists the worker pods that match a label selector, then watches them from the
list's resourceVersion. Pods that exist, are Ready and not terminating form the registry's
*gate*: only they receive traffic, even while an older heartbeat in Redis still says
otherwise. Heartbeats still say how loaded each worker is and whether its block keys match.
A pod's name is its worker id (the chart starts each agent with ``--worker-id $(POD_NAME)``)
and it is reached at ``<pod IP>:<--k8s-port>``.

The ``kubernetes`` client blocks, so the list/watch loop runs in a thread of its own and
hands each new view of the pods to the event loop (``call_soon_threadsafe``); the registry
is only ever touched on the loop. Protocol handling:

* list (paged with ``limit``/``continue``), then watch with ``resourceVersion``,
  ``allowWatchBookmarks`` and a server-side ``timeoutSeconds``; when a watch ends normally
  it is resumed from the last resourceVersion seen (events and BOOKMARKs both advance it);
* 410 Gone (an ERROR event in the stream or an HTTP status, on watch or on a paged list)
  means that resourceVersion was compacted away: list again from scratch, at once;
* any other failure (connection refused, 403, 500, a broken stream) backs off
  exponentially with jitter, keeping the last known pods: the API server being away is no
  reason to stop routing to pods that were Ready.

Until the first list succeeds the gate is closed: no heartbeat worker gets traffic before
Kubernetes has said it is Ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvroute.core.config import RouterConfig
from kvroute.router.registry import WorkerRegistry

log = logging.getLogger("kvroute.router.discovery")

SA_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
HTTP_GONE = 410


@dataclass(frozen=True)
class PodState:
    name: str
    ip: str
    ready: bool
    terminating: bool

    @property
    def routable(self) -> bool:
        return self.ready and not self.terminating and bool(self.ip)


def pod_state(pod: Any) -> PodState:
    """A V1Pod reduced to what routing needs. Ready = the pod's Ready condition is True
    (all its containers pass their readiness probes) and it is Running."""
    md, st = pod.metadata, pod.status
    conditions = (st.conditions if st is not None else None) or []
    ready = (st is not None and st.phase == "Running"
             and any(c.type == "Ready" and c.status == "True" for c in conditions))
    return PodState(name=md.name, ip=(st.pod_ip or "") if st is not None else "",
                    ready=ready, terminating=md.deletion_timestamp is not None)


def pod_address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


@dataclass
class DiscoveryStats:
    lists: int = 0
    relists_gone: int = 0
    watches: int = 0
    events: int = 0
    bookmarks: int = 0
    errors: int = 0
    up: bool = False
    resource_version: str = ""
    ready: int = 0
    not_ready: int = 0


@dataclass(frozen=True)
class WatchSettings:
    watch_timeout_s: int = 240  # server-side timeoutSeconds; the watch is then resumed
    request_timeout_s: float = 10.0  # connect timeout, and read timeout of list calls
    backoff_min_s: float = 0.5
    backoff_max_s: float = 30.0
    page_size: int = 500


class _GoneError(Exception):
    """The resourceVersion or continue token was compacted away (HTTP 410)."""

    def __init__(self, where: str, detail: str = "") -> None:
        super().__init__(f"{where}: {detail}")
        self.where = where
        self.detail = detail


class KubernetesDiscovery:
    """Watches worker pods in one namespace and gates the registry on their readiness."""

    def __init__(self, api_client: Any, namespace: str, selector: str, agent_port: int,
                 registry: WorkerRegistry, settings: WatchSettings | None = None) -> None:
        from kubernetes import client

        if not namespace:
            raise ValueError("kubernetes discovery needs a namespace")
        self.namespace = namespace
        self.selector = selector
        self.agent_port = agent_port
        self.settings = settings or WatchSettings()
        self.stats = DiscoveryStats()
        self._api = client.CoreV1Api(api_client)
        self._api_client = api_client
        self._registry = registry
        self._pods: dict[str, PodState] = {}  # owned by the watch thread
        self._stop = threading.Event()
        self._watch_lock = threading.Lock()
        self._watch: Any = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.ready = asyncio.Event()  # set once the first list has been applied
        self._seen_ready: set[str] = set()

    # -- event-loop side -------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._registry.set_gate({}, listed=False)
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._thread.start()
        log.info("kubernetes discovery started", extra={"kv": {
            "namespace": self.namespace, "selector": self.selector,
            "agent_port": self.agent_port}})

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the watch thread: interrupt its blocking read, then join it."""
        self._stop.set()
        if self._thread is not None:
            deadline = time.monotonic() + timeout_s
            while self._thread.is_alive() and time.monotonic() < deadline:
                # Watch.stop() shuts the socket down, unblocking the read; repeated because
                # a watch request still being sent has no socket to shut yet.
                with self._watch_lock:
                    if self._watch is not None:
                        self._watch.stop()
                await asyncio.to_thread(self._thread.join, 0.05)
            if self._thread.is_alive():
                log.warning("kubernetes watch thread did not stop in time; abandoning it "
                            "(daemon thread)", extra={"kv": {"timeout_s": timeout_s}})
        with contextlib.suppress(Exception):
            self._api_client.close()
        log.info("kubernetes discovery stopped")

    def _apply(self, pods: dict[str, PodState], listed: bool) -> None:
        ready = {n: pod_address(p.ip, self.agent_port) for n, p in pods.items() if p.routable}
        for name in sorted(ready.keys() - self._seen_ready):
            log.info("worker pod ready", extra={"kv": {"pod": name, "address": ready[name]}})
        for name in sorted(self._seen_ready - ready.keys()):
            state = pods.get(name)
            why = ("deleted" if state is None else "terminating" if state.terminating
                   else "not ready")
            log.info("worker pod out of rotation", extra={"kv": {"pod": name, "why": why}})
        self._seen_ready = set(ready)
        self.stats.ready = len(ready)
        self.stats.not_ready = len(pods) - len(ready)
        self._registry.set_gate(ready, pods.keys(), listed=listed)
        if listed:
            self.ready.set()

    def _publish(self, listed: bool = True) -> None:
        """From the watch thread: hand a copy of the pod view to the event loop."""
        snapshot = dict(self._pods)
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # loop closing under us during shutdown
            loop.call_soon_threadsafe(self._apply, snapshot, listed)

    # -- watch thread ----------------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes.client.rest import ApiException

        s = self.settings
        backoff = s.backoff_min_s
        rv: str | None = None
        gone_streak = 0
        while not self._stop.is_set():
            try:
                if rv is None:
                    rv = self._list()
                    backoff = s.backoff_min_s
                rv = self._watch_from(rv)
                gone_streak = 0
                continue
            except (_GoneError, ApiException) as exc:
                if isinstance(exc, ApiException) and exc.status != HTTP_GONE:
                    error: object = f"HTTP {exc.status} {exc.reason}".strip()
                    hint = {401: "the service account token was rejected",
                            403: "RBAC must allow list and watch on pods in this namespace",
                            400: "check --k8s-selector"}.get(exc.status or 0, "")
                else:
                    # Routine: that resourceVersion was compacted away. List again at once;
                    # only a server answering 410 over and over gets backed off from.
                    self.stats.relists_gone += 1
                    gone_streak += 1
                    log.info("resourceVersion expired (410 Gone); listing again",
                             extra={"kv": {"detail": str(exc)}})
                    rv = None
                    if gone_streak > 1:
                        self._stop.wait(min(s.backoff_min_s * gone_streak, s.backoff_max_s))
                    continue
            except Exception as exc:  # connection refused, reset, timeouts, bad payloads
                if self._stop.is_set():
                    break
                error, hint = f"{type(exc).__name__}: {exc}", ""
            self.stats.errors += 1
            self.stats.up = False
            # Start over with a list: it proves the API is back (a quiet watch would not
            # say so for minutes) and catches up on anything a broken stream lost.
            rv = None
            log.warning("kubernetes list/watch failed; keeping the last known pods and "
                        "retrying", extra={"kv": {"error": error, "hint": hint,
                                                  "retry_in_s": round(backoff, 2)}})
            self._stop.wait(backoff * random.uniform(0.8, 1.2))
            backoff = min(backoff * 2, s.backoff_max_s)

    def _list(self) -> str:
        """List every matching pod (paged); replace the view; return the list's RV."""
        from kubernetes.client.rest import ApiException

        pods: dict[str, PodState] = {}
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.selector,
                                      "limit": self.settings.page_size,
                                      "_request_timeout": self.settings.request_timeout_s}
            if token:
                kwargs["_continue"] = token
            try:
                page = self._api.list_namespaced_pod(self.namespace, **kwargs)
            except ApiException as exc:
                if exc.status == HTTP_GONE:
                    raise _GoneError("list", "continue token expired") from None
                raise
            for pod in page.items or []:
                st = pod_state(pod)
                pods[st.name] = st
            token = page.metadata._continue if page.metadata is not None else None
            if not token:
                rv = page.metadata.resource_version if page.metadata is not None else ""
                break
        if not rv:
            raise ValueError("pod list carried no resourceVersion")
        self._pods = pods
        self.stats.lists += 1
        self.stats.resource_version = rv
        self.stats.up = True
        log.info("worker pods listed", extra={"kv": {
            "pods": len(pods), "ready": sum(p.routable for p in pods.values()),
            "resource_version": rv}})
        self._publish(listed=True)
        return rv

    def _watch_from(self, rv: str) -> str:
        """Follow one watch stream from ``rv`` until the server ends it or we stop.
        Returns the last resourceVersion seen (the one to resume from)."""
        from kubernetes import watch

        w = watch.Watch()
        with self._watch_lock:
            if self._stop.is_set():
                return rv
            self._watch = w
        self.stats.watches += 1
        try:
            for ev in self._events(w, rv):
                typ = ev["type"]
                raw = ev.get("raw_object") or {}
                new_rv = (raw.get("metadata") or {}).get("resourceVersion")
                if typ == "BOOKMARK":
                    self.stats.bookmarks += 1
                elif typ in ("ADDED", "MODIFIED", "DELETED"):
                    self.stats.events += 1
                    self._on_event(typ, ev["object"])
                else:
                    log.warning("ignoring unknown watch event", extra={"kv": {"type": typ}})
                if new_rv:
                    rv = new_rv
                    self.stats.resource_version = rv
        finally:
            with self._watch_lock:
                self._watch = None
        return rv

    def _events(self, w: Any, rv: str) -> Iterator[dict[str, Any]]:
        s = self.settings
        try:
            yield from w.stream(
                self._api.list_namespaced_pod, self.namespace, label_selector=self.selector,
                resource_version=rv, allow_watch_bookmarks=True,
                timeout_seconds=s.watch_timeout_s,
                # Read timeout past the server's own timeout: a silent, dead connection
                # still ends, and is then resumed.
                _request_timeout=(s.request_timeout_s, s.watch_timeout_s + 30))
        except Exception as exc:
            status = getattr(exc, "status", None)
            if status == HTTP_GONE:
                raise _GoneError("watch", str(getattr(exc, "reason", ""))) from None
            raise

    def _on_event(self, typ: str, pod: Any) -> None:
        st = pod_state(pod)
        before = self._pods.get(st.name)
        if typ == "DELETED":
            self._pods.pop(st.name, None)
        else:
            self._pods[st.name] = st
        if before != self._pods.get(st.name):
            self._publish()


def resolve_namespace(configured: str) -> str:
    """--k8s-namespace, else the pod's own namespace, else the kubeconfig context's."""
    if configured:
        return configured
    with contextlib.suppress(OSError):
        ns = SA_NAMESPACE_FILE.read_text().strip()
        if ns:
            return ns
    from kubernetes import config

    with contextlib.suppress(Exception):
        _contexts, active = config.list_kube_config_contexts(config_file=kubeconfig_path())
        ns = (active or {}).get("context", {}).get("namespace", "")
        if ns:
            return ns
    return "default"


def kubeconfig_path() -> str:
    # Read at call time: the client's own default is fixed when it is imported.
    return os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")


def load_api_client() -> Any:
    """In a pod: the service account (KUBERNETES_SERVICE_HOST is set). Elsewhere: the
    kubeconfig ($KUBECONFIG or ~/.kube/config). A clear SystemExit if neither works."""
    from kubernetes import client, config

    conf = client.Configuration()
    try:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=conf)
        else:
            config.load_kube_config(config_file=kubeconfig_path(), client_configuration=conf)
    except (config.ConfigException, OSError, TypeError) as exc:
        raise SystemExit(
            "--discovery kubernetes: no in-cluster service account and no usable "
            f"kubeconfig ({exc})") from None
    return client.ApiClient(conf)


KUBERNETES_INSTALL_HINT = "pip install 'kvroute[kubernetes]'"


def from_config(cfg: RouterConfig, registry: WorkerRegistry) -> KubernetesDiscovery:
    """The discovery ``cfg`` names. SystemExit in one line when the kubernetes client is not
    installed (the plain install leaves it out)."""
    try:
        import kubernetes  # noqa: F401 - only to name the extra when it is missing
    except ImportError:
        raise SystemExit("--discovery kubernetes needs the kubernetes client: "
                         f"{KUBERNETES_INSTALL_HINT}") from None
    api_client = load_api_client()
    return KubernetesDiscovery(api_client, resolve_namespace(cfg.workers.k8s_namespace),
                               cfg.workers.k8s_selector, cfg.workers.k8s_port, registry)


class DiscoveryCollector(Collector):
    """``kvroute_router_discovery_*``: is the watch healthy, how many pods in each state."""

    def __init__(self, discovery: KubernetesDiscovery) -> None:
        self._d = discovery

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        st = self._d.stats
        yield GaugeMetricFamily("kvroute_router_discovery_up",
                                "1 while the Kubernetes pod list/watch is healthy",
                                value=int(st.up))
        pods = GaugeMetricFamily("kvroute_router_discovery_pods",
                                 "Worker pods matching the selector, by state",
                                 labels=["state"])
        pods.add_metric(["ready"], st.ready)
        pods.add_metric(["not_ready"], st.not_ready)
        yield pods
        for name, doc, v in (
            ("kvroute_router_discovery_lists", "Full pod lists", st.lists),
            ("kvroute_router_discovery_relists_gone",
             "Lists forced by 410 Gone (resourceVersion compacted)", st.relists_gone),
            ("kvroute_router_discovery_events", "Pod watch events applied", st.events),
            ("kvroute_router_discovery_errors", "Failed list/watch calls", st.errors),
        ):
            yield CounterMetricFamily(name, doc, value=v)


def make_discovery(cfg: RouterConfig, registry: WorkerRegistry
                   ) -> KubernetesDiscovery | None:
    """The discovery named by ``--discovery``: None for redis (heartbeats alone)."""
    if cfg.workers.discovery == "redis":
        return None
    if cfg.workers.discovery == "kubernetes":
        try:
            return from_config(cfg, registry)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    raise SystemExit(f"unknown --discovery {cfg.workers.discovery!r}; choose redis or kubernetes")


__all__ = [
    "DiscoveryCollector",
    "KubernetesDiscovery",
    "PodState",
    "WatchSettings",
    "make_discovery",
    "pod_state",
]
