"""Splits generated text into reasoning, content and tool calls, incrementally, as Qwen3 formats them.

Qwen3 writes ``<think>\\nreasoning\\n</think>\\n\\ncontent`` and calls tools with
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. The parser is a three-state machine
(content, reasoning, tool call) fed text deltas; a marker split across deltas is held back until the next
delta decides it. Rules agents rely on:

- a ``<tool_call>`` inside reasoning is reasoning text, not a call;
- a tool call is streamed as it is generated, as OpenAI and vLLM do: once its body has opened with
  ``{"name": "...", "arguments":`` the call's first delta carries its index, id and name, and later deltas
  carry the arguments text as the model writes it (without the body's closing brace), so the fragments
  concatenate to the final ``arguments``. From that point the call cannot be taken back: arguments that
  turn out not to be valid JSON (or are cut off by max_tokens) still come back as that call's arguments;
- a body whose opening is not that (not JSON, no string ``name``) comes back verbatim as content, unless
  it is a whole JSON object with a string ``name`` in another key order, which is a call at its close;
- arguments are the model's own text, not re-serialized: the chat template writes a string ``arguments``
  back verbatim, so the next turn renders the very tokens the model produced;
- the newlines the template itself puts around markers (after ``<think>``, before ``</think>``, between
  ``</think>`` and content, around tool calls) are not part of reasoning or content, so that sending the
  parsed message back renders exactly the tokens the model produced (the prefix cache keeps hitting).

Qwen3.5 / Qwen3.6 templates write the body in an XML-like form instead (``<function=NAME>`` and
``<parameter=KEY>`` blocks); the syntax the chat template uses is passed in (tool_call_syntax.py), and
tool_calls_xml.py parses that body. Markers, reasoning and glue are handled here alike for both. What the
parser emits, and how the API carries it, is parsed_reply.py's.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from ninfer_rt.serve.parsed_reply import ParsedDelta, ToolCallDelta, new_call_id
from ninfer_rt.serve.tool_call_syntax import JsonToolCalls, ToolCallSyntax
from ninfer_rt.serve.tool_calls_xml import XmlCallBody, XmlCallPiece, XmlToolCalls

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
# Only newlines are template glue around markers; spaces belong to the text the model wrote.
GLUE = "\n"
# The opening of a Qwen3 tool-call body, as the chat template writes it: once it is complete the call's
# name is known and everything after it is the arguments value.
_CALL_OPENING = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:')


class _State(enum.Enum):
    CONTENT = "content"
    REASONING = "reasoning"
    TOOL_CALL = "tool_call"


@dataclass
class _OpenCall:
    """The tool call being generated, once its opening is complete."""

    index: int
    arguments_start: int  # where the arguments value starts in the body (after its leading whitespace)
    streams_raw: bool | None = None  # an object is streamed as written; None until its first character shows
    sent: int = 0  # characters of the arguments already emitted


def prompt_opens_reasoning(generation_prompt: str) -> bool:
    """Whether the prompt leaves the model inside a think block (thinking templates end it with "<think>\\n")."""
    return generation_prompt.rfind(THINK_OPEN) > generation_prompt.rfind(THINK_CLOSE)


def prompt_closes_reasoning(generation_prompt: str) -> bool:
    """Whether the prompt already holds this turn's (empty) think block, as enable_thinking=false renders it."""
    return generation_prompt.rfind(THINK_CLOSE) > generation_prompt.rfind(THINK_OPEN)


def forced_call_prefill(
    generation_prompt: str, function: str | None, syntax: ToolCallSyntax = JsonToolCalls()
) -> str:
    """What the server appends to the prompt so that the reply is a tool call (tool_choice "required" or a
    named function), for a model without constrained decoding: a think block the prompt opened is closed
    empty (as the template renders a turn without reasoning), then the call is opened; for a known function
    its opening is written up to the arguments, exactly as the template writes it back, so the name is
    certain and the model only writes the arguments. Without a known function the model writes the body and
    may still write one that is not a call; it then comes back as content."""
    close_thinking = "\n" + THINK_CLOSE + "\n\n" if prompt_opens_reasoning(generation_prompt) else ""
    return close_thinking + TOOL_OPEN + syntax.forced_opening(function)


class OutputParser:
    """Feed text deltas with `feed`, then `finish`; each returns what became final in that call."""

    def __init__(
        self,
        parse_tool_calls: bool = True,
        in_reasoning: bool = False,
        reasoning_done: bool = False,
        prefill: str = "",
        syntax: ToolCallSyntax = JsonToolCalls(),
    ) -> None:
        self._parse_tool_calls = parse_tool_calls
        self._xml_syntax = syntax if isinstance(syntax, XmlToolCalls) else None
        self._xml_call: XmlCallBody | None = None
        self._state = _State.REASONING if in_reasoning else _State.CONTENT
        # Text not yet decided: a possible marker prefix or trailing glue. A prefill (text the server appended
        # to the prompt, e.g. a forced tool call's opening) is parsed as the start of the reply.
        self._pending = prefill
        self._tool_body = ""
        self._call: _OpenCall | None = None
        self._skip_glue = in_reasoning  # drop newlines right after a marker
        # Whether the reply carries reasoning_content, "" included: a turn whose prompt held an empty think
        # block must say so, because sending "" back is what renders that block again.
        self.has_reasoning = in_reasoning or reasoning_done
        self.num_tool_calls = 0

    @classmethod
    def for_prompt(
        cls,
        generation_prompt: str,
        parse_tool_calls: bool,
        prefill: str = "",
        syntax: ToolCallSyntax = JsonToolCalls(),
    ) -> OutputParser:
        return cls(
            parse_tool_calls,
            in_reasoning=prompt_opens_reasoning(generation_prompt),
            reasoning_done=prompt_closes_reasoning(generation_prompt),
            prefill=prefill,
            syntax=syntax,
        )

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._step(out):
            pass
        return out

    def finish(self) -> ParsedDelta:
        """End of stream: an unterminated tool call is content, or, once opened, a call with the arguments it
        got; held-back text is released."""
        out = ParsedDelta()
        if self._state is _State.TOOL_CALL:
            self._tool_body += self._pending
            self._state = _State.CONTENT
            if self._call_opened():
                self._close_tool_call(out)
            else:
                self._emit_text(out, TOOL_OPEN + self._tool_body)
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
            self._grow_tool_body(out, safe)
        else:
            self._emit_text(out, safe)

    def _emit_before_marker(self, out: ParsedDelta, text: str) -> None:
        if self._state is _State.TOOL_CALL:
            self._grow_tool_body(out, text)
        else:
            self._emit_text(out, text.rstrip(GLUE))

    def _grow_tool_body(self, out: ParsedDelta, text: str) -> None:
        """Adds generated text to the open call's body and emits what became known: the call's opening
        (id, name), then its arguments as far as they are certain."""
        self._tool_body += text
        if self._xml_syntax is not None:
            self._grow_xml_call(out)
            return
        if self._call is None:
            self._open_call(out)
        if self._call is not None and self._decide_arguments(self._call) and self._call.streams_raw:
            self._emit_arguments(out, _arguments_so_far(self._tool_body[self._call.arguments_start :]))

    def _call_opened(self) -> bool:
        return self._call is not None or (self._xml_call is not None and self._xml_call.opened)

    def _grow_xml_call(self, out: ParsedDelta) -> None:
        assert self._xml_syntax is not None
        if self._xml_call is None:
            self._xml_call = XmlCallBody(self._xml_syntax)
        self._add_xml_pieces(out, self._xml_call.update(self._tool_body))

    def _add_xml_pieces(self, out: ParsedDelta, pieces: list[XmlCallPiece]) -> None:
        for piece in pieces:
            if piece.name is not None:  # the call opened: it takes the next index
                out.add_call(ToolCallDelta(self.num_tool_calls, id=new_call_id(), name=piece.name))
                self.num_tool_calls += 1
            else:
                out.add_call(ToolCallDelta(self.num_tool_calls - 1, arguments=piece.arguments))

    def _open_call(self, out: ParsedDelta) -> None:
        opening = _CALL_OPENING.match(self._tool_body)
        if opening is None:
            return
        self._call = _OpenCall(self.num_tool_calls, opening.end())
        self.num_tool_calls += 1
        out.add_call(ToolCallDelta(self._call.index, id=new_call_id(), name=json.loads(opening.group(1))))

    def _decide_arguments(self, call: _OpenCall) -> bool:
        """Whether the arguments' first character has shown: an object streams as written; anything else (a
        JSON string, as some models write) waits for the close, where it is decoded."""
        if call.streams_raw is None:
            rest = self._tool_body[call.arguments_start :]
            value = rest.lstrip()
            if not value:
                return False
            call.arguments_start += len(rest) - len(value)
            call.streams_raw = value.startswith("{")
        return True

    def _emit_arguments(self, out: ParsedDelta, arguments: str) -> None:
        assert self._call is not None
        fragment = arguments[self._call.sent :]
        if fragment:
            self._call.sent = len(arguments)
            out.add_call(ToolCallDelta(self._call.index, arguments=fragment))

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
        """The body is complete (or cut off): the open call gets the rest of its arguments; a body that never
        opened a call is one if it is a whole JSON call object, else it goes back as the text it was."""
        xml_call, self._xml_call = self._xml_call, None
        if xml_call is not None and xml_call.opened:
            self._add_xml_pieces(out, xml_call.close(self._tool_body))
            self._tool_body = ""
            return
        if self._call is None:
            self._close_unopened(out)
            return
        call = self._call
        self._decide_arguments(call)
        raw = _arguments_so_far(self._tool_body[call.arguments_start :])
        whole = None if call.streams_raw else parse_tool_call(self._tool_body)
        self._emit_arguments(out, raw if whole is None else whole[1])
        self._call = None
        self._tool_body = ""

    def _close_unopened(self, out: ParsedDelta) -> None:
        whole = parse_tool_call(self._tool_body)
        if whole is None:
            # Malformed calls go back to the client as the text the model wrote, never as an error.
            out.content += TOOL_OPEN + self._tool_body + TOOL_CLOSE
        else:
            out.add_call(ToolCallDelta(self.num_tool_calls, arguments=whole[1], id=new_call_id(), name=whole[0]))
            self.num_tool_calls += 1
        self._tool_body = ""

    def _emit_text(self, out: ParsedDelta, text: str) -> None:
        if self._state is _State.REASONING:
            out.reasoning += text
        else:
            out.content += text



def parse_tool_call(body: str) -> tuple[str, str] | None:
    """A whole Qwen3 tool-call body as (name, arguments JSON text), or None if it is not a JSON object with a
    string name."""
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
    return call["name"], arguments


def _arguments_so_far(text: str) -> str:
    """The arguments part of a (growing) body's text after the opening: all of it but the body's closing
    brace and the whitespace around it, which may be what the text ends with so far. Only ever grows as the
    text does, so what was emitted is always a prefix of the final arguments."""
    text = text.rstrip()
    return text.removesuffix("}").rstrip()


def parse_complete(
    text: str, parse_tool_calls: bool = True, in_reasoning: bool = False, syntax: ToolCallSyntax = JsonToolCalls()
) -> ParsedDelta:
    parser = OutputParser(parse_tool_calls, in_reasoning=in_reasoning, syntax=syntax)
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
