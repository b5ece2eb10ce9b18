"""Prometheus metrics, one registry per app (tests build many apps in one process; the global registry
would refuse the second). Names follow vLLM's where one exists, so existing dashboards mostly work."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ninfer_rt.engine.output import RequestStats
from ninfer_rt.engine.spec_stats import AcceptanceCounts
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.serve.state import EngineLoad

# Agent turns range from a cached 100k-token prompt (fast) to a cold one (tens of seconds).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.1, 0.25, 0.5, 1.0, 2.5)
# Tokens a verify step emits, averaged over one request: 1 (no draft accepted) .. draft_tokens + 1.
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._token_totals = (0, 0)  # (prompt, cached) tokens, for the hit ratio
        self._restores_counted = 0  # the snapshot store's restores already added to the counter
        self._evictions_counted = 0  # the page pool's evictions already added to the counter
        self._warmups_counted = {"completed": 0, "aborted": 0}  # the engine's warm-up ends already counted
        r = self.registry
        self.requests = Counter("ninfer_requests", "Finished HTTP requests", ["endpoint", "status"], registry=r)
        self.unexpected_errors = Counter(
            "ninfer_unexpected_errors", "Failures no handler expected (a 500 with a logged traceback)", registry=r
        )
        self.prompt_tokens = Counter("ninfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("ninfer_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("ninfer_cached_tokens", "Prompt tokens served by the prefix cache", registry=r)
        self.prefix_cache_queries = Counter(
            "ninfer_prefix_cache_queries", "Requests whose prompt was looked up in the prefix cache", registry=r
        )
        self.prefix_cache_hits = Counter(
            "ninfer_prefix_cache_hits", "Requests that found part of their prompt in the prefix cache", registry=r
        )
        self.preemptions = Counter("ninfer_preemptions", "Requests preempted (recomputed later)", registry=r)
        self.ttft = Histogram(
            "ninfer_time_to_first_token_seconds", "Arrival to first token", buckets=TTFT_BUCKETS, registry=r
        )
        self.inter_token = Histogram(
            "ninfer_inter_token_latency_seconds", "Time between streamed tokens", buckets=ITL_BUCKETS, registry=r
        )
        self.ordering_violations = Counter(
            "ninfer_ordering_violations", "Ordering violations that stopped the engine (--verify-ordering)", registry=r
        )
        # vLLM's spec-decode counters: acceptance rate = accepted / draft tokens, per position too.
        self.spec_drafts = Counter("ninfer_spec_decode_num_drafts", "Verify steps that checked drafts", registry=r)
        self.spec_draft_tokens = Counter("ninfer_spec_decode_num_draft_tokens", "Drafted tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("ninfer_spec_decode_num_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.spec_accepted_per_pos = Counter(
            "ninfer_spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted, by draft position", ["position"], registry=r
        )
        self.spec_acceptance_length = Histogram(
            "ninfer_spec_decode_acceptance_length", "Mean tokens per verify step, per request", buckets=ACCEPTANCE_BUCKETS, registry=r
        )
        self.kv_pages = Gauge("ninfer_kv_pages", "KV pages by state", ["state"], registry=r)
        self.kv_evictions = Counter(
            "ninfer_kv_page_evictions", "Cached KV pages evicted to make room (prefix-cache entries lost)", registry=r
        )
        self.requests_running = Gauge("ninfer_requests_running", "Requests the engine is running (prefill or decode)", registry=r)
        self.requests_waiting = Gauge("ninfer_requests_waiting", "Requests queued in the engine for a lane or pages", registry=r)
        self.requests_in_flight = Gauge("ninfer_requests_in_flight", "Prompts holding a server slot (running, queued or streaming out)", registry=r)
        self.prefix_hit_ratio = Gauge(
            "ninfer_prefix_cache_hit_ratio", "Prompt tokens served by the prefix cache / prompt tokens, since start", registry=r
        )
        # A hybrid model's Gated DeltaNet state slots and snapshots, beside the KV pages.
        self.state_slots = Gauge("ninfer_state_slots", "Linear-attention state slots by state", ["state"], registry=r)
        self.snapshots = Gauge("ninfer_state_snapshots", "Saved linear-attention states", registry=r)
        self.snapshot_bytes = Gauge("ninfer_state_snapshot_bytes", "Device bytes the saved states hold", registry=r)
        self.snapshot_restores = Counter("ninfer_state_snapshot_restores", "States restored into a new sequence", registry=r)
        self.prompt_tokens_computed = Counter(
            "ninfer_prompt_tokens_computed", "Prompt tokens the engine computed (not skipped by the prefix cache)", registry=r
        )
        self.warmups = Gauge(
            "ninfer_reply_warmups", "Replies re-tokenized for the next turn, queued or being prefilled while idle", ["state"], registry=r
        )
        self.warmups_ended = Counter(
            "ninfer_reply_warmups_ended", "Warm-ups of re-tokenized replies: completed, or aborted by a request", ["outcome"], registry=r
        )

    def request_done(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def generation_done(self, stats: RequestStats) -> None:
        prompt, cached = self._token_totals
        self._token_totals = (prompt + stats.prompt_tokens, cached + stats.cached_tokens)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generation_tokens.inc(stats.completion_tokens)
        self.cached_tokens.inc(stats.cached_tokens)
        self.prompt_tokens_computed.inc(stats.prompt_tokens - stats.cached_tokens)
        self.prefix_cache_queries.inc()
        if stats.cached_tokens:
            self.prefix_cache_hits.inc()
        self.preemptions.inc(stats.preemptions)
        self.ttft.observe(stats.ttft_s)
        if stats.acceptance is not None:
            self._acceptance_done(stats.acceptance)

    def _acceptance_done(self, counts: AcceptanceCounts) -> None:
        self.spec_drafts.inc(counts.steps)
        self.spec_draft_tokens.inc(sum(counts.proposed))
        self.spec_accepted_tokens.inc(sum(counts.accepted))
        for position, accepted in enumerate(counts.accepted):
            self.spec_accepted_per_pos.labels(position=str(position)).inc(accepted)
        self.spec_acceptance_length.observe(counts.mean_acceptance_length)

    def _states(self, load: EngineLoad) -> None:
        if load.state_slots is not None:
            slots = load.state_slots
            for state, value in (("in_use", slots.in_use), ("free", slots.free), ("fenced", slots.fenced), ("total", slots.total)):
                self.state_slots.labels(state=state).set(value)
        if load.snapshots is not None:
            self.snapshots.set(load.snapshots.count)
            self.snapshot_bytes.set(load.snapshots.bytes)
            # the store counts restores since start; the counter takes what was added since the last scrape
            self.snapshot_restores.inc(load.snapshots.restores - self._restores_counted)
            self._restores_counted = load.snapshots.restores
        if load.warmups is not None:
            self.warmups.labels(state="queued").set(load.warmups.queued)
            self.warmups.labels(state="running").set(int(load.warmups.running))
            for outcome, total in (("completed", load.warmups.completed), ("aborted", load.warmups.aborted)):
                self.warmups_ended.labels(outcome=outcome).inc(total - self._warmups_counted[outcome])
                self._warmups_counted[outcome] = total

    def token_gap(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def render(self, kv: PoolStats | None, load: EngineLoad | None = None, in_flight: int = 0) -> bytes:
        # Pages and load are sampled at scrape time: gauges updated per step would cost the engine loop for nothing.
        if kv is not None:
            for state, value in (("free", kv.free), ("in_use", kv.in_use), ("cached", kv.cached), ("total", kv.total)):
                self.kv_pages.labels(state=state).set(value)
            self.kv_evictions.inc(kv.evictions - self._evictions_counted)
            self._evictions_counted = kv.evictions
        if load is not None:
            self.requests_running.set(load.running)
            self.requests_waiting.set(load.waiting)
            self._states(load)
        self.requests_in_flight.set(in_flight)
        prompt, cached = self._token_totals
        self.prefix_hit_ratio.set(cached / prompt if prompt else 0.0)
        return generate_latest(self.registry)
