"""Engine assembly: the flags and a checkpoint's weights -> device, executor, prepared model, drafter, KV
cache, state slots (hybrid models) and runner, in the order memory asks for (the KV cache is sized last,
from what is left).

`EngineConfig` holds the flags `generate` and `serve` share; `build` turns them into the `EngineParts`
the request loop (engine.py) runs on, timing each start-up phase into `StartupTimes`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from ninfer_rt.cuda.driver import device_count, open_device
from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.engine.kv_ledger import KVLedger
from ninfer_rt.engine.runner import ModelRunner
from ninfer_rt.engine.scheduler import Scheduler, SchedulerConfig
from ninfer_rt.engine.spec import Drafter, DraftHead, SpecRunner
from ninfer_rt.engine.spec import lookahead as spec_lookahead
from ninfer_rt.engine.spec_vocab import DraftVocab
from ninfer_rt.engine.stores import StoreOptions, make_state_ledger, state_spec, store_sizes
from ninfer_rt.exec.cuda_exec import CudaExecutor
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.exec.numpy_rank_stores import rank_major_kv_spec, rank_major_state_spec
from ninfer_rt.exec.numpy_tensor_parallel import TensorParallelExecutor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.kv.manager import KVManager
from ninfer_rt.kv.memory_plan import SnapshotBudget
from ninfer_rt.model.executor import Executor, StepForward
from ninfer_rt.model.hybrid_layers import linear_attention_shape
from ninfer_rt.model.layers import PreparedModel, attention_shape, prepare_model
from ninfer_rt.model.mtp import prepare_mtp
from ninfer_rt.model.config import ModelConfig
from ninfer_rt.model.tensor_parallel import TensorParallelError, TensorParallelPlan, plan_for, shard_weights
from ninfer_rt.model.weights import ModelWeights

DEVICES = ("auto", "cpu", "cuda")
SPEC_METHODS = ("none", "mtp")
# The numpy executor's precisions; a hybrid's state slots on the CPU keep it too, so a state passing
# through a slot between steps is never rounded.
CPU_PRECISIONS = ("float32", "float64")


class EngineError(RuntimeError):
    """The engine cannot be built as configured (one line, for the CLI and the server)."""


@dataclass(frozen=True)
class EngineConfig:
    """The flags `generate` and `serve` share."""

    device: str = "auto"  # the GPU when one is present
    max_context: int = 32768
    kv_capacity: str = "auto"  # 'auto' or a page count
    max_concurrency: int = 2
    kv_dtype: KVDtype = KVDtype.BF16  # the flag's text is parsed here, once
    page_size: int = 64
    token_budget: int = 2048  # tokens per step: bounds the prefill chunk that shares a step with decodes
    prefix_caching: bool = True
    verify_ordering: bool | None = None  # None: NINFER_VERIFY_ORDERING decides
    spec: str = "none"  # speculative decoding: 'none' or 'mtp' (the checkpoint's MTP module drafts)
    draft_tokens: int = 3  # drafts verified per step
    logit_rows: int | None = None  # rows a step may score; None: each lane's last row or its verified rows
    lm_head_draft: int | None = None  # draft over the N most frequent tokens only (engine/spec_vocab.py)
    overlap: bool = True  # enqueue each step before reading the previous one's samples (engine.py)
    state_snapshot_budget: str | None = None  # hybrids: snapshot memory ('4GiB') or count ('16'); None: planned
    snapshot_interval: int = 16384  # hybrids: also save the state every this many tokens of a long prompt
    reply_warmup: bool = True  # hybrids: prefill re-tokenized replies while idle (engine/reply_warmup.py)
    debug_fault_after: int | None = None  # the fault drill (cuda/fault_drill.py): a fault after this many ops
    cpu_precision: str = "float32"  # the numpy executor's math (and a hybrid's CPU state slots): float64 for golden runs
    tensor_parallel: int = 1  # ranks the model is split over (simulated ranks on the CPU)

    def __post_init__(self) -> None:
        if isinstance(self.kv_dtype, str):
            object.__setattr__(self, "kv_dtype", KVDtype.parse(self.kv_dtype))
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
        if self.state_snapshot_budget is not None:
            SnapshotBudget.parse(self.state_snapshot_budget)  # raises naming the flag
        if self.cpu_precision not in CPU_PRECISIONS:
            raise ValueError(f"cpu_precision must be one of {CPU_PRECISIONS}, got {self.cpu_precision!r}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be at least 1, got {self.tensor_parallel}")
        if self.tensor_parallel > 1 and self.lm_head_draft is not None:
            raise ValueError("--lm-head-draft is not built with --tensor-parallel; leave one of them out")
        if self.snapshot_interval < 0:
            raise ValueError(f"snapshot_interval must be 0 (never) or positive, got {self.snapshot_interval}")


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


@dataclass(frozen=True)
class EngineParts:
    """What the request loop runs on."""

    device: str  # 'cpu' or 'cuda'
    streams: StreamSet
    executor: Executor
    kv: KVCache
    kv_manager: KVManager
    ledger: KVLedger
    scheduler: Scheduler
    runner: ModelRunner
    graphed: bool  # decode steps replay captured graphs: capture them before the first request


def build(
    weights: ModelWeights, config: EngineConfig, token_frequencies: np.ndarray | None, startup: StartupTimes
) -> EngineParts:
    if config.spec == "mtp" and weights.mtp is None:
        raise EngineError("--spec mtp: the checkpoint has no MTP weights (no mtp.* tensors); use --spec none")
    device = resolve_device(config.device)
    require_tensor_parallel_path(device, config.tensor_parallel)
    plan = plan_for(weights.config, config.tensor_parallel)
    if plan.ranks > 1:
        weights = shard_weights(weights, plan)
    clock = time.perf_counter()
    streams = StreamSet(open_device() if device == "cuda" else None, verify=config.verify_ordering)
    max_context = min(config.max_context, weights.config.max_position_embeddings)
    executor = make_executor(config, streams, max_context, plan)
    startup.kernels, clock = time.perf_counter() - clock, time.perf_counter()
    model = prepare_model(executor, weights)
    drafter = make_drafter(executor, weights, model, config, token_frequencies)  # before KV sizing
    linear = linear_attention_shape(weights.config) if weights.config.is_hybrid else None
    executor.reserve_step_buffers(attention_shape(weights.config), config.kv_dtype, linear)  # likewise
    sync_device(executor)
    startup.upload_weights, clock = time.perf_counter() - clock, time.perf_counter()
    # The stores are sized last: `--kv-capacity auto` splits what the weights and activations left free.
    options = store_options(weights.config, config, max_context)
    state = state_spec(weights.config, streams.device, np.dtype(config.cpu_precision))
    if plan.ranks > 1:  # one store for every rank, rank-major (exec/numpy_rank_stores.py)
        options = replace(options, kv_page=rank_major_kv_spec(options.kv_page, plan))
        state = state and rank_major_state_spec(state, plan)
    sizes = store_sizes(options, state, streams.device)
    states = make_state_ledger(streams, executor.compute, state, options, sizes.snapshots)
    kv = KVCache(streams, replace(options.kv_page, num_pages=sizes.kv_pages))
    startup.kv = time.perf_counter() - clock
    kv_manager = KVManager(streams, kv, max_context, config.prefix_caching)
    if states is not None and states.snapshots is not None:  # a snapshot goes with the page it ends in
        kv_manager.prefix.on_forget(states.snapshots.page_forgotten)
    ledger = KVLedger(kv_manager, executor.compute, streams.create("copy"), states)
    lookahead = spec_lookahead(config.draft_tokens) if config.spec == "mtp" else 0
    scheduler = Scheduler(SchedulerConfig(config.max_concurrency, config.token_budget, lookahead), ledger)
    # None: steps run op by op. A hybrid's graphed steps publish their state slots like their pages.
    step_forward = executor.graphed_forward(model, kv, None if states is None else states.pool)
    runner = make_runner(executor, model, kv, ledger, drafter, step_forward)
    return EngineParts(device, streams, executor, kv, kv_manager, ledger, scheduler, runner, step_forward is not None)


def sync_device(executor: Executor) -> None:
    """Wait for everything enqueued so far (start-up phases are timed to completion, not to enqueue)."""
    if executor.streams.device is not None:
        executor.compute.synchronize()


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


def max_step_logit_rows(config: EngineConfig) -> int:
    """The most rows a serving step scores: a prefill chunk its last row, a decode 1 + draft_tokens. The
    logits buffer is sized by it before the KV cache takes what is free: at a 248k vocabulary every
    step row would cost 1 MB of float32 logits (2 GB at a 2,048-token budget)."""
    drafts = config.draft_tokens if config.spec == "mtp" else 0
    return config.max_concurrency * (1 + drafts)


def require_tensor_parallel_path(device: str, ranks: int) -> None:
    """Tensor parallelism runs as simulated ranks on the CPU; the GPUs' NCCL path is not built."""
    if ranks > 1 and device == "cuda":
        raise TensorParallelError(
            f"--tensor-parallel {ranks}: multi-GPU tensor parallelism needs the NCCL path, which is not built; "
            "--device cpu runs the ranks simulated"
        )


def make_executor(config: EngineConfig, streams: StreamSet, max_context: int, plan: TensorParallelPlan) -> Executor:
    if streams.device is None and plan.ranks > 1:
        return TensorParallelExecutor(streams, plan, dtype=np.dtype(config.cpu_precision))
    if streams.device is None:
        return NumpyExecutor(streams, dtype=np.dtype(config.cpu_precision))
    return CudaExecutor(
        streams,
        max_tokens=max_step_rows(config),
        max_seqs=config.max_concurrency,
        max_logit_rows=config.logit_rows or max_step_logit_rows(config),
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


def make_runner(
    executor: Executor,
    model: PreparedModel,
    kv: KVCache,
    ledger: KVLedger,
    drafter: Drafter | None,
    step_forward: StepForward | None,
) -> ModelRunner:
    """The plain runner, or with a drafter the speculative one; graphed where the executor graphs steps."""
    if drafter is None:
        return ModelRunner(executor, model, kv, ledger, step_forward)
    mtp_steps = executor.graphed_mtp_steps(model, drafter.mtp, kv)  # None: op by op
    return SpecRunner(executor, model, kv, ledger, drafter, step_forward, mtp_steps)


def state_ring_depth(config: EngineConfig) -> int:
    """State slots per running sequence: the live one, plus one per draft for the per-position verify
    states of speculative decoding (kv/states_verify.py)."""
    return 1 + (config.draft_tokens if config.spec == "mtp" else 0)


def store_options(cfg: ModelConfig, config: EngineConfig, max_context: int) -> StoreOptions:
    page = KVSpec(
        # full-attention layers only (a hybrid's linear ones keep states), then the MTP layer (model/mtp.py)
        num_layers=len(cfg.full_attention_layers) + cfg.mtp_layers,
        num_pages=1,
        n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        dtype=config.kv_dtype,
        page_size=config.page_size,
    )
    return StoreOptions(
        config.kv_capacity, page, config.max_concurrency, max_context, state_ring_depth(config),
        config.prefix_caching, config.state_snapshot_budget, config.snapshot_interval,
    )
