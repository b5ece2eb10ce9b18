// Groupwise-int codes from a checkpoint's row layout into the GPU's octet layout, at load time: the codes
// travel to the device as stored and are rearranged there, rather than by numpy on the host (the 27B int4
// checkpoint's 15 GB of codes took 121 s to rearrange on an H200 host; quantize.layouts.device_layout is the
// definition this kernel follows byte for byte, and the reference its GPU test compares against).
//
// Input, LAYOUT_ROWS: codes [n_w, k] row-major; int4 two codes a byte, the even input in the low nibble; int8
// one code a byte. Output, LAYOUT_OCTETS (gemv_quant.cu documents it): 16-byte chunks [octets, k / column,
// 32 lanes], lane 4g + t of (octet o, column c) holding row 8o + g's runs j = 0 .. kRuns - 1 of the inputs
// c * column + 32j + 8t + i (i = 0 .. 7), int4 nibbles in the order (0 2 4 6 1 3 5 7) of a run's word, int8
// bytes in the order (0 2 1 3 4 6 5 7). Rows n_w .. 8 * octets - 1 are padding: code 2^(bits-1), q = 0.
// The scales are rearranged on the host (1/64 of the codes at int4 g128).
// Launch: octets_from_rows_int{4,8}: grid-stride over the output chunks (any grid), one chunk per thread;
// k % column == 0 (int4: 128, int8: 64).
#include "quant_common.cuh"

// int4: nibble n of the output word is input P(n) of the run, P = (0 2 4 6 1 3 5 7).
__forceinline__ unsigned int int4_run_word(unsigned int stored) {
    unsigned int word = 0;
#pragma unroll
    for (int n = 0; n < 8; ++n) {
        const int input = n < 4 ? 2 * n : 2 * (n - 4) + 1;
        word |= ((stored >> (4 * input)) & 0xFu) << (4 * n);
    }
    return word;
}

template <int BITS>
__forceinline__ void octets_from_rows(uint4* octets, const unsigned char* rows, long long chunks, int n_w, int k) {
    enter_dependent_kernel();  // `rows` is a staging matrix the previous launch may still be reading
    constexpr unsigned int kPadding = BITS == 4 ? 0x88888888u : 0x80808080u;
    const int columns = k / kColumnK<BITS>;
    const long long row_bytes = (long long)k * BITS / 8;
    for (long long chunk = (long long)blockIdx.x * blockDim.x + threadIdx.x; chunk < chunks;
         chunk += (long long)gridDim.x * blockDim.x) {
        const OctetChunk at = octet_chunk(chunk, columns);
        const unsigned char* row_codes = rows + at.row * row_bytes;
        const bool padding = at.row >= n_w;
        unsigned int words[4];
#pragma unroll
        for (int j = 0; j < kRuns<BITS>; ++j) {
            const long long k0 = (long long)at.column * kColumnK<BITS> + 32 * j + 8 * at.t;
            if (BITS == 4) {
                const unsigned int stored = padding ? kPadding : *reinterpret_cast<const unsigned int*>(row_codes + k0 / 2);
                words[j] = int4_run_word(stored);
            } else {
                const uint2 stored = padding ? make_uint2(kPadding, kPadding) : *reinterpret_cast<const uint2*>(row_codes + k0);
                words[2 * j] = __byte_perm(stored.x, 0, 0x3120);  // bytes (0 2 1 3) of the run's first word
                words[2 * j + 1] = __byte_perm(stored.y, 0, 0x3120);
            }
        }
        octets[chunk] = make_uint4(words[0], words[1], words[2], words[3]);
    }
}

#define OCTETS_FROM_ROWS_KERNEL(NAME, BITS)                                                                 \
    extern "C" __global__ void NAME(uint4* octets, const unsigned char* rows, long long chunks, int n_w, int k) { \
        octets_from_rows<BITS>(octets, rows, chunks, n_w, k);                                               \
    }
OCTETS_FROM_ROWS_KERNEL(octets_from_rows_int4, 4)
OCTETS_FROM_ROWS_KERNEL(octets_from_rows_int8, 8)
