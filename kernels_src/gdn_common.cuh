// Helpers shared by the Gated DeltaNet families (gdn_conv, gdn_delta_rule): the state-slot addressing of
// kv/states.py, the step's per-sequence tables and the gating scalars. Included after "common.cuh".
//
// State slots (kv/states.py StateSlotPool): one buffer, slot-major; kernels get the base of their layer,
// `layer = pool + layer_offset`, and the slot stride `slot_bytes`. In slot s the layer's conv window is
// bf16 [channels, K-1] (oldest column first) at `layer + s * slot_bytes`, and its recurrent state fp32
// [Hv, dk, dv] at `+ conv_bytes` (256-byte aligned).
// Targets: state_targets int32 [B, S], -1 pads at the front; target i of sequence b receives the state after
// len_b - S + 1 + i of its rows (the last listed: after all of them). A target may be the sequence's own
// source slot (in-place decode): every kernel reads the part of the state it writes before storing any.
#pragma once
#include "common.cuh"

struct StateSlots {
    unsigned char* layer;    // pool base + this layer's offset
    long long slot_bytes;    // stride between slots
    int conv_bytes;          // offset of the recurrent state within a layer
    const int* slots;        // [B] the slot holding each sequence's state before the step
    const int* targets;      // [B, num_targets]
    int num_targets;

    __forceinline__ bf16* window(int slot) const {
        return reinterpret_cast<bf16*>(layer + slot * slot_bytes);
    }
    __forceinline__ float* recurrent(int slot) const {
        return reinterpret_cast<float*>(layer + slot * slot_bytes + conv_bytes);
    }
    // The target slot that wants sequence `seq`'s state after `count` of its `length` rows, or -1.
    __forceinline__ int target_after(int seq, int count, int length) const {
        const int index = count - length + num_targets - 1;
        if (index < 0 || index >= num_targets) return -1;
        return targets[seq * num_targets + index];
    }
};

// The rows of sequence `seq` in the step: [first, first + length).
struct SequenceRows {
    int first;
    int length;
};

__forceinline__ SequenceRows sequence_rows(const int* query_start, int seq) {
    const int first = query_start[seq];
    return {first, query_start[seq + 1] - first};
}

__forceinline__ float gdn_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// log(1 + e^x), with torch's threshold of 20 above which it is x (numpy_hybrid_norms.softplus).
__forceinline__ float gdn_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// L2-normalisation epsilon of q and k (transformers' l2norm: x * rsqrt(sum(x^2) + eps)).
constexpr float kL2NormEps = 1e-6f;
