"""The numpy executor's linear-attention op over state slots: read each sequence's state from its slot,
run the layer (exec/numpy_linear_attn.py), write the states the step's targets ask for.

Slots are kv/states.py's StateSlotPool views: per layer a conv window [channels, kernel - 1] and a
recurrent state [value heads, key dim, value dim], stored in the pool's dtypes (the executor's own
precision on the CPU, so a state that passes through a slot between steps loses nothing). Targets
(StepBatch.state_targets, [B, S], -1 pads at the front) receive the states after a sequence's last S rows:
S = 1 keeps the final state only; a verification pass of k + 1 rows keeps all of them (kv/states_verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ninfer_rt.exec.numpy_linear_attn import LinearAttnState, LinearAttnWeights, linear_attention_mix
from ninfer_rt.kv.states import StateSlotPool
from ninfer_rt.model.executor import LinearAttentionParams


def saved_row_counts(query_start: np.ndarray, targets: np.ndarray) -> list[list[int]]:
    """Per sequence, the row counts after which its (non-padding) targets want the state."""
    lengths = np.diff(query_start)
    width = targets.shape[1]
    counts = []
    for seq, length in enumerate(lengths):
        wanted = [int(length) - width + 1 + t for t in range(width) if targets[seq, t] >= 0]
        if wanted and wanted[0] < 0:
            raise ValueError(f"sequence {seq} has {int(length)} rows; its state targets ask for the state after {wanted[0]}")
        counts.append(wanted)
    return counts


def read_states(pool: StateSlotPool, layer: int, slots: Sequence[int], dtype: np.dtype) -> LinearAttnState:
    return LinearAttnState(
        np.stack([pool.conv_window(int(s), layer).T for s in slots]).astype(dtype),
        np.stack([pool.recurrent(int(s), layer) for s in slots]).astype(dtype),
    )


def run_linear_attention(
    projected: np.ndarray,
    params: LinearAttentionParams,
    pool: StateSlotPool,
    layer: int,
    query_start: np.ndarray,
    slots: np.ndarray,
    targets: np.ndarray,
) -> np.ndarray:
    """projected [T, q | k | v | z | b | a] -> out_proj's input [T, value heads * value dim]."""
    shape = params.shape
    qkv, z, b, a = np.split(
        projected, np.cumsum([shape.conv_channels, shape.value_size, shape.num_value_heads]), axis=-1
    )
    weights = LinearAttnWeights(params.conv_weight, params.a_log, params.dt_bias, params.norm)
    state = read_states(pool, layer, slots, projected.dtype)
    counts = saved_row_counts(query_start, targets)
    result = linear_attention_mix(qkv, z, b, a, weights, shape, query_start, state, counts)
    for seq, saved in enumerate(result.saved):
        for index, slot in enumerate(t for t in targets[seq] if t >= 0):
            pool.conv_window(int(slot), layer)[...] = saved.conv_windows[index].T
            pool.recurrent(int(slot), layer)[...] = saved.recurrent[index]
    return result.out
