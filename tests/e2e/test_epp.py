"""``kvroute epp`` end to end: the real process, learning its pods from a Kubernetes API (the
InferencePool's selector; tests/kube_api.py speaks the API's wire protocol) and their cache
state from a real Redis, fed by real sim agents; driven by the client that sends what Envoy
sends (router/epp_client.py), which also plays the data plane: it forwards each request to
the pod the picker chose (the sim agent there stands in for the pod's vLLM server).

Each pod has its own loopback address (127.0.0.2, 127.0.0.3: the kernel routes all of
127/8 to lo), so the agents share one port as they would on pods, and an endpoint names its
pod: <pod IP>:<targetPort>.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.demo.openai_model import write_byte_model
from kvroute.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from kvroute.router.epp_client import Outcome, Upstream, exchange
from kvroute.v1 import common_pb2, worker_agent_pb2_grpc
from tests.kube_api import FakeKubeApi
from tests.support import free_port, stop_process, wait_for

MODEL = "tiny"
TARGET_PORT = 8000
PODS = {"vllm-0": "127.0.0.2", "vllm-1": "127.0.0.3"}
SELECTOR = {"app": "vllm", "pool": "tiny"}
SYSTEM = "You are kvroute's test assistant; answer briefly. " * 4


@pytest.fixture
def kube() -> Any:
    api = FakeKubeApi()
    api.start()
    try:
        yield api
    finally:
        api.stop()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_model(tmp_path_factory.mktemp("byte-model"))


class Pool:
    """The picker's process, its pods' agents and the data plane's view of them."""

    def __init__(self, epp_port: int, metrics_port: int, agent_port: int,
                 chat: ChatTokenizer) -> None:
        self.epp_port = epp_port
        self.metrics_port = metrics_port
        self.agent_port = agent_port
        self.chat = chat
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{epp_port}")
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)
        self.served: list[tuple[str, int, int]] = []  # (endpoint, prompt, cached tokens)

    async def serve(self, endpoint: str, body: bytes) -> Upstream:
        """The data plane: the request goes to the chosen pod's engine (its sim agent)."""
        host, port = endpoint.rsplit(":", 1)
        assert int(port) == TARGET_PORT and host in PODS.values(), endpoint
        req = json.loads(body)
        tokens = self.chat.apply(req["messages"])
        async with grpc.aio.insecure_channel(f"{host}:{self.agent_port}") as ch:
            out = [r async for r in worker_agent_pb2_grpc.WorkerAgentStub(ch).Generate(
                common_pb2.GenerateRequest(token_ids=tokens, model=MODEL,
                                           sampling=common_pb2.SamplingParams(
                                               max_tokens=req["max_tokens"])))]
        usage = next(r.usage for r in out if r.HasField("usage"))
        self.served.append((endpoint, usage.prompt_tokens, usage.cached_tokens))
        doc = {"object": "chat.completion", "model": MODEL, "choices": [], "usage": {
            "prompt_tokens": usage.prompt_tokens, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}}
        return Upstream(chunks=[json.dumps(doc).encode()])

    async def ask(self, messages: list[dict[str, str]], model: str = MODEL) -> Outcome:
        body = json.dumps({"model": model, "messages": messages, "max_tokens": 2}).encode()
        return await exchange(self.stub, body, chunk_bytes=256, serve=self.serve)

    async def metric(self, name: str, labels: dict[str, str]) -> float:
        async with aiohttp.ClientSession() as s, s.get(
                f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            text = await r.text()
        want = [f'{k}="{v}"' for k, v in labels.items()]
        for line in text.splitlines():
            if line.startswith(f"{name}{{" if want else f"{name} ") and all(
                    p in line for p in want):
                return float(line.rsplit(" ", 1)[1])
        return 0.0


@pytest.fixture
async def pool(cluster: Any, kube: FakeKubeApi, model_dir: Path) -> AsyncIterator[Pool]:
    agent_port = free_port()
    for name, ip in PODS.items():
        await cluster.agent(name, host=ip, port=agent_port, engine="sim",
                            model_source=str(model_dir),
                            capacity_blocks=512, model=MODEL)
        kube.upsert_pod(name, ip=ip, labels=SELECTOR)
    # A pod of the pool that is not Ready, and a Ready pod outside the selector.
    kube.upsert_pod("vllm-2", ip="127.0.0.4", labels=SELECTOR, ready=False)
    kube.upsert_pod("other-0", ip="127.0.0.5", labels={"app": "other"})
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "kubeconfig"
        config.write_text(kube.kubeconfig())
        epp_port, metrics_port = free_port(), free_port()
        log = Path(tmp) / "epp.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvroute", "epp", "--redis", cluster.redis.url,
                 "--model", f"{MODEL}={model_dir}", "--port", "0",
                 "--epp-port", str(epp_port), "--metrics-port", str(metrics_port),
                 "--discovery", "kubernetes", "--k8s-namespace", kube.namespace,
                 "--k8s-selector", ",".join(f"{k}={v}" for k, v in SELECTOR.items()),
                 "--k8s-port", str(agent_port), "--epp-target-port", str(TARGET_PORT),
                 "--poll-interval-s", "0.1"],
                stdout=out, stderr=out, env={**os.environ, "KUBECONFIG": str(config),
                                             "PYTHONUNBUFFERED": "1"})
        p = Pool(epp_port, metrics_port, agent_port, ChatTokenizer.load(str(model_dir)))
        try:
            async def serving() -> bool:
                assert proc.poll() is None, log.read_text()
                try:
                    resp = await health_pb2_grpc.HealthStub(p.channel).Check(
                        health_pb2.HealthCheckRequest(service="readiness"), timeout=1)
                except grpc.aio.AioRpcError:
                    return False
                return resp.status == health_pb2.HealthCheckResponse.SERVING

            await wait_for(serving, 30, "kvroute epp serving")
            yield p
        finally:
            await p.channel.close()
            stop_process(proc)


def turn(user: str, *earlier: dict[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *earlier, {"role": "user", "content": user}]


async def test_a_conversations_next_turn_goes_to_the_pod_that_served_it(pool: Pool) -> None:
    async def ready() -> bool:  # both pods listed Ready, and a pick made
        pods = await pool.metric("kvroute_router_discovery_pods", {"state": "ready"})
        return pods == 2 and (await exchange(pool.stub, b"")).status == 0
    await wait_for(ready, 20, "the pool's pods listed")
    conversations = [turn(f"conversation {i}: " + "tell me about caches " * 20)
                     for i in range(4)]
    firsts, seconds = [], []
    for messages in conversations:
        firsts.append(await pool.ask(messages))
    assert all(o.immediate is None for o in firsts)
    endpoints = {f"{ip}:{TARGET_PORT}" for ip in PODS.values()}
    # Every choice is a Ready pod of the pool, at its targetPort; the fallback the other.
    assert {o.endpoint for o in firsts} <= endpoints
    assert all(o.fallback == sorted(endpoints - {o.endpoint}) for o in firsts)
    for i, (o, messages) in enumerate(zip(firsts, conversations, strict=True)):
        nxt = [*messages, {"role": "assistant", "content": "ok"},
               {"role": "user", "content": "and then?"}]
        seconds.append(await pool.ask(nxt))
        assert seconds[-1].endpoint == o.endpoint, (i, o.endpoint, seconds[-1].endpoint)
        # The pod really had the conversation cached: the engine says so, not the picker.
        assert pool.served[-1][2] > 0
    # The router's metrics, labelled by api: every exchange counted, usage read back.
    assert await pool.metric("kvroute_router_requests_total",
                             {"api": "epp", "rpc": "Process", "outcome": "ok"}) >= 8
    cached = sum(c for _, _, c in pool.served)
    assert await pool.metric("kvroute_router_cached_tokens_total", {}) == cached


async def test_unknown_model_malformed_body_and_empty_pool(pool: Pool, kube: FakeKubeApi
                                                           ) -> None:
    out = await pool.ask(turn("hi"), model="llama-70b")
    assert out.status == 404 and out.error()["error"]["code"] == "model_not_found"
    out = await exchange(pool.stub, b'{"model": "tiny", "messages": [{"role": ')
    assert out.status == 400 and out.error()["error"]["code"] == "invalid_json"
    out = await exchange(pool.stub, json.dumps({"model": MODEL}).encode())
    assert out.status == 400 and out.error()["error"]["param"] == "messages"
    assert pool.served == []  # nothing went upstream
    for name in PODS:
        kube.delete_pod(name)

    async def empty() -> bool:
        return (await pool.ask(turn("hi"))).status == 503
    await wait_for(empty, 20, "the pool emptied")
    out = await pool.ask(turn("hi"))
    assert out.status == 503
    assert out.error()["error"]["type"] == "service_unavailable_error"
