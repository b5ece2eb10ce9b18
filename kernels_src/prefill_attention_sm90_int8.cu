// Causal flash attention for prefill chunks over int8 KV on Hopper's warpgroup MMAs (wgmma, sm_90a only), at
// head_dim 128 (attention_ops.prefill_kernel picks it there; bf16 KV runs prefill_attention_sm90.cu, other
// archs prefill_attention.cu's mma.sync kernel). Same math, tiles, splits, masks and outputs as
// prefill_attention.cu (its header): a block owns one kv head and a tile of R = 128 M rows (chunk rows x the
// GQA group's q heads), walks the pages of its split, and writes out (one split) or its f32 partials, which
// prefill_attention_combine_d128 merges. The int8 math is the mma.sync kernel's: f16 MMAs on the exact int8
// values, Q rounded bf16 -> f16, the per-key scales applied in f32 to S's columns (K) and to P's columns before
// P is rounded to f16 (V).
//
// Warp-specialized (FlashAttention-3's layout): warpgroup 0 copies each page raw (cp.async) into one of
// kLookahead raw slots, converts it to f16 swizzled K and V tiles in one of kStages slots and publishes the slot
// (mbarrier full[slot]); warpgroups 1 and 2 (64 M rows each, 224 registers through setmaxnreg) multiply:
// S = Q K^T as 8 x wgmma m64n64k16 per page (A = Q's f16 fragments, held in registers; B = K, K-major in
// shared memory), online softmax in f32 (prefill_common.cuh), O += P V as 4 x wgmma m64n128k16 (A = P from
// registers, B = V, N-major), then free the slot (mbarrier empty[slot]). S of page i is issued with P V of
// page i - 1 and its softmax runs during that P V; the two warpgroups take turns issuing (named barriers), so
// one's softmax overlaps the other's MMAs. Why int8 only: its conversion is what the copying warpgroup takes
// off the multiplying ones; for bf16 the two-blocks-per-SM kernel without a copying warpgroup measured faster
// (bench/logs/h200-2026-11-30-prefill-attention-warp-specialized-34d33ed.txt).
// Layout: q bf16 [T, Hq, 128]; K, V [num_pages, 64, Hkv, 128] int8, f32 scales [num_pages, 64, Hkv];
// block_tables, context_lens, query_start, out, the workspace and the output gate as in prefill_attention.cu.
// Shared memory (dynamic, WsSmem below, 1024-aligned inside: attention_ops.prefill_sm90_smem bytes).
// Launch: prefill_attention_sm90_d128_int8: grid as prefill_attention.cu's kernels (tiles * num_splits, Hkv,
// B); block 384, one block per SM. Compiled for other archs the file holds no kernel.
#include "attention_common.cuh"
#include "prefill_common.cuh"
#include "wgmma_sm90.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kBlockThreads = 384;  // warpgroup 0 copies pages, warpgroups 1 and 2 multiply (64 M rows each)
constexpr int kGroupThreads = 128;  // a warpgroup
// Page slots between the copying and the multiplying warpgroups, and raw pages whose copies a copying thread
// keeps in flight (as many raw slots).
constexpr int kStages = 4;
constexpr int kLookahead = 3;
// Registers per thread (setmaxnreg): the launch gives all 384 threads 168 (one block per SM); the copying
// warpgroup hands most of its share to the multiplying ones (128 x 56 + 256 x 224 = 384 x 168).
constexpr int kCopyRegs = 56;
constexpr int kMathRegs = 224;

// int8: the chunks of a raw page thread `tid` copied (copy_page<true>), as exact f16 into the swizzled tile.
__forceinline__ void convert_own_chunks(unsigned tile, const unsigned char* raw, int tid) {
#pragma unroll
    for (int j = 0; j < kKeyTile * 8 / kGroupThreads; ++j) {
        const int i = tid + j * kGroupThreads;
        const int key = i >> 3, chunk = 2 * (i & 7);  // 16 int8 dims -> f16 chunks `chunk`, `chunk + 1`
        uint4 lo, hi;
        int8x16_to_f16x16(*reinterpret_cast<const uint4*>(raw + i * 16), lo, hi);
        const unsigned half = tile + (chunk >> 3) * kPageHalf;
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(half + swizzled(key, chunk)), "r"(lo.x), "r"(lo.y), "r"(lo.z), "r"(lo.w));
        asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(half + swizzled(key, chunk + 1)), "r"(hi.x), "r"(hi.y), "r"(hi.z), "r"(hi.w));
    }
}

// The kernel's shared memory (byte offsets from the 1024-aligned base; attention_ops.prefill_sm90_smem mirrors
// kBytes): Q [128][128] f16, swizzled; kStages page slots, each a K then a V tile [64][128] f16 (swizzled),
// and their f32 scales [2][64]; kLookahead slots of raw pages in flight (K, V [64][128] bytes, their scales
// [2][64]); the mbarriers: full[kStages] (a slot's page landed), empty[kStages] (both multiplying warpgroups
// are done with it); a scratch word per multiplying thread.
struct WsSmem {
    static constexpr int kTile = 2 * kPageHalf;
    static constexpr int kSlot = 2 * kTile;
    static constexpr int kRawPage = kKeyTile * 128;
    static constexpr int kPageScales = 2 * kKeyTile * 4;
    static constexpr int kRawSlot = 2 * kRawPage + kPageScales;
    static constexpr int kQ = 0;
    static constexpr int kSlots = kQ + 2 * kQHalf;
    static constexpr int kScales = kSlots + kStages * kSlot;
    static constexpr int kRaw = kScales + kStages * kPageScales;
    static constexpr int kBarriers = kRaw + kLookahead * kRawSlot;
    static constexpr int kScratch = kBarriers + 2 * kStages * 8;  // a word per multiplying thread
    static constexpr int kBytes = kScratch + 2 * kGroupThreads * 4;
    static constexpr int full(int stage) { return kBarriers + 8 * stage; }
    static constexpr int empty(int stage) { return kBarriers + 8 * (kStages + stage); }
};

// The copying warpgroup (thread `tid` of 128): pages kt_begin .. kt_end - 1 into slots i % kStages. Each thread
// keeps the copies of kLookahead raw pages in flight. Iteration i first publishes page i - kLookahead (its
// copies landed; the thread converts its chunks into the slot's f16 tiles once the slot is empty) to the async
// proxy and arrives on its full barrier, then starts page i's copies into raw slot i % kLookahead, which page
// i - kLookahead has just left.
__forceinline__ void copy_pages(const PrefillBlock& b, unsigned base, unsigned char* smem, const void* k_cache,
                                const void* v_cache, const float* k_scale, const float* v_scale, int num_kv_heads, int tid) {
    using S = WsSmem;
    const int pages = b.kt_end - b.kt_begin;
    for (int i = 0; i < pages + kLookahead; ++i) {
        if (i >= kLookahead) {
            const int ready = i - kLookahead, stage = ready % kStages;
            cp_async_wait<kLookahead - 1>();
            mbarrier_wait(base + S::empty(stage), ((ready / kStages) & 1) ^ 1);
            const unsigned char* raw = smem + S::kRaw + (ready % kLookahead) * S::kRawSlot;
            const unsigned tile = base + S::kSlots + stage * S::kSlot;
            convert_own_chunks(tile, raw, tid);
            convert_own_chunks(tile + S::kTile, raw + S::kRawPage, tid);
            reinterpret_cast<float*>(smem + S::kScales + stage * S::kPageScales)[tid] =
                reinterpret_cast<const float*>(raw + 2 * S::kRawPage)[tid];
            fence_proxy_async();  // the slot, visible to the wgmma (async) proxy
            mbarrier_arrive(base + S::full(stage));
        }
        if (i < pages) {
            const int kt = b.kt_begin + i;
            const int keys = min(kKeyTile, b.t.ctx - kt * kKeyTile);
            const long long page = b.pages[kt];
            const int slot = i % kLookahead;
            const unsigned raw = base + S::kRaw + slot * S::kRawSlot;
            copy_page<true, kGroupThreads>(raw, k_cache, page, b.kv_head, num_kv_heads, keys, tid);
            copy_page<true, kGroupThreads>(raw + S::kRawPage, v_cache, page, b.kv_head, num_kv_heads, keys, tid);
            const int key = tid % kKeyTile;  // threads 0-63: K scales, 64-127: V scales
            const float* scales = tid < kKeyTile ? k_scale : v_scale;
            float* dst = reinterpret_cast<float*>(smem + S::kRaw + slot * S::kRawSlot + 2 * S::kRawPage) + tid;
            cp_async4(dst, scales + (key < keys ? (page * kPageSize + key) * num_kv_heads + b.kv_head : 0), key < keys);
        }
        cp_async_commit();  // every iteration, so the wait above always leaves kLookahead - 1 groups in flight
    }
}

// A multiplying warpgroup (mg = 0, 1: M rows 64 mg .. 64 mg + 63): its Q rows, then the pages as the copying
// warpgroup publishes them. S of page i is multiplied while P V of page i - 1 still runs, and the softmax of
// page i overlaps that P V; the slot of page i - 1 is freed once its P V has completed.
__forceinline__ void multiply_pages(const PrefillBlock& b, unsigned base, unsigned char* smem, const bf16* q,
                                    int num_q_heads, float scale, int mg, float (&o)[16][4], float (&m)[2], float (&l)[2]) {
    using S = WsSmem;
    constexpr int D = 128;
    const PrefillTile& t = b.t;
    const int mt = threadIdx.x % kGroupThreads;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int warp_row = 64 * mg + 16 * (mt >> 5);

    // This warpgroup's 64 Q rows, as f16 (the MMAs run in f16).
    copy_q_rows<kGroupThreads>(base + S::kQ, t, q, b.kv_head, num_q_heads, 64 * mg, mt);
    cp_async_commit();
    cp_async_wait<0>();
    q_rows_to_f16<kGroupThreads>(smem + S::kQ, base + S::kQ, 64 * mg, mt);
    asm volatile("bar.sync %0, 128;\n" ::"r"(1 + mg) : "memory");  // the warpgroup's Q rows are all in place
    // Q as the A fragments of S's MMAs, held in registers for the whole walk (K alone is read from shared
    // memory per page): k step ks of the warp's 16 rows, lane l addressing row l % 16, dims 16 ks + 8 (l / 16).
    unsigned qa[D / 16][4];
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        const int dim = 16 * ks + 8 * (lane >> 4);
        ldmatrix_x4_at(qa[ks], base + S::kQ + (dim >> 6) * kQHalf + swizzled(warp_row + (lane & 15), (dim & 63) >> 3));
    }

#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    m[0] = m[1] = neg_inf();
    l[0] = l[1] = 0.0f;
    const int min_pos = t.first_pos + t.q_begin;  // the tile's first position: earlier pages need no mask
    const float scale_log2 = scale * kLog2e;
    const int pages = b.kt_end - b.kt_begin;
    float s[8][4];
    unsigned p[kKeyTile / 16][4];
    float alpha[2];
    bool rescale = false;  // some row of the warp has alpha < 1: O needs the rescale (alpha = 1 exactly otherwise)

    auto slot = [&](int i) { return base + S::kSlots + (i % kStages) * S::kSlot; };
    auto page_scales = [&](int i) { return reinterpret_cast<const float*>(smem + S::kScales + (i % kStages) * S::kPageScales); };
    // One descriptor per tile, the k steps' offsets added to its address field (addresses stay below 2^18, so
    // the field never carries): ptxas rebuilt every descriptor from scratch, ~70 uniform instructions a page.
    auto issue_qk = [&](int i) {
        const unsigned long long k_desc = wgmma_desc(slot(i), 16, 1024);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const unsigned half = ks >> 2, within = (ks & 3) * 32;
            wgmma_qk(s, qa[ks], k_desc + ((half * kPageHalf + within) >> 4), ks > 0);
        }
        wgmma_commit();
    };
    auto issue_pv = [&](int i) {
        const unsigned long long v_desc = wgmma_desc(slot(i) + S::kTile, kPageHalf, 1024);
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) wgmma_pv<true>(o, p[kk], v_desc + ((kk * 16 * kSwizzleRow) >> 4));
        wgmma_commit();
    };
    // S of page i -> P (unpacked, in s); m, l, alpha. `masked`: the page holds keys past some row's position.
    auto softmax_page = [&](int i, bool masked) {
        const int kt = b.kt_begin + i;
        scale_key_columns(s, page_scales(i), c);
        if (masked) mask_causal(s, kt, min_pos + (warp_row + g) / t.group, min_pos + (warp_row + 8 + g) / t.group, c);
        bool grew = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) alpha[h] = softmax_rows(s, h, m[h], l[h], scale_log2, grew);
        rescale = __any_sync(0xffffffffu, grew);
    };
    auto wait_page = [&](int i) { mbarrier_wait(base + S::full(i % kStages), (i / kStages) & 1); };
    // A shared-memory store of the row sums (every exp2 of the page feeds them) before the P V wait: ptxas
    // keeps memory operations in order around the wait, and would otherwise hoist the wait above the exp2s.
    const unsigned scratch = base + S::kScratch + 4 * (threadIdx.x - kGroupThreads);
    auto pin_softmax = [&](const float (&sums)[2]) {
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(scratch), "f"(sums[0] + sums[1]) : "memory");
    };
    // The two multiplying warpgroups take turns issuing their MMAs (named barrier 3 + mg is mg's turn): one's
    // softmax runs while the other's MMAs hold the tensor cores (FA3's ping-pong). Warpgroup 0 goes first.
    auto take_turn = [&] { asm volatile("bar.sync %0, 256;\n" ::"r"(3 + mg) : "memory"); };
    auto pass_turn = [&] { asm volatile("bar.arrive %0, 256;\n" ::"r"(4 - mg) : "memory"); };
    if (mg == 1) pass_turn();
    // Page i >= 1: S of page i issued, O rescaled by page i - 1's alphas meanwhile, P V of page i - 1 issued;
    // the softmax of page i runs during that P V. Nothing touches O between the P V's issue and its wait
    // (ptxas would hoist the wait over the softmax to start such work early).
    auto step = [&](int i, bool masked) {
        wait_page(i);
        take_turn();
        keep_in_place(s);
        keep_in_place(p);
        keep_in_place(o);
        wgmma_fence();
        issue_qk(i);
        if (rescale) rescale_rows(o, alpha);
        keep_in_place(o);
        wgmma_fence();
        issue_pv(i - 1);
        pass_turn();
        wgmma_wait<1>();  // S of page i
        keep_in_place(s);
        softmax_page(i, masked);
        pin_softmax(l);
        wgmma_wait<0>();  // P V of page i - 1
        keep_in_place(o);
        keep_in_place(p);  // P stays live (its registers untouched) until the wgmma reading it is done
        mbarrier_arrive(base + S::empty((i - 1) % kStages));
        pack_p<true>(s, p, page_scales(i) + kKeyTile, c);
    };

    // Pages from first_masked on hold keys past the tile's first position: two loops, so neither body branches
    // on the mask (with the branch, ptxas put the P V wait at the top of the block after it).
    const int first_masked = min(pages, max(0, (min_pos + 1) / kKeyTile - b.kt_begin));
    wait_page(0);
    take_turn();
    wgmma_fence();
    issue_qk(0);
    pass_turn();
    wgmma_wait<0>();
    keep_in_place(s);
    softmax_page(0, first_masked == 0);
    pack_p<true>(s, p, page_scales(0) + kKeyTile, c);
    for (int i = 1; i < first_masked; ++i) step(i, false);
    for (int i = max(1, first_masked); i < pages; ++i) step(i, true);
    if (rescale) rescale_rows(o, alpha);
    take_turn();
    keep_in_place(p);
    keep_in_place(o);
    wgmma_fence();
    issue_pv(pages - 1);
    pass_turn();
    wgmma_wait<0>();
    keep_in_place(o);
    keep_in_place(p);
    if (mg == 0) take_turn();  // warpgroup 1's last pass: every arrival on the barriers is consumed
}

// One block: see the header.
__forceinline__ void prefill_attention_sm90_int8_block(bf16* out, float* partial_acc, float* partial_ml, const bf16* q,
                                             const void* k_cache, const void* v_cache, const float* k_scale,
                                             const float* v_scale, const int* block_tables, int max_pages,
                                             const int* context_lens, const int* query_start, int decode_max_queries,
                                             int num_q_heads, int num_kv_heads, float scale, int num_splits,
                                             OutputGate gate) {
    using S = WsSmem;
    extern __shared__ __align__(1024) unsigned char wg_smem[];
    const unsigned base = swizzle_aligned_base(wg_smem, S::kBytes);
    unsigned char* const smem = wg_smem + (base - smem_address(wg_smem));

    PrefillBlock b;
    if (!prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads,
                       num_kv_heads, num_splits)) {
        return;
    }
    if (threadIdx.x == 0) {
        for (int stage = 0; stage < kStages; ++stage) {
            mbarrier_init(base + S::full(stage), kGroupThreads);
            mbarrier_init(base + S::empty(stage), 2 * kGroupThreads);
        }
    }
    __syncthreads();
    if (threadIdx.x < kGroupThreads) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kCopyRegs));
        copy_pages(b, base, smem, k_cache, v_cache, k_scale, v_scale, num_kv_heads, threadIdx.x);
        return;
    }
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kMathRegs));
    const int mg = threadIdx.x / kGroupThreads - 1;
    float o[16][4], m[2], l[2];
    multiply_pages(b, base, smem, q, num_q_heads, scale, mg, o, m, l);
    const PrefillOutput dst = prefill_output(b, out, partial_acc, partial_ml, gate, num_q_heads, num_kv_heads, num_splits);
    store_rows<128>(dst, b.t, o, m, l, 64 * mg + 16 * ((threadIdx.x >> 5) & 3), (threadIdx.x & 31) >> 2, threadIdx.x & 3);
}

extern "C" __global__ void __launch_bounds__(kBlockThreads, 1) prefill_attention_sm90_d128_int8(
    bf16* out, float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache, const void* v_cache,
    const float* k_scale, const float* v_scale, const int* block_tables, int max_pages, const int* context_lens,
    const int* query_start, int decode_max_queries, int num_q_heads, int num_kv_heads, float scale, int num_splits,
    const bf16* gate, int gate_stride) {
    enter_dependent_kernel();
    prefill_attention_sm90_int8_block(out, partial_acc, partial_ml, q, k_cache, v_cache, k_scale, v_scale, block_tables,
                                max_pages, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,
                                scale, num_splits, OutputGate{gate, gate_stride});
}
#endif
