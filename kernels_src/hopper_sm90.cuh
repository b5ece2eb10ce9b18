// Hopper (sm_90a) building blocks shared by the warpgroup-MMA kernels (prefill_attention_sm90*.cu through
// wgmma_sm90.cuh, gemm_quant_sm90.cu): the 128-byte swizzle of shared-memory tiles and the wgmma matrix
// descriptors that read them, the wgmma fences, commit groups and waits, the asm statements that pin registers
// a wgmma in flight reads or writes, the 64-register accumulator operand list of an n128 wgmma, and the
// shared-memory mbarriers of warp-specialized kernels. Empty unless compiled for sm_90a. Part of the including
// files' cache keys.
#pragma once
#include "common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kSwizzleRow = 128;  // bytes per swizzled row (64 16-bit elements)

__forceinline__ unsigned swizzled(int row, int chunk) {  // chunk: 16-byte unit within the row's 128 bytes
    return row * kSwizzleRow + (((chunk & 7) ^ (row & 7)) << 4);
}

// The shared-address base of the kernel's dynamic shared memory rounded up to the 1024-byte alignment the
// 128-byte swizzle's atoms need; traps unless the launch gave `bytes` past it (the host adds the 1 KiB of slack).
__forceinline__ unsigned swizzle_aligned_base(const unsigned char* dynamic_smem, unsigned bytes) {
    unsigned dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic_bytes));
    if (dynamic_bytes < bytes + 1024) __trap();
    return (smem_address(dynamic_smem) + 1023u) & ~1023u;
}

// Shared-memory matrix descriptor of a 128-byte-swizzled operand starting at `address` (PTX ISA, "matrix
// descriptor"): `stride` = bytes between groups of 8 rows (1024 here); `leading` = bytes between the 64-element
// halves of an N-major operand (attention's V), unused for K-major ones (Q, K; the GEMM's x). A k step
// within a half advances the start address by 32 bytes; the hardware applies the swizzle to the final address,
// hence the 1024-byte alignment.
__forceinline__ unsigned long long wgmma_desc(unsigned address, unsigned leading, unsigned stride) {
    return (unsigned long long)((address & 0x3FFFFu) >> 4) | ((unsigned long long)(leading >> 4) << 16) |
           ((unsigned long long)(stride >> 4) << 32) | (1ull << 62);
}

__forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int kPending>
__forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory"); }

__forceinline__ void keep_register(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__forceinline__ void keep_register(unsigned& x) { asm volatile("" : "+r"(x)::"memory"); }

// Pins accumulators (float) and A fragments (unsigned) in program order around the wgmma fences: the compiler
// sees no access to them in the fence and wait asm statements, and would otherwise move reads and writes of them
// across; a fragment stays live (its registers untouched) until the wgmma reading it has completed.
template <typename T, int N>
__forceinline__ void keep_in_place(T (&regs)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) keep_register(regs[i][e]);
}

// The accumulators of an m64n128 wgmma, o[16][4], as asm operands %0 .. %63.
#define WGMMA_O_REGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
#define WGMMA_O_OPERANDS(o) "+f"(o[0][0]), "+f"(o[0][1]), "+f"(o[0][2]), "+f"(o[0][3]), "+f"(o[1][0]), "+f"(o[1][1]), "+f"(o[1][2]), "+f"(o[1][3]), "+f"(o[2][0]), "+f"(o[2][1]), "+f"(o[2][2]), "+f"(o[2][3]), "+f"(o[3][0]), "+f"(o[3][1]), "+f"(o[3][2]), "+f"(o[3][3]), "+f"(o[4][0]), "+f"(o[4][1]), "+f"(o[4][2]), "+f"(o[4][3]), "+f"(o[5][0]), "+f"(o[5][1]), "+f"(o[5][2]), "+f"(o[5][3]), "+f"(o[6][0]), "+f"(o[6][1]), "+f"(o[6][2]), "+f"(o[6][3]), "+f"(o[7][0]), "+f"(o[7][1]), "+f"(o[7][2]), "+f"(o[7][3]), "+f"(o[8][0]), "+f"(o[8][1]), "+f"(o[8][2]), "+f"(o[8][3]), "+f"(o[9][0]), "+f"(o[9][1]), "+f"(o[9][2]), "+f"(o[9][3]), "+f"(o[10][0]), "+f"(o[10][1]), "+f"(o[10][2]), "+f"(o[10][3]), "+f"(o[11][0]), "+f"(o[11][1]), "+f"(o[11][2]), "+f"(o[11][3]), "+f"(o[12][0]), "+f"(o[12][1]), "+f"(o[12][2]), "+f"(o[12][3]), "+f"(o[13][0]), "+f"(o[13][1]), "+f"(o[13][2]), "+f"(o[13][3]), "+f"(o[14][0]), "+f"(o[14][1]), "+f"(o[14][2]), "+f"(o[14][3]), "+f"(o[15][0]), "+f"(o[15][1]), "+f"(o[15][2]), "+f"(o[15][3])

// This thread's shared-memory writes, visible to the async proxy (what wgmma reads through a descriptor).
__forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// An mbarrier at shared address `bar` expecting `count` arrivals per phase.
__forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}

// Release: this thread's earlier shared-memory writes (and reads) happen before the phase completes.
__forceinline__ void mbarrier_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}

// Acquire: returns once the phase of parity `parity` has completed (a fresh barrier is in phase 0, so parity
// 1 passes at once: the slots start empty).
__forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(bar), "r"(parity)
                     : "memory");
    } while (!done);
}

#endif
