"""Scheduler policy with a page-counting ledger: decode first, budgeted chunked prefill, lanes, preemption."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from ninfer_rt.engine.request import FinishReason, Request, RequestState, SamplingParams
from ninfer_rt.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStep

PAGE = 4


@dataclass
class CountingLedger:
    """Pages as counts: enough to exercise every scheduling decision without KV storage."""

    total: int
    held: dict[str, int] = field(default_factory=dict)

    @property
    def free(self) -> int:
        return self.total - sum(self.held.values())

    def admit(self, request: Request, token_budget: int) -> int | None:
        return 0 if self.reserve(request, min(request.num_tokens, token_budget)) else None

    def reserve(self, request: Request, num_tokens: int) -> bool:
        needed = -(-num_tokens // PAGE) - self.held.get(request.request_id, 0)
        if needed > self.free:
            return False
        self.held[request.request_id] = self.held.get(request.request_id, 0) + max(needed, 0)
        return True

    def commit(self, request: Request) -> None:
        pass

    def release(self, request: Request, finished: bool = False) -> None:
        self.held.pop(request.request_id, None)

    def chunk_limit(self, request: Request, size: int) -> int:
        return size


def make_request(name: str, prompt_len: int) -> Request:
    return Request(name, list(range(1, prompt_len + 1)), SamplingParams(temperature=0))


def run_step(scheduler: Scheduler) -> SchedulerStep:
    """Schedule, pretend to compute, and append a token wherever the step samples."""
    step = scheduler.schedule()
    sampling = [chunk.request for chunk in step.chunks if chunk.samples]
    scheduler.complete(step)
    for request in sampling:
        request.output_ids.append(7)
    return step


def sizes(step: SchedulerStep) -> dict[str, int]:
    return {chunk.request.request_id: chunk.num_tokens for chunk in step.chunks}


def test_a_long_prompt_is_prefilled_in_budget_sized_chunks() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=16), CountingLedger(100))
    scheduler.add(make_request("long", 40))
    assert [sizes(run_step(scheduler)) for _ in range(3)] == [{"long": 16}, {"long": 16}, {"long": 8}]


def test_decode_is_scheduled_before_prefill_and_prefill_gets_the_rest_of_the_budget() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=16), CountingLedger(100))
    scheduler.add(make_request("short", 3))
    run_step(scheduler)
    scheduler.add(make_request("long", 100))
    step = run_step(scheduler)
    assert [c.request.request_id for c in step.chunks] == ["short", "long"]
    assert sizes(step) == {"short": 1, "long": 15}


def test_the_short_lane_decodes_every_step_while_the_long_lane_prefills() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=8), CountingLedger(100))
    scheduler.add(make_request("short", 2))
    scheduler.add(make_request("long", 60))
    steps = [sizes(run_step(scheduler)) for _ in range(8)]
    assert all(step.get("short") for step in steps)
    assert all(step.get("long", 0) <= 8 for step in steps)


def test_no_more_lanes_than_max_concurrency() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=64), CountingLedger(100))
    for name in "abc":
        scheduler.add(make_request(name, 4))
    step = run_step(scheduler)
    assert set(sizes(step)) == {"a", "b"}
    assert [r.request_id for r in scheduler.waiting] == ["c"]


def test_a_finished_lane_admits_the_next_waiting_request() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=1, token_budget=64), CountingLedger(100))
    first, second = make_request("a", 4), make_request("b", 4)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)
    scheduler.finish(first, FinishReason.STOP)
    assert set(sizes(run_step(scheduler))) == {"b"}


def old_and_new_filling_the_pool(ledger: CountingLedger) -> tuple[Scheduler, Request, Request]:
    """Requests "old" then "new", 8 prompt tokens each, after the step that gives each 2 pages: with a
    4-page (16-token) ledger the pool is full."""
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=64), ledger)
    old, new = make_request("old", 8), make_request("new", 8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    return scheduler, old, new


def test_when_pages_run_out_the_newest_request_is_preempted_and_waits_first_in_line() -> None:
    ledger = CountingLedger(4)
    scheduler, old, new = old_and_new_filling_the_pool(ledger)
    step = run_step(scheduler)  # "old" needs a third page for its 9th token
    assert step.preempted == [new]
    assert new.state is RequestState.PREEMPTED and new.num_computed == 0
    assert scheduler.waiting[0] is new
    assert ledger.held == {"old": 3}


def test_a_preempted_request_recomputes_prompt_and_output_when_readmitted() -> None:
    scheduler, old, new = old_and_new_filling_the_pool(CountingLedger(4))
    run_step(scheduler)  # preempts "new"
    scheduler.finish(old, FinishReason.STOP)
    step = run_step(scheduler)
    assert sizes(step) == {"new": 9}  # 8 prompt tokens + the token it had sampled


def test_a_request_that_cannot_grow_even_alone_finishes_with_length() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=1, token_budget=64), CountingLedger(2))
    request = make_request("r", 8)
    scheduler.add(request)
    run_step(scheduler)
    step = run_step(scheduler)
    assert step.finished == [request]
    assert request.finish_reason is FinishReason.LENGTH
    assert not scheduler.has_work


def test_waiting_requests_never_preempt_running_ones() -> None:
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=64), CountingLedger(3))
    scheduler.add(make_request("running", 8))  # its 9th token takes the third and last page
    run_step(scheduler)
    scheduler.add(make_request("late", 4))
    step = scheduler.schedule()
    assert not step.preempted
    assert [r.request_id for r in scheduler.waiting] == ["late"]


def test_abort_releases_pages_of_a_running_request() -> None:
    ledger = CountingLedger(10)
    scheduler = Scheduler(SchedulerConfig(max_concurrency=2, token_budget=64), ledger)
    request = make_request("r", 8)
    scheduler.add(request)
    run_step(scheduler)
    scheduler.abort(request)
    assert ledger.free == 10
    assert request.finish_reason is FinishReason.ABORT
    assert not scheduler.has_work


def test_budget_smaller_than_the_lanes_is_rejected() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        SchedulerConfig(max_concurrency=4, token_budget=2)
