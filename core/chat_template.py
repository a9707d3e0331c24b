"""A model's Jinja chat template, rendered the way ``transformers`` renders it.

``ChatTemplate(text).render(messages, ...)`` equals transformers'
``apply_chat_template(messages, tokenize=False, ...)`` for the same template and special tokens:

- the environment is jinja2's ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and
  ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block that renders
  its body (transformers uses it only to mark assistant tokens);
- the globals are ``raise_exception(message)`` (raises; :class:`ChatTemplateError` carries the
  message), ``strftime_now(format)`` (local time now), ``dict`` and ``namespace`` (which refuses
  names starting with ``_``), and ``tojson`` is ``json.dumps`` with ``ensure_ascii=False`` (no
  HTML escaping, ``indent``/``separators``/``sort_keys`` passed through);
- messages are dicts (keys whose value is None dropped, values rebuilt from plain JSON types),
  content may be a string or a list of content parts (passed to the template as they are),
  ``reasoning_content`` is filled from ``thinking``/``reasoning`` (and ``thinking`` from it);
- the template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the named
  special tokens (``bos_token``, ``eos_token``, ...) and then the caller's template kwargs
  (``chat_template_kwargs``), which win over the special tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

JINJA_INSTALL_HINT = "pip install 'jinja2>=3.1.6'  (or kvroute[models])"

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names a message's reasoning arrives under; templates read the first (gpt-oss's the second)."""


CONTINUE_MARKER = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' marker for where a continued final message ends (the same text, so the cut
falls where transformers' does)."""

RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class ChatTemplateError(ValueError):
    """The template or the conversation is unusable; the message says which and why."""


def _jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as exc:
        raise ChatTemplateError(f"chat templates need jinja2: {JINJA_INSTALL_HINT}") from exc
    version = tuple(int(p) for p in re.findall(r"\d+", jinja2.__version__)[:3])
    if version < (3, 1, 6):
        # Older releases have known sandbox escapes; templates come from model repositories.
        raise ChatTemplateError(
            f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}: {JINJA_INSTALL_HINT}")
    return jinja2


def _environment(jinja2: Any) -> Any:
    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(
                self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: object) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    class TemplateDict:
        """``dict(...)`` for templates without the type itself (no attribute type-hackery)."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja2's ``namespace`` refusing ``_``-prefixed names (no reach into internals)."""

        def __init__(*args: Any, **kwargs: Any) -> None:  # jinja's signature trick
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace.check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check_name(name: object) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore-prefixed namespace attributes: {name!r}")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def plain_data(value: Any) -> Any:
    """``value`` rebuilt from plain JSON types (str, int, float, bool, None, dict, list, tuple);
    anything else becomes the placeholder ``"<TypeName>"``, as transformers does, so the sandboxed
    template never holds an object with methods of its own."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_data(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain_data(v) for v in value)
    return f"<{type(value).__name__}>"


def normalize_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """The conversation as the template sees it. ChatTemplateError for an empty conversation or a
    message that is not a dict; keys whose value is None are dropped (OpenAI clients send
    ``content: null`` beside ``tool_calls``, which many templates would print as "None"); an
    assistant's tool calls get their ``arguments`` as an object, as vLLM hands them to the
    template (OpenAI clients send a JSON string; empty: ``{}``)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(
            f"messages must be a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("messages is empty: a conversation needs at least one message")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"messages[{i}] must be an object with a role and content, got {message!r}")
        message = plain_data({k: v for k, v in message.items() if v is not None})
        if message.get("role") == "assistant" and isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = _tool_calls(message["tool_calls"], i)
            if not message["tool_calls"]:
                del message["tool_calls"]  # the template's plain assistant path
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def _tool_calls(calls: list[Any], i: int) -> list[Any]:
    out = []
    for k, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict):
            args = fn.get("arguments")
            if not args:
                args = {}
            elif isinstance(args, str):
                try:
                    args = json.loads(args)
                except ValueError:
                    raise ChatTemplateError(
                        f"messages[{i}].tool_calls[{k}].function.arguments is not JSON: "
                        f"{args[:60]!r}") from None
            call = {**call, "function": {**fn, "arguments": args}}
        out.append(call)
    return out


class ChatTemplate:
    """One compiled chat template. ``special_tokens`` are the named special tokens (``bos_token``
    -> ``"<s>"``, ...) every render sees; ``name`` labels errors (the model's name)."""

    def __init__(self, text: str, special_tokens: Mapping[str, str] | None = None,
                 name: str = "model") -> None:
        if not isinstance(text, str) or not text.strip():
            raise ChatTemplateError(f"{name}: the chat template is empty")
        jinja2 = _jinja()
        self._jinja = jinja2
        self.text = text
        self.name = name
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment(jinja2).from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"{name}: chat template syntax error at line {exc.lineno}: {exc.message}") from exc

    def render(self, messages: Sequence[Any], tools: Sequence[Any] | None = None,
               documents: Sequence[Any] | None = None, add_generation_prompt: bool = True,
               continue_final_message: bool = False,
               chat_template_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> str:
        """The prompt text. Template variables come from ``chat_template_kwargs`` (a request's
        field, as a mapping) and ``kwargs``; ChatTemplateError for bad messages/tools/documents,
        a variable that would shadow a request field, and any error the template raises
        (``raise_exception``'s message is the error's message).

        ``continue_final_message`` leaves the last message open (no end-of-turn after its
        content) so the model continues it, cutting the text where transformers cuts it: at a
        marker appended to the message's content (to its last text part for a list)."""
        chat_template_kwargs = {**(chat_template_kwargs or {}), **kwargs}
        chat = normalize_messages(messages)
        if tools is not None:
            if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
                raise ChatTemplateError(
                    f"tools must be a list of tool objects, got {type(tools).__name__}")
            for i, tool in enumerate(tools):
                if not isinstance(tool, Mapping):
                    raise ChatTemplateError(f"tools[{i}] must be an object (a JSON schema), "
                                            f"got {type(tool).__name__}")
        if documents is not None:
            for i, doc in enumerate(documents):
                if not isinstance(doc, Mapping):
                    raise ChatTemplateError(
                        f"documents[{i}] must be an object with 'title' and 'text'")
        reserved = sorted(RESERVED_VARIABLES & chat_template_kwargs.keys())
        if reserved:
            raise ChatTemplateError(
                f"chat_template_kwargs cannot set {', '.join(reserved)} (they are request fields)")
        final = self._mark_final(chat, add_generation_prompt) if continue_final_message else None
        variables = {**self.special_tokens, **plain_data(dict(chat_template_kwargs))}
        try:
            text = str(self._template.render(
                messages=chat, tools=plain_data(tools), documents=plain_data(documents),
                add_generation_prompt=add_generation_prompt, **variables))
        except self._jinja.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"{self.name}: chat template: {exc.message or exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            raise ChatTemplateError(
                f"{self.name}: chat template failed on these messages: "
                f"{type(exc).__name__}: {exc}") from exc
        return text if final is None else self._cut_final(text, final)

    def _mark_final(self, chat: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        """Appends the marker to the last message's content; returns that content."""
        if add_generation_prompt:
            raise ChatTemplateError("continue_final_message and add_generation_prompt exclude "
                                    "each other: continue the last message or open a new one")
        content = chat[-1].get("content")
        if content is None:
            raise ChatTemplateError("continue_final_message: the last message has no content")
        if "content" not in self.text:
            raise ChatTemplateError(
                f"{self.name}: continue_final_message: the chat template reads no content")
        if isinstance(content, (list, tuple)):
            for part in reversed(content):
                if isinstance(part, dict) and "text" in part:
                    final = str(part["text"])
                    part["text"] = final + CONTINUE_MARKER
                    return final
            raise ChatTemplateError(
                "continue_final_message: the last message has no text part to continue")
        final = str(content)
        chat[-1]["content"] = final + CONTINUE_MARKER
        return final

    def _cut_final(self, text: str, final: str) -> str:
        marker = CONTINUE_MARKER.strip()
        if final.strip() not in text or marker not in text:
            raise ChatTemplateError(
                f"{self.name}: continue_final_message: the chat template does not render the "
                "last message's content as it is, so it cannot be continued")
        at = text.rindex(marker)
        if text[at:at + len(CONTINUE_MARKER)] == CONTINUE_MARKER:
            return text[:at]
        return text[:at].rstrip()  # the template trimmed the content's trailing space
