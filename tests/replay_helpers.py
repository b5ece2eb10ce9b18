"""A real CPU server for replay tests: uvicorn on a free port in a thread, the engine with the ordering
verifier on, and /debug/crash-context served (what `ninfer-rt serve --verify-ordering` runs)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from server_helpers import healthy_server

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.serve.app import create_app
from ninfer_rt.serve.backend import EngineBackend
from ninfer_rt.serve.state import ServeConfig, ServerState, sampling_defaults

MODEL = "tiny"


@dataclass
class RunningServer:
    url: str
    state: ServerState

    def engine(self) -> Engine:
        backend = self.state.backend
        assert isinstance(backend, EngineBackend)
        return backend._loop.engine


@contextmanager
def verified_server(
    model_dir: Path,
    kv_pages: int,
    max_context: int = 4096,
    on_engine: Callable[[Engine], None] = lambda e: None,
    exit_on_fatal: bool = False,  # as `ninfer-rt serve` does; off, a failed server stays up to be inspected
    checkpoint_sampling: bool = False,  # as `ninfer-rt serve` does: generation_config.json's when a request omits it
    **engine: object,  # more EngineConfig fields (the seed's --kv-dtype int8 --spec mtp ...)
) -> Iterator[RunningServer]:
    engine_config = EngineConfig(device="cpu", max_context=max_context, kv_capacity=str(kv_pages),
                                 max_concurrency=2, verify_ordering=True, **engine)  # type: ignore[arg-type]

    def build() -> Engine:
        engine = Engine.load(model_dir, engine_config)
        on_engine(engine)
        return engine

    serve_config = ServeConfig(served_model_name=MODEL, verify_ordering=True,
                               sampling_defaults=sampling_defaults(model_dir) if checkpoint_sampling else {})
    app = create_app(lambda: EngineBackend.start(build), serve_config)
    with healthy_server(app, exit_on_fatal) as url:
        yield RunningServer(url, app.state.server)
