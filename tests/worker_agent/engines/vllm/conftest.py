"""Fixtures: vLLM's sources (from the wheels, cached) and the fake vLLM server.

Every test that takes ``vllm_release``, ``kv_events`` or ``fake_vllm`` runs once per end of
the supported range (:data:`kvroute.worker_agent.engines.vllm.versions.SUPPORTED`), against
that release's own code."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from kvroute.worker_agent.engines.vllm.versions import SUPPORTED
from tests.support import free_port, free_port_span, stop_process
from tests.worker_agent.engines.vllm.vllm_release import Release, read_release
from tests.worker_agent.engines.vllm.vllm_wire import load_kv_events, vllm_sources
from tests.worker_agent.engines.wheels import REPO


@pytest.fixture(scope="session", params=SUPPORTED, ids=lambda v: f"vllm-{v}")
def vllm_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="session")
def vllm_src(vllm_version: str) -> Path:
    try:
        return vllm_sources(vllm_version)
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def vllm_release(vllm_version: str, vllm_src: Path) -> Release:
    """What that release's code declares (request/response fields, features)."""
    return read_release(vllm_version, vllm_src)


@pytest.fixture(scope="session")
def kv_events(vllm_src: Path) -> ModuleType:
    """vLLM's own ``vllm/distributed/kv_events.py``, executed from the wheel."""
    return load_kv_events(vllm_src)


@dataclass
class FakeServerProc:
    """A fake server subprocess (``module``: fake_vllm.py, or SGLang's fake_sglang.py), by PID:
    started with its ports, ``release_args`` (its release's sources) and ``args``."""

    module: str
    release_args: list[str]
    args: list[str] = field(default_factory=list)
    release: Any = None
    """What the release's code declares (a vLLM ``Release``), for tests to read."""
    # A fake SGLang with data-parallel ranks serves rank r on these ports + r (up to 4).
    http_port: int = field(default_factory=free_port)
    events_port: int = field(default_factory=free_port_span)
    upstream_port: int = field(default_factory=free_port_span)
    replay_port: int = field(default_factory=free_port_span)
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def start(self) -> None:
        fd, path = tempfile.mkstemp(prefix="fake-server-", suffix=".log")
        self.log = Path(path)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module,
             "--http-port", str(self.http_port), "--events-port", str(self.events_port),
             "--upstream-port", str(self.upstream_port), "--replay-port", str(self.replay_port),
             *self.release_args, *self.args],
            cwd=REPO, stdout=subprocess.PIPE, stderr=fd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        os.close(fd)
        assert self.proc.stdout is not None
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if sel.select(0.1):
                line = self.proc.stdout.readline().decode()
                if line.startswith("READY "):
                    json.loads(line[6:])
                    return
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"{self.module} did not start: {self.log_text()[-2000:]}")

    def stop(self) -> None:
        stop_process(self.proc)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def log_text(self) -> str:
        return self.log.read_text() if self.log and self.log.exists() else ""

    # -- control (test-only endpoints) -------------------------------------------------------

    def state(self, rank: int = 0) -> dict[str, Any]:
        """``rank``: a fake SGLang's data-parallel rank's."""
        return httpx.get(self.url + f"/control/state?rank={rank}").json()

    def truth(self, rank: int = 0) -> set[int]:
        return set(self.state(rank)["keys"])

    def requests(self, rank: int = 0) -> list[dict[str, Any]]:
        """Every completion request body received, in order."""
        return httpx.get(self.url + f"/control/requests?rank={rank}").json()

    def drop(self, seqs: list[int] | None = None, next_n: int = 0) -> None:
        httpx.post(self.url + "/control/drop", json={"seqs": seqs or [], "next": next_n})

    def inject(self, frames: list[bytes]) -> None:
        httpx.post(self.url + "/control/inject", json={"frames": [f.hex() for f in frames]})

    def evict(self, n: int) -> int:
        return httpx.post(self.url + "/control/evict", json={"n": n}).json()["evicted"]

    def reset_prefix_cache(self) -> int:
        return httpx.post(self.url + "/reset_prefix_cache").status_code


def fake_servers(module: str, release_args: list[str], release: Any = None
                 ) -> Iterator[Callable[..., FakeServerProc]]:
    """``start(*args)`` launches a fake server; every one is stopped at the end."""
    procs: list[FakeServerProc] = []

    def start(*args: str) -> FakeServerProc:
        p = FakeServerProc(module, release_args, list(args), release)
        p.start()
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.stop()
        if p.log is not None:
            with contextlib.suppress(OSError):
                p.log.unlink()


@pytest.fixture
def fake_vllm(vllm_src: Path, vllm_release: Release
              ) -> Iterator[Callable[..., FakeServerProc]]:
    """``start(*args)`` launches a fake vLLM of the release under test; every one is stopped
    at the end of the test."""
    yield from fake_servers("tests.worker_agent.engines.vllm.fake_vllm",
                            ["--vllm-src", str(vllm_src), "--vllm-version",
                             vllm_release.version], vllm_release)
