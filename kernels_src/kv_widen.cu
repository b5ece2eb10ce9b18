// int8 KV pages widened to f16 pages holding the same exact int8 values, for a prefill step's attention on
// sm_90a (attention_ops.prefill_attention, prefill_attention_sm90.cu's widened kernel): the int8 prefill
// kernels convert every page in every block that reads it (a 128-row tile's worth of keys per conversion);
// widened once per layer and step, a page is then read like a bf16 one, and the scales stay f32 beside it.
//
// For every prefill sequence s of the step (more than decode_max_queries new rows, as prefill_attention.cu
// decides) and each page i < ceil(context_lens[s] / 64) of it: widened page w = first(s) + i, where first(s)
// sums the pages of the prefill sequences before s; K16[w] = K[block_tables[s][i]] as f16 (exact: |q| <= 127),
// V16 likewise, both scale rows copied, widened_tables[s][i] = w. Other entries of widened_tables are left
// as they are (the prefill kernels never read past a sequence's pages, nor a decode sequence's row).
// Layout: K, V [num_pages, 64, Hkv, D] int8, k_scale, v_scale f32 [num_pages, 64, Hkv]; K16, V16
// [capacity, 64, Hkv, D] f16, k_scale16, v_scale16 f32 [capacity, 64, Hkv]; block_tables and widened_tables
// int32 [B, max_pages]. Hkv * D % 16 == 0. Traps when first(s) + pages(s) > capacity (the host sizes the
// launch so it cannot).
// Launch: widen_int8_kv: grid (any count, e.g. the pages of the longest prefill context; B), block
// kWidenThreads; block x of sequence s widens its pages x, x + gridDim.x, ... (every kv head): 16-byte loads
// of int8, two 16-byte stores of f16 each.
#include "attention_common.cuh"
#include "prefill_common.cuh"

constexpr int kWidenThreads = 256;

// Pages of sequence s when it is a prefill one (else 0).
__forceinline__ int prefill_pages(int s, const int* context_lens, const int* query_start, int decode_max_queries) {
    const bool prefill = query_start[s + 1] - query_start[s] > decode_max_queries;
    return prefill ? (context_lens[s] + kPageSize - 1) / kPageSize : 0;
}

// first(s): the prefill pages of sequences 0 .. s - 1, summed by the whole block.
__forceinline__ int first_widened_page(int s, const int* context_lens, const int* query_start, int decode_max_queries) {
    __shared__ int warp_pages[kWidenThreads / 32];
    int pages = 0;
    for (int j = threadIdx.x; j < s; j += kWidenThreads) pages += prefill_pages(j, context_lens, query_start, decode_max_queries);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) pages += __shfl_xor_sync(0xffffffffu, pages, offset);
    if ((threadIdx.x & 31) == 0) warp_pages[threadIdx.x >> 5] = pages;
    __syncthreads();
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWidenThreads / 32; ++w) total += warp_pages[w];
    return total;
}

// Page `from` of the int8 cache into widened page `to` (every kv head): values as exact f16, scales copied.
__forceinline__ void widen_page(void* k16, void* v16, float* k_scale16, float* v_scale16, long long to,
                                const void* k_cache, const void* v_cache, const float* k_scale, const float* v_scale,
                                long long from, int num_kv_heads, int head_dim) {
    const int page_values = kPageSize * num_kv_heads * head_dim;  // per K or V page
    const int chunks = page_values / 16;
#pragma unroll 2
    for (int j = threadIdx.x; j < 2 * chunks; j += kWidenThreads) {
        const bool is_v = j >= chunks;
        const int chunk = is_v ? j - chunks : j;
        const uint4* src = reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(is_v ? v_cache : k_cache) + from * page_values) + chunk;
        uint4* dst = reinterpret_cast<uint4*>(static_cast<unsigned short*>(is_v ? v16 : k16) + to * page_values) + 2 * chunk;
        uint4 lo, hi;
        int8x16_to_f16x16(__ldg(src), lo, hi);
        dst[0] = lo;
        dst[1] = hi;
    }
    const int page_scales = kPageSize * num_kv_heads;
    for (int j = threadIdx.x; j < 2 * page_scales; j += kWidenThreads) {
        const bool is_v = j >= page_scales;
        const int at = is_v ? j - page_scales : j;
        (is_v ? v_scale16 : k_scale16)[to * page_scales + at] = (is_v ? v_scale : k_scale)[from * page_scales + at];
    }
}

extern "C" __global__ void __launch_bounds__(kWidenThreads) widen_int8_kv(
    void* k16, void* v16, float* k_scale16, float* v_scale16, int* widened_tables, int capacity, const void* k_cache,
    const void* v_cache, const float* k_scale, const float* v_scale, const int* block_tables, int max_pages,
    const int* context_lens, const int* query_start, int decode_max_queries, int num_kv_heads, int head_dim) {
    enter_dependent_kernel();
    const int s = blockIdx.y;
    const int pages = prefill_pages(s, context_lens, query_start, decode_max_queries);
    if (blockIdx.x >= pages) return;
    const int first = first_widened_page(s, context_lens, query_start, decode_max_queries);
    if (first + pages > capacity) __trap();
    for (int i = blockIdx.x; i < pages; i += gridDim.x) {
        if (threadIdx.x == 0) widened_tables[(long long)s * max_pages + i] = first + i;
        widen_page(k16, v16, k_scale16, v_scale16, first + i, k_cache, v_cache, k_scale, v_scale,
                   block_tables[(long long)s * max_pages + i], num_kv_heads, head_dim);
    }
}
