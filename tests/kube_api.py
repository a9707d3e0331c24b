"""A small local stand-in for the Kubernetes API server: pods list and watch, nothing else.

No Kubernetes API server can run here, so the discovery code is tested with the real
``kubernetes`` client against this HTTP server, which speaks the parts of the protocol the
router uses, as the API server does:

* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=..&limit=..&continue=..``: a PodList
  whose ``metadata.resourceVersion`` is the current one, paged with ``continue`` tokens;
  an expired token answers HTTP 410 (reason Expired);
* ``...?watch=true&resourceVersion=RV&allowWatchBookmarks=true&timeoutSeconds=N``: a chunked
  stream of JSON lines ``{"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": ...}``
  with every change after RV, then new ones as they happen, until ``timeoutSeconds``; an
  RV older than the last compaction gets an ERROR event carrying a 410 Status (or, with
  ``gone_as_status``, HTTP 410 on the request itself);
* equality-based label selectors (``a=b,c!=d,e``); anything else is a 400, as the real
  server would reject a selector it cannot parse.

Every request is recorded (path and query) so tests can assert what the client sent.
Tests drive it: add, change and delete pods, send bookmarks, compact history, fail the
next requests, end or hold watch streams.
"""

from __future__ import annotations

import base64
import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse


@dataclass
class Request:
    path: str
    query: dict[str, str]
    at: float = field(default_factory=time.monotonic)

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1")


@dataclass
class _Event:
    rv: int
    type: str
    obj: dict[str, Any]


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def _client_gone(h: BaseHTTPRequestHandler) -> bool:
    """The watching client closed its end (a watch client never sends anything more)."""
    sock = h.connection
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def parse_selector(sel: str) -> list[tuple[str, str, str]]:
    """``a=b,c!=d,e`` -> [(key, op, value)]; ValueError for what we do not support."""
    out: list[tuple[str, str, str]] = []
    for part in filter(None, (p.strip() for p in sel.split(","))):
        if "!=" in part:
            k, v = part.split("!=", 1)
            out.append((k.strip(), "!=", v.strip()))
        elif "==" in part:
            k, v = part.split("==", 1)
            out.append((k.strip(), "=", v.strip()))
        elif "=" in part:
            k, v = part.split("=", 1)
            out.append((k.strip(), "=", v.strip()))
        elif " " in part or "(" in part:
            raise ValueError(f"unsupported selector term {part!r}")
        else:
            out.append((part, "exists", ""))
        if not out[-1][0]:
            raise ValueError(f"empty key in selector term {part!r}")
    return out


def matches(labels: dict[str, str], terms: list[tuple[str, str, str]]) -> bool:
    for k, op, v in terms:
        if op == "=" and labels.get(k) != v:
            return False
        if op == "!=" and labels.get(k) == v:
            return False
        if op == "exists" and k not in labels:
            return False
    return True


@dataclass
class FakeKubeApi:
    namespace: str = "kvroute"
    gone_as_status: bool = False  # answer a too-old watch RV with HTTP 410, not an event
    requests: list[Request] = field(default_factory=list)
    _rv: int = 1000
    _oldest: int = 0  # history before this RV is compacted: older watches get 410
    _pods: dict[str, dict[str, Any]] = field(default_factory=dict)
    _events: list[_Event] = field(default_factory=list)
    _failures: list[int] = field(default_factory=list)
    _generation: int = 0  # bumped by end_watches(): open streams end
    _kill_generation: int = 0  # bumped by kill_watches(): open streams break off
    _hold: bool = False
    _closing: bool = False
    _open_watches: int = 0
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self._cond = threading.Condition()

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                api._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self) -> str:
        """A kubeconfig (YAML is a superset of JSON) pointing at this server."""
        return json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "test-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                      "namespace": self.namespace}}],
        })

    # -- driving it ------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def upsert_pod(self, name: str, *, ready: bool = True, ip: str = "10.0.0.1",
                   labels: dict[str, str] | None = None, phase: str = "Running",
                   terminating: bool = False) -> int:
        """Create or change a pod; returns the new resourceVersion."""
        with self._cond:
            self._rv += 1
            old = self._pods.get(name)
            md: dict[str, Any] = {
                "name": name, "namespace": self.namespace, "uid": f"uid-{name}",
                "resourceVersion": str(self._rv),
                "labels": labels if labels is not None else (
                    old["metadata"]["labels"] if old else
                    {"app.kubernetes.io/component": "worker"}),
                "creationTimestamp": "2025-01-01T00:00:00Z",
            }
            if terminating:
                md["deletionTimestamp"] = "2025-01-01T00:10:00Z"
            pod = {
                "apiVersion": "v1", "kind": "Pod", "metadata": md,
                "spec": {"containers": [{"name": "agent", "image": "kvroute:test"}]},
                "status": {
                    "phase": phase, "podIP": ip,
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"},
                                   {"type": "PodScheduled", "status": "True"}],
                },
            }
            self._pods[name] = pod
            self._events.append(_Event(self._rv, "MODIFIED" if old else "ADDED", pod))
            self._cond.notify_all()
            return self._rv

    def delete_pod(self, name: str) -> int:
        with self._cond:
            pod = self._pods.pop(name)
            self._rv += 1
            gone = json.loads(json.dumps(pod))
            gone["metadata"]["resourceVersion"] = str(self._rv)
            self._events.append(_Event(self._rv, "DELETED", gone))
            self._cond.notify_all()
            return self._rv

    def bookmark(self) -> int:
        """Other objects changed (the RV moves on); watchers that asked get a BOOKMARK."""
        with self._cond:
            self._rv += 1
            self._events.append(_Event(self._rv, "BOOKMARK", {
                "kind": "Pod", "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._rv)}}))
            self._cond.notify_all()
            return self._rv

    def compact(self) -> int:
        """Forget history up to now: a watch from an older RV gets 410 Gone."""
        with self._cond:
            self._oldest = self._rv
            self._events = [e for e in self._events if e.rv > self._oldest]
            return self._oldest

    def fail_next(self, code: int, count: int = 1) -> None:
        with self._cond:
            self._failures.extend([code] * count)

    def end_watches(self, *, hold: bool = False) -> None:
        """End open watch streams cleanly (as on timeoutSeconds). ``hold`` keeps new watch
        requests waiting until :meth:`release`."""
        with self._cond:
            self._generation += 1
            self._hold = hold
            self._cond.notify_all()

    def kill_watches(self) -> None:
        """Break open watch streams off mid-stream (no closing chunk)."""
        with self._cond:
            self._kill_generation += 1
            self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._hold = False
            self._cond.notify_all()

    def open_watches(self) -> int:
        with self._cond:
            return self._open_watches

    def watch_requests(self) -> list[Request]:
        return [r for r in list(self.requests) if r.watch]

    def list_requests(self) -> list[Request]:
        return [r for r in list(self.requests) if not r.watch]

    def wait_for(self, pred: Any, timeout: float = 10.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.01)

    # -- serving ---------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        u = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(u.query, keep_blank_values=True).items()}
        req = Request(u.path, query)
        self.requests.append(req)
        with self._cond:
            failure = self._failures.pop(0) if self._failures else None
        if failure is not None:
            return self._send_json(h, failure, status(failure, "InternalError"
                                                      if failure >= 500 else "Forbidden"
                                                      if failure == 403 else "BadRequest",
                                                      f"injected failure {failure}"))
        prefix = f"/api/v1/namespaces/{self.namespace}/pods"
        if u.path != prefix:
            return self._send_json(h, 404, status(404, "NotFound", f"no route {u.path}"))
        try:
            terms = parse_selector(query.get("labelSelector", ""))
        except ValueError as exc:
            return self._send_json(h, 400, status(400, "BadRequest",
                                                  f"unable to parse requirement: {exc}"))
        if req.watch:
            return self._watch(h, query, terms)
        return self._list(h, query, terms)

    def _list(self, h: BaseHTTPRequestHandler, query: dict[str, str],
              terms: list[tuple[str, str, str]]) -> None:
        limit = int(query.get("limit") or 0)
        offset = 0
        with self._cond:
            rv = self._rv
            token = query.get("continue")
            if token:
                tok_rv, _, off = base64.b64decode(token).decode().partition(":")
                if int(tok_rv) < self._oldest:
                    return self._send_json(h, 410, status(
                        410, "Expired", "The provided continue parameter is too old"))
                rv, offset = int(tok_rv), int(off)
            items = [p for _, p in sorted(self._pods.items())
                     if matches(p["metadata"]["labels"], terms)]
        page = items[offset:offset + limit] if limit else items[offset:]
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and offset + limit < len(items):
            meta["continue"] = base64.b64encode(f"{rv}:{offset + limit}".encode()).decode()
        self._send_json(h, 200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                                 "items": page})

    def _watch(self, h: BaseHTTPRequestHandler, query: dict[str, str],
               terms: list[tuple[str, str, str]]) -> None:
        timeout_s = float(query.get("timeoutSeconds") or 1800)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        with self._cond:
            while self._hold and not self._closing:
                self._cond.wait(0.05)
            since = int(query.get("resourceVersion") or self._rv)
            too_old = since < self._oldest
            gen, kill = self._generation, self._kill_generation
        if too_old and self.gone_as_status:
            return self._send_json(h, 410, status(410, "Expired",
                                                  f"too old resource version: {since}"))
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if too_old:
            self._chunk(h, {"type": "ERROR", "object": status(
                410, "Expired", f"too old resource version: {since} ({self._oldest})")})
            return self._end(h)
        with self._cond:
            self._open_watches += 1
        try:
            for ev in self._follow(h, since, timeout_s, gen, kill):
                if ev is None:  # killed: drop the connection without the closing chunk
                    h.close_connection = True
                    return
                if ev.type == "BOOKMARK" and not bookmarks:
                    continue
                if ev.type != "BOOKMARK" and not matches(ev.obj["metadata"]["labels"], terms):
                    continue
                self._chunk(h, {"type": ev.type, "object": ev.obj})
            self._end(h)
        except OSError:
            pass  # the client went away (the router stopped its watch)
        finally:
            with self._cond:
                self._open_watches -= 1

    def _follow(self, h: BaseHTTPRequestHandler, since: int, timeout_s: float, gen: int,
                kill: int) -> Iterator[_Event | None]:
        deadline = time.monotonic() + timeout_s
        cursor = since
        while True:
            with self._cond:
                while True:
                    if self._kill_generation != kill:
                        yield None
                        return
                    pending = [e for e in self._events if e.rv > cursor]
                    if (pending or self._closing or self._generation != gen
                            or time.monotonic() >= deadline or _client_gone(h)):
                        break
                    self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                if not pending:
                    return
            for ev in pending:
                cursor = ev.rv
                yield ev

    @staticmethod
    def _chunk(h: BaseHTTPRequestHandler, obj: dict[str, Any]) -> None:
        data = (json.dumps(obj) + "\n").encode()
        h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        h.wfile.flush()

    @staticmethod
    def _end(h: BaseHTTPRequestHandler) -> None:
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

    @staticmethod
    def _send_json(h: BaseHTTPRequestHandler, code: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)
