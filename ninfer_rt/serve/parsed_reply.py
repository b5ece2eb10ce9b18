"""The parsed reply (parsing.py's output): reasoning, content and tool-call pieces, merged over a reply, and
how OpenAI's API carries them (a streamed chunk's tool-call piece, a message's fields).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, replace
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallDelta:
    """A piece of tool call `index`: its first piece carries id and name, every piece an arguments fragment.
    Merged (ParsedDelta.extend) over a whole reply, it is the complete call."""

    index: int
    arguments: str = ""  # a fragment of the JSON text OpenAI's API carries
    id: str | None = None
    name: str | None = None

    def stream_json(self) -> dict[str, Any]:
        """The piece as a streamed chat chunk carries it: index always, id/type/name on the first piece only."""
        data: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {}
        if self.id is not None:
            data.update(id=self.id, type="function")
            function["name"] = self.name
        function["arguments"] = self.arguments
        data["function"] = function
        return data

    def message_json(self) -> dict[str, Any]:
        """The merged call as a non-streamed message carries it."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedDelta:
    """What became final in one `OutputParser.feed` or `finish` call; extended over a whole reply, the reply."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: ParsedDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        for call in other.tool_calls:
            self.add_call(call)

    def add_call(self, piece: ToolCallDelta) -> None:
        """Appends a piece, merged into the last one when it continues the same call (one delta per call)."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == piece.index:
            last.arguments += piece.arguments  # later pieces of a call carry no id or name
        else:
            self.tool_calls.append(replace(piece))  # a copy: merging must not change the caller's piece



def message_fields(out: ParsedDelta, has_reasoning: bool) -> dict[str, Any]:
    """An assistant message's content, reasoning_content and tool_calls as OpenAI returns them."""
    fields: dict[str, Any] = {
        "content": out.content if out.content or not out.tool_calls else None,
        "reasoning_content": out.reasoning if has_reasoning else None,
    }
    if out.tool_calls:
        fields["tool_calls"] = [call.message_json() for call in out.tool_calls]
    return fields
