"""A generation request: what was asked (SamplingParams), where it is (RequestState), what it produced.

A request's token sequence is `prompt_ids + output_ids`. `num_computed` counts the leading tokens whose K/V
is in the cache; the scheduler's only question per step is how many of the remaining tokens to compute. A
prefill, a decode step and the recompute after preemption are all the same operation: compute the next
chunk of the sequence, and when the chunk reaches the end, sample one more token.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    PREFILLING = "prefilling"  # holds pages, more than one token still to compute
    DECODING = "decoding"  # holds pages, one token (the last sampled) to compute per step
    PREEMPTED = "preempted"  # its pages were taken back; it recomputes prompt + output when readmitted
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens, or the context limit
    ABORT = "abort"


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI/vLLM sampling parameters. Invalid values raise ValueError with a message fit for a 400."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) = no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    MAX_TOP_LOGPROBS = 20

    def __post_init__(self) -> None:
        # Accept lists (JSON) and a single string, as the OpenAI API does, but store tuples (hashable, frozen).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for problem in self._problems():
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _problems(self) -> list[str]:
        checks = [
            (_finite(self.temperature) and self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (_finite(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or self.top_k >= 0, f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (_finite(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            (
                0 <= self.top_logprobs <= self.MAX_TOP_LOGPROBS,
                f"top_logprobs must be in [0, {self.MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            ),
            (not self.top_logprobs or self.logprobs, "top_logprobs requires logprobs=true"),
            (_finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (_finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (_finite(self.repetition_penalty) and self.repetition_penalty > 0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
        ]
        return [message for ok, message in checks if not ok]


def as_token_ids(prompt: Sequence[int]) -> list[int]:
    """A prompt's ids as a list of ints. A list is taken as it is, not copied: the server hands over the
    list it validated, and copying a 100k-token prompt on every turn is the cost this avoids."""
    return prompt if isinstance(prompt, list) else [int(t) for t in prompt]


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


_request_numbers = itertools.count()


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of prompt_ids + output_ids whose K/V is in the cache
    num_cached_prompt: int = 0  # prompt tokens served by the prefix cache at (first) admission
    finish_reason: FinishReason | None = None
    preemptions: int = 0
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token_time: float | None = None
    # the client sends the reply back as text: once it ends, prefill it as that text tokenizes (reply_warmup.py)
    warm_reply: bool = False
    # admission order breaks ties: the newest running request is the first to be preempted
    order: int = field(default_factory=lambda: next(_request_numbers))
    # the request's own random stream: a seeded request replays exactly whatever shares its batch
    generator: np.random.Generator = field(init=False, repr=False)
    # A token sampled on the device and not read back yet (the engine's overlap): it counts as the
    # sequence's last token, and a step that computes it embeds row `pending_row` of the fed ids.
    pending_row: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        self.generator = np.random.default_rng(self.params.seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """`all_ids[start:stop]` without building the whole sequence (per-step callers on long prompts); a
        pending token reads as -(pending_row + 1), the embedding's reference to the fed ids."""
        known = len(self.prompt_ids) + len(self.output_ids)
        if self.pending_row is not None and stop > known:
            return self._known_slice(start, known) + [-(self.pending_row + 1)]
        return self._known_slice(start, stop)

    def _known_slice(self, start: int, stop: int) -> list[int]:
        split = len(self.prompt_ids)
        if stop <= split:
            return self.prompt_ids[start:stop]
        if start >= split:
            return self.output_ids[start - split : stop - split]
        return self.prompt_ids[start:] + self.output_ids[: stop - split]

    @functools.cached_property
    def prompt_vocab(self) -> np.ndarray:
        """The prompt's distinct token ids, once: what the repetition penalty reads of it every token."""
        return np.unique(np.asarray(self.prompt_ids, np.int64))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + (self.pending_row is not None)

    @property
    def num_remaining(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def running(self) -> bool:
        return self.state in (RequestState.PREFILLING, RequestState.DECODING)

    def finish(self, reason: FinishReason) -> None:
        self.state = RequestState.FINISHED
        self.finish_reason = reason
