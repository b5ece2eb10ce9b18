// SwiGLU activation: out[r, i] = silu(gate[r, i]) * up[r, i], silu(g) = g / (1 + exp(-g)).
//
// Layout (SwiGLU): gate_up is bf16 [rows, 2 * inter] row-major, the fused output of the gate and up projections:
// gate = columns [0, inter), up = columns [inter, 2 * inter). out is bf16 [rows, inter]. Math in f32,
// rounded to bf16 once, on store.
// Launch: 1-D grid-stride; any grid and block size (block a multiple of 32 recommended), no smem. Work
// items are 8-element 16-byte vectors when inter % 8 == 0 and both pointers are 16-byte aligned, single
// elements otherwise.
#include "common.cuh"

__forceinline__ float silu(float g) {
    return g / (1.0f + expf(-g));
}

extern "C" __global__ void silu_mul_bf16(bf16* out, const bf16* gate_up, int rows, int inter) {
    enter_dependent_kernel();
    const bool vectorised = inter % 8 == 0 && aligned16(out) && aligned16(gate_up);
    const int width = vectorised ? 8 : 1;
    const long long items_per_row = inter / width;
    const long long items = (long long)rows * items_per_row;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long item = (long long)blockIdx.x * blockDim.x + threadIdx.x; item < items; item += stride) {
        const long long row = item / items_per_row;
        const long long col = (item - row * items_per_row) * width;
        const bf16* gate = gate_up + row * 2 * inter + col;
        const bf16* up = gate + inter;
        bf16* dst = out + row * inter + col;
        if (vectorised) {
            float g[8], u[8];
            load_bf16x8(gate, g);
            load_bf16x8(up, u);
#pragma unroll
            for (int j = 0; j < 8; ++j) g[j] = silu(g[j]) * u[j];
            store_bf16x8(dst, g);
        } else {
            *dst = __float2bfloat16(silu(__bfloat162float(*gate)) * __bfloat162float(*up));
        }
    }
}
