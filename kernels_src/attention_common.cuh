// Helpers shared by the attention families (rope_kv, decode_attention, prefill_attention): the paged KV
// geometry, cp.async copies into shared memory, raw bf16/int8 unpacking and warp reductions.
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

// 16-byte global -> shared copy that bypasses the registers. With `valid` false nothing is read and the
// 16 destination bytes are zero-filled (src-size 0), so keys past the context never bring garbage (NaN
// bit patterns) into shared memory; `src` must still be a mapped address, callers pass the base pointer.
__forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_size));
}

// 4-byte variant (used for the per-key int8 scales), zero-filled when `valid` is false.
__forceinline__ void cp_async4(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_size = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_size));
}

__forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");  // no shared read hoisted above
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
