// Greedy sampling on the device: out[r] = argmax(logits[r, :]), the lowest index among equal maxima
// (np.argmax's rule). NaN never compares greater, so a row with NaNs yields the argmax of its numbers.
//
// Only greedy decoding is decided here; it lets a captured decode graph end in one int32 per row, so
// the host reads 4 bytes per sequence instead of a vocab-wide row. Top-k / top-p / min-p sampling,
// penalties and logprobs run on the host (engine/sampling.py) from the full f32 logits row: they need
// per-request state (seeded generators, token histories) that already lives there, and a vocab row of
// 152k floats is ~0.6 MB, a few microseconds over PCIe per row.
//
// Layout: logits f32 [rows, vocab] row-major; out int32 [rows].
// Launch: grid (rows), block (1024); one block per row, no dynamic smem.

struct Best {
    float value;
    int index;
};

__forceinline__ Best better(Best a, Best b) {
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
    return a;
}

__forceinline__ Best warp_best(Best v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        Best other{__shfl_xor_sync(0xffffffffu, v.value, offset), __shfl_xor_sync(0xffffffffu, v.index, offset)};
        v = better(v, other);
    }
    return v;
}

extern "C" __global__ void argmax_f32(int* out, const float* logits, int vocab) {
    __shared__ Best partial[32];
    const float* row = logits + (long long)blockIdx.x * vocab;
    // -inf with index vocab loses to every real value; an all-NaN row answers 0 after the clamp below.
    Best best{-__int_as_float(0x7f800000), vocab};
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = better(best, Best{row[i], i});
    best = warp_best(best);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = best;
    __syncthreads();
    if (warp != 0) return;
    best = lane < (blockDim.x >> 5) ? partial[lane] : Best{-__int_as_float(0x7f800000), vocab};
    best = warp_best(best);
    if (lane == 0) out[blockIdx.x] = best.index < vocab ? best.index : 0;
}
