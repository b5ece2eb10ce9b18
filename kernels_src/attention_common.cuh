// Helpers shared by the attention families (rope_kv, decode_attention, prefill_attention): the paged KV
// geometry, raw bf16/int8 unpacking, the output gate and warp reductions (cp.async copies are common.cuh's).
// Included as "attention_common.cuh" after "common.cuh"; part of the cubin cache key like any local header.
#pragma once
#include "common.cuh"

// Tokens per KV page (docs/ARCHITECTURE.md "KV pages"):
// K/V are [num_pages, kPageSize, n_kv_heads, head_dim].
constexpr int kPageSize = 64;

__forceinline__ float neg_inf() {
    return __int_as_float(0xff800000);
}

// Element offset of (slot, kv_head, 0) in a [num_pages, 64, n_kv_heads, head_dim] cache, where
// slot = page * 64 + offset. 64-bit: a large cache holds more than 2^31 elements.
__forceinline__ long long kv_row_offset(long long slot, int kv_head, int num_kv_heads, int head_dim) {
    return (slot * num_kv_heads + kv_head) * head_dim;
}

// The two bf16 halves of a 32-bit word as floats (the lower address is the low half).
__forceinline__ float bf16_lo(unsigned word) {
    return __uint_as_float(word << 16);
}

__forceinline__ float bf16_hi(unsigned word) {
    return __uint_as_float(word & 0xffff0000u);
}

// Byte `i` (0 = lowest address) of a 32-bit word as a signed int8 value.
__forceinline__ float int8_at(unsigned word, int i) {
    return static_cast<float>(static_cast<signed char>((word >> (8 * i)) & 0xffu));
}

// Two floats -> one bf16x2 word, `lo` at the lower address (round to nearest even).
__forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&pair);
}

// The gated attention's output gate on a value about to be stored: v * sigmoid(gate) in f32, the store's
// bf16 rounding the only one. Fast exp and division (ex2.approx, rcp.approx: a few f32 ulp, far below that
// rounding; exp overflow gives v / inf = 0): with expf's range reduction the sm_90a wgmma prefill kernel
// spilled 20 bytes instead of 8, the extra ones inside its main loop (ptxas, NVRTC 13).
__forceinline__ float gated(float v, float gate) {
    return __fdividef(v, 1.0f + __expf(-gate));
}

// Where the attention output's gates are: bf16 values at gate[row * stride + head * head_dim + dim], or none
// (gate null: plain attention, the stores unchanged). A uniform kernel argument pair.
struct OutputGate {
    const bf16* gate;
    int stride;
};

__forceinline__ float warp_sum(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

__forceinline__ float warp_max(float value) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value = fmaxf(value, __shfl_xor_sync(0xffffffffu, value, offset));
    return value;
}
