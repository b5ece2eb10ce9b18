// Helpers shared by the kernels over groupwise-quantized weights in the GPU layout ("octets", documented at
// the top of gemv_quant.cu): gemv_quant.cu (the decode GEMV and the dequantize kernel) and gemm_quant.cu (the
// prefill GEMM). A 16-byte chunk's runs -> bf16x2 q pairs with the bit tricks documented there, exactly;
// the m16n8k16 mma pair of one run (the pairs as A fragments, rows g and g+8 from two octets); scale bits ->
// f32; the epilogue's store. Included after "gemv_common.cuh"; part of the cubin cache key like any local
// header.
#pragma once
#include "gemv_common.cuh"

constexpr int kStoreF32 = 3;  // beyond gemv_common.cuh's Epilogue: gemv.cu picks f32 output by type instead
constexpr unsigned int kBf16One2 = 0x3F803F80u;    // bf16x2 (1, 1)
constexpr unsigned int kBf16Magic2 = 0x43004300u;  // bf16x2 (128, 128): mantissa LSB worth 1
constexpr unsigned int kInt4Bias2 = 0xC308C308u;   // bf16x2 (-136, -136) = -(128 + 8)
constexpr unsigned int kNegZero2 = 0x80008000u;    // bf16x2 (-0, -0): x + -0 == x for every x

template <int BITS>
constexpr int kRuns = BITS == 4 ? 4 : 2;  // 8-input runs per 16-byte chunk
template <int BITS>
constexpr int kColumnK = 32 * kRuns<BITS>;  // inputs per column: 4 lanes x 8 x kRuns

// Where 16-byte chunk `chunk` of the octet layout sits: chunk (octet * columns + column) * 32 + 4g + t holds
// row 8 * octet + g's runs j at inputs column * kColumnK + 32j + 8t.
struct OctetChunk {
    long long octet, row;
    int column, g, t;
};
__forceinline__ OctetChunk octet_chunk(long long chunk, int columns) {
    const int lane = (int)(chunk & 31), g = lane >> 2;
    const long long octet_column = chunk >> 5;
    const long long octet = octet_column / columns;
    return {octet, 8 * octet + g, (int)(octet_column - octet * columns), g, lane & 3};
}

__forceinline__ unsigned int bf16x2_fma(unsigned int a, unsigned int b, unsigned int c) {
    unsigned int d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The bit masks of the dequantization, in registers. A LOP3 takes one immediate, so (w & mask) | magic needs
// one constant in a register; given an immediate, ptxas re-materializes it (an IMAD.MOV) before every LOP3
// rather than keep it live (sm_90a: 58 of the int4 hot loop's 367 instructions per batch, 62 of int8's 286).
// Nor does it keep one it can rebuild from a kernel parameter. A volatile load cannot be repeated, so the
// masks are read once from this table and stay in registers (H200, qwen3-8b decode step at 256 tokens:
// int4 2.38 -> 2.29 ms, int8 3.19 -> 3.05 ms).
struct DequantMasks {
    unsigned int value;  // int4: a nibble in each half, 0x000F000F; int8: the low 7 bits, 0x007F007F
    unsigned int sign;   // int8: bit 7 of each half, 0x00800080
};
__device__ unsigned int dequant_mask_table[3] = {0x000F000Fu, 0x007F007Fu, 0x00800080u};

__forceinline__ unsigned int load_volatile(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.volatile.global.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}

template <int BITS>
__forceinline__ DequantMasks dequant_masks() {
    return {load_volatile(dequant_mask_table + (BITS == 4 ? 0 : 1)), load_volatile(dequant_mask_table + 2)};
}

// An int4 run (one word) -> the bf16x2 q pairs (i0 i1)(i2 i3)(i4 i5)(i6 i7), exactly.
__forceinline__ void dequant_run(const unsigned int word, const DequantMasks& m, unsigned int (&p)[4]) {
#pragma unroll
    for (int s = 0; s < 4; ++s) p[s] = bf16x2_fma(((word >> (4 * s)) & m.value) | kBf16Magic2, kBf16One2, kInt4Bias2);
}

// Two int8 codes (bits 0..7 and 16..23 of v) -> their bf16x2 q pair, exactly.
__forceinline__ unsigned int dequant_int8_pair(const unsigned int v, const DequantMasks& m) {
    return bf16x2_fma((v & m.value) | kBf16Magic2, kBf16One2, (v & m.sign) ^ 0xC380C380u);
}

// An int8 run (two words) -> the bf16x2 q pairs (i0 i1)(i2 i3)(i4 i5)(i6 i7), exactly.
__forceinline__ void dequant_run(const unsigned int w0, const unsigned int w1, const DequantMasks& m, unsigned int (&p)[4]) {
    p[0] = dequant_int8_pair(w0, m);
    p[1] = dequant_int8_pair(w0 >> 8, m);
    p[2] = dequant_int8_pair(w1, m);
    p[3] = dequant_int8_pair(w1 >> 8, m);
}

// Run j of a chunk -> its 4 bf16x2 q pairs.
template <int BITS>
__forceinline__ void dequant_chunk_run(const uint4 chunk, const int j, const DequantMasks& m, unsigned int (&p)[4]) {
    const unsigned int words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
    if (BITS == 4) {
        dequant_run(words[j], m, p);
    } else {
        dequant_run(words[2 * j], words[2 * j + 1], m, p);
    }
}

// d += A (16 x 16, rows g / g+8 from a / b) * B (16 x 8, x): m16n8k16, bf16 in, f32 accumulate.
__forceinline__ void mma_run(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[4], const uint4 x) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(b[0]), "r"(a[1]), "r"(b[1]), "r"(x.x), "r"(x.y));
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[2]), "r"(b[2]), "r"(a[3]), "r"(b[3]), "r"(x.z), "r"(x.w));
}

__forceinline__ float bf16_bits_to_float(const unsigned short bits) {
    return __uint_as_float((unsigned int)bits << 16);
}

// A scale's bits -> f32, exactly: bf16 by a shift, fp16 by cvt (subnormal multipliers included).
template <bool F16S>
__forceinline__ float scale_to_float(const unsigned short bits) {
    if (!F16S) return bf16_bits_to_float(bits);
    float f;
    asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(bits));
    return f;
}

// A bf16x2 q pair times a bf16 scale (`scale2`: the scale in both halves), rounded to bf16 once (one FMA).
__forceinline__ unsigned int scale_pair_bf16(const unsigned int pair, const unsigned int scale2) {
    return bf16x2_fma(pair, scale2, kNegZero2);
}

// A bf16x2 q pair times an f32 scale, each product exact in f32 and rounded to bf16 once.
__forceinline__ unsigned int scale_pair_f32(const unsigned int pair, const float scale) {
    const float lo = __uint_as_float(pair << 16) * scale, hi = __uint_as_float(pair & 0xFFFF0000u) * scale;
    unsigned int d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}

__forceinline__ void store_output(void* y, const bf16* residual, long long i, float v, int epilogue) {
    if (epilogue == kStoreF32) {
        store(static_cast<float*>(y), i, v);
        return;
    }
    if (epilogue == kResidual) v = round_bf16(v) + __bfloat162float(residual[i]);
    store(static_cast<bf16*>(y), i, v);
}

// One lane's m16n8 accumulators of a prefill GEMM (mma.sync's and wgmma's layout: rows row_a and row_a + 8,
// tokens token and token + 1; acc[e], acc[2 + e]) through the epilogue, where the row and the token exist.
__forceinline__ void store_accumulators(void* y, const bf16* residual, const float (&acc)[4], long long row_a, long long token,
                                        int m, int n, long long ldy, int epilogue) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        if (token + e >= m) continue;
        if (row_a < n) store_output(y, residual, (token + e) * ldy + row_a, acc[e], epilogue);
        if (row_a + 8 < n) store_output(y, residual, (token + e) * ldy + row_a + 8, acc[2 + e], epilogue);
    }
}

// The prefill GEMMs' tiles (gemm_quant.cu, gemm_quant_sm90.cu): octets of an N-row weight in the layout,
// ceil(N / 8) padded to an even count; a block's first octet and token, rastered in groups of `raster_tiles`
// row tiles (block b: group b / (raster_tiles * token tiles), and in it the row tile varies fastest), so the
// blocks resident at once share a few row tiles' weights and token tiles' x in L2.
__forceinline__ int octet_count(int n) {
    const int octets = (n + 7) >> 3;
    return octets + (octets & 1);
}

struct GemmTile {
    long long octet0;  // the block's first octet
    int token0;        // its first token
};

__forceinline__ GemmTile gemm_tile(int block, int row_tiles, int token_tiles, int tokens_per_tile, int tile_octets,
                                   int raster_tiles) {
    const int group_blocks = raster_tiles * token_tiles;
    const int group = block / group_blocks, first = group * raster_tiles;
    const int rows_in_group = min(raster_tiles, row_tiles - first);
    const int i = block - group * group_blocks;
    return {(long long)(first + i % rows_in_group) * tile_octets, (i / rows_in_group) * tokens_per_tile};
}

// The prefill GEMMs' variants, as KERNEL(name, bits, scale segments a column, fp16 scales): groups of at least a
// column take one scale a column (gemm_int<BITS>), smaller groups one per segment; fp16 scales are the `.ninfer`
// formats as bound (gemv_quant.cu): Q4G64 as int4 g64, Q5G64 / Q6G64 as int8 g64 (one scale per int8 column),
// W8G32 as int8 g32. gemm_quant.cu and gemm_quant_sm90.cu instantiate each.
#define GEMM_QUANT_VARIANTS(KERNEL)              \
    KERNEL(gemm_int4, 4, 1, false)               \
    KERNEL(gemm_int8, 8, 1, false)               \
    KERNEL(gemm_int4_g32, 4, 4, false)           \
    KERNEL(gemm_int4_g64, 4, 2, false)           \
    KERNEL(gemm_int8_g32, 8, 2, false)           \
    KERNEL(gemm_int4_g64_f16s, 4, 2, true)       \
    KERNEL(gemm_int8_f16s, 8, 1, true)           \
    KERNEL(gemm_int8_g32_f16s, 8, 2, true)
