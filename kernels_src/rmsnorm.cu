// RMSNorm over rows, optionally fused with the residual add that precedes it in a decoder layer.
//
//   rmsnorm_bf16:          out[r] = w * (x[r] * rsqrt(mean(x[r]^2) + eps))
//   rmsnorm_residual_bf16: residual[r] = x[r] + residual[r]   (in place, rounded to bf16 as stored)
//                          out[r] = w * (residual[r] * rsqrt(mean(residual[r]^2) + eps))
//
// Layout: x, residual, out are bf16 [rows, hidden] row-major; w is bf16 [hidden], or f32 in the *_f32w
// variants (the hybrid's zero-centred norms: the executor forms 1 + w in f32, which bf16 gains would round).
// Math in f32; the normalised row is rounded to bf16 once, on store.
// Launch: grid (rows), block (T) with T a multiple of 32, <= 1024; one block per row, no dynamic smem.
// Rows are read with 16-byte vectors when hidden % 8 == 0 and every pointer is 16-byte aligned, element
// by element otherwise (any hidden size, odd included). Each element is read and written by the same
// thread, so out may alias x.
#include "common.cuh"

// Eight gains from 16-byte aligned memory (bf16: one vector load; f32: two).
__forceinline__ void load_gains8(const bf16* w, float (&out)[8]) {
    load_bf16x8(w, out);
}

__forceinline__ void load_gains8(const float* w, float (&out)[8]) {
    const float4 lo = reinterpret_cast<const float4*>(w)[0];
    const float4 hi = reinterpret_cast<const float4*>(w)[1];
    out[0] = lo.x, out[1] = lo.y, out[2] = lo.z, out[3] = lo.w;
    out[4] = hi.x, out[5] = hi.y, out[6] = hi.z, out[7] = hi.w;
}

__forceinline__ float gain_at(const bf16* w, int i) {
    return __bfloat162float(w[i]);
}

__forceinline__ float gain_at(const float* w, int i) {
    return w[i];
}

// Pass 1 for one 16-byte vector: v = x (+ residual, rounded to bf16 and stored back, exactly as an unfused
// "add, then norm" would see it), and its squares added to `sum_squares` in order.
template <bool kResidual>
__forceinline__ void load_summed_vector(float (&v)[8], float& sum_squares, const bf16* x, bf16* residual) {
    load_bf16x8(x, v);
    if (kResidual) {
        float r[8];
        load_bf16x8(residual, r);
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(__float2bfloat16(v[j] + r[j]));
        store_bf16x8(residual, v);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) sum_squares += v[j] * v[j];
}

// The decode case (hidden <= 8 * blockDim, e.g. 4096 over 512 threads): each thread owns one 16-byte
// vector and keeps it in registers between the two passes (no second read of the row), and loads its
// gains before waiting for the previous kernel (they are weights). A one-block kernel sits on the
// critical path of every decode step twice per layer, so its latency is what matters. Same math and
// summation order as the general path below: bit-identical results.
template <bool kResidual, typename Gain>
__forceinline__ void one_vector_per_thread(bf16* out_row, bf16* res_row, const bf16* x_row, const Gain* w, int hidden,
                                           float eps) {
    const int i = threadIdx.x * 8;
    const bool mine = i < hidden;
    float g[8], v[8];
    if (mine) load_gains8(w + i, g);
    enter_dependent_kernel();
    float sum_squares = 0.0f;
    if (mine) load_summed_vector<kResidual>(v, sum_squares, x_row + i, kResidual ? res_row + i : nullptr);
    const float inv_rms = rsqrtf(block_sum(sum_squares) / hidden + eps);
    if (!mine) return;
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = g[j] * (v[j] * inv_rms);
    store_bf16x8(out_row + i, v);
}

template <bool kResidual, typename Gain>
__forceinline__ void rmsnorm_row(bf16* out, bf16* residual, const bf16* x, const Gain* w, int hidden, float eps) {
    const long long row_offset = (long long)blockIdx.x * hidden;
    const bf16* x_row = x + row_offset;
    bf16* out_row = out + row_offset;
    bf16* res_row = kResidual ? residual + row_offset : nullptr;
    const bool vectorised = hidden % 8 == 0 && aligned16(x_row) && aligned16(out_row) && aligned16(w) &&
                            (!kResidual || aligned16(res_row));
    if (vectorised && hidden <= 8 * (int)blockDim.x) {
        one_vector_per_thread<kResidual, Gain>(out_row, res_row, x_row, w, hidden, eps);
        return;
    }
    enter_dependent_kernel();

    // Pass 1: (fused add and) sum of squares. The sum is stored as bf16 and the rounded value is what gets
    // normalised, exactly as an unfused "add, then norm" would see it.
    float sum_squares = 0.0f;
    if (vectorised) {
        for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
            float v[8];
            load_summed_vector<kResidual>(v, sum_squares, x_row + i, kResidual ? res_row + i : nullptr);
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            float v = __bfloat162float(x_row[i]);
            if (kResidual) {
                const bf16 sum = __float2bfloat16(v + __bfloat162float(res_row[i]));
                res_row[i] = sum;
                v = __bfloat162float(sum);
            }
            sum_squares += v * v;
        }
    }
    const float inv_rms = rsqrtf(block_sum(sum_squares) / hidden + eps);

    // Pass 2: re-read the (summed) row, which this thread itself wrote or read, and normalise.
    const bf16* src = kResidual ? res_row : x_row;
    if (vectorised) {
        for (int i = threadIdx.x * 8; i < hidden; i += blockDim.x * 8) {
            float v[8], g[8];
            load_bf16x8(src + i, v);
            load_gains8(w + i, g);
#pragma unroll
            for (int j = 0; j < 8; ++j) v[j] = g[j] * (v[j] * inv_rms);
            store_bf16x8(out_row + i, v);
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            out_row[i] = __float2bfloat16(gain_at(w, i) * (__bfloat162float(src[i]) * inv_rms));
        }
    }
}

extern "C" __global__ void rmsnorm_bf16(bf16* out, const bf16* x, const bf16* w, int hidden, float eps) {
    rmsnorm_row<false>(out, nullptr, x, w, hidden, eps);
}

extern "C" __global__ void rmsnorm_residual_bf16(bf16* out, bf16* residual, const bf16* x, const bf16* w, int hidden,
                                                 float eps) {
    rmsnorm_row<true>(out, residual, x, w, hidden, eps);
}

extern "C" __global__ void rmsnorm_bf16_f32w(bf16* out, const bf16* x, const float* w, int hidden, float eps) {
    rmsnorm_row<false>(out, nullptr, x, w, hidden, eps);
}

extern "C" __global__ void rmsnorm_residual_bf16_f32w(bf16* out, bf16* residual, const bf16* x, const float* w,
                                                      int hidden, float eps) {
    rmsnorm_row<true>(out, residual, x, w, hidden, eps);
}
