// Split-bf16 tensor-core products for the chunked gated delta rule (gdn_delta_rule.cu, gdn_chunked_split.cu):
// f32 operands in shared memory, each rounded to a bf16 pair x = hi + lo, and A B accumulated in f32 by
// mma.sync.m16n8k16 as hi*hi + hi*lo + lo*hi (every arch from sm_80; no wgmma).
//
// Error: |x - hi| <= 2^-8 |x| and |x - hi - lo| <= 2^-16 |x| (bf16 keeps 8 significant bits), so a term's
// relative error is at most 2^-16 (lo's rounding, in either factor) + 2^-16 (the dropped lo*lo) ~ 3e-5 in the
// worst case and ~1e-5 typical: near f32 products, far tighter than plain bf16 (2^-8). The f32 accumulation
// is the tensor core's.
//
// Warp tiles: 8 warps (256 threads) cover an M x N product (M = 64 or 128, N a multiple of 8 per column
// warp): M / 16 row tiles of 16, the rest of the warps across columns; a warp owns rows [m0, m0 + 16) and
// NT column tiles of 8 from n0. An accumulator element (tile nt, register r) is row m0 + g + 8 (r / 2) and
// column n0 + 8 nt + 2 t + r % 2, g = lane / 4, t = lane % 4 (the mma C layout).
//
// fragment_mma takes its operands from sources: f32 split at every load (split_mma's), a pair of bf16 planes
// split once for an operand used more than once (SplitPlanes: one 32-bit shared load a fragment word), or
// exact bf16 values (ExactRows, ExactColumns), whose lo part is zero and whose terms with it are skipped.
#pragma once
#include "common.cuh"

constexpr int kSplitMmaWarps = 8;

template <int M, int N>
struct WarpTile {
    static constexpr int kRowTiles = M / 16;
    static constexpr int kColumnWarps = kSplitMmaWarps / kRowTiles;
    static constexpr int NT = N / 8 / kColumnWarps;
    static_assert(kRowTiles * kColumnWarps == kSplitMmaWarps && NT * 8 * kColumnWarps == N, "warp tiling");
    int m0, n0;

    __device__ explicit WarpTile(int warp) : m0(16 * (warp / kColumnWarps)), n0(8 * NT * (warp % kColumnWarps)) {}

    // body(row, column, value) for every accumulator element of this thread
    template <typename Body>
    __forceinline__ void each(const float (&acc)[NT][4], Body body) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) body(m0 + g + 8 * (r >> 1), n0 + 8 * nt + 2 * t + (r & 1), acc[nt][r]);
    }

    // body(row, column, acc at (row, column), acc at (row, column + 1)) for every pair of this thread's
    // accumulator elements (the references are const where acc is)
    template <typename Acc, typename Body>
    __forceinline__ void each_pair(Acc& acc, Body body) const {
        const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int half = 0; half < 2; ++half) body(m0 + g + 8 * half, n0 + 8 * nt + 2 * t, acc[nt][2 * half], acc[nt][2 * half + 1]);
    }

    // acc *= factor(row), row by row
    template <typename Factor>
    __forceinline__ void scale_rows(float (&acc)[NT][4], Factor factor) const {
        const int g = (threadIdx.x & 31) >> 2;
        const float upper = factor(m0 + g), lower = factor(m0 + g + 8);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            acc[nt][0] *= upper;
            acc[nt][1] *= upper;
            acc[nt][2] *= lower;
            acc[nt][3] *= lower;
        }
    }
};

struct SplitPair {
    unsigned hi, lo;
};

// (a, b) -> bf16x2 words hi and lo with a at the lower half, a = hi.x + lo.x (to 2^-16), b likewise.
__forceinline__ SplitPair split_bf16x2(float a, float b) {
    const __nv_bfloat162 hi = __floats2bfloat162_rn(a, b);
    const float2 back = __bfloat1622float2(hi);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(a - back.x, b - back.y);
    return {*reinterpret_cast<const unsigned*>(&hi), *reinterpret_cast<const unsigned*>(&lo)};
}

__forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Operand sources of fragment_mma. `pair(row, l)` gives the fragment words of elements (row, l) and
// (row, l + 1), l even, where `row` is A's row or B's column and l the reduction index: hi and, for a split
// source (kSplit), lo with x = hi + lo to 2^-16. An exact source (bf16 values, kSplit false) has lo = 0 and
// its terms with lo are skipped: an exact operand against a split one costs two products, two exact ones one.

// f32 values read through `at(row, l)` (A) or `at(l, column)` (B), split at every load.
template <typename At, bool kColumns>
struct F32Operand {
    static constexpr bool kSplit = true;
    At at;

    __forceinline__ SplitPair pair(int row, int l) const {
        return kColumns ? split_bf16x2(at(l, row), at(l + 1, row)) : split_bf16x2(at(row, l), at(row, l + 1));
    }
};

template <typename At>
__forceinline__ F32Operand<At, false> f32_rows(At at) {
    return {at};
}

template <typename At>
__forceinline__ F32Operand<At, true> f32_columns(At at) {
    return {at};
}

// An operand split once into bf16 planes hi and lo, rows `stride` bf16 apart, each row holding the reduction
// index contiguously: A [M][depth] row-major, B [N][depth] (B transposed). One 32-bit load a word.
struct SplitPlanes {
    static constexpr bool kSplit = true;
    bf16* hi;
    bf16* lo;
    int stride;

    __forceinline__ SplitPair pair(int row, int l) const {
        return {*reinterpret_cast<const unsigned*>(hi + row * stride + l), *reinterpret_cast<const unsigned*>(lo + row * stride + l)};
    }
    __forceinline__ void put(int row, int l, float x) const {
        const float rounded = __bfloat162float(hi[row * stride + l] = __float2bfloat16_rn(x));
        lo[row * stride + l] = __float2bfloat16_rn(x - rounded);
    }
    // (row, l) and (row, l + 1), l even, in one word of each plane
    __forceinline__ void put_pair(int row, int l, float x0, float x1) const {
        const SplitPair words = split_bf16x2(x0, x1);
        *reinterpret_cast<unsigned*>(hi + row * stride + l) = words.hi;
        *reinterpret_cast<unsigned*>(lo + row * stride + l) = words.lo;
    }
};

// bf16 values (exact), rows holding the reduction index: A [M][depth], or B transposed [N][depth].
struct ExactRows {
    static constexpr bool kSplit = false;
    const bf16* data;
    int stride;

    __forceinline__ SplitPair pair(int row, int l) const {
        return {*reinterpret_cast<const unsigned*>(data + row * stride + l), 0u};
    }
};

// bf16 values (exact) of B stored as it is, [depth][N]: the two elements of a word come from two rows.
struct ExactColumns {
    static constexpr bool kSplit = false;
    const bf16* data;
    int stride;

    __forceinline__ SplitPair pair(int column, int l) const {
        const unsigned short* at = reinterpret_cast<const unsigned short*>(data) + l * stride + column;
        return {static_cast<unsigned>(at[0]) | static_cast<unsigned>(at[stride]) << 16, 0u};
    }
};

// acc += sum over l in [0, depth) of a(row, l) * b(l, column) over the warp's tile; depth a multiple of 16.
// The small terms first: lo(a) hi(b), hi(a) lo(b), then hi(a) hi(b) (the dropped lo(a) lo(b) is ~2^-16).
template <int NT, typename A, typename B>
__forceinline__ void fragment_mma(float (&acc)[NT][4], int m0, int n0, int depth, const A& a, const B& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = m0 + g, r1 = r0 + 8;
    for (int k0 = 0; k0 < depth; k0 += 16) {
        const int c0 = k0 + 2 * t, c1 = c0 + 8;
        const SplitPair a0 = a.pair(r0, c0), a1 = a.pair(r1, c0), a2 = a.pair(r0, c1), a3 = a.pair(r1, c1);
        const unsigned hi[4] = {a0.hi, a1.hi, a2.hi, a3.hi}, lo[4] = {a0.lo, a1.lo, a2.lo, a3.lo};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int n = n0 + 8 * nt + g;
            const SplitPair b0 = b.pair(n, c0), b1 = b.pair(n, c1);
            if constexpr (A::kSplit) mma_bf16(acc[nt], lo, b0.hi, b1.hi);
            if constexpr (B::kSplit) mma_bf16(acc[nt], hi, b0.lo, b1.lo);
            mma_bf16(acc[nt], hi, b0.hi, b1.hi);
        }
    }
}

// acc = sum over l in [0, depth) of a(row, l) * b(l, column) over the warp's tile; depth a multiple of 16.
// a(m, l) and b(l, n) read f32 operands (shared memory), split at every load.
template <int NT, typename A, typename B>
__forceinline__ void split_mma(float (&acc)[NT][4], int m0, int n0, int depth, A a, B b) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    fragment_mma(acc, m0, n0, depth, f32_rows(a), f32_columns(b));
}
