// Causal flash attention for prefill chunks on Hopper's warpgroup MMAs (wgmma, sm_90a only), at head_dim 128
// (attention_ops.prefill_kernel picks it there; prefill_attention.cu's mma.sync kernel runs on every arch).
// Same math, tiles, splits, masks and outputs as prefill_attention.cu (its header): a block owns one kv head
// and a tile of R = 128 M rows (chunk rows x the GQA group's q heads), walks the pages of its split, and writes
// out (one split) or its f32 partials, which prefill_attention_combine_d128 merges.
//
// S = Q K^T: 8 x wgmma m64n64k16 per page (A = Q, B = K, both K-major in shared memory), f32; online softmax
// in f32 (log2 domain, prefill_common.cuh); O += P V: 4 x wgmma m64n128k16 (A = P from registers: the S
// accumulator layout repacked as in the mma.sync kernel; B = V, N-major in shared memory). bf16 KV: bf16
// inputs, P rounded to bf16. int8 KV: f16 inputs on the exact int8 values (each thread converts the raw
// chunks it copied into the f16 tiles), Q rounded bf16 -> f16, the per-key scales applied in f32 to S's
// columns (K) and to P's columns before P is rounded to f16 (V): the mma.sync kernel's int8 math.
// Layout: q bf16 [T, Hq, 128]; K, V [num_pages, 64, Hkv, 128] bf16 or int8 (+ f32 scales [num_pages, 64,
// Hkv]); block_tables, context_lens, query_start, out and the workspace as in prefill_attention.cu.
// Shared memory (dynamic, WgSmem below, 1024-aligned inside: attention_ops.prefill_sm90_smem bytes): Q and the
// K and V tiles as 64-dim halves of 128-byte rows in the 128-byte swizzle wgmma reads (16-byte chunk c of row
// r at r * 128 + ((c ^ (r % 8)) << 4)); bf16: two buffers of the K and V tiles; int8: one f16 tile each and
// two buffers of the raw pages and scales. Page kt + 1 is copied (cp.async) while page kt is multiplied.
// Launch: prefill_attention_sm90_d128_{bf16,int8}: grid as prefill_attention.cu's kernels (tiles * num_splits,
// Hkv, B); block 256 = 2 warpgroups x 64 M rows (warp w of warpgroup j: M rows 64 j + 16 w .. + 15); two
// blocks per SM (128 registers). Compiled for other archs the file holds no kernel.
#include "attention_common.cuh"
#include "prefill_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kWgThreads = 256;
constexpr int kSwizzleRow = 128;                       // bytes per swizzled row (64 bf16 dims)
constexpr int kQHalf = kFlashRows * kSwizzleRow;       // one 64-dim half of Q
constexpr int kPageHalf = kKeyTile * kSwizzleRow;      // one 64-dim half of a K or V page

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

#define WGMMA_S_REGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WGMMA_S_OPERANDS(s) "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]), "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]), "+f"(s[3][2]), "+f"(s[3][3]), "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]), "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]), "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]), "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])
#define WGMMA_O_REGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define WGMMA_O_OPERANDS(o) "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]), "+f"(o[1][2]), "+f"(o[1][3]), "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]), "+f"(o[3][0]), "+f"(o[3][1]), "+f"(o[3][2]), "+f"(o[3][3]), "+f"(o[4][0]), "+f"(o[4][1]), "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]), "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), "+f"(o[7][0]), "+f"(o[7][1]), "+f"(o[7][2]), "+f"(o[7][3]), "+f"(o[8][0]), "+f"(o[8][1]), "+f"(o[8][2]), "+f"(o[8][3]), "+f"(o[9][0]), "+f"(o[9][1]), "+f"(o[9][2]), "+f"(o[9][3]), "+f"(o[10][0]), "+f"(o[10][1]), "+f"(o[10][2]), "+f"(o[10][3]), "+f"(o[11][0]), "+f"(o[11][1]), "+f"(o[11][2]), "+f"(o[11][3]), "+f"(o[12][0]), "+f"(o[12][1]), "+f"(o[12][2]), "+f"(o[12][3]), "+f"(o[13][0]), "+f"(o[13][1]), "+f"(o[13][2]), "+f"(o[13][3]), "+f"(o[14][0]), "+f"(o[14][1]), "+f"(o[14][2]), "+f"(o[14][3]), "+f"(o[15][0]), "+f"(o[15][1]), "+f"(o[15][2]), "+f"(o[15][3])

// s (= or +=) Q[64 rows, 16 dims] K[64 keys, 16 dims]^T; 16-bit inputs: f16 (kF16, int8 KV) or bf16.
template <bool kF16>
__forceinline__ void wgmma_qk(float (&s)[8][4], unsigned long long q_desc, unsigned long long k_desc, int accumulate) {
    if constexpr (kF16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WGMMA_S_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WGMMA_S_OPERANDS(s)
                     : "l"(q_desc), "l"(k_desc), "r"(accumulate));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_S_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WGMMA_S_OPERANDS(s)
                     : "l"(q_desc), "l"(k_desc), "r"(accumulate));
    }
}

// o += P[64 rows, 16 keys] (registers) V[16 keys, 128 dims].
template <bool kF16>
__forceinline__ void wgmma_pv(float (&o)[16][4], const unsigned (&p)[4], unsigned long long v_desc) {
    if constexpr (kF16) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WGMMA_O_REGS ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                     : WGMMA_O_OPERANDS(o)
                     : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v_desc));
    } else {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WGMMA_O_REGS ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                     : WGMMA_O_OPERANDS(o)
                     : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v_desc));
    }
}

// Keys [0, valid_keys) of `page` for one kv head into shared memory at `dst` (cp.async, zero-filled past
// valid_keys): bf16 straight into a swizzled page tile; int8 as the raw page, [64][128] bytes.
template <bool kInt8>
__forceinline__ void load_page(unsigned dst, const void* cache, long long page, int kv_head, int num_kv_heads, int valid_keys) {
    constexpr int kChunks = kInt8 ? 8 : 16;  // 16-byte chunks per key row
    const unsigned char* base = static_cast<const unsigned char*>(cache);
#pragma unroll
    for (int j = 0; j < kKeyTile * kChunks / kWgThreads; ++j) {
        const int i = threadIdx.x + j * kWgThreads;
        const int key = i / kChunks, chunk = i % kChunks;
        const bool valid = key < valid_keys;
        const unsigned char* src = valid ? base + ((page * kPageSize + key) * num_kv_heads + kv_head) * (kChunks * 16) + chunk * 16 : base;
        const unsigned to = dst + (kInt8 ? i * 16 : (chunk >> 3) * kPageHalf + swizzled(key, chunk));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(valid ? 16 : 0));
    }
}

// int8: the chunks of a raw page this thread copied (load_page<true>), as exact f16 into the swizzled tile.
__forceinline__ void convert_own_chunks(unsigned tile, const unsigned char* raw) {
#pragma unroll
    for (int j = 0; j < kKeyTile * 8 / kWgThreads; ++j) {
        const int i = threadIdx.x + j * kWgThreads;
        const int key = i >> 3, chunk = 2 * (i & 7);  // 16 int8 dims -> f16 chunks `chunk`, `chunk + 1`
        uint4 lo, hi;
        int8x16_to_f16x16(*reinterpret_cast<const uint4*>(raw + i * 16), lo, hi);
        const unsigned half = tile + (chunk >> 3) * kPageHalf;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(half + swizzled(key, chunk)), "r"(lo.x), "r"(lo.y), "r"(lo.z), "r"(lo.w));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(half + swizzled(key, chunk + 1)), "r"(hi.x), "r"(hi.y), "r"(hi.z), "r"(hi.w));
    }
}

// The scales of `page`'s keys for one kv head (int8 KV) into scale_tile[64], zero-filled past valid_keys.
__forceinline__ void load_page_scales(float* scale_tile, const float* scales, long long page, int kv_head, int num_kv_heads,
                                      int valid_keys, int first_thread) {
    const int key = threadIdx.x - first_thread;
    if (key >= 0 && key < kKeyTile) {
        const bool valid = key < valid_keys;
        cp_async4(scale_tile + key, scales + (valid ? (page * kPageSize + key) * num_kv_heads + kv_head : 0), valid);
    }
}

// The kernel's shared memory (byte offsets from the 1024-aligned base; attention_ops.prefill_sm90_smem mirrors
// kBytes): Q [128][128] 16-bit; bf16 KV: two buffers of the swizzled K and V page tiles; int8 KV: one f16 K and
// V tile, two buffers of the raw K and V pages [64][128] bytes and of their f32 scales [64].
template <bool kInt8>
struct WgSmem {
    static constexpr int kTile = 2 * kPageHalf;  // a K or V page as 16-bit values
    static constexpr int kRaw = kKeyTile * 128;  // an int8 page
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + 2 * kQHalf;
    static constexpr int kV = kK + (kInt8 ? 1 : 2) * kTile;
    static constexpr int kKRaw = kV + (kInt8 ? 1 : 2) * kTile;
    static constexpr int kVRaw = kKRaw + (kInt8 ? 2 * kRaw : 0);
    static constexpr int kKScale = kVRaw + (kInt8 ? 2 * kRaw : 0);
    static constexpr int kVScale = kKScale + (kInt8 ? 2 * kKeyTile * 4 : 0);
    static constexpr int kBytes = kVScale + (kInt8 ? 2 * kKeyTile * 4 : 0);
};

// One block: see the header.
template <bool kInt8>
__forceinline__ void wgmma_prefill_attention(bf16* out, float* partial_acc, float* partial_ml, const bf16* q,
                                             const void* k_cache, const void* v_cache, const float* k_scale,
                                             const float* v_scale, const int* block_tables, int max_pages,
                                             const int* context_lens, const int* query_start, int decode_max_queries,
                                             int num_q_heads, int num_kv_heads, float scale, int num_splits) {
    using S = WgSmem<kInt8>;
    constexpr int D = 128;
    constexpr int kDimTiles = D / 8;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    unsigned dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic_bytes));
    if (dynamic_bytes < S::kBytes + 1024) __trap();  // attention_ops.prefill_sm90_smem must match
    const unsigned aligned = (smem_address(wg_smem) + 1023u) & ~1023u;  // swizzle atoms are 1024-byte aligned
    unsigned char* const smem = wg_smem + (aligned - smem_address(wg_smem));
    const unsigned q_at = aligned + S::kQ, k_at = aligned + S::kK, v_at = aligned + S::kV;
    const unsigned k_raw_at = aligned + S::kKRaw, v_raw_at = aligned + S::kVRaw;
    float* const k_scales = reinterpret_cast<float*>(smem + S::kKScale);
    float* const v_scales = reinterpret_cast<float*>(smem + S::kVScale);

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

    // Page kt into buffer (kt - kt_begin) % 2: the tiles themselves (bf16) or the raw page and its scales (int8).
    auto load = [&](int kt) {
        const int keys = min(kKeyTile, t.ctx - kt * kKeyTile);
        const int buffer = (kt - b.kt_begin) & 1;
        if constexpr (kInt8) {
            load_page<true>(k_raw_at + buffer * S::kRaw, k_cache, b.pages[kt], b.kv_head, num_kv_heads, keys);
            load_page<true>(v_raw_at + buffer * S::kRaw, v_cache, b.pages[kt], b.kv_head, num_kv_heads, keys);
            load_page_scales(k_scales + buffer * kKeyTile, k_scale, b.pages[kt], b.kv_head, num_kv_heads, keys, 0);
            load_page_scales(v_scales + buffer * kKeyTile, v_scale, b.pages[kt], b.kv_head, num_kv_heads, keys, kKeyTile);
        } else {
            load_page<false>(k_at + buffer * S::kTile, k_cache, b.pages[kt], b.kv_head, num_kv_heads, keys);
            load_page<false>(v_at + buffer * S::kTile, v_cache, b.pages[kt], b.kv_head, num_kv_heads, keys);
        }
    };

    // Q tile (padding rows and rows past the chunk zero-filled) and the first page. Thread x copies chunks
    // i = x + 256 j of Q: row i / 16, 16-byte chunk i % 16.
    auto q_chunk = [&](int i) { return S::kQ + ((i & 15) >> 3) * kQHalf + swizzled(i >> 4, i & 15); };
    for (int j = 0; j < kFlashRows * 16 / kWgThreads; ++j) {
        const int i = threadIdx.x + j * kWgThreads;
        const int r = i >> 4, qi = tile_query(t, r);
        const bf16* src = qi >= 0 ? q + tile_row_offset(t, r, qi, b.kv_head, num_q_heads, D) + (i & 15) * 8 : q;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(aligned + q_chunk(i)), "l"(src), "r"(qi >= 0 ? 16 : 0));
    }
    load(b.kt_begin);
    cp_async_commit();
    if constexpr (kInt8) {  // int8 KV multiplies in f16 (exact int8 values): this thread's Q chunks bf16 -> f16
        cp_async_wait<0>();
        for (int j = 0; j < kFlashRows * 16 / kWgThreads; ++j) {
            uint4* at = reinterpret_cast<uint4*>(smem + q_chunk(threadIdx.x + j * kWgThreads));
            const uint4 v = *at;
            *at = make_uint4(pack_f16x2(bf16_lo(v.x), bf16_hi(v.x)), pack_f16x2(bf16_lo(v.y), bf16_hi(v.y)),
                             pack_f16x2(bf16_lo(v.z), bf16_hi(v.z)), pack_f16x2(bf16_lo(v.w), bf16_hi(v.w)));
        }
    }

    float o[kDimTiles][4];
#pragma unroll
    for (int dt = 0; dt < kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};  // rows g, g + 8
    const int min_pos = t.first_pos + t.q_begin;  // the tile's first position: earlier pages need no mask
    const float scale_log2 = scale * kLog2e;
    const unsigned q_rows = q_at + warpgroup * 64 * kSwizzleRow;

    for (int kt = b.kt_begin; kt < b.kt_end; ++kt) {
        const int buffer = (kt - b.kt_begin) & 1;
        if (kt + 1 < b.kt_end) load(kt + 1);  // the next page flies during this one's math
        cp_async_commit();
        cp_async_wait<1>();  // page kt (and Q) landed
        if constexpr (kInt8) convert_own_chunks(k_at, smem + S::kKRaw + buffer * S::kRaw);
        if constexpr (kInt8) convert_own_chunks(v_at, smem + S::kVRaw + buffer * S::kRaw);
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // visible to the wgmma (async) proxy
        __syncthreads();
        const unsigned k_page = k_at + (kInt8 ? 0 : buffer * S::kTile), v_page = v_at + (kInt8 ? 0 : buffer * S::kTile);

        float s[8][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const unsigned half = ks >> 2, within = (ks & 3) * 32;
            wgmma_qk<kInt8>(s, wgmma_desc(q_rows + half * kQHalf + within, 16, 1024),
                            wgmma_desc(k_page + half * kPageHalf + within, 16, 1024), ks > 0);
        }
        wgmma_commit();
        wgmma_wait_all();
        keep_in_place(s);

        if constexpr (kInt8) scale_key_columns(s, k_scales + buffer * kKeyTile, c);
        if (kt * kKeyTile + kKeyTile - 1 > min_pos) {
            mask_causal(s, kt, min_pos + (warp_row + g) / t.group, min_pos + (warp_row + 8 + g) / t.group, c);
        }
        bool grew = false;
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) alpha[h] = softmax_rows(s, h, m[h], l[h], scale_log2, grew);
        rescale_rows(o, alpha);
        unsigned pa[kKeyTile / 16][4];
        pack_p<kInt8>(s, pa, v_scales + buffer * kKeyTile, c);
        keep_in_place(o);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) {
            wgmma_pv<kInt8>(o, pa[kk], wgmma_desc(v_page + kk * 16 * kSwizzleRow, kPageHalf, 1024));
        }
        wgmma_commit();
        wgmma_wait_all();
        keep_in_place(o);
        __syncthreads();  // both warpgroups are done with page kt's tiles and scales before they are refilled
    }

    prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,
                  num_splits);
    const PrefillOutput dst = prefill_output(b, out, partial_acc, partial_ml, num_q_heads, num_kv_heads, num_splits);
    store_rows<D>(dst, t, o, m, l, warp_row, g, c);
}

#define PREFILL_SM90_KERNEL(KIND, INT8)                                                                        \
    extern "C" __global__ void __launch_bounds__(kWgThreads, 2) prefill_attention_sm90_d128_##KIND(            \
        bf16* out, float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache,                  \
        const void* v_cache, const float* k_scale, const float* v_scale, const int* block_tables,              \
        int max_pages, const int* context_lens, const int* query_start, int decode_max_queries,                \
        int num_q_heads, int num_kv_heads, float scale, int num_splits) {                                     \
        enter_dependent_kernel();                                                                             \
        wgmma_prefill_attention<INT8>(out, partial_acc, partial_ml, q, k_cache, v_cache, k_scale, v_scale,    \
                                      block_tables, max_pages, context_lens, query_start, decode_max_queries, \
                                      num_q_heads, num_kv_heads, scale, num_splits);                          \
    }

PREFILL_SM90_KERNEL(bf16, false)
PREFILL_SM90_KERNEL(int8, true)
#endif
