"""The FastAPI app: the routes (OpenAI chat and text completions and models, Anthropic messages and
count_tokens, health, metrics).

The app owns HTTP concerns only: auth, routing and error bodies (errors.py). A request body is taken in
off the event loop (intake.py: decoding, validation, the chat template and tokenizing in worker
processes, prepare.py); jobs.py shapes its responses and streaming.py sends them. Generation goes
through a `GenerationBackend` (the engine loop on its own thread). The backend is built in the background
at start-up so /health can say "loading" (503) instead of the port staying closed; a backend failure marks
the server unhealthy, fails the requests it had, and asks the process to exit so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ninfer_rt.serve.anthropic_job import MessagesJob
from ninfer_rt.serve.errors import install_error_handlers
from ninfer_rt.serve.intake import Intake, read_body
from ninfer_rt.serve.jobs import ChatJob, CompletionJob
from ninfer_rt.serve.metrics import ServerMetrics
from ninfer_rt.serve.prepare import ModelLimits
from ninfer_rt.serve.protocol import APIError
from ninfer_rt.serve.state import GenerationBackend, ServeConfig, ServerState, ready
from ninfer_rt.serve.streaming import respond

log = logging.getLogger("ninfer_rt.serve")


def create_app(load_backend: Callable[[], GenerationBackend], config: ServeConfig) -> FastAPI:
    """`load_backend` runs on a thread at start-up; /health is 503 until it returns."""
    state = ServerState()
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.get_running_loop().run_in_executor(None, _load, state, load_backend, config)
        yield
        await loading
        if state.intake is not None:
            state.intake.shutdown()
        if state.backend is not None:
            state.backend.shutdown()

    app = FastAPI(title="ninfer-rt", lifespan=lifespan)
    app.state.server = state
    app.state.metrics = metrics
    install_error_handlers(app, metrics)
    _install_status_routes(app, state, metrics, config)
    _install_api_routes(app, state, metrics, config)
    return app


def _load(state: ServerState, load_backend: Callable[[], GenerationBackend], config: ServeConfig) -> None:
    try:
        backend = load_backend()
        limits = ModelLimits(backend.context_limit, backend.vocab_size)
        state.intake = Intake.start(backend.tokenizer, limits, config)
        state.backend = backend
        log.info("model loaded; serving")
    except Exception as exc:  # noqa: BLE001 — any load failure is fatal and must reach the log and /health
        state.fatal = f"model failed to load: {exc}"
        state.load_error = exc
        log.error(state.fatal)
        state.on_fatal()


def _install_status_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics, config: ServeConfig) -> None:
    """The routes for supervisors and harnesses: health, Prometheus metrics, the crash context."""

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.fatal is not None:
            return JSONResponse({"status": "error", "error": state.fatal}, status_code=503)
        if state.backend is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        backend = state.backend
        kv, load = (backend.kv_stats(), backend.load()) if backend is not None else (None, None)
        return Response(metrics.render(kv, load, state.in_flight), media_type="text/plain; version=0.0.4")

    @app.get("/debug/crash-context")
    async def crash_context() -> JSONResponse:
        if not config.verify_ordering:
            raise APIError(404, "/debug/crash-context is served only with --verify-ordering", code="not_found")
        backend = state.backend
        if backend is None:
            raise APIError(503, "the model is still loading", type="server_error")
        return JSONResponse(backend.crash_context())


def _install_api_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics, config: ServeConfig) -> None:
    """The client routes, behind the API key when there is one."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        # vLLM's route: harnesses that need exact prompt lengths (a prefix ending mid-page) measure here.
        counted = await take_in(request, state, config, "tokenize")
        return JSONResponse({"count": len(counted.ids), "max_model_len": counted.context_limit, "tokens": counted.ids})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        authorize(request, config)
        return JSONResponse({"object": "list", "data": [_model_card(state, config)]})

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> JSONResponse:
        authorize(request, config)
        card = _model_card(state, config)
        if model_id != card["id"]:
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return JSONResponse(card)

    async def generate(request: Request, kind: str, job: type[ChatJob] | type[CompletionJob]) -> Response:
        prepared = await take_in(request, state, config, kind)
        return await respond(state, metrics, config, job.build(prepared, ready(state).tokenizer))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat", ChatJob)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion", CompletionJob)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await generate(request, "messages", MessagesJob)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> JSONResponse:
        counted = await take_in(request, state, config, "count_tokens")
        return JSONResponse({"input_tokens": len(counted.ids)})


async def take_in(request: Request, state: ServerState, config: ServeConfig, kind: str) -> Any:
    """The request, authorized, read under the size limit (spooled) and prepared (`Preparer.<kind>`) by an intake
    worker: the event loop only moves bytes."""
    authorize(request, config)
    ready(state)
    body = await read_body(request, config.max_body_bytes)
    assert state.intake is not None, "the intake is up before the backend is published"
    return await state.intake.prepare(kind, body)


def _model_card(state: ServerState, config: ServeConfig) -> dict[str, Any]:
    return {
        "id": config.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "ninfer-rt",
        "max_model_len": ready(state).context_limit,
    }


def authorize(request: Request, config: ServeConfig) -> None:
    """The key as OpenAI clients send it (Authorization: Bearer) or as Anthropic's do (x-api-key)."""
    if config.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    bearer = token.strip() if scheme.lower() == "bearer" else None
    if config.api_key not in (bearer, request.headers.get("x-api-key")):
        raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")

