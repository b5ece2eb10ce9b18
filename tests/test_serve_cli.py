"""The serve command as a process: one-line start-up errors with exit status 2, and SIGTERM draining."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, wait_healthy
from test_serve_http import MODEL

from ninfer_rt.shipped import DEFAULT_MODEL_NAME

SERVE = [sys.executable, "-m", "ninfer_rt.serve"]


def run_serve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SERVE, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/no/such/model"], "not a model directory"),
        (["--bogus-flag"], "No such option"),
    ],
)
def test_a_bad_start_up_exits_2_with_one_clear_line(tiny_qwen3: Path, args: list[str], message: str) -> None:
    if args[0] != "--model":
        args = ["--model", str(tiny_qwen3), *args]
    result = run_serve(*args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


@pytest.mark.parametrize("flag", [["--kv-capacity", "lots"], ["--kv-dtype", "fp4"], ["--max-concurrency", "0"]])
def test_a_bad_flag_value_exits_2_with_one_line(tiny_qwen3: Path, flag: list[str]) -> None:
    result = run_serve("--model", str(tiny_qwen3), *flag)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_a_configuration_the_engine_refuses_at_load_is_the_one_line_itself(tiny_qwen3: Path) -> None:
    # refused once the weights are read (no MTP weights); --kv-capacity auto's plan that does not fit the
    # device (MemoryPlanError, tests/test_memory_plan.py) ends the same way on a GPU
    result = run_serve("--model", str(tiny_qwen3), "--device", "cpu", "--port", str(free_port()), "--spec", "mtp")
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last == "Error: --spec mtp: the checkpoint has no MTP weights (no mtp.* tensors); use --spec none"


def test_the_cli_group_has_the_serve_command() -> None:
    console_script = Path(sys.executable).parent / "ninfer-rt"
    result = subprocess.run([str(console_script), "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "--preserve-thinking / --no-preserve-thinking" in result.stdout
    assert "--prefix-caching / --no-prefix-caching" in result.stdout


def test_sigterm_drains_in_flight_streams_then_exits_0(tiny_qwen3: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [*SERVE, "--model", str(tiny_qwen3), "--device", "cpu", "--port", str(port), "--served-model-name", MODEL,
         "--kv-capacity", "64", "--max-context", "1024"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 300,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        received: list[str] = []
        started = threading.Event()

        def consume() -> None:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
                for line in response.iter_lines():
                    started.set()
                    if line.startswith("data:"):
                        received.append(line)

        reader = threading.Thread(target=consume)
        reader.start()
        assert started.wait(30)
        process.send_signal(signal.SIGTERM)
        reader.join(timeout=60)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert received[-1] == "data: [DONE]"
    assert json.loads(received[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 300


def test_without_an_api_key_the_start_up_log_says_the_server_is_open(tiny_qwen3: Path) -> None:
    port = free_port()
    process = subprocess.Popen(
        [*SERVE, "--model", str(tiny_qwen3), "--device", "cpu", "--port", str(port), "--kv-capacity", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
    finally:
        process.send_signal(signal.SIGTERM)
        output = process.communicate(timeout=60)[0]
    assert "no --api-key" in output


def test_serve_defaults_to_the_shipped_model_and_a_taken_port_exits_2_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = run_serve("--device", "cpu", "--port", str(taken.getsockname()[1]))
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()  # no --model needed; the port check came before any loading
    assert "--port" in line and "cannot listen" in line


def test_serve_without_a_model_serves_the_shipped_one() -> None:
    port = free_port()
    process = subprocess.Popen([*SERVE, "--device", "cpu", "--port", str(port), "--log-level", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        [card] = httpx.get(url + "/v1/models").json()["data"]
        assert card["id"] == DEFAULT_MODEL_NAME
        reply = httpx.post(url + "/v1/completions", json={"model": card["id"], "prompt": "def add(a, b):",
                                                          "max_tokens": 4, "temperature": 0}, timeout=60)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0


@pytest.mark.parametrize("command", [SERVE, [sys.executable, "-c", "from ninfer_rt.cli import main; main()", "generate", "--prompt", "hi"]])
def test_device_cuda_without_a_gpu_is_one_line_and_exit_2(command: list[str]) -> None:
    from ninfer_rt.cuda.driver import device_count

    if device_count() > 0:
        pytest.skip("a GPU is visible here")
    result = subprocess.run([*command, "--device", "cuda"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert "--device cuda" in line
