"""The rest of a regular constraint after a prefix, checked against Python's regex engine:
``text + w`` matches the pattern exactly when ``w`` matches the rest."""

from __future__ import annotations

import random
import re

import pytest

from kvroute.worker_agent.controller.continuation import (
    NotAPrefixError,
    constraint_node,
    parse,
    rest_of,
)
from kvroute.worker_agent.controller.unsupported import UnsupportedError

ALPHABET = "abc01 .+(\n"
ATOMS = ["a", "b", "c", "0", r"\.", r"\+", r"\(", " ", "[a-c]", "[^ab]", r"\d", r"\w", r"\s",
         ".", "[0-9.]", r"[\-+]", "[]a]"]


def random_pattern(rng: random.Random, depth: int = 0) -> str:
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        return rng.choice(ATOMS)
    if roll < 0.6:
        return "".join(random_pattern(rng, depth + 1) for _ in range(rng.randint(2, 3)))
    if roll < 0.75:
        options = "|".join(random_pattern(rng, depth + 1) for _ in range(rng.randint(2, 3)))
        return rng.choice(("(", "(?:")) + options + ")"
    inner = random_pattern(rng, depth + 1)
    if len(inner) > 1 and not re.fullmatch(r"\\.|\[[^]]*\]|\[\][^]]*\]", inner):
        inner = f"({inner})"
    q = rng.choice(("*", "+", "?", "{2}", "{1,3}", "{0,2}", "{2,}", "*?", "+?"))
    return inner + q


def strings(rng: random.Random, pattern: str, n: int) -> list[str]:
    """Random strings, and a few that match (found among many random ones)."""
    out = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 7))) for _ in range(n)]
    compiled = re.compile(pattern)
    out += [s for s in ("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5)))
                        for _ in range(20 * n)) if compiled.fullmatch(s)][:n]
    return out


def test_the_rest_matches_exactly_the_completions() -> None:
    rng = random.Random(11)
    checked = matched = 0
    for _ in range(300):
        pattern = random_pattern(rng)
        compiled = re.compile(pattern)
        node = parse(pattern)
        for s in strings(rng, pattern, 30):
            k = rng.randint(0, len(s))
            text, w = s[:k], s[k:]
            whole = compiled.fullmatch(s) is not None
            try:
                rest = rest_of(node, text, 10**6)
            except NotAPrefixError:
                assert not whole, (pattern, text, w)
                continue
            got = w == "" if rest is None else re.fullmatch(rest, w) is not None
            assert got == whole, (pattern, text, w, rest)
            checked += 1
            matched += whole
    assert checked > 3000 and matched > 300  # both outcomes well represented


def test_what_a_rest_looks_like() -> None:
    number = parse(r"-?(0|[1-9]\d*)(\.\d+)?")
    assert rest_of(number, "-1", 999) == r"\d*(\.\d+)?"
    assert rest_of(number, "-0.", 999) == r"\d+"
    assert rest_of(parse("^(ab|cd)e$"), "c", 999) == "de"
    assert rest_of(parse("(ab|cd)e"), "cde", 999) is None  # complete: nothing left
    assert rest_of(parse("ab(cd)?"), "ab", 999) == "(cd)?"  # complete, or more
    assert rest_of(parse(r"\d{3}-\d{2,4}"), "12", 999) == r"\d-\d{2,4}"
    assert rest_of(constraint_node("choices", ("yes", "yeah", "no"), 999), "ye", 999) == "s|ah"
    assert rest_of(constraint_node("choices", ("a.b", "a*"), 999), "a", 999) == r"\.b|\*"
    # Lazy and greedy repeats accept the same strings.
    assert rest_of(parse("(ab)+?c"), "ab", 999) == "(ab)*c"
    # A long prefix leaves a small rest: derivatives do not pile up.
    assert rest_of(parse("(ab|ba)*c"), "ab" * 500, 999) == "(ab|ba)*c"


def test_text_that_starts_nothing_the_constraint_accepts() -> None:
    with pytest.raises(NotAPrefixError, match="does not start"):
        rest_of(parse("(ab|cd)e"), "ac", 999)
    with pytest.raises(NotAPrefixError):
        rest_of(constraint_node("choices", ("yes", "no"), 999), "yes!", 999)


@pytest.mark.parametrize(("kind", "source", "why"), [
    ("regex", "(?i)abc", "case-insensitive"),
    ("regex", "a(?i:b)", "case-insensitive"),
    ("regex", r"(a)\1", "back-references"),
    ("regex", "a(?=b)", "look-arounds"),
    ("regex", r"a\bb", "anchors and word boundaries"),
    ("regex", "a^b", "anchors and word boundaries"),
    ("regex", "a*+b", "possessive"),
    ("regex", "(?>ab)c", "atomic"),
    ("regex", r"\p{L}+", "Python's regex parser does not read it"),
    ("json_schema", '{"type": "object"}', "without properties"),
    ("lark", 'start: "a"+', "context-free"),
])
def test_what_is_refused_says_why(kind: str, source: str, why: str) -> None:
    with pytest.raises(UnsupportedError, match=why):
        constraint_node(kind, source, 10**6)


def test_a_rest_longer_than_the_limit_is_refused() -> None:
    node = constraint_node("choices", tuple(f"x{i:03d}" for i in range(100)), 10**6)
    assert rest_of(node, "x0", 10**6) is not None
    with pytest.raises(UnsupportedError, match="max_grammar_bytes"):
        rest_of(node, "x", 50)
