"""Continuous batching: which requests compute how many tokens in the next step.

Policy, per step, under a token budget:
1. every running request that is decoding gets its one token first, so a lane's decode is never delayed
   by more than the one prefill chunk that shares its step;
2. running prefills (oldest first) take chunks of what is left of the budget;
3. waiting requests are admitted (oldest first, preempted ones at the front) while a lane is free and
   budget and pages remain; admission attaches the request's cached prefix, which its prefill skips.
When a running request cannot get pages, the newest running request is preempted by recompute: its pages
go back to the pool and it waits again with prompt + output to recompute. A request that cannot grow even
alone in the pool finishes with "length" instead of crashing the engine.

The scheduler never touches pages itself: a `PageLedger` (the KV side) does, so the policy is testable
with a page counter.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ninfer_rt.engine.request import FinishReason, Request, RequestState


class PageLedger(Protocol):
    def admit(self, request: Request, token_budget: int) -> int | None:
        """Attach the request's longest cached prefix and the pages of its first chunk (what is left of
        its tokens, at most `token_budget`). Returns how many tokens the cache supplied (always fewer than
        the request has: the last must be computed to sample from it), or None, changing nothing, when
        the pool cannot take it now."""

    def reserve(self, request: Request, num_tokens: int) -> bool:
        """Make room for the request's first `num_tokens` tokens; False, changing nothing, if the pool can't."""

    def commit(self, request: Request) -> None:
        """The request's K/V now covers `num_computed` tokens: its full pages may enter the prefix cache."""

    def release(self, request: Request, finished: bool = False) -> None:
        """Give back every page the request holds; `finished`: it ended (not aborted nor preempted), so
        what it computed is worth keeping for a next turn."""

    def chunk_limit(self, request: Request, size: int) -> int:
        """How much of a `size`-token chunk from the request's computed tokens to schedule now (a hybrid
        model ends chunks where it saves states)."""

    def rollback(self, request: Request) -> None:
        """Give back the pages wholly past the request's computed tokens (reserved, then not kept)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_concurrency: int = 2
    token_budget: int = 2048  # tokens computed per step: the prefill chunk size when a lane decodes
    lookahead: int = 0  # slots reserved past a sampling chunk's end (speculative verify and drafting)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.token_budget < self.max_concurrency:
            raise ValueError(f"token_budget ({self.token_budget}) must cover one token per lane ({self.max_concurrency})")


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed

    @property
    def samples(self) -> bool:
        """Whether the chunk reaches the end of the sequence, so the step samples a token for it."""
        return self.request.num_computed + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerStep:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (no room to grow)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: SchedulerConfig, ledger: PageLedger) -> None:
        self.config = config
        self.ledger = ledger
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first

    # -- queue -----------------------------------------------------------------------------------------

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
            self.ledger.release(request)
        request.finish(FinishReason.ABORT)

    def finish(self, request: Request, reason: FinishReason) -> None:
        self.running.remove(request)
        self.ledger.release(request, finished=True)
        request.finish(reason)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- one step --------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerStep:
        step = SchedulerStep()
        budget = self.config.token_budget
        decoding = [r for r in self.running if r.num_remaining == 1]
        prefilling = [r for r in self.running if r.num_remaining > 1]
        for request in decoding + prefilling:
            if request not in self.running:  # preempted earlier in this loop to make room
                continue
            size = self.ledger.chunk_limit(request, min(request.num_remaining, budget))
            extra = self.config.lookahead if size == request.num_remaining else 0
            if size and self._reserve_or_preempt(request, size + extra, step):
                step.chunks.append(ScheduledChunk(request, size))
                budget -= size
        self._admit(budget, step)
        return step

    def complete(self, step: SchedulerStep) -> None:
        """The step ran: advance each chunk's computed count (sampled tokens are appended by the engine)."""
        for chunk in step.chunks:
            request = chunk.request
            if request.finished:
                continue
            request.num_computed += chunk.num_tokens
            self.ledger.commit(request)
            request.state = RequestState.DECODING if request.num_remaining <= 1 else RequestState.PREFILLING

    def settle(self, request: Request, accepted_drafts: int) -> None:
        """The step's samples joined the request's output: the drafts among them were verified, so their
        K/V (written by the verify rows) counts as computed; pages reserved past that go back."""
        request.num_computed += accepted_drafts
        self.ledger.commit(request)
        self.ledger.rollback(request)

    # -- internals -------------------------------------------------------------------------------------

    def _admit(self, budget: int, step: SchedulerStep) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_concurrency:
            request = self.waiting[0]
            cached = self.ledger.admit(request, budget)
            if cached is None:
                break  # pages are short: waiting requests never preempt running ones
            request.num_computed = cached
            if request.preemptions == 0:
                request.num_cached_prompt = cached
                request.first_scheduled = time.monotonic()
            size = self.ledger.chunk_limit(request, min(request.num_remaining, budget))
            self.waiting.popleft()
            self.running.append(request)
            request.state = RequestState.PREFILLING
            step.chunks.append(ScheduledChunk(request, size))
            budget -= size

    def _reserve_or_preempt(self, request: Request, size: int, step: SchedulerStep) -> bool:
        scheduled = {id(chunk.request) for chunk in step.chunks}
        while not self.ledger.reserve(request, request.num_computed + size):
            victims = [r for r in self.running if id(r) not in scheduled]
            victim = max(victims, key=lambda r: r.order)
            if victim is request and len(self.running) == 1:
                self.finish(request, FinishReason.LENGTH)  # alone and still no room: the pool is its limit
                step.finished.append(request)
                return False
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, step: SchedulerStep) -> None:
        self.running.remove(request)
        self.ledger.release(request)
        request.num_computed = 0
        request.preemptions += 1
        request.state = RequestState.PREEMPTED
        self.waiting.appendleft(request)
        step.preempted.append(request)

