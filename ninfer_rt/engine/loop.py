"""EngineLoop: the engine's own thread, and the thread-safe / asyncio face servers use.

The loop thread is the only one that touches the engine (and so the streams). Other threads submit and
abort through a command queue and receive outputs through a callback per request; `stream` adapts that to
an async iterator by handing each output to the event loop with call_soon_threadsafe. Validation runs in
the caller's thread so a bad request fails there (a 400), not in the loop.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import SamplingParams, as_token_ids

Sink = Callable[[RequestOutput | BaseException], None]


@dataclass(frozen=True)
class _Submit:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    warm_reply: bool


@dataclass(frozen=True)
class _Abort:
    request_id: str


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[_Submit | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self._error_lock = threading.Lock()  # a submit either sees `error` or is failed by the loop

    def start(self) -> EngineLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._commands.put(None)
        self._thread.join()

    # -- any thread ------------------------------------------------------------------------------------

    def submit(self, prompt: str | Sequence[int], params: SamplingParams, sink: Sink, warm_reply: bool = False) -> str:
        """Queue a request; `sink` is called on the loop thread with each output (or the fatal error);
        `warm_reply` as for Engine.add_request."""
        if self.error is not None:
            raise RuntimeError(f"the engine loop stopped: {self.error}")
        prompt_ids = self.engine.tokenizer.encode(prompt) if isinstance(prompt, str) else as_token_ids(prompt)
        self.engine.validate(prompt_ids, params)
        request_id = f"loop-{next(self._ids)}"
        with self._error_lock:
            if self.error is not None:
                raise RuntimeError(f"the engine loop stopped: {self.error}")
            self._commands.put(_Submit(request_id, prompt_ids, params, sink, warm_reply))
        return request_id

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    async def stream(
        self, prompt: str | Sequence[int], params: SamplingParams, warm_reply: bool = False
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced; leaving the iteration early aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        request_id = self.submit(
            prompt, params, lambda item: loop.call_soon_threadsafe(outputs.put_nowait, item), warm_reply
        )
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    # -- the loop thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._apply_commands(block=not self.engine.has_work):
                for output in self.engine.step():
                    self._deliver(output)
        except BaseException as err:  # a fatal engine error ends every request, never silently
            with self._error_lock:
                self.error = err
            # requests still queued (submitted before `error` was set) fail too
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Submit):
                    self._sinks[command.request_id] = command.sink
            for sink in self._sinks.values():
                try:
                    sink(err)
                except Exception:  # noqa: BLE001 -- a consumer that went away must not keep the others waiting
                    pass
            self._sinks.clear()

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False once stop() was called."""
        while True:
            try:
                command = self._commands.get() if block else self._commands.get_nowait()
            except queue.Empty:
                return True
            block = False
            if command is None:
                return False
            if isinstance(command, _Abort):
                self._sinks.pop(command.request_id, None)  # whoever aborted stopped listening
                self.engine.abort(command.request_id)
                continue
            try:
                self.engine.add_request(command.prompt_ids, command.params, command.request_id, command.warm_reply)
            except ValueError as err:  # valid when submitted, but not any more: that request fails alone
                command.sink(err)
                continue
            self._sinks[command.request_id] = command.sink

    def _deliver(self, output: RequestOutput) -> None:
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return
        if output.finished:
            del self._sinks[output.request_id]
        try:
            sink(output)
        except Exception:  # a consumer that went away (closed event loop) must not stop the other lanes
            self._sinks.pop(output.request_id, None)
            self.engine.abort(output.request_id)
