"""The OpenAI-compatible FastAPI app: chat and text completions (plain and SSE), models, health, metrics.

The app owns HTTP concerns only: auth, validation, the chat template, reasoning/tool-call parsing and
response shapes. Generation goes through a `GenerationBackend` (the engine loop on its own thread). The
backend is built in the background at start-up so /health can say "loading" (503) instead of the port
staying closed; a backend failure marks the server unhealthy, fails the requests it had, and asks the
process to exit so a supervisor restarts it.

Validation happens once, here: a request that parses (protocol.py) is turned into `Generation`s whose
prompts and parameters fit the model (vocabulary, context), so every refusal is a 400 before anything is
queued or a stream has started. `/v1/completions` takes a batch of prompts (texts or token-id lists): one
choice each, run concurrently, streamed interleaved by `index`, usage summed.

tool_choice: "none" hides the tools; "auto" lets the model decide; "required" and a named function force a
call without constrained decoding, by prefilling the assistant turn (parsing.forced_call_prefill). What
that guarantees: a named function (or "required" with a single tool) always comes back as a call of that
function, whose arguments are the model's text (not checked against the schema); "required" with several
tools starts the reply inside a call, and the model chooses the function; if it then writes a body that
is not a call, that comes back as content.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
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
from ninfer_rt.serve.parsing import OutputParser, ParsedDelta, forced_call_prefill, message_fields
from ninfer_rt.serve.tool_call_syntax import ToolCallSyntax
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


@dataclass(frozen=True)
class Generation:
    """One prompt and its sampling parameters, validated once, at the edge, against what the backend
    announces (vocabulary, context limit): the backend runs it as it is."""

    prompt_ids: list[int]
    params: SamplingParams


class GenerationBackend(Protocol):
    """What the app needs from the engine side."""

    tokenizer: Tokenizer
    context_limit: int  # prompt + output tokens one request may hold
    vocab_size: int  # prompt token ids must be in [0, vocab_size)

    def generate(self, generation: Generation, request_id: str) -> AsyncIterator[RequestOutput]:
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
        ids = _render_chat(body, state, config).ids if chat else _single_prompt(body, backend.tokenizer)
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


# -- jobs: one request's prompts, parameters and response shape -------------------------------------------


@dataclass
class _Job:
    """What both endpoints share: the validated generations (one per choice), and how to turn their outputs
    into JSON."""

    request_id: str
    model: str
    generations: list[Generation]
    stream: bool
    include_usage: bool
    tokenizer: Tokenizer
    created: int = field(default_factory=lambda: int(time.time()))

    endpoint = ""
    object_name = ""
    id_prefix = ""
    prompt_param = ""  # the request field an invalid prompt is reported under

    @classmethod
    def _fields(
        cls, body: ChatCompletionRequest | CompletionRequest, backend: GenerationBackend, prompts: list[list[int]],
        config: ServeConfig, logprobs: bool, top_logprobs: int,
    ) -> dict[str, Any]:
        """The fields both endpoints fill the same way from the request and its tokenized prompts."""
        return {
            "request_id": f"{cls.id_prefix}-{uuid.uuid4().hex}",
            "model": body.model,
            "generations": [
                _generation(body, ids, backend, config, logprobs, top_logprobs, cls.prompt_param) for ids in prompts
            ],
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

    def delta(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        """Choice `index`'s streamed chunk for `output`, or None when it adds nothing yet."""
        raise NotImplementedError

    def final(self, index: int, outputs: list[RequestOutput]) -> dict[str, Any]:
        """Choice `index` of the non-streamed response, from all its outputs."""
        raise NotImplementedError


@dataclass
class _ChatJob(_Job):
    parser: OutputParser = field(default_factory=OutputParser)  # one: a chat request has one choice (n=1)
    sent_role: bool = False

    endpoint = "/v1/chat/completions"
    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    @classmethod
    def build(cls, body: ChatCompletionRequest, state: ServerState, config: ServeConfig) -> _ChatJob:
        backend = _serving(body.model, state, config)
        prompt = _render_chat(body, state, config)
        fields = cls._fields(body, backend, [prompt.ids], config, body.logprobs, body.top_logprobs or 0)
        parser = OutputParser.for_prompt(
            prompt.generation_prompt, body.parses_tool_calls, prompt.prefill, prompt.tool_syntax
        )
        return cls(parser=parser, **fields)

    def delta(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
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
        return {"index": index, "delta": message, "logprobs": logprobs, "finish_reason": self._finish_reason(output)}

    def final(self, index: int, outputs: list[RequestOutput]) -> dict[str, Any]:
        parsed = ParsedDelta()
        for output in outputs:
            parsed.extend(self.parser.feed(output.text))
        parsed.extend(self.parser.finish())
        message = {"role": "assistant", **message_fields(parsed, self.parser.has_reasoning)}
        logprobs = self._logprobs([lp for output in outputs for lp in output.logprobs])
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": self._finish_reason(outputs[-1])}

    def _finish_reason(self, output: RequestOutput) -> str | None:
        if output.finish_reason is None:
            return None
        if output.finish_reason.value == "stop" and self.parser.num_tool_calls:
            return "tool_calls"
        return output.finish_reason.value

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if not self.generations[0].params.logprobs or not entries:
            return None
        return {"content": [_chat_logprob(self.tokenizer, entry) for entry in entries]}


@dataclass
class _CompletionJob(_Job):
    num_logprobs: int | None = None

    endpoint = "/v1/completions"
    object_name = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    @classmethod
    def build(cls, body: CompletionRequest, state: ServerState, config: ServeConfig) -> _CompletionJob:
        backend = _serving(body.model, state, config)
        prompts = [_prompt_ids(prompt, backend.tokenizer) for prompt in body.prompts]
        fields = cls._fields(body, backend, prompts, config, body.logprobs is not None, body.logprobs or 0)
        return cls(num_logprobs=body.logprobs, **fields)

    def delta(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        if not output.text and not output.finished:
            return None
        return self._choice(index, output.text, output.logprobs, output)

    def final(self, index: int, outputs: list[RequestOutput]) -> dict[str, Any]:
        text = "".join(output.text for output in outputs)
        return self._choice(index, text, [lp for output in outputs for lp in output.logprobs], outputs[-1])

    def _choice(self, index: int, text: str, logprobs: list[TokenLogprobs], last: RequestOutput) -> dict[str, Any]:
        finish = last.finish_reason.value if last.finish_reason is not None else None
        return {"index": index, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish}

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
        if self.num_logprobs is None:
            return None
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
    prefill: str  # what the server appended after the generation prompt (a forced tool call's opening)
    tool_syntax: ToolCallSyntax


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
    syntax = prompt.tool_syntax
    forced = body.forced_function
    prefill = forced_call_prefill(prompt.generation_prompt, forced, syntax) if body.forces_tool_call else ""
    return _ChatPrompt(backend.tokenizer.encode(prompt.text + prefill), prompt.generation_prompt, prefill, syntax)


def _serving(model: str, state: ServerState, config: ServeConfig) -> GenerationBackend:
    """The backend, once it is ready and if `model` is the one this server serves."""
    backend = _ready(state)
    if model != config.served_model_name:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {config.served_model_name!r}",
            param="model", code="model_not_found",
        )
    return backend


def _prompt_ids(prompt: str | list[int], tokenizer: Tokenizer) -> list[int]:
    return tokenizer.encode(prompt) if isinstance(prompt, str) else prompt


def _single_prompt(body: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
    if len(body.prompts) != 1:
        raise bad_request("/tokenize takes one prompt", param="prompt")
    return _prompt_ids(body.prompts[0], tokenizer)


def _generation(
    body: ChatCompletionRequest | CompletionRequest,
    prompt_ids: list[int],
    backend: GenerationBackend,
    config: ServeConfig,
    logprobs: bool,
    top_logprobs: int,
    prompt_param: str,
) -> Generation:
    """The one validation of a prompt and its parameters: everything the engine would refuse is a 400 here."""
    _check_prompt(prompt_ids, backend, prompt_param)
    limit = backend.context_limit
    max_tokens = body.requested_max_tokens
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
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return Generation(prompt_ids, params)


def _check_prompt(prompt_ids: list[int], backend: GenerationBackend, param: str) -> None:
    if not prompt_ids:
        raise bad_request("the prompt must contain at least one token", param=param)
    if min(prompt_ids) < 0 or max(prompt_ids) >= backend.vocab_size:
        raise bad_request(f"prompt token ids must be in [0, {backend.vocab_size})", param=param)
    if len(prompt_ids) >= backend.context_limit:  # no room left for even one generated token
        raise bad_request(
            f"this model's maximum context length is {backend.context_limit} tokens, but the prompt has "
            f"{len(prompt_ids)} tokens",
            param=param, code="context_length_exceeded",
        )


def _chat_logprob(tokenizer: Tokenizer, entry: TokenLogprobs) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def _usage(stats: list[RequestStats]) -> dict[str, Any]:
    """Usage of a whole response: the sum over its choices."""
    prompt = sum(s.prompt_tokens for s in stats)
    completion = sum(s.completion_tokens for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in stats)},
    }


# -- running a job ------------------------------------------------------------------------------------------


async def _serve(
    request: Request, state: ServerState, metrics: ServerMetrics, config: ServeConfig, job: _Job
) -> Response:
    backend = _ready(state)
    _take_slots(state, config, len(job.generations))
    outputs = _Merged([
        _Outputs(state, metrics, backend.generate(generation, job.request_id)) for generation in job.generations
    ])
    if job.stream:
        # The background task releases the slots even when the client leaves before the body starts
        # (then `_sse` never runs, so its `finally` cannot); aclose is idempotent.
        return StreamingResponse(
            _sse(job, outputs, metrics), media_type="text/event-stream", background=BackgroundTask(outputs.aclose)
        )
    collected: list[list[RequestOutput]] = [[] for _ in job.generations]
    try:
        async for index, output in outputs:
            collected[index].append(output)
    finally:
        await outputs.aclose()
    metrics.request_done(job.endpoint, 200)
    stats = [choice[-1].stats for choice in collected]
    usage = _usage(stats) if all(stats) else None  # type: ignore[arg-type]
    return JSONResponse(job.envelope([job.final(i, choice) for i, choice in enumerate(collected)], usage, chunk=False))


def _take_slots(state: ServerState, config: ServeConfig, wanted: int) -> None:
    """Checks that `wanted` more requests fit in flight (each prompt of a batch is one); _Outputs takes them."""
    capacity = config.max_concurrency + config.max_queue
    if wanted > capacity:  # retrying would never help: a 400, not a 429
        raise bad_request(f"at most {capacity} prompts fit in one request on this server", param="prompt")
    if state.in_flight + wanted > capacity:
        raise APIError(
            429, f"the server is at capacity ({capacity} requests in flight); retry shortly",
            type="rate_limit_error", code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class _Outputs:
    """A request's outputs; records latencies, turns a backend failure into a fatal server state, and holds
    an in-flight slot from construction until it is released, exactly once however the consumer stops
    (done, error, client gone)."""

    def __init__(self, state: ServerState, metrics: ServerMetrics, source: AsyncIterator[RequestOutput]) -> None:
        self._state = state
        self._metrics = metrics
        self._source = source
        self._closed = False
        state.in_flight += 1

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


class _Merged:
    """The outputs of a response's choices as one stream of (choice index, output), in the order the
    engine produces them (a batch of prompts runs concurrently, so its streamed choices interleave)."""

    def __init__(self, choices: list[_Outputs]) -> None:
        self._choices = choices

    def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        iterators = [aiter(choice) for choice in self._choices]
        waiting = {asyncio.create_task(_next(it)): index for index, it in enumerate(iterators)}
        try:
            while waiting:
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=waiting.__getitem__):  # same-moment outputs in choice order
                    index = waiting.pop(task)
                    output = task.result()
                    if output is None:
                        continue
                    yield index, output
                    waiting[asyncio.create_task(_next(iterators[index]))] = index
        finally:
            # a failed choice or a consumer that stopped: the other choices' pending reads are cancelled,
            # which ends (and aborts) their requests before aclose releases them
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    async def aclose(self) -> None:
        for choice in self._choices:
            await choice.aclose()


async def _next(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """The next output, or None at the end (a task cannot finish with StopAsyncIteration cleanly)."""
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        return None


async def _sse(job: _Job, outputs: _Merged, metrics: ServerMetrics) -> AsyncIterator[str]:
    status = 200
    try:
        stats: list[RequestStats | None] = [None] * len(job.generations)
        async for index, output in outputs:
            choice = job.delta(index, output)
            if choice is not None:
                yield _event(job.envelope([choice], None, chunk=True))
            stats[index] = output.stats or stats[index]
        if job.include_usage and all(stats):
            yield _event(job.envelope([], _usage(stats), chunk=True))  # type: ignore[arg-type]
        yield "data: [DONE]\n\n"
    except APIError as exc:
        status = exc.status
        yield _event(exc.body())
    except asyncio.CancelledError:  # the client went away: closing the outputs aborts the requests
        status = 499
        raise
    finally:
        await outputs.aclose()
        metrics.request_done(job.endpoint, status)


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
