"""The trace format: one JSON object per line, one line per request ("turn").

A trace describes what is NEW in each turn, never the full messages: a conversation turn re-sends the
previous messages plus the assistant reply the server actually gave, and only then the new content. That
is what makes prefix-cache hits real (the server sees its own output come back), so the replayer builds
the messages from the replies it received (runner.py).

New content is literal text or a count of words synthesized from WORDS. Every word in WORDS is one token
after a space for the tiny test tokenizer and for Qwen3's, so "N words" is about N tokens for both. Where a
test needs an exact token count (a prompt length ≡ 41 mod 64), a turn either asks the replayer to pad its
words until the server's /tokenize says so (`align`), or uses the completions route with token ids.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

# Common English and code words, each a single token after a space in the tiny model's tokenizer (a test
# checks this) and in Qwen3's vocabulary.
WORDS = (
    "None Path The and as assistant config conversation def for if in int is json key list main max model "
    "not numbers of prompt read request return self sum test that the them time token value with"
).split()

# Token ids for the completions route: ordinary (non-special) tokens in the tiny vocabulary (512) and in
# every real Qwen3/Llama vocabulary.
TOKEN_ID_RANGE = (256, 500)

# Tools a turn can offer, by name; the trace names them instead of repeating their JSON schemas.
TOOL_SPECS: dict[str, dict[str, Any]] = {
    "read_file": {
        "description": "Read a file from the workspace",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
    "run_shell": {
        "description": "Run a shell command and return its output",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
    "edit_file": {
        "description": "Replace text in a file",
        "parameters": {
            "type": "object",
            "properties": {"path": {"type": "string"}, "old": {"type": "string"}, "new": {"type": "string"}},
            "required": ["path", "old", "new"],
        },
    },
}

Route = Literal["chat", "completions"]
Content = str | int  # literal text, or a number of words (chat) / token ids (completions) to synthesize


@dataclass(frozen=True)
class Turn:
    """One request. Turns of a lane run one after another; lanes run concurrently. Turns of a
    conversation build on each other (a conversation belongs to one lane)."""

    lane: str
    content: Content  # the new user (or tool) content
    conversation: str = ""  # defaults to the lane's name
    route: Route = "chat"
    role: Literal["user", "tool"] = "user"  # "tool" answers the previous reply's tool calls (user if it made none)
    system: Content | None = None  # set (or rotate) the conversation's system prompt
    messages: tuple[dict[str, Any], ...] = ()  # scripted messages before the new content (tool calls, results)
    tools: tuple[str, ...] = ()  # names from TOOL_SPECS
    thinking: bool | None = None  # chat_template_kwargs.enable_thinking; None: the template's default
    reset: bool = False  # forget the conversation's history first
    align: int | None = None  # pad the new content so the prompt length ≡ align (mod ALIGN_PAGE)
    think_s: float = 0.0  # pause before sending (an agent reading the last reply, a user typing)
    max_tokens: int = 64
    stream: bool = False
    ignore_eos: bool = False  # fixed reply lengths: conversations grow by a known amount per turn
    seed: int = 0  # of the synthesized words or ids, so a trace replays the same text every time

    def __post_init__(self) -> None:
        if not self.conversation:
            object.__setattr__(self, "conversation", self.lane)
        unknown = set(self.tools) - set(TOOL_SPECS)
        if unknown:
            raise ValueError(f"unknown tools {sorted(unknown)}; known: {sorted(TOOL_SPECS)}")
        if self.route == "completions" and not isinstance(self.content, int):
            raise ValueError("a completions turn's content is a token count (its prompt is token ids)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")

    def to_json(self) -> dict[str, Any]:
        """Only the fields that differ from the defaults: traces stay readable."""
        defaults = Turn(lane=self.lane, content=self.content)
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) != getattr(defaults, f.name)}
        out = {"lane": self.lane, "content": self.content, **out}
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Turn:
        known = {f.name for f in fields(cls)}
        extra = set(data) - known
        if extra:
            raise ValueError(f"unknown trace fields {sorted(extra)}")
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()}
        return cls(**values)


ALIGN_PAGE = 64  # the page size whose alignment `align` targets (the server's default --page-size)


def synth_words(count: int, seed: int) -> str:
    """`count` words from WORDS, the same for the same seed."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(count))


def synth_ids(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(count)]


def text_of(content: Content, seed: int) -> str:
    return content if isinstance(content, str) else synth_words(content, seed)


def tool_specs(names: Iterable[str]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": name, **TOOL_SPECS[name]}} for name in names]


def write_trace(turns: Iterable[Turn], path: str | Path) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as out:
        for turn in turns:
            out.write(json.dumps(turn.to_json(), ensure_ascii=False) + "\n")
            count += 1
    return count


def read_trace(path: str | Path) -> list[Turn]:
    """The turns of a trace file; a bad line is an error naming its line number."""
    return list(_parse_lines(Path(path).read_text(encoding="utf-8").splitlines(), str(path)))


def _parse_lines(lines: list[str], name: str) -> Iterator[Turn]:
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield Turn.from_json(json.loads(line))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{name}:{number}: {exc}") from None


@dataclass
class TraceStats:
    """What a trace asks for, before it runs (printed by the generator)."""

    requests: int = 0
    lanes: set[str] = field(default_factory=set)
    conversations: set[str] = field(default_factory=set)
    new_units: int = 0  # words and token ids of new content and system prompts: about their tokens
    max_tokens: int = 0

    @classmethod
    def of(cls, turns: Iterable[Turn]) -> TraceStats:
        stats = cls()
        for turn in turns:
            stats.requests += 1
            stats.lanes.add(turn.lane)
            stats.conversations.add(turn.conversation)
            stats.new_units += sum(_units(c) for c in (turn.content, turn.system) if c is not None)
            stats.max_tokens += turn.max_tokens
        return stats

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "lanes": len(self.lanes), "conversations": len(self.conversations)}


def _units(content: Content) -> int:
    return content if isinstance(content, int) else len(content.split())
