"""Streams one long completion from a server, says "ready" once its first chunk arrives and, once a line
arrives on stdin, stops reading it (the server aborts the request) and prints the arrival time of every
streamed chunk (time.monotonic(), seconds) as one JSON list.

It runs as a process of its own (`python tests/stream_probe.py URL MODEL MAX_TOKENS`), as
tests/health_probe.py does and for the same reason: what it times must be the server's gaps alone, not the
pytest process's collector pauses or the GIL its threads sending request bodies hold. CLOCK_MONOTONIC is
the system's, so the test can place these times against its own.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time

import httpx


def stream(url: str, model: str, max_tokens: int, stop: threading.Event) -> list[float]:
    body = {"model": model, "prompt": "def main(", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    arrivals: list[float] = []
    with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        gc.disable()  # this process's own pauses are not the server's gaps
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
                if len(arrivals) == 1:
                    print("ready", flush=True)  # the stream is under way
            if stop.is_set():
                break
    return arrivals


def main() -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    url, model, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
    print(json.dumps(stream(url, model, max_tokens, stop)), flush=True)


if __name__ == "__main__":
    main()
