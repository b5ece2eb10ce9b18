"""The app's GenerationBackend over the engine's EngineLoop (the engine on its own thread).

What this adds to EngineLoop is the server's view of failure: an error that stopped the loop (a sticky
CUDA error, rule 6, or an ordering violation under --verify-ordering) is `BackendFailed`, which the app
turns into a 500, an unhealthy /health and a process exit; a request refused on its own (a ValueError) stays
that request's problem. A violation stops the engine mid-step, like a sticky error, so it gets the same
treatment: the crash context is dumped to a file that the 500 names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.loop import EngineLoop
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.ordering import OrderingViolation
from ninfer_rt.serve.state import BackendFailed, EngineLoad, Generation


class EngineBackend:
    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self.tokenizer: Tokenizer = loop.engine.tokenizer
        self.context_limit: int = loop.engine.kv_manager.context_limit
        self.vocab_size: int = loop.engine.runner.model.config.vocab_size
        self._violation_dump: Path | None = None

    @classmethod
    def start(cls, build_engine: Callable[[], Engine]) -> EngineBackend:
        return cls(EngineLoop(build_engine()).start())

    def kv_stats(self) -> PoolStats:
        return self._loop.engine.kv_stats()

    def load(self) -> EngineLoad:
        # read from another thread without a lock: two list lengths, each exact when read, enough for a gauge
        engine = self._loop.engine
        scheduler = engine.scheduler
        return EngineLoad(
            len(scheduler.running), len(scheduler.waiting), engine.state_stats(), engine.snapshot_stats(),
            engine.warmup_stats(),
        )

    def crash_context(self) -> dict[str, Any]:
        error = self._loop.error
        return self._loop.engine.streams.crash.snapshot(None if error is None else repr(error))

    async def generate(self, generation: Generation, request_id: str) -> AsyncIterator[RequestOutput]:
        # request_id names the HTTP response; the loop keeps its own ids for the engine. The app validated
        # the generation; the loop's and the engine's own checks stay as the engine's guard for other callers.
        try:
            async for output in self._loop.stream(generation.prompt_ids, generation.params, generation.text_round_trip):
                yield output
        except ValueError:
            raise
        except Exception as exc:
            if self._loop.error is None:
                raise
            raise self._failure() from exc

    def _failure(self) -> BackendFailed:
        error = self._loop.error
        if not isinstance(error, OrderingViolation):
            return BackendFailed(str(error))  # a FatalCudaError already names its crash-context file
        if self._violation_dump is None:  # every in-flight request fails with it; one dump is enough
            self._violation_dump = self._loop.engine.streams.crash.dump(error=f"ordering violation: {error}")
        return BackendFailed(
            f"ordering violation: {error}; crash context written to {self._violation_dump}", ordering_violation=True
        )

    def shutdown(self) -> None:
        self._loop.stop()
