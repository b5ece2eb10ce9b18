// Row gather/copy: out[t * out_stride + i] = src[r(t) * src_stride + i] for i < width, r(t) = ids[t] (or t
// when ids is null). It serves three ops: the embedding lookup (ids = token ids, src = the embedding
// table), the selection of the hidden rows whose logits are needed (ids = logit_rows), and feature
// concatenation (ids = null, out offset to the part's first column, out_stride = the concatenated width).
// A negative id -(j + 1) stands for feed[j] (the embedding's fed ids: the previous step's samples, still on
// the device when this step was enqueued; see Executor.feed).
//
// Layout: bf16 row-major; strides and width in elements; every id in [0, src rows) or in [-fed rows, 0)
// with feed non-null (validated on the host before publishing; fed ids come from the sampling kernels).
// Launch: grid (rows), block (T) with T a multiple of 32; one block per output row, no smem. Rows move as
// 16-byte vectors when width and both strides are multiples of 8 and both pointers are 16-byte aligned,
// element by element otherwise.
#include "common.cuh"

extern "C" __global__ void gather_rows_bf16(bf16* out, int out_stride, const bf16* src, int src_stride,
                                            const int* ids, int width, const int* feed) {
    enter_dependent_kernel();
    // int, not blockIdx's unsigned type: a negative id must stay negative
    long long row = ids == nullptr ? (int)blockIdx.x : ids[blockIdx.x];
    if (row < 0) row = feed[-row - 1];
    const bf16* from = src + row * src_stride;
    bf16* to = out + (long long)blockIdx.x * out_stride;
    if (width % 8 == 0 && aligned16(from) && aligned16(to)) {
        const uint4* from4 = reinterpret_cast<const uint4*>(from);
        uint4* to4 = reinterpret_cast<uint4*>(to);
        for (int i = threadIdx.x; i < width / 8; i += blockDim.x) to4[i] = from4[i];
        return;
    }
    for (int i = threadIdx.x; i < width; i += blockDim.x) to[i] = from[i];
}
