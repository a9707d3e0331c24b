"""The OpenAI-compatible HTTP front end to end: the official ``openai`` SDK, a raw HTTP client
and curl against a real router (``--http-port``, ``--model NAME=SOURCE``) and real agents.

The model directory is built with ``tokenizers`` (kvroute/demo/openai_model.py): a byte-level
tokenizer whose ids are the tiny engine's ``--tokenizer byte`` ids (byte b is id b, 256 end of
text, 257 start of text) and a chat template, so the tiny engine's output is text the router
decodes and its masks (response_format) run on the same ids.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.demo.openai_model import openai_lines, write_byte_model
from kvroute.router.openai_schema import parse_chat
from tests.support import free_port, generate, wait_for

openai = pytest.importorskip("openai")

MODEL = "tiny"
SYSTEM = "You are kvroute's test assistant; answer briefly. " * 4  # ~200 tokens
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0,
                                                   "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = write_byte_model(tmp_path_factory.mktemp("byte-model"))
    chat = ChatTokenizer.load(str(d))
    assert chat.vocab_size == 258 and chat.eos_token_id == 256
    assert chat.encode("hé", add_special_tokens=False) == list("hé".encode())
    return d


# Agents take the router's model SOURCE (--model-source): no vocabulary size to work out.
TINY = dict(engine="tiny", capacity_blocks=256, model=MODEL)
SIM = dict(engine="sim", capacity_blocks=512, model=MODEL)


async def start(cluster: Any, model_dir: Path, agents: dict[str, dict[str, Any]],
                **router: Any) -> Any:
    for wid, kw in agents.items():
        await cluster.agent(wid, **{"model_source": str(model_dir), **kw})
    router = {"model": f"{MODEL}={model_dir}", **router}
    r = await cluster.router(http_port=free_port(), **router)
    await wait_for(lambda: len(r.registry.loads) == len(agents), what="workers registered")
    return r


def client(router: Any) -> Any:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1",
                              api_key="unused", max_retries=0)


def http_requests(router: Any, outcome: str) -> float:
    return router.metrics.registry.get_sample_value(
        "kvroute_router_requests_total",
        {"api": "http", "rpc": "Generate", "outcome": outcome}) or 0.0


# -- chat --------------------------------------------------------------------------------------

async def test_chat_non_streaming_and_streaming_give_the_same_text(cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": TINY})
    c = client(r)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": [{"type": "text", "text": "hi"},
                                             {"type": "text", "text": "there"}]}]
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, seed=1)
    out = raw.parse()
    assert raw.headers["x-kvroute-worker"] == "a"
    assert out.object == "chat.completion" and out.model == MODEL
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("length", "stop")
    chat = ChatTokenizer.load(str(model_dir))
    prompt = chat.apply([{**messages[0]}, {"role": "user", "content": "hi\nthere"}])
    assert out.usage.prompt_tokens == len(prompt)
    assert 0 < out.usage.completion_tokens <= 12
    # The same ids through gRPC Generate: the same tokens (greedy), so the same text.
    grpc_out = await generate(r.port, prompt, max_tokens=12)
    ids = [t for x in grpc_out for t in x.token_ids]
    assert choice.message.content == chat.decode(ids, skip_special_tokens=True)

    stream = await c.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, seed=1, stream=True,
        stream_options={"include_usage": True})
    chunks = [x async for x in stream]
    assert all(x.object == "chat.completion.chunk" for x in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    finishes = [x.choices[0].finish_reason for x in chunks[:-1] if x.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    text = "".join(x.choices[0].delta.content or "" for x in chunks[:-1])
    assert text == choice.message.content
    assert http_requests(r, "ok") == 2


def tokenize_threads(router: Any) -> list[str]:
    import threading

    prefix = f"kvroute-tokenize-{router.http_port}"
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


async def test_a_long_chat_is_tokenized_off_the_event_loop_with_the_same_ids(
        cluster, model_dir) -> None:
    from kvroute.router.http_front import INLINE_BODY_BYTES

    r = await start(cluster, model_dir, {"a": SIM})
    c = client(r)
    chat = ChatTokenizer.load(str(model_dir))
    short = [{"role": "user", "content": "hi"}]
    out = await c.chat.completions.create(model=MODEL, messages=short, max_tokens=2)
    assert out.usage.prompt_tokens == len(chat.apply(short))
    assert tokenize_threads(r) == []  # a short prompt stays on the loop: no thread was made
    long = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "word " * (INLINE_BODY_BYTES // 4)}]  # > the bound
    outs = await asyncio.gather(*(c.chat.completions.create(
        model=MODEL, messages=[*long, {"role": "user", "content": str(i)}], max_tokens=2)
        for i in range(4)))
    assert tokenize_threads(r)  # the long ones were tokenized on the pool's threads
    for i, o in enumerate(outs):
        assert o.usage.prompt_tokens == len(chat.apply([*long, {"role": "user",
                                                               "content": str(i)}]))
    text = await c.completions.create(model=MODEL, prompt="x" * (INLINE_BODY_BYTES + 1),
                                      max_tokens=2)
    assert text.usage.prompt_tokens == INLINE_BODY_BYTES + 1


async def test_the_second_turn_lands_on_the_first_turns_worker_with_its_cache(
        cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {w: SIM for w in ("a", "b", "c", "d")})
    c = client(r)
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=turn1,
                                                            max_tokens=8)
    first, worker = raw.parse(), raw.headers["x-kvroute-worker"]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    await wait_for(lambda: r.mirror.index.count(worker) >= first.usage.prompt_tokens // 16,
                   what="the first turn's blocks in the index")
    turn2 = [*turn1, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "and a second one"}]
    raw = await c.chat.completions.with_raw_response.create(model=MODEL, messages=turn2,
                                                            max_tokens=8, user="u1")
    second = raw.parse()
    assert raw.headers["x-kvroute-worker"] == worker
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 > 0
    assert raw.headers["x-kvroute-cached-tokens"] == str(cached)


async def test_n_choices_run_as_a_fork_on_one_worker(cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": TINY, "b": TINY})
    c = client(r)
    raw = await c.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": SYSTEM}], max_tokens=6, n=2,
        temperature=1.5, seed=3)
    out = raw.parse()
    assert sorted(ch.index for ch in out.choices) == [0, 1]
    assert "," not in raw.headers["x-kvroute-worker"]  # one request, one worker
    assert 2 <= out.usage.completion_tokens <= 12  # both choices' tokens
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": SYSTEM}], max_tokens=6, n=2,
        temperature=1.5, seed=3, stream=True)
    chunks = [x async for x in stream]
    texts = {0: "", 1: ""}
    for x in chunks:
        for ch in x.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts == {ch.index: ch.message.content for ch in out.choices}  # same seed
    deltas = [ch.index for x in chunks for ch in x.choices if ch.delta.content]
    assert deltas.count(0) > 1 and deltas.count(1) > 1  # streamed as generated, not at the end


async def test_response_format_json_schema_output_parses_against_its_schema(
        cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": TINY})
    c = client(r)
    for seed in (1, 2, 3):
        out = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a person as JSON"}],
            max_tokens=64, temperature=1.5, seed=seed,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "person", "schema": SCHEMA}})
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)
    obj = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON"}], max_tokens=64,
        temperature=0.0, response_format={"type": "json_object"}, logprobs=True)
    # Free-form JSON from a random model often runs to max_tokens: an object's beginning then.
    content, finish = obj.choices[0].message.content, obj.choices[0].finish_reason
    assert content.startswith("{") and finish in ("stop", "length")
    if finish == "stop":
        assert isinstance(json.loads(content), dict)
    lps = obj.choices[0].logprobs.content
    assert len(lps) == obj.usage.completion_tokens
    assert all(t.logprob <= 0 for t in lps) and sum(t.logprob for t in lps) < 0  # real logits
    if not any("\ufffd" in t.token for t in lps):  # a character split across tokens
        assert "".join(t.token for t in lps) == content


async def test_tools_and_chat_template_kwargs_are_rendered(cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": SIM})
    c = client(r)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    base = await c.chat.completions.create(model=MODEL, max_tokens=1,
                                           messages=[{"role": "user", "content": "hi"}])
    with_tools = await c.chat.completions.create(
        model=MODEL, max_tokens=1, tools=tools, messages=[{"role": "user", "content": "hi"}])
    chat = ChatTokenizer.load(str(model_dir))
    assert with_tools.usage.prompt_tokens == len(
        chat.apply([{"role": "user", "content": "hi"}], tools=tools))
    assert with_tools.usage.prompt_tokens > base.usage.prompt_tokens
    no_think = await c.chat.completions.create(
        model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "hi"}],
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_think.usage.prompt_tokens == base.usage.prompt_tokens + len("<think></think>")


WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                   "required": ["city"], "additionalProperties": False}}}]
# What a model that calls a tool writes in Hermes' format (the byte model's template writes
# calls so); the tests make the tiny engine write it with a choice constraint.
CALLS = 'Checking.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


async def stream_chat(c: Any, **kw: Any) -> tuple[str, dict[int, Any], str | None]:
    """A streamed chat's content, tool calls by index, and finish reason."""
    content, calls, finish = "", {}, None
    async for chunk in await c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                calls[tc.index] = tc
            finish = ch.finish_reason or finish
    return content, calls, finish


async def test_tool_calls_are_read_from_the_output_or_forced(cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": TINY})
    c = client(r)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
               tools=WEATHER, max_tokens=120)
    writes_calls = {"structured_outputs": {"choice": [CALLS]}}
    out = await c.chat.completions.create(**ask, extra_body=writes_calls)
    (ch,) = out.choices
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking.\n"
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # Streamed: the text up to the call, never the call's own text; the call at the end.
    content, calls, finish = await stream_chat(c, **ask, extra_body=writes_calls)
    assert content == "Checking.\n" and finish == "tool_calls"
    assert calls[0].function.name == "get_weather" and calls[0].id.startswith("call_")
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}

    # Turn two: the call sent back renders as the template writes calls.
    history = [*ask["messages"], ch.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    turn2 = await c.chat.completions.create(model=MODEL, tools=WEATHER, max_tokens=4,
                                            messages=history)
    chat = ChatTokenizer.load(str(model_dir))
    rendered = chat.render(parse_chat({"model": MODEL, "messages": history}).messages,
                           tools=WEATHER)
    assert CALLS.split("\n")[1] in rendered  # the call as the model wrote it
    assert turn2.usage.prompt_tokens == len(chat.encode(rendered, add_special_tokens=False))

    # tool_choice none: the same output is text.
    none = await c.chat.completions.create(**ask, tool_choice="none", extra_body=writes_calls)
    assert none.choices[0].message.content == CALLS and not none.choices[0].message.tool_calls

    # Forced, named: the arguments generated under the tool's schema, streamed or not.
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = await c.chat.completions.create(**ask, tool_choice=named)
    (call,) = forced.choices[0].message.tool_calls
    assert forced.choices[0].finish_reason == "tool_calls"
    assert forced.choices[0].message.content is None and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER[0]["function"]["parameters"])
    content, calls, finish = await stream_chat(c, **ask, tool_choice="required")
    assert content == "" and finish == "tool_calls" and calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(calls[0].function.arguments),
                        WEATHER[0]["function"]["parameters"])


async def test_a_model_whose_tool_calls_cannot_be_read_is_told_so(cluster, model_dir,
                                                                 tmp_path) -> None:
    plain = write_byte_model(tmp_path / "plain", "{% for m in messages %}{{ m['content'] }}"
                             "{% endfor %}")
    r = await start(cluster, model_dir, {"a": TINY}, model=f"{MODEL}={model_dir},plain={plain}")
    c = client(r)
    with pytest.raises(openai.BadRequestError) as exc:
        await c.chat.completions.create(model="plain", tools=WEATHER, max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["param"] == "tool_choice"
    assert "--http-tool-parser" in exc.value.body["message"]
    # With --http-tool-parser none the calls stay text.
    r2 = await cluster.router(model=f"{MODEL}={model_dir}", http_port=free_port(),
                              http_tool_parser="none")
    await wait_for(lambda: len(r2.registry.loads) == 1, what="workers registered")
    out = await client(r2).chat.completions.create(
        model=MODEL, tools=WEATHER, max_tokens=120, messages=[{"role": "user", "content": "?"}],
        extra_body={"structured_outputs": {"choice": [CALLS]}})
    assert out.choices[0].message.content == CALLS and out.choices[0].finish_reason == "stop"


# -- completions -------------------------------------------------------------------------------

async def test_completions_with_text_with_ids_and_with_several_prompts(cluster,
                                                                       model_dir) -> None:
    r = await start(cluster, model_dir, {"a": TINY})
    c = client(r)
    chat = ChatTokenizer.load(str(model_dir))
    text = await c.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=8, temperature=0)
    ids = await c.completions.create(model=MODEL, prompt=chat.encode(SYSTEM), max_tokens=8,
                                     temperature=0)
    assert text.object == "text_completion"
    assert text.choices[0].text == ids.choices[0].text  # the same ids either way
    assert text.usage.prompt_tokens == len(chat.encode(SYSTEM))
    batch = await c.completions.create(model=MODEL, prompt=[SYSTEM, list(b"other prompt")],
                                       max_tokens=4, temperature=0)
    assert [ch.index for ch in batch.choices] == [0, 1]
    assert batch.usage.prompt_tokens == len(chat.encode(SYSTEM)) + len(b"other prompt")
    assert text.choices[0].text.startswith(batch.choices[0].text.rstrip("\ufffd"))
    full = text.choices[0].text  # random bytes: the first ASCII one past the start stops it
    at = next(i for i, ch in enumerate(full) if i > 0 and ord(ch) < 128)
    stop = await c.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=8, temperature=0,
                                      stop=[full[at]])
    assert stop.choices[0].text == full[:at]  # the stop string is not kept
    assert stop.choices[0].finish_reason == "stop"
    stream = await c.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=8,
                                        temperature=0, stream=True)
    assert "".join([x.choices[0].text async for x in stream]) == text.choices[0].text


# -- errors ------------------------------------------------------------------------------------

async def post(port: int, path: str, body: Any, raw: bytes | None = None
               ) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{port}{path}", data=raw if raw is not None else json.dumps(body),
            headers={"content-type": "application/json"}) as resp:
        return resp.status, await resp.json(), dict(resp.headers)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": MODEL, "messages": "hi"}, 400, "messages"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "3"},
     400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6},
     400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
     400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 2},
     400, "top_p"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]},
     400, "stop"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bogus": 1},
     400, "bogus"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "xml"}}, 400, "response_format"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600}]}, 413, "messages"),
    ({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 40}, 400, "n"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "chat_template": "{{ 'x' * 10 }}"}, 400, "chat_template"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "chat_template_kwargs": {"messages": []}}, 400, "messages"),
    # A lone surrogate (no UTF-8 for it) in any text field: that field, not a 500.
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi \ud800"}]}, 400,
     "messages[0].content"),
    ({"model": MODEL, "messages": [{"role": "\udfff", "content": "hi"}]}, 400,
     "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["\ud800"]},
     400, "stop[0]"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "user": "\ud800"},
     400, "user"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "cache_salt": "\ud800"},
     400, "cache_salt"),
])
async def test_each_bad_chat_request_gets_its_status_and_param(cluster, model_dir, body,
                                                              status, param) -> None:
    r = await start(cluster, model_dir, {"a": SIM}, max_prompt_tokens=512)
    code, err, _ = await post(r.http_port, "/v1/chat/completions", body)
    assert code == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["param"] == param, err
    if status == 413:
        assert "512" in err["error"]["message"]
    if status == 404:
        assert err["error"]["code"] == "model_not_found"


async def test_a_batch_past_its_bounds_is_a_413_and_its_prompts_run_a_few_at_a_time(
        cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": SIM}, http_max_generations=16,
                    http_max_batch_tokens=1000, http_batch_concurrency=2)
    port = r.http_port
    # 100,000 prompts: refused on their count, before any is read or tokenized.
    code, err, _ = await post(port, "/v1/completions",
                              {"model": MODEL, "prompt": ["hello"] * 100_000})
    assert code == 413 and err["error"]["param"] == "prompt"
    assert "100000 prompts x n=1 asks for 100000 generations" in err["error"]["message"]
    code, err, _ = await post(port, "/v1/completions",
                              {"model": MODEL, "prompt": ["a", "b"], "n": 9,
                               "temperature": 1.0})
    assert code == 413 and "18 generations" in err["error"]["message"]
    code, err, _ = await post(port, "/v1/completions",
                              {"model": MODEL, "prompt": [[1] * 400] * 3})
    assert code == 413 and "--http-max-batch-tokens" in err["error"]["message"]
    # Within bounds: all prompts served, at most 2 in flight at once.
    peak, seen = [0], []
    original = r.registry.begin

    def begin(worker: str, *a: Any, **kw: Any) -> Any:
        seen.append(1)
        peak[0] = max(peak[0], sum(i.inflight for i in r.registry.all()) + 1)
        return original(worker, *a, **kw)
    r.registry.begin = begin  # type: ignore[method-assign]
    code, body, _ = await post(port, "/v1/completions",
                               {"model": MODEL, "prompt": [[1, 2, 3]] * 12, "max_tokens": 4})
    assert code == 200 and len(body["choices"]) == 12
    assert len(seen) == 12 and peak[0] <= 2


async def test_malformed_bodies_oversized_bodies_and_bad_prompts_are_4xx(cluster,
                                                                       model_dir) -> None:
    r = await start(cluster, model_dir, {"a": SIM}, http_max_body_bytes=4096,
                    max_prompt_tokens=512)
    port = r.http_port
    for raw in (b"{not json", b"\xff\xfe", b"[1, 2]", b"null", b"[" * 100000):
        code, err, _ = await post(port, "/v1/chat/completions", None, raw=raw)
        assert code in (400, 413), (raw[:10], code, err)
        assert code == 400 or raw.startswith(b"[[")
    code, err, _ = await post(port, "/v1/completions", None,
                              raw=json.dumps({"model": MODEL, "prompt": "x" * 5000}).encode())
    assert code == 413 and "4096" in err["error"]["message"]
    for prompt, param in (([300], "prompt"), ([], "prompt"), ([[1], "a", 3], "prompt"),
                          ([-1], "prompt")):
        code, err, _ = await post(port, "/v1/completions", {"model": MODEL, "prompt": prompt})
        assert code == 400 and err["error"]["param"] == param, (prompt, err)
    code, err, _ = await post(port, "/v1/completions", {"model": MODEL, "prompt": [1] * 600})
    assert code == 413 and err["error"]["param"] == "prompt" and "512" in err["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(f"http://127.0.0.1:{port}/v1/nothing") as resp:
            assert resp.status == 404 and "error" in await resp.json()
        async with s.get(f"http://127.0.0.1:{port}/v1/chat/completions") as resp:
            assert resp.status == 405 and "error" in await resp.json()
        async with s.get(f"http://127.0.0.1:{port}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == [MODEL]
        async with s.get(f"http://127.0.0.1:{port}/health") as resp:
            assert resp.status == 200 and (await resp.json())["workers"] == 1
    assert http_requests(r, "invalid") >= 5


async def test_no_worker_is_a_503_with_retry_after(cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {})
    code, err, headers = await post(r.http_port, "/v1/completions",
                                    {"model": MODEL, "prompt": "hello"})
    assert code == 503 and headers["Retry-After"] == "1", err
    assert err["error"]["code"] == "no_worker_available"
    with pytest.raises(openai.InternalServerError):
        await client(r).completions.create(model=MODEL, prompt="hello")
    assert http_requests(r, "unavailable") == 2


async def test_a_taken_http_port_is_refused_naming_the_flag(cluster, model_dir) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit, match=rf"--http-port {port} \(KVROUTE_HTTP_PORT\).*in use"):
            await cluster.router(model=f"{MODEL}={model_dir}", http_port=port)


# -- raw SSE, curl, disconnects ----------------------------------------------------------------

def sse_events(lines: list[str]) -> list[Any]:
    """The data of each event; every event is one ``data:`` line and a blank line."""
    events = []
    for i, line in enumerate(lines):
        if line.startswith("data: "):
            assert lines[i + 1] == "", lines[i:i + 2]
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "" and i > 0 and lines[i - 1].startswith("data: "), line
    return events


async def test_an_sse_stream_read_line_by_line_and_with_curl(cluster, model_dir) -> None:
    r = await start(cluster, model_dir, {"a": TINY})
    body = {"model": MODEL, "stream": True, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    url = f"http://127.0.0.1:{r.http_port}/v1/chat/completions"
    lines: list[str] = []
    async with aiohttp.ClientSession() as s, s.post(url, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        async for raw in resp.content:
            lines.append(raw.decode().rstrip("\n"))
    events = sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    if shutil.which("curl") is None:
        return
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sN", url, "-H", "content-type: application/json", "-d", json.dumps(body),
        stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    curl_events = sse_events(out.decode().split("\n")[:-1])
    assert [e if e == "[DONE]" else e["choices"] for e in curl_events] == \
        [e if e == "[DONE]" else e["choices"] for e in events]  # greedy: the same stream


def record_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every write of a streamed HTTP response, in order (the stream of one request)."""
    writes: list[bytes] = []
    real = aiohttp.web.StreamResponse.write

    async def write(self: aiohttp.web.StreamResponse, data: bytes) -> None:
        writes.append(bytes(data))
        await real(self, data)
    monkeypatch.setattr(aiohttp.web.StreamResponse, "write", write)
    return writes


async def test_a_streams_first_token_goes_in_one_write_with_its_role(cluster, model_dir,
                                                                      monkeypatch) -> None:
    """One wake of the client for the first token, not one per chunk."""
    r = await start(cluster, model_dir, {"a": TINY})
    writes = record_writes(monkeypatch)
    stream = await client(r).chat.completions.create(
        model=MODEL, stream=True, max_tokens=6, temperature=0,
        messages=[{"role": "user", "content": "hello"}])  # its first token is a character
    chunks = [c async for c in stream]
    first = [json.loads(e[len("data: "):]) for e in writes[0].decode().split("\n\n") if e]
    assert [e["choices"][0]["delta"] for e in first] == [
        {"role": "assistant", "content": ""},
        {"content": chunks[1].choices[0].delta.content}], first
    assert chunks[1].choices[0].delta.content  # the first token's text


async def test_a_client_that_disconnects_mid_stream_frees_the_engine(cluster,
                                                                   model_dir) -> None:
    a = await cluster.agent("a", **{**SIM, "time_scale": 1.0,
                                             "model_source": str(model_dir)})
    r = await cluster.router(model=f"{MODEL}={model_dir}", http_port=free_port())
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    body = {"model": MODEL, "stream": True, "max_tokens": 5000,
            "messages": [{"role": "user", "content": SYSTEM}]}
    url = f"http://127.0.0.1:{r.http_port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        resp = await s.post(url, json=body)
        got = 0
        async for raw in resp.content:
            got += raw.startswith(b"data: {") and b'"content"' in raw
            if got >= 3:
                break
        assert a.engine.load().running == 1
        resp.close()  # the connection goes away mid-stream
    await wait_for(lambda: a.engine.load().running == 0 and a.engine.load().queued == 0,
                   what="the engine's sequence freed")
    await wait_for(lambda: http_requests(r, "cancelled") == 1, what="counted as cancelled")
    # Non-streaming too: the client gives up while the engine generates.
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(s.post(url, json={**body, "stream": False, "n": 2}))
        await wait_for(lambda: a.engine.load().running + a.engine.load().queued == 2,
                       what="both choices in the engine")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await wait_for(lambda: a.engine.load().running == 0 and a.engine.load().queued == 0,
                   what="the engine's sequences freed")
    await wait_for(lambda: http_requests(r, "cancelled") == 2, what="counted as cancelled")


async def test_a_worker_failing_mid_stream_ends_the_stream_with_an_error_event(
        cluster, model_dir) -> None:
    a = await cluster.agent("a", **{**SIM, "time_scale": 1.0,
                                             "model_source": str(model_dir)})
    r = await cluster.router(model=f"{MODEL}={model_dir}", http_port=free_port())
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    stream = await client(r).chat.completions.create(
        model=MODEL, stream=True, max_tokens=5000,
        messages=[{"role": "user", "content": SYSTEM}])
    got = 0
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        async for x in stream:
            got += bool(x.choices and x.choices[0].delta.content)
            if got == 3:
                await cluster.stop(a)
    assert got >= 3
    assert http_requests(r, "failed_midstream") == 1


async def test_a_non_streaming_request_whose_worker_fails_midway_runs_again(
        cluster, model_dir) -> None:
    a = await cluster.agent("a", **{**SIM, "time_scale": 1.0,
                                             "model_source": str(model_dir)})
    r = await cluster.router(model=f"{MODEL}={model_dir}", http_port=free_port())
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    call = asyncio.create_task(client(r).chat.completions.create(
        model=MODEL, max_tokens=300, messages=[{"role": "user", "content": SYSTEM}]))
    ttft = "kvroute_router_ttft_seconds_count"
    await wait_for(lambda: (r.metrics.registry.get_sample_value(ttft) or 0) == 1,
                   what="a's first tokens at the router")
    await cluster.agent("b", **{**SIM, "time_scale": 0.0, "model_source": str(model_dir)})
    await wait_for(lambda: len(r.registry.loads) == 2, what="b registered")
    await cluster.stop(a)
    out = await call
    # Nothing had reached the client: the whole answer comes from b.
    assert out.usage is not None and out.usage.completion_tokens >= 1
    assert out.choices[0].finish_reason in ("stop", "length") and out.choices[0].message.content
    routed = "kvroute_router_routed_total"
    assert r.metrics.registry.get_sample_value(routed, {"worker": "b"}) == 1
    assert http_requests(r, "failed_midstream") == 1 and http_requests(r, "ok") == 1


async def test_the_printed_curl_line_and_sdk_snippet_work(cluster, model_dir) -> None:
    """What ``kvroute demo --serve`` prints, run as a user would paste it into a shell."""
    r = await start(cluster, model_dir, {"a": TINY})
    lines = openai_lines(f"127.0.0.1:{r.http_port}", MODEL)
    curl, snippet = lines.split("\n  python", 1)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    runs = [("python" + snippet).strip()]
    if shutil.which("curl"):
        runs.append(curl.strip())
    for script in runs:
        proc = await asyncio.create_subprocess_exec(
            "bash", "-c", script, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        out, err = await proc.communicate()
        assert proc.returncode == 0, (script, err.decode())
        text = out.decode()
        if script.startswith("curl"):
            assert text.rstrip().endswith("data: [DONE]") and "chat.completion.chunk" in text
        else:
            assert "prompt_tokens=" in text, text


async def test_a_router_without_a_model_source_serves_token_id_completions(cluster) -> None:
    await cluster.agent("a", engine="sim", vocab_size=1000)
    r = await cluster.router(vocab_size=1000, http_port=free_port())
    await wait_for(lambda: len(r.registry.loads) == 1, what="worker registered")
    out = await client(r).completions.create(model="default", prompt=list(range(40)),
                                             max_tokens=5)
    assert out.choices[0].text == "" and len(out.choices[0].token_ids) == 5  # type: ignore
    code, err, _ = await post(r.http_port, "/v1/chat/completions",
                              {"model": "default", "messages": [{"role": "user", "content": "x"}]})
    assert code == 400 and err["error"]["param"] == "messages" and "--model" in err["error"][
        "message"]
    code, err, _ = await post(r.http_port, "/v1/completions", {"model": "default", "prompt": "x"})
    assert code == 400 and err["error"]["param"] == "prompt"
    code, err, _ = await post(r.http_port, "/v1/completions",
                              {"model": "default", "prompt": [5000]})
    assert code == 400 and err["error"]["param"] == "prompt" and "1000" in err["error"]["message"]


async def test_an_agent_given_another_tokenizer_of_the_same_size_gets_no_traffic(
        cluster, model_dir, tmp_path) -> None:
    # The byte model with its two special tokens swapped: 258 ids, but not the same ones.
    other = tmp_path / "other-model"
    other.mkdir()
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    for tok in spec["added_tokens"]:
        tok["id"] = 257 if tok["id"] == 256 else 256
    (other / "tokenizer.json").write_text(json.dumps(spec))
    (other / "tokenizer_config.json").write_text(
        (model_dir / "tokenizer_config.json").read_text())
    r = await start(cluster, model_dir, {"same": SIM})
    await cluster.agent("other", **{**SIM, "model_source": str(other)})
    ours = ChatTokenizer.load(str(model_dir)).fingerprint
    theirs = ChatTokenizer.load(str(other)).fingerprint
    await wait_for(lambda: r.registry._workers.get("other") is not None
                   and r.registry._workers["other"].excluded == "tokenizer",
                   what="the other tokenizer's worker excluded")
    assert r.registry._workers["other"].excluded_why == \
        f"tokenizer {theirs}/258, router {ours}/258"
    assert set(r.registry.loads) == {"same"}
    for _ in range(4):
        out = await client(r).chat.completions.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert out.choices[0].message.content is not None
    assert r.metrics.registry.get_sample_value(
        "kvroute_router_worker_excluded", {"worker": "other", "reason": "tokenizer"}) == 1
