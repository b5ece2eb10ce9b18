// Prefill GEMM over groupwise-quantized weights (int4 / int8, symmetric, bf16 or fp16 scales) on the tensor
// cores, dequantizing inside its main loop from the decode GEMV's weight layout: no bf16 copy of the weights.
//
// Math: y[m, n] = sum_k x[m, k] * q[n, k] * scale[n, k / G] for M tokens (any M >= 1; the executor takes it
// above the GEMV's 8 rows), as gemv_quant.cu computes it: codes dequantized to bf16 exactly, the products q * x
// exact and summed in f32 by mma.sync m16n8k16 (bf16 in, f32 accumulate); the runs of a column that share a
// scale (a segment: the whole column when G >= KC, else G / 32 runs) are summed first and then added times
// their scale in f32; each output is rounded once on store. A scale, bf16 or fp16 (F16S), widens to f32
// exactly, so with fp16 scales this computes with the unrounded products q * scale, as the GEMV does, where
// the dequantize + cuBLASLt path rounds each to bf16 first (at most 2^-9 relative per weight). Epilogues
// (gemv_quant.cu's codes, a uniform kernel argument):
//   kStore (0):     y = x @ W^T, bf16
//   kResidual (1):  y = bf16(x @ W^T) + residual, bf16 (y may alias residual: one thread reads, then writes, each element)
//   kStoreF32 (3):  y = x @ W^T, f32
// x is bf16 [M, K]; y [M, N] and residual bf16 [M, N] with rows ldy >= N elements apart (ldy > N: the product
// fills the first N columns of a wider output, a projection's other columns being another GEMM's); x, qweight
// and scales 16-byte aligned (host-checked).
//
// Layout: gemv_quant.cu's "octets", unchanged (rows in octets of 8, padded to an even count; a column of KC
// inputs, int4 128 / int8 64, of an octet is 32 16-byte chunks, chunk lane = 4g + t holding row g's runs j of
// inputs 32j + 8t + i; scales [octets, K / G, 8]). As in the GEMV, octets 2p and 2p + 1 (octet pair p) are
// an mma's rows g and g + 8 and a run's 4 q pairs are the A fragments of two k16 steps, k slots 2t + e and
// 2t + 8 + e of a step being inputs 8t + e and 8t + 2 + e of the run. The B fragments of lane (g, t) for
// token column g of an n8 tile are then the 16 contiguous bytes x[token][32j + 8t .. 32j + 8t + 7]: one
// ld.shared.v4 (ldmatrix cannot gather them: an 8x8 matrix row is 16 contiguous bytes, and in this k order
// B's rows are not).
//
// Launch: one-dimensional grid of ceil(octets / 32) row tiles x ceil(M / T) token tiles, rastered in groups
// of kRasterTiles row tiles (block b: group b / (kRasterTiles * token tiles), and in it the row tile varies
// fastest), so the blocks resident at once share a few row tiles' weights and token tiles' x in L2. Block:
// 8 warps (256 threads), a tile of 32 octets (256 rows) x T tokens (T = 32 or 64: the _t32 / _t64 kernels);
// warp w owns octet pairs 2w and 2w + 1 of the tile (32 rows) and all T tokens. Dynamic shared memory:
// kStages stages of [weights: 32 octets x 32 chunks | x: T tokens x KC / 8 chunks | scales: 32 octets x SEGS
// chunks of 8], 16-byte chunks (gemm_quant_ops.smem_bytes mirrors StageLayout; too little traps).
// Main loop over the K / KC columns, one barrier a column: stage c + kStages - 1's cp.async copies (weights,
// scales, x; tokens past M and octets past the weight zero-filled) fly while column c is computed. The first
// stages' weights and scales are copied before grid_dependency_wait (immutable), x only after it. Per column
// and segment a warp reads its 4 chunks from shared memory and dequantizes the segment's A fragments (the
// whole column when G >= KC); then for each kChains n8 tiles of tokens: part = the segment's runs (B
// fragments from shared memory, 2 mmas a run per octet pair and n8 tile: 4 independent accumulators),
// acc += scale * part.
// Epilogue: each lane stores its accumulators (rows g and g + 8 of each pair, tokens 2t and 2t + 1 of each n8
// tile) where the row is < N and the token < M. A warp whose pairs are all past the weight only copies.
//
// Why these tiles (design estimates for an H100/H200 SM, not measurements; the GPU benchmark tunes them):
// - Each dequantized A fragment feeds T / 8 n8 tiles: at T = 64 the int4 dequantization (about 2.75
//   instructions per q pair) costs ~1.4 instructions per mma, int8 less.
// - Each B fragment (one 16-byte shared load for two mmas) feeds both octet pairs of the warp: 128 bytes of
//   shared memory per mma, about one clock at 128 B/clk, near mma.sync's issue rate. One pair per warp would
//   need twice that.
// - The segment sums need a second accumulator per output; holding a segment's A fragments (int4 g128: the
//   column, 64 registers) and a part for kChains n8 tiles beats a part for every n8 tile. ptxas gives the
//   64-token kernels 208-255 registers (docs/findings.md): one block of 8 warps per SM, each warp with 4
//   independent mma chains.
// - 256 rows x 64 tokens bring 16 KiB of int4 weights and 16 KiB of x per column from L2 for 1024 mmas, 32 B
//   per mma; x, 4x the bytes of int4 weights per element, is why the tile is tall rather than wide.
// - Stages: int4 2 (a column is 8 k16 steps), int8 3 (4 steps, the same bytes of weights): at most 75 KiB,
//   under sm_120's 99 KiB per block.
// - T = 32 for M <= 32: such GEMMs are bound by the weight bytes, and a 64-token tile would double the mma
//   work for nothing.
#include "quant_common.cuh"

constexpr int kGemmWarps = 8;
constexpr int kGemmThreads = 32 * kGemmWarps;
constexpr int kWarpPairs = 2;                                // octet pairs (16-row mma tiles) per warp
constexpr int kTileOctets = 2 * kWarpPairs * kGemmWarps;     // 32 octets: 256 weight rows per block
constexpr int kRasterTiles = 8;                              // row tiles per raster group
constexpr int kChains = 2;                                   // n8 tiles per pass over a segment's A fragments

constexpr int kStagesInt4 = 2;                               // pipeline stages: a column is 8 k16 steps
constexpr int kStagesInt8 = 3;                               // 4 k16 steps (the same weight bytes)
template <int BITS>
constexpr int kStages = BITS == 4 ? kStagesInt4 : kStagesInt8;

// One pipeline stage in dynamic shared memory, in 16-byte chunks: weights, then x, then scales.
template <int BITS, int SEGS, int T>
struct StageLayout {
    static constexpr int kWeightChunks = kTileOctets * 32;  // chunk (octet, lane), as in global memory
    static constexpr int kRowChunks = kColumnK<BITS> / 8;    // x chunks per token of a column
    static constexpr int kXChunks = T * kRowChunks;           // chunk (token, x_slot(token, chunk))
    static constexpr int kScaleChunks = kTileOctets * SEGS;   // (octet, segment): rows 0..7's scales
    static constexpr int kChunks = kWeightChunks + kXChunks + kScaleChunks;
    static constexpr int kBytes = kStages<BITS> * kChunks * 16;
    static_assert(kWeightChunks % kGemmThreads == 0 && kXChunks % kGemmThreads == 0 && kScaleChunks <= kGemmThreads, "copy split");
};

// x chunk q of token row r sits at slot q ^ 4 on odd rows. The 8 lanes of a quarter warp read rows 2i and
// 2i + 1 at chunks 4j + t (t = 0..3) and a row is a multiple of 128 bytes, so they hit 8 distinct 16-byte
// bank groups; the copies write 8 consecutive chunks of one row, also distinct.
__forceinline__ int x_slot(int row, int chunk) {
    return chunk ^ ((row & 1) << 2);
}

__forceinline__ void require_dynamic_smem(unsigned int bytes) {
    unsigned int have;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
    if (have < bytes) __trap();  // the host's smem_bytes disagrees with StageLayout
}

// This thread's copies of every stage, fixed for the block: the sources at column 0 and the distance between
// the thread's successive copies (the column adds column * 32 chunks to the weights, column * KC inputs to x,
// its group to the scales). Copy u of the thread is chunk threadIdx.x + u * kGemmThreads of its part of the
// stage: weights (octet (tid >> 5) + 8u, lane tid & 31), x (token tid / kRowChunks + u * kTokenStep, chunk
// tid % kRowChunks), scales (octet tid / SEGS, segment tid % SEGS; threads below kScaleChunks).
template <int BITS, int SEGS, int T>
struct CopyPlan {
    using L = StageLayout<BITS, SEGS, T>;
    static constexpr int kOctetStep = kGemmThreads / 32;
    static constexpr int kTokenStep = kGemmThreads / L::kRowChunks;
    const uint4* weights;    // chunk (octet0 + tid / 32, column 0, lane tid % 32)
    long long octet_stride;  // kOctetStep octets of chunks
    int octets_left;         // octets from the thread's first to the weight's end: copy u reads while u * kOctetStep < it
    const uint4* scales;     // chunk (octet0 + tid / SEGS, group tid % SEGS)
    bool scale_valid;
    const bf16* x;           // x[token0 + tid / kRowChunks][8 * (tid % kRowChunks)]
    long long token_stride;  // kTokenStep tokens of x
    int tokens_left;         // tokens from the thread's first to M: copy u reads while u * kTokenStep < it
    int x_chunk;             // where copy 0 lands in the stage's x: its row's chunks, then x_slot
    const void* anywhere;    // a mapped address for the zero-filling copies (cp_async16)

    __device__ CopyPlan(const uint4* qweight, const uint4* scale_chunks, const bf16* x_rows, const GemmTile& tile, int m,
                        int k, int octets, int columns, int groups) {
        const int tid = threadIdx.x;
        weights = qweight + (tile.octet0 + tid / 32) * columns * 32 + tid % 32;
        octet_stride = (long long)kOctetStep * columns * 32;
        octets_left = (int)(octets - tile.octet0 - tid / 32);
        scales = scale_chunks + (tile.octet0 + tid / SEGS) * groups + tid % SEGS;
        scale_valid = tid < L::kScaleChunks && tile.octet0 + tid / SEGS < octets;
        const int row = tid / L::kRowChunks, chunk = tid % L::kRowChunks;
        x = x_rows + (long long)(tile.token0 + row) * k + 8 * chunk;
        token_stride = (long long)kTokenStep * k;
        tokens_left = m - tile.token0 - row;
        x_chunk = row * L::kRowChunks + x_slot(row, chunk);  // kTokenStep is even: x_slot is the same for every copy
        anywhere = qweight;
    }
};

// Weights and scales of column `column` into `stage`. Immutable data only.
template <int BITS, int SEGS, int T>
__forceinline__ void copy_weights(uint4* stage, const CopyPlan<BITS, SEGS, T>& plan, int column, int group_log2) {
    using L = StageLayout<BITS, SEGS, T>;
#pragma unroll
    for (int u = 0; u < L::kWeightChunks / kGemmThreads; ++u) {
        const bool valid = u * plan.kOctetStep < plan.octets_left;
        cp_async16(stage + threadIdx.x + u * kGemmThreads, valid ? plan.weights + u * plan.octet_stride + column * 32 : plan.anywhere,
                   valid);
    }
    // A segment's group: with SEGS > 1 the groups are KC / SEGS inputs, so a column's are consecutive.
    if (threadIdx.x < L::kScaleChunks) {
        const int group = (column * kColumnK<BITS>) >> group_log2;
        cp_async16(stage + L::kWeightChunks + L::kXChunks + threadIdx.x, plan.scale_valid ? plan.scales + group : plan.anywhere,
                   plan.scale_valid);
    }
}

// x[token0 .. token0 + T, column] into `stage`, swizzled (x_slot); tokens past M zero-filled.
template <int BITS, int SEGS, int T>
__forceinline__ void copy_x(uint4* stage, const CopyPlan<BITS, SEGS, T>& plan, int column) {
    using L = StageLayout<BITS, SEGS, T>;
#pragma unroll
    for (int u = 0; u < L::kXChunks / kGemmThreads; ++u) {
        const bool valid = u * plan.kTokenStep < plan.tokens_left;
        cp_async16(stage + L::kWeightChunks + plan.x_chunk + u * kGemmThreads,
                   valid ? plan.x + u * plan.token_stride + column * kColumnK<BITS> : plan.anywhere, valid);
    }
}

// acc += this warp's rows x T tokens of one column, read from `stage`, a segment at a time: its runs'
// A fragments dequantized (the whole column when G >= KC), then every n8 tile, kChains at a time.
template <int BITS, int SEGS, int T, bool F16S>
__forceinline__ void gemm_column(float (&acc)[kWarpPairs][T / 8][4], const uint4* stage, const DequantMasks& masks) {
    using L = StageLayout<BITS, SEGS, T>;
    constexpr int kRunsPerSegment = kRuns<BITS> / SEGS;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const unsigned short* scales = reinterpret_cast<const unsigned short*>(stage + L::kWeightChunks + L::kXChunks);
    const uint4* x_lane = stage + L::kWeightChunks + g * L::kRowChunks;  // token g of n8 tile 0
#pragma unroll
    for (int s = 0; s < SEGS; ++s) {
        unsigned int qa[kWarpPairs][kRunsPerSegment][4], qb[kWarpPairs][kRunsPerSegment][4];  // rows g, g + 8
        float sa[kWarpPairs], sb[kWarpPairs];
#pragma unroll
        for (int p = 0; p < kWarpPairs; ++p) {
            const int octet_a = 2 * (kWarpPairs * warp + p);
            const uint4 chunk_a = stage[octet_a * 32 + lane], chunk_b = stage[(octet_a + 1) * 32 + lane];
#pragma unroll
            for (int r = 0; r < kRunsPerSegment; ++r) {
                dequant_chunk_run<BITS>(chunk_a, s * kRunsPerSegment + r, masks, qa[p][r]);
                dequant_chunk_run<BITS>(chunk_b, s * kRunsPerSegment + r, masks, qb[p][r]);
            }
            sa[p] = scale_to_float<F16S>(scales[(octet_a * SEGS + s) * 8 + g]);
            sb[p] = scale_to_float<F16S>(scales[((octet_a + 1) * SEGS + s) * 8 + g]);
        }
#pragma unroll
        for (int n0 = 0; n0 < T / 8; n0 += kChains) {
            float part[kWarpPairs][kChains][4] = {};
#pragma unroll
            for (int r = 0; r < kRunsPerSegment; ++r) {
                const int j = s * kRunsPerSegment + r;
                uint4 xv[kChains];
#pragma unroll
                for (int c = 0; c < kChains; ++c) xv[c] = x_lane[(n0 + c) * 8 * L::kRowChunks + x_slot(g, 4 * j + t)];
#pragma unroll
                for (int p = 0; p < kWarpPairs; ++p)
#pragma unroll
                    for (int c = 0; c < kChains; ++c) mma_run(part[p][c], qa[p][r], qb[p][r], xv[c]);
            }
#pragma unroll
            for (int p = 0; p < kWarpPairs; ++p)
#pragma unroll
                for (int c = 0; c < kChains; ++c) {
                    float(&a)[4] = acc[p][n0 + c];
                    a[0] = fmaf(sa[p], part[p][c][0], a[0]);
                    a[1] = fmaf(sa[p], part[p][c][1], a[1]);
                    a[2] = fmaf(sb[p], part[p][c][2], a[2]);
                    a[3] = fmaf(sb[p], part[p][c][3], a[3]);
                }
        }
    }
}

// acc[p][i]: (row g of octet 2P, tokens 8i + 2t, 8i + 2t + 1), then the same of octet 2P + 1 (P: pair p's index).
template <int T>
__forceinline__ void store_tile(void* y, const bf16* residual, const float (&acc)[kWarpPairs][T / 8][4], const GemmTile& tile,
                                int m, int n, long long ldy, int epilogue) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int p = 0; p < kWarpPairs; ++p) {
        const long long row_a = 8 * (tile.octet0 + 2 * (kWarpPairs * warp + p)) + g;
#pragma unroll
        for (int i = 0; i < T / 8; ++i) store_accumulators(y, residual, acc[p][i], row_a, tile.token0 + 8 * i + 2 * t, m, n, ldy, epilogue);
    }
}

// SEGS: scale segments per column (1 when G >= KC, else KC / G); T: tokens per block; F16S: fp16 scales.
template <int BITS, int SEGS, int T, bool F16S>
__forceinline__ void gemm_quant(void* y, const bf16* x, const unsigned char* qweight, const bf16* scales,
                                const bf16* residual, int m, int n, int k, int group_log2, int epilogue, int ldy) {
    using L = StageLayout<BITS, SEGS, T>;
    constexpr int kS = kStages<BITS>;
    extern __shared__ uint4 smem[];
    require_dynamic_smem(L::kBytes);
    const int octets = octet_count(n), columns = k / kColumnK<BITS>;
    const int row_tiles = (octets + kTileOctets - 1) / kTileOctets, token_tiles = (m + T - 1) / T;
    const GemmTile tile = gemm_tile(blockIdx.x, row_tiles, token_tiles, T, kTileOctets, kRasterTiles);
    const CopyPlan<BITS, SEGS, T> plan(reinterpret_cast<const uint4*>(qweight), reinterpret_cast<const uint4*>(scales), x, tile,
                                       m, k, octets, columns, k >> group_log2);

#pragma unroll
    for (int c = 0; c < kS - 1; ++c)
        if (c < columns) copy_weights(smem + c * L::kChunks, plan, c, group_log2);
    enter_dependent_kernel();  // x, residual and y only from here on
#pragma unroll
    for (int c = 0; c < kS - 1; ++c) {
        if (c < columns) copy_x(smem + c * L::kChunks, plan, c);
        cp_async_commit();  // group c: column c's x (group 0 also every prologue column's weights)
    }

    const DequantMasks masks = dequant_masks<BITS>();
    const bool idle = tile.octet0 + 2 * kWarpPairs * (threadIdx.x >> 5) >= octets;  // all its pairs past the weight
    float acc[kWarpPairs][T / 8][4] = {};
    for (int c = 0; c < columns; ++c) {
        cp_async_wait<kS - 2>();  // this thread's copies of column c have landed
        __syncthreads();          // everyone's have, and every warp is done with column c - 1's stage
        const int next = c + kS - 1;
        if (next < columns) {
            uint4* stage = smem + (next % kS) * L::kChunks;
            copy_weights(stage, plan, next, group_log2);
            copy_x(stage, plan, next);
        }
        cp_async_commit();
        if (!idle) gemm_column<BITS, SEGS, T, F16S>(acc, smem + (c % kS) * L::kChunks, masks);
    }
    if (!idle) store_tile<T>(y, residual, acc, tile, m, n, ldy, epilogue);
}

#define GEMM_QUANT_ARGS                                                                                       \
    void *y, const bf16 *x, const unsigned char *qweight, const bf16 *scales, const bf16 *residual, int m, int n, \
        int k, int group_log2, int epilogue, int ldy
#define GEMM_QUANT_KERNEL_T(NAME, BITS, SEGS, T, F16S)                                                          \
    extern "C" __global__ void __launch_bounds__(kGemmThreads, 1) NAME##_t##T(GEMM_QUANT_ARGS) {                \
        gemm_quant<BITS, SEGS, T, F16S>(y, x, qweight, scales, residual, m, n, k, group_log2, epilogue, ldy); \
    }
#define GEMM_QUANT_KERNEL(NAME, BITS, SEGS, F16S)     \
    GEMM_QUANT_KERNEL_T(NAME, BITS, SEGS, 32, F16S) \
    GEMM_QUANT_KERNEL_T(NAME, BITS, SEGS, 64, F16S)

GEMM_QUANT_VARIANTS(GEMM_QUANT_KERNEL)
