"""The rest of a regular constraint once part of its region is generated.

An engine that takes a whole grammar per request (``vllm``: structured outputs) starts each
request's constraint from its beginning. So a gen with ``continue_constraint`` -- resuming a
region that an earlier gen, or a fork's parent, left open -- cannot send the constraint
again: it must send what is left of it. For a ``regex`` or ``choices`` constraint that is
regular too: the Brzozowski derivative of the pattern by the text generated so far, the
language of every ``w`` with ``text + w`` in the original's. :func:`rest_of` computes it
and prints it back as a regex, which the engine then enforces for the rest of the region.
A ``json_schema`` constraint is first written as a regex (``json_regex``: flat schemas
without recursion are regular); a ``lark`` one is context-free and its rest is not written.

The pattern is read with Python's own regex parser, and membership of a character in a
class is decided by Python's regex engine on the class's own text, so ``\\d``, ``\\w``,
``[^...]`` and ``.`` keep their meaning (printed back as they were, the engine reads them
as it reads the original). Refused (:class:`UnsupportedError`): case-insensitive patterns,
back-references, look-arounds, anchors other than a leading ``^`` and a trailing ``$``,
word boundaries, possessive repeats and atomic groups, and anything Python's parser does
not read (``\\p{...}``).

Invariant: every node is normalised by :func:`_seq`, :func:`_alt` and :func:`_rep` (no
nested sequence or alternation, no :data:`_NOTHING` inside one, alternatives without
duplicates), so the derivatives of a pattern by successive characters stay finite in number
and small.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from kvroute.worker_agent.controller.json_regex import schema_regex
from kvroute.worker_agent.controller.unsupported import UnsupportedError


class NotAPrefixError(ValueError):
    """The text generated so far is not the start of anything the constraint accepts."""


@dataclass(frozen=True, slots=True)
class _Nothing:
    """The empty language (no string at all)."""


@dataclass(frozen=True, slots=True)
class _Empty:
    """The empty string alone."""


_NOTHING = _Nothing()
_EMPTY = _Empty()


@dataclass(frozen=True, slots=True)
class _Chars:
    """One character from a class, written ``src`` ("a", "\\.", "[a-z\\d]", "[^x]", ".")."""

    src: str
    _re: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_re", re.compile(self.src))

    def has(self, ch: str) -> bool:
        return self._re.fullmatch(ch) is not None


@dataclass(frozen=True, slots=True)
class _Seq:
    parts: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class _Alt:
    options: tuple[Node, ...]


@dataclass(frozen=True, slots=True)
class _Rep:
    node: Node
    lo: int
    hi: int | None  # None: unbounded


Node = _Nothing | _Empty | _Chars | _Seq | _Alt | _Rep

# Characters with a meaning in a regex, outside and inside a class.
_META = frozenset("\\.^$*+?{}[]|()")
_CLASS_META = frozenset("\\]^-[")
_CONTROL = {"\n": "\\n", "\t": "\\t", "\r": "\\r", "\f": "\\f", "\v": "\\v"}


def _escape(ch: str, meta: frozenset[str]) -> str:
    if ch in _CONTROL:
        return _CONTROL[ch]
    if ch < " " or ch == "\x7f":  # other control characters: written, not sent raw
        return f"\\x{ord(ch):02x}"
    return "\\" + ch if ch in meta else ch


def _seq(*parts: Node) -> Node:
    flat: list[Node] = []
    for p in parts:
        if p is _NOTHING:
            return _NOTHING
        if isinstance(p, _Seq):
            flat.extend(p.parts)
        elif p is not _EMPTY:
            flat.append(p)
    if not flat:
        return _EMPTY
    return flat[0] if len(flat) == 1 else _Seq(tuple(flat))


def _alt(*options: Node) -> Node:
    flat: dict[Node, None] = {}  # ordered, without duplicates
    for o in options:
        for x in (o.options if isinstance(o, _Alt) else (o,)):
            if x is not _NOTHING:
                flat[x] = None
    if not flat:
        return _NOTHING
    return next(iter(flat)) if len(flat) == 1 else _Alt(tuple(flat))


def _rep(node: Node, lo: int, hi: int | None) -> Node:
    if hi == 0 or node is _EMPTY:
        return _EMPTY
    if node is _NOTHING:
        return _EMPTY if lo == 0 else _NOTHING
    if lo == 1 and hi == 1:
        return node
    return _Rep(node, lo, hi)


def _nullable(n: Node) -> bool:
    if isinstance(n, _Empty):
        return True
    if isinstance(n, _Nothing | _Chars):
        return False
    if isinstance(n, _Seq):
        return all(_nullable(p) for p in n.parts)
    if isinstance(n, _Alt):
        return any(_nullable(o) for o in n.options)
    return n.lo == 0 or _nullable(n.node)


def _derive(n: Node, ch: str) -> Node:
    """The strings ``w`` with ``ch + w`` in ``n``'s language."""
    if isinstance(n, _Nothing | _Empty):
        return _NOTHING
    if isinstance(n, _Chars):
        return _EMPTY if n.has(ch) else _NOTHING
    if isinstance(n, _Seq):
        first, rest = n.parts[0], _seq(*n.parts[1:])
        d = _seq(_derive(first, ch), rest)
        return _alt(d, _derive(rest, ch)) if _nullable(first) else d
    if isinstance(n, _Alt):
        return _alt(*(_derive(o, ch) for o in n.options))
    return _seq(_derive(n.node, ch),
                _rep(n.node, max(n.lo - 1, 0), None if n.hi is None else n.hi - 1))


def _show(n: Node, ctx: str = "top") -> str:
    """Regex text for ``n``; ``ctx`` is where it stands: top (or an alternative), inside a
    sequence, or under a quantifier."""
    if isinstance(n, _Empty):
        return "()" if ctx == "rep" else ""
    if isinstance(n, _Nothing):
        raise NotAPrefixError("the empty language has no regex")
    if isinstance(n, _Chars):
        return n.src
    if isinstance(n, _Seq):
        s = "".join(_show(p, "seq") for p in n.parts)
        return f"({s})" if ctx == "rep" else s
    if isinstance(n, _Alt):
        return _show_alt(n, ctx)
    inner = _show(n.node, "rep") + _quantifier(n.lo, n.hi)
    return f"({inner})" if ctx == "rep" else inner


def _show_alt(n: _Alt, ctx: str) -> str:
    others = [o for o in n.options if o is not _EMPTY]
    s = "|".join(_show(o) for o in others)
    if len(others) < len(n.options):  # the empty string is one of them
        s = f"{s}?" if len(others) == 1 and isinstance(others[0], _Chars) else f"({s})?"
        return f"({s})" if ctx == "rep" else s
    return f"({s})" if ctx != "top" else s


def _quantifier(lo: int, hi: int | None) -> str:
    """``{lo,hi}`` in its shortest form (``*``, ``+``, ``?``)."""
    short = {(0, None): "*", (1, None): "+", (0, 1): "?"}.get((lo, hi))
    if short is not None:
        return short
    if hi is None:
        return f"{{{lo},}}"
    return f"{{{lo}}}" if lo == hi else f"{{{lo},{hi}}}"


_CATEGORIES = {
    sre.CATEGORY_DIGIT: "\\d", sre.CATEGORY_NOT_DIGIT: "\\D",
    sre.CATEGORY_SPACE: "\\s", sre.CATEGORY_NOT_SPACE: "\\S",
    sre.CATEGORY_WORD: "\\w", sre.CATEGORY_NOT_WORD: "\\W",
}


def _class(items: list[tuple[Any, Any]]) -> _Chars:
    """A ``[...]`` class from the parser's items."""
    negate, body = False, []
    for op, av in items:
        if op is sre.NEGATE:
            negate = True
        elif op is sre.LITERAL:
            body.append(_escape(chr(av), _CLASS_META))
        elif op is sre.RANGE:
            body.append(_escape(chr(av[0]), _CLASS_META) + "-" + _escape(chr(av[1]), _CLASS_META))
        elif op is sre.CATEGORY and av in _CATEGORIES:
            body.append(_CATEGORIES[av])
        else:
            raise UnsupportedError(f"character class item {op} {av!r}")
    if not negate and len(body) == 1 and body[0] in _CATEGORIES.values():
        return _Chars(body[0])  # \d is read as a class of one category
    return _Chars(("[^" if negate else "[") + "".join(body) + "]")


def _node(sub: Any, dotall: bool) -> Node:
    parts: list[Node] = []
    for op, av in sub:
        if op is sre.LITERAL:
            parts.append(_Chars(_escape(chr(av), _META)))
        elif op is sre.NOT_LITERAL:
            parts.append(_Chars("[^" + _escape(chr(av), _CLASS_META) + "]"))
        elif op is sre.ANY:
            parts.append(_Chars("[\\s\\S]" if dotall else "."))
        elif op is sre.IN:
            parts.append(_class(av))
        elif op is sre.BRANCH:
            parts.append(_alt(*(_node(b, dotall) for b in av[1])))
        elif op is sre.SUBPATTERN:
            _group, add_flags, _del_flags, p = av
            if add_flags & (sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_LOCALE):
                raise UnsupportedError("case-insensitive groups")
            parts.append(_node(p, dotall or bool(add_flags & sre.SRE_FLAG_DOTALL)))
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # lazy or greedy: the same language
            lo, hi, p = av
            parts.append(_rep(_node(p, dotall), lo, None if hi == sre.MAXREPEAT else hi))
        else:
            raise UnsupportedError(_describe(op))
    return _seq(*parts)


def _describe(op: Any) -> str:
    names = {sre.AT: "anchors and word boundaries inside the pattern",
             sre.GROUPREF: "back-references", sre.GROUPREF_EXISTS: "conditional groups",
             sre.ASSERT: "look-arounds", sre.ASSERT_NOT: "look-arounds"}
    for name in ("POSSESSIVE_REPEAT", "ATOMIC_GROUP"):
        if getattr(sre, name, None) is op:
            return "possessive repeats and atomic groups"
    return names.get(op, str(op).lower())


def parse(pattern: str) -> Node:
    """The pattern as this module's nodes (UnsupportedError says what is not handled)."""
    try:
        sub = sre_parse.parse(pattern)
    except re.error as exc:
        raise UnsupportedError(f"Python's regex parser does not read it: {exc}") from None
    flags = sub.state.flags
    if flags & (sre.SRE_FLAG_IGNORECASE | sre.SRE_FLAG_LOCALE):
        raise UnsupportedError("case-insensitive patterns")
    items = list(sub)
    # The whole region must match the pattern: a leading ^ and a trailing $ say nothing more.
    if items and items[0][0] is sre.AT and items[0][1] in (sre.AT_BEGINNING,
                                                           sre.AT_BEGINNING_STRING):
        items = items[1:]
    if items and items[-1][0] is sre.AT and items[-1][1] in (sre.AT_END, sre.AT_END_STRING):
        items = items[:-1]
    return _node(items, bool(flags & sre.SRE_FLAG_DOTALL))


def choices(options: tuple[str, ...] | list[str]) -> Node:
    """A ``choices`` constraint as nodes: one literal string of the options."""
    return _alt(*(_seq(*(_Chars(_escape(c, _META)) for c in o)) for o in options))


def constraint_node(kind: str, source: str | tuple[str, ...], max_len: int,
                    json_flexible: bool = False) -> Node:
    """A ``regex``, ``choices`` or ``json_schema`` constraint as nodes (a schema through
    :func:`~kvroute.worker_agent.controller.json_regex.schema_regex`, refused past
    ``max_len`` characters, with whitespace inside objects and arrays when
    ``json_flexible``); UnsupportedError for ``lark`` and what that refuses."""
    if kind == "regex":
        assert isinstance(source, str)
        return parse(source)
    if kind == "choices":
        return choices(tuple(source))
    if kind == "json_schema":
        assert isinstance(source, str)
        return parse(schema_regex(json.loads(source), max_len, json_flexible))
    raise UnsupportedError(f"a {kind} constraint is context-free: its rest mid-region is "
                           f"not written here (regex, choices and json_schema ones are)")


def rest_of(node: Node, text: str, max_len: int) -> str | None:
    """The regex for what is left of ``node`` after ``text``: None when only the empty
    string is (the region is complete). NotAPrefixError when ``text`` starts nothing ``node``
    accepts; UnsupportedError when the regex would be longer than ``max_len`` characters."""
    for ch in text:
        node = _derive(node, ch)
        if node is _NOTHING:
            raise NotAPrefixError(f"{text!r} does not start anything the constraint accepts")
    if node is _EMPTY:
        return None
    out = _show(node)
    if len(out) > max_len:
        raise UnsupportedError(f"the rest of the constraint is a regex of {len(out)} characters, "
                          f"more than max_grammar_bytes ({max_len})")
    return out
