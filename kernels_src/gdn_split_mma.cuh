// Split-bf16 tensor-core products for the chunked gated delta rule (gdn_delta_rule.cu): f32 operands in
// shared memory, each rounded to a bf16 pair x = hi + lo at fragment load, and A B accumulated in f32 by
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
// Operands used more than once are split once instead, into a pair of bf16 planes (SplitPlanes): the product
// then loads each fragment register with one 32-bit shared load (planes_mma), with the same three terms.
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

// acc = sum over l in [0, depth) of a(row, l) * b(l, column) over the warp's tile; depth a multiple of 16.
// a(m, l) and b(l, n) read f32 operands (shared memory).
template <int NT, typename A, typename B>
__forceinline__ void split_mma(float (&acc)[NT][4], int m0, int n0, int depth, A a, B b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[nt][r] = 0.0f;
    const int r0 = m0 + g, r1 = r0 + 8;
    for (int k0 = 0; k0 < depth; k0 += 16) {
        const int c0 = k0 + 2 * t, c1 = c0 + 8;
        const SplitPair a0 = split_bf16x2(a(r0, c0), a(r0, c0 + 1)), a1 = split_bf16x2(a(r1, c0), a(r1, c0 + 1));
        const SplitPair a2 = split_bf16x2(a(r0, c1), a(r0, c1 + 1)), a3 = split_bf16x2(a(r1, c1), a(r1, c1 + 1));
        const unsigned hi[4] = {a0.hi, a1.hi, a2.hi, a3.hi}, lo[4] = {a0.lo, a1.lo, a2.lo, a3.lo};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int n = n0 + 8 * nt + g;
            const SplitPair b0 = split_bf16x2(b(c0, n), b(c0 + 1, n)), b1 = split_bf16x2(b(c1, n), b(c1 + 1, n));
            mma_bf16(acc[nt], lo, b0.hi, b1.hi);  // the small terms first
            mma_bf16(acc[nt], hi, b0.lo, b1.lo);
            mma_bf16(acc[nt], hi, b0.hi, b1.hi);
        }
    }
}

// An operand split into bf16 planes hi and lo (x = hi + lo to 2^-16), rows `stride` bf16 apart, each row holding
// the operand's reduction index contiguously: A [M][depth] row-major, B [N][depth] (B transposed).
struct SplitPlanes {
    bf16* hi;
    bf16* lo;
    int stride;

    // the plane words holding (row, l) and (row, l + 1), l even
    __forceinline__ unsigned hi_word(int row, int l) const {
        return *reinterpret_cast<const unsigned*>(hi + row * stride + l);
    }
    __forceinline__ unsigned lo_word(int row, int l) const {
        return *reinterpret_cast<const unsigned*>(lo + row * stride + l);
    }
    __forceinline__ void put(int row, int l, float x) const {
        const float rounded = __bfloat162float(hi[row * stride + l] = __float2bfloat16_rn(x));
        lo[row * stride + l] = __float2bfloat16_rn(x - rounded);
    }
};

// acc += sum over l in [0, depth) of a(row, l) * b(l, column) over the warp's tile, a and b split into planes
// (b's rows are its columns); depth a multiple of 16. The terms in split_mma's order.
template <int NT>
__forceinline__ void planes_mma(float (&acc)[NT][4], int m0, int n0, int depth, const SplitPlanes& a, const SplitPlanes& b) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int r0 = m0 + g, r1 = r0 + 8;
    for (int k0 = 0; k0 < depth; k0 += 16) {
        const int c0 = k0 + 2 * t, c1 = c0 + 8;
        const unsigned hi[4] = {a.hi_word(r0, c0), a.hi_word(r1, c0), a.hi_word(r0, c1), a.hi_word(r1, c1)};
        const unsigned lo[4] = {a.lo_word(r0, c0), a.lo_word(r1, c0), a.lo_word(r0, c1), a.lo_word(r1, c1)};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int n = n0 + 8 * nt + g;
            mma_bf16(acc[nt], lo, b.hi_word(n, c0), b.hi_word(n, c1));
            mma_bf16(acc[nt], hi, b.lo_word(n, c0), b.lo_word(n, c1));
            mma_bf16(acc[nt], hi, b.hi_word(n, c0), b.hi_word(n, c1));
        }
    }
}
