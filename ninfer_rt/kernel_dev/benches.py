"""Each kernel family's benchmark, by family name (`ninfer-rt kernels bench FAMILY`); the cases are in the
bench_*.py modules. A family of kernels_src/ without an entry here has no benchmark yet."""

from __future__ import annotations

from functools import partial

from ninfer_rt.cuda.attention_plan import KVVariant
from ninfer_rt.kernel_dev.bench_attention import bench_decode_attention, bench_kv_widen, bench_prefill_attention, bench_rope_kv
from ninfer_rt.kernel_dev.bench_gdn import bench_gdn_chunked_split, bench_gdn_conv, bench_gdn_delta_rule
from ninfer_rt.kernel_dev.bench_rows import (
    bench_activation, bench_embedding, bench_gemm_quant, bench_gemv, bench_gemv_quant, bench_quant_layout, bench_rmsnorm,
    bench_sampling,
)
from ninfer_rt.kernel_dev.cases import BenchFunction

BENCHES: dict[str, BenchFunction] = {
    "rmsnorm": bench_rmsnorm,
    "activation": bench_activation,
    "embedding": bench_embedding,
    "sampling": bench_sampling,
    "gemv": bench_gemv,
    "gemv_quant": bench_gemv_quant,
    "gemm_quant": bench_gemm_quant,
    "gemm_quant_sm90": partial(bench_gemm_quant, wgmma=True),
    "quant_layout": bench_quant_layout,
    "rope_kv": bench_rope_kv,
    "decode_attention": bench_decode_attention,
    "prefill_attention": bench_prefill_attention,
    # time the sm_90a kernels and the mma.sync one in the same run
    "prefill_attention_sm90": bench_prefill_attention,  # bf16, and int8 widened
    "prefill_attention_sm90_int8": partial(bench_prefill_attention, kv_kinds=(KVVariant.INT8,)),
    "kv_widen": bench_kv_widen,
    "gdn_conv": bench_gdn_conv,
    "gdn_delta_rule": bench_gdn_delta_rule,
    "gdn_chunked_split": bench_gdn_chunked_split,
}
