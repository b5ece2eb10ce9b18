"""Request intake: the body size limit (413, enforced while the body streams in) and the event loop kept
free while big requests are decoded, templated and tokenized in the intake workers."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_helpers import free_port, wait_healthy
from test_serve_errors import GOOD, assert_error, assert_still_serving
from test_serve_http import MAX_CONTEXT, MODEL, Server, running_server

from ninfer_rt.serve.intake import default_max_body_bytes, spool_dir

LIMIT = 4096


@pytest.fixture(scope="module")
def server(tiny_qwen3: Path) -> Iterator[Server]:
    with running_server(tiny_qwen3, max_body_bytes=LIMIT) as running:
        yield running


def test_the_default_limit_grows_with_the_context() -> None:
    assert default_max_body_bytes(32768) == 16 * 32768 + 2**20
    assert default_max_body_bytes(131072) > default_max_body_bytes(32768)


def test_a_body_announced_over_the_limit_is_a_413(server: Server) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"x" * LIMIT + b'"}'
    response = server.post("/v1/completions", big)
    assert_error(response, 413, str(LIMIT), "--max-body-bytes")
    assert response.json()["error"]["code"] == "request_too_large"
    assert_still_serving(server)


def spooled_bodies() -> set[Path]:
    return set(spool_dir().glob("ninfer-body-*"))


def test_a_taken_in_body_leaves_no_spool_file_behind(server: Server) -> None:
    before = spooled_bodies()
    assert server.post("/v1/chat/completions", GOOD).status_code == 200
    assert server.post("/v1/completions", b'{"model": "tiny", "prompt": 12}').status_code == 400
    assert spooled_bodies() <= before


def test_a_chunked_body_is_refused_once_it_passes_the_limit_not_after_it_ends(server: Server) -> None:
    # No Content-Length, and the body never ends: only a server counting as it reads can answer.
    before = spooled_bodies()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 2048
        for _ in range(3):
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        reply = b""
        while b"}" not in reply:  # the status line and headers, then the JSON body
            reply += sock.recv(65536) or b"}"
    assert reply.startswith(b"HTTP/1.1 413")
    assert b"request_too_large" in reply
    assert spooled_bodies() <= before  # the part that was read is not left behind
    assert_still_serving(server)


def test_anthropic_routes_get_anthropic_shaped_413s(server: Server) -> None:
    response = server.post("/v1/messages", b"{" + b" " * LIMIT + b"}")
    assert response.status_code == 413
    assert response.json() == {
        "type": "error", "error": {"type": "request_too_large", "message": response.json()["error"]["message"]}
    }


# -- the event loop stays responsive -------------------------------------------------------------------

P99_BUDGET_S = 0.050
HEALTH_PROBE = Path(__file__).with_name("health_probe.py")


def test_health_keeps_its_latency_while_huge_requests_are_taken_in(tiny_qwen3: Path) -> None:
    # The server and the prober run in processes of their own, as in production: neither this process's
    # threads (sending the bodies) nor its garbage collector can stand between a probe and its answer.
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ninfer_rt.serve", "--model", str(tiny_qwen3), "--device", "cpu", "--port", str(port),
         "--served-model-name", MODEL, "--kv-capacity", "64", "--max-context", str(MAX_CONTEXT),
         "--max-body-bytes", str(64 * 2**20), "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        # 25 MB of prompt token ids (decoded and validated in a worker), and a 100k-token text to tokenize
        ids = b", ".join(b"%d" % (i % 200 + 1) for i in range(25 * 10**6 // 4))
        huge = b'{"model": "tiny", "max_tokens": 1, "prompt": [' + ids + b"]}"
        long_text = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "' + b"word " * 100_000 + b'"}]}'
        assert len(huge) > 25 * 10**6
        latencies, statuses = _probe_while(url, [huge, long_text])
    finally:
        process.terminate()
        process.wait(timeout=60)
    p99 = statistics.quantiles(latencies, n=100, method="inclusive")[98]
    print(f"/health over {len(latencies)} probes: median {statistics.median(latencies) * 1000:.1f} ms, "
          f"p99 {p99 * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
    assert statuses == [400, 400]  # both longer than the context: refused once taken in
    assert p99 < P99_BUDGET_S


def _probe_while(url: str, bodies: list[bytes]) -> tuple[list[float], list[int]]:
    """/health latencies, probed (tests/health_probe.py) from before the bodies are sent until a second
    after both were answered; and the bodies' statuses."""
    statuses: list[int] = [0] * len(bodies)

    def send(index: int) -> None:
        headers = {"content-type": "application/json"}
        statuses[index] = httpx.post(url + "/v1/" + ("completions", "chat/completions")[index], content=bodies[index],
                                     headers=headers, timeout=120).status_code

    prober = subprocess.Popen([sys.executable, str(HEALTH_PROBE), url], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout is not None and prober.stdin is not None
        assert prober.stdout.readline().strip() == "ready"
        senders = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
        for sender in senders:
            sender.start()
        for sender in senders:
            sender.join()
        time.sleep(1.0)
        output, _ = prober.communicate("stop\n", timeout=60)
    finally:
        prober.kill()
    return json.loads(output), statuses
