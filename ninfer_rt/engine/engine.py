"""Engine: add_request / step / abort / generate over the scheduler, the KV ledger and the model runner.

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

from ninfer_rt.cuda.driver import Device, device_count, open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.engine.kv_ledger import KVLedger
from ninfer_rt.engine.output import OutputStream, RequestOutput
from ninfer_rt.engine.request import FinishReason, Request, SamplingParams
from ninfer_rt.engine.runner import ModelRunner
from ninfer_rt.engine.sampling import PendingSamples
from ninfer_rt.engine.scheduler import Scheduler, SchedulerConfig, SchedulerStep
from ninfer_rt.engine.spec import Drafter, DraftHead, SpecRunner
from ninfer_rt.engine.spec import lookahead as spec_lookahead
from ninfer_rt.engine.spec_vocab import DraftVocab, load_token_frequencies
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVSpec
from ninfer_rt.kv.capacity import check_fits, resolve_kv_capacity
from ninfer_rt.kv.manager import KVManager
from ninfer_rt.kv.pages import PoolStats
from ninfer_rt.model.executor import Executor
from ninfer_rt.model.layers import PreparedModel, attention_shape, prepare_model
from ninfer_rt.model.mtp import prepare_mtp
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.weights import ModelWeights, load_model_weights

DEVICES = ("auto", "cpu", "cuda")
SPEC_METHODS = ("none", "mtp")


class EngineError(RuntimeError):
    """The engine cannot be built as configured (one line, for the CLI and the server)."""


@dataclass(frozen=True)
class EngineConfig:
    """The flags `generate` and `serve` share."""

    device: str = "auto"  # the GPU when one is present
    max_context: int = 32768
    kv_capacity: str = "auto"  # 'auto' or a page count
    max_concurrency: int = 2
    kv_dtype: str = "bf16"
    page_size: int = 64
    token_budget: int = 2048  # tokens per step: bounds the prefill chunk that shares a step with decodes
    prefix_caching: bool = True
    verify_ordering: bool | None = None  # None: NINFER_VERIFY_ORDERING decides
    spec: str = "none"  # speculative decoding: 'none' or 'mtp' (the checkpoint's MTP module drafts)
    draft_tokens: int = 3  # drafts verified per step
    lm_head_draft: int | None = None  # draft over the N most frequent tokens only (engine/spec_vocab.py)
    overlap: bool = True  # enqueue each step before reading the previous one's samples (module docstring)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.max_context < 2:
            raise ValueError(f"max_context must be at least 2, got {self.max_context}")
        if self.spec not in SPEC_METHODS:
            raise ValueError(f"spec must be one of {SPEC_METHODS}, got {self.spec!r}")
        if self.draft_tokens < 1:
            raise ValueError(f"draft_tokens must be at least 1, got {self.draft_tokens}")
        if self.lm_head_draft is not None and self.lm_head_draft < 1:
            raise ValueError(f"lm_head_draft must be at least 1, got {self.lm_head_draft}")


@dataclass(frozen=True)
class InFlight:
    """A step whose samples are on their way back: request i owns sample row i."""

    requests: list[Request]
    samples: PendingSamples


@dataclass
class StartupTimes:
    """Seconds spent getting ready, by phase (printed at start-up by `generate` and `serve`)."""

    read_weights: float = 0.0  # safetensors -> host arrays (Engine.load)
    upload_weights: float = 0.0  # prepare_model: host -> device, fused matrices
    kernels: float = 0.0  # executor: NVRTC (or the cubin cache) and module loads
    kv: float = 0.0  # KV cache allocation
    graphs: float = 0.0  # warm-up requests capturing every decode step graph

    def describe(self) -> str:
        total = self.read_weights + self.upload_weights + self.kernels + self.kv + self.graphs
        return (
            f"ready in {total:.1f} s: weights {self.read_weights + self.upload_weights:.1f} s, kernels {self.kernels:.1f} s, "
            f"KV {self.kv:.1f} s, decode graphs {self.graphs:.1f} s"
        )


class Engine:
    def __init__(
        self,
        weights: ModelWeights,
        tokenizer: Tokenizer,
        config: EngineConfig = EngineConfig(),
        token_frequencies: np.ndarray | None = None,  # for --lm-head-draft (spec_vocab.py)
    ) -> None:
        if config.spec == "mtp" and weights.mtp is None:
            raise EngineError("--spec mtp: the checkpoint has no MTP weights (no mtp.* tensors); use --spec none")
        self.config = config
        self.tokenizer = tokenizer
        self.device = resolve_device(config.device)
        self.startup = StartupTimes()
        clock = time.perf_counter()
        self.streams = StreamSet(open_device() if self.device == "cuda" else None, verify=config.verify_ordering)
        cfg = weights.config
        max_context = min(config.max_context, cfg.max_position_embeddings)
        self.executor = make_executor(config, self.streams, max_context)
        self.eos_ids = frozenset(tokenizer.eos_token_ids) | frozenset(cfg.eos_token_ids)
        self.startup.kernels, clock = time.perf_counter() - clock, time.perf_counter()
        model = prepare_model(self.executor, weights)
        drafter = make_drafter(self.executor, weights, model, config, token_frequencies)  # before KV sizing
        self.executor.reserve_attention(attention_shape(cfg), config.kv_dtype)  # likewise
        self._sync_device()
        self.startup.upload_weights, clock = time.perf_counter() - clock, time.perf_counter()
        # KV is sized last: `--kv-capacity auto` takes what the weights and activations left free.
        self.kv = KVCache(self.streams, kv_spec(weights, config, self.streams.device))
        self.startup.kv = time.perf_counter() - clock
        self.kv_manager = KVManager(self.streams, self.kv, max_context, config.prefix_caching)
        self.ledger = KVLedger(self.kv_manager, self.executor.compute, self.streams.create("copy"))
        lookahead = spec_lookahead(config.draft_tokens) if config.spec == "mtp" else 0
        self.scheduler = Scheduler(SchedulerConfig(config.max_concurrency, config.token_budget, lookahead), self.ledger)
        step_forward = self.executor.graphed_forward(model, self.kv)  # None: steps run op by op
        if drafter is None:
            self.runner = ModelRunner(self.executor, model, self.kv, self.ledger, step_forward)
        else:
            mtp_steps = self.executor.graphed_mtp_steps(model, drafter.mtp, self.kv)
            self.runner = SpecRunner(self.executor, model, self.kv, self.ledger, drafter, step_forward, mtp_steps)
        self._requests: dict[str, OutputStream] = {}
        self._pending: list[RequestOutput] = []  # outputs of requests ended between steps (abort)
        self._overlap = config.overlap and drafter is None
        self._inflight: InFlight | None = None
        self._ids = itertools.count()
        self._owner: int | None = None
        self.streams.crash.add_section("engine", self._frontier)
        if step_forward is not None:  # graphed steps: capture them before the first request
            clock = time.perf_counter()
            self._capture_decode_graphs()
            self.startup.graphs = time.perf_counter() - clock

    @classmethod
    def load(cls, model_dir: str | Path, config: EngineConfig = EngineConfig()) -> Engine:
        clock = time.perf_counter()
        weights = load_model_weights(model_dir)
        frequencies = load_token_frequencies(model_dir, weights.config.vocab_size) if config.lm_head_draft else None
        read_weights = time.perf_counter() - clock
        engine = cls(weights, Tokenizer(model_dir), config, frequencies)
        engine.startup.read_weights = read_weights
        print(f"ninfer-rt: {engine.startup.describe()}", file=sys.stderr)
        return engine

    def _sync_device(self) -> None:
        """Wait for everything enqueued so far (start-up phases are timed to completion, not to enqueue)."""
        if self.streams.device is not None:
            self.executor.compute.synchronize()

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
        self._sync_device()
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
        self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams(), request_id: str | None = None
    ) -> str:
        self._check_thread()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.validate(prompt_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(request_id, prompt_ids, params)
        self._requests[request_id] = OutputStream(request, self.tokenizer, self.eos_ids, self.kv_manager.context_limit)
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """End a request wherever it is; its pages go back to the pool. Unknown or finished ids are ignored."""
        self._check_thread()
        stream = self._requests.pop(request_id, None)
        if stream is None:
            return
        self.scheduler.abort(stream.request)
        self._pending.append(stream.close(FinishReason.ABORT))

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or bool(self._pending) or self._inflight is not None

    # -- stepping --------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns every request's delta (and every final output). With overlap
        the deltas are the previous step's, whose samples were read back while this one was enqueued."""
        self._check_thread()
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
        return output

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


def resolve_device(device: str) -> str:
    """'auto' is the GPU when one is present, else the CPU."""
    if device == "auto":
        return "cuda" if device_count() > 0 else "cpu"
    return device


def max_step_rows(config: EngineConfig) -> int:
    """The most rows one step can hold: the token budget counts a speculative decode as one token, but
    it verifies 1 + draft_tokens rows."""
    drafts = config.draft_tokens if config.spec == "mtp" else 0
    return config.token_budget + config.max_concurrency * drafts


def make_executor(config: EngineConfig, streams: StreamSet, max_context: int) -> Executor:
    if streams.device is None:
        return NumpyExecutor(streams)
    return CudaExecutor(
        streams,
        max_tokens=max_step_rows(config),
        max_seqs=config.max_concurrency,
        max_pages_per_seq=-(-max_context // config.page_size) + 1,
        max_positions=max_context,
    )


def make_drafter(
    executor: Executor, weights: ModelWeights, model: PreparedModel, config: EngineConfig, token_frequencies: np.ndarray | None
) -> Drafter | None:
    if config.spec == "none":
        return None
    vocab = None
    if config.lm_head_draft is not None:
        vocab = DraftVocab(config.lm_head_draft, weights.config.vocab_size, token_frequencies)
    return Drafter(prepare_mtp(executor, weights, model), DraftHead(executor, model, weights, vocab), config.draft_tokens)


def kv_spec(weights: ModelWeights, config: EngineConfig, device: Device | None) -> KVSpec:
    cfg = weights.config
    shape = dict(
        num_layers=cfg.num_hidden_layers + cfg.mtp_layers,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=config.kv_dtype,
        page_size=config.page_size,
    )
    page = KVSpec(num_pages=1, **shape)
    if device is None:  # CPU: memory is not the limit
        num_pages = resolve_kv_capacity(config.kv_capacity, page, None)
    else:
        # What prepare_model left free; the margin keeps room for the activation pool, cuBLAS workspaces
        # and graphs, which are allocated after the KV.
        margin = max(3 << 30, device.total_memory // 20)
        num_pages = resolve_kv_capacity(config.kv_capacity, page, device.free_memory(), margin)
    return KVSpec(num_pages=num_pages, **shape)
