"""The split chunked delta rule (kernels_src/gdn_chunked_split.cu) emulated in numpy: the three passes as the
kernels run them, in their order and over their workspace layout, in the inputs' dtype (float32 as on the
device; float64 checks the decomposition itself, exactly).

Pass 1 (chunk terms, one block per chunk and value head): cum = cumsum(g), A = strict_tril(beta k k^T D),
T = (I + A)^-1 by block doubling, w = T (beta e^cum k), u = T (beta v); stores w, u, cum per row, and per
chunk k^T zero-padded to 64 rows (the kernel keeps w and k^T as bf16 hi/lo plane pairs, an f32's worth, and
also the scales that normalise each row's raw q and k, which this emulation takes normalised). Pass 2 (state
carry, one block per value head and column group, chunks in order): stores the state before each chunk (the
kernel: transposed, as planes), v_new = u - w S over u, S = e^last S + k^T (e^(last - cum) v_new), and the
targets' states. Pass 3 (outputs, one block per chunk and value head): o = e^cum q S_chunk + tril(q k^T D) v_new.
Chunks, their numbering and the targets' row counts are gdn_split_plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ninfer_rt.cuda import gdn_split_plan as plan
from ninfer_rt.exec.numpy_delta_rule import DeltaRuleInputs, unit_lower_inverse

@dataclass
class Workspace:
    """The kernels' workspace arrays (gdn_split_plan.SplitWorkspace), row-major as on the device."""

    w: np.ndarray  # [T, Hv, dk]
    u: np.ndarray  # [T, Hv, dv]: u after pass 1, v_new after pass 2
    cum: np.ndarray  # [T, Hv]
    h: np.ndarray  # [chunks, Hv, dk, dv]
    kt: np.ndarray  # [chunks, Hk, dk, 64]


@dataclass(frozen=True)
class Chunk:
    seq: int
    index: int  # among the step's chunks (chunk_bases)
    first: int  # flat row of the chunk's first row
    rows: int
    end_count: int  # the sequence's row count after the chunk


def chunks_of(query_start: np.ndarray, num_targets: int) -> list[list[Chunk]]:
    """Per sequence its chunks (none for a short sequence), from gdn_split_plan's closed form."""
    lens = np.diff(query_start).tolist()
    bases = plan.chunk_bases(lens, num_targets)
    out = []
    for b, length in enumerate(lens):
        count = plan.chunk_count(length, num_targets) if plan.is_chunked(length) else 0
        points = [plan.chunk_point(length, num_targets, c) for c in range(count + 1)]
        out.append([
            Chunk(b, bases[b] + c, int(query_start[b]) + points[c], points[c + 1] - points[c], points[c + 1]) for c in range(count)
        ])
    return out


def padded(x: np.ndarray, rows: int) -> np.ndarray:
    """x's chunk rows, zero rows after them up to CHUNK."""
    out = np.zeros((plan.CHUNK, *x.shape[1:]), x.dtype)
    out[:rows] = x
    return out


def pass_terms(x: DeltaRuleInputs, ws: Workspace, chunk: Chunk) -> None:
    """Pass 1 for one chunk, all value heads at once ([Hv, 64, ...])."""
    rows = slice(chunk.first, chunk.first + chunk.rows)
    ratio = x.v.shape[1] // x.k.shape[1]
    ws.kt[chunk.index] = padded(x.k[rows], chunk.rows).transpose(1, 2, 0)
    k = np.repeat(padded(x.k[rows], chunk.rows), ratio, axis=1).swapaxes(0, 1)  # [Hv, 64, dk]
    v = padded(x.v[rows], chunk.rows).swapaxes(0, 1)
    g, beta = (padded(y[rows], chunk.rows).T for y in (x.g, x.beta))  # [Hv, 64]
    cum = np.cumsum(g, axis=-1)
    ws.cum[rows] = cum[:, : chunk.rows].T
    lower = np.tril(np.ones((plan.CHUNK, plan.CHUNK), bool), -1)
    decay = np.exp(np.where(lower, cum[:, :, None] - cum[:, None, :], -np.inf))
    a = beta[:, :, None] * (k @ k.swapaxes(1, 2)) * decay
    t = unit_lower_inverse(a)
    w = t @ ((beta * np.exp(cum))[:, :, None] * k)
    u = t @ (beta[:, :, None] * v)
    ws.w[rows] = w[:, : chunk.rows].swapaxes(0, 1)
    ws.u[rows] = u[:, : chunk.rows].swapaxes(0, 1)


def pass_carry(x: DeltaRuleInputs, ws: Workspace, chunks: list[Chunk], state: np.ndarray, num_targets: int,
               saved: np.ndarray) -> None:
    """Pass 2 for one sequence, all heads and columns at once: `state` [Hv, dk, dv] in place, the states
    after the target counts into saved[S] (row count len - S + 1 + i -> saved[i])."""
    length = chunks[-1].end_count
    ratio = x.v.shape[1] // x.k.shape[1]

    def keep(count: int) -> None:
        index = count - length + num_targets - 1
        if 0 <= index < num_targets:
            saved[index] = state

    keep(0)
    for chunk in chunks:
        rows = slice(chunk.first, chunk.first + chunk.rows)
        ws.h[chunk.index] = state
        w = ws.w[rows].swapaxes(0, 1)  # [Hv, n, dk]
        v_new = ws.u[rows].swapaxes(0, 1) - w @ state
        ws.u[rows] = v_new.swapaxes(0, 1)
        cum = ws.cum[rows].T  # [Hv, n]
        last = cum[:, -1:]
        kt = np.repeat(ws.kt[chunk.index][:, :, : chunk.rows], ratio, axis=0)  # [Hv, dk, n]
        state[...] = np.exp(last)[:, :, None] * state + kt @ (np.exp(last - cum)[:, :, None] * v_new)
        keep(chunk.end_count)


def pass_outputs(x: DeltaRuleInputs, ws: Workspace, chunk: Chunk, out: np.ndarray) -> None:
    """Pass 3 for one chunk, all value heads (q and k from the inputs, as the kernel reads them from the conv
    rows and the scales pass 1 stored)."""
    rows = slice(chunk.first, chunk.first + chunk.rows)
    ratio = x.v.shape[1] // x.k.shape[1]
    q, k = (np.repeat(y[rows], ratio, axis=1).swapaxes(0, 1) for y in (x.q, x.k))  # [Hv, n, dk]
    cum = ws.cum[rows].T
    causal = np.tril(np.ones((chunk.rows, chunk.rows), bool))
    decay = np.exp(np.where(causal, cum[:, :, None] - cum[:, None, :], -np.inf))
    o = (np.exp(cum)[:, :, None] * q) @ ws.h[chunk.index] + ((q @ k.swapaxes(1, 2)) * decay) @ ws.u[rows].swapaxes(0, 1)
    out[rows] = o.swapaxes(0, 1)


@dataclass(frozen=True)
class SplitResult:
    out: np.ndarray  # [T, Hv, dv], rows of short sequences untouched (zero)
    final_states: np.ndarray  # [B, Hv, dk, dv]
    saved: np.ndarray  # [B, S, Hv, dk, dv]: the state after len - S + 1 + i rows; NaN where never stored
    workspace: Workspace


def split_delta_rule(x: DeltaRuleInputs, num_targets: int) -> SplitResult:
    """The three passes over every chunked sequence of the step, in x.v's dtype."""
    (rows, hk, dk), (hv, dv), dtype = x.k.shape, x.v.shape[1:], x.v.dtype
    per_seq = chunks_of(np.asarray(x.query_start), num_targets)
    total = plan.chunk_bases(np.diff(x.query_start).tolist(), num_targets)[-1]
    ws = Workspace(*(np.full(shape, np.nan, dtype) for shape in (
        (rows, hv, dk), (rows, hv, dv), (rows, hv), (total, hv, dk, dv), (total, hk, dk, plan.CHUNK))))
    for chunk in (c for chunks in per_seq for c in chunks):
        pass_terms(x, ws, chunk)
    states = x.initial_states.astype(dtype, copy=True)
    saved = np.full((len(per_seq), num_targets, hv, dk, dv), np.nan, dtype)
    for b, chunks in enumerate(per_seq):
        if chunks:
            pass_carry(x, ws, chunks, states[b], num_targets, saved[b])
    out = np.zeros((rows, hv, dv), dtype)
    for chunk in (c for chunks in per_seq for c in chunks):
        pass_outputs(x, ws, chunk, out)
    return SplitResult(out, states, saved, ws)
