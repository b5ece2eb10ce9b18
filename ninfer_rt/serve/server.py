"""The server as a process: the engine on its thread, the app, and the uvicorn run until drained or fatal.

The process exits 1 after a fatal engine error so that a supervisor restarts it, and 0 after SIGTERM once
in-flight requests have drained (uvicorn stops accepting, waits for open responses, then the lifespan stops
the engine). The flags that fill these values are the CLI's (`ninfer-rt serve`); this module takes them
already checked.
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from ninfer_rt.engine.build import EngineConfig
from ninfer_rt.engine.engine import Engine
from ninfer_rt.serve.app import create_app
from ninfer_rt.serve.backend import EngineBackend
from ninfer_rt.serve.state import ServeConfig

log = logging.getLogger("ninfer_rt.serve")


@dataclass(frozen=True)
class Listen:
    host: str = "127.0.0.1"
    port: int = 8000
    log_level: str = "info"


class ModelLoadFailed(Exception):
    """The model never loaded; `cause` says why (the log has its traceback)."""

    def __init__(self, cause: Exception | None) -> None:
        super().__init__(str(cause))
        self.cause = cause


def run_server(model_path: Path, engine_config: EngineConfig, serve_config: ServeConfig, listen: Listen) -> int:
    """Serves until SIGTERM/SIGINT (returns 0 once drained) or a fatal engine error (returns 1); raises
    ModelLoadFailed when the model never loaded."""
    app = create_app(lambda: EngineBackend.start(lambda: Engine.load(model_path, engine_config)), serve_config)
    if serve_config.api_key is None:
        log.warning("no --api-key: anyone who can reach %s:%s can use this server", listen.host, listen.port)
    server = uvicorn.Server(uvicorn.Config(app, host=listen.host, port=listen.port, log_level=listen.log_level))
    state = app.state.server
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    log.info("serving %r from %s on http://%s:%s", serve_config.served_model_name, model_path, listen.host, listen.port)
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler that was there before it
    # started; a no-op one turns that into a normal return, so the exit status says drained (0) or fatal (1).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    if state.fatal is not None and state.backend is None:
        raise ModelLoadFailed(state.load_error)
    return 1 if state.fatal is not None else 0
