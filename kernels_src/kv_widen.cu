// int8 KV pages widened to f16 pages of their dequantized values, for a prefill step's attention on sm_90a
// (attention_ops.prefill_attention; prefill_attention_sm90.cu's f16 kernel then reads them as it reads bf16
// pages): the int8 kernels apply each key's K and V scales in every tile that reads the page, which costs the
// multiplying warps more than the page's conversion (H200: bench/logs/h200-2026-11-30-int8-kv-widening-b41b0ef.txt); widened, a page
// is dequantized once per layer and step.
//
// For every prefill sequence s of the step (more than decode_max_queries new rows, as prefill_attention.cu
// decides) and each page i < ceil(context_lens[s] / 64) of it: widened page w = first(s) + i, where first(s)
// sums the pages of the prefill sequences before s; K16[w][key][h][d] = f16(K[p][key][h][d] * k_scale[p][key][h])
// with p = block_tables[s][i] (the product in f32, rounded once; beyond f16's range it saturates to +-65504),
// V16 likewise, widened_tables[s][i] = w. Other entries of widened_tables are left as they are (the prefill
// kernels never read past a sequence's pages, nor a decode sequence's row).
// Layout: K, V [num_pages, 64, Hkv, D] int8, k_scale, v_scale f32 [num_pages, 64, Hkv]; K16, V16
// [capacity, 64, Hkv, D] f16; block_tables and widened_tables int32 [B, max_pages]. D % 8 == 0. Traps when
// first(s) + pages(s) > capacity (the host sizes the launch so it cannot).
// Launch: widen_int8_kv: grid (any count, e.g. the pages of the longest prefill context; B), block
// kWidenThreads; block x of sequence s widens its pages x, x + gridDim.x, ... (every kv head).
#include "attention_common.cuh"

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
    for (int j = threadIdx.x; j < s; j += kWidenThreads) {
        pages += prefill_pages(j, context_lens, query_start, decode_max_queries);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) pages += __shfl_xor_sync(0xffffffffu, pages, offset);
    if ((threadIdx.x & 31) == 0) warp_pages[threadIdx.x >> 5] = pages;
    __syncthreads();
    int total = 0;
#pragma unroll
    for (int w = 0; w < kWidenThreads / 32; ++w) total += warp_pages[w];
    return total;
}

// Two f32 values as a saturated f16 pair, `lo` at the lower address.
__forceinline__ unsigned f16x2_saturated(float lo, float hi) {
    unsigned pair;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(pair) : "f"(hi), "f"(lo));
    return pair;
}

// 4 int8 values (a word) times `scale`, as two f16 pairs.
__forceinline__ void dequantize4(unsigned word, float scale, unsigned& lo, unsigned& hi) {
    lo = f16x2_saturated(int8_at(word, 0) * scale, int8_at(word, 1) * scale);
    hi = f16x2_saturated(int8_at(word, 2) * scale, int8_at(word, 3) * scale);
}

// Page `from` of one int8 cache (K or V) into widened page `to` (every kv head): a thread takes 8 values at a
// time (an 8-byte load, a 16-byte store: each warp instruction moves whole contiguous lines) and keeps
// kInFlight loads in flight.
__forceinline__ void widen_page(unsigned short* widened, long long to, const unsigned char* cache, const float* scales,
                                long long from, int num_kv_heads, int head_dim) {
    constexpr int kInFlight = 8;
    const int rows = kPageSize * num_kv_heads, row_runs = head_dim / 8;  // (key, kv head) rows of 8-value runs
    const int runs = rows * row_runs;
    const uint2* src = reinterpret_cast<const uint2*>(cache + from * rows * head_dim);
    uint4* dst = reinterpret_cast<uint4*>(widened + to * rows * head_dim);
    for (int j0 = threadIdx.x; j0 < runs; j0 += kInFlight * kWidenThreads) {
        uint2 raw[kInFlight];
        float scale[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
            const int j = j0 + u * kWidenThreads;
            if (j < runs) {
                raw[u] = __ldg(src + j);
                scale[u] = __ldg(scales + from * rows + j / row_runs);
            }
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
            const int j = j0 + u * kWidenThreads;
            if (j < runs) {
                uint4 out;
                dequantize4(raw[u].x, scale[u], out.x, out.y);
                dequantize4(raw[u].y, scale[u], out.z, out.w);
                dst[j] = out;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(kWidenThreads) widen_int8_kv(
    void* k16, void* v16, int* widened_tables, int capacity, const void* k_cache, const void* v_cache,
    const float* k_scale, const float* v_scale, const int* block_tables, int max_pages, const int* context_lens,
    const int* query_start, int decode_max_queries, int num_kv_heads, int head_dim) {
    enter_dependent_kernel();
    const int s = blockIdx.y;
    const int pages = prefill_pages(s, context_lens, query_start, decode_max_queries);
    if (blockIdx.x >= pages) return;
    const int first = first_widened_page(s, context_lens, query_start, decode_max_queries);
    if (first + pages > capacity) __trap();
    for (int i = blockIdx.x; i < pages; i += gridDim.x) {
        const long long from = block_tables[(long long)s * max_pages + i];
        if (threadIdx.x == 0) widened_tables[(long long)s * max_pages + i] = first + i;
        widen_page(static_cast<unsigned short*>(k16), first + i, static_cast<const unsigned char*>(k_cache), k_scale, from,
                   num_kv_heads, head_dim);
        widen_page(static_cast<unsigned short*>(v16), first + i, static_cast<const unsigned char*>(v_cache), v_scale, from,
                   num_kv_heads, head_dim);
    }
}
