"""Request intake: the body size limit (413, enforced while the body streams in) and the event loop kept
free while big requests are decoded, templated and tokenized in the intake workers: /health keeps its
latency and another lane's stream its pace."""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from server_helpers import serving_process
from test_default_model import needs_shipped_model
from test_serve_errors import GOOD, assert_error, assert_still_serving
from test_serve_http import MAX_CONTEXT, MODEL, Server, running_server

from ninfer_rt.serve.intake import default_max_body_bytes, spool_dir
from ninfer_rt.shipped import default_model_dir

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
# The server and the probes run in processes of their own, as in production: neither this process's threads
# (sending the bodies) nor its garbage collector can stand between a probe and what it times.

P99_BUDGET_S = 0.050
HEALTH_PROBE = Path(__file__).with_name("health_probe.py")
STREAM_PROBE = Path(__file__).with_name("stream_probe.py")
BODY_LIMIT_FLAGS = ("--max-body-bytes", str(64 * 2**20))


def huge_bodies() -> list[tuple[str, bytes]]:
    """25 MB of prompt token ids (decoded and validated in a worker) and a 115k-token chat message (templated
    and tokenized in one): both longer than any context here, so both are refused once taken in."""
    ids = b", ".join(b"%d" % (i % 200 + 1) for i in range(25 * 10**6 // 4))
    huge = b'{"model": "tiny", "max_tokens": 1, "prompt": [' + ids + b"]}"
    assert len(huge) > 25 * 10**6
    words = b"word " * 115_000
    long_text = b'{"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": "' + words + b'"}]}'
    return [("/v1/completions", huge), ("/v1/chat/completions", long_text)]


def send_all(url: str, bodies: list[tuple[str, bytes]]) -> list[int]:
    """The bodies posted at once, one thread each; their statuses."""
    statuses = [0] * len(bodies)

    def send(index: int) -> None:
        route, body = bodies[index]
        headers = {"content-type": "application/json"}
        statuses[index] = httpx.post(url + route, content=body, headers=headers, timeout=120).status_code

    senders = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join()
    return statuses


@contextmanager
def probing(*args: str) -> Iterator[list[float]]:
    """A probe script run in its own process from the moment it says it has started until the block ends;
    the list yielded holds its figures once the block has ended."""
    figures: list[float] = []
    prober = subprocess.Popen([sys.executable, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout is not None
        assert prober.stdout.readline().strip() == "ready"
        yield figures
        output, _ = prober.communicate("stop\n", timeout=60)
        figures.extend(json.loads(output))
    finally:
        prober.kill()


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def test_health_keeps_its_latency_while_huge_requests_are_taken_in(tiny_qwen3: Path) -> None:
    bodies = huge_bodies()
    flags = ("--model", str(tiny_qwen3), "--served-model-name", MODEL, "--kv-capacity", "64", "--max-context", str(MAX_CONTEXT))
    with serving_process(*flags, *BODY_LIMIT_FLAGS) as url:
        with probing(str(HEALTH_PROBE), url) as latencies:  # from before the bodies are sent
            statuses = send_all(url, bodies)
            time.sleep(1.0)  # until a second after both were answered
    print(f"/health over {len(latencies)} probes: median {statistics.median(latencies) * 1000:.1f} ms, "
          f"p99 {p99(latencies) * 1000:.1f} ms, max {max(latencies) * 1000:.1f} ms")
    assert statuses == [400, 400]
    assert p99(latencies) < P99_BUDGET_S


STREAM_TOKENS = 4000  # the shipped model's 4096-token context less the prompt: longer than the intake and around it
QUIET_S = 3.0  # lane A alone, before and after the intake: its baseline


@needs_shipped_model
def test_a_streaming_reply_keeps_its_pace_while_huge_requests_are_taken_in() -> None:
    # Lane A streams a long completion; lane B posts the huge bodies meanwhile. Lane A's gaps before and after
    # them are its baseline (both sides, so that load from outside the test raises it as it raises the rest);
    # its gaps while they are taken in must stay near it.
    bodies = huge_bodies()
    with serving_process("--model", str(default_model_dir()), "--served-model-name", MODEL, *BODY_LIMIT_FLAGS) as url:
        with probing(str(STREAM_PROBE), url, MODEL, str(STREAM_TOKENS)) as arrivals:
            time.sleep(QUIET_S)
            intake_start = time.monotonic()
            statuses = send_all(url, bodies)
            intake_end = time.monotonic()
            time.sleep(QUIET_S)
    gaps = list(zip(arrivals, arrivals[1:]))
    baseline = [end - start for start, end in gaps if end < intake_start or start > intake_end]
    # every gap the intake overlaps: a stall that lasts until the bodies are answered ends after intake_end
    during = [end - start for start, end in gaps if end >= intake_start and start <= intake_end]
    bound = max(3 * p99(baseline), p99(baseline) + 0.050)
    print(f"lane A's gaps: baseline ({len(baseline)}) median {statistics.median(baseline) * 1000:.1f} ms, "
          f"p99 {p99(baseline) * 1000:.1f} ms; during {intake_end - intake_start:.1f} s of intake ({len(during)}) "
          f"median {statistics.median(during) * 1000:.1f} ms, p99 {p99(during) * 1000:.1f} ms, "
          f"max {max(during) * 1000:.1f} ms; bound {bound * 1000:.1f} ms")
    assert statuses == [400, 400]
    assert arrivals[-1] > intake_end + QUIET_S / 2, "lane A's stream ended too soon after the intake"
    assert p99(during) < bound
