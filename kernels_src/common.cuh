// Shared helpers for the kernel families: bf16 <-> f32 conversion of 8-element (16-byte) vectors, a
// block-wide sum, cp.async copies into shared memory and the programmatic dependent launch prologue.
// Included by the .cu files as "common.cuh"; its contents are part of the cubin cache key.
#pragma once
#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

// Eight bf16 values, 16 bytes: one vectorised global load or store.
struct __align__(16) bf16x8 {
    __nv_bfloat162 pair[4];
};

__forceinline__ void load_bf16x8(const bf16* src, float (&out)[8]) {
    const bf16x8 v = *reinterpret_cast<const bf16x8*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(v.pair[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__forceinline__ void store_bf16x8(bf16* dst, const float (&in)[8]) {
    bf16x8 v;
#pragma unroll
    for (int i = 0; i < 4; ++i) v.pair[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<bf16x8*>(dst) = v;
}

__forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Sum of `value` over the whole block; every thread gets the result. blockDim.x must be a multiple of 32
// (at most 1024). Safe to call repeatedly: the leading barrier protects `partial` from the previous call.
__forceinline__ float block_sum(float value) {
    __shared__ float partial[32];
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    __syncthreads();
    if (lane == 0) partial[warp] = value;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    value = lane < warps ? partial[lane] : 0.0f;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
    return value;
}

// The shared-memory (state space) address of a generic pointer into shared memory.
__forceinline__ unsigned smem_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses the registers. With `valid` false nothing is read and the
// 16 destination bytes are zero-filled (src-size 0), so keys past the context never bring garbage (NaN
// bit patterns) into shared memory; `src` must still be a mapped address, callers pass the base pointer.
__forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_size = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_size));
}

// 4-byte variant (used for the per-key int8 scales), zero-filled when `valid` is false.
__forceinline__ void cp_async4(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const int src_size = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_size));
}

__forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Wait until at most `kPending` of this thread's committed groups are still in flight.
template <int kPending>
__forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");  // no shared read hoisted above
}

// Programmatic dependent launch (sm_90 and later; no-ops below, where launches are plain). Kernels are
// launched with the programmatic-stream-serialization attribute, so a kernel's blocks may start while the
// previous kernel on its stream is still running: its launch latency and prologue hide behind that
// kernel's run. The contract that keeps stream order intact: every kernel calls
// grid_dependency_wait() before its first access to memory that another kernel writes or reads
// (activations, KV pages, step inputs, outputs); only reads of immutable data (weights) may come first.
// The wait returns once the previous grid has completed and its writes are visible, and since every
// kernel waits, that previous grid had itself waited for the one before it. A test checks that every
// kernel entry contains the wait (tests/test_pdl_contract.py).
__forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel on the stream launch now (its blocks then wait in grid_dependency_wait for this
// grid to finish). It launches once every block of this grid has called this, i.e. once the last of them
// is resident, so no waiting block of it can keep one of this grid's blocks from starting.
__forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// The usual kernel prologue: let the next kernel launch, then wait for the previous one. Triggering before
// the wait gives the next kernel's weight loads (its pre-wait prologue) this kernel's whole run to overlap,
// not just what is left of it after the wait (H200, qwen3-8b decode at 256 tokens: bf16 4.08 -> 4.00 ms,
// int8 weights 2.76 -> 2.73, int4 2.08 -> 2.09; bench/logs/h200-2026-11-30-quant-gemv-shapes-pdl-early-6f07f36.txt). Ordering is unchanged: the
// next kernel touches mutable memory only after its own wait, which returns once this grid has completed,
// and this grid completes only after its wait on the previous one returned.
__forceinline__ void enter_dependent_kernel() {
    allow_dependent_launch();
    grid_dependency_wait();
}
