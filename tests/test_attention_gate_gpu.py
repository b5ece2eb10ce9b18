"""The gated attention's output gate fused into the attention kernels' stores, on the GPU: out * sigmoid(gate)
with the gates read from fused qkv rows (after q, k and v), against the float64 reference times the numpy
executor's gate (exec/numpy_gated_attention.py gate_output). Decode: the combine applies it, with one split
and with many, bf16 and int8 KV; prefill: the kernel that stores the output (one split) or the combine (several),
on the portable mma.sync kernel and on sm_90a's wgmma kernels (bf16, widened int8, int8), at head_dim 128
and at the 27B's gated-attention heads (24 q heads over 4 kv heads of 256)."""

from __future__ import annotations

import numpy as np
import pytest

from attention_refs import make_batch
from test_attention_kernels_gpu import Gpu, assert_close, gpu, require_shared_memory, run_decode, run_prefill, sm90_only  # noqa: F401

pytestmark = pytest.mark.gpu

HEADS_27B = (24, 4, 256)  # the 27B's gated-attention layers: GQA 6, head_dim 256


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 64])
@pytest.mark.parametrize(("hq", "hkv", "d"), [HEADS_27B, (16, 4, 128)], ids=["27b", "d128"])
def test_decode_gates_its_output_with_any_split_count(gpu: Gpu, kv_dtype: str, num_splits: int, hq: int, hkv: int, d: int) -> None:
    # a decode row, a 4-row verify (MTP k = 3) and a one-token context: 64 splits leave most of them empty
    batch = make_batch(np.random.default_rng(num_splits + d), [1, 4, 1], [1000, 130, 1])
    out, expected = run_decode(gpu, batch, hq, hkv, d, kv_dtype, num_splits=num_splits, gated=True)
    assert_close(out, expected, f"gated decode {kv_dtype} d={d} with {num_splits} splits")


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_decode_gates_a_long_context_with_the_planned_splits(gpu: Gpu, kv_dtype: str) -> None:
    batch = make_batch(np.random.default_rng(5), [1], [40_000])
    out, expected = run_decode(gpu, batch, *HEADS_27B, kv_dtype, gated=True)
    assert_close(out, expected, f"gated decode {kv_dtype} 40000 tokens")


@pytest.mark.parametrize("wgmma", [None, False], ids=["default", "portable"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize(("chunk", "context"), [(65, 1000), (257, 2113)])
def test_prefill_gates_its_output_at_the_27b_heads(
    gpu: Gpu, kv_dtype: str, num_splits: int, chunk: int, context: int, wgmma: bool | None
) -> None:
    # default on sm_90a: the wgmma kernel (bf16; int8 widened at 257 rows, the mma.sync int8 kernel at 65)
    require_shared_memory(gpu, 256, kv_dtype)
    batch = make_batch(np.random.default_rng(chunk + context + num_splits), [chunk, 2], [context, 50])
    out, expected, slack = run_prefill(gpu, batch, *HEADS_27B, kv_dtype, num_splits=num_splits, wgmma=wgmma, gated=True)
    rows = np.arange(chunk)  # the 2-row sequence is decode_attention's: left poisoned
    assert_close(out[rows], expected[rows], f"gated prefill d=256 {kv_dtype} {num_splits} split(s)", slack=slack[rows])
    assert (out[chunk:].view(np.uint16) == 0xFFFF).all(), "prefill_attention wrote a decode sequence's rows"


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("wgmma", [None, False], ids=["default", "portable"])
def test_prefill_gates_its_output_at_head_dim_128(gpu: Gpu, kv_dtype: str, num_splits: int, wgmma: bool | None) -> None:
    # default on sm_90a: the wgmma kernels (int8 KV widened from its row count on); portable: mma.sync
    batch = make_batch(np.random.default_rng(num_splits + 128), [300], [1300])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, kv_dtype, num_splits=num_splits, wgmma=wgmma, gated=True)
    assert_close(out, expected, f"gated prefill d=128 {kv_dtype} {num_splits} split(s) wgmma={wgmma}", slack=slack)


@pytest.mark.parametrize("widen", [True, False], ids=["widened", "int8"])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_prefill_gates_the_output_of_both_sm90_int8_paths(gpu: Gpu, widen: bool, num_splits: int) -> None:
    sm90_only(gpu)
    batch = make_batch(np.random.default_rng(num_splits + widen), [300], [1300])
    out, expected, slack = run_prefill(gpu, batch, 16, 4, 128, "int8", num_splits=num_splits, widen=widen, gated=True)
    assert_close(out, expected, f"gated prefill int8 widen={widen} {num_splits} split(s)", slack=slack)
