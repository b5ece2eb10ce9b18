// Helpers shared by the decode GEMV families (gemv.cu: bf16 weights, gemv_quant.cu: int4/int8 weights):
// streaming 16-byte weight loads, bf16x8 unpacking, the epilogue math and typed stores.
#pragma once
#include "common.cuh"

enum Epilogue { kStore = 0, kResidual = 1, kSwiglu = 2 };

// Weights are read once per step: L1::no_allocate keeps them from evicting x, which every warp re-reads.
__forceinline__ uint4 load_streaming(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// A bf16 is the top half of an f32: shifting/masking converts a packed pair without cvt instructions.
__forceinline__ void unpack8(const uint4 v, float (&f)[8]) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(words[i] << 16);
        f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

__forceinline__ float round_bf16(float v) {
    return __bfloat162float(__float2bfloat16(v));
}

// Same formula as activation.cu, so the fused SwiGLU epilogues match the unfused pair bit for bit.
__forceinline__ float silu(float g) {
    return g / (1.0f + expf(-g));
}

__forceinline__ void store(bf16* y, long long i, float v) { y[i] = __float2bfloat16(v); }
__forceinline__ void store(float* y, long long i, float v) { y[i] = v; }

// Sum over the warp, every lane gets it.
template <int R, int B>
__forceinline__ void warp_sum(float (&acc)[R][B]) {
#pragma unroll
    for (int j = 0; j < R; ++j)
#pragma unroll
        for (int b = 0; b < B; ++b)
#pragma unroll
            for (int offset = 16; offset > 0; offset >>= 1) acc[j][b] += __shfl_xor_sync(0xffffffffu, acc[j][b], offset);
}
