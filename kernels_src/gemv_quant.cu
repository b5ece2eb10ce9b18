// Decode GEMV over groupwise-quantized weights (int4 / int8, symmetric, bf16 or fp16 scales) on the tensor
// cores, and the dequantize kernel of the prefill path (bf16 [N_w, K] for cuBLASLt).
//
// Math: y[b, n] = sum_k x[b, k] * q[n, k] * scale[n, k / G] for batch rows b < rows <= 8. Codes are
// dequantized to bf16 exactly (|q| <= 128 needs at most 8 significant bits) and multiplied by x on the
// tensor cores (mma.sync m16n8k16 bf16, f32 accumulate: products exact, sums f32); each 32-input run lies in
// one group, so a segment of runs sharing a scale is summed first and then added times its scale in f32.
// Each output is rounded once on store. Scales are bf16, or fp16 (F16S: a `.ninfer` artifact's multipliers);
// either widens to f32 exactly. Epilogues (a uniform kernel argument), as gemv.cu's:
//   kStore (0):     y = x @ W^T, bf16                                 (N_w = N)
//   kResidual (1):  y = bf16(x @ W^T) + residual, bf16                (N_w = N; y may alias residual)
//   kSwiglu (2):    y[b, i] = silu(bf16(g)) * bf16(u), g/u = rows i and N+i of the fused gate_up matrix
//                   (N_w = 2N, N % 8 == 0): bit-identical to kStore followed by activation.cu's silu_mul_bf16
//   kStoreF32 (3):  y = x @ W^T, f32 (a quantized lm_head's logits)   (N_w = N)
// x is bf16 [rows, K]; y is [rows, N]; residual bf16 [rows, N]. Pointers 16-byte aligned (host-checked).
// Dense tail (kStore only; tail null and tail_rows 0 otherwise, which changes nothing): tail bf16
// [tail_rows, K] row-major is the projection's last rows, kept bf16 beside the quantized ones (a Gated
// DeltaNet's in_proj_b / in_proj_a, 2 x 48 rows at the 27B). y is then [rows, N + tail_rows] and row b of
// it is [x_b @ W^T | x_b @ tail^T]: one launch, where a GEMV of each and a concatenation were three.
//
// Device weight layout ("octets"; ninfer_rt/quantize/layouts.py device_layout() writes it from the checkpoint's
// row-major codes at load time). Codes are offset binary, u = q + 2^(BITS-1). Rows come in octets of 8
// (row 8o + g, g = 0..7; the last octets are padded with q = 0 / scale 0 rows to an even count). A row's K
// inputs are cut into columns of KC inputs (int4: KC = 128, int8: KC = 64; K % KC == 0), and a column into
// runs of 8 inputs: run j of lane t covers inputs c*KC + 32j + 8t + i, i = 0..7 (j < R runs per lane:
// int4 R = 4, int8 R = 2). One 16-byte chunk holds one lane's runs of one row:
//   qweight: chunk (o, c, lane = 4g + t) at byte ((o * C + c) * 32 + lane) * 16, C = K / KC columns, so the
//            32 lanes of a warp read 512 contiguous bytes = one column of one octet.
//   int4: word j of the chunk is run j, value i in nibble i/2 + 4 * (i%2) (i0 n0, i1 n4, i2 n1, i3 n5, ...):
//         (word >> 4s) & 0x000F000F is then the pair (i_2s, i_2s+1) in the two halves, which OR 0x4300 makes
//         the bf16 128 + u, and one bf16x2 FMA (- 136) makes q: per 2 values one LOP3, one FMA, <= 1 shift.
//   int8: words 2j, 2j+1 are run j, bytes (i0, i2, i1, i3), (i4, i6, i5, i7): the halves of a word (and of
//         the word >> 8) hold (i0, i1) and (i2, i3). bf16 holds 128 consecutive integers per binade, so
//         u = 128h + l becomes (0x4300 | l) + (0xC380 ^ (h << 7)) = (128 + l) - (256 - 128h) = q: per 2
//         values two LOP3 and one FMA.
//   scales: bf16 [octets, K / G, 8]: the 8 rows of an octet side by side for each group.
// A run's 4 bf16 pairs (i0 i1)(i2 i3)(i4 i5)(i6 i7) are the A fragments of two m16n8k16 mmas (rows g and
// g+8 come from the two octets of a tile, k slots 2t, 2t+1, 2t+8, 2t+9 are the run's inputs in order), and
// the lane's 16-byte load of x[b = g, run] is, unchanged, their B fragments: no shuffles, no conversions of x.
// G >= 32 (a power of two); K % G == 0.
//
// Launch: one block of 32 * W threads (W warps) per tile of 16 weight rows, grid = tail tiles + tiles:
//   plain epilogues: tile m = octets 2m, 2m+1 (rows 16m..16m+15), tiles = ceil(N / 16)
//   kSwiglu:         tile m = octets m and N/8 + m (gate rows 8m.., up rows N+8m..), tiles = N / 8
//   tail tiles:      ceil(tail_rows / 16) blocks ahead of the quantized tiles (blockIdx.x < tail tiles; 0
//                    without a tail); tail tile m = tail rows 16m..16m+15 (past tail_rows: row tail_rows-1
//                    again, never stored), stored at columns N + 16m... A bf16 row holds 4x the bytes of an
//                    int4 one, so these blocks go first: they start in the first wave, not after it.
//   A tail tile runs the quantized tiles' mma with the rows' bf16 values as A fragments, as loaded: the
//   16-byte chunk of row g at inputs 32j + 8t.. is the pairs (i0 i1)(i2 i3)(i4 i5)(i6 i7) that a run's
//   dequantization gives, and x's chunk of the same inputs is, as there, the B fragments. Warp w takes the
//   32-input runs w, w+W, ..., kTailRuns at a time (2 * kTailRuns 16-byte loads per lane, as a quantized
//   batch's 2 * kColumns); the products are exact in f32 and summed in f32 (no scale), then the warps'
//   sums meet in the same shared-memory reduction and store.
// W = 8, or 16 for a grid of at most two tiles per SM (quant_ops.gemv_warps): such a grid leaves SMs at a
// quarter of their warps, so each warp's chain of batches is long and the loads in flight few (H200,
// qwen3-8b decode step at 256 tokens: int8 down 21.6 -> 15.7 us with 16, 256 tiles; qkv, 384 tiles, 8.5 ->
// 11.1 us: its second wave of blocks would run alone).
// Warp w takes the columns w, w+W, w+2W, ...: kColumns (2) columns at a time, i.e. 4 16-byte loads per lane
// issued before any math (K = 4096 int4 at W = 8 is two such batches per warp). Two columns, not more: the registers
// they leave free let more blocks reside, which keeps more bytes in flight than deeper batches do (H200,
// qwen3-8b decode step at 256 tokens, kColumns 1 / 2 / 4 / 8: int8 3.58 / 3.21 / 3.35 / 3.53 ms, int4 2.59 /
// 2.38 / 2.45 / 2.59 ms; bench/results/decode.jsonl, "-var-columns" rows). The first batch and its scales are
// loaded before grid_dependency_wait (weights are immutable; with programmatic dependent launch they overlap
// the previous kernel's tail); x, residual and y are touched only after it. Lane (g, t) reads x row
// min(g, rows-1): rows >= `rows` of the mma are never stored. The W warps' accumulators (16 rows x 8 batch
// rows) are summed in shared memory in a fixed order; 128 threads apply the epilogue and store.
// Kernels: gemv_int<BITS>_b<B> (B in 1, 2, 4, 8: rows <= B) for G >= KC, where a whole column shares one
// scale; gemv_int4_g32, gemv_int4_g64, gemv_int8_g32 (rows <= 8) for smaller groups (scale per segment);
// each with W = 8, and with W = 16 as <name>_w16; <name>_f16s[_w16] with fp16 scales for the artifact
// formats (listed at the end).
//
// dequantize_int<BITS>_bf16: W[N_w, K] bf16 = q * scale, rounded to bf16 once (one bf16x2 FMA), one thread
// per 16-byte chunk (padded rows skipped), grid-stride; launch any grid of 256-thread blocks.
// dequantize_int<BITS>_f16s_bf16: fp16 scales, no bf16, so q * scale is formed in f32 (exact: 8 + 11
// significant bits) and rounded to bf16 once, which is NInfer's decoded value.
#include "quant_common.cuh"

constexpr int kColumns = 2;  // columns in flight per warp: 2 * kColumns 16-byte loads per lane
constexpr int kTailRuns = 2;  // a dense tail's 32-input runs in flight per warp: as many loads per lane

// load_streaming, but volatile: ptxas keeps the issue order, so a batch's loads all leave before its math.
__forceinline__ uint4 load_weights(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Makes p opaque: ptxas then keeps it in a register instead of re-deriving it, in 64-bit arithmetic, for
// every load of the loop (sm_90a int4 b1: 308 -> 267 instructions per batch of two columns).
template <class T>
__forceinline__ void keep_pointer(const T*& p) {
    asm volatile("" : "+l"(p));
}

// What one warp streams: its tile's two octets (a: mma rows 0..7, b: rows 8..15) and their scales.
struct TileRows {
    const uint4* wa;            // chunk (octet a, column 0, this lane)
    const uint4* wb;
    const unsigned short* sa;   // scale (octet a, group 0, row g)
    const unsigned short* sb;
};

// kColumns columns' chunks and the scales of their SEGS segments, loaded together.
template <int SEGS>
struct Batch {
    uint4 a[kColumns], b[kColumns];
    unsigned short sa[kColumns][SEGS], sb[kColumns][SEGS];
};

// Loads columns c, c + WARPS, ... (those < columns) of the tile into `batch`; wa and wb point at column c's
// chunks (the offsets of the other columns are then immediates of the loads). Immutable data only.
template <int BITS, int SEGS, int WARPS>
__forceinline__ void load_batch(Batch<SEGS>& batch, const uint4* wa, const uint4* wb, const TileRows& tile, const int c,
                                const int columns, const int group_log2) {
#pragma unroll
    for (int u = 0; u < kColumns; ++u) {
        if (c + WARPS * u < columns) {
            batch.a[u] = load_weights(wa + WARPS * u * 32);
            batch.b[u] = load_weights(wb + WARPS * u * 32);
        }
    }
#pragma unroll
    for (int u = 0; u < kColumns; ++u) {
        const int column = c + WARPS * u;
        if (column < columns) {
#pragma unroll
            for (int s = 0; s < SEGS; ++s) {
                const unsigned int group = (unsigned int)(column * kColumnK<BITS> + s * (kColumnK<BITS> / SEGS)) >> group_log2;
                batch.sa[u][s] = __ldg(tile.sa + group * 8);
                batch.sb[u][s] = __ldg(tile.sb + group * 8);
            }
        }
    }
}

// acc += the column's contribution: SEGS segments of kRuns / SEGS runs, each summed by the tensor cores and
// then added times its scale.
template <int BITS, int SEGS, bool F16S>
__forceinline__ void accumulate_column(float (&acc)[4], const Batch<SEGS>& batch, const int u, const uint4* x_lane,
                                       const int column, const DequantMasks& masks) {
    constexpr int kRunsPerSegment = kRuns<BITS> / SEGS;
#pragma unroll
    for (int s = 0; s < SEGS; ++s) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int r = 0; r < kRunsPerSegment; ++r) {
            const int j = s * kRunsPerSegment + r;
            const uint4 xv = __ldg(x_lane + column * (kColumnK<BITS> / 8) + 4 * j);
            unsigned int pa[4], pb[4];
            dequant_chunk_run<BITS>(batch.a[u], j, masks, pa);
            dequant_chunk_run<BITS>(batch.b[u], j, masks, pb);
            mma_run(part, pa, pb, xv);
        }
        const float scale_a = scale_to_float<F16S>(batch.sa[u][s]), scale_b = scale_to_float<F16S>(batch.sb[u][s]);
        acc[0] = fmaf(scale_a, part[0], acc[0]);
        acc[1] = fmaf(scale_a, part[1], acc[1]);
        acc[2] = fmaf(scale_b, part[2], acc[2]);
        acc[3] = fmaf(scale_b, part[3], acc[3]);
    }
}

// A quantized tile's sums (tile m of the header's Launch), per lane: (row g, batch 2t), (row g, batch 2t+1),
// (row g+8, batch 2t), (row g+8, batch 2t+1). SEGS: scale segments per column (1 when G >= KC; KC / G for
// smaller groups); WARPS: W; F16S: fp16 scales.
template <int BITS, int B, int SEGS, int WARPS, bool F16S>
__forceinline__ void quant_tile_sums(float (&acc)[4], const bf16* x, const unsigned char* qweight, const bf16* scales,
                                     int rows, int n, int k, int group_log2, bool swiglu, long long tile) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const long long octet_a = swiglu ? tile : 2 * tile;
    const long long octet_b = swiglu ? (n >> 3) + tile : 2 * tile + 1;
    const int columns = k / kColumnK<BITS>;
    const int groups = k >> group_log2;
    TileRows rows_of_tile = {
        reinterpret_cast<const uint4*>(qweight) + octet_a * columns * 32 + lane,
        reinterpret_cast<const uint4*>(qweight) + octet_b * columns * 32 + lane,
        reinterpret_cast<const unsigned short*>(scales) + octet_a * groups * 8 + g,
        reinterpret_cast<const unsigned short*>(scales) + octet_b * groups * 8 + g,
    };

    // Column c's chunks (c: the loop's), advanced a batch at a time. Kept apart from rows_of_tile: advancing
    // rows_of_tile's own pointers instead compiles to other SASS, and int8 ran 0.5% slower (H200: bench/logs/h200-2026-11-30-gemv-tma-cluster-barriers-d2ba9d6.txt).
    const uint4* wa = rows_of_tile.wa + warp * 32;
    const uint4* wb = rows_of_tile.wb + warp * 32;
    keep_pointer(rows_of_tile.sa);
    keep_pointer(rows_of_tile.sb);
    Batch<SEGS> batch;
    load_batch<BITS, SEGS, WARPS>(batch, wa, wb, rows_of_tile, warp, columns, group_log2);
    enter_dependent_kernel();  // x, residual and y only from here on

    // Lane (g, t) supplies batch row g's inputs of its runs; rows past `rows` repeat row rows-1.
    const int x_row = B == 1 ? 0 : min(g, rows - 1);
    const uint4* x_lane = reinterpret_cast<const uint4*>(x) + (long long)x_row * (k >> 3) + t;
    const DequantMasks masks = dequant_masks<BITS>();
    constexpr int kStep = WARPS * kColumns;  // columns per batch of the warps
    for (int c = warp; c < columns; c += kStep) {
#pragma unroll
        for (int u = 0; u < kColumns; ++u)
            if (c + WARPS * u < columns) accumulate_column<BITS, SEGS, F16S>(acc, batch, u, x_lane, c + WARPS * u, masks);
        wa += kStep * 32;
        wb += kStep * 32;
        keep_pointer(wa);
        keep_pointer(wb);
        if (c + kStep < columns) load_batch<BITS, SEGS, WARPS>(batch, wa, wb, rows_of_tile, c + kStep, columns, group_log2);
    }
}

// Loads runs run, run + WARPS, ... (those < runs) of rows a and b; wa and wb point at run `run`'s chunks.
template <int WARPS>
__forceinline__ void load_tail_batch(uint4 (&a)[kTailRuns], uint4 (&b)[kTailRuns], const uint4* wa, const uint4* wb,
                                     const int run, const int runs) {
#pragma unroll
    for (int u = 0; u < kTailRuns; ++u) {
        if (run + WARPS * u < runs) {
            a[u] = load_weights(wa + 4 * WARPS * u);
            b[u] = load_weights(wb + 4 * WARPS * u);
        }
    }
}

// A dense tail tile's sums, laid out as quant_tile_sums' (header: tail tiles): rows 16 * tile + g and
// 16 * tile + 8 + g of the bf16 tail [tail_rows, K], the lane's chunk t of each 32-input run.
template <int B, int WARPS>
__forceinline__ void tail_tile_sums(float (&acc)[4], const bf16* x, const bf16* tail, int rows, int tail_rows, int k, int tile) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int chunks = k >> 3, runs = k >> 5;  // 16-byte chunks and 32-input runs per row
    const long long row_a = min(16 * tile + g, tail_rows - 1), row_b = min(16 * tile + 8 + g, tail_rows - 1);
    const uint4* wa = reinterpret_cast<const uint4*>(tail) + row_a * chunks + 4 * warp + t;
    const uint4* wb = reinterpret_cast<const uint4*>(tail) + row_b * chunks + 4 * warp + t;
    uint4 a[kTailRuns], b[kTailRuns];
    load_tail_batch<WARPS>(a, b, wa, wb, warp, runs);
    enter_dependent_kernel();  // x and y only from here on

    const int x_row = B == 1 ? 0 : min(g, rows - 1);
    const uint4* x_lane = reinterpret_cast<const uint4*>(x) + (long long)x_row * chunks + t;
    constexpr int kStep = WARPS * kTailRuns;  // runs per batch of the warps
    // Rolled: unrolled, this loop's registers set the whole kernel's (ptxas, sm_90a: int4 g64 64 -> 73, one
    // allocation step more, i.e. 3 blocks of 8 warps per SM instead of 4 on the quantized tiles).
#pragma unroll 1
    for (int run = warp; run < runs; run += kStep) {
#pragma unroll
        for (int u = 0; u < kTailRuns; ++u) {
            if (run + WARPS * u < runs) {
                const unsigned int pa[4] = {a[u].x, a[u].y, a[u].z, a[u].w}, pb[4] = {b[u].x, b[u].y, b[u].z, b[u].w};
                mma_run(acc, pa, pb, __ldg(x_lane + 4 * (run + WARPS * u)));
            }
        }
        wa += 4 * kStep;
        wb += 4 * kStep;
        if (run + kStep < runs) load_tail_batch<WARPS>(a, b, wa, wb, run + kStep, runs);
    }
}

// Blocks below the tail's tile count (0 without a tail) take its tiles, the others the quantized tiles.
template <int BITS, int B, int SEGS, int WARPS, bool F16S>
__forceinline__ void gemv_quant(void* y, const bf16* x, const unsigned char* qweight, const bf16* scales,
                                const bf16* residual, int rows, int n, int k, int group_log2, int epilogue,
                                const bf16* tail, int tail_rows) {
    __shared__ float partial[WARPS][4][32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool swiglu = epilogue == kSwiglu;
    const int tail_tiles = (tail_rows + 15) >> 4;
    const bool in_tail = (int)blockIdx.x < tail_tiles;
    const long long tile = (long long)blockIdx.x - (in_tail ? 0 : tail_tiles);
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (in_tail) {
        tail_tile_sums<B, WARPS>(acc, x, tail, rows, tail_rows, k, (int)tile);
    } else {
        quant_tile_sums<BITS, B, SEGS, WARPS, F16S>(acc, x, qweight, scales, rows, n, k, group_log2, swiglu, tile);
    }

    // acc: (row g, batch 2t), (row g, batch 2t+1), (row g+8, batch 2t), (row g+8, batch 2t+1) of the tile.
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][i][lane] = acc[i];
    __syncthreads();
    // The sum over warps of tile row r (0..15), batch row b.
    auto total = [&](int r, int b) {
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += partial[w][(r >> 3) * 2 + (b & 1)][4 * (r & 7) + (b >> 1)];
        return v;
    };
    if (swiglu) {  // never with a tail (host-checked)
        const int r = threadIdx.x & 7, b = threadIdx.x >> 3;
        if (b < B && b < rows) {
            const float gate = total(r, b), up = total(r + 8, b);
            store(static_cast<bf16*>(y), (long long)b * n + 8 * tile + r, silu(round_bf16(gate)) * round_bf16(up));
        }
        return;
    }
    const int r = threadIdx.x & 15, b = threadIdx.x >> 4;
    const long long y_cols = (long long)n + tail_rows;  // y's row stride
    const long long row = (in_tail ? n : 0) + 16 * tile + r;
    if (b < B && b < rows && row < (in_tail ? y_cols : n)) store_output(y, residual, b * y_cols + row, total(r, b), epilogue);
}

template <int BITS, bool F16S>
__forceinline__ void dequantize(bf16* w, const unsigned char* qweight, const bf16* scales, long long chunks, int n_w,
                                int k, int group_log2) {
    enter_dependent_kernel();  // w is the scratch matrix an earlier GEMM may still be reading
    const uint4* q4 = reinterpret_cast<const uint4*>(qweight);
    const unsigned short* s16 = reinterpret_cast<const unsigned short*>(scales);
    const int columns = k / kColumnK<BITS>;
    const int groups = k >> group_log2;
    const DequantMasks masks = dequant_masks<BITS>();
    for (long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x; chunk < chunks;
         chunk += (long long)gridDim.x * blockDim.x) {
        const OctetChunk at = octet_chunk(chunk, columns);
        if (at.row >= n_w) continue;  // a padding row
        const uint4 v = load_streaming(q4 + chunk);
#pragma unroll
        for (int j = 0; j < kRuns<BITS>; ++j) {
            const int k0 = at.column * kColumnK<BITS> + 32 * j + 8 * at.t;
            const unsigned int s = s16[(at.octet * groups + (k0 >> group_log2)) * 8 + at.g];
            unsigned int p[4];
            dequant_chunk_run<BITS>(v, j, masks, p);
            uint4 out;
            if (F16S) {
                const float scale = scale_to_float<true>((unsigned short)s);
                out = make_uint4(scale_pair_f32(p[0], scale), scale_pair_f32(p[1], scale), scale_pair_f32(p[2], scale),
                                 scale_pair_f32(p[3], scale));
            } else {
                const unsigned int scale2 = s | (s << 16);
                out = make_uint4(scale_pair_bf16(p[0], scale2), scale_pair_bf16(p[1], scale2), scale_pair_bf16(p[2], scale2),
                                 scale_pair_bf16(p[3], scale2));
            }
            *reinterpret_cast<uint4*>(w + at.row * k + k0) = out;
        }
    }
}

#define GEMV_QUANT_ARGS                                                                                       \
    void *y, const bf16 *x, const unsigned char *qweight, const bf16 *scales, const bf16 *residual, int rows, \
        int n, int k, int group_log2, int epilogue, const bf16 *tail, int tail_rows
#define GEMV_QUANT_KERNEL_W(NAME, BITS, B, SEGS, WARPS, F16S)                                                  \
    extern "C" __global__ void __launch_bounds__(32 * WARPS) NAME(GEMV_QUANT_ARGS) {                           \
        gemv_quant<BITS, B, SEGS, WARPS, F16S>(y, x, qweight, scales, residual, rows, n, k, group_log2, epilogue, \
                                               tail, tail_rows);                                                 \
    }
#define GEMV_QUANT_KERNEL_S(NAME, BITS, B, SEGS, F16S) \
    GEMV_QUANT_KERNEL_W(NAME, BITS, B, SEGS, 8, F16S)  \
    GEMV_QUANT_KERNEL_W(NAME##_w16, BITS, B, SEGS, 16, F16S)
#define GEMV_QUANT_KERNEL(NAME, BITS, B, SEGS) GEMV_QUANT_KERNEL_S(NAME, BITS, B, SEGS, false)
#define GEMV_QUANT_KERNEL_F16S(NAME, BITS, B, SEGS) GEMV_QUANT_KERNEL_S(NAME##_f16s, BITS, B, SEGS, true)
#define DEQUANTIZE_KERNEL(NAME, BITS, F16S)                                                                  \
    extern "C" __global__ void NAME(bf16* w, const unsigned char* qweight, const bf16* scales, long long chunks, \
                                    int n_w, int k, int group_log2) {                                        \
        dequantize<BITS, F16S>(w, qweight, scales, chunks, n_w, k, group_log2);                              \
    }
// One kernel per batch bucket B (rows <= B), for groups of at least a column.
#define GEMV_QUANT_BUCKETS(KERNEL, BITS)          \
    KERNEL(gemv_int##BITS##_b1, BITS, 1, 1)       \
    KERNEL(gemv_int##BITS##_b2, BITS, 2, 1)       \
    KERNEL(gemv_int##BITS##_b4, BITS, 4, 1)       \
    KERNEL(gemv_int##BITS##_b8, BITS, 8, 1)

GEMV_QUANT_BUCKETS(GEMV_QUANT_KERNEL, 4)
GEMV_QUANT_BUCKETS(GEMV_QUANT_KERNEL, 8)
DEQUANTIZE_KERNEL(dequantize_int4_bf16, 4, false)
DEQUANTIZE_KERNEL(dequantize_int8_bf16, 8, false)
// Groups smaller than a column: a scale per segment of runs (G / 32 runs).
GEMV_QUANT_KERNEL(gemv_int4_g32, 4, 8, 4)
GEMV_QUANT_KERNEL(gemv_int4_g64, 4, 8, 2)
GEMV_QUANT_KERNEL(gemv_int8_g32, 8, 8, 2)
// fp16 scales, for the `.ninfer` formats as bound: Q4G64 as int4 g64; Q5G64 / Q6G64 as int8 g64 (one scale
// per int8 column); W8G32 as int8 g32.
GEMV_QUANT_KERNEL_F16S(gemv_int4_g64, 4, 8, 2)
GEMV_QUANT_BUCKETS(GEMV_QUANT_KERNEL_F16S, 8)
GEMV_QUANT_KERNEL_F16S(gemv_int8_g32, 8, 8, 2)
DEQUANTIZE_KERNEL(dequantize_int4_f16s_bf16, 4, true)
DEQUANTIZE_KERNEL(dequantize_int8_f16s_bf16, 8, true)
