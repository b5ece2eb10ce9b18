"""`ninfer-rt check`'s logits comparison: the first tokens through the numpy forward and through transformers.

Both run float32 math on the same weights: bf16/fp16 checkpoints are widened exactly to float32 by both, and a
quantized checkpoint's reference is transformers on its dequantized weights (written to a temporary float32
checkpoint, since transformers cannot run the groupwise format, and GPTQ or FP8 only with optional kernels). The
error is max |ours - theirs| / max |theirs| over every row's logits; float32 forwards of the same weights
differ by accumulation order only (about 1e-6 on the tiny models), so MAX_RELATIVE_ERROR = 1e-3 is far
above rounding and far below what any wrong op gives (a misread norm or gate moves logits by 1e-1 or more).
torch and transformers are imported only here, only when present.
"""

from __future__ import annotations

import importlib.util
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.kv.states import StateSlotPool, StateSpec
from ninfer_rt.model.executor import StepBatch
from ninfer_rt.model.layers import forward, prepare_model
from ninfer_rt.model.weights import Checkpoint, ModelWeights, stored_name
from ninfer_rt.quantize.layouts import dense
from ninfer_rt.quantize.scheme import scheme_from_dir

MAX_RELATIVE_ERROR = 1e-3
PAGE_SIZE = 16
SIDE_FILES = ("generation_config.json",)


def reference_available() -> str | None:
    """None when transformers and torch can be imported, else why the comparison is skipped."""
    missing = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


def numpy_logits(checkpoint: Checkpoint, tokens: Sequence[int]) -> np.ndarray:
    """Logits [len(tokens), vocab] of one fresh sequence prefilled in one step by the float32 numpy forward."""
    cfg = checkpoint.config
    streams = StreamSet()
    executor = NumpyExecutor(streams, dtype=np.float32)
    kv = KVCache(streams, KVSpec(
        num_layers=len(cfg.full_attention_layers) + cfg.mtp_layers, num_pages=-(-len(tokens) // PAGE_SIZE),
        n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, dtype=KVDtype.parse("f32"), page_size=PAGE_SIZE,
    ))
    states = None
    if cfg.is_hybrid:
        states = StateSlotPool(streams, StateSpec.for_model(cfg, executor.dtype, executor.dtype), 1)
        states.zero(states.acquire(executor.compute), executor.compute)
    model = prepare_model(executor, ModelWeights.from_checkpoint(checkpoint))
    out = forward(executor, model, _prefill_batch(tokens), kv, states)
    return executor.to_host(out.logits)


def _prefill_batch(tokens: Sequence[int]) -> StepBatch:
    count = len(tokens)
    positions = np.arange(count, dtype=np.int32)
    return StepBatch(
        token_ids=np.asarray(tokens, np.int32),
        positions=positions,
        query_start=np.array([0, count], np.int32),
        context_lens=np.array([count], np.int32),
        block_tables=np.arange(-(-count // PAGE_SIZE), dtype=np.int32)[None, :],
        slot_mapping=positions,  # consecutive pages from 0: slot == position
        logit_rows=positions,
        state_slots=np.zeros(1, np.int32),
        state_targets=np.zeros((1, 1), np.int32),
    )


def transformers_logits(model_dir: Path, checkpoint: Checkpoint, tokens: Sequence[int]) -> np.ndarray:
    """transformers' float32 logits of ``tokens``; a quantized checkpoint runs as its dequantized weights."""
    import torch
    from transformers import AutoModelForCausalLM

    quantized = scheme_from_dir(model_dir) is not None
    with tempfile.TemporaryDirectory(prefix="ninfer-check-") as scratch:
        source = _dequantized_copy(model_dir, checkpoint, Path(scratch)) if quantized else model_dir
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            logits = model.eval()(torch.tensor([list(tokens)])).logits
    return logits[0].numpy()


def _dequantized_copy(model_dir: Path, checkpoint: Checkpoint, out: Path) -> Path:
    """A float32 checkpoint of ``checkpoint``'s weights under the stored names, config without quantization."""
    cfg = checkpoint.config
    tensors = {stored_name(cfg, name): np.ascontiguousarray(dense(t, np.float32)) for name, t in checkpoint.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    raw.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(raw))
    for name in SIDE_FILES:
        if (model_dir / name).is_file():
            (out / name).write_text((model_dir / name).read_text())
    return out


def max_relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    ours, reference = np.asarray(ours, np.float64), np.asarray(reference, np.float64)
    return float(np.abs(ours - reference).max() / np.abs(reference).max())
