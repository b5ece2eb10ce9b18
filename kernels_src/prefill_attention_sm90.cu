// Causal flash attention for prefill chunks over bf16 KV, or over widened int8 KV (kv_widen.cu: f16 pages of
// the dequantized values), on Hopper's warpgroup MMAs (wgmma, sm_90a only), at head_dim D = 128 and 256
// (attention_ops.prefill_kernel picks it there; int8 KV not worth widening runs prefill_attention_sm90_int8.cu at
// D = 128 and prefill_attention.cu's mma.sync kernel at 256, as other archs do). Same math, splits, masks and
// outputs as prefill_attention.cu (its header): a block owns one kv head and a tile of R = 128 M rows (chunk
// rows x the GQA group's q heads; at D = 256 too, where the mma.sync kernel takes 64), walks the pages of its
// split, and writes out (one split) or its f32 partials, which prefill_attention_combine_d128 /
// prefill_attention_combine_d256_r128 merge.
//
// S = Q K^T: D / 16 x wgmma m64n64k16 per page (A = Q, B = K, both K-major in shared memory), f32; online
// softmax in f32 (log2 domain, prefill_common.cuh); O += P V: 4 x wgmma m64n128k16 per 128 dims of V (A = P from
// registers: the S accumulator layout repacked as in the mma.sync kernel, rounded to bf16; B = V, N-major in
// shared memory). Widened int8 KV: the same in f16 (Q rounded bf16 -> f16 in shared memory once, P rounded to f16).
// Layout: q bf16 [T, Hq, D]; K, V [num_pages, 64, Hkv, D] bf16 (f16 widened); block_tables, context_lens,
// query_start, out, the workspace and the output gate as in prefill_attention.cu.
// Shared memory (dynamic, WgSmem<D> below, 1024-aligned inside: attention_ops.prefill_sm90_smem bytes): Q and two
// buffers of the K and V page tiles as 64-dim halves of 128-byte rows in the 128-byte swizzle wgmma reads
// (16-byte chunk c of row r at r * 128 + ((c ^ (r % 8)) << 4)): 96 KiB at D = 128, 192 KiB at 256. Page kt + 1
// is copied (cp.async) while page kt is multiplied.
// Launch: prefill_attention_sm90_d{128,256}_{bf16,widened}: grid as prefill_attention.cu's kernels (tiles *
// num_splits, Hkv, B); block 256 = 2 warpgroups x 64 M rows (warp w of warpgroup j: M rows 64 j + 16 w .. + 15).
// D = 128: two blocks per SM (128 registers). D = 256: one block per SM (its shared memory), a thread's O
// accumulators 128 registers of its 255. Compiled for other archs the file holds no kernel.
#include "attention_common.cuh"
#include "prefill_common.cuh"
#include "wgmma_sm90.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kBlockThreads = 256;

// The kernel's shared memory (byte offsets from the 1024-aligned base; attention_ops.prefill_sm90_smem mirrors
// kBytes): Q [128][D] 16-bit; two buffers of the swizzled K and V page tiles [64][D] 16-bit; D / 64 halves each.
template <int D>
struct WgSmem {
    static constexpr int kHalves = D / 64;
    static constexpr int kTile = kHalves * kPageHalf;  // a K or V page
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kHalves * kQHalf;
    static constexpr int kV = kK + 2 * kTile;
    static constexpr int kBytes = kV + 2 * kTile;
};

// O += P V over the page in `v_tile` for one warpgroup: per 128 dims of V (n = 128, the 64-dim halves 2p and
// 2p + 1 at kPageHalf apart), the page's 4 k16 steps.
template <bool kF16, int D>
__forceinline__ void accumulate_pv(float (&o)[D / 8][4], const unsigned (&pa)[kKeyTile / 16][4], unsigned v_tile) {
    const unsigned long long v_desc = wgmma_desc(v_tile, kPageHalf, 1024);
#pragma unroll
    for (int part = 0; part < D / 128; ++part) {
        float(&o_part)[16][4] = *reinterpret_cast<float(*)[16][4]>(&o[16 * part]);
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) {
            wgmma_pv<kF16>(o_part, pa[kk], v_desc + ((2 * part * kPageHalf + kk * 16 * kSwizzleRow) >> 4));
        }
    }
}

// One block: see the header.
template <int D, bool kF16>
__forceinline__ void prefill_attention_sm90_block(bf16* out, float* partial_acc, float* partial_ml, const bf16* q,
                                                  const void* k_cache, const void* v_cache, const int* block_tables,
                                                  int max_pages, const int* context_lens, const int* query_start,
                                                  int decode_max_queries, int num_q_heads, int num_kv_heads, float scale,
                                                  int num_splits, OutputGate gate) {
    using S = WgSmem<D>;
    constexpr int kDimTiles = D / 8;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const unsigned aligned = swizzle_aligned_base(wg_smem, S::kBytes);
    unsigned char* const smem = wg_smem + (aligned - smem_address(wg_smem));
    const unsigned q_at = aligned + S::kQ, k_at = aligned + S::kK, v_at = aligned + S::kV;

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

    auto load = [&](int kt) {  // page kt into buffer (kt - kt_begin) % 2
        const int keys = min(kKeyTile, t.ctx - kt * kKeyTile);
        const int buffer = (kt - b.kt_begin) & 1;
        copy_page<false, kBlockThreads, D>(k_at + buffer * S::kTile, k_cache, b.pages[kt], b.kv_head, num_kv_heads, keys, threadIdx.x);
        copy_page<false, kBlockThreads, D>(v_at + buffer * S::kTile, v_cache, b.pages[kt], b.kv_head, num_kv_heads, keys, threadIdx.x);
    };

    // The Q tile, then the first page.
    copy_q_rows<kBlockThreads, D>(q_at, t, q, b.kv_head, num_q_heads, 0, threadIdx.x);
    cp_async_commit();
    load(b.kt_begin);
    cp_async_commit();
    if (kF16) {  // the first page stays in flight; the loop's first barrier publishes Q as f16
        cp_async_wait<1>();
        q_rows_to_f16<kBlockThreads, D>(smem + S::kQ, q_at, 0, threadIdx.x);
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
        cp_async_wait<0>();  // page kt (and Q) landed
        fence_proxy_async();  // visible to the wgmma (async) proxy
        // One barrier a page: every thread's copies of page kt are in, and both warpgroups are done with page
        // kt - 1, whose buffer page kt + 1 takes (it flies during this page's math).
        __syncthreads();
        if (kt + 1 < b.kt_end) load(kt + 1);
        cp_async_commit();
        // K's and V's tiles: one descriptor each, the k steps' offsets added to its address field (addresses
        // stay below 2^18, so the field never carries); Q's are rebuilt per step (a 64-bit descriptor held
        // through the loop spills).
        const unsigned long long k_desc = wgmma_desc(k_at + buffer * S::kTile, 16, 1024);
        float s[8][4];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const unsigned half = ks >> 2, within = (ks & 3) * 32;
            wgmma_qk<kF16>(s, wgmma_desc(q_rows + half * kQHalf + within, 16, 1024), k_desc + ((half * kPageHalf + within) >> 4), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_place(s);

        if (kt * kKeyTile + kKeyTile - 1 > min_pos) {
            mask_causal(s, kt, min_pos + (warp_row + g) / t.group, min_pos + (warp_row + 8 + g) / t.group, c);
        }
        bool grew = false;
        float alpha[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) alpha[h] = softmax_rows(s, h, m[h], l[h], scale_log2, grew);
        if (__any_sync(0xffffffffu, grew)) rescale_rows(o, alpha);  // else every alpha is exactly 1
        unsigned pa[kKeyTile / 16][4];
        pack_p<kF16, false>(s, pa, nullptr, c);
        keep_in_place(o);
        wgmma_fence();
        accumulate_pv<kF16, D>(o, pa, v_at + buffer * S::kTile);
        wgmma_commit();
        wgmma_wait<0>();
        keep_in_place(o);
    }

    prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,
                  num_splits);
    const PrefillOutput dst = prefill_output(b, out, partial_acc, partial_ml, gate, num_q_heads, num_kv_heads, num_splits);
    store_rows<D>(dst, t, o, m, l, warp_row, g, c);
}

// k_scale and v_scale are unused (bf16 and widened KV): the signature is every prefill attention kernel's.
// Blocks per SM: two at D = 128 (128 registers), one at 256 (192 KiB of shared memory).
#define PREFILL_SM90_KERNEL(D, KIND, F16)                                                                       \
    extern "C" __global__ void __launch_bounds__(kBlockThreads, D == 128 ? 2 : 1) prefill_attention_sm90_d##D##_##KIND( \
        bf16* out, float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache, const void* v_cache,   \
        const float* k_scale, const float* v_scale, const int* block_tables, int max_pages, const int* context_lens, \
        const int* query_start, int decode_max_queries, int num_q_heads, int num_kv_heads, float scale,             \
        int num_splits, const bf16* gate, int gate_stride) {                                                         \
        enter_dependent_kernel();                                                                                    \
        prefill_attention_sm90_block<D, F16>(out, partial_acc, partial_ml, q, k_cache, v_cache, block_tables, max_pages, \
                                             context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads, \
                                             scale, num_splits, OutputGate{gate, gate_stride});                       \
    }
PREFILL_SM90_KERNEL(128, bf16, false)
PREFILL_SM90_KERNEL(128, widened, true)
PREFILL_SM90_KERNEL(256, bf16, false)
PREFILL_SM90_KERNEL(256, widened, true)
#endif
