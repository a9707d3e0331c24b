"""Several models per router (each ``--model`` a pool of its own workers) and load shedding
(``--max-inflight``: HTTP 429, gRPC RESOURCE_EXHAUSTED), against a real router, real sim
agents, the official ``openai`` SDK and real gRPC clients."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import prometheus_client
import pytest

from kvroute.core.config import RouterConfig
from kvroute.core.settings import add_arguments, from_namespace
from kvroute.demo.openai_model import write_byte_model
from kvroute.router.app import RouterApp
from kvroute.v1 import common_pb2, router_pb2_grpc
from tests.support import free_port, generate, wait_for

openai = pytest.importorskip("openai")

SIM = dict(engine="sim", capacity_blocks=512)  # and --model-source: the router's SOURCE
PROMPT = [{"role": "user", "content": "which pool serves me?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_model(tmp_path_factory.mktemp("byte-model"))


def client(router: Any) -> Any:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1",
                              api_key="unused", max_retries=0)


def requests(router: Any, api: str, outcome: str) -> float:
    return router.metrics.registry.get_sample_value(
        "kvroute_router_requests_total",
        {"api": api, "rpc": "Generate", "outcome": outcome}) or 0.0


def test_model_is_a_repeatable_flag_and_names_are_checked(model_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, RouterConfig, {})
    cfg = from_namespace(RouterConfig, parser.parse_args(
        ["--model", f"qa={model_dir}", "--model", "qb"]))
    assert cfg.model.name == f"qa={model_dir},qb"
    assert from_namespace(RouterConfig, parser.parse_args([])).model.name == "default"
    with pytest.raises(SystemExit, match="qa given more than once"):
        RouterApp(RouterConfig.of(model=f"qa={model_dir},qa"))
    with pytest.raises(SystemExit, match="an empty model name"):
        RouterApp(RouterConfig.of(model="qa,,qb"))
    with pytest.raises(SystemExit, match="one --model per router"):
        RouterApp(RouterConfig.of(model="qa,qb", discovery="kubernetes"))


async def test_each_model_is_a_pool_and_only_its_workers_are_ranked(cluster,
                                                                    model_dir) -> None:
    for wid in ("a1", "a2"):
        await cluster.agent(wid, model="pa", **SIM, model_source=str(model_dir))
    for wid in ("b1", "b2"):
        await cluster.agent(wid, model="pb", **SIM, model_source=str(model_dir))
    r = await cluster.router(model=f"pa={model_dir},pb={model_dir}", http_port=free_port())
    pa, pb = r.pools
    await wait_for(lambda: set(pa.registry.loads) == {"a1", "a2"}
                   and set(pb.registry.loads) == {"b1", "b2"}, what="each pool's workers")
    assert r.registry is pa.registry  # the first model is the default

    c = client(r)
    listed = await c.models.list()
    assert [m.id for m in listed.data] == ["pa", "pb"]
    for model, pool in (("pa", {"a1", "a2"}), ("pb", {"b1", "b2"})):
        for i in range(4):
            raw = await c.chat.completions.with_raw_response.create(
                model=model, max_tokens=2, messages=[*PROMPT, {"role": "user",
                                                              "content": f"{model} {i}"}])
            assert raw.headers["x-kvroute-worker"] in pool
            assert raw.parse().model == model
    with pytest.raises(openai.NotFoundError) as err:
        await c.chat.completions.create(model="pc", messages=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found" and err.value.param == "model"
    assert "'pa', 'pb'" in err.value.message

    # gRPC: the request's model picks the pool; none is the first; another is refused.
    ids = list(b"gRPC prompt of some length" * 4)
    for model, pool in (("pb", {"b1", "b2"}), ("", {"a1", "a2"}), ("pa", {"a1", "a2"})):
        out = await generate(r.port, ids, model=model)
        assert out[0].worker_id in pool
    with pytest.raises(grpc.aio.AioRpcError) as rpc:
        await generate(r.port, ids, model="pc")
    assert rpc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'pc' is not served here" in rpc.value.details()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{r.port}") as ch:
        routed = await router_pb2_grpc.RouterStub(ch).Route(common_pb2.GenerateRequest(
            token_ids=ids, model="pb", sampling=common_pb2.SamplingParams(max_tokens=1)))
    assert {c.worker_id for c in routed.candidates} == {"b1", "b2"}

    # Each pool's mirror holds its own workers' blocks; the metrics carry the model.
    await wait_for(lambda: pb.mirror.index.count("b1") + pb.mirror.index.count("b2") > 0,
                   what="pb's blocks mirrored")
    assert pa.mirror.index.count("b1") == 0 and pb.mirror.index.count("a1") == 0
    assert r.metrics.registry.get_sample_value(
        "kvroute_router_worker_routable", {"model": "pb", "worker": "b1"}) == 1
    assert r.metrics.registry.get_sample_value(
        "kvroute_router_worker_routable", {"model": "pa", "worker": "b1"}) is None
    text = prometheus_client.generate_latest(r.metrics.registry).decode()
    assert 'kvroute_router_index_entries{model="pb"}' in text
    assert 'kvroute_router_feed_propagation_seconds_count{model="pa"}' in text
    async with aiohttp.ClientSession() as s, \
            s.get(f"http://127.0.0.1:{r.http_port}/health") as resp:
        health = await resp.json()
    assert health["models"] == {"pa": 2, "pb": 2} and health["workers"] == 4


async def test_past_max_inflight_http_gets_429_and_grpc_resource_exhausted(
        cluster, model_dir) -> None:
    # A modelled engine (time_scale 1): a 500-token stream stays in flight for seconds.
    await cluster.agent("s1", model="shed", **SIM, time_scale=1.0, model_source=str(model_dir))
    r = await cluster.router(model=f"shed={model_dir}", http_port=free_port(), max_inflight=1)
    await wait_for(lambda: len(r.registry.loads) == 1, what="the worker registered")
    c = client(r)
    stream = await c.chat.completions.create(model="shed", messages=PROMPT, max_tokens=500,
                                             stream=True)
    first = await stream.__anext__()  # the one request in flight
    assert first.choices[0].delta.role == "assistant"

    with pytest.raises(openai.RateLimitError) as err:
        await c.chat.completions.create(model="shed", messages=PROMPT, max_tokens=2)
    assert err.value.status_code == 429 and err.value.code == "rate_limit_exceeded"
    assert err.value.response.headers["Retry-After"] == "1"
    assert "--max-inflight" in err.value.message
    with pytest.raises(openai.RateLimitError):
        await c.completions.create(model="shed", prompt=[1, 2, 3], max_tokens=2)
    with pytest.raises(grpc.aio.AioRpcError) as rpc:
        await generate(r.port, [1, 2, 3], model="shed")
    assert rpc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert requests(r, "http", "shed") == 2 and requests(r, "grpc", "shed") == 1

    await stream.close()  # the request in flight ends (cancelled): the next is served
    await wait_for(lambda: r.front.shedder.inflight == 0, what="the stream's slot freed")
    out = await c.chat.completions.create(model="shed", messages=PROMPT, max_tokens=2)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert requests(r, "http", "shed") == 2


async def test_lora_adapters_are_models_routed_in_their_base_pool_keyed_apart(
        cluster, model_dir) -> None:
    for wid in ("l1", "l2"):
        await cluster.agent(wid, model="lb", **SIM, model_source=str(model_dir))
    r = await cluster.router(model=f"lb={model_dir}", lora="lb-ada=lb,lb-adb=lb",
                             http_port=free_port())
    await wait_for(lambda: len(r.registry.loads) == 2, what="the base pool's workers")
    c = client(r)
    listed = {m.id: m for m in (await c.models.list()).data}
    assert list(listed) == ["lb", "lb-ada", "lb-adb"]
    assert listed["lb-ada"].parent == "lb" and listed["lb-ada"].root == "lb"
    assert listed["lb"].parent is None

    chat = [{"role": "system", "content": "A long shared system prompt. " * 12}, *PROMPT]
    raw = await c.chat.completions.with_raw_response.create(model="lb", messages=chat,
                                                            max_tokens=2)
    base, worker = raw.parse(), raw.headers["x-kvroute-worker"]
    blocks = base.usage.prompt_tokens // 16
    await wait_for(lambda: r.mirror.index.count(worker) >= blocks, what="the base's blocks")
    # The same prompt as the adapter: the base model's blocks are not its own.
    raw = await c.chat.completions.with_raw_response.create(model="lb-ada", messages=chat,
                                                            max_tokens=2)
    ada = raw.parse()
    assert ada.model == "lb-ada" and ada.usage.prompt_tokens == base.usage.prompt_tokens
    assert ada.usage.prompt_tokens_details.cached_tokens == 0
    ada_worker = raw.headers["x-kvroute-worker"]
    await wait_for(lambda: r.mirror.index.count(ada_worker) >= 2 * blocks
                   if ada_worker == worker else r.mirror.index.count(ada_worker) >= blocks,
                   what="the adapter's blocks")
    # Its second request finds the adapter's own blocks; the other adapter's does not.
    raw = await c.chat.completions.with_raw_response.create(model="lb-ada", messages=chat,
                                                            max_tokens=2)
    assert raw.headers["x-kvroute-worker"] == ada_worker
    assert raw.parse().usage.prompt_tokens_details.cached_tokens >= blocks * 16 - 16
    adb = await c.chat.completions.create(model="lb-adb", messages=chat, max_tokens=2)
    assert adb.usage.prompt_tokens_details.cached_tokens == 0

    with pytest.raises(SystemExit, match="'nope' is not a --model"):
        RouterApp(RouterConfig.of(model="lb", lora="x=nope"))
    with pytest.raises(SystemExit, match="already a model's name"):
        RouterApp(RouterConfig.of(model="lb", lora="lb=lb"))
