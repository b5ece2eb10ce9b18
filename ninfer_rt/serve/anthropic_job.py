"""Anthropic Messages responses: the chat job's parsed output (reasoning, text, tool calls) as content
blocks, whole or as Anthropic's SSE events.

A stream is message_start, then per block content_block_start / content_block_delta (thinking_delta,
text_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason and the usage, now
final: input_tokens are the uncached prompt tokens, cache_read_input_tokens the ones the prefix cache
served) and message_stop. A tool call's arguments stream as the model writes them (as OpenAI's
deltas do); in the whole message, `input` is the arguments decoded, or {} when the model wrote
something that is not a JSON object.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ninfer_rt.engine.output import RequestOutput, RequestStats
from ninfer_rt.serve.errors import anthropic_body
from ninfer_rt.serve.jobs import ChatJob, sse_event
from ninfer_rt.serve.parsed_reply import ParsedDelta, ToolCallDelta
from ninfer_rt.serve.protocol import APIError


@dataclass
class MessagesJob(ChatJob):
    block_index: int = -1  # the content block being streamed
    block_kind: str | None = None  # its type: thinking, text, tool_use; None before the first or after a stop

    endpoint = "/v1/messages"
    id_prefix = "msg"

    def response_body(self, collected: list[list[RequestOutput]]) -> dict[str, Any]:
        outputs = collected[0]
        parsed = ParsedDelta()
        for output in outputs:
            parsed.extend(self.parser.feed(output.text))
        parsed.extend(self.parser.finish())
        content: list[dict[str, Any]] = []
        if parsed.reasoning:
            content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
        if parsed.content:
            content.append({"type": "text", "text": parsed.content})
        content.extend(_tool_use(call, _decoded(call.arguments)) for call in parsed.tool_calls)
        stats = outputs[-1].stats
        return {**self._message(content, self._stop_reason(outputs[-1])), "usage": _usage(stats)}

    def events(self, index: int, output: RequestOutput) -> list[str]:
        events = [] if self.sent_role else [self._message_start()]
        self.sent_role = True
        parsed = self.parser.feed(output.text)
        if output.finished:
            parsed.extend(self.parser.finish())
        if parsed.reasoning:
            events += self._into_block("thinking", {"thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": parsed.reasoning}))
        if parsed.content:
            events += self._into_block("text", {"text": ""})
            events.append(self._delta({"type": "text_delta", "text": parsed.content}))
        for call in parsed.tool_calls:
            if call.id is not None:  # a new call: its own block
                events += self._close_block()
                events += self._into_block("tool_use", _tool_use(call, {}))
            if call.arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        if output.finished:
            events += self._close_block()
            events += self._message_end(output)
        return events

    def closing_events(self, stats: list[RequestStats | None]) -> list[str]:
        return []  # message_stop went out with the last output

    def error_event(self, error: APIError) -> str:
        return sse_event(anthropic_body(error), "error")

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None) -> dict[str, Any]:
        return {
            "id": self.request_id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": None,
        }

    def _message_start(self) -> str:
        prompt = len(self.generations[0].prompt_ids)
        usage = {"input_tokens": prompt, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
        return sse_event({"type": "message_start", "message": {**self._message([], None), "usage": usage}}, "message_start")

    def _message_end(self, output: RequestOutput) -> list[str]:
        delta = {"stop_reason": self._stop_reason(output), "stop_sequence": None}
        end = {"type": "message_delta", "delta": delta, "usage": _usage(output.stats)}
        return [sse_event(end, "message_delta"), sse_event({"type": "message_stop"}, "message_stop")]

    def _into_block(self, kind: str, start: dict[str, Any]) -> list[str]:
        """Events that make a block of `kind` the open one (nothing when it already is)."""
        if self.block_kind == kind and kind != "tool_use":
            return []
        events = self._close_block()
        self.block_index += 1
        self.block_kind = kind
        block = {"type": kind, **start}
        event = {"type": "content_block_start", "index": self.block_index, "content_block": block}
        return [*events, sse_event(event, "content_block_start")]

    def _close_block(self) -> list[str]:
        if self.block_kind is None:
            return []
        self.block_kind = None
        return [sse_event({"type": "content_block_stop", "index": self.block_index}, "content_block_stop")]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event({"type": "content_block_delta", "index": self.block_index, "delta": delta}, "content_block_delta")

    def _stop_reason(self, output: RequestOutput) -> str | None:
        reason = self._finish_reason(output)
        return {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}.get(reason or "", reason)


def _tool_use(call: ToolCallDelta, arguments: dict[str, Any]) -> dict[str, Any]:
    tool_id = "toolu_" + (call.id or uuid.uuid4().hex).removeprefix("call_")
    return {"type": "tool_use", "id": tool_id, "name": call.name, "input": arguments}


def _decoded(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _usage(stats: RequestStats | None) -> dict[str, Any]:
    if stats is None:
        return {"input_tokens": 0, "output_tokens": 0}
    return {
        "input_tokens": stats.prompt_tokens - stats.cached_tokens,
        "output_tokens": stats.completion_tokens,
        "cache_read_input_tokens": stats.cached_tokens,
        "cache_creation_input_tokens": 0,
    }
