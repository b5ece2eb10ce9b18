"""A request body -> what the engine runs: JSON decoding, schema validation, the chat template, tokenizing,
and the one validation of prompts and parameters against the model (vocabulary, context).

This is the expensive, GIL-holding part of taking a request in (a 25 MB body decodes for hundreds of
milliseconds, a 100k-token prompt tokenizes for as long), so it runs in intake worker processes
(intake.py); its inputs (bytes) and outputs (`Prepared`: token ids, sampling parameters, what the reply's
parser needs) are plain picklable values. Every refusal is an `APIError` raised here, before anything is
queued or a stream has started.

tool_choice: "none" hides the tools; "auto" lets the model decide; "required" and a named function force a
call without constrained decoding, by prefilling the assistant turn (parsing.forced_call_prefill). What
that guarantees: a named function (or "required" with a single tool) always comes back as a call of that
function, whose arguments are the model's text (not checked against the schema); "required" with several
tools starts the reply inside a call, and the model chooses the function; if it then writes a body that
is not a call, that comes back as content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.anthropic import CountTokensRequest, MessagesRequest, as_chat_request
from ninfer_rt.serve.chat import ChatTemplate, ChatTemplateError, ReservedVariables
from ninfer_rt.serve.parsing import forced_call_prefill
from ninfer_rt.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    decode_body,
    validate_body,
)
from ninfer_rt.serve.state import SAMPLING_DEFAULT_KEYS, Generation, ServeConfig
from ninfer_rt.serve.tool_call_syntax import ToolCallSyntax


@dataclass(frozen=True)
class ModelLimits:
    context_limit: int  # prompt + output tokens one request may hold
    vocab_size: int  # prompt token ids must be in [0, vocab_size)


@dataclass(frozen=True)
class ChatPrompt:
    ids: list[int]
    generation_prompt: str
    prefill: str  # what the server appended after the generation prompt (a forced tool call's opening)
    tool_syntax: ToolCallSyntax
    parses_tool_calls: bool


@dataclass(frozen=True)
class Prepared:
    """A validated request: its generations (one per choice) and what its response needs to be shaped."""

    model: str
    stream: bool
    include_usage: bool
    generations: list[Generation]
    chat: ChatPrompt | None = None  # chat requests only
    num_logprobs: int | None = None  # /v1/completions' logprobs


@dataclass(frozen=True)
class TokenCount:
    ids: list[int]
    context_limit: int


class Preparer:
    """Everything preparation needs, built once per intake worker (or once in-process)."""

    def __init__(self, tokenizer: Tokenizer, limits: ModelLimits, config: ServeConfig) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.config = config
        source = tokenizer.chat_template
        self.template = ChatTemplate(source) if source else None

    def warm(self, raw: bytes) -> None:
        """Nothing: run once per worker so the pool's processes are up before the server says it is ready."""

    def chat(self, raw: bytes) -> Prepared:
        return self.chat_request(validate_body(decode_body(raw), ChatCompletionRequest))

    def chat_request(self, body: ChatCompletionRequest) -> Prepared:
        self._check_model(body.model)
        prompt = self.render_chat(body)
        generation = self._generation(body, prompt.ids, body.logprobs, body.top_logprobs or 0, "messages", True)
        return Prepared(**self._common(body), generations=[generation], chat=prompt)

    def messages(self, raw: bytes) -> Prepared:
        """An Anthropic Messages request, run as the chat request it translates to (anthropic.py)."""
        return self.chat_request(as_chat_request(validate_body(decode_body(raw), MessagesRequest)))

    def count_tokens(self, raw: bytes) -> TokenCount:
        body = as_chat_request(validate_body(decode_body(raw), CountTokensRequest))
        self._check_model(body.model)
        return TokenCount(self.render_chat(body).ids, self.limits.context_limit)

    def completion(self, raw: bytes) -> Prepared:
        body = validate_body(decode_body(raw), CompletionRequest)
        self._check_model(body.model)
        logprobs, top = body.logprobs is not None, body.logprobs or 0
        generations = [
            self._generation(body, self._prompt_ids(p), logprobs, top, "prompt", isinstance(p, str)) for p in body.prompts
        ]
        return Prepared(**self._common(body), generations=generations, num_logprobs=body.logprobs)

    def tokenize(self, raw: bytes) -> TokenCount:
        """vLLM's /tokenize: a chat body (it has messages) through the template, else one completion prompt."""
        data = decode_body(raw)
        if "messages" in data:
            body = validate_body(data, ChatCompletionRequest)
            self._check_model(body.model)
            return TokenCount(self.render_chat(body).ids, self.limits.context_limit)
        completion = validate_body(data, CompletionRequest)
        self._check_model(completion.model)
        if len(completion.prompts) != 1:
            raise bad_request("/tokenize takes one prompt", param="prompt")
        return TokenCount(self._prompt_ids(completion.prompts[0]), self.limits.context_limit)

    def render_chat(self, body: ChatCompletionRequest) -> ChatPrompt:
        """The chat template applied to the request, tokenized: what generation and /tokenize both see."""
        if self.template is None:
            raise bad_request("this model has no chat template; use /v1/completions")
        variables = {"preserve_thinking": self.config.preserve_thinking, **(body.chat_template_kwargs or {})}
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools] if body.parses_tool_calls else None
        try:
            prompt = self.template.render([m.for_template() for m in body.messages], tools=tools, variables=variables)
        except ReservedVariables as exc:
            raise bad_request(str(exc), param="chat_template_kwargs") from None
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None
        syntax = prompt.tool_syntax
        forced = body.forced_function
        prefill = forced_call_prefill(prompt.generation_prompt, forced, syntax) if body.forces_tool_call else ""
        ids = self.encode(prompt.text + prefill, "messages")
        return ChatPrompt(ids, prompt.generation_prompt, prefill, syntax, body.parses_tool_calls)

    def encode(self, text: str, param: str) -> list[int]:
        """The text's token ids, or a 400: JSON can carry what no tokenizer takes (lone UTF-16 surrogates)."""
        try:
            return self.tokenizer.encode(text)
        except (TypeError, ValueError) as exc:
            raise bad_request(f"{param}: the text cannot be tokenized ({exc}); is it valid Unicode?", param=param) from None

    def _check_model(self, model: str) -> None:
        served = self.config.served_model_name
        if model != served:
            raise APIError(
                404, f"the model {model!r} does not exist; this server serves {served!r}",
                param="model", code="model_not_found",
            )

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        return self.encode(prompt, "prompt") if isinstance(prompt, str) else prompt

    @staticmethod
    def _common(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return {"model": body.model, "stream": body.stream, "include_usage": include_usage}

    def _generation(
        self, body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], logprobs: bool,
        top_logprobs: int, prompt_param: str, text_round_trip: bool,
    ) -> Generation:
        """The one validation of a prompt and its parameters: everything the engine would refuse is a 400 here."""
        self._check_prompt(prompt_ids, prompt_param)
        limit = self.limits.context_limit
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # as vLLM does: whatever room the context leaves
            max_tokens = limit - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > limit:
            raise bad_request(
                f"this model's maximum context length is {limit} tokens, but {len(prompt_ids) + max_tokens} were "
                f"requested ({len(prompt_ids)} in the prompt, {max_tokens} for the completion)",
                param=body.max_tokens_param, code="context_length_exceeded",
            )
        chosen = {k: getattr(body, k) for k in SAMPLING_DEFAULT_KEYS if getattr(body, k) is not None}
        try:
            params = SamplingParams(
                **{**self.config.sampling_defaults, **chosen},
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
        return Generation(prompt_ids, params, text_round_trip)

    def _check_prompt(self, prompt_ids: list[int], param: str) -> None:
        limits = self.limits
        if not prompt_ids:
            raise bad_request("the prompt must contain at least one token", param=param)
        if min(prompt_ids) < 0 or max(prompt_ids) >= limits.vocab_size:
            raise bad_request(f"prompt token ids must be in [0, {limits.vocab_size})", param=param)
        if len(prompt_ids) >= limits.context_limit:  # no room left for even one generated token
            raise bad_request(
                f"this model's maximum context length is {limits.context_limit} tokens, but the prompt has "
                f"{len(prompt_ids)} tokens",
                param=param, code="context_length_exceeded",
            )
