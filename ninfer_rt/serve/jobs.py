"""Request jobs: a parsed request -> validated `Generation`s (one per choice) and the response's shapes.

Validation happens once, here: a request that parses (protocol.py) is turned into `Generation`s whose
prompts and parameters fit the model (vocabulary, context), so every refusal is a 400 before anything is
queued or a stream has started. `/v1/completions` takes a batch of prompts (texts or token-id lists): one
choice each, usage summed.

tool_choice: "none" hides the tools; "auto" lets the model decide; "required" and a named function force a
call without constrained decoding, by prefilling the assistant turn (parsing.forced_call_prefill). What
that guarantees: a named function (or "required" with a single tool) always comes back as a call of that
function, whose arguments are the model's text (not checked against the schema); "required" with several
tools starts the reply inside a call, and the model chooses the function; if it then writes a body that
is not a call, that comes back as content.
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.engine.sampling import TokenLogprobs
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.chat import ChatTemplateError, ReservedVariables
from ninfer_rt.serve.parsing import OutputParser, ParsedDelta, forced_call_prefill, message_fields
from ninfer_rt.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from ninfer_rt.serve.tool_call_syntax import ToolCallSyntax
from ninfer_rt.serve.state import (
    SAMPLING_DEFAULT_KEYS,
    Generation,
    GenerationBackend,
    ServeConfig,
    ServerState,
    ready,
)

LOGPROB_FLOOR = -9999.0


@dataclass
class Job:
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
class ChatJob(Job):
    parser: OutputParser = field(default_factory=OutputParser)  # one: a chat request has one choice (n=1)
    sent_role: bool = False

    endpoint = "/v1/chat/completions"
    object_name = "chat.completion"
    id_prefix = "chatcmpl"
    prompt_param = "messages"

    @classmethod
    def build(cls, body: ChatCompletionRequest, state: ServerState, config: ServeConfig) -> ChatJob:
        backend = serving(body.model, state, config)
        prompt = render_chat(body, state, config)
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
class CompletionJob(Job):
    num_logprobs: int | None = None

    endpoint = "/v1/completions"
    object_name = "text_completion"
    id_prefix = "cmpl"
    prompt_param = "prompt"

    @classmethod
    def build(cls, body: CompletionRequest, state: ServerState, config: ServeConfig) -> CompletionJob:
        backend = serving(body.model, state, config)
        prompts = [_prompt_ids(prompt, backend.tokenizer) for prompt in body.prompts]
        fields = cls._fields(body, backend, prompts, config, body.logprobs is not None, body.logprobs or 0)
        return cls(num_logprobs=body.logprobs, **fields)

    def delta(self, index: int, output: RequestOutput) -> dict[str, Any] | None:
        if not output.text and not output.logprobs and not output.finished:  # a token's logprobs go out with it
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
        entries = [finite_logprobs(e) for e in entries]
        tokens = [self.tokenizer.decode([e.token_id]) for e in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.tokenizer.decode([t]): lp for t, lp in e.top} for e in entries],
            "text_offset": [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))],
        }


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    generation_prompt: str
    prefill: str  # what the server appended after the generation prompt (a forced tool call's opening)
    tool_syntax: ToolCallSyntax


def render_chat(body: ChatCompletionRequest, state: ServerState, config: ServeConfig) -> ChatPrompt:
    """The chat template applied to the request, tokenized: what generation and /tokenize both see."""
    backend = ready(state)
    if state.template is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    variables = {"preserve_thinking": config.preserve_thinking, **(body.chat_template_kwargs or {})}
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.parses_tool_calls else None
    try:
        prompt = state.template.render([m.for_template() for m in body.messages], tools=tools, variables=variables)
    except ReservedVariables as exc:
        raise bad_request(str(exc), param="chat_template_kwargs") from None
    except ChatTemplateError as exc:
        raise bad_request(str(exc), param="messages") from None
    syntax = prompt.tool_syntax
    forced = body.forced_function
    prefill = forced_call_prefill(prompt.generation_prompt, forced, syntax) if body.forces_tool_call else ""
    ids = encode_text(backend.tokenizer, prompt.text + prefill, "messages")
    return ChatPrompt(ids, prompt.generation_prompt, prefill, syntax)


def encode_text(tokenizer: Tokenizer, text: str, param: str) -> list[int]:
    """The text's token ids, or a 400: JSON can carry what no tokenizer takes (lone UTF-16 surrogates)."""
    try:
        return tokenizer.encode(text)
    except (TypeError, ValueError) as exc:
        raise bad_request(f"{param}: the text cannot be tokenized ({exc}); is it valid Unicode?", param=param) from None


def serving(model: str, state: ServerState, config: ServeConfig) -> GenerationBackend:
    """The backend, once it is ready and if `model` is the one this server serves."""
    backend = ready(state)
    if model != config.served_model_name:
        raise APIError(
            404, f"the model {model!r} does not exist; this server serves {config.served_model_name!r}",
            param="model", code="model_not_found",
        )
    return backend


def _prompt_ids(prompt: str | list[int], tokenizer: Tokenizer) -> list[int]:
    return encode_text(tokenizer, prompt, "prompt") if isinstance(prompt, str) else prompt


def single_prompt(body: CompletionRequest, tokenizer: Tokenizer) -> list[int]:
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
    except ValueError as exc:  # a range the request schema does not bound (e.g. a server default)
        named = str(exc).split(" ", 1)[0]
        raise bad_request(str(exc), param=named if hasattr(body, named) else None) from None
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


def finite_logprobs(entry: TokenLogprobs) -> TokenLogprobs:
    """The entry as JSON can carry it. A top alternative outside the top-k / top-p / min-p support has
    probability 0 (logprob -inf): it is left out, as OpenAI lists only tokens the model could have chosen,
    so `top_logprobs` may hold fewer than asked. A chosen token's non-finite logprob (NaN logits) is
    clamped to -9999.0, the floor OpenAI itself reports."""
    logprob = entry.logprob if math.isfinite(entry.logprob) else LOGPROB_FLOOR
    top = tuple((token, lp) for token, lp in entry.top if math.isfinite(lp))
    return TokenLogprobs(entry.token_id, logprob, top)


def _chat_logprob(tokenizer: Tokenizer, entry: TokenLogprobs) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text = tokenizer.decode([token_id])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

    entry = finite_logprobs(entry)
    return {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def usage(stats: list[RequestStats]) -> dict[str, Any]:
    """Usage of a whole response: the sum over its choices."""
    prompt = sum(s.prompt_tokens for s in stats)
    completion = sum(s.completion_tokens for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in stats)},
    }
