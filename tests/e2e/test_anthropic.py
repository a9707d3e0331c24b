"""Anthropic's Messages API end to end: the official ``anthropic`` SDK and a raw HTTP client
against a real router (``--http-port``, ``--model NAME=SOURCE``) and real tiny-engine agents
(the byte model of tests/e2e/test_openai.py, so the output is text the router decodes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.demo.openai_model import write_byte_model
from kvroute.router.auth import hash_key
from kvroute.router.openai_schema import parse_chat
from tests.e2e.test_openai import record_writes
from tests.support import free_port, wait_for

anthropic = pytest.importorskip("anthropic")

MODEL = "tiny"
SYSTEM = "You are kvroute's test assistant; answer briefly. " * 4  # ~200 tokens
TINY = dict(engine="tiny", capacity_blocks=256, model=MODEL)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    qwen = (Path(__file__).parents[2] / "kvroute" / "demo" / "qwen2.5-instruct.jinja")
    # Qwen2.5's template: it renders tools, tool calls and tool results.
    return write_byte_model(tmp_path_factory.mktemp("byte-model"), qwen.read_text())


async def start(cluster: Any, model_dir: Path, n: int = 1, **router: Any) -> Any:
    for i in range(n):
        await cluster.agent(f"a{i}", **{"model_source": str(model_dir), **TINY})
    r = await cluster.router(model=f"{MODEL}={model_dir}", http_port=free_port(), **router)
    await wait_for(lambda: len(r.registry.loads) == n, what="workers registered")
    return r


def client(router: Any, key: str = "unused") -> Any:
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{router.http_port}",
                                    api_key=key, max_retries=0)


def chat_ids(model_dir: Path, openai_body: dict[str, Any]) -> list[int]:
    """The ids the chat front renders for an OpenAI body."""
    req = parse_chat({"model": MODEL, **openai_body})
    return list(ChatTokenizer.load(str(model_dir)).apply(req.messages, tools=req.tools))


async def test_a_message_and_its_stream_give_the_same_text_and_turn_two_reads_the_cache(
        cluster, model_dir) -> None:
    r = await start(cluster, model_dir)
    c = client(r)
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "text", "text": "there"}]}]
    raw = await c.messages.with_raw_response.create(
        model=MODEL, system=SYSTEM, messages=messages, max_tokens=12,
        extra_body={"temperature": 0})
    out = await raw.parse()
    assert raw.headers["x-kvroute-worker"] == "a0" and out._request_id.startswith("req_")
    assert out.type == "message" and out.role == "assistant" and out.model == MODEL
    assert out.id.startswith("msg_") and out.stop_reason in ("end_turn", "max_tokens")
    (block,) = out.content
    assert block.type == "text"
    prompt = chat_ids(model_dir, {"messages": [{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": "hi\nthere"}]})
    u = out.usage
    assert u.input_tokens + u.cache_read_input_tokens == len(prompt)
    assert 0 < u.output_tokens <= 12 and (u.output_tokens == 12) == (out.stop_reason ==
                                                                       "max_tokens")
    # Counted with the model's tokenizer and template, as the message was rendered.
    counted = await c.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert counted.input_tokens == len(prompt)

    # Streamed: Anthropic's event sequence, the same text (greedy), the prompt from cache.
    kinds, text, final = [], "", None
    async with c.messages.stream(model=MODEL, system=SYSTEM, messages=messages,
                                 max_tokens=12, extra_body={"temperature": 0}) as stream:
        async for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = await stream.get_final_message()
    assert kinds[0] == "message_start"
    assert kinds.index("content_block_start") < kinds.index("content_block_delta")
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text == block.text == final.content[0].text
    assert final.stop_reason == out.stop_reason
    assert final.usage.output_tokens == u.output_tokens
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again

    # Turn two: the first turn's prompt and answer are its prefix, read from the cache.
    turn2 = await c.messages.create(
        model=MODEL, system=SYSTEM, max_tokens=4, extra_body={"temperature": 0},
        messages=[*messages, {"role": "assistant", "content": block.text},
                  {"role": "user", "content": "and then?"}])
    assert turn2.usage.cache_read_input_tokens >= len(prompt) // 16 * 16 - 16


async def test_a_streams_opening_events_go_in_one_write_with_the_first_token(
        cluster, model_dir, monkeypatch) -> None:
    r = await start(cluster, model_dir)
    writes = record_writes(monkeypatch)
    async with client(r).messages.stream(
            model=MODEL, max_tokens=6,
            messages=[{"role": "user", "content": "hi"}]) as stream:
        async for _ in stream:
            pass
    first = [e.split("\n")[0].removeprefix("event: ")
             for e in writes[0].decode().split("\n\n") if e]
    assert first == ["message_start", "ping", "content_block_start", "content_block_delta"]


async def test_tools_render_as_the_chat_does_and_stop_sequences_stop(cluster, model_dir
                                                                      ) -> None:
    r = await start(cluster, model_dir)
    c = client(r)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C",
             "cache_control": {"type": "ephemeral"}}]}]
    counted = await c.messages.count_tokens(model=MODEL, messages=history, tools=[TOOL])
    assert counted.input_tokens == len(chat_ids(model_dir, {
        "tools": [{"type": "function", "function": {
            "name": TOOL["name"], "description": TOOL["description"],
            "parameters": TOOL["input_schema"]}}],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"}]}))
    out = await c.messages.create(model=MODEL, messages=history, tools=[TOOL],
                                  tool_choice={"type": "auto"}, max_tokens=24,
                                  extra_body={"temperature": 0})
    text = out.content[0].text
    assert out.stop_reason in ("end_turn", "max_tokens")
    # A stop sequence taken from that answer: the same greedy answer stops before it.
    cut = next((i for i, ch in enumerate(text) if i > 0 and ch.isprintable()
                and ch not in text[:i]), None)
    if cut is None:
        pytest.skip(f"no usable stop character in {text!r}")
    stopped = await c.messages.create(model=MODEL, messages=history, tools=[TOOL],
                                      max_tokens=24, extra_body={"temperature": 0},
                                      stop_sequences=[text[cut], "\x00never"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == text[cut]
    assert stopped.content[0].text == text[:cut]


async def test_output_config_format_constrains_the_answer_to_its_schema(cluster, model_dir
                                                                        ) -> None:
    r = await start(cluster, model_dir)
    out = await client(r).messages.create(
        model=MODEL, max_tokens=64, messages=[{"role": "user", "content": "A person."}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA},
                       "effort": "low"})
    assert out.stop_reason == "end_turn"
    jsonschema.validate(json.loads(out.content[0].text), SCHEMA)


async def test_top_k_and_top_p_reach_the_engine(cluster, model_dir) -> None:
    r = await start(cluster, model_dir)
    c = client(r)

    async def text(**sampling: Any) -> str:
        out = await c.messages.create(model=MODEL, max_tokens=16, extra_body=sampling,
                                      messages=[{"role": "user", "content": "Say something."}])
        return out.content[0].text

    greedy = await text(temperature=0)
    # Sampling at temperature 1 from the one most likely token is the greedy answer.
    assert await text(temperature=1, top_k=1) == greedy
    assert await text(temperature=1, top_p=0.000001) == greedy
    assert await text(temperature=1, top_k=50) != greedy  # a filter, not greedy


async def test_errors_come_in_anthropics_shape(cluster, model_dir) -> None:
    r = await start(cluster, model_dir)
    c = client(r)
    with pytest.raises(anthropic.NotFoundError) as nf:
        await c.messages.create(model="nope", max_tokens=4,
                                messages=[{"role": "user", "content": "hi"}])
    assert nf.value.body["type"] == "error"
    assert nf.value.body["error"]["type"] == "not_found_error"
    assert "does not exist" in nf.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as bad:
        await c.messages.create(model=MODEL, max_tokens=4, extra_body={"top_k": -5},
                                messages=[{"role": "user", "content": "hi"}])
    assert bad.value.body["error"] == {"type": "invalid_request_error", "message":
                                       "top_k: expected an integer >= 0, got -5"}
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{r.http_port}/v1/messages"
        async with s.post(url, data=b"{not json") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with s.post(url, json={"model": MODEL, "messages": [
                {"role": "user", "content": "hi"}]}) as resp:
            body = await resp.json()
            assert resp.status == 400 and "max_tokens" in body["error"]["message"]
        # The chat endpoint keeps OpenAI's shape.
        async with s.post(f"http://127.0.0.1:{r.http_port}/v1/chat/completions",
                          data=b"{not json") as resp:
            assert "param" in (await resp.json())["error"]
        async with s.get(f"http://127.0.0.1:{r.http_port}/v1/models",
                         headers={"anthropic-version": "2023-06-01"}) as resp:
            models = await resp.json()
            assert [m["id"] for m in models["data"]] == [MODEL]
            assert models["data"][0]["type"] == "model" and models["has_more"] is False
    page = await c.models.list()
    assert [m.id for m in page.data] == [MODEL]


async def test_api_keys_by_bearer_or_x_api_key(cluster, model_dir, tmp_path: Path) -> None:
    keys = tmp_path / "keys.jsonl"
    keys.write_text(json.dumps({"name": "team", "sha256": hash_key("sk-good")}) + "\n")
    r = await start(cluster, model_dir, api_keys_file=str(keys))
    msg = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    with pytest.raises(anthropic.AuthenticationError) as auth:
        await client(r, "sk-bad").messages.create(**msg)
    assert auth.value.body["error"]["type"] == "authentication_error"
    assert (await client(r, "sk-good").messages.create(**msg)).usage.output_tokens > 0
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{r.http_port}/v1/messages"
        async with s.post(url, json=msg, headers={"x-api-key": "sk-good"}) as resp:
            assert resp.status == 200, await resp.text()
        async with s.post(url, json=msg, headers={"x-api-key": "sk-bad"}) as resp:
            assert resp.status == 401
            assert (await resp.json())["error"]["type"] == "authentication_error"


async def test_a_forced_tool_call_is_a_tool_use_block_streamed_or_not(cluster, model_dir
                                                                      ) -> None:
    r = await start(cluster, model_dir)
    c = client(r)
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"], "additionalProperties": False}
    tools = [{"name": "get_weather", "description": "The weather.", "input_schema": city},
             {"name": "now", "input_schema": {"type": "object", "properties": {},
                                              "additionalProperties": False}}]
    ask = dict(model=MODEL, max_tokens=64, tools=tools,
               messages=[{"role": "user", "content": "Weather in Paris?"}])
    out = await c.messages.create(**ask, tool_choice={"type": "tool", "name": "get_weather"})
    assert out.stop_reason == "tool_use" and out.stop_sequence is None
    (use,) = out.content  # no text block: the output is the call
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, city)

    # Any tool, one at most, streamed: a tool_use block whose input comes as JSON deltas.
    kinds, parts = [], ""
    async with c.messages.stream(**ask, tool_choice={"type": "any",
                                                     "disable_parallel_tool_use": True}
                                 ) as stream:
        async for event in stream:
            if event.type == "input_json":  # the SDK's own event beside the delta
                continue
            kinds.append(event.type)
            if event.type == "content_block_delta":
                assert event.delta.type == "input_json_delta"
                parts += event.delta.partial_json
        final = await stream.get_final_message()
    (use,) = final.content
    assert final.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.name in ("get_weather", "now") and json.loads(parts) == use.input
    jsonschema.validate(use.input,
                        city if use.name == "get_weather" else tools[1]["input_schema"])
    assert kinds[-5:] == ["content_block_start", "content_block_delta", "content_block_stop",
                          "message_delta", "message_stop"]

    # The call and its result sent back render as the chat front renders them.
    history = [*ask["messages"], {"role": "assistant", "content": [use.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "sunny"}]}]
    turn2 = await c.messages.count_tokens(model=MODEL, tools=tools, messages=history)
    assert turn2.input_tokens == len(chat_ids(model_dir, {
        "tools": [{"type": "function", "function": {
            "name": t["name"], **({"description": t["description"]} if "description" in t
                                  else {}), "parameters": t["input_schema"]}} for t in tools],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": use.id, "type": "function",
                 "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "sunny"}]}))
