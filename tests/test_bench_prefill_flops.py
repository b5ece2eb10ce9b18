"""tools/bench_prefill.py's FLOP count, the numerator of its fraction of the GEMM rate, against the layer
geometry written out by hand: the dense qwen3-8b (q, k, v, o and the MLP in all 36 layers) and the
qwen3.6-27b hybrid (48 Gated DeltaNet layers: in_proj_qkv 10240, in_proj_z 6144, in_proj_a/b 48 rows each,
out_proj; 16 gated-attention layers: q_proj with its gate 12288 rows, k/v 1024, o_proj; the MLP in all 64;
attention only in the 16; the chunked delta rule only in the 48)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import bench_prefill as prefill  # noqa: E402 -- lives in tools/
from bench_decode import shape_config  # noqa: E402
from bench_hybrid_model import hybrid_config  # noqa: E402

H8, H27, VOCAB_27B = 4096, 5120, 248320


def test_the_dense_count_is_every_projection_of_every_layer_and_one_lm_head_row() -> None:
    cfg = shape_config("qwen3-8b")
    per_layer = H8 * (32 + 2 * 8) * 128 + 32 * 128 * H8 + 3 * H8 * 12288
    assert prefill.matmul_flops(cfg, 8192) == 2.0 * 8192 * 36 * per_layer + 2.0 * H8 * cfg.vocab_size
    assert prefill.attention_flops(cfg, 0, 8192) == 4.0 * 32 * 128 * (8192 * 8193 / 2) * 36
    assert prefill.delta_rule_flops(cfg, 8192) == 0.0


def test_the_27b_hybrid_counts_each_layer_kind_where_it_is() -> None:
    cfg = hybrid_config("qwen3.6-27b")
    linear = (10240 + 6144 + 48 + 48) * H27 + H27 * 6144
    attention = (12288 + 1024 + 1024) * H27 + H27 * 24 * 256
    mlp = 3 * H27 * 17408
    layers = 48 * linear + 16 * attention + 64 * mlp
    assert prefill.matmul_flops(cfg, 531) == 2.0 * 531 * layers + 2.0 * H27 * VOCAB_27B
    assert abs(layers - 24.35e9) < 0.01e9
    assert prefill.attention_flops(cfg, 114281, 531) == 4.0 * 24 * 256 * (531 * 114281 + 531 * 532 / 2) * 16


def test_the_delta_rule_counts_each_chunk_of_64_and_the_remainder() -> None:
    cfg = hybrid_config("qwen3.6-27b")

    def chunk(n: int) -> float:  # k k^T, w, q k^T over dk; u, P v_new over dv; v_new, update, q S
        return 3 * 2.0 * n * n * 128 + 2 * 2.0 * n * n * 128 + 3 * 2.0 * n * 128 * 128

    assert prefill.delta_rule_flops(cfg, 531) == (8 * chunk(64) + chunk(19)) * 48 * 48
    assert prefill.delta_rule_flops(cfg, 8192) == 128 * chunk(64) * 48 * 48
    assert prefill.delta_rule_flops(cfg, 8192) / prefill.matmul_flops(cfg, 8192) < 0.01  # a small share of the work


def test_the_gemm_roofline_is_the_shapes_own_gate_up_product_at_8192_rows() -> None:
    assert prefill.gemm_shape(shape_config("qwen3-8b")) == prefill.GemmShape(8192, 24576, 4096)
    assert prefill.gemm_shape(hybrid_config("qwen3.6-27b")) == prefill.GemmShape(8192, 34816, 5120)
