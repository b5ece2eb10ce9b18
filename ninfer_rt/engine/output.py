"""From sampled tokens to what a caller streams: text deltas, stop conditions, per-request statistics.

One `OutputStream` per request. It appends sampled tokens to the request and decides whether the request
ends: EOS (unless ignore_eos) and stop_token_ids end it without their text; a stop string ends it exactly
before the string (even when the string spans tokens); max_tokens and the context limit end it with
"length". Text is streamed through the tokenizer's incremental detokenizer, so a delta never ends inside
a UTF-8 character.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from ninfer_rt.engine.request import FinishReason, Request
from ninfer_rt.engine.sampling import Sample, TokenLogprobs
from ninfer_rt.engine.spec_stats import AcceptanceCounts
from ninfer_rt.engine.stop import StopStringMatcher
from ninfer_rt.model.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestStats:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the prefix cache supplied
    completion_tokens: int
    preemptions: int
    ttft_s: float  # arrival to first token
    prefill_tok_s: float  # computed (uncached) prompt tokens per second of prefill
    decode_tok_s: float  # tokens after the first, per second
    acceptance: AcceptanceCounts | None = None  # speculative decoding only


@dataclass(frozen=True)
class RequestOutput:
    """What one step added to one request: the stream's next delta."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stats: RequestStats | None = None  # on the final output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputStream:
    def __init__(self, request: Request, tokenizer: Tokenizer, eos_ids: Collection[int], context_limit: int) -> None:
        self.request = request
        self._stop_ids = set(request.params.stop_token_ids) | (set() if request.params.ignore_eos else set(eos_ids))
        self._detokenizer = tokenizer.detokenizer(request.prompt_ids, skip_special_tokens=True)
        self._stop_strings = StopStringMatcher(request.params.stop)
        self._context_limit = context_limit
        self._acceptance = AcceptanceCounts()

    def accept(self, samples: Sequence[Sample], drafted: int = 0) -> RequestOutput:
        """Append the step's samples (stopping at the first that ends the request) and return the delta.
        `drafted` drafts were verified to produce them: all but the last sample are accepted drafts."""
        self._acceptance.add(drafted, len(samples) - 1)
        request = self.request
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        tokens, text, logprobs = [], "", []
        reason: FinishReason | None = None
        stopped_on_string = False
        for sampled in samples:
            request.output_ids.append(sampled.token_id)
            tokens.append(sampled.token_id)
            if sampled.logprobs is not None:
                logprobs.append(sampled.logprobs)
            if sampled.token_id in self._stop_ids:
                reason = FinishReason.STOP
                break
            piece, stopped_on_string = self._stop_strings.feed(self._detokenizer.add(sampled.token_id))
            text += piece
            if stopped_on_string:
                reason = FinishReason.STOP
                break
            if self.length_reached():
                reason = FinishReason.LENGTH
                break
        if reason is not None and not stopped_on_string:  # after a stop string everything held is cut
            text += self._flush()
        return self._output(tokens, text, logprobs, reason)

    def length_reached(self, more: int = 0) -> bool:
        """Whether the request has reached max_tokens or the context limit (`more` tokens from now)."""
        request = self.request
        return (
            len(request.output_ids) + more >= request.params.max_tokens
            or request.num_tokens + more >= self._context_limit
        )

    def close(self, reason: FinishReason) -> RequestOutput:
        """The final output of a request ended from outside (abort, or no room to grow)."""
        return self._output([], self._flush(), [], reason)

    def _flush(self) -> str:
        return self._stop_strings.feed(self._detokenizer.flush())[0] + self._stop_strings.flush()

    def _output(
        self, tokens: list[int], text: str, logprobs: list[TokenLogprobs], reason: FinishReason | None
    ) -> RequestOutput:
        stats = self._stats() if reason is not None else None
        return RequestOutput(self.request.request_id, tokens, text, logprobs, reason, stats)

    def _stats(self) -> RequestStats:
        request = self.request
        now = time.monotonic()
        first = request.first_token_time or now
        started = request.first_scheduled or request.arrival
        computed_prompt = len(request.prompt_ids) - request.num_cached_prompt
        decoded = max(len(request.output_ids) - 1, 0)
        return RequestStats(
            prompt_tokens=len(request.prompt_ids),
            cached_tokens=request.num_cached_prompt,
            completion_tokens=len(request.output_ids),
            preemptions=request.preemptions,
            ttft_s=first - request.arrival,
            prefill_tok_s=computed_prompt / max(first - started, 1e-9),
            decode_tok_s=decoded / max(now - first, 1e-9) if decoded else 0.0,
            acceptance=self._acceptance if self._acceptance.steps else None,
        )

