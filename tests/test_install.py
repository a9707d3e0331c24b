"""A plain ``pip install kvroute`` serves, and each extra serves the feature it is for.

The wheel is installed into a bare venv (no extras, nothing of this test venv's); a router,
a sim agent and ``kvroute epp`` from it start against a real Redis and the router serves a
Generate. A feature that needs an extra ends its command with one line naming the extra.
Then, in a copy of that venv, each extra is installed and its feature really used:
``[models]`` a chat through the HTTP front with router and agent given one model source,
``[sim]`` the replay's plots, ``[kubernetes]`` discovery against a server speaking the
Kubernetes pods API (tests/kube_api.py; no API server runs here)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.demo.openai_model import write_byte_model
from kvroute.simulations.gen_cli import write_jsonl
from kvroute.simulations.generators import generate as generate_trace
from tests.kube_api import FakeKubeApi
from tests.support import free_port, generate, stop_process, wait_for

pytestmark = pytest.mark.timeout(900)
PNG = b"\x89PNG\r\n\x1a\n"


def pip_install(venv: Path, requirement: str) -> None:
    out = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                          "--disable-pip-version-check", requirement],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.fixture(scope="module")
def bare(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the wheel and its declared dependencies only."""
    venv = tmp_path_factory.mktemp("venvs") / "bare"
    # The base interpreter, not this venv's: nothing of the test venv may leak in.
    base = Path(getattr(sys, "_base_executable", sys.executable))
    subprocess.run([str(base), "-m", "venv", str(venv)], check=True, timeout=120)
    pip_install(venv, str(wheel))
    return venv


def with_extra(bare: Path, wheel: Path, extra: str) -> Path:
    """A copy of the bare venv with ``kvroute[extra]`` installed (its python runs from the
    copy: a venv is found from the interpreter's path; scripts are not used)."""
    venv = bare.parent / extra
    if not venv.exists():
        shutil.copytree(bare, venv, symlinks=True)
        pip_install(venv, f"kvroute[{extra}] @ {wheel.as_uri()}")
    return venv


class Procs:
    """kvroute processes of one venv, each logging to a file; stopped by PID."""

    def __init__(self, venv: Path, logs: Path, env: dict[str, str] | None = None) -> None:
        self.venv, self.logs = venv, logs
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        # Nothing of the source tree or the test venv on the path.
        self.env.pop("PYTHONPATH", None)
        self.procs: list[tuple[subprocess.Popen[bytes], Path]] = []

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "python"), "-m", "kvroute", *args],
                              capture_output=True, text=True, timeout=timeout, env=self.env,
                              cwd=self.logs)

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = self.logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([str(self.venv / "bin" / "python"), "-m", "kvroute", *args],
                                    stdout=out, stderr=out, env=self.env, cwd=self.logs)
        self.procs.append((proc, log))
        return proc

    def alive(self) -> bool:
        for proc, log in self.procs:
            assert proc.poll() is None, f"{log.name} exited:\n{log.read_text()[-3000:]}"
        return True

    def stop(self) -> None:
        for proc, _ in self.procs:
            stop_process(proc)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Callable[..., Procs]]:
    """Makes :class:`Procs` of a venv; stops every process they started."""
    made: list[Procs] = []

    def make(venv: Path, env: dict[str, str] | None = None) -> Procs:
        p = Procs(venv, tmp_path, env)
        made.append(p)
        return p

    yield make
    for p in made:
        p.stop()


def one_line_naming(out: subprocess.CompletedProcess[str], extra: str) -> None:
    """The command ended at once with one line that names ``kvroute[extra]``."""
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert f"kvroute[{extra}]" in last, out.stderr


async def served(port: int, procs: Procs) -> list[object]:
    """One Generate through the router at ``port``, once a worker is registered."""
    result: list[object] = []

    async def answered() -> bool:
        procs.alive()
        try:
            result[:] = await asyncio.wait_for(generate(port, list(range(1, 40)),
                                                        max_tokens=4), 5)
        except Exception:  # no worker yet (UNAVAILABLE), or not listening yet
            return False
        return True

    await wait_for(answered, timeout=60, what="a Generate served")
    return result


async def test_a_plain_install_runs_router_agent_and_epp(bare: Path, procs, redis_server,
                                                         tmp_path: Path) -> None:
    p = procs(bare)
    url = redis_server.url
    gport, eport = free_port(), free_port()
    p.start("agent", "agent", "--engine", "sim", "--redis", url, "--port", "0",
            "--worker-id", "w0", "--heartbeat-s", "0.2", "--heartbeat-ttl-s", "1")
    p.start("router", "router", "--redis", url, "--port", str(gport),
            "--poll-interval-s", "0.1")
    p.start("epp", "epp", "--redis", url, "--port", "0", "--epp-port", str(eport),
            "--poll-interval-s", "0.1")
    chunks = await served(gport, p)
    assert sum(len(c.token_ids) for c in chunks) == 4  # type: ignore[attr-defined]
    assert {c.worker_id for c in chunks if c.worker_id} == {"w0"}  # type: ignore[attr-defined]
    # The endpoint picker answers health checks on its port once it serves.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{eport}") as ch:
        async def picker_serving() -> bool:
            p.alive()
            try:
                got = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                return False
            return got.status == health_pb2.HealthCheckResponse.SERVING
        await wait_for(picker_serving, timeout=30, what="the endpoint picker serving")

    # Features of the extras: one line naming the extra, at once.
    model = write_byte_model(tmp_path / "model")
    one_line_naming(p.run("router", "--redis", url, "--port", "0", "--model", f"m={model}"),
                    "models")
    one_line_naming(p.run("agent", "--redis", url, "--port", "0", "--model-source", str(model)),
                    "models")
    one_line_naming(p.run("router", "--redis", url, "--port", "0", "--discovery",
                          "kubernetes"), "kubernetes")
    # The replay runs without [sim]: its tables, and a line saying how to get the plots.
    trace = tmp_path / "chat.jsonl"
    write_jsonl(generate_trace("chat", 60, 20.0, seed=5), trace)
    out = p.run("replay", str(trace), "--workers", "2", "--policies", "kvroute,round_robin",
                "--out", str(tmp_path / "replay"))
    assert out.returncode == 0, out.stderr
    assert "kvroute[sim]" in out.stdout + out.stderr
    assert not list((tmp_path / "replay").glob("*.png"))


async def test_models_extra_serves_chat_with_one_source_on_both_sides(
        bare: Path, wheel: Path, procs, redis_server, tmp_path: Path) -> None:
    p = procs(with_extra(bare, wheel, "models"))
    model = write_byte_model(tmp_path / "model")
    url = redis_server.url
    hport = free_port()
    # The agent needs no --vocab-size: it reads the router's SOURCE.
    p.start("agent", "agent", "--engine", "sim", "--redis", url, "--port", "0",
            "--model", "m", "--model-source", str(model), "--worker-id", "w0",
            "--heartbeat-s", "0.2", "--heartbeat-ttl-s", "1")
    p.start("router", "router", "--redis", url, "--port", "0", "--http-port", str(hport),
            "--model", f"m={model}", "--poll-interval-s", "0.1")
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}}
    reply: dict[str, object] = {}
    async with httpx.AsyncClient(timeout=10) as client:
        async def chatted() -> bool:
            p.alive()
            try:
                r = await client.post(f"http://127.0.0.1:{hport}/v1/chat/completions",
                                      json=body)
            except httpx.TransportError:
                return False
            if r.status_code == 503:  # no worker registered yet
                return False
            assert r.status_code == 200, r.text
            reply.update(r.json())
            return True
        await wait_for(chatted, timeout=60, what="a chat completion")
    assert reply["usage"]["completion_tokens"] >= 1  # type: ignore[index]
    assert reply["choices"][0]["message"]["role"] == "assistant"  # type: ignore[index]


async def test_sim_extra_draws_the_replays_plots(bare: Path, wheel: Path, procs,
                                                 tmp_path: Path) -> None:
    p = procs(with_extra(bare, wheel, "sim"))
    trace = tmp_path / "chat.jsonl"
    write_jsonl(generate_trace("chat", 60, 20.0, seed=5), trace)
    out = p.run("replay", str(trace), "--workers", "2", "--policies", "kvroute,round_robin",
                "--out", str(tmp_path / "replay"), timeout=300)
    assert out.returncode == 0, out.stderr
    pngs = list((tmp_path / "replay").glob("*.png"))
    assert pngs and all(f.read_bytes().startswith(PNG) for f in pngs)


async def test_kubernetes_extra_discovers_worker_pods(bare: Path, wheel: Path, procs,
                                                      redis_server, tmp_path: Path) -> None:
    kube = FakeKubeApi()
    kube.start()
    try:
        config = tmp_path / "kubeconfig"
        config.write_text(kube.kubeconfig())
        p = procs(with_extra(bare, wheel, "kubernetes"), {"KUBECONFIG": str(config)})
        url, aport, gport = redis_server.url, free_port(), free_port()
        p.start("agent", "agent", "--engine", "sim", "--redis", url, "--port", str(aport),
                "--worker-id", "pod-0", "--heartbeat-s", "0.2", "--heartbeat-ttl-s", "1")
        kube.upsert_pod("pod-0", ip="127.0.0.1", labels={"app": "kvroute-worker"})
        p.start("router", "router", "--redis", url, "--port", str(gport),
                "--discovery", "kubernetes", "--k8s-namespace", kube.namespace,
                "--k8s-selector", "app=kvroute-worker", "--k8s-port", str(aport),
                "--poll-interval-s", "0.1")
        chunks = await served(gport, p)
        assert {c.worker_id for c in chunks if c.worker_id} == {"pod-0"}  # type: ignore[attr-defined]
        assert any(r.query.get("labelSelector") == "app=kvroute-worker"
                   for r in kube.requests)
    finally:
        kube.stop()


def test_the_bare_venv_holds_no_extra(bare: Path) -> None:
    probe = ("import importlib.util, json; print(json.dumps({m: importlib.util.find_spec(m) "
             "is not None for m in ('tokenizers', 'jinja2', 'matplotlib', 'kubernetes', "
             "'yaml')}))")
    out = subprocess.run([str(bare / "bin" / "python"), "-c", probe], capture_output=True,
                         text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == {"tokenizers": False, "jinja2": False,
                                      "matplotlib": False, "kubernetes": False, "yaml": True}
