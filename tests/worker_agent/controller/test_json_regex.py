"""A JSON schema's regex: every compact instance matches it, everything it matches is an
instance (jsonschema) that the agent's own matcher accepts (llguidance), and its rest after
any prefix of an instance matches what is left of it (``continuation.rest_of``)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import llguidance
import pytest

from kvroute.worker_agent.controller.continuation import (
    NotAPrefixError,
    parse,
    rest_of,
)
from kvroute.worker_agent.controller.json_regex import schema_regex
from kvroute.worker_agent.controller.unsupported import UnsupportedError
from kvroute.worker_agent.controller.vocab import make_vocab

ALPHABET = 'ab é"\\/\n\t\x01{}[],:0-'


def random_schema(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    kinds = ["integer", "number", "boolean", "null", "string", "enum", "const"]
    if depth > 0:
        kinds += ["object", "object", "array", "anyOf", "ref", "types"]
    kind = rng.choice(kinds)
    if kind == "integer" and rng.random() < 0.5:
        lo = rng.choice([-120, -3, 0, 7, 95])
        bounds = {rng.choice(["minimum", "exclusiveMinimum"]): lo,
                  rng.choice(["maximum", "exclusiveMaximum"]): lo + rng.choice([2, 30, 1000])}
        return {"type": "integer", **dict(rng.sample(sorted(bounds.items()), rng.randint(1, 2)))}
    if kind in ("integer", "number", "boolean", "null"):
        return {"type": kind}
    if kind == "string":
        lo = rng.choice([0, 0, 1, 2])
        out: dict[str, Any] = {"type": "string", "description": "a string"}
        if rng.random() < 0.5:
            out["minLength"] = lo
        if rng.random() < 0.5:
            out["maxLength"] = lo + rng.randint(0, 3)
        return out
    if kind == "enum":
        return {"enum": rng.sample(["x", "a.b", "é", 1, 2.5, None, True, [1], {"k": "v"}],
                                   rng.randint(1, 3))}
    if kind == "const":
        return {"const": rng.choice(["c+", 0, False, {"a": [None]}])}
    if kind == "types":
        return {"type": rng.sample(["integer", "boolean", "null", "string"], 2)}
    if kind == "anyOf":
        # (llguidance takes a oneOf only when it can tell its options apart: anyOf here)
        return {"anyOf": [random_schema(rng, depth - 1, defs) for _ in range(rng.randint(1, 3))]}
    if kind == "ref":
        name = f"d{len(defs)}"
        defs[name] = {}  # the name is taken before its schema draws any more
        defs[name] = random_schema(rng, depth - 1, defs)
        return {"$ref": f"#/$defs/{name}"}
    if kind == "array":
        out = {"type": "array", "items": random_schema(rng, depth - 1, defs)}
        lo = rng.randint(0, 2)
        if rng.random() < 0.5:
            out["minItems"] = lo
        if rng.random() < 0.5:
            out["maxItems"] = lo + rng.randint(0, 2)
        return out
    names = rng.sample(["id", "name", "x y", 'q"t', "n"], rng.randint(0, 4))
    props = {n: random_schema(rng, depth - 1, defs) for n in names}
    out = {"type": "object", "properties": props,
           "required": [n for n in names if rng.random() < 0.5]}
    if rng.random() < 0.5:
        out["additionalProperties"] = False
    return out


def instance(rng: random.Random, schema: dict[str, Any], root: dict[str, Any]) -> Any:
    if "$ref" in schema:
        return instance(rng, root["$defs"][schema["$ref"].rsplit("/", 1)[1]], root)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return instance(rng, rng.choice(schema[key]), root)
    kind = schema["type"]
    kind = rng.choice(kind) if isinstance(kind, list) else kind
    if kind == "integer":
        lo = schema.get("minimum", schema.get("exclusiveMinimum", -20000) + 1)
        hi = schema.get("maximum", schema.get("exclusiveMaximum", 20000) - 1)
        return rng.choice([lo, hi, rng.randint(lo, hi), min(max(0, lo), hi)])
    if kind == "number":
        return rng.choice([0, -1.5, 2.25e-7, 3e20, 7])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "string":
        lo = schema.get("minLength", 0)
        hi = schema.get("maxLength", lo + 4)
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))
    if kind == "array":
        lo = schema.get("minItems", 0)
        hi = schema.get("maxItems", lo + 3)
        return [instance(rng, schema["items"], root) for _ in range(rng.randint(lo, hi))]
    return {n: instance(rng, s, root) for n, s in schema["properties"].items()
            if n in schema["required"] or rng.random() < 0.5}


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def written(value: Any, rng: random.Random | None) -> str:
    """``value`` as JSON text: compact, or with random whitespace (``rng``) wherever the
    matcher with flexible whitespace takes it (inside objects and arrays)."""
    if rng is None:
        return compact(value)

    def ws() -> str:
        return "".join(rng.choice(" \t\n\r") for _ in range(rng.choice([0, 0, 1, 2])))
    if isinstance(value, dict):
        items = [f"{compact(k)}{ws()}:{ws()}{written(v, rng)}" for k, v in value.items()]
        return "{" + ws() + f"{ws()},{ws()}".join(items) + ws() + "}"
    if isinstance(value, list):
        return "[" + ws() + f"{ws()},{ws()}".join(written(v, rng) for v in value) + ws() + "]"
    return compact(value)


def local_check(vocab, schema: dict[str, Any], flexible: bool):
    """The agent's own matcher for the schema (``program.py``; with flexible whitespace on
    vLLM, ``grammars.py``): does it accept a whole text?"""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        schema, defaults={"whitespace_flexible": flexible})

    def accepts(text: str) -> bool:
        m = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        return m.consume_tokens(list(text.encode())) and m.is_accepting()
    return accepts


@pytest.mark.parametrize("flexible", [False, True])
def test_instances_match_their_rest_after_every_split_and_matches_are_instances(
        flexible: bool) -> None:
    rng = random.Random(5)
    vocab = make_vocab("byte")
    checked = mutants = 0
    for _ in range(120):
        defs: dict[str, Any] = {}
        schema = random_schema(rng, 3, defs)
        if defs:
            schema = {"anyOf": [schema], "$defs": defs}
        regex = schema_regex(schema, 10**6, flexible)
        node = parse(regex)
        accepts = local_check(vocab, schema, flexible)
        for _ in range(4):
            value = instance(rng, schema, schema)
            text = written(value, rng if flexible else None)
            jsonschema.validate(value, schema)  # the generator's own check
            assert re.fullmatch(regex, text), (schema, text)
            assert accepts(text), (schema, text)
            for k in sorted({0, len(text), *(rng.randint(0, len(text)) for _ in range(3))}):
                rest = rest_of(node, text[:k], 10**6)
                if rest is None:  # nothing but the empty string is left
                    assert k == len(text)
                else:
                    assert re.fullmatch(rest, text[k:]), (schema, text, k, rest)
                checked += 1
            # Whatever the regex takes is an instance both checks accept.
            for _ in range(6):
                i = rng.randrange(len(text) + 1)
                mutant = text[:i] + rng.choice(ALPHABET) + text[i + rng.randint(0, 1):]
                if re.fullmatch(regex, mutant):
                    mutants += 1
                    jsonschema.validate(json.loads(mutant), schema)
                    assert accepts(mutant), (schema, mutant)
    assert checked > 1500 and mutants > 100


def test_an_object_keeps_its_order_and_commas() -> None:
    schema = {"type": "object", "required": ["b"],
              "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"},
                             "c": {"type": "null"}}}
    regex = schema_regex(schema, 999)
    good = ['{"b":true}', '{"a":1,"b":false}', '{"b":true,"c":null}', '{"a":0,"b":true,"c":null}']
    bad = ["{}", '{"a":1}', '{"b":true,"a":1}', '{,"b":true}', '{"b":true,}', '{"b": true}',
           '{"b":true,"d":1}']
    assert all(re.fullmatch(regex, t) for t in good)
    assert not any(re.fullmatch(regex, t) for t in bad)
    # The rest is printed as a regex an engine can take, with the schema's own pieces.
    assert rest_of(parse(regex), '{"a":12', 999) == r'[0-9]*,"b":(true|false)(,"c":null)?\}'
    assert rest_of(parse(schema_regex({"enum": ["blue", "red"]}, 99)), '"b', 99) == 'lue"'
    score = {"type": "integer", "minimum": 1, "maximum": 10}  # a judge's score, say
    assert schema_regex(score, 99) == "(?:[1-9]|10)"
    assert rest_of(parse(schema_regex(score, 99)), "1", 99) == "0?"
    one_of = {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]}
    assert rest_of(parse(schema_regex(one_of, 999)), '"', 999).endswith(')?"')


@pytest.mark.parametrize("schema, why", [
    (True, "not an object schema"),
    ({"type": "object"}, "without properties"),
    ({"type": "object", "properties": {}, "additionalProperties": True}, "must be false"),
    ({"type": "array"}, "without items"),
    ({"type": "array", "items": [{"type": "null"}]}, "only object schemas"),
    ({"type": "string", "pattern": "a+"}, "pattern not supported"),
    ({"type": "number", "minimum": 0}, "bounds on a number"),
    ({"type": "integer", "minimum": 3, "exclusiveMaximum": 3}, "no integer"),
    ({"type": "integer", "maximum": "9"}, "must be a number"),
    ({"allOf": [{"type": "null"}]}, "allOf not supported"),
    ({}, "no type"),
    ({"$ref": "#/$defs/t", "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}}},
     "recursive"),
    ({"$ref": "#/$defs/u", "$defs": {}}, "names no definition"),
    ({"$ref": "other.json"}, "only #/"),
    ({"type": "string", "maxLength": -1}, "non-negative"),
    ({"type": "array", "items": {"type": "null"}, "minItems": 3, "maxItems": 2}, "below"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]},
     "properties it defines"),
    ({"type": "date"}, "not a JSON type"),
])
def test_what_is_refused_says_why(schema: Any, why: str) -> None:
    with pytest.raises(UnsupportedError, match=why):
        schema_regex(schema, 10**6)


def test_a_regex_longer_than_the_limit_is_refused() -> None:
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(8)}}
    assert len(schema_regex(schema, 10**6)) > 500
    with pytest.raises(UnsupportedError, match="max_grammar_bytes"):
        schema_regex(schema, 500)


def test_nested_optional_fields_are_refused_before_their_regex_is_built() -> None:
    # Each level repeats its child in every alternative: 6 levels of 6 optional fields
    # would be a regex of ~10^12 characters, refused as soon as a piece passes the limit.
    schema: dict[str, Any] = {"type": "null"}
    for _ in range(6):
        schema = {"type": "object", "properties": {f"f{i}": schema for i in range(6)}}
    with pytest.raises(UnsupportedError, match="max_grammar_bytes"):
        schema_regex(schema, 65536)


def test_the_best_of_n_example_schema_continues() -> None:
    """examples/best_of_n_json.py's schema (bounded age, enum city, short name) has a regex,
    so its extraction can be forked mid-region on vLLM too."""
    schema = {
        "type": "object", "additionalProperties": False, "required": ["name", "age", "city"],
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "age": {"type": "integer", "minimum": 0, "maximum": 130},
                       "city": {"enum": ["Paris", "Oslo", "Lima"]}}}
    node = parse(schema_regex(schema, 65536))
    rest = rest_of(node, '{"name":"Ada Lovelace","age":13', 65536)
    assert rest == r'0?,"city":"(Paris"|Oslo"|Lima")\}'  # 13 or 130: at most 130
    with pytest.raises(NotAPrefixError):
        rest_of(node, '{"name":"Ada Lovelace","age":131', 65536)
