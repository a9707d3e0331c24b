"""Tool calls in a model's output: how a request asks for them (:class:`ToolChoice`), how the
model writes them (:class:`ToolFormat`, read from its chat template), and the output split into
text and calls, whole or as it streams (:class:`ToolStream`).

Two ways a generation holds tool calls:

- **parsed** (``tool_choice`` auto): the model writes calls in its own format, and the text
  from the first call on is read as calls. Formats: ``hermes`` (``<tool_call>{"name",
  "arguments"}</tool_call>``, one per call: Qwen2.5, Qwen3, Hermes) and ``llama3_json`` (the
  whole output one ``{"name", "parameters"}`` object, or several joined by ``;``: Llama 3.1
  and 3.2). Output that does not parse stays text, as vLLM's parsers leave it.
- **forced** (``required``/``any``, or one named tool): the output is generated under a JSON
  schema (:meth:`ToolChoice.schema`, kvroute's constrained generation), so it is a call's
  arguments (a named tool) or a list of ``{"name", "parameters"}`` (any tool), as vLLM forces
  them.

A stream sends text as it comes, but holds back what may begin a call (a suffix that could
be the start of ``<tool_call>``, or an output that begins with ``{`` in llama3_json) and
sends the calls once the output has ended.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

ToolMode = Literal["auto", "none", "required", "named"]


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's ``name`` and its ``arguments`` as a JSON object's text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    @property
    def input(self) -> dict[str, Any]:
        """The arguments as an object (Anthropic's ``input``)."""
        value = json.loads(self.arguments)
        assert isinstance(value, dict)
        return value


@dataclass(frozen=True)
class ToolChoice:
    """What a request asks of tools: ``auto`` (the model may call; calls are parsed from its
    output), ``none`` (no call: the output is text), ``required`` (at least one call, forced),
    ``named`` (one call of tool ``name``, forced). ``parallel``: several calls may be made."""

    mode: ToolMode = "auto"
    name: str = ""
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def check(self, tools: Sequence[Mapping[str, Any]] | None) -> None:
        """ValueError when the choice does not fit the request's tools."""
        names = tool_names(tools)
        if self.forced and not names:
            raise ValueError(f"{self.mode} needs tools to choose from")
        if self.mode == "named" and self.name not in names:
            raise ValueError(f"no tool named {json.dumps(self.name)[:60]} in tools "
                             f"({', '.join(names)})")

    def schema(self, tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Any] | None:
        """The JSON schema a forced choice's output is generated under (None unless forced):
        the named tool's parameters, or a list of ``{"name", "parameters"}`` of any tool
        (at most one unless ``parallel``). ``tools`` are OpenAI's ``{"type": "function",
        "function": {...}}``."""
        if not self.forced:
            return None
        self.check(tools)
        params = {t["function"]["name"]: _parameters(t["function"]) for t in tools or ()}
        if self.mode == "named":
            return params[self.name]
        one = [{"type": "object", "properties": {"name": {"const": n}, "parameters": p},
                "required": ["name", "parameters"], "additionalProperties": False}
               for n, p in params.items()]
        return {"type": "array", "minItems": 1, **({} if self.parallel else {"maxItems": 1}),
                "items": one[0] if len(one) == 1 else {"anyOf": one}}


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> list[str]:
    """The names of OpenAI-shaped tools."""
    return [str(t.get("function", {}).get("name")) for t in tools or ()]


def _parameters(fn: Mapping[str, Any]) -> dict[str, Any]:
    p = fn.get("parameters")
    # A tool without a schema (or an empty one) takes any object.
    return p if isinstance(p, dict) and p else {"type": "object"}


# -- formats ------------------------------------------------------------------------------


def _call(obj: Any, args_key: str) -> ToolCall | None:
    """``{"name": str, args_key: object}`` as a call; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes calls. ``opens``: the text a call begins with (held back while a
    stream's text may be its start); ``whole``: calls are the whole output (it begins with
    ``opens``)."""

    name: str
    opens: str
    whole: bool

    def hold_from(self, text: str) -> int:
        """Where the text that may hold calls begins in ``text`` (its length: none)."""
        if self.whole:
            stripped = text.lstrip()
            return 0 if not stripped or stripped.startswith(self.opens) else len(text)
        at = text.find(self.opens)
        if at >= 0:
            return at
        for k in range(min(len(self.opens) - 1, len(text)), 0, -1):
            if self.opens.startswith(text[-k:]):
                return len(text) - k
        return len(text)

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """``text`` (from :meth:`hold_from` on) as calls and any text after them; None when
        it does not parse (it is text)."""
        return _hermes(text) if self.name == "hermes" else _llama3(text)


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)


def _hermes(text: str) -> tuple[str, list[ToolCall]] | None:
    calls, end = [], 0
    for m in _HERMES.finditer(text):
        if text[end:m.start()].strip():
            break  # text between calls: the rest is text
        call = _call(_json(m.group(1)), "arguments")
        if call is None:
            return None
        calls.append(call)
        end = m.end()
    return (text[end:].strip(), calls) if calls else None


def _llama3(text: str) -> tuple[str, list[ToolCall]] | None:
    calls = [_call(_json(part), "parameters") for part in text.strip().split(";")]
    if not calls or any(c is None for c in calls):
        return None
    return "", [c for c in calls if c is not None]


FORMATS = {"hermes": ToolFormat("hermes", "<tool_call>", whole=False),
           "llama3_json": ToolFormat("llama3_json", "{", whole=True)}
"""The formats kvroute reads, by ``--http-tool-parser`` name."""
_MARKS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"))
"""What a chat template writes when it renders calls in a format (``auto``)."""


def tool_format(parser: str, templates: Sequence[str]) -> ToolFormat | None:
    """The format of a model's calls: ``parser`` (``--http-tool-parser``) by name, ``none``
    for none, or (``auto``) the one its chat ``templates`` write; None when none."""
    if parser == "auto":
        for mark, name in _MARKS:
            if any(mark in t for t in templates):
                return FORMATS[name]
        return None
    if parser == "none":
        return None
    return FORMATS[parser]


# -- an output's calls -------------------------------------------------------------------


def _forced(text: str, choice: ToolChoice) -> list[ToolCall] | None:
    value = _json(text)
    if choice.mode == "named":
        return [ToolCall(choice.name, json.dumps(value, ensure_ascii=False))] \
            if isinstance(value, dict) else None
    if not isinstance(value, list):
        return None
    calls = [_call(v, "parameters") for v in value]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


class ToolStream:
    """One choice's output split into text and calls as it comes: :meth:`feed` each new
    piece of text and send what it returns; :meth:`finish` at the end gives the text held
    back that turned out to be text, and the calls."""

    def __init__(self, choice: ToolChoice = ToolChoice("none"),
                 fmt: ToolFormat | None = None) -> None:
        self._choice = choice
        self._fmt = fmt if choice.mode == "auto" else None
        self._text = ""
        self._sent = 0

    def again(self) -> ToolStream:
        """A stream for the same choice's output anew (a generation run again)."""
        return ToolStream(self._choice, self._fmt)

    def feed(self, text: str) -> str:
        self._text += text
        if self._choice.forced:
            return ""
        hold = self._fmt.hold_from(self._text) if self._fmt is not None else len(self._text)
        if hold <= self._sent:
            return ""
        new, self._sent = self._text[self._sent:hold], hold
        return new

    def finish(self) -> tuple[str, list[ToolCall]]:
        held = self._text[self._sent:]
        self._sent = len(self._text)
        if self._choice.forced:
            calls = _forced(held, self._choice)
            return ("", calls) if calls else (held, [])
        if self._fmt is None or not held:
            return held, []
        parsed = self._fmt.parse(held)
        if parsed is None:
            return held, []
        rest, calls = parsed
        if not self._choice.parallel:
            calls = calls[:1]
        return rest, calls


def split(text: str, stream: ToolStream) -> tuple[str, list[ToolCall]]:
    """A whole output's text and calls, read as ``stream`` reads (which it leaves as it
    was)."""
    stream = stream.again()
    head = stream.feed(text)
    rest, calls = stream.finish()
    return head + rest, calls
