"""Engine: add_request / step / abort / generate over the scheduler, the KV ledger and the model runner
(the request loop; build.py assembles what it runs on from the flags and the checkpoint).

Thread model: the engine belongs to one thread, the one that calls it first; that thread owns the streams
and is the only one that enqueues work. Calls from another thread raise instead of racing. EngineLoop
(loop.py) is how servers use it: it runs `step` on a dedicated thread while other threads enqueue
requests and read outputs.

Overlap (EngineConfig.overlap, without --spec): a step's samples are fed to the next step on the device
(Executor.feed), and the next step is scheduled and its forward enqueued before they are read back, so
the GPU runs step N+1 while the host reads step N's tokens, streams them and schedules. A request whose
sample is on its way holds it as a pending token (Request.pending_row): it counts as the sequence's last
token and the next step embeds it from the fed ids. Per step:
  1. resolve the in-flight step first unless the next schedule is plain decode (nothing waiting, nothing
     prefilling, a free page per running request: no admission and no preemption can see a pending token);
  2. schedule, enqueue the forward;
  3. resolve the in-flight step: its tokens join their streams, stops end requests (their pages go back
     behind a fence recorded after the forward just enqueued, which may still write one K/V slot into
     them; its row for them is ignored);
  4. complete the step, enqueue its sampling (after 3: penalties read the tokens just resolved), feed
     the samples, and keep them in flight.
A request whose next token ends it by length gets no pending token: nothing is scheduled after it.
"""

from __future__ import annotations

import itertools
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ninfer_rt.cuda.driver import open_device
from ninfer_rt.cuda.fault_drill import FaultDrill
from ninfer_rt.engine.build import EngineConfig, StartupTimes, build, sync_device
from ninfer_rt.engine.output import OutputStream, RequestOutput
from ninfer_rt.engine.reply_warmup import WARMUP_PARAMS, ReplyWarmup, WarmupStats
from ninfer_rt.engine.request import FinishReason, Request, SamplingParams, as_token_ids
from ninfer_rt.engine.sampling import PendingSamples
from ninfer_rt.engine.scheduler import SchedulerStep
from ninfer_rt.engine.spec_vocab import load_token_frequencies
from ninfer_rt.kv.capacity import check_fits
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.kv.snapshots import SnapshotStats
from ninfer_rt.kv.states import SlotStats
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.artifact_binding import draft_frequencies, is_artifact_path, load_artifact_model
from ninfer_rt.model.weights import ModelWeights, load_model_weights


@dataclass(frozen=True)
class InFlight:
    """A step whose samples are on their way back: request i owns sample row i."""

    requests: list[Request]
    samples: PendingSamples


class Engine:
    def __init__(
        self,
        weights: ModelWeights,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        token_frequencies: np.ndarray | None = None,  # for --lm-head-draft (spec_vocab.py)
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(weights.config.eos_token_ids)
        self.startup = StartupTimes()
        parts = build(weights, config, token_frequencies, self.startup)
        self.device, self.streams = parts.device, parts.streams
        self.executor, self.kv, self.kv_manager = parts.executor, parts.kv, parts.kv_manager
        self.ledger, self.scheduler, self.runner = parts.ledger, parts.scheduler, parts.runner
        self._requests: dict[str, OutputStream] = {}
        self._pending: list[RequestOutput] = []  # outputs of requests ended between steps (abort)
        self._overlap = config.overlap and config.spec == "none"
        self._inflight: InFlight | None = None
        self._ids = itertools.count()
        self._owner: int | None = None
        self._warmup: ReplyWarmup | None = None  # none while the start-up requests run
        self._held: list[Request] = []  # requests that continue the running warm-up's prompt, until it ends
        self.streams.crash.add_section("engine", self._frontier)
        if parts.graphed:
            clock = time.perf_counter()
            self._capture_decode_graphs()
            self.startup.graphs = time.perf_counter() - clock
        snapshots = self.ledger.states is not None and self.ledger.states.snapshots is not None
        if snapshots and config.reply_warmup:
            self._warmup = ReplyWarmup(tokenizer, self.eos_ids, config.max_concurrency)
        if config.debug_fault_after is not None:  # armed last: the drill counts the serving ops, not start-up's
            FaultDrill.arm(self.streams, config.debug_fault_after)

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig = EngineConfig()) -> Engine:
        clock = time.perf_counter()
        if is_artifact_path(model_dir):
            bound = load_artifact_model(model_dir)
            weights, tokenizer_dir = bound.weights, bound.frontend_dir
            frequencies = draft_frequencies(bound) if config.lm_head_draft else None
        else:
            weights, tokenizer_dir = load_model_weights(model_dir), Path(model_dir)
            frequencies = load_token_frequencies(model_dir, weights.config.vocab_size) if config.lm_head_draft else None
        read_weights = time.perf_counter() - clock
        engine = cls(weights, Tokenizer(tokenizer_dir), config, frequencies)
        engine.startup.read_weights = read_weights
        print(f"ninfer-rt: {engine.startup.describe()}", file=sys.stderr)
        return engine

    def _capture_decode_graphs(self) -> None:
        """Serve throwaway requests, alone and then side by side up to max_concurrency, so every decode step
        shape's CUDA graph (batch size, and verify width with --spec mtp) is captured now: a capture costs an
        eager step plus instantiation, which the first real requests would otherwise pay. Their pages go
        back to the pool (a one-token prompt fills no page the prefix cache could keep)."""
        steps = 2 + 2 * (self.config.draft_tokens if self.config.spec == "mtp" else 0)
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        for lanes in range(1, self.config.max_concurrency + 1):
            for _ in self.generate([[0]] * lanes, params):
                pass
        sync_device(self.executor)
        self._owner = None  # the serving thread (EngineLoop) takes the engine over

    # -- requests --------------------------------------------------------------------------------------

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError for a request that can never run; safe from any thread (reads only constants)."""
        if not prompt_ids:
            raise ValueError("the prompt must contain at least one token")
        vocab = self.runner.model.config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:  # C loops: a 114k-token prompt in ~1 ms
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        check_fits(len(prompt_ids) + params.max_tokens, self.kv_manager.context_limit)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams = SamplingParams(),
        request_id: str | None = None,
        warm_reply: bool = False,
    ) -> str:
        """Queue a request; `warm_reply`: its reply will come back as text (engine/reply_warmup.py)."""
        self._check_thread()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else as_token_ids(prompt)
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt_ids, params, warm_reply=warm_reply)
        warmup = self._warmup
        if warmup is not None:
            warmup.drop_continued(prompt_ids)  # a queued one this turn continues: it computes that itself
            if warmup.continued_by(prompt_ids):
                # the next turn of the warmed reply: it resumes where the warm-up ends, so it waits for it
                self._requests[request_id] = self._stream_of(request)
                self._held.append(request)
                return request_id
            warming = warmup.give_way()
            if warming is not None:  # any other request goes first
                self.abort(warming)
        self._add(request)
        return request_id

    def _add(self, request: Request) -> None:
        self._requests[request.request_id] = self._stream_of(request)
        self.scheduler.add(request)

    def _stream_of(self, request: Request) -> OutputStream:
        return OutputStream(request, self.tokenizer, self.eos_ids, self.kv_manager.context_limit)

    def abort(self, request_id: str) -> None:
        """End a request wherever it is; its pages go back to the pool. Unknown or finished ids are ignored."""
        self._check_thread()
        stream = self._requests.pop(request_id, None)
        if stream is None:
            return
        if stream.request in self._held:
            self._held.remove(stream.request)
        self.scheduler.abort(stream.request)
        self._pending.append(stream.close(FinishReason.ABORT))

    @property
    def has_work(self) -> bool:
        warming = (self._warmup is not None and bool(self._warmup.queue)) or bool(self._held)
        return self.scheduler.has_work or bool(self._pending) or self._inflight is not None or warming

    # -- stepping --------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns every request's delta (and every final output). With overlap
        the deltas are the previous step's, whose samples were read back while this one was enqueued. A
        warm-up request's outputs are not among them."""
        self._check_thread()
        self._start_warmup()
        outputs = self._step()
        if self._warmup is None:
            return outputs
        outputs = [output for output in outputs if not self._warmup.owns(output.request_id, output.finished)]
        if self._held and self._warmup.running is None:  # its pages and snapshot are in place: resume there
            for request in self._held:
                self.scheduler.add(request)
            self._held.clear()
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._inflight is not None and not self._plain_decode_next():
            outputs += self._resolve()
        plan = self.scheduler.schedule()
        outputs += [self._requests.pop(r.request_id).close(FinishReason.LENGTH) for r in plan.finished]
        if not plan.chunks:
            return outputs + self._resolve()
        if not self._overlap:
            return outputs + self._run(plan)
        sampling = [chunk.request for chunk in plan.chunks if chunk.samples]  # before complete() moves them on
        output = self.runner.launch(plan.chunks)
        outputs += self._resolve()
        self.scheduler.complete(plan)
        self._inflight = InFlight(sampling, self.runner.sample(output, sampling, feed=True))
        for row, request in enumerate(sampling):
            # the token that ends a request by length is its last: nothing is scheduled after it
            if not request.finished and not self._requests[request.request_id].length_reached(more=1):
                request.pending_row = row
        return outputs

    def _run(self, plan: SchedulerStep) -> list[RequestOutput]:
        """The step without overlap (and every --spec step): forward, samples read back, outputs."""
        sampled = self.runner.run(plan.chunks)
        self.scheduler.complete(plan)
        outputs = []
        for result in sampled:
            output = self._requests[result.request.request_id].accept(result.samples, result.drafted)
            # Accepted drafts that joined the output (a stop may cut the step's samples short) are computed.
            self.scheduler.settle(result.request, accepted_drafts=min(len(output.token_ids), len(result.samples) - 1))
            outputs.append(self._end_if_finished(result.request, output))
        return outputs

    def _resolve(self) -> list[RequestOutput]:
        """Read back the in-flight step's samples and give them to their requests' streams."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        outputs = []
        for request, sample in zip(inflight.requests, inflight.samples.result()):
            request.pending_row = None
            if not request.finished:  # else it ended (stop, abort) after this step was enqueued
                outputs.append(self._end_if_finished(request, self._requests[request.request_id].accept([sample])))
        return outputs

    def _end_if_finished(self, request: Request, output: RequestOutput) -> RequestOutput:
        if output.finished:
            self.scheduler.finish(request, output.finish_reason)
            del self._requests[request.request_id]
            if self._warmup is not None and request.warm_reply:
                self._warmup.offer(request.prompt_ids, request.output_ids)
        return output

    # -- warm-ups (reply_warmup.py) --------------------------------------------------------------------

    def _start_warmup(self) -> None:
        """Start the next queued warm-up when nothing else is queued, running or in flight."""
        warmup = self._warmup
        if warmup is None or warmup.running is not None or self.scheduler.has_work or self._inflight is not None:
            return
        prompt = warmup.next_prompt()
        if prompt is None:
            return
        try:
            self.validate(prompt, WARMUP_PARAMS)
        except ValueError:  # past the context: the turn that would resume there cannot be sent either
            return
        request = Request(f"warmup-{next(self._ids)}", prompt, WARMUP_PARAMS)
        self._add(request)
        warmup.started_as(request.request_id, prompt)

    def _plain_decode_next(self) -> bool:
        """Whether the next schedule can only give each running request its one token: then it may see
        pending tokens (no admission reads a prompt, no preemption re-queues one, pages cannot run out)."""
        running = self.scheduler.running
        return (
            not self.scheduler.waiting
            and all(request.num_remaining <= 1 for request in running)
            and self.kv_manager.pool.can_allocate(len(running))
        )

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams = SamplingParams()
    ) -> Iterator[RequestOutput]:
        """Add `prompts` and step until all of them finish, yielding their outputs as they come."""
        ids = {self.add_request(prompt, params) for prompt in prompts}
        while ids:
            for output in self.step():
                if output.request_id in ids:
                    yield output
                    if output.finished:
                        ids.discard(output.request_id)

    # -- observability ---------------------------------------------------------------------------------

    def kv_stats(self) -> PoolStats:
        return self.kv_manager.stats()

    def state_stats(self) -> SlotStats | None:
        """The hybrid's state slot pool (None for a model without linear-attention layers)."""
        return None if self.ledger.states is None else self.ledger.states.stats()

    def snapshot_stats(self) -> SnapshotStats | None:
        """The hybrid's state snapshots (None without linear-attention layers or with prefix caching off)."""
        states = self.ledger.states
        return None if states is None or states.snapshots is None else states.snapshots.stats()

    def warmup_stats(self) -> WarmupStats | None:
        """The re-tokenized replies' warm-ups (None where they are off: no hybrid, or no prefix caching)."""
        return None if self._warmup is None else self._warmup.stats()

    def _frontier(self) -> dict:
        return {
            rid: {"state": s.request.state.value, "computed": s.request.num_computed, "tokens": s.request.num_tokens}
            for rid, s in self._requests.items()
        }

    def _check_thread(self) -> None:
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
            if self.streams.device is not None:
                open_device(self.streams.device.ordinal)  # the CUDA context is current per thread
        elif self._owner != me:
            raise RuntimeError("the engine belongs to the thread that first used it; use EngineLoop from others")
