"""Calibration for the quantizer: each linear layer's mean x x^T over its inputs on a text.

Windows of the text run through the numpy executor (the reference forward); each linear layer's mean
x x^T then weights the scale search and drives GPTQ's choice of codes (quantizer.py). Layers the forward
never runs (the MTP module, an untied lm_head) get no statistics and keep the weight-only scale search.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ninfer_rt.cuda.streams import StreamSet
from ninfer_rt.model.executor import StepBatch, WeightRole
from ninfer_rt.exec.numpy_exec import NumpyExecutor
from ninfer_rt.kv.cache import KVCache, KVDtype, KVSpec
from ninfer_rt.model.layers import forward, prepare_model
from ninfer_rt.model.tokenizer import Tokenizer
from ninfer_rt.model.weights import load_model_weights
from ninfer_rt.quantize.format import Linear

CALIBRATION_WINDOW = 512  # tokens per calibration sequence
# The checkpoint weights behind each matrix prepare_layer (model/layers.py) builds: they share its input.
PREPARED_INPUTS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


class _InputRecorder(NumpyExecutor):
    """The numpy executor, also summing x^T x of every linear layer's input by the weight it multiplies."""

    def __init__(self, streams: StreamSet) -> None:
        super().__init__(streams)
        self.names: dict[int, str] = {}  # id(prepared weight) -> its prepare_weight name
        self.sums: dict[str, np.ndarray] = {}
        self.rows: dict[str, int] = {}

    def prepare_weight(self, name: str, parts: Sequence[Linear], role: WeightRole) -> np.ndarray:
        prepared = super().prepare_weight(name, parts, role)
        self.names[id(prepared)] = name
        return prepared

    def linear(self, x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        name = self.names[id(weight)]
        x64 = np.asarray(x, np.float64)  # float64 sums: thousands of rows without losing the small channels
        self.sums[name] = self.sums.get(name, 0.0) + x64.T @ x64
        self.rows[name] = self.rows.get(name, 0) + x.shape[0]
        return super().linear(x, weight)


def input_hessians(model_dir: Path, text_path: str, tokens: int) -> dict[str, np.ndarray]:
    """Checkpoint weight name -> mean x x^T of its inputs over up to ``tokens`` tokens of the text, run in
    windows of CALIBRATION_WINDOW through the numpy executor (the reference forward)."""
    ids = np.asarray(Tokenizer(model_dir).encode(Path(text_path).read_text()), dtype=np.int32)[:tokens]
    if len(ids) < CALIBRATION_WINDOW:
        raise ValueError(f"--calibration-text {text_path}: {len(ids)} tokens, fewer than one {CALIBRATION_WINDOW}-token window")
    weights = load_model_weights(model_dir)
    cfg = weights.config
    streams = StreamSet(None)
    recorder = _InputRecorder(streams)
    model = prepare_model(recorder, weights)
    kv = KVCache(streams, KVSpec(
        num_pages=-(-CALIBRATION_WINDOW // 16), num_layers=cfg.num_hidden_layers, n_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, dtype=KVDtype.BF16, page_size=16,
    ))
    for start in range(0, len(ids) - CALIBRATION_WINDOW + 1, CALIBRATION_WINDOW):
        forward(recorder, model, _window_batch(ids[start:start + CALIBRATION_WINDOW], kv.spec.page_size), kv)
    return {
        f"model.{prepared.rsplit('.', 1)[0]}.{module}.weight": total / recorder.rows[prepared]
        for prepared, total in recorder.sums.items()
        if prepared.rsplit(".", 1)[-1] in PREPARED_INPUTS
        for module in PREPARED_INPUTS[prepared.rsplit(".", 1)[-1]]
    }


def _window_batch(tokens: np.ndarray, page_size: int) -> StepBatch:
    """One fresh sequence prefilled in one step on pages 0, 1, ...; only its last row's logits."""
    positions = np.arange(len(tokens), dtype=np.int32)
    return StepBatch(
        token_ids=tokens,
        positions=positions,
        query_start=np.array([0, len(tokens)], np.int32),
        context_lens=np.array([len(tokens)], np.int32),
        block_tables=np.arange(-(-len(tokens) // page_size), dtype=np.int32)[None, :],
        slot_mapping=positions,  # consecutive pages from 0: slot == position
        logit_rows=positions[-1:],
        lanes=("calibration",),
    )
