"""A real server for tests: uvicorn on a free local port in a thread, or `ninfer-rt serve` in a process of its
own, and waiting for its /health."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy")


@contextmanager
def serving_in_thread(app: FastAPI, exit_on_fatal: bool = False) -> Iterator[str]:
    """Serves the app until the block ends; yields its URL, which may not answer yet. With exit_on_fatal the
    server stops itself after a fatal engine error, as `ninfer-rt serve` does."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    if exit_on_fatal:
        app.state.server.on_fatal = lambda: setattr(server, "should_exit", True)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def healthy_server(app: FastAPI, exit_on_fatal: bool = False) -> Iterator[str]:
    """serving_in_thread, once /health answers 200."""
    with serving_in_thread(app, exit_on_fatal) as url:
        wait_healthy(url)
        yield url


@contextmanager
def serving_process(*flags: str) -> Iterator[str]:
    """`python -m ninfer_rt.serve` on the CPU and a free port, with these flags, in a process of its own (as in
    production: nothing in the test process can pause it); yields its URL once /health answers 200."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ninfer_rt.serve", "--device", "cpu", "--port", str(port), "--log-level", "warning", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
