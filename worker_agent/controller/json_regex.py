"""A JSON schema as the regex of the JSON texts the agent's matcher accepts for it.

A ``json_schema`` constraint is context-free in general, so a region continued on an engine
that takes a whole grammar per request (``continuation``) has no regex for its rest. But the
schemas programs use are mostly flat records: objects of named fields, enums, arrays of
those. Without recursion such a schema is regular, and :func:`schema_regex` writes it as a
regex whose language is a subset of what the agent's own matcher accepts for the schema
(llguidance: ``program.py``, with ``whitespace_flexible`` on for vLLM, ``grammars.py``):
``,`` and ``:`` as separators (with whitespace around them and inside brackets where the
matcher is flexible, none elsewhere), properties in the schema's order, none but the
schema's (llguidance lets others follow them), ``\\u`` escapes only for control characters
as it does. So what the engine generates under the rest is accepted by the local check too;
a region whose text so far left that subset (an extra property, say) is refused when
continued (``continuation.NotAPrefixError``).

Read: ``type`` (one or a list), ``enum``, ``const``, ``properties``, ``required``,
``additionalProperties: false``, ``items`` (one schema), ``minItems``, ``maxItems``,
``minLength``, ``maxLength``, ``minimum`` / ``maximum`` and their exclusive forms on an
``integer`` (exact digit ranges), ``anyOf`` / ``oneOf`` (as alternatives: the matcher
checks a ``oneOf`` as an ``anyOf`` too), ``$ref`` into ``$defs`` / ``definitions``, and
the annotations (``title``, ``description``, ``default``, ``examples``, ``$schema``).
Anything else (a recursive ``$ref``, ``pattern``, ``format``, bounds on a ``number``,
``allOf``, an object without ``properties``, ``items`` as a list, ``true`` as a schema,
...) raises ``unsupported.UnsupportedError`` naming it, as does a regex longer than
``max_len``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from kvroute.worker_agent.controller.unsupported import UnsupportedError

# The JSON text pieces (RFC 8259), compact. A string's characters: anything but a quote, a
# backslash, a control character or DEL, or an escape the matcher takes (not ``\\/``, and
# ``\\u`` only for a control character).
_STRING_CHAR = r'(?:[^"\\\x00-\x1f\x7f]|\\["\\bfnrt]|\\u00[01][0-9a-fA-F])'
_INTEGER = r"-?(?:0|[1-9][0-9]*)"
_NUMBER = _INTEGER + r"(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
# With flexible whitespace, between the tokens inside an object or array (never around the
# whole value).
_WHITESPACE = "[ \\t\\n\\r]*"
_SCALARS = {"integer": _INTEGER, "number": _NUMBER, "boolean": "(?:true|false)",
            "null": "null"}
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                          "$comment", "$defs", "definitions", "deprecated", "readOnly",
                          "writeOnly"})
_READ = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties",
                   "items", "minItems", "maxItems", "minLength", "maxLength", "anyOf",
                   "oneOf", "$ref", "minimum", "maximum", "exclusiveMinimum",
                   "exclusiveMaximum"})
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def literal(value: Any, ws: str = "") -> str:
    """The regex of one JSON value's text (an ``enum`` option, a ``const``): compact, with
    ``ws`` (a whitespace regex) inside its objects and arrays."""
    if ws and isinstance(value, dict):
        items = [f"{literal(k)}{ws}:{ws}{literal(v, ws)}" for k, v in value.items()]
        return r"\{" + ws + f"{ws},{ws}".join(items) + ws + r"\}"
    if ws and isinstance(value, list):
        return r"\[" + ws + f"{ws},{ws}".join(literal(v, ws) for v in value) + ws + r"\]"
    return re.escape(json.dumps(value, separators=(",", ":"), ensure_ascii=False))


def _group(alternatives: list[str]) -> str:
    return alternatives[0] if len(alternatives) == 1 else "(?:" + "|".join(alternatives) + ")"


def _count(schema: Mapping[str, Any], lo_key: str, hi_key: str, where: str
           ) -> tuple[int, int | None]:
    lo, hi = schema.get(lo_key, 0), schema.get(hi_key)
    for key, v in ((lo_key, lo), (hi_key, hi)):
        if v is not None and (type(v) is not int or v < 0):
            raise UnsupportedError(f"{where}.{key} must be a non-negative integer, got {v!r}")
    if hi is not None and hi < lo:
        raise UnsupportedError(f"{where}: {hi_key} {hi} is below {lo_key} {lo}")
    return lo, hi


def _same_length(a: str, b: str) -> list[str]:
    """Regexes of the digit strings from ``a`` to ``b`` (as long as each other)."""
    if not a:
        return [""]
    if a[0] == b[0]:
        return [a[0] + r for r in _same_length(a[1:], b[1:])]
    n = len(a) - 1
    if a[1:] == "0" * n and b[1:] == "9" * n:  # every digit string between: one class
        return [f"[{a[0]}-{b[0]}]" + "[0-9]" * n]
    out = [a[0] + r for r in _same_length(a[1:], "9" * n)]
    if int(b[0]) - int(a[0]) > 1:
        out.append(f"[{int(a[0]) + 1}-{int(b[0]) - 1}]" + "[0-9]" * n)
    return out + [b[0] + r for r in _same_length("0" * n, b[1:])]


def _naturals(lo: int, hi: int | None) -> list[str]:
    """Regexes of the decimal numbers from ``lo`` >= 0 to ``hi`` (None: no end), without
    leading zeros, one per length: ``[1-9][0-9]{n,}`` past the last bounded one."""
    out: list[str] = []
    length = len(str(lo))
    while hi is None or length <= len(str(hi)):
        first = lo if length == len(str(lo)) else 10 ** (length - 1)
        if hi is None and first == 10 ** (length - 1) and length > 1:
            return [*out, f"[1-9][0-9]{{{length - 1},}}"]
        last = hi if hi is not None and length == len(str(hi)) else 10 ** length - 1
        out += _same_length(str(first), str(last))
        length += 1
    return out


def _integers(schema: Mapping[str, Any], where: str) -> str:
    """The integers within the schema's bounds (none: every integer, ``-0`` too, as the
    matcher takes it); bounds as the matcher reads them, ``-0`` left out of a bounded range."""
    lo, hi = _integer_bounds(schema, where)
    if lo is None and hi is None:
        return _INTEGER
    if lo is not None and hi is not None and hi < lo:
        raise UnsupportedError(f"{where}: no integer lies within its bounds")
    out: list[str] = []
    if lo is None or lo < 0:  # the negative part, -1 down to lo: "-" and 1 .. -lo
        neg_hi = -1 if hi is None or hi >= 0 else hi
        out += ["-" + r for r in _naturals(-neg_hi, None if lo is None else -lo)]
    if hi is None or hi >= 0:
        out += _naturals(max(lo or 0, 0), hi)
    return _group(out)


def _integer_bounds(schema: Mapping[str, Any], where: str) -> tuple[int | None, int | None]:
    """The least and greatest integer the schema's (exclusive) minimum and maximum allow."""
    lo: int | None = None
    hi: int | None = None
    for key in _BOUNDS:
        if key not in schema:
            continue
        v = schema[key]
        if type(v) not in (int, float) or v != v or v in (math.inf, -math.inf):
            raise UnsupportedError(f"{where}.{key} must be a number, got {v!r}")
        if key in ("minimum", "exclusiveMinimum"):
            b = math.ceil(v) if key == "minimum" else math.floor(v) + 1
            lo = b if lo is None else max(lo, b)
        else:
            b = math.floor(v) if key == "maximum" else math.ceil(v) - 1
            hi = b if hi is None else min(hi, b)
    return lo, hi


def _repeat(unit: str, lo: int, hi: int | None) -> str:
    if (lo, hi) == (0, None):
        return f"(?:{unit})*"
    if hi is None:
        return f"(?:{unit}){{{lo},}}"
    return f"(?:{unit}){{{lo},{hi}}}" if lo != hi else f"(?:{unit}){{{lo}}}"


class _Writer:
    """One schema's regex: ``root`` holds the definitions ``$ref`` names, ``active`` the refs
    being expanded (a ref met again inside itself is recursion, which no regex has). Every
    piece is checked against ``max_len`` as it is written: nested optional fields multiply
    a regex's length, and a short schema must not build a huge one before it is refused."""

    def __init__(self, root: Mapping[str, Any], max_len: int, flexible: bool) -> None:
        self.root = root
        self.max_len = max_len
        self.ws = _WHITESPACE if flexible else ""
        self.active: list[str] = []

    def value(self, schema: Any, where: str) -> str:
        out = self._value(schema, where)
        if len(out) > self.max_len:
            raise UnsupportedError(f"the schema's regex has {len(out)} characters or more, "
                                   f"more than max_grammar_bytes ({self.max_len})")
        return out

    def _value(self, schema: Any, where: str) -> str:
        if schema is False:
            raise UnsupportedError(f"{where} is false: no value is allowed")
        if not isinstance(schema, Mapping):
            raise UnsupportedError(f"{where} is {schema!r}: only object schemas are read "
                                   f"(true, any JSON value, has no regex)")
        unknown = sorted(set(schema) - _READ - _ANNOTATIONS)
        if unknown:
            raise UnsupportedError(f"{where}: {', '.join(unknown)} not supported")
        if "$ref" in schema:
            return self.ref(schema, where)
        if "const" in schema:
            return literal(schema["const"], self.ws)
        if "enum" in schema:
            options = schema["enum"]
            if not isinstance(options, list) or not options:
                raise UnsupportedError(f"{where}.enum must be a non-empty list")
            return _group([literal(v, self.ws) for v in options])
        for key in ("anyOf", "oneOf"):
            if key in schema:
                subs = schema[key]
                if not isinstance(subs, list) or not subs:
                    raise UnsupportedError(f"{where}.{key} must be a non-empty list")
                return _group([self.value(s, f"{where}.{key}[{i}]")
                               for i, s in enumerate(subs)])
        kinds = schema.get("type")
        if kinds is None:
            raise UnsupportedError(f"{where} has no type, enum, const, anyOf or $ref "
                                   f"(any JSON value has no regex)")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        return _group([self.typed(schema, k, where) for k in kinds])

    def typed(self, schema: Mapping[str, Any], kind: Any, where: str) -> str:
        if kind == "integer":
            return _integers(schema, where)
        if kind == "number" and any(key in schema for key in _BOUNDS):
            raise UnsupportedError(f"{where}: bounds on a number are not supported (on an "
                                   f"integer they are)")  # (other types ignore them)
        if kind in _SCALARS:
            return _SCALARS[kind]
        if kind == "string":
            lo, hi = _count(schema, "minLength", "maxLength", where)
            return '"' + _repeat(_STRING_CHAR, lo, hi) + '"'
        if kind == "array":
            items = schema.get("items")
            if items is None:
                raise UnsupportedError(f"{where}: an array without items (any JSON values)")
            item = self.value(items, f"{where}.items")
            lo, hi = _count(schema, "minItems", "maxItems", where)
            w = self.ws
            if hi == 0:
                return r"\[" + w + r"\]"
            rest = _repeat(f"{w},{w}{item}", max(lo - 1, 0), None if hi is None else hi - 1)
            body = item + rest
            return r"\[" + w + (body if lo > 0 else f"(?:{body})?") + w + r"\]"
        if kind == "object":
            return self.record(schema, where)
        raise UnsupportedError(f"{where}.type {kind!r} is not a JSON type")

    def record(self, schema: Mapping[str, Any], where: str) -> str:
        props = schema.get("properties")
        if not isinstance(props, Mapping):
            raise UnsupportedError(f"{where}: an object without properties (any keys)")
        if schema.get("additionalProperties", False) is not False:
            raise UnsupportedError(f"{where}.additionalProperties must be false or absent")
        required = schema.get("required", [])
        if not isinstance(required, list) or not set(required) <= set(props):
            raise UnsupportedError(f"{where}.required must list properties it defines")
        w = self.ws
        fields = [(f"{literal(name)}{w}:{w}" + self.value(sub, f"{where}.properties.{name}"),
                   name in required) for name, sub in props.items()]
        # The first field present carries no comma, each later one does: so one alternative
        # per field that may come first (every field before it optional).
        firsts: list[str] = []
        for i, (text, needed) in enumerate(fields):
            tail = "".join(f"(?:{w},{w}{t})" if req else f"(?:{w},{w}{t})?"
                           for t, req in fields[i + 1:])
            firsts.append(text + tail)
            if needed:
                break
        if not firsts:
            body = ""
        elif not any(req for _, req in fields):  # the empty object too
            body = "(?:" + "|".join(firsts) + ")?"
        else:
            body = _group(firsts)
        return r"\{" + w + body + w + r"\}"

    def ref(self, schema: Mapping[str, Any], where: str) -> str:
        target = schema["$ref"]
        m = re.fullmatch(r"#/(\$defs|definitions)/([^/]+)", target) \
            if isinstance(target, str) else None
        if m is None:
            raise UnsupportedError(f"{where}.$ref {target!r}: only #/$defs/NAME and "
                                   f"#/definitions/NAME are read")
        if target in self.active:
            raise UnsupportedError(f"{where}.$ref {target!r} is recursive (no regex has it)")
        defs = self.root.get(m.group(1))
        if not isinstance(defs, Mapping) or m.group(2) not in defs:
            raise UnsupportedError(f"{where}.$ref {target!r} names no definition")
        if len(schema) > 1 and set(schema) - _ANNOTATIONS - {"$ref"}:
            raise UnsupportedError(f"{where}: $ref beside other keywords is not supported")
        self.active.append(target)
        try:
            return self.value(defs[m.group(2)], target)
        finally:
            self.active.pop()


def schema_regex(schema: Any, max_len: int, flexible: bool = False) -> str:
    """The regex of ``schema``'s compact instances (see the module docstring), or with
    ``flexible`` of its instances with whitespace inside objects and arrays, as the matcher
    takes them with ``whitespace_flexible`` on (the agent's check on vLLM, whose guidance
    backend lets a model write it). UnsupportedError names what it cannot write, or says
    it is longer than ``max_len``."""
    if not isinstance(schema, Mapping):
        raise UnsupportedError(f"the schema is {schema!r}, not an object schema")
    return _Writer(schema, max_len, flexible).value(schema, "schema")
