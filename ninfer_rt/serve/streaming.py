"""Running a job: its choices' outputs merged into one stream, sent as SSE events or as one JSON body.

Every prompt of a request holds an in-flight slot (capacity: running lanes + queue; beyond it a 429) from
the moment its generation starts until it is released, exactly once, however the response ends: done, an
error, or a client that went away (which aborts the engine's requests and frees their pages). A backend
failure becomes a 500 and a fatal server state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.serve.errors import internal_error
from ninfer_rt.serve.jobs import Job
from ninfer_rt.serve.metrics import ServerMetrics
from ninfer_rt.serve.protocol import APIError, bad_request
from ninfer_rt.serve.state import BackendFailed, ServeConfig, ServerState, ready

log = logging.getLogger("ninfer_rt.serve")

RETRY_AFTER_S = 1


async def respond(state: ServerState, metrics: ServerMetrics, config: ServeConfig, job: Job) -> Response:
    """Starts the job's generations; the response streams them (SSE) or collects them into one body."""
    backend = ready(state)
    _take_slots(state, config, len(job.generations))
    outputs = _Merged([
        _Outputs(state, metrics, backend.generate(generation, job.request_id)) for generation in job.generations
    ])
    if job.stream:
        # The background task releases the slots even when the client leaves before the body starts
        # (then `_sse` never runs, so its `finally` cannot); aclose is idempotent.
        return StreamingResponse(
            _sse(job, outputs, metrics), media_type="text/event-stream", background=BackgroundTask(outputs.aclose)
        )
    collected: list[list[RequestOutput]] = [[] for _ in job.generations]
    try:
        async for index, output in outputs:
            collected[index].append(output)
    finally:
        await outputs.aclose()
    metrics.request_done(job.endpoint, 200)
    return JSONResponse(job.response_body(collected))


def _take_slots(state: ServerState, config: ServeConfig, wanted: int) -> None:
    """Checks that `wanted` more requests fit in flight (each prompt of a batch is one); _Outputs takes them."""
    capacity = config.max_concurrency + config.max_queue
    if wanted > capacity:  # retrying would never help: a 400, not a 429
        raise bad_request(f"at most {capacity} prompts fit in one request on this server", param="prompt")
    if state.in_flight + wanted > capacity:
        raise APIError(
            429, f"the server is at capacity ({capacity} requests in flight); retry shortly",
            type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class _Outputs:
    """A request's outputs; records latencies, turns a backend failure into a fatal server state, and holds
    an in-flight slot from construction until it is released, exactly once however the consumer stops
    (done, error, client gone)."""

    def __init__(self, state: ServerState, metrics: ServerMetrics, source: AsyncIterator[RequestOutput]) -> None:
        self._state = state
        self._metrics = metrics
        self._source = source
        self._closed = False
        state.in_flight += 1

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        last_token_time: float | None = None
        try:
            async for output in self._source:
                now = time.monotonic()
                if output.token_ids and last_token_time is not None:
                    self._metrics.token_gap((now - last_token_time) / len(output.token_ids))
                if output.token_ids:
                    last_token_time = now
                if output.stats is not None:
                    self._metrics.generation_done(output.stats)
                yield output
        except ValueError as exc:  # refused by the engine after our checks (e.g. the pool changed): a 400
            raise bad_request(str(exc)) from None
        except BackendFailed as exc:
            if exc.ordering_violation and self._state.fatal is None:
                self._metrics.ordering_violations.inc()  # once: every in-flight request sees the same one
            self._state.fatal = str(exc)
            self._state.on_fatal()
            raise APIError(500, f"the engine failed: {exc}", type="server_error") from None

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._state.in_flight -= 1
        await self._source.aclose()  # type: ignore[attr-defined]


class _Merged:
    """The outputs of a response's choices as one stream of (choice index, output), in the order the
    engine produces them (a batch of prompts runs concurrently, so its streamed choices interleave)."""

    def __init__(self, choices: list[_Outputs]) -> None:
        self._choices = choices

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        iterators = [aiter(choice) for choice in self._choices]
        waiting = {asyncio.create_task(_next(it)): index for index, it in enumerate(iterators)}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=waiting.__getitem__):  # same-moment outputs in choice order
                    index = waiting.pop(task)
                    output = task.result()
                    if output is None:
                        continue
                    yield index, output
                    waiting[asyncio.create_task(_next(iterators[index]))] = index
        finally:
            # a failed choice or a consumer that stopped: the other choices' pending reads are cancelled,
            # which ends (and aborts) their requests before aclose releases them
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    async def aclose(self) -> None:
        for choice in self._choices:
            await choice.aclose()


async def _next(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """The next output, or None at the end (a task cannot finish with StopAsyncIteration cleanly)."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None


async def _sse(job: Job, outputs: _Merged, metrics: ServerMetrics) -> AsyncIterator[str]:
    status = 200
    try:
        stats: list[RequestStats | None] = [None] * len(job.generations)
        async for index, output in outputs:
            for event in job.events(index, output):
                yield event
            stats[index] = output.stats or stats[index]
        for event in job.closing_events(stats):
            yield event
    except APIError as exc:
        status = exc.status
        yield job.error_event(exc)
    except Exception as exc:  # noqa: BLE001 — a bug mid-stream still ends the stream with a JSON error
        log.exception("unexpected error while streaming %s", job.request_id)
        metrics.unexpected_errors.inc()
        status = 500
        yield job.error_event(internal_error(exc))
    except asyncio.CancelledError:  # the client went away: closing the outputs aborts the requests
        status = 499
        raise
    finally:
        await outputs.aclose()
        metrics.request_done(job.endpoint, status)
