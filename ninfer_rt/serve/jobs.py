"""Request jobs: a prepared request (prepare.py) -> the response's shapes, as one JSON body or as chunks.

`/v1/completions` takes a batch of prompts (texts or token-id lists): one choice each, usage summed.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.engine.sampling import TokenLogprobs
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.serve.parsed_reply import ParsedDelta, message_fields
from ninfer_rt.serve.parsing import OutputParser
from ninfer_rt.serve.prepare import Prepared
from ninfer_rt.serve.protocol import APIError
from ninfer_rt.serve.state import Generation

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
    def _fields(cls, prepared: Prepared, tokenizer: Tokenizer) -> dict[str, Any]:
        """The fields both endpoints fill the same way from the prepared request."""
        return {
            "request_id": f"{cls.id_prefix}-{uuid.uuid4().hex}",
            "model": prepared.model,
            "generations": prepared.generations,
            "stream": prepared.stream,
            "include_usage": prepared.include_usage,
            "tokenizer": tokenizer,
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

    def response_body(self, collected: list[list[RequestOutput]]) -> dict[str, Any]:
        """The non-streamed response from each choice's outputs."""
        stats = [choice[-1].stats for choice in collected]
        total = usage(stats) if all(stats) else None  # type: ignore[arg-type]
        return self.envelope([self.final(i, choice) for i, choice in enumerate(collected)], total, chunk=False)

    def events(self, index: int, output: RequestOutput) -> list[str]:
        """The SSE events `output` of choice `index` adds to the stream."""
        choice = self.delta(index, output)
        return [] if choice is None else [sse_event(self.envelope([choice], None, chunk=True))]

    def closing_events(self, stats: list[RequestStats | None]) -> list[str]:
        """What ends a stream whose generations all finished: the usage chunk when asked for, and [DONE]."""
        events = []
        if self.include_usage and all(stats):
            events.append(sse_event(self.envelope([], usage(stats), chunk=True)))  # type: ignore[arg-type]
        return [*events, "data: [DONE]\n\n"]

    def error_event(self, error: APIError) -> str:
        return sse_event(error.body())

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
    def build(cls, prepared: Prepared, tokenizer: Tokenizer) -> ChatJob:
        prompt = prepared.chat
        assert prompt is not None, "a chat job is built from a prepared chat request"
        parser = OutputParser.for_prompt(
            prompt.generation_prompt, prompt.parses_tool_calls, prompt.prefill, prompt.tool_syntax
        )
        return cls(parser=parser, **cls._fields(prepared, tokenizer))

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
    def build(cls, prepared: Prepared, tokenizer: Tokenizer) -> CompletionJob:
        return cls(num_logprobs=prepared.num_logprobs, **cls._fields(prepared, tokenizer))

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


# Line breaks to Python's str.splitlines (and so to httpx's iter_lines) that JSON leaves raw in a string:
# a client splitting lines that way would cut a data line in two; escaped, the JSON is the same.
_RAW_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_event(data: dict[str, Any], name: str | None = None) -> str:
    # allow_nan=False: NaN / Infinity are not JSON; a value that slipped through fails loudly here
    event = f"event: {name}\n" if name is not None else ""
    payload = json.dumps(data, ensure_ascii=False, allow_nan=False).translate(_RAW_LINE_BREAKS)
    return f"{event}data: {payload}\n\n"


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
