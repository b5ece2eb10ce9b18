"""`ninfer-rt serve` / `python -m ninfer_rt.serve`: the flags and start-up checks; serve/server.py runs it.

Start-up mistakes (a bad flag, a missing model directory) exit 2 with one line, before anything loads: a
supervisor's log should say what is wrong, not show a usage screen.
"""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Any

import click

from ninfer_rt.cli.errors import OneLineErrors
from ninfer_rt.cli.model_path import model_frontend, resolve_model
from ninfer_rt.cli.options import engine_config, engine_options
from ninfer_rt.engine.build import EngineError
from ninfer_rt.kv.memory_plan import MemoryPlanError
from ninfer_rt.serve.intake import default_max_body_bytes
from ninfer_rt.serve.server import Listen, ModelLoadFailed, run_server
from ninfer_rt.serve.state import ServeConfig, sampling_defaults


@click.command("serve", cls=OneLineErrors)
@click.option(
    "--model", "model_dir", default=None, help="Model directory (Hugging Face layout), .ninfer artifact, or a shipped model's name [default: the shipped tiny model]."
)
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", default=None, help="Require 'Authorization: Bearer KEY' on /v1 routes.")
@click.option("--served-model-name", default=None, help="The model id clients use (default: the directory name).")
@engine_options
@click.option("--max-queue", default=64, show_default=True, type=click.IntRange(min=0), help="Waiting requests before 429.")
@click.option(
    "--max-body-bytes", default=None, type=click.IntRange(min=1),
    help="Largest request body accepted (413 beyond) [default: 16 bytes per --max-context token + 1 MiB].",
)
@click.option(
    "--intake-workers", default=2, show_default=True, type=click.IntRange(min=1),
    help="Processes that decode, template and tokenize request bodies off the event loop.",
)
@click.option("--preserve-thinking/--no-preserve-thinking", default=True, show_default=True)
@click.option("--log-level", default="info", show_default=True, type=click.Choice(["debug", "info", "warning", "error"]))
def serve(model_dir: str | None, **options: Any) -> None:
    """Serve the OpenAI API (chat, completions, models) and Anthropic's Messages API, with health and metrics."""
    model_path = resolve_model(model_dir)
    frontend = model_frontend(model_path)
    try:
        config = engine_config(options)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    _check_port_free(options["host"], options["port"])
    logging.basicConfig(level=options["log_level"].upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    listen = Listen(host=options["host"], port=options["port"], log_level=options["log_level"])
    try:
        status = run_server(model_path, config, _serve_config(model_path, frontend, options), listen)
    except ModelLoadFailed as failed:
        raise click.UsageError(_load_failure_line(model_path, failed.cause)) from None
    sys.exit(status)


def _load_failure_line(model_path: Path, cause: Exception | None) -> str:
    """A configuration the engine refuses (stores that do not fit the device, flags the checkpoint cannot
    serve) is the one line itself, naming its flag; any other failure points at the log, which has it."""
    if isinstance(cause, (MemoryPlanError, EngineError)):
        return str(cause)
    return f"--model {model_path}: the model failed to load"


def _check_port_free(host: str, port: int) -> None:
    """Fails before the model loads when the address is taken (a second server, a stale one)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise click.UsageError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None


def _serve_config(model_path: Path, frontend: Path, options: dict[str, Any]) -> ServeConfig:
    return ServeConfig(
        served_model_name=options["served_model_name"] or model_path.resolve().name.removesuffix(".ninfer"),
        api_key=options["api_key"],
        preserve_thinking=options["preserve_thinking"],
        max_concurrency=options["max_concurrency"],
        max_queue=options["max_queue"],
        verify_ordering=options["verify_ordering"],
        sampling_defaults=sampling_defaults(frontend),
        max_body_bytes=options["max_body_bytes"] or default_max_body_bytes(options["max_context"]),
        intake_workers=options["intake_workers"],
    )
