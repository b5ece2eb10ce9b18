"""Acceptance statistics reach generate's stderr stats line and the server's /metrics."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from ninfer_rt.cli import main
from ninfer_rt.engine.output import RequestStats
from ninfer_rt.engine.spec_stats import AcceptanceCounts
from ninfer_rt.serve.metrics import ServerMetrics

SMALL_ENGINE = ["--kv-capacity", "16", "--max-context", "1024", "--device", "cpu"]


def generate(*args: str):  # noqa: ANN201 -- click's Result
    return CliRunner().invoke(main, ["generate", *args, *SMALL_ENGINE])


def test_acceptance_counts_give_mean_length_and_per_position_rates() -> None:
    counts = AcceptanceCounts()
    counts.add(drafted=3, accepted=3)
    counts.add(drafted=3, accepted=1)
    counts.add(drafted=0, accepted=0)  # a step without drafts is no verify step
    assert counts.steps == 2
    assert counts.mean_acceptance_length == 1 + 4 / 2
    assert counts.position_rates == [1.0, 0.5, 0.5]


def test_generate_with_spec_mtp_prints_the_acceptance_on_the_stats_line(tiny_qwen3_mtp: Path) -> None:
    result = generate("--model", str(tiny_qwen3_mtp), "--prompt", "def f", "--max-tokens", "8", "--temperature", "0",
                      "--spec", "mtp", "--draft-tokens", "2", "--lm-head-draft", "64")
    assert result.exit_code == 0, result.output
    assert "acceptance" in result.stderr and "tok/step (per position" in result.stderr


def test_generate_with_spec_mtp_on_a_checkpoint_without_mtp_fails_with_a_clear_message(tiny_qwen3: Path) -> None:
    result = generate("--model", str(tiny_qwen3), "--prompt", "x", "--spec", "mtp")
    assert result.exit_code != 0
    assert "no MTP weights" in result.output


def test_lm_head_draft_without_a_value_takes_the_default_size(tiny_qwen3_mtp: Path) -> None:
    result = generate("--model", str(tiny_qwen3_mtp), "--prompt", "x", "--max-tokens", "2", "--spec", "mtp", "--lm-head-draft")
    assert result.exit_code == 0, result.output


def test_server_metrics_count_drafts_and_accepted_tokens_per_position() -> None:
    metrics = ServerMetrics()
    counts = AcceptanceCounts()
    counts.add(drafted=2, accepted=1)
    counts.add(drafted=2, accepted=2)
    metrics.generation_done(RequestStats(5, 0, 8, 0, 0.1, 1.0, 1.0, acceptance=counts))
    text = metrics.render(None).decode()
    assert "ninfer_spec_decode_num_drafts_total 2.0" in text
    assert "ninfer_spec_decode_num_draft_tokens_total 4.0" in text
    assert "ninfer_spec_decode_num_accepted_tokens_total 3.0" in text
    assert 'ninfer_spec_decode_num_accepted_tokens_per_pos_total{position="1"} 1.0' in text
    assert "ninfer_spec_decode_acceptance_length_count 1.0" in text
