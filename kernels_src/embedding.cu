// Row gather: out[t, :] = table[ids[t], :]. The embedding lookup (ids = the step's token ids, table = the
// embedding matrix) and the selection of the hidden rows whose logits are needed (ids = logit_rows).
//
// Layout: table is bf16 [num_rows, width] row-major; ids is int32 [rows], every id in [0, num_rows)
// (validated on the host before publishing); out is bf16 [rows, width].
// Launch: grid (rows), block (T) with T a multiple of 32; one block per output row, no smem. Rows move as
// 16-byte vectors when width % 8 == 0 and both pointers are 16-byte aligned, element by element otherwise.
#include "common.cuh"

extern "C" __global__ void gather_rows_bf16(bf16* out, const bf16* table, const int* ids, int width) {
    const bf16* src = table + (long long)ids[blockIdx.x] * width;
    bf16* dst = out + (long long)blockIdx.x * width;
    if (width % 8 == 0 && aligned16(src) && aligned16(dst)) {
        const uint4* src4 = reinterpret_cast<const uint4*>(src);
        uint4* dst4 = reinterpret_cast<uint4*>(dst);
        for (int i = threadIdx.x; i < width / 8; i += blockDim.x) dst4[i] = src4[i];
        return;
    }
    for (int i = threadIdx.x; i < width; i += blockDim.x) dst[i] = src[i];
}
