// Decode GEMV: y[b, n] = sum_k x[b, k] * W[n, k] for a few rows b (1..8: decode and spec-verify widths).
//
// Layout: W is bf16 [N_w, K] row-major ([out, in] as checkpoints store it); x is bf16 [B, K]; y is
// [B, N] row-major (bf16, or f32 for logits). K % 8 == 0 and every pointer 16-byte aligned (checked on the
// host). Math in f32, each output rounded once on store.
// Epilogues (one kernel each per row bucket B in {1, 2, 4, 8}: gemv_<epilogue>_b<B>, for rows <= B):
//   gemv_bf16_b*:          y = x @ W^T                                   (N_w = N)
//   gemv_f32_b*:           same, f32 output (lm_head logits)             (N_w = N)
//   gemv_residual_bf16_b*: y = bf16(x @ W^T) + residual, rounded again   (N_w = N; y may alias residual)
//   gemv_swiglu_bf16_b*:   y[b, i] = silu(g) * u with g = bf16((x @ W^T)[b, i]), u = bf16((x @ W^T)[b, N + i])
//                          for the fused gate_up matrix (N_w = 2N): bit-identical to gemv_bf16 followed by
//                          activation.cu's silu_mul_bf16, one pass and one launch fewer.
// rows (1..B) is a kernel argument: a bucket serves every width up to B at the cost of B.
// Launch: block (128) = 4 warps, grid (ceil(groups / 4)); no shared memory. A warp owns a group of two
// weight rows (n, n+1, or i and N+i for SwiGLU) and walks K with 16-byte loads, lane-interleaved so each
// warp load is 512 contiguous bytes; unroll(B) * 2 loads are in flight per lane. Decode is memory bound:
// W streams through with L1::no_allocate so it does not evict x, which every warp of the SM re-reads.
// Partial sums are reduced with warp shuffles; there is no cross-warp communication. Each warp's first
// batch of weight loads is issued before grid_dependency_wait (see common.cuh).
#include "gemv_common.cuh"

constexpr int kRowsPerWarp = 2;
// 16-byte weight loads in flight per lane and row: 8 KiB per warp at 1-2 rows, where registers are free;
// 4 at 4-8 rows, whose accumulators and x need them.
template <int B>
constexpr int kUnroll = B <= 2 ? 8 : 4;
constexpr int kWarpsPerBlock = 4;

// load_streaming, but volatile: ptxas keeps the issue order, so a step's loads all leave before its math
// (the plain form let it sink loads to their uses: 8 in flight whatever the unroll).
__forceinline__ uint4 load_streaming_in_order(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__forceinline__ void dot8(float& acc, const uint4 w, const float (&x)[8]) {
    float wf[8];
    unpack8(w, wf);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc = fmaf(wf[i], x[i], acc);
}

template <int kU>
__forceinline__ void load_batch(uint4 (&wv)[kU][kRowsPerWarp], const uint4* const (&w_row)[kRowsPerWarp], int c) {
#pragma unroll
    for (int u = 0; u < kU; ++u)
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) wv[u][j] = load_streaming_in_order(w_row[j] + c + 32 * u);
}

// Rows b >= `rows` of a bucket re-read row rows-1 (an L1 hit) and are never stored.
template <int B>
__forceinline__ void accumulate(float (&acc)[kRowsPerWarp][B], const uint4 (&w)[kRowsPerWarp], const uint4* x,
                                int rows, int kc, int chunk) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
        float xf[8];
        unpack8(__ldg(x + (long long)min(b, rows - 1) * kc + chunk), xf);
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) dot8(acc[j][b], w[j], xf);
    }
}

template <int B, int EPI, typename OutT>
__forceinline__ void gemv(OutT* y, const bf16* x, const bf16* w, const bf16* residual, int rows, int n, int k) {
    const int lane = threadIdx.x & 31;
    const long long group = (long long)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    const long long w_rows = EPI == kSwiglu ? 2ll * n : n;
    const long long groups = EPI == kSwiglu ? n : (n + kRowsPerWarp - 1) / kRowsPerWarp;
    if (group >= groups) {
        enter_dependent_kernel();
        return;
    }
    const int kc = k >> 3;  // 16-byte chunks per row

    long long w_index[kRowsPerWarp];
    const uint4* w_row[kRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
        w_index[j] = EPI == kSwiglu ? group + j * (long long)n : group * kRowsPerWarp + j;
        // A missing last row (odd N) loads row N-1 again and is never stored: no branch in the hot loop.
        w_row[j] = reinterpret_cast<const uint4*>(w) + min(w_index[j], w_rows - 1) * kc;
    }
    const uint4* x4 = reinterpret_cast<const uint4*>(x);

    float acc[kRowsPerWarp][B];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[j][b] = 0.0f;

    int c = lane;
    constexpr int kU = kUnroll<B>;
    // The first batch of weight loads leaves before the wait for the previous kernel (weights are
    // immutable): with programmatic dependent launch it overlaps that kernel's tail. x, y and residual
    // are touched only after the wait.
    uint4 wv[kU][kRowsPerWarp];  // all loads of a batch issued before any math: kU * 2 in flight
    bool full = c + 32 * (kU - 1) < kc;
    if (full) load_batch<kU>(wv, w_row, c);
    enter_dependent_kernel();
    while (full) {
#pragma unroll
        for (int u = 0; u < kU; ++u) accumulate<B>(acc, wv[u], x4, rows, kc, c + 32 * u);
        c += 32 * kU;
        full = c + 32 * (kU - 1) < kc;
        if (full) load_batch<kU>(wv, w_row, c);
    }
    for (; c < kc; c += 32) {
        uint4 tail[kRowsPerWarp];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) tail[j] = load_streaming(w_row[j] + c);
        accumulate<B>(acc, tail, x4, rows, kc, c);
    }

    warp_sum(acc);
    if (lane != 0) return;

#pragma unroll
    for (int b = 0; b < B; ++b) {
        if (b >= rows) break;
        const long long out_row = (long long)b * n;
        if (EPI == kSwiglu) {
            store(y, out_row + group, silu(round_bf16(acc[0][b])) * round_bf16(acc[1][b]));
            continue;
        }
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) {
            if (w_index[j] >= n) continue;
            const long long i = out_row + w_index[j];
            float v = acc[j][b];
            if (EPI == kResidual) v = round_bf16(v) + __bfloat162float(residual[i]);
            store(y, i, v);
        }
    }
}

#define GEMV_KERNEL(NAME, B, EPI, OUT)                                                                 \
    extern "C" __global__ void NAME##_b##B(OUT* y, const bf16* x, const bf16* w, const bf16* residual,     \
                                           int rows, int n, int k) {                                     \
        gemv<B, EPI>(y, x, w, residual, rows, n, k);                                                     \
    }
#define GEMV_KERNELS(B)                              \
    GEMV_KERNEL(gemv_bf16, B, kStore, bf16)          \
    GEMV_KERNEL(gemv_f32, B, kStore, float)          \
    GEMV_KERNEL(gemv_residual_bf16, B, kResidual, bf16) \
    GEMV_KERNEL(gemv_swiglu_bf16, B, kSwiglu, bf16)

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(4)
GEMV_KERNELS(8)
