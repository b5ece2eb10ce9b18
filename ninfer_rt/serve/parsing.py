"""Splits generated text into reasoning, content and tool calls, incrementally, as Qwen3 formats them.

Qwen3 writes ``<think>\\nreasoning\\n</think>\\n\\ncontent`` and calls tools with
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. The parser is a three-state machine
(content, reasoning, tool call) fed text deltas; a marker split across deltas is held back until the next
delta decides it. Rules agents rely on:

- a ``<tool_call>`` inside reasoning is reasoning text, not a call;
- a tool call whose body is not a JSON object with a string ``name`` comes back verbatim as content;
- the newlines the template itself puts around markers (after ``<think>``, before ``</think>``, between
  ``</think>`` and content, around tool calls) are not part of reasoning or content, so that sending the
  parsed message back renders exactly the tokens the model produced (the prefix cache keeps hitting).
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
# Only newlines are template glue around markers; spaces belong to the text the model wrote.
GLUE = "\n"


class _State(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


def prompt_opens_reasoning(generation_prompt: str) -> bool:
    """Whether the prompt leaves the model inside a think block (thinking templates end it with "<think>\\n")."""
    return generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE)


def prompt_closes_reasoning(generation_prompt: str) -> bool:
    """Whether the prompt already holds this turn's (empty) think block, as enable_thinking=false renders it."""
    return generation_prompt.rfind(THINK_CLOSE) > generation_prompt.rfind(THINK_OPEN)


class OutputParser:
    """Feed text deltas with `feed`, then `finish`; each returns what became final in that call."""

    def __init__(self, parse_tool_calls: bool = True, in_reasoning: bool = False, reasoning_done: bool = False) -> None:
        self._parse_tool_calls = parse_tool_calls
        self._state = _State.REASONING if in_reasoning else _State.CONTENT
        self._pending = ""  # text not yet decided: a possible marker prefix or trailing glue
        self._tool_body = ""
        self._skip_glue = in_reasoning  # drop newlines right after a marker
        # Whether the reply carries reasoning_content, "" included: a turn whose prompt held an empty think
        # block must say so, because sending "" back is what renders that block again.
        self.has_reasoning = in_reasoning or reasoning_done
        self.num_tool_calls = 0

    @classmethod
    def for_prompt(cls, generation_prompt: str, parse_tool_calls: bool) -> OutputParser:
        return cls(
            parse_tool_calls,
            in_reasoning=prompt_opens_reasoning(generation_prompt),
            reasoning_done=prompt_closes_reasoning(generation_prompt),
        )

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """End of stream: an unterminated tool call is content; held-back text is released."""
        out = ParsedDelta()
        if self._state is _State.TOOL_CALL:
            self._state = _State.CONTENT
            self._emit_text(out, TOOL_OPEN + self._tool_body + self._pending)
        else:
            self._emit_text(out, self._pending)
        self._pending = ""
        self._tool_body = ""
        return out

    def _markers(self) -> tuple[str, ...]:
        if self._state is _State.REASONING:
            return (THINK_CLOSE,)
        if self._state is _State.TOOL_CALL:
            return (TOOL_CLOSE,)
        return (THINK_OPEN, TOOL_OPEN) if self._parse_tool_calls else (THINK_OPEN,)

    def _step(self, out: ParsedDelta) -> bool:
        """Consumes pending text up to and including the next marker; False when it must wait for more."""
        if self._skip_glue:
            self._pending = self._pending.lstrip(GLUE)
            if not self._pending:
                return False
            self._skip_glue = False
        hit = _first_marker(self._pending, self._markers())
        if hit is None:
            self._emit_undecided(out)
            return False
        start, marker = hit
        self._emit_before_marker(out, self._pending[:start])
        self._pending = self._pending[start + len(marker) :]
        self._transition(out, marker)
        return True

    def _emit_undecided(self, out: ParsedDelta) -> None:
        # Hold back a possible marker prefix, and trailing newlines that a following marker would make glue.
        held = _longest_marker_prefix_suffix(self._pending, self._markers())
        safe = self._pending[: len(self._pending) - held]
        if self._state is not _State.TOOL_CALL:
            safe_kept = safe.rstrip(GLUE)
            held += len(safe) - len(safe_kept)
            safe = safe_kept
        self._pending = self._pending[len(self._pending) - held :] if held else ""
        if self._state is _State.TOOL_CALL:
            self._tool_body += safe
        else:
            self._emit_text(out, safe)

    def _emit_before_marker(self, out: ParsedDelta, text: str) -> None:
        if self._state is _State.TOOL_CALL:
            self._tool_body += text
        else:
            self._emit_text(out, text.rstrip(GLUE))

    def _transition(self, out: ParsedDelta, marker: str) -> None:
        if marker == THINK_OPEN:
            self._state = _State.REASONING
            self.has_reasoning = True
        elif marker == TOOL_OPEN:
            self._state = _State.TOOL_CALL
        else:  # THINK_CLOSE or TOOL_CLOSE
            if marker == TOOL_CLOSE:
                self._close_tool_call(out)
            self._state = _State.CONTENT
        # A tool-call body keeps its newlines so a malformed one comes back exactly as written.
        self._skip_glue = self._state is not _State.TOOL_CALL

    def _close_tool_call(self, out: ParsedDelta) -> None:
        call = parse_tool_call(self._tool_body)
        if call is None:
            # Malformed calls go back to the client as the text the model wrote, never as an error.
            out.content += TOOL_OPEN + self._tool_body + TOOL_CLOSE
        else:
            out.tool_calls.append(call)
            self.num_tool_calls += 1
        self._tool_body = ""

    def _emit_text(self, out: ParsedDelta, text: str) -> None:
        if self._state is _State.REASONING:
            out.reasoning += text
        else:
            out.content += text


def message_fields(out: ParsedDelta, has_reasoning: bool) -> dict[str, Any]:
    """An assistant message's content, reasoning_content and tool_calls as OpenAI returns them."""
    fields: dict[str, Any] = {
        "content": out.content if out.content or not out.tool_calls else None,
        "reasoning_content": out.reasoning if has_reasoning else None,
    }
    if out.tool_calls:
        fields["tool_calls"] = [tool_call_json(call) for call in out.tool_calls]
    return fields


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A tool call in OpenAI's shape; streamed calls also carry their index in the message."""
    data: dict[str, Any] = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    if index is not None:
        data["index"] = index
    return data


def parse_tool_call(body: str) -> ToolCall | None:
    """A Qwen3 tool-call body, or None if it is not a JSON object with a string name."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if not isinstance(arguments, str):
        # json.dumps' default separators are what the chat template's tojson writes back: same tokens.
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name=call["name"], arguments=arguments)


def parse_complete(text: str, parse_tool_calls: bool = True, in_reasoning: bool = False) -> ParsedDelta:
    parser = OutputParser(parse_tool_calls, in_reasoning=in_reasoning)
    out = parser.feed(text)
    out.extend(parser.finish())
    return out


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(i, m) for m in markers if (i := text.find(m)) >= 0]
    return min(hits) if hits else None


def _longest_marker_prefix_suffix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    for length in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-length:]) for m in markers):
            return length
    return 0
