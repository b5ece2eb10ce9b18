"""The app's GenerationBackend over the engine's EngineLoop (the engine on its own thread).

What this adds to EngineLoop is the server's view of failure: an error that stopped the loop (a sticky
CUDA error, rule 6) is `BackendFailed`, which the app turns into a 500, an unhealthy /health and a process
exit; a request refused on its own (a ValueError) stays that request's problem.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from ninfer_rt.engine.engine import Engine
from ninfer_rt.engine.loop import EngineLoop
from ninfer_rt.engine.output import RequestOutput
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.app import BackendFailed


class EngineBackend:
    def __init__(self, loop: EngineLoop) -> None:
        self._loop = loop
        self.tokenizer: Tokenizer = loop.engine.tokenizer
        self.context_limit: int = loop.engine.kv_manager.context_limit

    @classmethod
    def start(cls, build_engine: Callable[[], Engine]) -> EngineBackend:
        return cls(EngineLoop(build_engine()).start())

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        self._loop.engine.validate(prompt_ids, params)

    def kv_stats(self) -> PoolStats:
        return self._loop.engine.kv_stats()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        # request_id names the HTTP response; the loop keeps its own ids for the engine
        try:
            async for output in self._loop.stream(prompt_ids, params):
                yield output
        except ValueError:
            raise
        except Exception as exc:
            if self._loop.error is None:
                raise
            raise BackendFailed(str(self._loop.error)) from exc

    def shutdown(self) -> None:
        self._loop.stop()
