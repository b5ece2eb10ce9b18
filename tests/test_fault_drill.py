"""The fault drill (rule 6), end to end on the CPU: `serve --debug-fault-after N` raises the sticky CUDA
error a real out-of-bounds write would, mid-generation, through the numpy executor's op path. The server
dumps the crash context, fails the requests in flight with a 500 naming the file, turns /health
unhealthy and exits non-zero. Without NINFER_ALLOW_FAULT_DRILL=1 the flag is refused in one line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from server_helpers import free_port, wait_healthy
from test_serve_http import MODEL

from ninfer_rt.cuda.fault_drill import ALLOW_ENV, LABEL

SERVE = [sys.executable, "-m", "ninfer_rt.serve"]
FAULT_AFTER = 120  # ops after start-up: a few steps into two concurrent generations


def drill_server(model: Path, port: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*SERVE, "--model", str(model), "--device", "cpu", "--port", str(port), "--served-model-name", MODEL,
         "--kv-capacity", "64", "--max-context", "1024", "--debug-fault-after", str(FAULT_AFTER)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )


def chat(url: str, words: str) -> tuple[int | None, str]:
    """(status, error message); status None when the request came after the server had gone."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 200, "ignore_eos": True}
    try:
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    except httpx.TransportError as exc:
        return None, repr(exc)
    return response.status_code, response.json().get("error", {}).get("message", "")


def test_the_drilled_fault_dumps_the_context_fails_in_flight_requests_naming_it_and_exits_non_zero(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = drill_server(tiny_qwen3, port, {**os.environ, ALLOW_ENV: "1", "NINFER_CRASH_DIR": str(tmp_path)})
    try:
        wait_healthy(url)
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda words: chat(url, words), ["hello there", "another lane"]))
        try:
            health = httpx.get(url + "/health", timeout=5).status_code
        except httpx.TransportError:
            health = None  # already gone: the exit below is the stronger signal
        status = process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    # in flight at the fault: a 500 naming the file; arriving after it (a loaded box) the unhealthy server's
    # 503, or no answer once it has exited
    failed = [message for status, message in replies if status == 500]
    assert failed and all(status in (500, 503, None) for status, _ in replies), replies
    named = {re.search(r"crash context written to (\S+)", message)[1] for message in failed}
    assert named == {str(p) for p in tmp_path.glob("ninfer-crash-*.json")} and len(named) == 1
    doc = json.loads(Path(named.pop()).read_text())
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in doc["error"]
    assert any(op["label"] == LABEL for ops in doc["streams"].values() for op in ops)
    assert health in (503, None)
    assert status != 0


def test_the_drill_is_refused_in_one_line_unless_the_environment_allows_it(tiny_qwen3: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != ALLOW_ENV}
    result = subprocess.run([*SERVE, "--model", str(tiny_qwen3), "--device", "cpu", "--debug-fault-after", "5"],
                            capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert f"--debug-fault-after 5: the fault drill kills the server on purpose; set {ALLOW_ENV}=1" in result.stderr
