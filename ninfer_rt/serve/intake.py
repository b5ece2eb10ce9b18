"""Taking a request in without holding the event loop: the body read under a size limit, then decoded,
validated, templated and tokenized in worker processes.

Why processes: JSON decoding of a 25 MB body holds the GIL for hundreds of milliseconds, and so does
tokenizing a 100k-token prompt; on a thread that would stall /health, the other lane's stream and (through
the GIL) the engine thread. A worker reads the raw bytes and returns a `Prepared` (prepare.py): token ids
and sampling parameters, already validated, which the app hands to the engine as they are.

Why a spool file: the body goes to the worker through a file in memory-backed storage, written chunk by
chunk as it arrives. Joining the chunks into one bytes object and pickling it into the pool's pipe would
each copy the whole body in one call holding the GIL (about 25 ms apiece for 25 MB on a 2-core machine),
which is the event loop's stall the workers exist to avoid.

The size limit is enforced while the body streams in (a client announcing or sending more than the limit
gets a 413 without the server buffering it all), and defaults to what a full context plausibly needs.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request

from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.prepare import ModelLimits, Preparer
from ninfer_rt.serve.protocol import APIError
from ninfer_rt.serve.state import ServeConfig

WORKER_NICENESS = 10
BODY_BYTES_PER_TOKEN = 16  # ~4 characters a token, JSON escaping, and room for role and tool fields
BODY_SLACK_BYTES = 1 << 20  # tool schemas, system prompts and the envelope, whatever the context


def default_max_body_bytes(max_context: int) -> int:
    return BODY_BYTES_PER_TOKEN * max_context + BODY_SLACK_BYTES


MEMORY_BACKED_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class SpooledBody:
    """A request body in a file of its own, removed by `remove()` once the worker has read it."""

    path: Path

    def remove(self) -> None:
        self.path.unlink(missing_ok=True)


def spool_dir() -> Path:
    return MEMORY_BACKED_DIR if MEMORY_BACKED_DIR.is_dir() else Path(tempfile.gettempdir())


async def read_body(request: Request, limit: int) -> SpooledBody:
    """The request body, spooled as it streams in, or a 413 as soon as it is known to exceed `limit` bytes
    (nothing of it is left behind then)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    fd, name = tempfile.mkstemp(prefix="ninfer-body-", dir=spool_dir())
    body = SpooledBody(Path(name))
    try:
        with open(fd, "wb") as spool:
            size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                spool.write(chunk)
    except BaseException:
        body.remove()
        raise
    return body


def _too_large(limit: int) -> APIError:
    return APIError(
        413, f"the request body exceeds this server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )


# The worker process's own Preparer, built by its initializer: one per process, never shared.
_worker_preparer: Preparer | None = None


def _start_worker(tokenizer: Tokenizer, limits: ModelLimits, config: ServeConfig) -> None:
    global _worker_preparer
    # On a loaded machine a core busy decoding a huge body must still leave the event loop and the
    # engine thread their time slices: intake runs at a lower priority.
    os.nice(WORKER_NICENESS)
    _worker_preparer = Preparer(tokenizer, limits, config)


def _prepare(kind: str, body_path: Path | None) -> Any:
    assert _worker_preparer is not None, "the worker's initializer builds its Preparer"
    raw = body_path.read_bytes() if body_path is not None else b""
    return getattr(_worker_preparer, kind)(raw)


class Intake:
    """The worker pool. `prepare(kind, body)` runs `Preparer.<kind>` on the body in a worker and removes the
    spooled body; an `APIError` raised there is raised here. A pool whose worker died (killed, out of
    memory) is replaced."""

    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits, config: ServeConfig) -> None:
        self._initargs = (tokenizer, limits, config)
        self._workers = config.intake_workers
        self._pool = self._new_pool()

    @classmethod
    def start(cls, tokenizer: Tokenizer, limits: ModelLimits, config: ServeConfig) -> Intake:
        """A pool whose workers are up (they are spawned, so they import and build their Preparer first)."""
        intake = cls(tokenizer, limits, config)
        for future in [intake._pool.submit(_prepare, "warm", None) for _ in range(config.intake_workers)]:
            future.result()
        return intake

    def _new_pool(self) -> ProcessPoolExecutor:
        # spawn, not fork: the server process has threads (the engine's, uvicorn's) a fork would copy mid-flight
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self._workers, context, initializer=_start_worker, initargs=self._initargs)

    async def prepare(self, kind: str, body: SpooledBody) -> Any:
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, _prepare, kind, body.path)
        except BrokenProcessPool:
            if pool is self._pool:
                self._pool = self._new_pool()
            raise APIError(
                503, "a request intake worker died (out of memory?); retry", type="server_error",
                headers={"Retry-After": "1"},
            ) from None
        finally:
            body.remove()

    def shutdown(self) -> None:
        self._pool.shutdown(cancel_futures=True)
