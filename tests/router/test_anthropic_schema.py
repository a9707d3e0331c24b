"""Messages bodies: checked by field, and rendered to the ids the same conversation gets as
a chat completion (so a client switching API keeps its cache)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.core.chat_tokenizer import ChatTokenizer
from kvroute.demo.openai_model import write_byte_model
from kvroute.router.anthropic_schema import error_body, parse_messages
from kvroute.router.api_error import ApiError
from kvroute.router.openai_schema import parse_chat

QWEN = Path(__file__).parents[2] / "kvroute" / "demo" / "qwen2.5-instruct.jinja"


@pytest.fixture(scope="module")
def chat(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    d = write_byte_model(tmp_path_factory.mktemp("byte-model"), QWEN.read_text())
    return ChatTokenizer.load(str(d))


text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
               max_size=20)
ident = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
args = st.dictionaries(ident, st.one_of(text, st.integers(-5, 5), st.booleans()), max_size=3)


@st.composite
def conversations(draw: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Messages body and the chat-completions body a client would send for the same
    conversation (written from the documented mapping, not by the code under test)."""
    tools = draw(st.lists(ident, max_size=2, unique=True))
    a_tools = [{"name": n, "description": f"tool {n}",
                "input_schema": {"type": "object", "properties": {}}} for n in tools]
    o_tools = [{"type": "function", "function": {"name": n, "description": f"tool {n}",
                                                 "parameters": {"type": "object",
                                                                "properties": {}}}}
               for n in tools]
    system = draw(st.none() | text)
    a_msgs: list[dict[str, Any]] = []
    o_msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    pending: list[str] = []  # tool calls the next user turn answers
    for turn in range(draw(st.integers(1, 3))):
        parts = draw(st.lists(text, min_size=0 if pending else 1, max_size=2))
        results = [(cid, draw(text)) for cid in pending]
        a_msgs.append({"role": "user", "content": [
            *({"type": "tool_result", "tool_use_id": cid, "content": r} for cid, r in results),
            *({"type": "text", "text": p} for p in parts)]})
        o_msgs += [{"role": "tool", "tool_call_id": cid, "content": r} for cid, r in results]
        if parts:
            o_msgs.append({"role": "user", "content": "\n".join(parts)})
        pending = []
        if turn == 2 or not draw(st.booleans()):
            break
        said = draw(text)
        calls = [(f"call_{turn}_{k}", n, draw(args)) for k, n in
                 enumerate(draw(st.lists(st.sampled_from(tools), max_size=2)) if tools else [])]
        a_msgs.append({"role": "assistant", "content": [
            {"type": "text", "text": said},
            *({"type": "tool_use", "id": cid, "name": n, "input": a} for cid, n, a in calls)]})
        o_msg: dict[str, Any] = {"role": "assistant", "content": said}
        if calls:
            o_msg["tool_calls"] = [{"id": cid, "type": "function", "function": {
                "name": n, "arguments": json.dumps(a)}} for cid, n, a in calls]
        o_msgs.append(o_msg)
        pending = [cid for cid, _, _ in calls]
    a_body: dict[str, Any] = {"model": "m", "max_tokens": 8, "messages": a_msgs}
    o_body: dict[str, Any] = {"model": "m", "messages": o_msgs}
    if system:
        a_body["system"] = system
    if tools:
        a_body["tools"], o_body["tools"] = a_tools, o_tools
    return a_body, o_body


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations())
def test_a_conversation_renders_alike_as_messages_and_as_chat(
        chat: ChatTokenizer, pair: tuple[dict[str, Any], dict[str, Any]]) -> None:
    a_body, o_body = pair
    a, o = parse_messages(a_body), parse_chat(o_body)
    assert list(chat.apply(a.messages, tools=a.tools)) == \
        list(chat.apply(o.messages, tools=o.tools))


def test_prefill_sequences_metadata_and_sampling_map_to_the_chat_request() -> None:
    req = parse_messages({
        "model": "m", "max_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "stop_sequences": ["END"], "metadata": {"user_id": "u-1"},
        "system": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "b"}],
        "messages": [{"role": "user", "content": "q"},
                     {"role": "assistant", "content": "The answer is"}]})
    assert req.messages[0] == {"role": "system", "content": "a\nb"}
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.user) == \
        (9, 0.5, 0.9, ["END"], "u-1")
    assert req.prefill and req.continue_final_message and not req.add_generation_prompt
    counted = parse_messages({"model": "m", "messages": [{"role": "user", "content": "q"}]},
                             counting=True)
    assert counted.max_tokens is None and counted.add_generation_prompt


TOOL = {"name": "now", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(("choice", "mode", "parallel"), [
    (None, "auto", True), ({"type": "none"}, "none", True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "now"}, "named", True)])
def test_tool_choice_maps_to_the_chat_tool_choice(choice, mode, parallel) -> None:
    body = {"model": "m", "max_tokens": 4, "tools": [TOOL],
            "messages": [{"role": "user", "content": "q"}]}
    req = parse_messages({**body, "tool_choice": choice} if choice else body)
    assert (req.tool_choice.mode, req.tool_choice.parallel) == (mode, parallel)
    assert (req.constraint is not None) == req.tool_choice.forced


@pytest.mark.parametrize(("body", "says"), [
    ({"messages": [{"role": "user", "content": "q"}], "max_tokens": 4}, "model: required"),
    ({"model": "m", "messages": [{"role": "user", "content": "q"}]}, "max_tokens: required"),
    ({"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "q"}]},
     "max_tokens: required"),
    ({"model": "m", "max_tokens": 4, "messages": []}, "messages: required"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "system", "content": "q"}]},
     "messages[0].role"),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, "messages[0].content[0]: type \"image\""),
    ({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "t", "input": {}}]}]}, "tool_use"),
    ({"model": "m", "max_tokens": 4, "temperature": 1.5,
      "messages": [{"role": "user", "content": "q"}]}, "temperature"),
    ({"model": "m", "max_tokens": 4, "tool_choice": {"type": "any"},
      "messages": [{"role": "user", "content": "q"}]}, "tool_choice: required needs tools"),
    ({"model": "m", "max_tokens": 4, "tool_choice": {"type": "tool", "name": "rm"},
      "tools": [TOOL], "messages": [{"role": "user", "content": "q"}]},
     "tool_choice: no tool named \"rm\""),
    ({"model": "m", "max_tokens": 4, "tool_choice": {"type": "tool", "name": "now"},
      "tools": [TOOL], "output_config": {"format": {"type": "json_schema", "schema": {}}},
      "messages": [{"role": "user", "content": "q"}]}, "output_config both constrain"),
    ({"model": "m", "max_tokens": 4, "thinking": {"type": "enabled", "budget_tokens": 1024},
      "messages": [{"role": "user", "content": "q"}]}, "thinking"),
    ({"model": "m", "max_tokens": 4, "stop_sequences": [""],
      "messages": [{"role": "user", "content": "q"}]}, "stop_sequences"),
    ({"model": "m", "max_tokens": 4, "tools": [{"type": "web_search_20250305",
                                                "name": "web_search"}],
      "messages": [{"role": "user", "content": "q"}]}, "server tools"),
    ({"model": "m", "max_tokens": 4, "frequency_penalty": 1,
      "messages": [{"role": "user", "content": "q"}]}, "Extra inputs are not permitted"),
])
def test_a_bad_body_is_a_400_naming_its_field(body: dict[str, Any], says: str) -> None:
    with pytest.raises(ApiError) as exc:
        parse_messages(body)
    assert exc.value.status == 400 and says in exc.value.message
    assert error_body(exc.value) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": exc.value.message}}


def test_error_types_follow_the_status() -> None:
    for status, kind in ((401, "authentication_error"), (403, "permission_error"),
                         (404, "not_found_error"), (413, "request_too_large"),
                         (429, "rate_limit_error"), (503, "overloaded_error"),
                         (500, "api_error"), (502, "api_error"), (409, "invalid_request_error")):
        assert error_body(ApiError(status, "x"))["error"]["type"] == kind
