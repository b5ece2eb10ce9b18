"""The README's commands run as written (those a CPU can run), and its test and torch lines are what CI runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from server_helpers import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)```", README, re.DOTALL)
CLI = [sys.executable, "-c", "from ninfer_rt.cli import main; main()"]


def _block(language: str, containing: str) -> str:
    return next(body for lang, body in BLOCKS if lang == language and containing in body)


def _env() -> dict[str, str]:
    return os.environ | {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_the_readme_is_short_and_links_its_pages() -> None:
    assert len(README.splitlines()) < 150
    for page in ("docs/ARCHITECTURE.md", "docs/performance.md", "docs/findings.md"):
        assert f"({page}" in README
    assert (ROOT / "docs" / "performance.md").is_file() and (ROOT / "docs" / "findings.md").is_file()


def test_the_test_command_and_the_torch_installs_are_the_ones_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = _block("bash", "pytest").strip()
    as_ci_writes_it = test_command.replace("pip install ", "python -m pip install -q ", 1)
    assert ci.rstrip().splitlines()[-1] == as_ci_writes_it
    for install in re.findall(r"`(pip install torch[^`]*)`", README):
        assert f"python -m pip install -q {install[len('pip install '):]}" in ci, install


def test_the_install_and_generate_line_generates_on_the_shipped_model() -> None:
    line = _block("bash", "ninfer-rt generate --prompt").strip()
    args = shlex.split(line.split("&& ninfer-rt ", 1)[1].replace("--max-tokens 64", "--max-tokens 4"))
    result = subprocess.run(CLI + args + ["--device", "cpu"], capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_the_tour_names_only_commands_that_exist() -> None:
    from ninfer_rt.cli import main

    tour = _block("bash", "ninfer-rt kernels list")
    assert set(re.findall(r"^ninfer-rt (\w+)", tour, re.MULTILINE)) <= set(main.commands)


def test_the_python_api_example_runs() -> None:
    code = _block("python", "from ninfer_rt import")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


@pytest.fixture(scope="module")
def served_port() -> Iterator[int]:
    """The README's serve line, on a free port and the CPU, healthy."""
    port = free_port()
    serve = shlex.split(_block("bash", "ninfer-rt serve --model tiny-qwen3-code").strip().rstrip("&"))[1:]
    serve = [str(port) if a == "8000" else a for a in serve] + ["--device", "cpu"]
    server = subprocess.Popen(CLI + serve, env=_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", timeout=120)
        yield port
    finally:
        server.terminate()
        server.wait(timeout=30)


def _client_example_answers(code: str, port: int) -> None:
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_the_openai_client_example_talks_to_the_served_shipped_model(served_port: int) -> None:
    _client_example_answers(_block("python", "from openai import OpenAI"), served_port)


def test_the_anthropic_client_example_talks_to_the_served_shipped_model(served_port: int) -> None:
    pytest.importorskip("anthropic")  # in the [dev] extra, so CI runs it
    _client_example_answers(_block("python", "from anthropic import Anthropic"), served_port)
