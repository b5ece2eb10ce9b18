"""The parser on Qwen3.5 / Qwen3.6 output: tool calls in the XML-like body, typed from the tools' schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.parsed_reply import ParsedDelta, message_fields
from ninfer_rt.serve.parsing import OutputParser, forced_call_prefill, parse_complete
from ninfer_rt.serve.tool_call_syntax import JsonToolCalls, tool_call_syntax
from ninfer_rt.serve.tool_calls_xml import XmlToolCalls, typed_value

TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3_6_chat_template.jinja").read_text()
PROPERTIES = {
    "city": {"type": "string"},
    "days": {"type": "integer"},
    "ratio": {"type": "number"},
    "metric": {"type": "boolean"},
    "filters": {"type": "object"},
    "hours": {"type": "array", "items": {"type": "integer"}},
    "limit": {"type": ["integer", "null"]},
}
WEATHER_PARAMETERS = {"type": "object", "properties": PROPERTIES}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
SYNTAX = tool_call_syntax(TEMPLATE, TOOLS)


def call(name: str, **params: str) -> str:
    """A tool call as the template writes it: each value between the newlines of its parameter block."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


WEATHER = call("get_weather", city="Paris", days="3", metric="true", filters='{"wind": [1, 2]}')
TWO_CALLS = (
    "<think>\nTwo lookups are needed.\n</think>\n\nChecking both.\n\n" + WEATHER + "\n" + call("get_time", tz="CET")
)


def stream(text: str, chunk: int, **kwargs: Any) -> ParsedDelta:
    parser = OutputParser(syntax=SYNTAX, **kwargs)
    merged = ParsedDelta()
    for start in range(0, len(text), chunk):
        merged.extend(parser.feed(text[start : start + chunk]))
    merged.extend(parser.finish())
    return merged


def calls_of(out: ParsedDelta) -> list[tuple[str | None, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in out.tool_calls]


def test_the_template_decides_the_syntax(tiny_qwen3: Path) -> None:
    assert isinstance(SYNTAX, XmlToolCalls) and set(SYNTAX.properties) == {"get_weather", "get_time"}
    qwen3_template = Tokenizer(tiny_qwen3).chat_template
    assert qwen3_template is not None and isinstance(tool_call_syntax(qwen3_template, TOOLS), JsonToolCalls)


@pytest.mark.parametrize("chunk", [1, 2, 7, 10_000])
def test_calls_reasoning_and_content_come_out_alike_however_the_text_is_split(chunk: int) -> None:
    out = stream(TWO_CALLS, chunk, in_reasoning=False)
    assert (out.reasoning, out.content) == ("Two lookups are needed.", "Checking both.")
    assert calls_of(out) == [
        ("get_weather", {"city": "Paris", "days": 3, "metric": True, "filters": {"wind": [1, 2]}}),
        ("get_time", {"tz": "CET"}),
    ]
    assert [c.index for c in out.tool_calls] == [0, 1] and len({c.id for c in out.tool_calls}) == 2


def test_content_streams_before_the_call_and_the_call_streams_parameter_by_parameter() -> None:
    parser = OutputParser(syntax=SYNTAX)
    assert parser.feed("Checking.\n\n<tool_call>\n<function=get_wea").content == "Checking."
    named = parser.feed("ther>\n<parameter=city>\nPar")
    assert [(c.index, c.name, c.arguments) for c in named.tool_calls] == [(0, "get_weather", "")]
    assert named.tool_calls[0].id is not None
    assert parser.feed("is\n</parameter>\n<parameter=days>\n").tool_calls[0].arguments == '{"city": "Paris"'
    assert parser.feed("3\n</parameter>\n</function>\n").tool_calls[0].arguments == ', "days": 3'
    closing = parser.feed("</tool_call>")
    closing.extend(parser.finish())
    assert [c.arguments for c in closing.tool_calls] == ["}"] and parser.num_tool_calls == 1


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        ("-2.5e3", {"type": "number"}, -2500.0),
        ("7", {"type": "number"}, 7),
        ("false", {"type": "boolean"}, False),
        ("True", {"type": "boolean"}, True),  # how a template rendering with |string writes True
        ("null", {"type": "null"}, None),
        ("None", {"type": ["integer", "null"]}, None),
        ("12", {"type": ["integer", "null"]}, 12),
        ('{"a": {"b": null}}', {"type": "object"}, {"a": {"b": None}}),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        # a value that is not its type stays the text the model wrote
        ("3.5", {"type": "integer"}, "3.5"),
        ("true", {"type": "integer"}, "true"),
        ("yes", {"type": "boolean"}, "yes"),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("{broken", {"type": "object"}, "{broken"),
        # strings, and parameters without a schema, are kept verbatim
        ("007", {"type": "string"}, "007"),
        ("true", {"type": "string"}, "true"),
        ("  indented\n\nlines  ", {"type": "string"}, "  indented\n\nlines  "),
        ("42", None, "42"),
        ("42", {"enum": ["42"]}, "42"),
    ],
)
def test_values_are_typed_from_the_schema(text: str, schema: dict[str, Any] | None, value: Any) -> None:
    parsed = typed_value(text, schema)
    assert parsed == value and type(parsed) is type(value)


def test_a_multiline_string_value_keeps_everything_but_the_template_newlines() -> None:
    code = "def f():\n    return 1\n"
    out = parse_complete(call("get_weather", city=code), syntax=SYNTAX)
    assert calls_of(out) == [("get_weather", {"city": code})]


def test_a_parameter_of_an_unknown_function_stays_a_string() -> None:
    out = parse_complete(call("search", limit="5"), syntax=SYNTAX)
    assert calls_of(out) == [("search", {"limit": "5"})]


def test_a_call_without_parameters_has_empty_arguments() -> None:
    assert [c.arguments for c in parse_complete(call("get_time"), syntax=SYNTAX).tool_calls] == ["{}"]


def test_a_tool_call_inside_reasoning_is_reasoning() -> None:
    out = parse_complete("I could write " + WEATHER + " here.\n</think>\n\nNo call.", in_reasoning=True, syntax=SYNTAX)
    assert out.tool_calls == [] and WEATHER in out.reasoning and out.content == "No call."


def test_a_body_that_is_not_a_call_comes_back_as_the_text_the_model_wrote() -> None:
    text = "<tool_call>\nget the weather please\n</tool_call>"
    out = parse_complete("Hm.\n" + text, syntax=SYNTAX)
    assert (out.content, out.tool_calls) == ("Hm." + text, [])  # the newline before a marker is template glue


def test_a_json_body_is_still_a_call_under_the_xml_syntax() -> None:
    out = parse_complete('<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>', syntax=SYNTAX)
    assert calls_of(out) == [("get_time", {"tz": "UTC"})]


def test_a_call_cut_off_by_max_tokens_keeps_the_parameters_it_got() -> None:
    out = stream("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", 4)
    assert calls_of(out) == [("get_weather", {"city": "Par"})]
    fields = message_fields(out, has_reasoning=False)
    assert fields["content"] is None and json.loads(fields["tool_calls"][0]["function"]["arguments"]) == {"city": "Par"}


def test_a_forced_function_is_opened_in_the_template_syntax_and_the_model_writes_its_parameters() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    prefill = forced_call_prefill(prompt, "get_weather", SYNTAX)
    assert prefill == "\n</think>\n\n<tool_call>\n<function=get_weather>\n"
    parser = OutputParser.for_prompt(prompt, True, prefill, SYNTAX)
    opened = parser.feed("")
    assert [c.name for c in opened.tool_calls] == ["get_weather"]
    opened.extend(parser.feed("<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>"))
    opened.extend(parser.finish())
    assert calls_of(opened) == [("get_weather", {"days": 5})] and opened.reasoning == ""
