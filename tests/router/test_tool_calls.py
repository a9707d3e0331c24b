"""Tool calls read from a model's output: the formats, a stream that holds back what may
begin a call, forced calls, and the format chosen from a chat template."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvroute.router.tool_calls import FORMATS, ToolChoice, ToolStream, split, tool_format

HERMES, LLAMA = FORMATS["hermes"], FORMATS["llama3_json"]
AUTO = ToolChoice("auto")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "now"}}]
TEMPLATES = Path(__file__).parents[1] / "core" / "data" / "chat_templates"


def call(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_hermes_calls_after_text_are_read_and_the_text_before_kept() -> None:
    text, calls = split("Let me check.\n" + call("get_weather", {"city": "Paris"}) + "\n"
                        + call("now", {}), ToolStream(AUTO, HERMES))
    assert text == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("now", {})]
    assert calls[0].input == {"city": "Paris"} and calls[0].id != calls[1].id


@pytest.mark.parametrize("output", [
    "<tool_call>\n{not json}\n</tool_call>",          # not JSON: text, as vLLM leaves it
    '<tool_call>{"arguments": {}}</tool_call>',       # no name
    '<tool_call>{"name": "now", "arguments": [1]}</tool_call>',  # arguments not an object
    "no calls at all <tool_",                          # a marker's start that never came
])
def test_output_that_does_not_parse_is_text(output: str) -> None:
    assert split(output, ToolStream(AUTO, HERMES)) == (output, [])


def test_an_unclosed_last_call_and_arguments_as_a_string_are_read() -> None:
    out = '<tool_call>{"name": "now", "arguments": "{\\"tz\\": \\"UTC\\"}"}'
    (c,) = split(out, ToolStream(AUTO, HERMES))[1]
    assert c.name == "now" and c.input == {"tz": "UTC"}


def test_llama3_json_is_the_whole_output_with_calls_joined_by_semicolons() -> None:
    out = ' {"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": ' \
          '{"city": "Oslo"}}'
    text, calls = split(out, ToolStream(AUTO, LLAMA))
    assert text == "" and [c.name for c in calls] == ["now", "get_weather"]
    assert split("Sunny. {\"name\": \"now\"}", ToolStream(AUTO, LLAMA))[1] == []


def test_tool_choice_none_and_no_format_read_no_calls() -> None:
    out = call("now", {})
    assert split(out, ToolStream(ToolChoice("none"), HERMES)) == (out, [])
    assert split(out, ToolStream(AUTO, None)) == (out, [])


def test_one_call_at_most_without_parallel_calls() -> None:
    out = call("now", {}) + call("now", {"tz": "UTC"})
    assert len(split(out, ToolStream(ToolChoice("auto", parallel=False), HERMES))[1]) == 1


@given(st.lists(st.integers(0, 40), max_size=8), st.sampled_from([
    "It is " + call("now", {}), "plain text with < and <tool and <tool_cal", call("now", {}),
    "a <tool_call>{broken", "héllo wörld"]))
def test_a_stream_sends_what_the_whole_output_has_however_it_is_cut(cuts: list[int],
                                                                   output: str) -> None:
    stream, sent, at = ToolStream(AUTO, HERMES), "", 0
    for k in sorted(cuts):
        sent += stream.feed(output[at:max(at, k)])
        at = max(at, k)
    sent += stream.feed(output[at:])
    rest, calls = stream.finish()
    whole = split(output, ToolStream(AUTO, HERMES))
    assert (sent + rest, [(c.name, c.arguments) for c in calls]) == \
        (whole[0], [(c.name, c.arguments) for c in whole[1]])


def test_a_stream_holds_back_a_possible_marker_and_everything_after_one() -> None:
    stream = ToolStream(AUTO, HERMES)
    assert stream.feed("Sure <tool") == "Sure "
    assert stream.feed("box> ok ") == "<toolbox> ok "  # not a marker after all
    assert stream.feed("<tool_call>{\"name\": \"now\"") == ""
    assert stream.feed(", \"arguments\": {}}</tool_call>") == ""
    rest, (c,) = stream.finish()
    assert rest == "" and c.name == "now"


def test_forced_calls_are_generated_under_a_schema_and_read_whole() -> None:
    named = ToolChoice("named", "get_weather")
    assert named.schema(TOOLS) == TOOLS[0]["function"]["parameters"]
    stream = ToolStream(named, HERMES)
    assert stream.feed('{"city": "Rome"}') == ""  # held: it is the arguments
    (c,) = stream.finish()[1]
    assert (c.name, c.input) == ("get_weather", {"city": "Rome"})

    required = ToolChoice("required", parallel=False)
    schema = required.schema(TOOLS)
    out = [{"name": "now", "parameters": {}}]
    jsonschema.validate(out, schema)
    with pytest.raises(jsonschema.ValidationError):  # one call at most
        jsonschema.validate(out * 2, schema)
    with pytest.raises(jsonschema.ValidationError):  # a name not in tools
        jsonschema.validate([{"name": "rm", "parameters": {}}], schema)
    assert [c.name for c in split(json.dumps(out), ToolStream(required))[1]] == ["now"]
    # Cut short (max_tokens): no call, the text as it is.
    assert split('{"city": "Ro', ToolStream(named)) == ('{"city": "Ro', [])


def test_a_forced_choice_must_name_a_tool_of_the_request() -> None:
    with pytest.raises(ValueError, match="no tool named \"rm\""):
        ToolChoice("named", "rm").schema(TOOLS)
    with pytest.raises(ValueError, match="needs tools"):
        ToolChoice("required").schema(None)
    assert ToolChoice("auto").schema(TOOLS) is None


@pytest.mark.parametrize("template, expected", [
    ("qwen2.5-instruct.jinja", "hermes"), ("llama3.1-instruct.jinja", "llama3_json"),
    ("mistral-7b-instruct-v0.3.jinja", None)])
def test_auto_reads_the_format_a_chat_template_writes(template: str, expected: str | None
                                                      ) -> None:
    fmt = tool_format("auto", [(TEMPLATES / template).read_text()])
    assert (fmt.name if fmt else None) == expected
    assert tool_format("none", [(TEMPLATES / template).read_text()]) is None
    assert tool_format("hermes", []) is HERMES
