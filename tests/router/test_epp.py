"""kvroute epp's protocol handling (router/epp.py): the ext_proc pieces on their own, then an
in-process endpoint picker with real sim agents and a real Redis, driven by the client that
sends what Envoy sends (router/epp_client.py). tests/e2e/test_epp.py runs ``kvroute epp`` as
a process with Kubernetes discovery."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.core.redis_schema import Heartbeat, RecordError, check_endpoint
from kvroute.demo.openai_model import write_byte_model
from kvroute.envoy_api.envoy.config.core.v3 import base_pb2
from kvroute.envoy_api.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from kvroute.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from kvroute.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from kvroute.router import epp, epp_protocol
from kvroute.router.epp_client import BUFFERED, Upstream, exchange
from kvroute.router.registry import WorkerInfo
from tests.conftest import router_config
from tests.support import wait_for

MODEL = "tiny"
SIM = dict(engine="sim", capacity_blocks=512, model=MODEL)
SYSTEM = "You are kvroute's test assistant; answer briefly. " * 4


# -- the pieces --------------------------------------------------------------------------------

def test_engine_endpoint_is_the_heartbeats_else_the_agents_host_at_the_target_port() -> None:
    hb = Heartbeat(worker_id="a", address="10.1.2.3:50061", epoch="e",
                   engine_endpoint="10.1.2.3:8001")
    assert epp.engine_endpoint(WorkerInfo("a", "10.1.2.3:50061", heartbeat=hb), 8000) == \
        "10.1.2.3:8001"
    assert epp.engine_endpoint(WorkerInfo("b", "10.1.2.4:50061"), 8000) == "10.1.2.4:8000"
    assert epp.engine_endpoint(WorkerInfo("c", "[fd00::5]:50061"), 8000) == "[fd00::5]:8000"


def test_a_heartbeats_engine_endpoint_is_validated() -> None:
    base = {"worker_id": "a", "address": "h:1", "epoch": "e"}
    assert Heartbeat.from_json(json.dumps({**base, "engine_endpoint": "10.0.0.1:8000"})
                               ).engine_endpoint == "10.0.0.1:8000"
    assert Heartbeat.from_json(json.dumps(base)).engine_endpoint == ""  # an older agent
    for bad in ("10.0.0.1", "10.0.0.1:0", "h:99999", "a b:80", 7, "x" * 300 + ":80"):
        with pytest.raises(RecordError, match="engine_endpoint"):
            Heartbeat.from_json(json.dumps({**base, "engine_endpoint": bad}))
    with pytest.raises(ValueError, match="--engine-endpoint"):
        check_endpoint("nope", "--engine-endpoint")


def test_headers_subset_and_served_endpoint_are_read_from_what_envoy_sends() -> None:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":Path", raw_value=b"/v1/x"),
                                     base_pb2.HeaderValue(key="x-old", value="v")])
    assert epp_protocol.header_map(ep.HttpHeaders(headers=hm)) == {":path": "/v1/x", "x-old": "v"}
    md = base_pb2.Metadata()
    assert epp_protocol.subset_hint(md) is None and epp_protocol.served_endpoint(md) == ""
    md.filter_metadata[epp_protocol.SUBSET_NAMESPACE].update(
        {epp_protocol.SUBSET: ["10.0.0.1:8000", "10.0.0.2:8000,10.0.0.3:8000"]})
    assert epp_protocol.subset_hint(md) == ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    md.filter_metadata[epp_protocol.SUBSET_NAMESPACE].update({epp_protocol.SUBSET: "10.0.0.9:8000"})
    assert epp_protocol.subset_hint(md) == ["10.0.0.9:8000"]  # a flat string, as header-to-metadata
    md.filter_metadata[epp_protocol.SUBSET_NAMESPACE].update({epp_protocol.SUBSET: []})
    assert epp_protocol.subset_hint(md) == []  # present and empty: nothing is allowed
    md.filter_metadata[epp_protocol.LB_NAMESPACE].update({epp_protocol.SERVED: "10.0.0.2:8000"})
    assert epp_protocol.served_endpoint(md) == "10.0.0.2:8000"


def test_the_destination_sets_one_value_in_the_header_and_the_metadata() -> None:
    common, meta = epp_protocol.destination("10.0.0.1:8000", ["10.0.0.2:8000", "10.0.0.3:8000"])
    (h,) = common.header_mutation.set_headers
    assert (h.header.key, h.header.raw_value) == (epp_protocol.DESTINATION, b"10.0.0.1:8000")
    assert common.clear_route_cache
    lb = meta.fields[epp_protocol.LB_NAMESPACE].struct_value.fields
    assert lb[epp_protocol.DESTINATION].string_value == "10.0.0.1:8000"
    assert lb[epp_protocol.FALLBACK].string_value == "10.0.0.2:8000,10.0.0.3:8000"
    _, alone = epp_protocol.destination("10.0.0.1:8000", [])
    assert epp_protocol.FALLBACK not in alone.fields[epp_protocol.LB_NAMESPACE].struct_value.fields


def test_usage_is_read_from_json_and_from_events_split_across_chunks() -> None:
    u = epp_protocol.UsageReader("application/json")
    body = json.dumps({"usage": {"prompt_tokens": 70, "prompt_tokens_details":
                                 {"cached_tokens": 64}}}).encode()
    u.feed(body[:10], False)
    u.feed(body[10:], True)
    assert u.tokens() == (70, 64)
    s = epp_protocol.UsageReader("text/event-stream; charset=utf-8")
    events = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n'
              b'data: {"choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":'
              b'{"cached_tokens":0}}}\n\ndata: [DONE]\n\n')
    for i in range(0, len(events), 7):
        s.feed(events[i:i + 7], i + 7 >= len(events))
    assert s.tokens() == (9, 0)
    for hostile in (b"<html>bad gateway</html>", b'{"usage": {"prompt_tokens": -5}}',
                    b'{"usage": {"prompt_tokens": 1e300}}', b'{"usage": []}', b"[1]"):
        h = epp_protocol.UsageReader("application/json")
        h.feed(hostile, True)
        assert h.tokens() == (0, 0)


def test_an_immediate_response_carries_the_status_and_openais_error() -> None:
    from kvroute.router.api_error import ApiError

    resp = epp_protocol.immediate(ApiError(404, "no such model", param="model",
                                           code="model_not_found"))
    im = resp.immediate_response
    assert im.status.code == 404
    assert json.loads(im.body)["error"]["code"] == "model_not_found"
    assert {h.header.key: h.header.raw_value for h in im.headers.set_headers} == {
        "content-type": b"application/json"}
    assert epp_protocol.immediate(ApiError(503, "x", headers={"Retry-After": "1"})
                         ).immediate_response.status.code == 503


# -- an endpoint picker with real agents --------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_byte_model(tmp_path_factory.mktemp("byte-model"))


@pytest.fixture
async def picker(cluster: Any, model_dir: Path) -> Any:
    apps = []

    async def start(agents: dict[str, str], **kw: Any) -> Any:
        for wid, endpoint in agents.items():
            await cluster.agent(wid, engine_endpoint=endpoint, model_source=str(model_dir),
                                **SIM)
        cfg = epp.EppConfig.of(**{**router_config(cluster.redis.url).flat(),
                               "model": f"{MODEL}={model_dir}", "epp_port": 0, **kw})
        app = epp.EppApp(cfg)
        await app.start(wait_for_redis_s=5.0)
        apps.append(app)
        await wait_for(lambda: len(app.router.registry.loads) == len(agents),
                       what="workers registered")
        app.channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.epp_port}")
        app.stub = ep_grpc.ExternalProcessorStub(app.channel)
        return app

    yield start
    for app in apps:
        await app.channel.close()
        await app.stop(grace_s=0.5)


def chat(text: str, model: str = MODEL, **extra: Any) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "system", "content": SYSTEM},
                                                    {"role": "user", "content": text}],
                       "max_tokens": 4, **extra}).encode()


def count(app: Any, outcome: str) -> float:
    return app.router.metrics.registry.get_sample_value(
        "kvroute_router_requests_total",
        {"api": "epp", "rpc": "Process", "outcome": outcome}) or 0.0


def json_upstream(prompt_tokens: int = 70, cached: int = 0) -> Any:
    async def serve(endpoint: str, body: bytes) -> Upstream:
        doc = {"object": "chat.completion", "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": cached}}}
        raw = json.dumps(doc).encode()
        return Upstream(chunks=[raw[:20], raw[20:]])

    return serve


async def test_a_chat_body_in_chunks_gets_an_endpoint_and_goes_on_unchanged(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"})
    body = chat("hello " * 300)  # several chunks
    out = await exchange(app.stub, body, chunk_bytes=500, serve=json_upstream(70, 64))
    assert out.immediate is None
    assert out.endpoint in ("10.0.0.1:8000", "10.0.0.2:8000")
    assert out.metadata_endpoint == out.endpoint and out.clear_route_cache
    assert out.fallback == [{"10.0.0.1:8000": "10.0.0.2:8000",
                             "10.0.0.2:8000": "10.0.0.1:8000"}[out.endpoint]]
    assert out.body_sent == body  # the gateway forwards what the picker sent back
    kinds = [r.WhichOneof("response") for r in out.responses]
    assert kinds == ["request_headers", "request_body", "response_headers", "response_body",
                     "response_body"]
    assert json.loads(out.response_body)["usage"]["prompt_tokens"] == 70  # echoed whole
    reg = app.router.metrics.registry
    assert count(app, "ok") == 1
    assert reg.get_sample_value("kvroute_router_cached_tokens_total") == 64
    # The decision's load was released when the response ended.
    assert all(info.inflight == 0 and info.pending_prefill == 0
               for info in app.router.registry.all())


async def test_a_chat_with_tools_is_picked_whatever_its_model_writes(picker, tmp_path
                                                                     ) -> None:
    # The pod's engine reads the calls: a template the router cannot read calls from is no
    # reason to refuse the request.
    plain = write_byte_model(tmp_path / "plain", "{% for m in messages %}{{ m['content'] }}"
                             "{% endfor %}")
    app = await picker({"a": "10.0.0.1:8000"}, model=f"{MODEL}={plain}")
    tools = [{"type": "function", "function": {"name": "now", "parameters": {}}}]
    for choice in ("auto", "required"):
        out = await exchange(app.stub, chat("hi", tools=tools, tool_choice=choice),
                             serve=json_upstream())
        assert out.immediate is None and out.endpoint == "10.0.0.1:8000"


async def test_buffered_mode_gets_the_destination_in_the_body_response(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"})
    out = await exchange(app.stub, chat("hi"), mode=BUFFERED, serve=json_upstream())
    assert out.endpoint == "10.0.0.1:8000" == out.metadata_endpoint
    kinds = [r.WhichOneof("response") for r in out.responses]
    assert kinds[:2] == ["request_headers", "request_body"]
    assert not out.responses[0].request_headers.response.header_mutation.set_headers
    assert out.body_sent == b""  # nothing replaced: Envoy sends its buffered body


async def test_a_streamed_mode_gateway_is_told_what_mode_is_needed(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"})
    out = await exchange(app.stub, chat("hi"),
                         mode=processing_mode_pb2.ProcessingMode.STREAMED)
    assert out.status == 500 and "FULL_DUPLEX_STREAMED" in out.error()["error"]["message"]


async def test_refusals_get_the_status_the_protocol_prescribes(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"})
    out = await exchange(app.stub, b'{"model": "tiny", "messages": [')
    assert out.status == 400 and out.error()["error"]["code"] == "invalid_json"
    out = await exchange(app.stub, chat("hi", model="other"))
    assert out.status == 404 and out.error()["error"]["code"] == "model_not_found"
    out = await exchange(app.stub, json.dumps({"model": MODEL, "messages": "x"}).encode())
    assert out.status == 400 and out.error()["error"]["param"] == "messages"
    out = await exchange(app.stub, chat("hi"), subset=["10.9.9.9:8000"])
    assert out.status == 503  # nothing of the gateway's subset is ready
    out = await exchange(app.stub, chat("hi"), subset=["10.0.0.1:8000"])
    assert out.endpoint == "10.0.0.1:8000"
    assert count(app, "invalid") == 3 and count(app, "unavailable") == 1


async def test_a_body_past_the_limit_is_413(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"}, http_max_body_bytes=1000)
    out = await exchange(app.stub, chat("x" * 2000), chunk_bytes=400)
    assert out.status == 413


async def test_an_empty_pool_is_503(picker, cluster) -> None:
    app = await picker({})
    out = await exchange(app.stub, chat("hi"))
    assert out.status == 503
    assert out.error()["error"]["type"] == "service_unavailable_error"
    out = await exchange(app.stub, b"")  # no body (GET /v1/models): any pod, none here
    assert out.status == 503


async def test_a_client_gone_before_the_response_releases_the_load(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"})
    out = await exchange(app.stub, chat("hi"))  # no upstream: the stream just ends
    assert out.endpoint == "10.0.0.1:8000"
    await wait_for(lambda: count(app, "cancelled") == 1, what="the stream's end seen")
    info = app.router.registry.get("a")
    assert info is not None and info.inflight == 0 and info.pending_prefill == 0


async def test_health_serves_the_protocols_services(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"})
    stub = health_pb2_grpc.HealthStub(app.channel)
    for name in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


async def test_concurrent_sessions_each_return_to_their_pod(picker) -> None:
    """Predictions: a conversation's next turn, sent while the first turn's cache events may
    not have arrived yet, goes where the first went."""
    app = await picker({"a": "10.0.0.1:8000", "b": "10.0.0.2:8000", "c": "10.0.0.3:8000"})
    firsts = await asyncio.gather(*(exchange(app.stub, chat(f"session {i} " * 80),
                                             serve=json_upstream()) for i in range(6)))
    seconds = await asyncio.gather(*(exchange(app.stub, chat(f"session {i} " * 80 + "more"),
                                              serve=json_upstream()) for i in range(6)))
    assert [o.endpoint for o in seconds] == [o.endpoint for o in firsts]


async def test_a_fallback_the_gateway_reports_moves_the_load_there(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000", "b": "10.0.0.2:8000"})
    reg = app.router.registry
    worker = {"10.0.0.1:8000": "a", "10.0.0.2:8000": "b"}
    seen: dict[str, Any] = {}

    def inflight() -> tuple[int, int]:  # (the chosen pod's, the other's)
        chosen = worker[seen["endpoint"]]
        return reg.get(chosen).inflight, reg.get("b" if chosen == "a" else "a").inflight

    async def report(endpoint: str, body: bytes) -> Upstream:
        seen["endpoint"] = endpoint
        seen["before"] = inflight()
        return await json_upstream()(endpoint, body)

    async def mid() -> None:
        seen["moved"] = inflight()

    # The first pick's fallback is the other pod: the gateway says that one served it.
    first = await exchange(app.stub, chat("warm"), serve=json_upstream())
    out = await exchange(app.stub, chat("warm"), serve=report, served=first.fallback[0],
                         after_headers=mid)
    assert out.endpoint == first.endpoint
    assert seen["before"] == (1, 0) and seen["moved"] == (0, 1)
    assert all(info.inflight == 0 for info in reg.all())


async def test_a_streamed_response_counts_its_first_bytes_as_the_first_token(picker) -> None:
    app = await picker({"a": "10.0.0.1:8000"})
    info = app.router.registry.get("a")
    events = [b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n',
              b'data: {"choices":[],"usage":{"prompt_tokens":90,"prompt_tokens_details":'
              b'{"cached_tokens":16}}}\n\n', b"data: [DONE]\n\n"]
    seen = {}

    async def serve(endpoint: str, body: bytes) -> Upstream:
        return Upstream(headers={"content-type": "text/event-stream"}, chunks=events)

    async def mid() -> None:  # headers back, no token yet: the prefill is still pending
        seen["pending"] = info.pending_prefill

    out = await exchange(app.stub, chat("stream " * 50, stream=True), serve=serve,
                         after_headers=mid)
    assert out.response_body == b"".join(events)
    assert seen["pending"] > 0 and info.pending_prefill == 0 and info.inflight == 0
    reg = app.router.metrics.registry
    assert reg.get_sample_value("kvroute_router_ttft_seconds_count") == 1
    assert reg.get_sample_value("kvroute_router_prompt_tokens_total") == 90
    assert reg.get_sample_value("kvroute_router_cached_tokens_total") == 16
