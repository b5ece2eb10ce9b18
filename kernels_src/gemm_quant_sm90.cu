// Prefill GEMM over groupwise-quantized weights on Hopper's warpgroup MMAs (wgmma, sm_90a only), dequantizing in
// registers from the decode GEMV's weight layout: no bf16 copy of the weights (gemm_quant_ops picks it on sm_90a
// from 65 tokens; gemm_quant.cu's mma.sync kernel elsewhere and for fewer tokens).
//
// Math: y[m, n] = sum_k x[m, k] * bf16(q[n, k] * scale[n, k / G]) for M tokens: each weight becomes the bf16 value
// dequantize_int<BITS>[_f16s]_bf16 (gemv_quant.cu) writes for cuBLASLt (q * scale rounded to bf16 once; formed
// exactly in f32 first for fp16 scales), the products are summed in f32 by wgmma (bf16 in, f32 accumulate) and
// each output is rounded once on store: the dequantize + cuBLASLt path's values without the bf16 copy. (gemm_quant.cu
// keeps q * x exact and applies the scale in f32 per column; that needs a second accumulator per output, which
// wgmma's 128 accumulator registers per thread leave no room for.) Every format gemm_quant.cu takes: groups of
// 32 inputs and more (SEGS = KC / G scale segments a column when G < KC, each run's A fragments scaled by its
// segment's), bf16 or fp16 (F16S) scales. Epilogues as gemm_quant.cu's (kStore, kResidual,
// kStoreF32; rows of y and residual ldy >= N elements apart). x, qweight and scales 16-byte aligned (host-checked).
//
// Layout: gemv_quant.cu's octets as gemm_quant.cu reads them (its header): rows in octets of 8; a column of KC
// inputs (int4 128, int8 64) of an octet is 32 16-byte chunks, lane 4g + t holding row g's runs j of inputs
// 32j + 8t + i. A warp's octet pair (2P, 2P + 1) is its 16 rows (g and g + 8) of a wgmma A tile, and a run's 4 q
// pairs per row are the A fragments of two k16 steps: k slot 2t + e of step s is input 8t + 4s + e of the run,
// slot 2t + 8 + e input 8t + 4s + 2 + e. wgmma reads B (x) from shared memory in k-slot order, so x is staged in
// that order: word w (inputs 2w, 2w + 1) of the run's 16-byte chunk a (inputs 8a .. 8a + 7) is word a of chunk w
// of the run's k-ordered 64 bytes, a 4 x 4 transpose of 4-byte words that the copies do themselves (4-byte
// cp.async: a warp reads 128 contiguous bytes of a token row and writes one swizzled 128-byte row, 32 banks).
//
// Launch: gemm_int<BITS>[_g<G>][_f16s]_sm90 (gemm_quant.cu's variants): a one-dimensional grid of ceil(octets / 32) row
// tiles x ceil(M / 128) token tiles, rastered as gemm_quant.cu's; block 256 = 2 warpgroups, one block per SM:
// warpgroup mg (0, 1) multiplies 128 weight rows, two m64 tiles (warp w holds octet pairs 8 mg + w and
// 8 mg + 4 + w), by the block's 128 tokens: wgmma m64n128k16, A (the weights) from registers, B (x) K-major from
// shared memory in the 128-byte swizzle; 128 accumulator registers a thread.
// Shared memory (dynamic, 1024-aligned inside; gemm_quant_ops.sm90_smem_bytes mirrors kStages *
// Stage<BITS>::kBytes and adds the 1 KiB of slack; the kernel traps on less): kStages stages of [x: KC / 64 halves
// of 128 tokens x 128 bytes | weights: 32 octets x 32 chunks | scales: 32 octets x SEGS segments x 8 rows], each
// rounded up to 1 KiB: int4 4 x 49 KiB, int8 4 x 33 KiB.
// Pipeline (every thread copies; cp.async, the x words straight to their k-slot places): column c + kLookahead is
// copied into the stage column c - 2 used while column c is multiplied; the first columns' weights and scales
// are copied before the wait for the previous kernel (immutable), their x after it. A column starts with the
// thread's wait for its copies, a fence.proxy.async (x is read by wgmma, the async proxy) and a block barrier,
// after which every warpgroup has issued all of column c - 1 and waited for all of column c - 2. Per run, a warpgroup dequantizes the
// A fragments of both m64 tiles into one of two register buffers and issues their 4 wgmmas, then waits for the
// previous run's (wgmma.wait_group 1) before the next dequantization overwrites that buffer.
#include "quant_common.cuh"
#include "hopper_sm90.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kGroupThreads = 128;                  // a warpgroup
constexpr int kBlockThreads = 256;                  // two warpgroups, multiplying and copying
constexpr int kTokens = 128;                        // tokens per block: the wgmma's n
constexpr int kTileOctets = 32;                     // 256 weight rows per block: 128 per warpgroup
constexpr int kRasterTiles = 8;                     // row tiles per raster group
constexpr int kStages = 4;
constexpr int kLookahead = kStages - 2;             // columns copied while one is multiplied and the one before finishes
constexpr int kXHalf = kTokens * kSwizzleRow;       // 64 inputs of the block's tokens: 16 KiB

// One pipeline stage, byte offsets; kBytes rounded up to 1 KiB so every stage's x starts on a swizzle atom.
template <int BITS, int SEGS>
struct Stage {
    static constexpr int kX = 0;
    static constexpr int kWeights = kX + kColumnK<BITS> / 64 * kXHalf;
    static constexpr int kScales = kWeights + kTileOctets * 32 * 16;  // chunk (octet, segment): rows 0..7's scales
    static constexpr int kBytes = (kScales + kTileOctets * SEGS * 16 + 1023) / 1024 * 1024;
};

// This thread's copies of every column, fixed for the block (as gemm_quant.cu's CopyPlan): the sources at column
// 0 and the strides between the thread's copies. Weight chunk tid + 256 u: octet tid / 32 + 8u, lane tid % 32;
// the scale chunk (octet tid / SEGS, segment tid % SEGS) (threads below 32 SEGS); x: 16-byte chunk q = tid % (KC / 8) (run q / 4, chunk a = q % 4:
// inputs 8q .. 8q + 7) of tokens tid / (KC / 8) + kTokenStep i, its 4 words w each to its k-slot place, word a of
// the run's k-ordered chunk w (see the header; the 4 copies share a source address). The thread's tokens all have
// the same row bits below 8, so the swizzle of its places is fixed. Octets and tokens past the weight and M are
// zero-filled (scale 0: the padding rows' A fragments are 0).
template <int BITS, int SEGS>
struct CopyPlan {
    static constexpr int kChunks = kColumnK<BITS> / 8;  // 16-byte chunks of a token's column
    static constexpr int kTokenStep = kBlockThreads / kChunks;
    static constexpr int kOctetStep = kBlockThreads / 32;
    const uint4* weights;    // chunk (octet0 + tid / 32, column 0, lane tid % 32)
    long long octet_stride;  // kOctetStep octets of chunks
    int octets_left;         // octets from the thread's first to the weight's end
    const uint4* scales;     // chunk (octet0 + tid / SEGS, group tid % SEGS)
    bool scale_valid;
    const bf16* x;           // x[token0 + tid / kChunks][8 * (tid % kChunks)]
    int token_stride;        // kTokenStep tokens of x, elements
    int tokens_left;         // tokens from the thread's first to M
    int x_place;             // where word w of its first copy lands in a stage's x: x_place + x_word[w]
    int x_word[4];
    const void* anywhere;    // a mapped address for the zero-filling copies

    __device__ CopyPlan(const unsigned char* qweight, const bf16* scale_rows, const bf16* x_rows, const GemmTile& tile, int m,
                        int k, int octets, int columns, int groups) {
        const int tid = threadIdx.x;
        weights = reinterpret_cast<const uint4*>(qweight) + (tile.octet0 + tid / 32) * columns * 32 + tid % 32;
        octet_stride = (long long)kOctetStep * columns * 32;
        octets_left = (int)(octets - tile.octet0 - tid / 32);
        scales = reinterpret_cast<const uint4*>(scale_rows) + (tile.octet0 + tid / SEGS) * groups + tid % SEGS;
        scale_valid = tid < kTileOctets * SEGS && tile.octet0 + tid / SEGS < octets;
        const int chunk = tid % kChunks, first = tid / kChunks, run = chunk >> 2;
        x = x_rows + (long long)(tile.token0 + first) * k + 8 * chunk;
        token_stride = kTokenStep * k;
        tokens_left = m - tile.token0 - first;
        x_place = (run >> 1) * kXHalf + first * kSwizzleRow + 4 * (chunk & 3);
#pragma unroll
        for (int w = 0; w < 4; ++w) x_word[w] = ((4 * (run & 1) + w) ^ (first & 7)) << 4;  // k-ordered chunk 4 run + w
        anywhere = qweight;
    }
};

// Column `column`'s weights and scales into the stage at `stage` (generic pointer), this thread's share (plan).
// Immutable data only: may run before the wait for the previous kernel.
template <int BITS, int SEGS>
__forceinline__ void copy_weights(unsigned char* stage, const CopyPlan<BITS, SEGS>& plan, int column, int group_log2) {
    using S = Stage<BITS, SEGS>;
    using P = CopyPlan<BITS, SEGS>;
#pragma unroll
    for (int u = 0; u < kTileOctets / P::kOctetStep; ++u) {
        const bool valid = u * P::kOctetStep < plan.octets_left;
        cp_async16(stage + S::kWeights + 16 * (threadIdx.x + u * kBlockThreads),
                   valid ? plan.weights + u * plan.octet_stride + column * 32 : plan.anywhere, valid);
    }
    if (threadIdx.x < kTileOctets * SEGS) {  // a column's groups are consecutive: its segments'
        const int group = (column * kColumnK<BITS>) >> group_log2;
        cp_async16(stage + S::kScales + 16 * threadIdx.x, plan.scale_valid ? plan.scales + group : plan.anywhere, plan.scale_valid);
    }
}

// Column `column`'s x into the stage, this thread's share (plan): another kernel's output, so after the wait.
template <int BITS, int SEGS>
__forceinline__ void copy_x(unsigned char* stage, const CopyPlan<BITS, SEGS>& plan, int column) {
    using S = Stage<BITS, SEGS>;
    using P = CopyPlan<BITS, SEGS>;
    const bf16* src = plan.x + column * kColumnK<BITS>;
    unsigned char* dst = stage + S::kX + plan.x_place;
#pragma unroll
    for (int i = 0; i < kTokens / P::kTokenStep; ++i) {
        const bool valid = i * P::kTokenStep < plan.tokens_left;
        const bf16* chunk = valid ? src + i * plan.token_stride : static_cast<const bf16*>(plan.anywhere);
#pragma unroll
        for (int w = 0; w < 4; ++w) cp_async4(dst + i * P::kTokenStep * kSwizzleRow + plan.x_word[w], chunk + 2 * w, valid);
    }
}

// acc (= or +=, `accumulate`) A[64 rows, 16 inputs] (registers) x[128 tokens, 16 inputs]^T (K-major in shared
// memory). The first product overwrites: zeroing the accumulators with other instructions would make ptxas
// serialize every wgmma of the loop (C7515), the zeros' definitions reaching the wgmmas in flight across iterations.
__forceinline__ void wgmma_x(float (&acc)[16][4], const unsigned (&a)[4], unsigned long long x_desc, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WGMMA_O_REGS ", {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : WGMMA_O_OPERANDS(acc)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(x_desc), "r"(accumulate));
}

// A tile's scale, as the dequantization takes it: bf16 in both halves of a word (bf16x2 FMA), fp16 as f32.
template <bool F16S>
struct RowScale {
    unsigned int bf16x2;
    float f32;
    __forceinline__ explicit RowScale(unsigned short bits) : bf16x2(bits | ((unsigned int)bits << 16)), f32(scale_to_float<F16S>(bits)) {}
    __forceinline__ unsigned int times(unsigned int pair) const { return F16S ? scale_pair_f32(pair, f32) : scale_pair_bf16(pair, bf16x2); }
};

// The A fragments of run j of one m64 tile (rows g: chunk a, g + 8: chunk b), both k16 steps, each q pair times
// its row's scale and rounded to bf16: step s's fragment is {row g pair 2s, row g + 8 pair 2s, row g pair 2s + 1,
// row g + 8 pair 2s + 1} (as gemm_quant.cu's mma_run pairs them).
template <int BITS, bool F16S>
__forceinline__ void dequant_fragments(unsigned (&step0)[4], unsigned (&step1)[4], const uint4& a, const uint4& b,
                                       const RowScale<F16S>& sa, const RowScale<F16S>& sb, int j, const DequantMasks& masks) {
    unsigned int qa[4], qb[4];
    dequant_chunk_run<BITS>(a, j, masks, qa);
    dequant_chunk_run<BITS>(b, j, masks, qb);
    step0[0] = sa.times(qa[0]), step0[1] = sb.times(qb[0]), step0[2] = sa.times(qa[1]), step0[3] = sb.times(qb[1]);
    step1[0] = sa.times(qa[2]), step1[1] = sb.times(qb[2]), step1[2] = sa.times(qa[3]), step1[3] = sb.times(qb[3]);
}

// One column of a warpgroup (mg = 0, 1) from the stage at `stage` (generic pointer; `x_stage`: its x, shared
// address), run by run into acc[m64 tile], the A fragments alternating between frag's two buffers.
template <int BITS, int SEGS, bool F16S>
__forceinline__ void multiply_column(float (&acc)[2][16][4], unsigned (&frag)[2][4][4], const unsigned char* stage,
                                     unsigned x_stage, int mg, const DequantMasks& masks, bool first) {
    using S = Stage<BITS, SEGS>;
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2;
    const uint4* weights = reinterpret_cast<const uint4*>(stage + S::kWeights);
    const unsigned short* scales = reinterpret_cast<const unsigned short*>(stage + S::kScales);
    uint4 chunk[2][2];
    unsigned short scale_bits[2][2][SEGS];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int octet = 2 * (8 * mg + 4 * i + warp);
        chunk[i][0] = weights[octet * 32 + lane], chunk[i][1] = weights[(octet + 1) * 32 + lane];
#pragma unroll
        for (int seg = 0; seg < SEGS; ++seg) {
            scale_bits[i][0][seg] = scales[(octet * SEGS + seg) * 8 + g];
            scale_bits[i][1][seg] = scales[((octet + 1) * SEGS + seg) * 8 + g];
        }
    }
#pragma unroll
    for (int j = 0; j < kRuns<BITS>; ++j) {  // kRuns is even: run 0 of every column takes buffer 0
        unsigned (&a)[4][4] = frag[j & 1];
        const int seg = j * SEGS / kRuns<BITS>;  // the run's scale segment
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            dequant_fragments<BITS, F16S>(a[2 * i], a[2 * i + 1], chunk[i][0], chunk[i][1], RowScale<F16S>(scale_bits[i][0][seg]),
                                          RowScale<F16S>(scale_bits[i][1][seg]), j, masks);
        }
        wgmma_fence();  // the accumulators stay untouched by anything but wgmma until the final wait
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                const int step = 2 * j + s;  // the column's k16 step: 64-input half step / 4, 32 bytes a step within it
                wgmma_x(acc[i], a[2 * i + s], wgmma_desc(x_stage + (step >> 2) * kXHalf + (step & 3) * 32, 16, 1024),
                        !first || step > 0);
            }
        wgmma_commit();
        wgmma_wait<1>();  // the previous run's wgmmas are done: its buffer may be overwritten
        keep_in_place(frag[(j + 1) & 1]);
    }
}

// acc[i][nt]: rows (octet pair 8 mg + 4i + warp) g and g + 8, tokens 8 nt + 2t, 8 nt + 2t + 1 (wgmma's layout).
__forceinline__ void store_rows(void* y, const bf16* residual, const float (&acc)[2][16][4], const GemmTile& tile, int mg,
                                int m, int n, long long ldy, int epilogue) {
    const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const long long row_a = 8 * (tile.octet0 + 2 * (8 * mg + 4 * i + warp)) + g;
#pragma unroll
        for (int nt = 0; nt < kTokens / 8; ++nt) {
            store_accumulators(y, residual, acc[i][nt], row_a, tile.token0 + 8 * nt + 2 * t, m, n, ldy, epilogue);
        }
    }
}

template <int BITS, int SEGS, bool F16S>
__forceinline__ void gemm_quant_sm90(void* y, const bf16* x, const unsigned char* qweight, const bf16* scales,
                                     const bf16* residual, int m, int n, int k, int group_log2, int epilogue, int ldy) {
    using S = Stage<BITS, SEGS>;
    extern __shared__ __align__(1024) unsigned char gemm_smem[];
    const unsigned base = swizzle_aligned_base(gemm_smem, kStages * S::kBytes);
    unsigned char* const smem = gemm_smem + (base - smem_address(gemm_smem));
    const int octets = octet_count(n), columns = k / kColumnK<BITS>;
    const int row_tiles = (octets + kTileOctets - 1) / kTileOctets, token_tiles = (m + kTokens - 1) / kTokens;
    const GemmTile tile = gemm_tile(blockIdx.x, row_tiles, token_tiles, kTokens, kTileOctets, kRasterTiles);
    const CopyPlan<BITS, SEGS> plan(qweight, scales, x, tile, m, k, octets, columns, k >> group_log2);
#pragma unroll
    for (int c = 0; c < kLookahead; ++c)
        if (c < columns) copy_weights(smem + c * S::kBytes, plan, c, group_log2);
    enter_dependent_kernel();  // x, residual and y only from here on
#pragma unroll
    for (int c = 0; c < kLookahead; ++c) {
        if (c < columns) copy_x(smem + c * S::kBytes, plan, c);
        cp_async_commit();  // group c: column c's x (group 0 also every prologue column's weights)
    }
    const int mg = threadIdx.x / kGroupThreads;
    const DequantMasks masks = dequant_masks<BITS>();
    float acc[2][16][4];  // the first column's first wgmma of each tile overwrites
    unsigned frag[2][4][4];
    for (int c = 0; c < columns; ++c) {
        cp_async_wait<kLookahead - 1>();  // this thread's copies of column c have landed
        fence_proxy_async();              // x, visible to the wgmma (async) proxy
        __syncthreads();                  // everyone's; both warpgroups are done with column c - 2's stage
        const int next = c + kLookahead;
        if (next < columns) {
            copy_weights(smem + (next % kStages) * S::kBytes, plan, next, group_log2);
            copy_x(smem + (next % kStages) * S::kBytes, plan, next);
        }
        cp_async_commit();
        const int stage = c % kStages;
        multiply_column<BITS, SEGS, F16S>(acc, frag, smem + stage * S::kBytes, base + stage * S::kBytes + S::kX, mg, masks, c == 0);
    }
    wgmma_wait<0>();
    keep_in_place(frag[0]);
    keep_in_place(frag[1]);
    keep_in_place(acc[0]);
    keep_in_place(acc[1]);
    store_rows(y, residual, acc, tile, mg, m, n, ldy, epilogue);
}

#define GEMM_QUANT_SM90_KERNEL(NAME, BITS, SEGS, F16S)                                                          \
    extern "C" __global__ void __launch_bounds__(kBlockThreads, 1) NAME##_sm90(                                   \
        void* y, const bf16* x, const unsigned char* qweight, const bf16* scales, const bf16* residual, int m,    \
        int n, int k, int group_log2, int epilogue, int ldy) {                                                   \
        gemm_quant_sm90<BITS, SEGS, F16S>(y, x, qweight, scales, residual, m, n, k, group_log2, epilogue, ldy);  \
    }
GEMM_QUANT_VARIANTS(GEMM_QUANT_SM90_KERNEL)
#endif
