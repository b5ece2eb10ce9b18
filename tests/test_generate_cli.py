"""`ninfer-rt generate`: streams text to stdout and statistics to stderr; command-line mistakes exit 2 with one line."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from ninfer_rt.cli import main
from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.request import SamplingParams

SMALL_ENGINE = ["--kv-capacity", "16", "--max-context", "1024"]


def run(*args: str, stdin: str | None = None):  # noqa: ANN201 -- click's Result
    return CliRunner().invoke(main, ["generate", *args], input=stdin)


def test_generate_streams_the_engines_greedy_text_and_reports_statistics(tiny_qwen3: Path) -> None:
    result = run("--model", str(tiny_qwen3), "--prompt", "def fibonacci(n", "--max-tokens", "10", "--temperature", "0", *SMALL_ENGINE)
    assert result.exit_code == 0, result.output
    engine = Engine.load(tiny_qwen3, EngineConfig(kv_capacity="16", max_context=1024))
    expected = "".join(o.text for o in engine.generate(["def fibonacci(n"], SamplingParams(temperature=0, max_tokens=10)))
    assert result.stdout.startswith(expected)
    assert "TTFT" in result.stderr and "prefill" in result.stderr and "decode" in result.stderr and "cached" in result.stderr


def test_prompt_file_is_read(tiny_qwen3: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick brown fox")
    # greedy: a sampled end-of-text token would end the reply early on the random model
    result = run("--model", str(tiny_qwen3), "--prompt-file", str(prompt), "--max-tokens", "3", "--temperature", "0", *SMALL_ENGINE)
    assert result.exit_code == 0, result.output
    assert "3 generated" in result.stderr


def test_chat_runs_one_reply_per_line_and_reuses_the_conversation_prefix(tiny_qwen3: Path) -> None:
    result = run("--model", str(tiny_qwen3), "--chat", "--max-tokens", "4", "--temperature", "0", *SMALL_ENGINE, stdin="hello\nand then?\n")
    assert result.exit_code == 0, result.output
    stats = [line for line in result.stderr.splitlines() if "TTFT" in line]
    assert len(stats) == 2
    assert "(0 cached)" not in stats[1]


def test_chat_without_prefix_caching_recomputes_every_turn(tiny_qwen3: Path) -> None:
    args = ("--model", str(tiny_qwen3), "--chat", "--max-tokens", "4", "--temperature", "0", *SMALL_ENGINE)
    result = run(*args, "--no-prefix-caching", stdin="hello\nand then?\n")
    assert result.exit_code == 0, result.output
    stats = [line for line in result.stderr.splitlines() if "TTFT" in line]
    assert len(stats) == 2 and all("(0 cached)" in line for line in stats)
    assert result.stdout == run(*args, stdin="hello\nand then?\n").stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/no/such/dir", "--prompt", "x"], "not a model directory"),
        (["--model", "{model}"], "exactly one of --prompt, --prompt-file or --chat"),
        (["--model", "{model}", "--prompt", "x", "--temperature", "hot"], "'--temperature'"),
        (["--model", "{model}", "--prompt", "x", "--top-p", "3"], "'--top-p'"),
        (["--model", "{model}", "--prompt", "x", "--top-p", "0"], "'--top-p'"),
        (["--model", "{model}", "--prompt", "x", "--top-k", "-2"], "'--top-k'"),
        (["--model", "{model}", "--prompt", "x", "--kv-dtype", "fp4"], "'--kv-dtype'"),
        (["--model", "{model}", "--prompt", "x", "--kv-capacity", "lots"], "'auto' or a positive page count"),
        (["--model", "{model}", "--prompt", "x", "--no-such-flag"], "No such option"),
        (["--model", "{model}", "--prompt", "x", "--device", "cuda", "--tensor-parallel", "2"], "needs the NCCL path, which is not built"),
        (["--model", "{model}", "--prompt", "x", "--device", "cpu", "--tensor-parallel", "3"], "4 attention heads do not split evenly"),
    ],
)
def test_command_line_mistakes_exit_2_with_one_line(tiny_qwen3: Path, args: list[str], message: str) -> None:
    result = run(*(a.format(model=tiny_qwen3) for a in args))
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error:") and message in lines[0], result.stderr
