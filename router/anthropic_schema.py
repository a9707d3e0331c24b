"""Anthropic Messages API bodies (``POST /v1/messages``, ``/v1/messages/count_tokens``):
checked, and turned into the chat request the OpenAI front renders.

A Messages conversation becomes chat messages as follows, so that a client switching API
sends the model the same token ids and keeps its cache:

- ``system`` (a string, or text blocks joined by newlines): a first ``system`` message;
- a message's text blocks, joined by newlines: its ``content`` (as the chat front joins text
  parts);
- an assistant's ``tool_use`` blocks: its ``tool_calls`` (``{"id", "type": "function",
  "function": {"name", "arguments": <input as JSON>}}``);
- a user's ``tool_result`` blocks: one ``tool`` message each (``tool_call_id``, its text),
  before the user's text, as Anthropic requires them first;
- ``tools``: ``{"type": "function", "function": {"name", "description", "parameters":
  input_schema}}``; ``tool_choice`` ``auto``/``none`` as they are, ``any`` as ``required``,
  ``tool`` as a named function, ``disable_parallel_tool_use`` as ``parallel_tool_calls:
  false``;
- a last ``assistant`` message: a prefill the answer continues (``continue_final_message``).

``stop_sequences`` are the chat request's ``stop``, ``metadata.user_id`` its ``user`` (the
session), ``output_config.format`` its constraint (a JSON schema). Fields Anthropic defines
that kvroute cannot honour are refused by name, as are fields nobody defines;
``cache_control`` marks are accepted and ignored (engines cache every prefix).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvroute.router.api_error import ApiError, invalid
from kvroute.router.openai_schema import ChatRequest, Constraint, tool_constraint
from kvroute.router.tool_calls import ToolChoice

# Accepted and not used: they change nothing kvroute does (engines cache every prefix; one
# speed, one tier, one region).
_IGNORED = frozenset({"cache_control", "service_tier", "speed", "inference_geo", "diagnostics",
                      "user_profile_id", "workspace_id"})
COUNT_FIELDS = _IGNORED | {"model", "messages", "system", "tools", "tool_choice", "thinking",
                           "output_config"}
MESSAGES_FIELDS = COUNT_FIELDS | {"max_tokens", "stop_sequences", "stream", "temperature",
                                  "top_p", "top_k", "metadata", "container"}
_BLOCK_KEYS = frozenset({"type", "cache_control", "citations"})
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 413: "request_too_large",
               429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
               529: "overloaded_error"}


def error_body(exc: ApiError) -> dict[str, Any]:
    """``exc`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = ERROR_TYPES.get(exc.status,
                           "invalid_request_error" if exc.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


@dataclass
class MessagesRequest(ChatRequest):
    """A Messages request as the chat request it renders as."""

    prefill: bool = False
    """The last message is the assistant's: the answer continues it."""


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise invalid(where, f"expected a string, got {json.dumps(value)[:40]}")
    return value


def _block(block: Any, where: str, kinds: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(block, dict):
        raise invalid(where, "expected a content block object")
    kind = block.get("type")
    if kind not in kinds:
        raise invalid(where, f"type {json.dumps(kind)[:40]}: kvroute takes "
                      f"{', '.join(kinds)} blocks here")
    return block


def _texts(content: Any, where: str) -> str:
    """A string, or text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(where, "expected a string or a list of text blocks")
    return "\n".join(_text(_block(b, f"{where}[{j}]", ("text",)).get("text"),
                           f"{where}[{j}].text") for j, b in enumerate(content))


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages (a user's tool results first)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise invalid(where, "expected an object with a role and content")
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise invalid(f"{where}.role", f"expected \"user\" or \"assistant\", got "
                      f"{json.dumps(role)[:40]}")
    content = m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content", "expected a string or a list of content blocks")
    kinds = ("text", "tool_result") if role == "user" else ("text", "tool_use")
    texts: list[str] = []
    out: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for j, raw in enumerate(content):
        at = f"{where}.content[{j}]"
        b = _block(raw, at, kinds)
        if b["type"] == "text":
            texts.append(_text(b.get("text"), f"{at}.text"))
        elif b["type"] == "tool_result":
            result = b.get("content", "")
            out.append({"role": "tool", "tool_call_id": _text(b.get("tool_use_id"),
                                                               f"{at}.tool_use_id"),
                        "content": _texts(result, f"{at}.content")})
        else:
            args = b.get("input")
            if not isinstance(args, dict):
                raise invalid(f"{at}.input", "expected an object")
            calls.append({"id": _text(b.get("id"), f"{at}.id"), "type": "function",
                          "function": {"name": _text(b.get("name"), f"{at}.name"),
                                       "arguments": json.dumps(args)}})
    if role == "assistant":
        msg: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    return out + ([{"role": "user", "content": "\n".join(texts)}] if texts or not out else [])


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise invalid("tools", "expected a list of tools")
    out = []
    for k, t in enumerate(tools):
        where = f"tools[{k}]"
        if not isinstance(t, dict) or t.get("type", "custom") != "custom":
            raise invalid(where, "kvroute takes client tools ({\"name\", \"description\", "
                          "\"input_schema\"}), not server tools")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise invalid(f"{where}.input_schema", "required: a JSON schema object")
        # The keys in an OpenAI client's order: templates print tools as JSON.
        fn: dict[str, Any] = {"name": _text(t.get("name"), f"{where}.name")}
        if t.get("description") is not None:
            fn["description"] = _text(t["description"], f"{where}.description")
        out.append({"type": "function", "function": {**fn, "parameters": schema}})
    return out


def _check(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for name in body:
        if name not in known:
            raise ApiError(400, f"{name}: Extra inputs are not permitted", param=name)
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict)
                                 or thinking.get("type") not in ("disabled", "adaptive")):
        raise invalid("thinking", "extended thinking budgets are not supported by kvroute "
                      "(only {\"type\": \"disabled\"} or \"adaptive\": the model's template "
                      "decides)")
    if body.get("container") is not None:
        raise invalid("container", "code execution containers are not supported by kvroute")


_MODES = {"auto": "auto", "none": "none", "any": "required", "tool": "named"}


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice``: ``auto`` (the default), ``none``, ``any`` (some tool, forced) or
    ``tool`` (the one named, forced); ``disable_parallel_tool_use``: one call at most."""
    v = body.get("tool_choice") or {"type": "auto"}
    if not isinstance(v, dict) or v.get("type") not in _MODES:
        raise invalid("tool_choice", "expected {\"type\": \"auto\"}, {\"type\": \"any\"}, "
                      "{\"type\": \"tool\", \"name\": ...} or {\"type\": \"none\"}")
    single = v.get("disable_parallel_tool_use", False)
    if not isinstance(single, bool):
        raise invalid("tool_choice.disable_parallel_tool_use", "expected true or false")
    mode = _MODES[v["type"]]
    name = _text(v.get("name"), "tool_choice.name") if mode == "named" else ""
    if mode in ("auto", "none") and not tools:
        mode = "none"
    return ToolChoice(mode, name, parallel=not single)  # type: ignore[arg-type]


def _constraint(body: Mapping[str, Any]) -> Constraint | None:
    """``output_config.format``: a JSON schema the output must match (kvroute's constrained
    generation); ``output_config.effort`` changes nothing."""
    config = body.get("output_config")
    if config is None:
        return None
    if not isinstance(config, dict):
        raise invalid("output_config", "expected an object")
    fmt = config.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise invalid("output_config.format", "expected {\"type\": \"json_schema\", "
                      "\"schema\": {...}}")
    return Constraint("json_schema", json.dumps(fmt["schema"]), "output_config")


def _number(body: Mapping[str, Any], name: str) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise invalid(name, f"expected a number in [0, 1], got {json.dumps(v)[:40]}")
    return float(v)


def _top_k(body: Mapping[str, Any]) -> int | None:
    """``top_k``: sample from the k most likely tokens (0: all)."""
    v = body.get("top_k")
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**31:
        raise invalid("top_k", f"expected an integer >= 0, got {json.dumps(v)[:40]}")
    return v or None


def _model_and_max_tokens(body: Mapping[str, Any], counting: bool) -> tuple[str, int | None]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the name of a model from /v1/models")
    if counting:
        return model, None
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise invalid("max_tokens", "required: an integer >= 1")
    return model, max_tokens


def _conversation(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The chat messages, and whether the last is the assistant's (a prefill)."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise invalid("messages", "required: a non-empty list of messages")
    messages = [{"role": "system", "content": _texts(body["system"], "system")}] \
        if body.get("system") is not None else []
    for i, m in enumerate(raw):
        messages.extend(_message(m, i))
    return messages, raw[-1].get("role") == "assistant"


def _stops(body: Mapping[str, Any]) -> list[str]:
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > 16:
        raise invalid("stop_sequences", "expected at most 16 non-empty strings")
    return list(stops)


def _user(body: Mapping[str, Any]) -> str:
    """``metadata.user_id``: the session."""
    meta = body.get("metadata") or {}
    user = meta.get("user_id") if isinstance(meta, dict) else None
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise invalid("metadata.user_id", "expected a string of at most 256 characters")
    return user or ""


def parse_messages(body: Any, counting: bool = False) -> MessagesRequest:
    """A ``/v1/messages`` body (``counting``: a ``count_tokens`` one, without max_tokens);
    ApiError (400) names the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check(body, COUNT_FIELDS if counting else MESSAGES_FIELDS)
    model, max_tokens = _model_and_max_tokens(body, counting)
    messages, prefill = _conversation(body)
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", "expected true or false")
    return MessagesRequest(
        model=model, max_tokens=max_tokens, temperature=_number(body, "temperature"),
        top_p=_number(body, "top_p"), top_k=_top_k(body), stop=_stops(body), stream=stream,
        user=_user(body),
        messages=messages, constraint=tool_constraint(choice, tools, _constraint(body)),
        tools=tools, tool_choice=choice,
        add_generation_prompt=not prefill, continue_final_message=prefill, prefill=prefill)
