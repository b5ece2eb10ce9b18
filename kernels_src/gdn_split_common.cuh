// The split chunked delta rule's shared part (gdn_chunked_split.cu): block size and tile strides, the
// workspace the passes hand each other and the addressing of its split planes, the chunks of a sequence in
// closed form, and the copies that stage global rows into shared memory.
#pragma once
#include "attention_common.cuh"
#include "gdn_delta_rule_common.cuh"
#include "gdn_split_mma.cuh"

constexpr int kSplitThreads = 256;  // kSplitMmaWarps warps
constexpr int kOutputColumns = 32;  // value columns per step of the passes that cover a whole head (u, o)

// Row stride in shared memory of a `columns`-wide tile read as split_mma's b operand: lane (g, t) reads rows
// 2t, 2t + 1 at column g, so rows 4 floats longer than a multiple of 32 land on 32 distinct banks (a stride of
// 32 would put all four t of a column on one bank).
constexpr int operand_stride(int columns) {
    return columns + 4;
}
constexpr int kOutputStride = operand_stride(kOutputColumns);

// Row stride, in bf16, of a split plane whose rows hold `depth` reduction indices: a fragment word of lane
// (g, t) is word 4 g + t of a 32-bank window (the rows are 16 bytes longer than a multiple of 128), and the
// rows stay 16-byte aligned for cp.async.
constexpr int plane_stride(int depth) {
    return depth + 8;
}

struct SplitWorkspace {
    float* norms;  // [T, Hk, 2]: the scales that L2-normalise the raw q and k rows (q's with dk^-0.5)
    bf16* w;       // [T, Hv, 2, DK]: hi plane, lo plane (SplitPlanes)
    float* u;      // [T, Hv, dv]: u, then v_new
    float* cum;    // [T, Hv]
    bf16* h;       // [chunks, Hv, 2, dv, DK]: S^T before the chunk, hi plane, lo plane
    bf16* kt;      // [chunks, Hk, 2, DK, 64]: k^T of the chunk's rows (zero past them), hi plane, lo plane
};

// The hi/lo planes of row `row`'s w for value head `head`.
template <int DK>
__forceinline__ SplitPlanes w_planes(const SplitWorkspace& ws, long long row, int value_heads, int head) {
    bf16* hi = ws.w + (row * value_heads + head) * 2 * DK;
    return {hi, hi + DK, value_heads * 2 * DK};  // stride: to the same head's next row
}

// The hi/lo planes of k^T for chunk `number` and key head `key_head`: rows of 64 bf16, one per key dim.
template <int DK>
__forceinline__ SplitPlanes kt_planes(const SplitWorkspace& ws, int number, int key_heads, int key_head) {
    bf16* hi = ws.kt + ((long long)number * key_heads + key_head) * 2 * DK * kChunk;
    return {hi, hi + DK * kChunk, kChunk};
}

// The hi/lo planes of S^T before chunk `number` for value head `head`: rows of DK bf16, one per value column.
template <int DK>
__forceinline__ SplitPlanes h_planes(const SplitWorkspace& ws, int number, int value_heads, int head, int value_dim) {
    bf16* hi = ws.h + ((long long)number * value_heads + head) * 2 * value_dim * DK;
    return {hi, hi + value_dim * DK, DK};
}

// -- chunks ---------------------------------------------------------------------------------------------

__forceinline__ int first_extra_cut(int length, int num_targets) {
    return max(1, length - num_targets + 1);
}

__forceinline__ int chunk_count(int length, int num_targets) {
    int extra = 0;
    for (int n = first_extra_cut(length, num_targets); n < length; ++n) extra += n % kChunk != 0;
    return 1 + (length - 1) / kChunk + extra;
}

// The row count where chunk c starts (c = chunk_count: the length): the extra cut whose place among the sorted
// cuts is c, else the multiple of 64 left after the extra cuts placed before c.
__forceinline__ int chunk_point(int length, int num_targets, int c) {
    if (c == 0) return 0;
    int before = 0, rank = 0;
    for (int n = first_extra_cut(length, num_targets); n < length; ++n) {
        if (n % kChunk == 0) continue;
        const int place = 1 + (n - 1) / kChunk + rank++;
        if (place == c) return n;
        before += place < c;
    }
    return min(length, kChunk * (c - before));
}

// The number of sequence `seq`'s first chunk: the chunks of the chunked sequences before it.
__forceinline__ int chunk_base(const int* query_start, int seq, int num_targets) {
    int base = 0;
    for (int b = 0; b < seq; ++b) {
        const int length = query_start[b + 1] - query_start[b];
        if (length > kRecurrentMaxRows) base += chunk_count(length, num_targets);
    }
    return base;
}

struct SplitChunk {
    long long first;  // flat row
    int rows;         // 0: no such chunk
    int number;
};

// Chunk c of sequence seq, for the per-chunk passes.
__forceinline__ SplitChunk find_chunk(const DeltaRuleArgs& p, int seq, int c) {
    const SequenceRows rows = sequence_rows(p.query_start, seq);
    const int targets = p.states.num_targets;
    if (rows.length <= kRecurrentMaxRows || c >= chunk_count(rows.length, targets)) return {0, 0, 0};
    const int start = chunk_point(rows.length, targets, c);
    return {rows.first + start, chunk_point(rows.length, targets, c + 1) - start, chunk_base(p.query_start, seq, targets) + c};
}

// A ROWS x COLUMNS block of f32 rows `src_stride` apart, rows >= `rows` zero, staged through registers: every
// thread issues all its 16-byte loads before it stores any.
template <int ROWS, int COLUMNS>
struct Block {
    static constexpr int kQuads = ROWS * COLUMNS / 4, kPerThread = (kQuads + kSplitThreads - 1) / kSplitThreads;
    float4 values[kPerThread];

    __forceinline__ void fetch(const float* src, long long src_stride, int rows) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int quad = threadIdx.x + i * kSplitThreads, r = quad / (COLUMNS / 4), c = 4 * (quad % (COLUMNS / 4));
            values[i] = quad < kQuads && r < rows ? *reinterpret_cast<const float4*>(src + r * src_stride + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }

    // into tile[r * stride + c]
    __forceinline__ void put(float* tile, int stride) const {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int quad = threadIdx.x + i * kSplitThreads, r = quad / (COLUMNS / 4), c = 4 * (quad % (COLUMNS / 4));
            if (quad >= kQuads) continue;
            float* dst = tile + r * stride + c;
            dst[0] = values[i].x;
            dst[1] = values[i].y;
            dst[2] = values[i].z;
            dst[3] = values[i].w;
        }
    }
};

__forceinline__ float* row_at(float* base, long long row, int heads, int head, int width) {
    return base + (row * heads + head) * width;
}

// `rows` of the chunk's DK conv channels from `column` (bf16; zeros past the chunk's rows) into tile[r * stride + c]
// by cp.async; the caller commits.
template <int DK>
__forceinline__ void copy_conv_rows(bf16* tile, int stride, const DeltaRuleArgs& p, const SplitChunk& chunk, int column) {
    constexpr int kRowQuads = DK / 8, kQuads = kChunk * kRowQuads;
    static_assert(kQuads % kSplitThreads == 0, "whole rounds of 16-byte copies");
    const long long channels = p.conv_channels(DK);
#pragma unroll
    for (int i = 0; i < kQuads / kSplitThreads; ++i) {
        const int quad = threadIdx.x + i * kSplitThreads, r = quad / kRowQuads, c = 8 * (quad % kRowQuads);
        const bool valid = r < chunk.rows;
        cp_async16(tile + r * stride + c, valid ? p.conv + (chunk.first + r) * channels + column + c : p.conv, valid);
    }
}

// body(plane, row, column) for each of this thread's 16-byte pieces of two planes of ROWS rows of ROW_BYTES
// (column in bf16 elements).
template <int ROWS, int ROW_BYTES, typename Body>
__forceinline__ void each_plane_piece(Body body) {
    constexpr int kRowPieces = ROW_BYTES / 16, kPieces = 2 * ROWS * kRowPieces;
    static_assert(kPieces % kSplitThreads == 0, "whole rounds of 16-byte pieces");
#pragma unroll
    for (int i = 0; i < kPieces / kSplitThreads; ++i) {
        const int piece = threadIdx.x + i * kSplitThreads;
        body(piece / (ROWS * kRowPieces), piece / kRowPieces % ROWS, 8 * (piece % kRowPieces));
    }
}

// `rows` rows of both planes, ROW_BYTES each, from `src` (planes `src_plane` bf16 apart, rows `src_stride`
// apart) into `dst` by cp.async, zeros past `rows`; the caller commits.
template <int ROWS, int ROW_BYTES>
__forceinline__ void copy_planes_async(const SplitPlanes& dst, const bf16* src, long long src_stride, long long src_plane, int rows) {
    each_plane_piece<ROWS, ROW_BYTES>([&](int plane, int r, int c) {
        bf16* to = (plane == 0 ? dst.hi : dst.lo) + r * dst.stride + c;
        cp_async16(to, r < rows ? src + plane * src_plane + r * src_stride + c : src, r < rows);
    });
}
