"""OpenAI-compatible request bodies: parsed and checked, before any tokenizing or routing.

``parse_chat`` and ``parse_completion`` turn a decoded JSON body into a :class:`ChatRequest` or
:class:`CompletionRequest`, or raise :class:`ApiError` naming the field (OpenAI's ``param``).
Fields OpenAI defines that kvroute cannot honour are accepted at their default values only
(``frequency_penalty: 0``) and refused otherwise; fields nobody defines are refused, as OpenAI
refuses them ("Unrecognized request argument supplied"). docs/http.md lists them.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvroute.router.api_error import ApiError, invalid
from kvroute.router.tool_calls import ToolChoice
from kvroute.v1 import common_pb2, program_pb2

MAX_N = 128
"""The most choices one request may ask for (the agent's --max-program-fanout is the real
limit; this one keeps an absurd ``n`` from building a huge program)."""
SO = "structured_outputs"
STOP_CAPTURE = "text"
"""The capture of a request's gen when it has stop strings: the agent's exact text before the
stop, which may end inside a token its ids leave out."""


# -- the parsed requests --------------------------------------------------------------------

@dataclass(frozen=True)
class Constraint:
    """What the output must match: ``kind`` is a kvroute.v1.Constraint field (json_schema,
    regex, lark, choices); ``value`` its text, or the options for choices."""

    kind: str
    value: str | tuple[str, ...]
    param: str = "response_format"
    """The request field it came from (``response_format`` or ``structured_outputs``)."""


@dataclass
class Generation:
    """The fields both endpoints share. ``None``: not given (the router's default applies)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    user: str = ""
    cache_salt: str = ""
    constraint: Constraint | None = None

    @property
    def needs_program(self) -> bool:
        """Stop strings, several choices, a constraint and log-probabilities are the
        controller's (a program with one gen step, forked ``n`` ways); the rest is a plain
        request."""
        return bool(self.program_params)

    @property
    def program_params(self) -> list[str]:
        """The request fields that make it a program, the constraint's first: a worker's
        refusal of the program is about them."""
        return ([self.constraint.param] if self.constraint is not None else []) + \
            ["stop"] * bool(self.stop) + ["n"] * (self.n > 1) + ["logprobs"] * self.logprobs


@dataclass
class ChatRequest(Generation):
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None


@dataclass
class CompletionRequest(Generation):
    prompts: list[str | list[int]] = field(default_factory=list)
    """One entry per prompt: text, or token ids."""


# -- field readers ---------------------------------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: Mapping[str, Any], name: str, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise invalid(name, f"expected an integer, got {json.dumps(v)[:40]}")
    if v < low or (high is not None and v > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise invalid(name, f"must be {bound}, got {v}")
    return int(v)


def _number(body: Mapping[str, Any], name: str, low: float, high: float) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise invalid(name, f"expected a number, got {json.dumps(v)[:40]}")
    if not low <= v <= high:
        raise invalid(name, f"must be in [{low:g}, {high:g}], got {v}")
    return float(v)


def _bool(body: Mapping[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"expected true or false, got {json.dumps(v)[:40]}")
    return v


def _str(body: Mapping[str, Any], name: str, default: str = "", most: int = 256) -> str:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise invalid(name, f"expected a string, got {json.dumps(v)[:40]}")
    if len(v) > most:
        raise invalid(name, f"longer than {most} characters")
    return v


def _object(body: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, dict):
        raise invalid(name, f"expected an object, got {json.dumps(v)[:40]}")
    return v


def _objects(body: Mapping[str, Any], name: str) -> list[dict[str, Any]] | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise invalid(name, "expected a list of objects")
    return v


# Fields OpenAI defines that kvroute serves only at their default (the value they may take).
_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logit_bias": ({},),
    "best_of": (1,), "echo": (False,), "suffix": ("",), "top_logprobs": (0,),
    "modalities": (["text"],), "prediction": (), "audio": (), "web_search_options": (),
    "reasoning_effort": (), "functions": (), "function_call": ("auto", "none"),
}
_WHY_DEFAULT_ONLY = {
    "top_logprobs": "engines report only each sampled token's log-probability (logprobs: "
                    "true), not the alternatives'",
}
# Fields accepted and not used: they change nothing kvroute does.
_IGNORED = frozenset({"store", "metadata", "service_tier", "stream_options", "user",
                      "prompt_cache_key", "safety_identifier"})


def _check_fields(body: Mapping[str, Any], known: frozenset[str]) -> None:
    for name, value in body.items():
        if name in known or name in _IGNORED:
            continue
        if name in _DEFAULT_ONLY:
            if value is None or value in _DEFAULT_ONLY[name]:
                continue
            why = _WHY_DEFAULT_ONLY.get(name, "")
            raise invalid(name, f"{json.dumps(value)[:60]} is not supported by kvroute (only "
                          f"{' or '.join(json.dumps(v) for v in _DEFAULT_ONLY[name]) or 'unset'})"
                          f"{': ' + why if why else ''}", code="unsupported_parameter")
        raise ApiError(400, f"Unrecognized request argument supplied: {name}", param=name,
                       code="unknown_parameter")


_COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n",
                     "logprobs", "stream", "stream_options", "user", "response_format",
                     "structured_outputs", "cache_salt"})
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template",
                         "chat_template_kwargs", "add_generation_prompt",
                         "continue_final_message", "documents"}
COMPLETION_FIELDS = _COMMON | {"prompt"}


def _constraint(body: Mapping[str, Any]) -> Constraint | None:
    """``response_format`` or vLLM's ``structured_outputs`` (not both)."""
    rf = _object(body, "response_format")
    so = _object(body, "structured_outputs")
    if rf is not None and so is not None:
        raise invalid("structured_outputs", "give response_format or structured_outputs, "
                      "not both")
    if rf is not None:
        return _response_format(rf)
    return _structured_outputs(so) if so is not None else None


def _response_format(rf: Mapping[str, Any]) -> Constraint | None:
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_schema", json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise invalid("response_format", "json_schema needs a \"json_schema\" object "
                          "with a \"schema\" object")
        return Constraint("json_schema", json.dumps(spec["schema"]))
    raise invalid("response_format", f"type {json.dumps(kind)}: expected \"text\", "
                  "\"json_object\" or \"json_schema\"")


def _structured_outputs(so: Mapping[str, Any]) -> Constraint:
    given = {k: v for k, v in so.items() if v is not None}
    if len(given) != 1:
        raise invalid("structured_outputs", "give exactly one of json, regex, choice, "
                      "grammar")
    (kind, v), = given.items()
    if kind == "json" and isinstance(v, (dict, str)):
        return Constraint("json_schema", v if isinstance(v, str) else json.dumps(v), SO)
    if kind in _TEXT_CONSTRAINTS and isinstance(v, str):
        return Constraint(_TEXT_CONSTRAINTS[kind], v, SO)
    if kind == "choice" and isinstance(v, list) and v and all(isinstance(c, str) for c in v):
        return Constraint("choices", tuple(v), SO)
    raise invalid("structured_outputs", f"{kind}: expected json (an object), regex or "
                  "grammar (a string) or choice (a list of strings)")


_TEXT_CONSTRAINTS = {"regex": "regex", "grammar": "lark"}  # field -> kvroute.v1.Constraint's


def _top_k(body: Mapping[str, Any]) -> int | None:
    """vLLM's ``top_k``: the most likely tokens sampled from; -1 and 0 mean all."""
    k = _int(body, "top_k", -1, 2**31 - 1)
    return None if k is None or k <= 0 else k


def _generation(body: Mapping[str, Any], max_tokens_fields: Sequence[str]) -> dict[str, Any]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "required: the name of a model from /v1/models")
    max_tokens = None
    for name in max_tokens_fields:  # the later wins (max_completion_tokens over max_tokens)
        v = _int(body, name, 1)
        if v is not None:
            max_tokens = v
    stop = body.get("stop")
    stops: list[str]
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise invalid("stop", "expected a string or a list of strings")
    if any(not s for s in stops) or len(stops) > 16:
        raise invalid("stop", "at most 16 stop strings, none empty")
    stream = _bool(body, "stream")
    opts = _object(body, "stream_options") or {}
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise invalid("stream_options", "include_usage: expected true or false")
    return dict(model=model, max_tokens=max_tokens,
                temperature=_number(body, "temperature", 0.0, 2.0),
                top_p=_number(body, "top_p", 0.0, 1.0), top_k=_top_k(body),
                seed=_int(body, "seed", 0, 2**64 - 1), stop=stops,
                n=_int(body, "n", 1, MAX_N) or 1, stream=stream,
                include_usage=stream and include_usage, user=_str(body, "user", most=200),
                cache_salt=_str(body, "cache_salt"), constraint=_constraint(body))


def _content(message: Mapping[str, Any], i: int) -> Any:
    """A message's content as templates take it: text parts joined by newlines (as vLLM's
    "string" content format does); other parts are refused."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"messages[{i}].content", "expected a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        if not isinstance(part, dict) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise invalid(f"messages[{i}].content[{j}]",
                          f"only text parts are supported (type \"text\" with a \"text\" "
                          f"string), got type {json.dumps(kind)}")
        texts.append(part["text"])
    return "\n".join(texts)


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = _objects(body, "tools")
    for k, t in enumerate(tools or ()):
        fn = t.get("function")
        if t.get("type") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise invalid(f"tools[{k}]", "expected {\"type\": \"function\", \"function\": "
                          "{\"name\", \"description\", \"parameters\"}}")
    return tools


def _tool_choice(body: Mapping[str, Any], tools: list[dict[str, Any]] | None) -> ToolChoice:
    """``tool_choice`` ("auto" by default with tools, else "none"), ``parallel_tool_calls``."""
    parallel = _bool(body, "parallel_tool_calls", True)
    v = body.get("tool_choice")
    if v is None:
        v = "auto" if tools else "none"
    if v in ("auto", "none", "required"):
        choice = ToolChoice(v if tools else "none", parallel=parallel)
    elif isinstance(v, dict) and v.get("type") == "function" \
            and isinstance(v.get("function"), dict) and isinstance(v["function"].get("name"), str):
        choice = ToolChoice("named", v["function"]["name"], parallel)
    else:
        raise invalid("tool_choice", "expected \"auto\", \"none\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if v == "required" and not tools:
        raise invalid("tool_choice", "required needs tools to choose from")
    return choice


def tool_constraint(choice: ToolChoice, tools: Sequence[Mapping[str, Any]] | None,
                    constraint: Constraint | None) -> Constraint | None:
    """The request's constraint given its tool choice: a forced call's schema
    (:meth:`ToolChoice.schema`), else ``constraint``; 400 (``tool_choice``) when both."""
    try:
        schema = choice.schema(tools)
    except ValueError as exc:
        raise invalid("tool_choice", str(exc)) from None
    if schema is None:
        return constraint
    if constraint is not None:
        raise invalid("tool_choice", f"a forced tool call and {constraint.param} both "
                      "constrain the output: give one")
    return Constraint("json_schema", json.dumps(schema), "tool_choice")


def parse_chat(body: Any) -> ChatRequest:
    """A ``/v1/chat/completions`` body; ApiError (400) names the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    common = _generation(body, ("max_tokens", "max_completion_tokens"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "required: a non-empty list of messages")
    parsed = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}]", "expected an object with a role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise invalid(f"messages[{i}].role", "required: a string (system, user, "
                          "assistant, tool, ...)")
        parsed.append({**m, "content": _content(m, i)})
    if _bool(body, "logprobs"):
        common["logprobs"] = True
    chat_template = body.get("chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise invalid("chat_template", "expected a template's name or text")
    tools = _tools(body)
    choice = _tool_choice(body, tools)
    common["constraint"] = tool_constraint(choice, tools, common["constraint"])
    return ChatRequest(**common, messages=parsed, tools=tools, tool_choice=choice,
                       chat_template=chat_template,
                       chat_template_kwargs=_object(body, "chat_template_kwargs") or {},
                       add_generation_prompt=_bool(body, "add_generation_prompt", True),
                       continue_final_message=_bool(body, "continue_final_message"),
                       documents=_objects(body, "documents"))


def parse_completion(body: Any, max_generations: int = MAX_N) -> CompletionRequest:
    """A ``/v1/completions`` body; ApiError (400) names the first bad field, 413 a batch of
    more than ``max_generations`` prompts times ``n`` (counted before any prompt is read)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    common = _generation(body, ("max_tokens",))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _is_int(prompt[0]):
        check_generations(len(prompt), common.get("n") or 1, max_generations)
    prompts = _prompts(prompt)
    lp = _int(body, "logprobs", 0, 5)
    if lp is not None:
        common["logprobs"] = True
    return CompletionRequest(**common, prompts=prompts)


def _ids(v: Any) -> bool:
    """A non-empty list of token ids."""
    return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """``prompt``: text, token ids, or a non-empty list of either; each id in uint32."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif _ids(prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _ids(p)
                                                     for p in prompt):
        prompts = [p if isinstance(p, str) else list(p) for p in prompt]
    else:
        raise invalid("prompt", "required: a string, a list of token ids, or a non-empty "
                      "list of either")
    if any(not 0 <= t < 2**32 for p in prompts if isinstance(p, list) for t in p):
        raise invalid("prompt", "token ids must be in [0, 2**32)")
    return prompts


def check_generations(prompts: int, n: int, limit: int) -> None:
    """413 (param ``prompt``, or ``n`` for one prompt) when ``prompts * n`` exceeds ``limit``
    (the router's --http-max-generations)."""
    if prompts * n > limit:
        what = f"{prompts} prompts x n={n}" if prompts > 1 else f"n={n}"
        raise ApiError(413, f"{what} asks for {prompts * n} generations; this router takes "
                       f"at most {limit} per request (--http-max-generations)",
                       param="prompt" if prompts > 1 else "n")


# -- the internal request ---------------------------------------------------------------------

def generate_request(g: Generation, tokens: Sequence[int], *, model: str, request_id: str,
                     max_tokens: int, stop_token_ids: Sequence[int] = ()
                     ) -> common_pb2.GenerateRequest:
    """The kvroute.v1 GenerateRequest the gRPC ``Generate`` takes for ``g`` with prompt
    ``tokens``: a plain request, or (:attr:`Generation.needs_program`) a controller program
    of one gen step, forked ``n`` ways so that the choices share the prompt's cache on one
    worker. ``max_tokens``: the request's, or the router's default. ``user`` is the session
    id (ties between equally good workers keep a user's requests on one)."""
    top_p, top_k = 1.0 if g.top_p is None else g.top_p, g.top_k or 0
    if top_p == 0:  # only the most likely token: the proto's 0 would mean "unset"
        top_p, top_k = 1.0, 1
    sampling = common_pb2.SamplingParams(
        temperature=1.0 if g.temperature is None else g.temperature, top_p=top_p,
        top_k=top_k, seed=g.seed or 0, stop_token_ids=stop_token_ids)
    req = common_pb2.GenerateRequest(token_ids=tokens, model=model, sampling=sampling,
                                     session_id=g.user, request_id=request_id,
                                     cache_salt=g.cache_salt)
    if not g.needs_program:
        req.sampling.max_tokens = max_tokens
        return req
    gen = program_pb2.Gen(max_tokens=max_tokens, stop=g.stop,
                          capture=STOP_CAPTURE if g.stop else "")
    c = g.constraint
    if c is not None:
        if c.kind == "choices":
            gen.constraint.choices.options.extend(c.value)
        else:
            setattr(gen.constraint, c.kind, c.value)
    step = program_pb2.Step(gen=gen)
    if g.n > 1:
        step = program_pb2.Step(fork=program_pb2.Fork(
            branches=[program_pb2.ControllerProgram(steps=[step])], n=g.n))
    req.program.steps.append(step)
    return req
