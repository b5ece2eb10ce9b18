"""Prefix reuse against the ideal: what a perfect cache skips is each turn's previous prompt (and reply on
the chat route), computed from the replayed requests; a turn recomputing more than new + 64 is named."""

from __future__ import annotations

from ninfer_rt.replay.report import reuse_summary
from ninfer_rt.replay.reuse import turn_reuse
from ninfer_rt.replay.runner import RequestRecord
from ninfer_rt.replay.server import _spec_counts, _state_slots, parse_metrics


def turn(index: int, number: int, prompt: int, cached: int, completion: int = 10, route: str = "chat",
         extends: bool = True, conversation: str = "a") -> RequestRecord:
    return RequestRecord(index, "main", conversation, number, route, False, prompt_tokens=prompt,
                         cached_tokens=cached, completion_tokens=completion, extends_previous=extends and number > 1)


def test_the_ideal_is_the_previous_prompt_and_reply_and_the_rest_is_new() -> None:
    records = [turn(0, 1, 1000, 0), turn(1, 2, 1200, 1000), turn(2, 3, 1300, 1210)]
    reuse = reuse_summary(records)
    assert reuse is not None
    assert reuse["ideal_skipped_tokens"] == 1010 + 1210
    assert reuse["skipped_tokens"] == 1000 + 1210
    assert reuse["skipped_of_ideal"] == round(2210 / 2220, 4)
    assert [(t.new, t.recomputed) for t in turn_reuse(records)] == [(190, 200), (90, 90)]
    assert reuse["over_new_plus_slack"] == 0


def test_the_completion_route_reuses_only_the_previous_prompt() -> None:
    records = [turn(0, 1, 500, 0, route="completions"), turn(1, 2, 600, 448, route="completions")]
    assert [(t.new, t.recomputed) for t in turn_reuse(records)] == [(100, 152)]


def test_a_turn_that_lost_its_prefix_is_over_the_slack_and_named() -> None:
    records = [turn(0, 1, 4000, 0), turn(1, 2, 4100, 64)]
    reuse = reuse_summary(records)
    assert reuse is not None and reuse["over_new_plus_slack"] == 1
    assert reuse["first_over"] == {"index": 1, "new": 90, "recomputed": 4036}


def test_a_reset_or_a_new_system_prompt_has_no_reusable_prefix_and_conversations_stay_apart() -> None:
    records = [turn(0, 1, 800, 0), turn(1, 1, 300, 0, conversation="b"), turn(2, 2, 900, 0, extends=False),
               turn(3, 2, 400, 300, conversation="b")]
    assert [t.index for t in turn_reuse(records)] == [3]


def test_state_slots_snapshots_and_spec_counts_are_read_from_the_metrics_text() -> None:
    text = "\n".join([
        'ninfer_state_slots{state="in_use"} 0.0', 'ninfer_state_slots{state="free"} 4.0',
        'ninfer_state_slots{state="fenced"} 0.0', 'ninfer_state_slots{state="total"} 4.0',
        "ninfer_state_snapshots 3.0", "ninfer_state_snapshot_bytes 3072.0",
        "ninfer_spec_decode_num_drafts_total 10.0", "ninfer_spec_decode_num_draft_tokens_total 30.0",
        "ninfer_spec_decode_num_accepted_tokens_total 15.0",
    ])
    samples = parse_metrics(text)
    states, spec = _state_slots(samples), _spec_counts(samples)
    assert states is not None and states.idle and states.snapshots == 3
    assert spec is not None and spec.as_json()["acceptance"] == 0.5 and spec.as_json()["tokens_per_round"] == 2.5
    held = parse_metrics(text.replace('state="in_use"} 0.0', 'state="in_use"} 1.0'))
    assert not _state_slots(held).idle  # type: ignore[union-attr]
