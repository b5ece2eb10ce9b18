"""Probes a server's /health every PROBE_INTERVAL_S until a line arrives on stdin, then prints the
latencies in seconds as one JSON list.

It runs as a process of its own (`python tests/health_probe.py URL`) so that what it times is the
server's latency alone: late in a test suite, the pytest process's garbage collector pauses for up to
hundreds of milliseconds, and its threads sending the request bodies share its GIL.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time

import httpx

PROBE_INTERVAL_S = 0.05  # 20 probes a second


def probe(url: str, stop: threading.Event) -> list[float]:
    latencies: list[float] = []
    with httpx.Client(timeout=10) as client:
        client.get(url + "/health")  # the connection is open before timing starts
        print("ready", flush=True)
        gc.disable()  # this process's own pauses are not the server's latency
        while not stop.is_set():
            start = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            stop.wait(max(0.0, PROBE_INTERVAL_S - (time.monotonic() - start)))
    return latencies


def main() -> None:
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
    print(json.dumps(probe(sys.argv[1], stop)), flush=True)


if __name__ == "__main__":
    main()
