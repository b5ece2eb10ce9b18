"""prefill_attention.cu's tiling, split and merge math emulated in float64 numpy, on the CPU.

The emulation follows the kernel's index math (tiles of 128 M rows, 64 at head_dim 256, of chunk rows x GQA
heads, pages per split,
empty splits, the mask only on pages past the tile's first position) and its online softmax in the log2
domain, then merges the splits as prefill_attention_combine does; the result must equal the unsplit
reference for every split count. It checks the math the kernel implements, not the kernel (the GPU tests
do that).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from attention_refs import PAGE, make_batch, make_pages, paged_attention_ref
from ninfer_rt.cuda import attention_plan, attention_prefill_plan

LOG2E = 1.4426950408889634


def tile_geometry(chunk: int, ctx: int, group: int, tile: int, num_splits: int, tile_rows: int) -> dict[str, int] | None:
    """prefill_tile() of the kernel."""
    tile_queries = tile_rows // group
    q_begin = tile * tile_queries
    if q_begin >= chunk:
        return None
    first_pos = ctx - chunk
    key_end = first_pos + min(q_begin + tile_queries, chunk)
    pages = math.ceil(ctx / PAGE)
    return dict(
        tile_queries=tile_queries, q_begin=q_begin, first_pos=first_pos,
        num_key_tiles=math.ceil(key_end / PAGE), pages_per_split=math.ceil(pages / num_splits),
    )


def split_partials(q_rows, keys, values, t, split, scale):
    """One split block's (acc, m, l) for its tile's M rows (q_rows [rows, D], zero for padding), or None if empty."""
    begin = split * t["pages_per_split"]
    end = min(begin + t["pages_per_split"], t["num_key_tiles"])
    if begin >= end:
        return None
    group_rows = q_rows.shape[0]
    pos = t["first_pos"] + t["q_begin"] + np.arange(group_rows) // t["group"]
    min_pos = t["first_pos"] + t["q_begin"]
    m = np.full(group_rows, -np.inf)
    l = np.zeros(group_rows)
    acc = np.zeros((group_rows, q_rows.shape[1]))
    ctx = keys.shape[0]
    for kt in range(begin, end):
        idx = np.arange(kt * PAGE, (kt + 1) * PAGE)
        k = np.where((idx < ctx)[:, None], keys[np.minimum(idx, ctx - 1)], 0.0)  # zero-filled past the context
        v = np.where((idx < ctx)[:, None], values[np.minimum(idx, ctx - 1)], 0.0)
        s = (q_rows @ k.T) * (scale * LOG2E)
        if kt * PAGE + PAGE - 1 > min_pos:
            s = np.where(idx[None, :] <= pos[:, None], s, -np.inf)
        else:
            assert (idx <= min_pos).all() and (idx < ctx).all()  # unmasked pages: every key visible to every row
        m_new = np.maximum(m, s.max(axis=1))
        m_use = np.where(m_new == -np.inf, 0.0, m_new)
        alpha = np.exp2(m - m_use)
        p = np.exp2(s - m_use[:, None])
        l = l * alpha + p.sum(axis=1)
        acc = acc * alpha[:, None] + p @ v
        m = m_new
    return acc, m, l


def emulate(q, k_pages, v_pages, batch, scale, num_splits, tile_rows):
    hq, d = q.shape[1], q.shape[2]
    hkv = k_pages.shape[2]
    group = hq // hkv
    out = np.full(q.shape, np.nan)
    max_queries = attention_plan.decode_max_queries(hq, hkv)
    for seq, ctx in enumerate(batch.context_lens):
        start, stop = int(batch.query_start[seq]), int(batch.query_start[seq + 1])
        chunk = stop - start
        if chunk <= max_queries:
            continue
        pages = batch.block_tables[seq, : math.ceil(ctx / PAGE)]
        for kv_head in range(hkv):
            keys = k_pages[pages][:, :, kv_head].reshape(-1, d)[:ctx]
            values = v_pages[pages][:, :, kv_head].reshape(-1, d)[:ctx]
            for tile in range(math.ceil(chunk / (tile_rows // group))):
                t = tile_geometry(chunk, int(ctx), group, tile, num_splits, tile_rows)
                assert t is not None
                t["group"] = group
                rows = []  # (M row, q row, head) of the valid rows
                q_rows = np.zeros((tile_rows, d))
                for r in range(tile_rows):
                    qi = r // group
                    if qi < t["tile_queries"] and t["q_begin"] + qi < chunk:
                        row, head = start + t["q_begin"] + qi, kv_head * group + r % group
                        q_rows[r] = q[row, head]
                        rows.append((r, row, head))
                parts = [split_partials(q_rows, keys, values, t, s, scale) for s in range(num_splits)]
                used = math.ceil(t["num_key_tiles"] / t["pages_per_split"])
                assert all(p is not None for p in parts[:used]) and all(p is None for p in parts[used:])
                ms = np.stack([p[1] for p in parts[:used]])
                big = ms.max(axis=0)
                assert np.isfinite(big[[r for r, _, _ in rows]]).all()  # split 0 holds key 0
                w = np.exp2(ms - np.where(big == -np.inf, 0.0, big))
                total = (w * np.stack([p[2] for p in parts[:used]])).sum(axis=0)
                merged = (w[:, :, None] * np.stack([p[0] for p in parts[:used]])).sum(axis=0) / total[:, None]
                for r, row, head in rows:
                    out[row, head] = merged[r]
    return out


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 32])
@pytest.mark.parametrize(
    ("hq", "hkv", "tile_rows"),
    [(4, 4, 128), (8, 2, 128), (10, 2, 128), (16, 2, 128), (12, 2, attention_prefill_plan.mma_sync_tile_rows(256))],
    ids=["gqa1", "gqa4", "gqa5", "gqa8", "gqa6-64-rows"],
)
def test_split_and_merge_equal_unsplit_attention(hq: int, hkv: int, tile_rows: int, num_splits: int) -> None:
    # the kernels' tiles: 128 rows (the mma.sync kernel below head_dim 256, the sm_90a ones at every head dim), 64
    # (the mma.sync kernel at 256: GQA 6 fills 60 of them); the dims themselves are 32 here, the index math does
    # not depend on them
    rng = np.random.default_rng(hq * 100 + num_splits)
    batch = make_batch(rng, [70, 3, 130, 20], [70, 500, 1100, 700])
    slots = batch.all_slots()
    k, v = (make_pages(rng, batch.num_pages, hkv, 32, "bf16", slots) for _ in range(2))
    q = rng.standard_normal((batch.num_rows, hq, 32))
    scale = 32**-0.5
    expected = paged_attention_ref(q, k.values, v.values, batch.block_tables, batch.context_lens, batch.query_start, scale)
    actual = emulate(q, k.values, v.values, batch, scale, num_splits, tile_rows)
    prefill = np.concatenate([np.arange(batch.query_start[i], batch.query_start[i + 1]) for i in (0, 2, 3)])
    np.testing.assert_allclose(actual[prefill], expected[prefill], rtol=1e-10, atol=1e-12)
    assert np.isnan(actual[70:73]).all()  # the decode sequence's rows are not the prefill kernel's
