"""The engine on its own thread, with asyncio on the other side.

The engine belongs to one thread (it owns the streams and is the only one that enqueues work), so the HTTP
event loop never calls it: it posts commands (add, abort) to a queue the engine thread drains between steps,
and the engine thread hands each output to the request's asyncio queue with call_soon_threadsafe. An
exception out of `step` is a dead engine (rule 6): every open request gets BackendFailed and the thread
stops; it never keeps stepping.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.app import BackendFailed

log = logging.getLogger("ninfer_rt.serve")

IDLE_WAIT_S = 0.05  # how long the idle engine thread blocks on the command queue before checking for stop


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class _Abort:
    request_id: str


_Sink = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class EngineBackend:
    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.tokenizer: Tokenizer = engine.tokenizer
        self.context_limit: int = engine.kv_manager.context_limit
        self._commands: queue.SimpleQueue[_Add | _Abort] = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._sinks_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def start(cls, build_engine: Callable[[], Engine]) -> EngineBackend:
        """Builds the engine on its own thread (which then owns it) and starts stepping; load errors re-raise."""
        built: queue.SimpleQueue[EngineBackend | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                backend = cls(build_engine())
            except BaseException as exc:  # noqa: BLE001 — handed to the caller, who reports it
                built.put(exc)
                return
            built.put(backend)
            backend._run()

        thread = threading.Thread(target=run, name="ninfer-engine", daemon=True)
        thread.start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        result._thread = thread
        return result

    # -- the asyncio side ---------------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._engine.validate(prompt_ids, params)

    def kv_stats(self) -> PoolStats:
        return self._engine.kv_stats()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if self._stop.is_set():
            raise BackendFailed("the engine has stopped")
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._sinks_lock:
            self._sinks[request_id] = (asyncio.get_running_loop(), outputs)
        self._commands.put(_Add(request_id, prompt_ids, params))
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # the consumer stopped early (client gone): free the request's pages now
                self._commands.put(_Abort(request_id))
            with self._sinks_lock:
                self._sinks.pop(request_id, None)

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    # -- the engine thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_commands(block=not self._engine.has_work)
                if self._engine.has_work:
                    self._deliver(self._engine.step())
        except Exception as exc:  # noqa: BLE001 — the engine is dead; every waiting request must hear why
            log.exception("engine step failed")
            self._stop.set()
            self._fail_all(BackendFailed(str(exc)))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=IDLE_WAIT_S) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._engine.abort(command.request_id)
            return
        try:
            self._engine.add_request(command.prompt_ids, command.params, command.request_id)
        except ValueError as exc:  # refused (the app validates first, so this is a race): tell that request
            self._send(command.request_id, exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            self._send(output.request_id, output)

    def _send(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._sinks_lock:
            sink = self._sinks.get(request_id)
        if sink is not None:
            _post(sink, item)

    def _fail_all(self, error: BaseException) -> None:
        with self._sinks_lock:
            sinks = list(self._sinks.values())
        for sink in sinks:
            _post(sink, error)


def _post(sink: _Sink, item: RequestOutput | BaseException) -> None:
    loop, outputs = sink
    try:
        loop.call_soon_threadsafe(outputs.put_nowait, item)
    except RuntimeError:  # that request's event loop is closed: nobody is listening any more
        pass
