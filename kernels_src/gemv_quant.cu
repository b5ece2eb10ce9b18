// Decode GEMV over groupwise-quantized weights (int4 / int8, symmetric, bf16 scales), and the dequantize
// kernel of the prefill path (bf16 tile for cuBLASLt).
//
// Weight layout (ninfer_rt/model/quant.py writes it; `ninfer-rt quantize` stores it):
//   qweight uint8 [N_w, K * BITS / 8] row-major ([out, in]); codes are offset binary, u = q + 2^(BITS-1).
//     int4: byte j of a row holds input 2j in its low nibble and input 2j+1 in its high nibble, so the
//           little-endian 32-bit word i holds inputs 8i..8i+7, input 8i+p at bits 4p..4p+3.
//     int8: byte k holds input k.
//   scales bf16 [N_w, K / G] row-major: w[n, k] = q[n, k] * scales[n, k / G].
// A 16-byte chunk of a row is 32 int4 / 16 int8 values. G is a power of two and a whole number of chunks;
// the kernels take group_shift = log2(G / values per chunk). K % G == 0, pointers 16-byte aligned (checked
// on the host). x is bf16 [B, K]; y is [B, N] (bf16, or f32 for logits).
//
// Math: per chunk, part = sum_k q_k * x_k (f32, q exact), then acc += scale * part; f32 throughout, each
// output rounded once on store. Dequantization uses no int->float conversions: OR-ing a code into the
// mantissa of 2^23 is the float 2^23 + code * 2^(4p) (p = nibble position), and one FMA by 2^-4p minus
// (2^(23-4p) + 8) yields q exactly. Per int4 value: one LOP3 + one FFMA; per int8 value: one PRMT + one
// FADD. That keeps batch-1 decode memory bound rather than ALU bound (int4 moves 4x the values per byte).
//
// One kernel per bits x row bucket B in {1, 2, 4, 8}: gemv_int<BITS>_b<B>, for rows <= B. The epilogue is a
// kernel argument (uniform, applied once per output after the K loop), which keeps the family at 8 GEMV
// instantiations (NVRTC time) at no cost in the hot loop. Epilogues, as gemv.cu's:
//   kStore (0):     y = x @ W^T, bf16                                 (N_w = N)
//   kResidual (1):  y = bf16(x @ W^T) + residual, bf16                (N_w = N; y may alias residual)
//   kSwiglu (2):    y[b, i] = silu(bf16(g)) * bf16(u), g/u = rows i and N+i of the fused gate_up matrix
//                   (N_w = 2N): bit-identical to kStore followed by activation.cu's silu_mul_bf16
//   kStoreF32 (3):  y = x @ W^T, f32 (a quantized lm_head's logits)   (N_w = N)
// Launch: block 128 = 4 warps, grid ceil(groups / 4), no shared memory. A warp owns 4 weight rows (plain:
// outputs 4g..4g+3; SwiGLU: gate rows 2g, 2g+1 and up rows N+2g, N+2g+1 -> outputs 2g, 2g+1) and walks K
// in 16-byte chunks, lane-interleaved (each warp load is 512 contiguous bytes of a row), kUnroll (2; 1 at B = 8) chunks
// of each row in flight per lane. Four rows per warp amortise unpacking x (bf16 -> f32) over more weights.
//
// dequantize_int<BITS>_bf16: W[N_w, K] bf16 = q * scale (rounded to bf16 once), one thread per chunk,
// grid-stride; launch any grid of 256-thread blocks.
#include "gemv_common.cuh"

constexpr int kRowsPerWarp = 4;
constexpr int kStoreF32 = 3;  // beyond gemv_common.cuh's Epilogue: gemv.cu picks f32 output by type instead
constexpr int kWarpsPerBlock = 4;
constexpr unsigned int kMagicBits = 0x4B000000u;  // the float 2^23: its mantissa LSB is worth 1
constexpr float kMagic = 8388608.0f;

// 8-value slices of x (one 16-byte bf16 load) per 16-byte weight chunk.
template <int BITS>
constexpr int kSlices = BITS == 4 ? 4 : 2;

// Codes of one int4 word (inputs 8i..8i+7) -> q, exactly.
__forceinline__ void dequant_int4(const unsigned int word, float (&q)[8]) {
    const unsigned int high = word >> 16;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const float down = 1.0f / float(1 << (4 * p));
        const float bias = -(kMagic * down + 8.0f);
        q[p] = fmaf(__uint_as_float((word & (0xFu << (4 * p))) | kMagicBits), down, bias);
        q[4 + p] = fmaf(__uint_as_float((high & (0xFu << (4 * p))) | kMagicBits), down, bias);
    }
}

// Codes of one int8 word (4 inputs) -> q[at..at+3], exactly. PRMT builds the bytes {code, 0, 0, 0x4B}.
__forceinline__ void dequant_int8(const unsigned int word, float (&q)[8], const int at) {
#pragma unroll
    for (int p = 0; p < 4; ++p) q[at + p] = __uint_as_float(__byte_perm(word, kMagicBits, 0x7440 + p)) - (kMagic + 128.0f);
}

// q of the 8 inputs of slice s of a chunk.
template <int BITS>
__forceinline__ void dequant_slice(const uint4 chunk, const int s, float (&q)[8]) {
    const unsigned int words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    if (BITS == 4) {
        dequant_int4(words[s], q);
    } else {
        dequant_int8(words[2 * s], q, 0);
        dequant_int8(words[2 * s + 1], q, 4);
    }
}

// acc[j][b] += scale[j] * sum over the chunk's inputs of q[j] * x[b]. Rows b >= `rows` of a bucket re-read
// row rows-1 (an L1 hit) and are never stored.
template <int BITS, int B>
__forceinline__ void accumulate_chunk(float (&acc)[kRowsPerWarp][B], const uint4 (&w)[kRowsPerWarp],
                                      const float (&scale)[kRowsPerWarp], const uint4* x, int rows, int x_stride,
                                      int chunk) {
    float part[kRowsPerWarp][B];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
        for (int b = 0; b < B; ++b) part[j][b] = 0.0f;
#pragma unroll
    for (int s = 0; s < kSlices<BITS>; ++s) {
        float q[kRowsPerWarp][8];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) dequant_slice<BITS>(w[j], s, q[j]);
#pragma unroll
        for (int b = 0; b < B; ++b) {
            float xf[8];
            unpack8(__ldg(x + (long long)min(b, rows - 1) * x_stride + chunk * kSlices<BITS> + s), xf);
#pragma unroll
            for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
                for (int i = 0; i < 8; ++i) part[j][b] = fmaf(q[j][i], xf[i], part[j][b]);
        }
    }
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[j][b] = fmaf(scale[j], part[j][b], acc[j][b]);
}

__forceinline__ void store_output(void* y, const bf16* residual, long long i, float v, int epilogue) {
    if (epilogue == kStoreF32) {
        store(static_cast<float*>(y), i, v);
        return;
    }
    if (epilogue == kResidual) v = round_bf16(v) + __bfloat162float(residual[i]);
    store(static_cast<bf16*>(y), i, v);
}

template <int BITS, int B>
__forceinline__ void gemv_quant(void* y, const bf16* x, const unsigned char* qweight, const bf16* scales,
                                const bf16* residual, int rows, int n, int k, int group_shift, int epilogue) {
    // Two chunks of each row in flight per lane; one at B = 8, whose accumulators need the registers.
    constexpr int kUnroll = B <= 4 ? 2 : 1;
    const bool swiglu = epilogue == kSwiglu;
    const int outputs = swiglu ? kRowsPerWarp / 2 : kRowsPerWarp;  // per warp
    const int lane = threadIdx.x & 31;
    const long long group = (long long)blockIdx.x * kWarpsPerBlock + (threadIdx.x >> 5);
    const long long w_rows = swiglu ? 2ll * n : n;
    if (group >= (n + outputs - 1) / outputs) return;
    const int kc = k / (128 / BITS);  // 16-byte chunks per row
    const int scales_per_row = kc >> group_shift;

    long long w_index[kRowsPerWarp];
    const uint4* w_row[kRowsPerWarp];
    const bf16* s_row[kRowsPerWarp];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
        w_index[j] = group * outputs + j % outputs + (j / outputs) * (long long)n;  // j / outputs is 0 unless SwiGLU
        // Rows past the end (N not a multiple of the warp's outputs) load row N_w-1 again and are never
        // stored: no branch in the hot loop.
        const long long row = min(w_index[j], w_rows - 1);
        w_row[j] = reinterpret_cast<const uint4*>(qweight) + row * kc;
        s_row[j] = scales + row * scales_per_row;
    }
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    const int x_stride = k >> 3;

    float acc[kRowsPerWarp][B];
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j)
#pragma unroll
        for (int b = 0; b < B; ++b) acc[j][b] = 0.0f;

    int c = lane;
    for (; c + 32 * (kUnroll - 1) < kc; c += 32 * kUnroll) {
        uint4 wv[kUnroll][kRowsPerWarp];  // all loads issued before any math: kUnroll * 4 in flight
        float sv[kUnroll][kRowsPerWarp];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
#pragma unroll
            for (int j = 0; j < kRowsPerWarp; ++j) {
                wv[u][j] = load_streaming(w_row[j] + c + 32 * u);
                sv[u][j] = __bfloat162float(__ldg(s_row[j] + ((c + 32 * u) >> group_shift)));
            }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) accumulate_chunk<BITS, B>(acc, wv[u], sv[u], x4, rows, x_stride, c + 32 * u);
    }
    for (; c < kc; c += 32) {
        uint4 wv[kRowsPerWarp];
        float sv[kRowsPerWarp];
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j) {
            wv[j] = load_streaming(w_row[j] + c);
            sv[j] = __bfloat162float(__ldg(s_row[j] + (c >> group_shift)));
        }
        accumulate_chunk<BITS, B>(acc, wv, sv, x4, rows, x_stride, c);
    }

    warp_sum(acc);
    if (lane != 0) return;

#pragma unroll
    for (int b = 0; b < B; ++b) {
        if (b >= rows) break;
        const long long out_row = (long long)b * n;
        if (swiglu) {
#pragma unroll
            for (int t = 0; t < kRowsPerWarp / 2; ++t)
                if (w_index[t] < n)
                    store(static_cast<bf16*>(y), out_row + w_index[t],
                          silu(round_bf16(acc[t][b])) * round_bf16(acc[kRowsPerWarp / 2 + t][b]));
            continue;
        }
#pragma unroll
        for (int j = 0; j < kRowsPerWarp; ++j)
            if (w_index[j] < n) store_output(y, residual, out_row + w_index[j], acc[j][b], epilogue);
    }
}

template <int BITS>
__forceinline__ void dequantize(bf16* w, const unsigned char* qweight, const bf16* scales, long long chunks, int kc,
                                int group_shift) {
    const uint4* q4 = reinterpret_cast<const uint4*>(qweight);
    for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; c < chunks; c += (long long)gridDim.x * blockDim.x) {
        const long long row = c / kc;
        const int col = (int)(c - row * kc);
        const float scale = __bfloat162float(scales[row * (kc >> group_shift) + (col >> group_shift)]);
        const uint4 v = load_streaming(q4 + c);
#pragma unroll
        for (int s = 0; s < kSlices<BITS>; ++s) {
            float q[8];
            dequant_slice<BITS>(v, s, q);
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] *= scale;
            store_bf16x8(w + c * (128 / BITS) + 8 * s, q);
        }
    }
}

#define GEMV_QUANT_KERNEL(BITS, B)                                                                           \
    extern "C" __global__ void gemv_int##BITS##_b##B(void* y, const bf16* x, const unsigned char* qweight,       \
                                                     const bf16* scales, const bf16* residual, int rows, int n,  \
                                                     int k, int group_shift, int epilogue) {                     \
        gemv_quant<BITS, B>(y, x, qweight, scales, residual, rows, n, k, group_shift, epilogue);                 \
    }
#define GEMV_QUANT_FAMILY(BITS)                                                                                  \
    GEMV_QUANT_KERNEL(BITS, 1)                                                                                   \
    GEMV_QUANT_KERNEL(BITS, 2)                                                                                   \
    GEMV_QUANT_KERNEL(BITS, 4)                                                                                   \
    GEMV_QUANT_KERNEL(BITS, 8)                                                                                   \
    extern "C" __global__ void dequantize_int##BITS##_bf16(bf16* w, const unsigned char* qweight, const bf16* scales, \
                                                           long long chunks, int kc, int group_shift) {           \
        dequantize<BITS>(w, qweight, scales, chunks, kc, group_shift);                                            \
    }

GEMV_QUANT_FAMILY(4)
GEMV_QUANT_FAMILY(8)
