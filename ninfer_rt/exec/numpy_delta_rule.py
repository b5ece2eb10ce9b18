"""The gated delta rule of the hybrid (Qwen3.5) linear-attention layers, in numpy: recurrent and chunked.

Per value head the state S [dk, dv] evolves over a sequence's tokens t:
    S = exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S += k_t delta^T;  o_t = S^T q_t
q and k arrive L2-normalised and q scaled by dk^-0.5 (numpy_linear_attn.normalize_qk); value head j reads
key head j // (Hv / Hk).

Rows of several sequences come flat ([T, heads, d]) with query_start [B+1]: sequence b owns rows
query_start[b]:query_start[b+1] and starts from initial_states[b] [Hv, dk, dv]. Arithmetic runs in the
dtype of v (float32 or float64). `save_after[b]` lists row counts n (0..len_b) after which sequence b's
state is returned as well: the end of a prompt for a snapshot, or every count 0..k+1 when verifying
k+1 draft rows, so that accepting a rows is picking saved_states[b][a].

The chunked form (UT/WY transform) cuts each sequence into chunks of CHUNK rows counted from its first
row, and cuts a chunk in two at every requested count: a requested state is then the state between two
chunks, which the scan over chunks computes anyway, exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

CHUNK = 64
RECURRENT_MAX_ROWS = 8  # decode (1 row) and verification (k+1 rows); anything longer is chunked
SaveAfter = Sequence[Sequence[int]]  # per sequence, the row counts after which its state is kept


@dataclass(frozen=True)
class DeltaRuleInputs:
    q: np.ndarray  # [T, Hk, dk], normalised and scaled
    k: np.ndarray  # [T, Hk, dk], normalised
    v: np.ndarray  # [T, Hv, dv]
    g: np.ndarray  # [T, Hv], log-decay (<= 0)
    beta: np.ndarray  # [T, Hv]
    query_start: np.ndarray  # [B+1]
    initial_states: np.ndarray  # [B, Hv, dk, dv]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.query_start)

    def per_value_head(self) -> tuple[np.ndarray, np.ndarray]:
        """q, k repeated to [T, Hv, dk] in v's dtype: value head j reads key head j // (Hv / Hk)."""
        ratio, remainder = divmod(self.v.shape[1], self.k.shape[1])
        if remainder:
            raise ValueError(f"{self.v.shape[1]} value heads are not a multiple of {self.k.shape[1]} key heads")
        q, k = (np.repeat(x.astype(self.v.dtype, copy=False), ratio, axis=1) for x in (self.q, self.k))
        return q, k


@dataclass(frozen=True)
class DeltaRuleResult:
    out: np.ndarray  # [T, Hv, dv]
    final_states: np.ndarray  # [B, Hv, dk, dv]
    saved_states: tuple[np.ndarray, ...]  # per sequence [len(save_after[b]), Hv, dk, dv]


def gated_delta_rule(x: DeltaRuleInputs, save_after: SaveAfter | None = None) -> DeltaRuleResult:
    """The form the executor runs: recurrent for decode and verification rows, chunked for prefill."""
    recurrent = x.lengths.max(initial=0) <= RECURRENT_MAX_ROWS
    return (recurrent_gated_delta_rule if recurrent else chunked_gated_delta_rule)(x, save_after)


def recurrent_gated_delta_rule(x: DeltaRuleInputs, save_after: SaveAfter | None = None) -> DeltaRuleResult:
    """Token by token, vectorised over sequences and heads."""
    (q, k), g, v, beta = x.per_value_head(), x.g, x.v, x.beta
    starts, lengths = np.asarray(x.query_start[:-1]), x.lengths
    states, saver = _start(x, save_after)
    out = np.zeros_like(v)
    for t in range(int(lengths.max(initial=0))):
        seqs = np.flatnonzero(lengths > t)
        rows = starts[seqs] + t
        s = states[seqs] * np.exp(g[rows])[..., None, None]
        predicted = np.einsum("nhkv,nhk->nhv", s, k[rows])
        delta = beta[rows][..., None] * (v[rows] - predicted)
        s += k[rows][..., :, None] * delta[..., None, :]
        out[rows] = np.einsum("nhkv,nhk->nhv", s, q[rows])
        states[seqs] = s
        saver.offer(seqs, np.full(len(seqs), t + 1), s)
    return DeltaRuleResult(out, states, saver.saved)


def chunked_gated_delta_rule(x: DeltaRuleInputs, save_after: SaveAfter | None = None) -> DeltaRuleResult:
    """Chunks of all sequences at once (intra-chunk work batched), then one scan step per chunk index."""
    plan = plan_chunks(x.query_start, save_after)
    chunks = _ChunkTerms(plan, *x.per_value_head(), x.v, x.g, x.beta)
    states, saver = _start(x, save_after)
    chunk_out = np.empty_like(chunks.u)
    for ids in plan.by_local_index():
        seqs = plan.seq[ids]
        s = states[seqs]
        v_new = chunks.u[ids] - chunks.w[ids] @ s
        chunk_out[ids] = chunks.q_decayed[ids] @ s + chunks.qk_decayed[ids] @ v_new
        s = s * chunks.total_decay[ids][..., None, None] + chunks.k_to_end[ids].swapaxes(-1, -2) @ v_new
        states[seqs] = s
        saver.offer(seqs, plan.end[ids] - x.query_start[seqs], s)
    out = np.zeros_like(x.v)
    out[plan.rows(0)[plan.valid]] = chunk_out.swapaxes(1, 2)[plan.valid]
    return DeltaRuleResult(out, states, saver.saved)


@dataclass(frozen=True)
class ChunkPlan:
    """Chunks of rows [start, end) in flat row numbers; `local` counts a sequence's chunks from 0."""

    seq: np.ndarray  # [N] sequence of each chunk
    start: np.ndarray  # [N]
    end: np.ndarray  # [N]
    local: np.ndarray  # [N]
    width: int  # the longest chunk rounded up to a power of two; padding rows change nothing

    def rows(self, padding_row: int) -> np.ndarray:
        """[N, width] row of each chunk slot; padding slots read `padding_row`."""
        return np.where(self.valid, self.start[:, None] + np.arange(self.width), padding_row)

    @property
    def valid(self) -> np.ndarray:
        return np.arange(self.width)[None, :] < (self.end - self.start)[:, None]

    def by_local_index(self) -> list[np.ndarray]:
        return [np.flatnonzero(self.local == i) for i in range(int(self.local.max(initial=-1)) + 1)]


def plan_chunks(query_start: np.ndarray, save_after: Sequence[Sequence[int]] | None = None) -> ChunkPlan:
    """Chunk ends at multiples of CHUNK from each sequence's first row, at every requested count, and at its end."""
    seq, start, end, local = [], [], [], []
    for b in range(len(query_start) - 1):
        first, length = int(query_start[b]), int(query_start[b + 1] - query_start[b])
        requested = save_after[b] if save_after is not None else ()
        cuts = sorted({*range(CHUNK, length, CHUNK), *(int(n) for n in requested if 0 < n < length), length} - {0})
        previous = 0
        for index, cut in enumerate(cuts):
            seq.append(b), start.append(first + previous), end.append(first + cut), local.append(index)
            previous = cut
    as_int = [np.asarray(x, dtype=np.int64) for x in (seq, start, end, local)]
    longest = int((as_int[2] - as_int[1]).max(initial=1))
    return ChunkPlan(*as_int, width=1 << (longest - 1).bit_length())  # a power of two, for the block inverse


class _ChunkTerms:
    """The state-independent terms of every chunk, [N, Hv, width, ...]; padding rows have k = v = beta = g = 0."""

    def __init__(
        self, plan: ChunkPlan, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray
    ) -> None:
        rows = plan.rows(padding_row=v.shape[0])

        def gather(x: np.ndarray) -> np.ndarray:
            with_zero_row = np.concatenate([x, np.zeros_like(x[:1])])
            return np.ascontiguousarray(np.moveaxis(with_zero_row[rows], 1, 2))  # [N, H, width, ...]

        q, k, v, g, beta = (gather(x) for x in (q, k, v, g, beta))
        cum = np.cumsum(g, axis=-1)  # log of the decay from the chunk's start to each row (inclusive)
        causal = np.tril(np.ones((plan.width, plan.width), dtype=bool))
        # decay[i, j] = exp(cum_i - cum_j) for j <= i; the masked half would overflow, so it is never exponentiated
        decay = np.exp(np.where(causal, cum[..., :, None] - cum[..., None, :], -np.inf))
        strictly_lower = (beta[..., :, None] * (k @ k.swapaxes(-1, -2)) * decay) * ~np.eye(plan.width, dtype=bool)
        # UT transform: (I + strictly_lower) [u | w] = [beta v | beta k exp(cum)]; u are the values the chunk
        # writes on a zero state, w the keys through which the incoming state cancels them
        inverse = unit_lower_inverse(strictly_lower)
        self.u = inverse @ (beta[..., None] * v)
        self.w = inverse @ ((beta * np.exp(cum))[..., None] * k)
        self.qk_decayed = (q @ k.swapaxes(-1, -2)) * decay
        self.q_decayed = q * np.exp(cum)[..., None]
        self.k_to_end = k * np.exp(cum[..., -1:] - cum)[..., None]
        self.total_decay = np.exp(cum[..., -1])


def unit_lower_inverse(strictly_lower: np.ndarray) -> np.ndarray:
    """(I + L)^-1 for strictly lower triangular L [..., n, n], n a power of two, by doubling the inverted
    diagonal blocks: inv([[A, 0], [C, B]]) = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]. Batched matmuls only."""
    n = strictly_lower.shape[-1]
    inverse = np.ones((*strictly_lower.shape[:-2], n, 1, 1), dtype=strictly_lower.dtype)  # the 1x1 blocks
    size = 1
    while size < n:
        pairs = _diagonal_blocks(strictly_lower, 2 * size)
        upper, lower = inverse[..., 0::2, :, :], inverse[..., 1::2, :, :]
        merged = np.zeros((*pairs.shape[:-2], 2 * size, 2 * size), dtype=inverse.dtype)
        merged[..., :size, :size] = upper
        merged[..., size:, size:] = lower
        merged[..., size:, :size] = -(lower @ pairs[..., size:, :size] @ upper)
        inverse, size = merged, 2 * size
    return inverse[..., 0, :, :]


def _diagonal_blocks(x: np.ndarray, size: int) -> np.ndarray:
    """[..., n, n] -> [..., n / size, size, size], the blocks on the diagonal."""
    count = x.shape[-1] // size
    blocks = x.reshape(*x.shape[:-2], count, size, count, size)
    return np.moveaxis(np.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


class _Saver:
    """Collects the states after the requested row counts of each sequence."""

    def __init__(self, save_after: Sequence[Sequence[int]] | None, lengths: np.ndarray, states: np.ndarray) -> None:
        requests = save_after if save_after is not None else [()] * len(lengths)
        if len(requests) != len(lengths):
            raise ValueError(f"save_after has {len(requests)} entries for {len(lengths)} sequences")
        self._slots: list[dict[int, list[int]]] = []
        for b, counts in enumerate(requests):
            bad = [n for n in counts if not 0 <= n <= lengths[b]]
            if bad:
                raise ValueError(f"save_after[{b}]: row counts {bad} outside 0..{int(lengths[b])}")
            slots: dict[int, list[int]] = {}
            for slot, n in enumerate(counts):
                slots.setdefault(int(n), []).append(slot)
            self._slots.append(slots)
        self.saved = tuple(np.empty((len(c), *states.shape[1:]), dtype=states.dtype) for c in requests)

    def offer(self, seqs: np.ndarray, counts: np.ndarray, states: np.ndarray) -> None:
        """states[i] is sequence seqs[i]'s state after counts[i] rows."""
        for i, (b, n) in enumerate(zip(seqs.tolist(), counts.tolist())):
            for slot in self._slots[b].get(n, ()):
                self.saved[b][slot] = states[i]


def _start(x: DeltaRuleInputs, save_after: SaveAfter | None) -> tuple[np.ndarray, _Saver]:
    """The working states (a copy of the initial ones, in v's dtype) and a saver that holds count 0's."""
    states = x.initial_states.astype(x.v.dtype, copy=True)
    saver = _Saver(save_after, x.lengths, states)
    saver.offer(np.arange(len(states)), np.zeros(len(states), dtype=np.int64), states)
    return states, saver
