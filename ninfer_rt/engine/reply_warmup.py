"""Idle-time prefill of finished replies as their text tokenizes (hybrid models).

A client sends a reply back as text, and the next prompt holds that text's own tokenization. A sampled
reply need not be it: a model may emit a word as pieces its BPE merges, and from that token on the next
prompt differs from what was computed. A dense model then recomputes the pages after the divergence; a
hybrid resumes from its deepest state snapshot before it, the previous end of input, and recomputes the
whole reply (40 of 117 chat turns of the agent replay on the trained tiny hybrid, docs/findings.md).

So when a reply ends and its ids are not its text's tokenization, the prompt plus the re-tokenized reply
is queued; the engine prefills it while it has nothing else to do, which saves a snapshot at its end and
enters its pages in the prefix cache: the next turn resumes there. That turn, arriving while the warm-up
runs, waits for it (about the time its own recompute of the reply would take) and then resumes at its end;
any other request aborts a running warm-up (its work is dropped). Only the newest replies are kept, one per
lane.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ninfer_rt.engine.request import SamplingParams
from ninfer_rt.model.tokenizer import Tokenizer

# One token sampled and dropped: what a prefill of the whole prompt costs at least.
WARMUP_PARAMS = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def retokenized_reply(tokenizer: Tokenizer, output_ids: Sequence[int], eos_ids: Collection[int]) -> list[int] | None:
    """The reply's ids as its text tokenizes (a closing end-of-sequence token kept as it is), or None when
    they are the ids the model sampled."""
    ids = list(output_ids)
    closing = ids[-1:] if ids and ids[-1] in eos_ids else []
    body = ids[: len(ids) - len(closing)]
    retokenized = tokenizer.encode(tokenizer.decode(body)) + closing
    return None if retokenized == ids else retokenized


@dataclass(frozen=True)
class WarmupStats:
    queued: int
    running: bool
    started: int
    completed: int
    aborted: int  # a real request arrived first


class ReplyWarmup:
    """The warm-up queue and the one warm-up request that may be running."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Collection[int], lanes: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.queue: deque[list[int]] = deque(maxlen=lanes)
        self.running: str | None = None  # the engine's id of the warm-up request in progress
        self.running_prompt: list[int] = []
        self.live: set[str] = set()  # warm-up requests whose final output has not passed yet (aborted ones too)
        self.started = 0
        self.completed = 0
        self.aborted = 0

    def offer(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A reply ended: queue its prompt and re-tokenized reply if they differ from what was computed."""
        reply = retokenized_reply(self.tokenizer, output_ids, self.eos_ids)
        if reply is not None:
            self.queue.append([*prompt_ids, *reply])

    def next_prompt(self) -> list[int] | None:
        return self.queue.popleft() if self.queue else None

    def started_as(self, request_id: str, prompt_ids: list[int]) -> None:
        self.running, self.running_prompt = request_id, prompt_ids
        self.live.add(request_id)
        self.started += 1

    def drop_continued(self, prompt_ids: Sequence[int]) -> None:
        """Forget the queued warm-ups a new prompt continues."""
        kept = [p for p in self.queue if not _continues(prompt_ids, p)]
        self.queue.clear()
        self.queue.extend(kept)

    def continued_by(self, prompt_ids: Sequence[int]) -> bool:
        """Whether a new prompt starts with the running warm-up's whole prompt (its conversation's next turn)."""
        return self.running is not None and _continues(prompt_ids, self.running_prompt)

    def give_way(self) -> str | None:
        """A real request arrived: the running warm-up's id, to abort, if one runs."""
        request_id, self.running = self.running, None
        self.aborted += request_id is not None
        return request_id

    def owns(self, request_id: str, finished: bool) -> bool:
        """Whether an engine output is a warm-up's (nobody reads it). Its final output ends the warm-up: it
        completed unless it was the one given way."""
        if request_id not in self.live:
            return False
        if finished:
            self.live.discard(request_id)
            if self.running == request_id:
                self.running = None
                self.completed += 1
        return True

    def stats(self) -> WarmupStats:
        return WarmupStats(len(self.queue), self.running is not None, self.started, self.completed, self.aborted)


def _continues(prompt_ids: Sequence[int], earlier: list[int]) -> bool:
    return len(prompt_ids) > len(earlier) and list(prompt_ids[: len(earlier)]) == earlier
