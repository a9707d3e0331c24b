"""API keys and quotas on the router's public API (router/auth.py), over gRPC and HTTP:
a real router and agent, a keys file of hashes, the openai SDK and grpcio as clients."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.router.auth import RELOAD_CHECK_S, hash_key
from kvroute.v1 import common_pb2, router_pb2_grpc
from tests.support import free_port, wait_for

openai = pytest.importorskip("openai")

KEYS = {"full": "kvr-full-0123456789", "other": "kvr-other-abcdef", "slow": "kvr-slow-xyz42"}


def write_keys(path: Path, extra: list[dict[str, Any]] | None = None) -> None:
    recs = [{"name": "full", "sha256": hash_key(KEYS["full"])},
            {"name": "other", "sha256": hash_key(KEYS["other"]), "models": ["other-model"]},
            {"name": "slow", "sha256": hash_key(KEYS["slow"]), "rate": 0.2, "burst": 2},
            *(extra or [])]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in recs))
    os.replace(tmp, path)  # as the kubelet swaps a Secret's files


@pytest.fixture
async def guarded(cluster, tmp_path: Path) -> Any:
    keys = tmp_path / "keys.jsonl"
    write_keys(keys)
    await cluster.agent("a", tokenizer="byte", vocab_size=258)
    r = await cluster.router(api_keys_file=str(keys), http_port=free_port(), tokenizer="byte",
                             metrics_port=free_port())
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    r.keys_path = keys
    return r


async def grpc_generate(port: int, key: str | None, *, header: str | None = None,
                        **fields: Any) -> list[Any]:
    md = [] if key is None and header is None else \
        [("authorization", header if header is not None else f"Bearer {key}")]
    req = common_pb2.GenerateRequest(token_ids=list(range(1, 40)),
                                     sampling=common_pb2.SamplingParams(max_tokens=2), **fields)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return [r async for r in router_pb2_grpc.RouterStub(ch).Generate(
            req, metadata=md, timeout=10)]


async def grpc_refusal(port: int, key: str | None, **kw: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await grpc_generate(port, key, **kw)
    return err.value


def sample(r: Any, name: str, labels: dict[str, str]) -> float:
    return r.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_grpc_keys_models_and_quotas(guarded, caplog) -> None:
    r = guarded
    caplog.set_level(logging.DEBUG)
    out = await grpc_generate(r.port, KEYS["full"])
    assert sum(len(x.token_ids) for x in out) == 2
    for key, kw, words in ((None, {}, "API key is required"),
                           ("kvr-wrong", {}, "not valid"),
                           (None, {"header": f"Basic {KEYS['full']}"}, "Bearer KEY")):
        err = await grpc_refusal(r.port, key, **kw)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED and words in err.details()
    err = await grpc_refusal(r.port, KEYS["other"])
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "'default'" in err.details()
    # Route is guarded too; so is a request naming the model (allowed, then refused as the
    # router does not serve it: the key passed)
    with pytest.raises(grpc.aio.AioRpcError) as rerr:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") as ch:
            await router_pb2_grpc.RouterStub(ch).Route(common_pb2.GenerateRequest(
                token_ids=[1, 2, 3]))
    assert rerr.value.code() == grpc.StatusCode.UNAUTHENTICATED
    err = await grpc_refusal(r.port, KEYS["other"], model="other-model")
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "not served here" in err.details()

    # burst 2, then 0.2/s: the third is over quota, with the seconds to wait
    await grpc_generate(r.port, KEYS["slow"])
    await grpc_generate(r.port, KEYS["slow"])
    err = await grpc_refusal(r.port, KEYS["slow"])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in err.details()
    retry = dict(err.trailing_metadata() or ())["retry-after"]
    assert 1 <= int(retry) <= 5
    # another key is not limited by it
    await grpc_generate(r.port, KEYS["full"])

    # health stays open
    async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") as ch:
        resp = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert sample(r, "kvroute_router_auth_failures_total", {"reason": "missing"}) == 3
    assert sample(r, "kvroute_router_auth_failures_total", {"reason": "invalid"}) == 1
    assert sample(r, "kvroute_router_auth_failures_total", {"reason": "model"}) == 1
    assert sample(r, "kvroute_router_rate_limited_total", {"key": "slow"}) == 1
    logged = "\n".join(rec.getMessage() + str(getattr(rec, "kv", "")) for rec in caplog.records)
    assert not any(k in logged for k in KEYS.values())


async def test_http_keys_models_and_quotas(guarded) -> None:
    r = guarded
    base = f"http://127.0.0.1:{r.http_port}/v1"

    def client(key: str) -> Any:
        return openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0)

    ok = await client(KEYS["full"]).completions.create(model="default", prompt="hi",
                                                       max_tokens=2)
    assert ok.usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError) as auth:
        await client("kvr-wrong").completions.create(model="default", prompt="hi",
                                                     max_tokens=2)
    assert auth.value.status_code == 401 and auth.value.code == "invalid_api_key"
    with pytest.raises(openai.PermissionDeniedError) as denied:
        await client(KEYS["other"]).completions.create(model="default", prompt="hi",
                                                       max_tokens=2)
    assert denied.value.code == "model_not_allowed"
    # a body without a model is for the router's model, which the key may not use
    with pytest.raises(openai.PermissionDeniedError):
        await client(KEYS["other"]).with_options().completions.create(
            model="", prompt="hi", max_tokens=2)
    slow = client(KEYS["slow"])
    for _ in range(2):
        await slow.completions.create(model="default", prompt="hi", max_tokens=1)
    with pytest.raises(openai.RateLimitError) as limited:
        await slow.completions.create(model="default", prompt="hi", max_tokens=1)
    assert limited.value.status_code == 429
    assert 1 <= int(limited.value.response.headers["Retry-After"]) <= 5
    assert limited.value.body["type"] == "rate_limit_error"

    async with aiohttp.ClientSession() as s:
        async with s.post(f"{base}/completions", json={"prompt": "hi"}) as resp:
            assert resp.status == 401 and resp.headers["WWW-Authenticate"] == "Bearer"
            body = await resp.json()
            assert body["error"]["type"] == "authentication_error"
            assert body["error"]["code"] == "missing_api_key"
        async with s.get(f"{base}/models") as resp:
            assert resp.status == 401
        # health and metrics stay open
        async with s.get(f"http://127.0.0.1:{r.http_port}/health") as resp:
            assert resp.status == 200
        async with s.get(f"http://127.0.0.1:{r.cfg.listen.metrics_port}/metrics") as resp:
            assert resp.status == 200
            assert "kvroute_router_auth_failures_total" in await resp.text()


async def test_each_generation_counts_against_the_keys_rate(guarded) -> None:
    base = f"http://127.0.0.1:{guarded.http_port}/v1"
    slow = openai.AsyncOpenAI(base_url=base, api_key=KEYS["slow"], max_retries=0)  # burst 2
    with pytest.raises(openai.RateLimitError) as over:
        await slow.completions.create(model="default", prompt=["a", "b", "c"], max_tokens=1)
    assert "asks for 3 generations, more than API key 'slow''s burst of 2" in \
        over.value.message
    await asyncio.sleep(5.1)  # the refused request took one token; 0.2 per second refill it
    two = await slow.completions.create(model="default", prompt=["a", "b"], max_tokens=1)
    assert len(two.choices) == 2
    with pytest.raises(openai.RateLimitError):  # both generations took the bucket
        await slow.completions.create(model="default", prompt="hi", max_tokens=1)


async def test_keys_file_reloads_and_a_bad_version_keeps_the_old_keys(guarded) -> None:
    r = guarded
    new = "kvr-new-key-777"
    assert (await grpc_refusal(r.port, new)).code() == grpc.StatusCode.UNAUTHENTICATED
    write_keys(r.keys_path, [{"name": "new", "sha256": hash_key(new)}])
    await asyncio.sleep(RELOAD_CHECK_S + 0.2)
    assert await grpc_generate(r.port, new)
    r.keys_path.write_text('{"name": "broken", "sha256": "not-a-hash"}\n')
    await asyncio.sleep(RELOAD_CHECK_S + 0.2)
    assert await grpc_generate(r.port, new)  # the broken file was not loaded
    assert await grpc_generate(r.port, KEYS["full"])
    # a key removed is refused
    write_keys(r.keys_path)
    await asyncio.sleep(RELOAD_CHECK_S + 0.2)
    assert (await grpc_refusal(r.port, new)).code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_bad_keys_file_stops_the_start(cluster, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(f"- name: a\n  sha256: {KEYS['full']}\n")  # the key, not its hash
    with pytest.raises(SystemExit, match="64 hex digits"):
        await cluster.router(api_keys_file=str(keys))
    with pytest.raises(SystemExit, match="cannot be read"):
        await cluster.router(api_keys_file=str(tmp_path / "missing"))


def test_kvroute_keys_hash_prints_a_record_the_router_loads(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "kvroute", "keys", "hash", "--name", "team",
                          "--models", "default", "--rate", "3"],
                         capture_output=True, text=True, check=True)
    key = run.stderr.strip().rsplit(" ", 1)[1]
    rec = json.loads(run.stdout)
    assert rec == {"name": "team", "sha256": hash_key(key), "models": ["default"], "rate": 3.0}
    assert key not in run.stdout
    piped = subprocess.run([sys.executable, "-m", "kvroute", "keys", "hash", "--name", "t",
                            "--stdin"], input="abc\n", capture_output=True, text=True,
                           check=True)
    assert json.loads(piped.stdout)["sha256"] == hash_key("abc") and piped.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "kvroute", "keys", "hash", "--name", "t",
                          "--burst", "3"], capture_output=True, text=True)
    assert bad.returncode == 2 and "burst needs a rate" in bad.stderr


async def test_a_wrong_redis_password_is_said_at_start(caplog) -> None:
    from kvroute.router.app import RouterApp
    from tests.conftest import router_config
    from tests.support import RedisProc

    redis = RedisProc()
    redis.start()
    redis.client().config_set("requirepass", "right-pw-123")
    app = RouterApp(router_config(redis.url, redis_password="wrong-pw-456"))
    try:
        with caplog.at_level(logging.WARNING, logger="kvroute"):
            await app.start(wait_for_redis_s=1.0)
        start = [rec.getMessage() for rec in caplog.records
                 if "at start" in rec.getMessage()]
        assert start and "refused the credentials" in start[0], start
        assert "not reachable" not in start[0]
        assert not any("wrong-pw-456" in rec.getMessage() for rec in caplog.records)
    finally:
        await app.stop(grace_s=0.1)
        redis.stop()


async def test_a_programs_fork_counts_against_the_keys_rate_over_grpc(guarded) -> None:
    from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders

    def forked(n: int) -> Any:
        gen = P.Step(gen=P.Gen(max_tokens=2))
        return P.ControllerProgram(steps=[P.Step(fork=P.Fork(
            branches=[P.ControllerProgram(steps=[gen])], n=n))])

    r = guarded  # "slow": burst 2, then 0.2/s
    err = await grpc_refusal(r.port, KEYS["slow"], program=forked(3))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "asks for 3 generations, more than API key 'slow''s burst of 2" in err.details()
    out = await grpc_generate(r.port, KEYS["slow"], program=forked(2))  # the whole burst
    assert len(out[-1].results) == 2
    err = await grpc_refusal(r.port, KEYS["slow"])
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in err.details()
