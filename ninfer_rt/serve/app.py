"""The OpenAI-compatible FastAPI app: chat and text completions (plain and SSE), models, health, metrics.

The app owns HTTP concerns only: auth, validation, the chat template, reasoning/tool-call parsing and
response shapes. Generation goes through a `GenerationBackend` (the engine loop on its own thread). The
backend is built in the background at start-up so /health can say "loading" (503) instead of the port
staying closed; a backend failure marks the server unhealthy, fails the requests it had, and asks the
process to exit so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.engine.sampling import TokenLogprobs
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.chat import ChatTemplate, ChatTemplateError
from ninfer_rt.serve.metrics import ServerMetrics
from ninfer_rt.serve.parsing import OutputParser, ParsedDelta, message_fields
from ninfer_rt.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_body,
)

log = logging.getLogger("ninfer_rt.serve")

RETRY_AFTER_S = 1
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class GenerationBackend(Protocol):
    """What the app needs from the engine side."""

    tokenizer: Tokenizer
    context_limit: int  # prompt + output tokens one request may hold

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that could never run."""

    def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs; closing the iterator early aborts the request and frees its pages."""

    def kv_stats(self) -> PoolStats: ...

    def crash_context(self) -> dict[str, Any]:
        """The engine's crash context now: last ops per stream, lane frontier, KV transactions and pages."""

    def shutdown(self) -> None: ...


class BackendFailed(RuntimeError):
    """The engine hit an error it cannot continue from (a sticky CUDA error, an ordering violation): the
    server must restart."""

    def __init__(self, message: str, ordering_violation: bool = False) -> None:
        super().__init__(message)
        self.ordering_violation = ordering_violation


@dataclass(frozen=True)
class ServeConfig:
    served_model_name: str
    api_key: str | None = None
    preserve_thinking: bool = True
    max_concurrency: int = 2
    max_queue: int = 64  # requests waiting beyond the running lanes before 429
    verify_ordering: bool = False  # also serves /debug/crash-context, for replay harnesses to assert on
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)  # from generation_config.json


@dataclass
class ServerState:
    backend: GenerationBackend | None = None
    template: ChatTemplate | None = None
    fatal: str | None = None
    in_flight: int = 0
    on_fatal: Callable[[], None] = lambda: None  # set by the runner: stop the server so the process exits


def sampling_defaults(model_dir: str | Path) -> dict[str, float]:
    """The sampling parameters the checkpoint recommends (generation_config.json), used when a client omits them."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    defaults = {key: config[key] for key in SAMPLING_DEFAULT_KEYS if isinstance(config.get(key), (int, float))}
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def create_app(load_backend: Callable[[], GenerationBackend], config: ServeConfig) -> FastAPI:
    """`load_backend` runs on a thread at start-up; /health is 503 until it returns."""
    state = ServerState()
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loading = asyncio.get_running_loop().run_in_executor(None, _load, state, load_backend)
        yield
        await loading
        if state.backend is not None:
            state.backend.shutdown()

    app = FastAPI(title="ninfer-rt", lifespan=lifespan)
    app.state.server = state
    app.state.metrics = metrics
    _install_error_handlers(app, metrics)
    _install_routes(app, state, metrics, config)
    return app


def _load(state: ServerState, load_backend: Callable[[], GenerationBackend]) -> None:
    try:
        backend = load_backend()
        template_source = backend.tokenizer.chat_template
        state.template = ChatTemplate(template_source) if template_source else None
        state.backend = backend
        log.info("model loaded; serving")
    except Exception as exc:  # noqa: BLE001 — any load failure is fatal and must reach the log and /health
        state.fatal = f"model failed to load: {exc}"
        log.error(state.fatal)
        state.on_fatal()


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        metrics.request_done(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _install_routes(app: FastAPI, state: ServerState, metrics: ServerMetrics, config: ServeConfig) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if state.fatal is not None:
            return JSONResponse({"status": "error", "error": state.fatal}, status_code=503)
        if state.backend is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        kv = state.backend.kv_stats() if state.backend is not None else None
        return Response(metrics.render(kv), media_type="text/plain; version=0.0.4")

    @app.get("/debug/crash-context")
    async def crash_context() -> JSONResponse:
        if not config.verify_ordering:
            raise APIError(404, "/debug/crash-context is served only with --verify-ordering", code="not_found")
        backend = state.backend
        if backend is None:
            raise APIError(503, "the model is still loading", type="server_error")
        return JSONResponse(backend.crash_context())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        # vLLM's route: harnesses that need exact prompt lengths (a prefix ending mid-page) measure here.
        _authorize(request, config)
        raw = await request.body()
        chat = _is_chat_body(raw)
        body = parse_body(raw, ChatCompletionRequest if chat else CompletionRequest)
        backend = _serving(body.model, state, config)
        ids = _render_chat(body, state, config).ids if chat else _completion_prompt_ids(body, backend)
        return JSONResponse({"count": len(ids), "max_model_len": backend.context_limit, "tokens": ids})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _authorize(request, config)
        backend = _ready(state)
        model = {
            "id": config.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "ninfer-rt",
            "max_model_len": backend.context_limit,
        }
        return JSONResponse({"object": "list", "data": [model]})

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        _authorize(request, config)
        body = parse_body(await request.body(), ChatCompletionRequest)
        return await _serve(request, state, metrics, config, _ChatJob.build(body, state, config))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        _authorize(request, config)
        body = parse_body(await request.body(), CompletionRequest)
        return await _serve(request, state, metrics, config, _CompletionJob.build(body, state, config))


def _authorize(request: Request, config: ServeConfig) -> None:
    if config.api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or token.strip() != config.api_key:
        raise APIError(401, "invalid or missing API key", type="authentication_error", code="invalid_api_key")


def _ready(state: ServerState) -> GenerationBackend:
    if state.fatal is not None:
        raise APIError(503, f"the server is unhealthy: {state.fatal}", type="server_error")
    if state.backend is None:
        raise APIError(503, "the model is still loading", type="server_error", headers={"Retry-After": "5"})
    return state.backend


# -- jobs: one request's prompt, parameters and response shape --------------------------------------------


@dataclass
class _Job:
    """What both endpoints share: the tokenized prompt, sampling, and how to turn outputs into JSON."""

    request_id: str
    model: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tokenizer: Tokenizer | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    endpoint = ""
    object_name = ""
    id_prefix = ""

    @classmethod
    def _fields(
        cls, body: ChatCompletionRequest | CompletionRequest, backend: GenerationBackend, prompt_ids: list[int],
        config: ServeConfig, logprobs: bool, top_logprobs: int,
    ) -> dict[str, Any]:
        """The fields both endpoints fill the same way from the request and its tokenized prompt."""
        params = _sampling_params(body, body.requested_max_tokens, prompt_ids, backend, config)
        return {
            "request_id": f"{cls.id_prefix}-{uuid.uuid4().hex}",
            "model": body.model,
            "prompt_ids": prompt_ids,
            "params": _with_logprobs(params, logprobs, top_logprobs),
            "stream": body.stream,
            "include_usage": bool(body.stream_options and body.stream_options.include_usage),
            "tokenizer": backend.tokenizer,
        }

    def chunk_object(self) -> str:
        return self.object_name + ".chunk" if self.object_name == "chat.completion" else self.object_name

    def envelope(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None, chunk: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": self.chunk_object() if chunk else self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None or not chunk:
            body["usage"] = usage
        return body

    def delta(self, output: RequestOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class _ChatJob(_Job):
    parser: OutputParser = field(default_factory=OutputParser)
    sent_role: bool = False

    endpoint = "/v1/chat/completions"
    object_name = "chat.completion"
    id_prefix = "chatcmpl"

    @classmethod
    def build(cls, body: ChatCompletionRequest, state: ServerState, config: ServeConfig) -> _ChatJob:
        backend = _serving(body.model, state, config)
        prompt = _render_chat(body, state, config)
        fields = cls._fields(body, backend, prompt.ids, config, body.logprobs, body.top_logprobs or 0)
        return cls(parser=OutputParser.for_prompt(prompt.generation_prompt, body.parses_tool_calls), **fields)

    def delta(self, output: RequestOutput) -> dict[str, Any] | None:
        parsed = self.parser.feed(output.text)
        if output.finished:
            parsed.extend(self.parser.finish())
        message: dict[str, Any] = {}
        if not self.sent_role:
            message["role"] = "assistant"
            self.sent_role = True
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.content:
            message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [call.stream_json() for call in parsed.tool_calls]
        logprobs = self._logprobs(output.logprobs)
        if not message and logprobs is None and not output.finished:
            return None
        choice = {"index": 0, "delta": message, "logprobs": logprobs, "finish_reason": self._finish_reason(output)}
        return choice

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        parsed = ParsedDelta()
        for output in outputs:
            parsed.extend(self.parser.feed(output.text))
        parsed.extend(self.parser.finish())
        message = {"role": "assistant", **message_fields(parsed, self.parser.has_reasoning)}
        logprobs = self._logprobs([lp for output in outputs for lp in output.logprobs])
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": self._finish_reason(outputs[-1])}

    def _finish_reason(self, output: RequestOutput) -> str | None:
        if output.finish_reason is None:
            return None
        if output.finish_reason.value == "stop" and self.parser.num_tool_calls:
            return "tool_calls"
        return output.finish_reason.value

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.params.logprobs or not entries:
            return None
        assert self.tokenizer is not None
        return {"content": [_chat_logprob(self.tokenizer, entry) for entry in entries]}


@dataclass
class _CompletionJob(_Job):
    num_logprobs: int | None = None

    endpoint = "/v1/completions"
    object_name = "text_completion"
    id_prefix = "cmpl"

    @classmethod
    def build(cls, body: CompletionRequest, state: ServerState, config: ServeConfig) -> _CompletionJob:
        backend = _serving(body.model, state, config)
        prompt_ids = _completion_prompt_ids(body, backend)
        fields = cls._fields(body, backend, prompt_ids, config, body.logprobs is not None, body.logprobs or 0)
        return cls(num_logprobs=body.logprobs, **fields)

    def delta(self, output: RequestOutput) -> dict[str, Any] | None:
        if not output.text and not output.finished:
            return None
        return self._choice(output.text, output.logprobs, output)

    def final(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        text = "".join(output.text for output in outputs)
        return self._choice(text, [lp for output in outputs for lp in output.logprobs], outputs[-1])

    def _choice(self, text: str, logprobs: list[TokenLogprobs], last: RequestOutput) -> dict[str, Any]:
        finish = last.finish_reason.value if last.finish_reason is not None else None
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish}

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
        assert self.tokenizer is not None
        tokens = [self.tokenizer.decode([e.token_id]) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
        }


def _is_chat_body(raw: bytes) -> bool:
    try:
        data = json.loads(raw)
    except ValueError:
        return False  # parse_body says what is wrong with it
    return isinstance(data, dict) and "messages" in data


@dataclass(frozen=True)
class _ChatPrompt:
    ids: list[int]
    generation_prompt: str


def _render_chat(body: ChatCompletionRequest, state: ServerState, config: ServeConfig) -> _ChatPrompt:
    """The chat template applied to the request, tokenized: what generation and /tokenize both see."""
    backend = _ready(state)
    if state.template is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    kwargs = {"preserve_thinking": config.preserve_thinking, **(body.chat_template_kwargs or {})}
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.parses_tool_calls else None
    try:
        prompt = state.template.render([m.for_template() for m in body.messages], tools=tools, **kwargs)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    return _ChatPrompt(backend.tokenizer.encode(prompt.text), prompt.generation_prompt)


def _serving(model: str, state: ServerState, config: ServeConfig) -> GenerationBackend:
    """The backend, once it is ready and if `model` is the one this server serves."""
    backend = _ready(state)
    if model != config.served_model_name:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {config.served_model_name!r}",
            param="model", code="model_not_found",
        )
    return backend


def _completion_prompt_ids(body: CompletionRequest, backend: GenerationBackend) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, str):
        return backend.tokenizer.encode(prompt)
    if prompt and isinstance(prompt[0], str):
        return backend.tokenizer.encode(str(prompt[0]))
    return [int(t) for t in prompt]


def _sampling_params(
    body: ChatCompletionRequest | CompletionRequest,
    max_tokens: int | None,
    prompt_ids: list[int],
    backend: GenerationBackend,
    config: ServeConfig,
) -> SamplingParams:
    limit = backend.context_limit
    if len(prompt_ids) >= limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but the prompt has {len(prompt_ids)} tokens",
            param="messages", code="context_length_exceeded",
        )
    if max_tokens is None:  # as vLLM does: whatever room the context leaves
        max_tokens = limit - len(prompt_ids)
    elif len(prompt_ids) + max_tokens > limit:
        raise bad_request(
            f"this model's maximum context length is {limit} tokens, but {len(prompt_ids) + max_tokens} were "
            f"requested ({len(prompt_ids)} in the prompt, {max_tokens} for the completion)",
            param="max_tokens", code="context_length_exceeded",
        )
    chosen = {k: getattr(body, k) for k in SAMPLING_DEFAULT_KEYS if getattr(body, k) is not None}
    try:
        params = SamplingParams(
            **{**config.sampling_defaults, **chosen},
            max_tokens=max_tokens,
            seed=body.seed,
            stop=tuple(body.stop or ()),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
        )
        backend.validate(prompt_ids, params)
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return params


def _with_logprobs(params: SamplingParams, logprobs: bool, top: int) -> SamplingParams:
    if not logprobs and not top:
        return params
    try:
        return SamplingParams(**{**params.__dict__, "logprobs": logprobs, "top_logprobs": top})
    except ValueError as exc:
        raise bad_request(str(exc), param="top_logprobs") from None


def _chat_logprob(tokenizer: Tokenizer, entry: TokenLogprobs) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def _usage(stats: RequestStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


# -- running a job ------------------------------------------------------------------------------------------


async def _serve(
    request: Request, state: ServerState, metrics: ServerMetrics, config: ServeConfig, job: _Job
) -> Response:
    capacity = config.max_concurrency + config.max_queue
    if state.in_flight >= capacity:
        raise APIError(
            429, f"the server is at capacity ({capacity} requests in flight); retry shortly",
            type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    backend = _ready(state)
    state.in_flight += 1
    outputs = _Outputs(state, metrics, backend.generate(job.prompt_ids, job.params, job.request_id))
    if job.stream:
        # The background task releases the slot even when the client leaves before the body starts
        # (then `_sse` never runs, so its `finally` cannot); aclose is idempotent.
        return StreamingResponse(
            _sse(job, outputs, metrics), media_type="text/event-stream", background=BackgroundTask(outputs.aclose)
        )
    try:
        collected = [output async for output in outputs]
    finally:
        await outputs.aclose()
    metrics.request_done(job.endpoint, 200)
    usage = _usage(collected[-1].stats) if collected[-1].stats else None
    return JSONResponse(job.envelope([job.final(collected)], usage, chunk=False))


class _Outputs:
    """A request's outputs; records latencies, turns a backend failure into a fatal server state, and
    releases the in-flight slot exactly once however the consumer stops (done, error, client gone)."""

    def __init__(self, state: ServerState, metrics: ServerMetrics, source: AsyncIterator[RequestOutput]) -> None:
        self._state = state
        self._metrics = metrics
        self._source = source
        self._closed = False

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


async def _sse(job: _Job, outputs: _Outputs, metrics: ServerMetrics) -> AsyncIterator[str]:
    status = 200
    try:
        stats: RequestStats | None = None
        async for output in outputs:
            choice = job.delta(output)
            if choice is not None:
                yield _event(job.envelope([choice], None, chunk=True))
            stats = output.stats or stats
        if job.include_usage and stats is not None:
            yield _event(job.envelope([], _usage(stats), chunk=True))
        yield "data: [DONE]\n\n"
    except APIError as exc:
        status = exc.status
        yield _event(exc.body())
    except asyncio.CancelledError:  # the client went away: closing the outputs aborts the request
        status = 499
        raise
    finally:
        await outputs.aclose()
        metrics.request_done(job.endpoint, status)


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

