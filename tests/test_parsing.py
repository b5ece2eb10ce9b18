"""The reasoning / tool-call parser, driven with scripted model output (random tiny models write gibberish)."""

from __future__ import annotations

import json

import pytest

from ninfer_rt.serve.parsed_reply import ParsedDelta, message_fields
from ninfer_rt.serve.parsing import (
    OutputParser,
    forced_call_prefill,
    parse_complete,
    prompt_closes_reasoning,
    prompt_opens_reasoning,
)

THINKING_ANSWER = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
TOOL_ANSWER = (
    "<think>\nI should look it up.\n</think>\n\nLet me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def stream(text: str, chunk: int, **kwargs: bool) -> ParsedDelta:
    """Feeds `text` in pieces of `chunk` characters and merges what comes out."""
    parser = OutputParser(**kwargs)
    merged = ParsedDelta()
    for start in range(0, len(text), chunk):
        merged.extend(parser.feed(text[start : start + chunk]))
    merged.extend(parser.finish())
    return merged


def test_reasoning_is_split_from_content_without_template_newlines() -> None:
    out = parse_complete(THINKING_ANSWER)
    assert out.reasoning == "The user wants 2+2."
    assert out.content == "It is 4."
    assert out.tool_calls == []


def test_plain_text_is_content() -> None:
    out = parse_complete("Just an answer.\nTwo lines.")
    assert (out.reasoning, out.content) == ("", "Just an answer.\nTwo lines.")


def test_output_that_starts_inside_reasoning_when_the_prompt_opened_the_think_block() -> None:
    out = parse_complete("\nthinking hard\n</think>\n\nanswer", in_reasoning=True)
    assert (out.reasoning, out.content) == ("thinking hard", "answer")


def test_tool_calls_are_parsed_with_json_arguments() -> None:
    out = parse_complete(TOOL_ANSWER)
    assert out.reasoning == "I should look it up."
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert len({c.id for c in out.tool_calls}) == 2


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 11, 1000])
def test_streaming_in_any_chunking_gives_the_same_result_as_whole_text(chunk: int) -> None:
    whole = parse_complete(TOOL_ANSWER)
    streamed = stream(TOOL_ANSWER, chunk)
    assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
    assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]


def test_a_marker_split_across_deltas_is_never_leaked_as_text() -> None:
    parser = OutputParser()
    first = parser.feed("Hello <tool_")
    assert first.content == "Hello "
    second = parser.feed('call>{"name": "f", "arguments": {}}</tool_call>')
    assert second.content == "" and [c.name for c in second.tool_calls] == ["f"]


def test_a_tool_call_inside_reasoning_is_reasoning() -> None:
    text = '<think>maybe <tool_call>{"name": "f", "arguments": {}}</tool_call> no</think>done'
    out = parse_complete(text)
    assert out.tool_calls == []
    assert out.reasoning == 'maybe <tool_call>{"name": "f", "arguments": {}}</tool_call> no'
    assert out.content == "done"


@pytest.mark.parametrize(
    "body",
    ['{"name": "f", "argu', "not json at all", '["a list"]', '{"arguments": {}}', '{"name": 3}'],
)
def test_a_tool_call_that_never_opened_comes_back_as_content(body: str) -> None:
    text = f"<tool_call>{body}</tool_call>"
    out = parse_complete(text)
    assert out.tool_calls == []
    assert out.content == text


def test_streamed_arguments_arrive_in_fragments_that_concatenate_to_the_final_arguments() -> None:
    parser = OutputParser()
    pieces = [call for start in range(len(TOOL_ANSWER)) for call in parser.feed(TOOL_ANSWER[start]).tool_calls]
    pieces += parser.finish().tool_calls
    for index, (name, arguments) in enumerate([("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "CET"}')]):
        mine = [p for p in pieces if p.index == index]
        assert (mine[0].name, mine[0].id is not None) == (name, True)
        assert all(p.id is None and p.name is None for p in mine[1:])
        assert len(mine) > 3  # character by character in, fragment by fragment out
        assert "".join(p.arguments for p in mine) == arguments
    assert parser.num_tool_calls == 2


def test_a_call_is_announced_as_soon_as_its_name_is_complete() -> None:
    parser = OutputParser()
    first = parser.feed('<tool_call>\n{"name": "read_file", "arguments":')
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "read_file", "")]
    assert first.tool_calls[0].stream_json() == {
        "index": 0, "id": first.tool_calls[0].id, "type": "function", "function": {"name": "read_file", "arguments": ""}
    }
    second = parser.feed(' {"path": "a.py"')
    assert [c.stream_json() for c in second.tool_calls] == [{"index": 0, "function": {"arguments": '{"path": "a.py"'}}]


def test_an_opened_call_whose_arguments_break_keeps_what_it_got() -> None:
    # The call was already streamed to the client: it stays a call, with the arguments as the model wrote them.
    for text in ['<tool_call>{"name": "f", "arguments": {"a": </tool_call>', '<tool_call>{"name": "f", "arguments": {"a": 1']:
        whole, streamed = parse_complete(text), stream(text, chunk=1)
        assert [(c.name, c.arguments) for c in whole.tool_calls] == [("f", text.split('"arguments": ')[1].split("<")[0].strip())]
        assert [(c.name, c.arguments) for c in streamed.tool_calls] == [(c.name, c.arguments) for c in whole.tool_calls]
        assert whole.content == ""


def test_arguments_are_the_models_text_not_reserialized() -> None:
    # The template writes string arguments back verbatim: the next turn renders the tokens the model wrote.
    out = parse_complete('<tool_call>\n{"name": "f", "arguments": {"a":1,  "b": [2]}}\n</tool_call>')
    assert out.tool_calls[0].arguments == '{"a":1,  "b": [2]}'


def test_a_call_in_another_key_order_is_a_call_at_its_close() -> None:
    out = stream('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', chunk=1)
    assert [(c.index, c.name, c.arguments) for c in out.tool_calls] == [(0, "f", '{"a": 1}')]


def test_a_prefill_is_parsed_as_the_start_of_the_reply() -> None:
    parser = OutputParser.for_prompt("<|im_start|>assistant\n<think>\n", True, prefill='\n</think>\n\n<tool_call>\n{"name": "f", "arguments":')
    out = parser.feed(' {"a": 1}}\n</tool_call>')
    out.extend(parser.finish())
    assert message_fields(out, parser.has_reasoning) == {
        "content": None, "reasoning_content": "",
        "tool_calls": [{"id": out.tool_calls[0].id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }


def test_unterminated_tool_call_comes_back_as_content() -> None:
    out = parse_complete('ok\n<tool_call>\n{"name": "f", "argu')
    assert out.tool_calls == []
    assert out.content == 'ok<tool_call>\n{"name": "f", "argu'


def test_tool_calls_are_not_parsed_when_tools_are_off() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    assert parse_complete(text, parse_tool_calls=False).content == text


def test_string_arguments_are_passed_through() -> None:
    out = parse_complete('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert out.tool_calls[0].arguments == '{"a": 1}'


def test_non_ascii_arguments_stay_readable() -> None:
    out = parse_complete('<tool_call>{"name": "f", "arguments": {"city": "Zürich"}}</tool_call>')
    assert out.tool_calls[0].arguments == '{"city": "Zürich"}'


def test_newlines_inside_text_are_kept_and_trailing_ones_released_at_the_end() -> None:
    out = stream("a\n\nb\n", chunk=1)
    assert out.content == "a\n\nb\n"


def test_unterminated_reasoning_stays_reasoning() -> None:
    out = parse_complete("<think>\nstill thinking when max_tokens hit")
    assert (out.reasoning, out.content) == ("still thinking when max_tokens hit", "")


def test_a_prompt_that_closed_the_think_block_reports_empty_reasoning_not_none() -> None:
    parser = OutputParser.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n", parse_tool_calls=True)
    out = parser.feed("Hello.")
    out.extend(parser.finish())
    assert message_fields(out, parser.has_reasoning) == {"content": "Hello.", "reasoning_content": ""}


def test_a_plain_prompt_without_reasoning_reports_none() -> None:
    parser = OutputParser.for_prompt("<|im_start|>assistant\n", parse_tool_calls=True)
    out = parser.feed("Hello.")
    assert message_fields(out, parser.has_reasoning) == {"content": "Hello.", "reasoning_content": None}


def test_tool_calls_come_back_in_openai_shape_with_null_content() -> None:
    out = parse_complete('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>')
    fields = message_fields(out, has_reasoning=False)
    assert fields["content"] is None
    assert fields["tool_calls"] == [
        {"id": out.tool_calls[0].id, "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


def test_generation_prompt_states() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert prompt_closes_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_closes_reasoning("<|im_start|>assistant\n<think>\n")


def test_a_forced_call_prefill_closes_an_opened_think_block_empty_and_names_a_known_function() -> None:
    # "<think>\n" + this renders "<think>\n\n</think>\n\n", the template's own empty think block
    assert forced_call_prefill("<|im_start|>assistant\n<think>\n", "f") == '\n</think>\n\n<tool_call>\n{"name": "f", "arguments":'
    assert forced_call_prefill("<|im_start|>assistant\n", None) == "<tool_call>"
