"""`ninfer-rt serve` / `python -m ninfer_rt.serve`: flags, start-up checks, and the uvicorn run.

Start-up mistakes (a bad flag, a missing model directory) exit 2 with one line, before anything loads: a
supervisor's log should say what is wrong, not show a usage screen. The process exits 1 after a fatal
engine error so that the supervisor restarts it, and 0 after SIGTERM once in-flight requests have drained
(uvicorn stops accepting, waits for open responses, then the lifespan stops the engine).
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Any

import click
import uvicorn

from ninfer_rt.cli_engine_options import engine_config, engine_options
from ninfer_rt.cli_errors import OneLineErrors
from ninfer_rt.engine.engine import Engine
from ninfer_rt.serve.app import ServeConfig, create_app, sampling_defaults
from ninfer_rt.serve.backend import EngineBackend

log = logging.getLogger("ninfer_rt.serve")


@click.command("serve", cls=OneLineErrors)
@click.option("--model", "model_dir", required=True, help="Model directory (Hugging Face layout).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1 routes.")
@click.option("--served-model-name", default=None, help="The model id clients use (default: the directory name).")
@engine_options
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0), help="Waiting requests before 429.")
@click.option("--preserve-thinking/--no-preserve-thinking", default=True, show_default=True)
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
def serve(model_dir: str, **options: Any) -> None:
    """Serve the OpenAI API (chat, completions, models, health, metrics)."""
    model_path = Path(model_dir)
    if not (model_path / "config.json").is_file():
        raise click.UsageError(f"--model {model_dir}: not a model directory (no config.json)")
    logging.basicConfig(level=options["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run_server(model_path, options))


def run_server(model_path: Path, options: dict[str, Any]) -> int:
    try:
        config = engine_config(options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    name = options["served_model_name"] or model_path.resolve().name
    serve_config = ServeConfig(
        served_model_name=name,
        api_key=options["api_key"],
        preserve_thinking=options["preserve_thinking"],
        max_concurrency=options["max_concurrency"],
        max_queue=options["max_queue"],
        verify_ordering=options["verify_ordering"],
        sampling_defaults=sampling_defaults(model_path),
    )
    app = create_app(lambda: EngineBackend.start(lambda: Engine.load(model_path, config)), serve_config)
    if options["api_key"] is None:
        log.warning("no --api-key: anyone who can reach %s:%s can use this server", options["host"], options["port"])
    server = uvicorn.Server(
        uvicorn.Config(app, host=options["host"], port=options["port"], log_level=options["log_level"])
    )
    state = app.state.server
    state.on_fatal = lambda: setattr(server, "should_exit", True)
    log.info("serving %r from %s on http://%s:%s", name, model_path, options["host"], options["port"])
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler that was there before it
    # started; a no-op one turns that into a normal return, so the exit status says drained (0) or fatal (1).
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run()
    return 1 if state.fatal is not None else 0
