"""How close a replay's prefix cache came to the ideal, judged from the replayed requests themselves.

A turn that extends its conversation's previous request could skip every token of that request's prompt
(and of its reply, on the chat route, where the reply is sent back as the assistant message); only its new
tokens need computing. The ideal is that sum over turns 2.., and what the server skipped is its reported
cached tokens; a turn recomputing more than its new tokens plus one page (64) lost a reusable prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ninfer_rt.replay.runner import RequestRecord

SLACK_TOKENS = 64  # one KV page: the granularity at which the prefix cache (and a state snapshot) resumes


@dataclass(frozen=True)
class TurnReuse:
    index: int
    new: int  # tokens beyond the previous request's prompt (and reply)
    recomputed: int  # prompt tokens the server did not serve from its cache

    @property
    def over_slack(self) -> bool:
        return self.recomputed > self.new + SLACK_TOKENS


def turn_reuse(records: Sequence[RequestRecord]) -> list[TurnReuse]:
    """Each successful turn that extends a successful previous request of its conversation."""
    previous: dict[str, RequestRecord] = {}
    turns = []
    for record in sorted(records, key=lambda r: r.index):  # a conversation's turns run in trace order
        before = previous.get(record.conversation)
        previous[record.conversation] = record
        if not (record.ok and record.extends_previous and before is not None and before.ok):
            continue
        reusable = before.prompt_tokens + (before.completion_tokens if record.route == "chat" else 0)
        reusable = min(reusable, record.prompt_tokens)
        turns.append(TurnReuse(record.index, record.prompt_tokens - reusable, record.prompt_tokens - record.cached_tokens))
    return turns
