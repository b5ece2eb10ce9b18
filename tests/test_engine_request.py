"""Requests and sampling parameters: validation messages, token bookkeeping, stop strings."""

from __future__ import annotations

import pytest

from ninfer_rt.engine.request import FinishReason, Request, RequestState, SamplingParams
from ninfer_rt.engine.stop import StopStringMatcher


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_k": -3}, "top_k must be"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"stop": [""]}, "stop strings must be non-empty"),
        ({"top_logprobs": 2}, "top_logprobs requires logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be in [0, 20]"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"temperature": float("nan")}, "temperature must be >= 0"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        SamplingParams(**kwargs)


def test_a_single_stop_string_becomes_a_tuple() -> None:
    assert SamplingParams(stop="END").stop == ("END",)


def test_empty_prompt_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        Request("r", [], SamplingParams())


def test_a_new_request_waits_with_its_whole_prompt_to_compute() -> None:
    request = Request("r", [1, 2, 3], SamplingParams())
    assert request.state is RequestState.WAITING
    assert request.num_remaining == 3


def test_sampled_tokens_extend_the_sequence_to_compute() -> None:
    request = Request("r", [1, 2, 3], SamplingParams())
    request.num_computed = 3
    request.output_ids.append(9)
    assert request.all_ids == [1, 2, 3, 9]
    assert request.num_remaining == 1


def test_finish_records_the_reason() -> None:
    request = Request("r", [1], SamplingParams())
    request.finish(FinishReason.LENGTH)
    assert request.finished and request.finish_reason is FinishReason.LENGTH


def feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    emitted = ""
    for delta in deltas:
        text, stopped = matcher.feed(delta)
        emitted += text
        if stopped:
            return emitted, True
    return emitted + matcher.flush(), False


def test_stop_string_split_across_deltas_ends_output_exactly_before_it() -> None:
    assert feed_all(StopStringMatcher(["</answer>"]), ["42 is it</an", "swe", "r> trailing"]) == ("42 is it", True)


def test_text_that_only_looks_like_a_stop_start_is_released_later() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("ART") == ("START", False)


def test_held_text_is_flushed_when_the_stream_ends_without_a_stop() -> None:
    assert feed_all(StopStringMatcher(["STOP"]), ["the end ST"]) == ("the end ST", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    assert feed_all(StopStringMatcher(["world", "lo w"]), ["hello world"]) == ("hel", True)
