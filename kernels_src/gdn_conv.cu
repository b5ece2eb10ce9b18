// Gated DeltaNet: causal depthwise conv1d (kernel K = 4, no bias) + SiLU over the [q | k | v] channels of
// the fused input projection, each sequence continuing from the conv window in its state slot.
//
//   hist_b = [window_b (K-1 rows, oldest first) ; x rows of sequence b]            (pre-conv values)
//   out[t, c] = silu(sum_j w[c, j] * hist_b[t_b + j, c])    t_b = row index of t within sequence b
//   window after n rows of b = hist_b[n : n + K - 1]; written into every target slot that asks for it
//
// Layout: x = the projection's rows, bf16, `x_stride` elements apart, channels at columns [0, C);
// w f32 [C, K] (WeightRole.PARAMETER); out bf16 [T, C]. State slots as gdn_common.cuh (windows bf16
// [C, K-1]). query_start int32 [B+1]. Math in f32, out rounded to bf16 once.
// Launch: grid (ceil(C / 128), splits, B), block 128: a thread per channel, blockIdx.y a split of
// `rows_per_split` (>= K - 1) consecutive rows of sequence blockIdx.z. Only split 0 reads the window (the
// rows before a later split are rows of x) and only split 0 writes the targets' windows, after it has read
// the old window into registers: a target that is the source slot is rewritten by the thread that read
// that channel, and no one else reads it.
#include "gdn_common.cuh"

constexpr int kConvThreads = 128;

// Pre-conv value of sequence row `r` (negative: the window's column K-1 + r) for channel c.
template <int K>
__forceinline__ float history_value(int r, const bf16* x_col, int x_stride, const float (&window)[K - 1]) {
    return r >= 0 ? __bfloat162float(x_col[(long long)r * x_stride]) : window[K - 1 + r];
}

// Split 0 only: the window after each requested row count into its target slot.
template <int K>
__forceinline__ void store_target_windows(const StateSlots& states, int seq, SequenceRows rows, int channel,
                                          const bf16* x_col, int x_stride, const float (&window)[K - 1]) {
    for (int i = 0; i < states.num_targets; ++i) {
        const int target = states.targets[seq * states.num_targets + i];
        if (target < 0) continue;
        const int count = rows.length - states.num_targets + 1 + i;
        bf16* dst = states.window(target) + channel * (K - 1);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
            dst[j] = __float2bfloat16(history_value<K>(count - (K - 1) + j, x_col, x_stride, window));
        }
    }
}

template <int K>
__forceinline__ void conv_silu(bf16* out, const bf16* x, int x_stride, const float* weight, StateSlots states,
                               const int* query_start, int channels, int rows_per_split) {
    const int channel = blockIdx.x * kConvThreads + threadIdx.x;
    const bool mine = channel < channels;
    float taps[K];
#pragma unroll
    for (int j = 0; j < K; ++j) taps[j] = mine ? weight[channel * K + j] : 0.0f;  // weights: before the wait
    enter_dependent_kernel();
    if (!mine) return;  // no block barrier below
    const int seq = blockIdx.z;
    const SequenceRows rows = sequence_rows(query_start, seq);
    const int begin = blockIdx.y * rows_per_split;
    if (begin >= rows.length) return;
    const int end = min(rows.length, begin + rows_per_split);
    const bf16* x_col = x + (long long)rows.first * x_stride + channel;

    float window[K - 1];  // the old window: read by split 0, never needed elsewhere
#pragma unroll
    for (int j = 0; j < K - 1; ++j) window[j] = 0.0f;
    if (begin == 0) {
        const bf16* src = states.window(states.slots[seq]) + channel * (K - 1);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) window[j] = __bfloat162float(src[j]);
    }
    float hist[K - 1];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) hist[j] = history_value<K>(begin - (K - 1) + j, x_col, x_stride, window);
    if (begin == 0) store_target_windows<K>(states, seq, rows, channel, x_col, x_stride, window);

    bf16* out_col = out + (long long)rows.first * channels + channel;
    for (int r = begin; r < end; ++r) {
        const float now = __bfloat162float(x_col[(long long)r * x_stride]);
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc += taps[j] * hist[j];
        acc += taps[K - 1] * now;
#pragma unroll
        for (int j = 0; j < K - 2; ++j) hist[j] = hist[j + 1];
        hist[K - 2] = now;
        out_col[(long long)r * channels] = __float2bfloat16(acc * gdn_sigmoid(acc));
    }
}

extern "C" __global__ void __launch_bounds__(kConvThreads) gdn_conv_silu_k4(
    bf16* out, const bf16* x, int x_stride, const float* weight, unsigned char* state_layer, long long slot_bytes,
    int conv_bytes, const int* state_slots, const int* state_targets, int num_targets, const int* query_start,
    int channels, int rows_per_split) {
    const StateSlots states{state_layer, slot_bytes, conv_bytes, state_slots, state_targets, num_targets};
    conv_silu<4>(out, x, x_stride, weight, states, query_start, channels, rows_per_split);
}
