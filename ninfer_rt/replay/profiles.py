"""Seven request profiles, each a trace generator with a scale (1.0: the GPU full-scale run).

The original hard-lock appeared only under a real agent's traffic (profile 7); the others isolate one
ingredient of it each, so a failure points at its cause. `scale` shrinks a profile for CI: sizes (words,
token ids, max_tokens) scale linearly and turn counts with its square root, so a small profile is still a
conversation of many turns rather than three big ones; floors keep the first turn large enough that every
later turn hits the prefix cache for >= 90% of its prompt.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from ninfer_rt.replay.trace import Turn, synth_words

AGENT_TOOLS = ("read_file", "run_shell", "edit_file")
TAIL_ALIGN = 41  # an odd residue mod 64: prompts end mid-page, so the next turn must copy-on-write the tail


@dataclass(frozen=True)
class Scale:
    factor: float

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"scale must be positive, got {self.factor}")

    def size(self, full: int, floor: int) -> int:
        return max(floor, round(full * self.factor))

    def count(self, full: int, floor: int) -> int:
        return max(floor, round(full * math.sqrt(self.factor)))


def prefix_saturation(s: Scale) -> list[Turn]:
    """(1) More distinct long system prompts than the KV cache holds, revisited round-robin by two lanes:
    retained catalogs are evicted (LRU) while others are re-activated."""
    conversations, rounds = s.count(48, 8), 3
    systems = [synth_words(s.size(6000, 300), seed=1000 + c) for c in range(conversations)]
    return [
        Turn(lane=f"lane{c % 2}", conversation=f"c{c}", content=s.size(200, 12), system=systems[c] if r == 0 else None,
             max_tokens=s.size(64, 8), ignore_eos=True, seed=r * conversations + c)
        for r in range(rounds) for c in range(conversations)
    ]


def long_conversation(s: Scale) -> list[Turn]:
    """(2) One conversation growing monotonically for 60 turns: every turn re-activates the last."""
    turns = s.count(60, 12)
    system = synth_words(s.size(3000, 400), seed=2000)
    return [
        Turn(lane="main", content=s.size(150, 8), system=system if t == 0 else None, max_tokens=s.size(128, 8),
             ignore_eos=True, seed=t)
        for t in range(turns)
    ]


def tools_thinking(s: Scale) -> list[Turn]:
    """(3) Streaming with tools and thinking: reasoning and tool calls come back in the next prompt, and
    thinking toggles (enable_thinking=false renders an empty think block)."""
    turns = s.count(24, 8)
    system = synth_words(s.size(1500, 300), seed=3000)
    return [
        Turn(lane="main", content=s.size(200, 12), role="tool" if t % 2 else "user", system=system if t == 0 else None,
             tools=AGENT_TOOLS, thinking=t % 4 != 3, stream=True, max_tokens=s.size(256, 24), seed=t)
        for t in range(turns)
    ]


def dual_lane(s: Scale) -> list[Turn]:
    """(4) Two conversations at once behind one shared system prompt: both lanes read the same cached
    pages while each extends its own."""
    turns = s.count(30, 8)
    system = synth_words(s.size(2000, 300), seed=4000)
    return [
        Turn(lane=lane, content=s.size(150, 10), system=system if t == 0 else None, stream=True,
             max_tokens=s.size(200, 16), ignore_eos=True, seed=100 * i + t)
        for t in range(turns) for i, lane in enumerate(("a", "b"))
    ]


def system_rotation(s: Scale) -> list[Turn]:
    """(5) The system prompt rotates among three every turn (the whole prefix misses, then hits again three
    turns later), with scripted tool calls and tool results in the history."""
    turns = s.count(24, 9)
    systems = [synth_words(s.size(1000, 200), seed=5000 + k) for k in range(3)]
    return [
        Turn(lane="main", content=s.size(100, 8), system=systems[t % 3], tools=AGENT_TOOLS,
             messages=_scripted_tool_call(t, synth_words(s.size(200, 16), seed=5100 + t)),
             role="tool" if t % 3 == 2 else "user", max_tokens=s.size(96, 12), seed=t)
        for t in range(turns)
    ]


def unaligned_tail(s: Scale) -> list[Turn]:
    """(6) A token-id conversation whose every prompt is ≡ 41 (mod 64) long, while a filler lane saturates
    the cache with fresh prompts and a side lane chats: tails are copied-on-write under eviction."""
    turns = s.count(24, 8)
    trace: list[Turn] = []
    for t in range(turns):
        trace.append(Turn(lane="tail", route="completions", content=s.size(400, 60), align=TAIL_ALIGN,
                          max_tokens=s.size(48, 8), ignore_eos=True, seed=6000 + t))
        trace.append(Turn(lane="fill", conversation=f"fill{t}", route="completions", content=s.size(3000, 500),
                          max_tokens=4, ignore_eos=True, seed=6500 + t))
        trace.append(Turn(lane="side", content=s.size(60, 8), reset=t % 4 == 0, stream=True,
                          max_tokens=s.size(32, 8), seed=6900 + t))
    return trace


def agent(s: Scale) -> list[Turn]:
    """(7) The real agent profile: a coding-agent conversation growing to ~115k tokens. Each turn re-sends
    the previous prompt + reply + ~450 new tokens (mostly tool results), so ~99.5% of it hits the cache;
    every 8th prompt is padded to ≡ 41 (mod 64); a small concurrent lane extends a token-id conversation
    of ≡ 41-long prompts now and then."""
    turns = s.count(118, 16)
    system = synth_words(s.size(8000, 600), seed=7000)
    main = [
        Turn(lane="agent", content=s.size(450, 24), system=system if t == 0 else None, tools=AGENT_TOOLS,
             role="tool" if t % 10 else "user", thinking=True, stream=True, align=TAIL_ALIGN if t % 8 == 7 else None,
             # Replies of 250 keep the last prompt near 115k: each turn also carries ~190 tokens of template,
             # tool-call and think markup (the H200 run with 400-token replies reached 130,973).
             max_tokens=s.size(250, 24), ignore_eos=True, seed=t)
        for t in range(turns)
    ]
    side_requests = s.count(14, 4)
    side = [
        Turn(lane="side", route="completions", content=s.size(300, 40), align=TAIL_ALIGN, think_s=_side_pause(s),
             max_tokens=s.size(32, 8), ignore_eos=True, seed=7500 + k)
        for k in range(side_requests)
    ]
    return main + side


def _side_pause(s: Scale) -> float:
    # The side lane must overlap the main one: spread it over the main lane's expected duration (about
    # ten seconds a turn on a GPU at full scale, a fraction of a second on a CPU in CI).
    return round(max(0.3, 20.0 * s.factor), 2)


def _scripted_tool_call(index: int, result: str) -> tuple[dict, ...]:
    call_id = f"call_{index}"
    call = {"id": call_id, "type": "function",
            "function": {"name": "read_file", "arguments": f'{{"path": "src/module_{index}.py"}}'}}
    return (
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    )


PROFILES: dict[str, Callable[[Scale], list[Turn]]] = {
    "prefix-saturation": prefix_saturation,
    "long-conversation": long_conversation,
    "tools-thinking": tools_thinking,
    "dual-lane": dual_lane,
    "system-rotation": system_rotation,
    "unaligned-tail": unaligned_tail,
    "agent": agent,
}


MIXED = "mixed"


def mixed(s: Scale) -> list[Turn]:
    """All seven profiles at once (the soak): each keeps its lanes and conversations, renamed apart, so the
    replay interleaves them over the server's lanes."""
    return [replace(turn, lane=f"{name}/{turn.lane}", conversation=f"{name}/{turn.conversation}")
            for name, profile in PROFILES.items() for turn in profile(s)]


def make_profile(name: str, scale: float = 1.0) -> list[Turn]:
    """A profile by name or by its number in the issue (1..7), or all of them mixed ("mixed")."""
    if name == MIXED:
        return mixed(Scale(scale))
    names = list(PROFILES)
    if name.isdigit() and 1 <= int(name) <= len(names):
        name = names[int(name) - 1]
    if name not in PROFILES:
        raise ValueError(f"unknown profile {name!r}; choose one of {', '.join(names)} (or 1..{len(names)})")
    return PROFILES[name](Scale(scale))
