// The delta-rule kernels' shared part (gdn_delta_rule.cu, gdn_chunked_split.cu): the launch parameters and
// their prologue (beta and the decay of a row), the chunk length, and the chunk math every chunked form
// does alike (the prefix sum of the log-decays, the unit lower triangular inverse).
#pragma once
#include "gdn_common.cuh"

constexpr int kRecurrentMaxRows = 8;  // numpy_delta_rule.RECURRENT_MAX_ROWS
constexpr int kChunk = 64;

// The scales that L2-normalise one row's q (also by dk^-0.5) and k.
struct RowScales {
    float q, k;
};

// q and k of one row, lane l holding dims l + 32 e: their RowScales. Called by a whole warp.
template <int DK>
__forceinline__ RowScales l2_scales(const float (&q)[DK / 32], const float (&k)[DK / 32]) {
    float qq = 0.0f, kk = 0.0f;
#pragma unroll
    for (int e = 0; e < DK / 32; ++e) {
        qq += q[e] * q[e];
        kk += k[e] * k[e];
    }
    return {rsqrtf(warp_sum(qq) + kL2NormEps) * rsqrtf((float)DK), rsqrtf(warp_sum(kk) + kL2NormEps)};
}

// ... and the row normalised in place.
template <int DK>
__forceinline__ void l2_normalise_qk(float (&q)[DK / 32], float (&k)[DK / 32]) {
    const RowScales scales = l2_scales<DK>(q, k);
#pragma unroll
    for (int e = 0; e < DK / 32; ++e) {
        q[e] *= scales.q;
        k[e] *= scales.k;
    }
}

struct DeltaRuleArgs {
    float* out;
    const bf16* conv;
    const bf16* x;
    int x_stride;
    int gate_column;
    const float* a_log;
    const float* dt_bias;
    StateSlots states;
    const int* query_start;
    int key_heads;
    int value_heads;
    int value_dim;

    __forceinline__ int conv_channels(int dk) const { return 2 * key_heads * dk + value_heads * value_dim; }
    // Row `row`'s q and k of `key_head` L2-normalised (l2_normalise_qk), lane l holding dims l + 32 e; zeros
    // where !valid. Called by a whole warp.
    template <int DK>
    __forceinline__ void normalised_row(float (&q)[DK / 32], float (&k)[DK / 32], long long row, int key_head, bool valid) const {
        const int lane = threadIdx.x & 31;
        const bf16* qk = conv + row * conv_channels(DK) + key_head * DK;
#pragma unroll
        for (int e = 0; e < DK / 32; ++e) {
            q[e] = valid ? __bfloat162float(qk[lane + 32 * e]) : 0.0f;
            k[e] = valid ? __bfloat162float(qk[key_heads * DK + lane + 32 * e]) : 0.0f;
        }
        l2_normalise_qk<DK>(q, k);
    }
    // beta and the decay e^g of (row, head).
    __forceinline__ void gating(long long row, int head, float decay_rate, float bias, float& beta, float& g) const {
        const bf16* gates = x + row * x_stride + gate_column;
        beta = gdn_sigmoid(__bfloat162float(gates[head]));
        g = -decay_rate * gdn_softplus(__bfloat162float(gates[value_heads + head]) + bias);
    }
};

// Inclusive prefix sum of cum[0..63] by warp 0 (two rows per lane).
__forceinline__ void prefix_sum_64(float* cum) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    const float a = cum[2 * lane], b = cum[2 * lane + 1];
    float inclusive = a + b;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const float up = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += up;
    }
    const float before = inclusive - (a + b);
    cum[2 * lane] = before + a;
    cum[2 * lane + 1] = inclusive;
}

// t = (I + a)^-1 for strictly lower triangular a [64][64] by doubling the inverted diagonal blocks:
// inv([[X, 0], [C, Y]]) = [[X^-1, 0], [-Y^-1 C X^-1, Y^-1]]. t starts as the identity. The lower-left
// blocks of a are consumed (they are never read again: later levels read blocks below the merged ones).
__forceinline__ void invert_unit_lower(float* a, float* t) {
    for (int size = 1; size < kChunk; size <<= 1) {
        const int items = (kChunk / (2 * size)) * size * size;
        for (int phase = 0; phase < 3; ++phase) {
            for (int idx = threadIdx.x; idx < items; idx += blockDim.x) {
                const int pair = idx / (size * size), i = (idx / size) % size, j = idx % size;
                const int c0 = pair * 2 * size, r0 = c0 + size;
                float* out = &t[(r0 + i) * kChunk + c0 + j];
                if (phase == 0) {  // C X^-1 into t's lower-left block (zero until now)
                    float acc = 0.0f;
                    for (int l = j; l < size; ++l) acc += a[(r0 + i) * kChunk + c0 + l] * t[(c0 + l) * kChunk + c0 + j];
                    *out = acc;
                } else if (phase == 1) {  // -Y^-1 (C X^-1) into a's consumed block
                    float acc = 0.0f;
                    for (int l = 0; l <= i; ++l) acc += t[(r0 + i) * kChunk + r0 + l] * t[(r0 + l) * kChunk + c0 + j];
                    a[(r0 + i) * kChunk + c0 + j] = -acc;
                } else {
                    *out = a[(r0 + i) * kChunk + c0 + j];
                }
            }
            __syncthreads();
        }
    }
}

// A state tile [DK][CV] (shared memory) into the columns it covers of a state [DK][value_dim].
template <int DK, int CV>
__forceinline__ void store_tile(const float* tile, float* dst, int value_dim) {
    for (int idx = threadIdx.x; idx < DK * CV; idx += blockDim.x) dst[(long long)(idx / CV) * value_dim + idx % CV] = tile[idx];
}

// ... and back: the columns of a state [DK][value_dim] into a tile.
template <int DK, int CV>
__forceinline__ void load_tile(float* tile, const float* src, int value_dim) {
    for (int idx = threadIdx.x; idx < DK * CV; idx += blockDim.x) tile[idx] = src[(long long)(idx / CV) * value_dim + idx % CV];
}

#define DELTA_RULE_PARAMS                                                                                      \
    float *out, const bf16 *conv, const bf16 *x, int x_stride, int gate_column, const float *a_log,            \
        const float *dt_bias, unsigned char *state_layer, long long slot_bytes, int conv_bytes,                 \
        const int *state_slots, const int *state_targets, int num_targets, const int *query_start,             \
        int key_heads, int value_heads, int value_dim
#define DELTA_RULE_ARGS                                                                                        \
    DeltaRuleArgs {                                                                                            \
        out, conv, x, x_stride, gate_column, a_log, dt_bias,                                                   \
            StateSlots{state_layer, slot_bytes, conv_bytes, state_slots, state_targets, num_targets},          \
            query_start, key_heads, value_heads, value_dim                                                     \
    }

