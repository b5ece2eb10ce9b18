// Causal flash attention for prefill chunks on Hopper's warpgroup MMAs (wgmma, sm_90a only): the kernel
// prefill_attention.cu's mma.sync kernel runs on every arch, for bf16 KV at head_dim 128 (attention_ops picks
// this one on sm_90a). Same math, tiles, splits, masks and outputs (prefill_attention.cu's header): a block
// owns one kv head and a tile of R = 128 M rows (chunk rows x the GQA group's q heads), walks the pages of its
// split, and writes out (one split) or its f32 partials, which prefill_attention_combine_d128 merges.
//
// S = Q K^T: 8 x wgmma m64n64k16 per page (A = Q, B = K, both K-major in shared memory), f32; online softmax
// in f32 (log2 domain, prefill_common.cuh); P rounded to bf16; O += P V: 4 x wgmma m64n128k16 (A = P from
// registers: the S accumulator layout repacked as in the mma.sync kernel; B = V, N-major in shared memory).
// Layout: q bf16 [T, Hq, 128]; K, V bf16 [num_pages, 64, Hkv, 128]; block_tables, context_lens, query_start,
// out and the workspace as in prefill_attention.cu (k_scale, v_scale unused).
// Shared memory (dynamic, 1024-aligned inside, attention_ops.PREFILL_SM90_SMEM bytes): Q [128][128] and two
// buffers of the K and V pages [64][128], each as two 64-dim halves of 128-byte rows in the 128-byte swizzle
// wgmma reads: 16-byte chunk c of row r at r * 128 + ((c ^ (r % 8)) << 4) (32 + 2 x 32 = 96 KiB). Page kt + 1
// is copied (cp.async) while page kt is multiplied.
// Launch: prefill_attention_sm90_d128_bf16: grid as prefill_attention.cu's kernels (tiles * num_splits, Hkv,
// B); block 256 = 2 warpgroups x 64 M rows (warp w of warpgroup j: M rows 64 j + 16 w .. + 15); two blocks per
// SM (128 registers). Compiled for other archs the file holds no kernel.
#include "attention_common.cuh"
#include "prefill_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kWgThreads = 256;
constexpr int kSwizzleRow = 128;                       // bytes per swizzled row (64 bf16 dims)
constexpr int kQHalf = kFlashRows * kSwizzleRow;       // one 64-dim half of Q
constexpr int kPageHalf = kKeyTile * kSwizzleRow;      // one 64-dim half of a K or V page
constexpr int kWgSmem = 2 * kQHalf + 2 * 2 * 2 * kPageHalf;  // Q, two buffers of K and V

__forceinline__ unsigned swizzled(int row, int chunk) {  // chunk: 16-byte unit within the row's 128 bytes
    return row * kSwizzleRow + (((chunk & 7) ^ (row & 7)) << 4);
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand starting at `address` (PTX ISA, "matrix
// descriptor"): `stride` = bytes between groups of 8 rows (1024 here); `leading` = bytes between the 64-dim
// halves of an N-major operand (V), unused for K-major ones (Q, K). A k step within a half advances the start
// address by 32 bytes; the hardware applies the swizzle to the final address, hence the 1024-byte alignment.
__forceinline__ unsigned long long wgmma_desc(unsigned address, unsigned leading, unsigned stride) {
    return (unsigned long long)((address & 0x3FFFFu) >> 4) | ((unsigned long long)(leading >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

__forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Pins the accumulators in program order around the wgmma fences: the compiler sees no access to `acc` in the
// fence and wait asm statements, and would otherwise move reads and writes of them across.
template <int N>
__forceinline__ void keep_in_place(float (&acc)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[i][e])::"memory");
}

// s (= or +=) Q[64 rows, 16 dims] K[64 keys, 16 dims]^T.
__forceinline__ void wgmma_qk(float (&s)[8][4], unsigned long long q_desc, unsigned long long k_desc, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]), "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]), "+f"(s[3][2]), "+f"(s[3][3]), "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]), "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]), "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]), "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])
                 : "l"(q_desc), "l"(k_desc), "r"(accumulate));
}

// o += P[64 rows, 16 keys] (registers) V[16 keys, 128 dims].
__forceinline__ void wgmma_pv(float (&o)[16][4], const unsigned (&p)[4], unsigned long long v_desc) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                 : "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]), "+f"(o[1][2]), "+f"(o[1][3]), "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]), "+f"(o[3][0]), "+f"(o[3][1]), "+f"(o[3][2]), "+f"(o[3][3]), "+f"(o[4][0]), "+f"(o[4][1]), "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]), "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), "+f"(o[7][0]), "+f"(o[7][1]), "+f"(o[7][2]), "+f"(o[7][3]), "+f"(o[8][0]), "+f"(o[8][1]), "+f"(o[8][2]), "+f"(o[8][3]), "+f"(o[9][0]), "+f"(o[9][1]), "+f"(o[9][2]), "+f"(o[9][3]), "+f"(o[10][0]), "+f"(o[10][1]), "+f"(o[10][2]), "+f"(o[10][3]), "+f"(o[11][0]), "+f"(o[11][1]), "+f"(o[11][2]), "+f"(o[11][3]), "+f"(o[12][0]), "+f"(o[12][1]), "+f"(o[12][2]), "+f"(o[12][3]), "+f"(o[13][0]), "+f"(o[13][1]), "+f"(o[13][2]), "+f"(o[13][3]), "+f"(o[14][0]), "+f"(o[14][1]), "+f"(o[14][2]), "+f"(o[14][3]), "+f"(o[15][0]), "+f"(o[15][1]), "+f"(o[15][2]), "+f"(o[15][3])
                 : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v_desc));
}

// Keys [0, valid_keys) of `page` for one kv head (bf16, D = 128) into a swizzled page tile; the rest zeroed.
__forceinline__ void load_page_swizzled(unsigned tile, const void* cache, long long page, int kv_head, int num_kv_heads,
                                        int valid_keys) {
    const unsigned char* base = static_cast<const unsigned char*>(cache);
#pragma unroll
    for (int j = 0; j < kKeyTile * 16 / kWgThreads; ++j) {
        const int i = threadIdx.x + j * kWgThreads;
        const int key = i >> 4, chunk = i & 15;
        const bool valid = key < valid_keys;
        const unsigned char* src = valid ? base + ((page * kPageSize + key) * num_kv_heads + kv_head) * 256 + chunk * 16 : base;
        const unsigned to = tile + (chunk >> 3) * kPageHalf + swizzled(key, chunk);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(valid ? 16 : 0));
    }
}

// One block: see the header.
__forceinline__ void wgmma_prefill_attention(bf16* out, float* partial_acc, float* partial_ml, const bf16* q,
                                             const void* k_cache, const void* v_cache, const int* block_tables,
                                             int max_pages, const int* context_lens, const int* query_start,
                                             int decode_max_queries, int num_q_heads, int num_kv_heads, float scale,
                                             int num_splits) {
    constexpr int D = 128;
    constexpr int kDimTiles = D / 8;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    unsigned dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic_bytes));
    if (dynamic_bytes < kWgSmem + 1024) __trap();  // attention_ops.PREFILL_SM90_SMEM must match
    const unsigned smem_base = (smem_address(wg_smem) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    const unsigned q_at = smem_base, k_at = q_at + 2 * kQHalf, v_at = k_at + 2 * 2 * kPageHalf;

    PrefillBlock b;
    if (!prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads,
                       num_kv_heads, num_splits)) {
        return;
    }
    const PrefillTile& t = b.t;

    const int warpgroup = threadIdx.x >> 7;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int warp_row = 64 * warpgroup + 16 * ((threadIdx.x >> 5) & 3);

    // Q tile (padding rows and rows past the chunk zero-filled) and the first page.
    for (int j = 0; j < kFlashRows * 16 / kWgThreads; ++j) {
        const int i = threadIdx.x + j * kWgThreads;
        const int r = i >> 4, chunk = i & 15;
        const int qi = tile_query(t, r);
        const bf16* src = qi >= 0 ? q + tile_row_offset(t, r, qi, b.kv_head, num_q_heads, D) + chunk * 8 : q;
        const unsigned to = q_at + (chunk >> 3) * kQHalf + swizzled(r, chunk);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(qi >= 0 ? 16 : 0));
    }
    {
        const int keys = min(kKeyTile, t.ctx - b.kt_begin * kKeyTile);
        load_page_swizzled(k_at, k_cache, b.pages[b.kt_begin], b.kv_head, num_kv_heads, keys);
        load_page_swizzled(v_at, v_cache, b.pages[b.kt_begin], b.kv_head, num_kv_heads, keys);
    }
    cp_async_commit();

    float o[kDimTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // rows g, g + 8
    const int min_pos = t.first_pos + t.q_begin;  // the tile's first position: earlier pages need no mask
    const float scale_log2 = scale * kLog2e;
    const unsigned q_rows = q_at + warpgroup * 64 * kSwizzleRow;

    for (int kt = b.kt_begin; kt < b.kt_end; ++kt) {
        const int buffer = (kt - b.kt_begin) & 1;
        if (kt + 1 < b.kt_end) {  // the next page flies during this one's math
            const int next_keys = min(kKeyTile, t.ctx - (kt + 1) * kKeyTile);
            load_page_swizzled(k_at + (buffer ^ 1) * 2 * kPageHalf, k_cache, b.pages[kt + 1], b.kv_head, num_kv_heads, next_keys);
            load_page_swizzled(v_at + (buffer ^ 1) * 2 * kPageHalf, v_cache, b.pages[kt + 1], b.kv_head, num_kv_heads, next_keys);
        }
        cp_async_commit();
        cp_async_wait<1>();  // page kt (and Q) landed
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the wgmma (async) proxy
        __syncthreads();
        const unsigned k_page = k_at + buffer * 2 * kPageHalf, v_page = v_at + buffer * 2 * kPageHalf;

        float s[8][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const unsigned half = ks >> 2, within = (ks & 3) * 32;
            wgmma_qk(s, wgmma_desc(q_rows + half * kQHalf + within, 16, 1024),
                     wgmma_desc(k_page + half * kPageHalf + within, 16, 1024), ks > 0);
        }
        wgmma_commit();
        wgmma_wait_all();
        keep_in_place(s);

        if (kt * kKeyTile + kKeyTile - 1 > min_pos) {
            mask_causal(s, kt, min_pos + (warp_row + g) / t.group, min_pos + (warp_row + 8 + g) / t.group, c);
        }
        bool grew = false;
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) alpha[h] = softmax_rows(s, h, m[h], l[h], scale_log2, grew);
#pragma unroll
        for (int dt = 0; dt < kDimTiles; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }
        // P as the A fragments of P V: S tiles 2kk, 2kk + 1 hold P[:, 16kk : 16kk + 16] in that layout.
        unsigned pa[kKeyTile / 16][4];
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) {
            pa[kk][0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
        keep_in_place(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) wgmma_pv(o, pa[kk], wgmma_desc(v_page + kk * 16 * kSwizzleRow, kPageHalf, 1024));
        wgmma_commit();
        wgmma_wait_all();
        keep_in_place(o);
        __syncthreads();  // both warpgroups are done with page kt's buffer before it is refilled
    }

    prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,
                  num_splits);
    const PrefillOutput dst = prefill_output(b, out, partial_acc, partial_ml, num_q_heads, num_kv_heads, num_splits);
    store_rows<D>(dst, t, o, m, l, warp_row, g, c);
}

extern "C" __global__ void __launch_bounds__(kWgThreads, 2) prefill_attention_sm90_d128_bf16(
    bf16* out, float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache, const void* v_cache,
    const float* k_scale, const float* v_scale, const int* block_tables, int max_pages, const int* context_lens,
    const int* query_start, int decode_max_queries, int num_q_heads, int num_kv_heads, float scale, int num_splits) {
    enter_dependent_kernel();
    wgmma_prefill_attention(out, partial_acc, partial_ml, q, k_cache, v_cache, block_tables, max_pages, context_lens,
                            query_start, decode_max_queries, num_q_heads, num_kv_heads, scale, num_splits);
}
#endif
