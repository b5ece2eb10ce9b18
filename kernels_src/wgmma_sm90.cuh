// Hopper warpgroup-MMA (wgmma) building blocks of the sm_90a prefill attention kernels (prefill_attention_sm90.cu,
// bf16 and widened int8 KV at head_dim 128 and 256; prefill_attention_sm90_int8.cu, int8 KV at 128): 128-byte-swizzled tiles and
// S = Q K^T (Q from shared memory or registers) and O += P V over them (hopper_sm90.cuh: the swizzle, the
// descriptors, fences and barriers), and the cp.async copies of Q's rows and of a page. Empty unless compiled
// for sm_90a. Included after prefill_common.cuh; part of the including files' cache keys.
#pragma once
#include "hopper_sm90.cuh"
#include "prefill_common.cuh"

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr int kQHalf = kFlashRows * kSwizzleRow;       // one 64-dim half of Q
constexpr int kPageHalf = kKeyTile * kSwizzleRow;      // one 64-dim half of a K or V page

#define WGMMA_S_REGS "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}"
#define WGMMA_S_OPERANDS(s) "+f"(s[0][0]), "+f"(s[0][1]), "+f"(s[0][2]), "+f"(s[0][3]), "+f"(s[1][0]), "+f"(s[1][1]), "+f"(s[1][2]), "+f"(s[1][3]), "+f"(s[2][0]), "+f"(s[2][1]), "+f"(s[2][2]), "+f"(s[2][3]), "+f"(s[3][0]), "+f"(s[3][1]), "+f"(s[3][2]), "+f"(s[3][3]), "+f"(s[4][0]), "+f"(s[4][1]), "+f"(s[4][2]), "+f"(s[4][3]), "+f"(s[5][0]), "+f"(s[5][1]), "+f"(s[5][2]), "+f"(s[5][3]), "+f"(s[6][0]), "+f"(s[6][1]), "+f"(s[6][2]), "+f"(s[6][3]), "+f"(s[7][0]), "+f"(s[7][1]), "+f"(s[7][2]), "+f"(s[7][3])

// s (= or +=) Q[64 rows, 16 dims] K[64 keys, 16 dims]^T, both from shared memory: bf16 (bf16 KV) or f16
// (widened int8 KV: K's dequantized values as f16).
template <bool kF16>
__forceinline__ void wgmma_qk(float (&s)[8][4], unsigned long long q_desc, unsigned long long k_desc, int accumulate) {
    if constexpr (kF16) {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WGMMA_S_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WGMMA_S_OPERANDS(s)
                     : "l"(q_desc), "l"(k_desc), "r"(accumulate));
    } else {
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WGMMA_S_REGS ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                     : WGMMA_S_OPERANDS(s)
                     : "l"(q_desc), "l"(k_desc), "r"(accumulate));
    }
}

// The same in f16 with Q's A fragments in registers (int8 KV: exact int8 values of K as f16).
__forceinline__ void wgmma_qk(float (&s)[8][4], const unsigned (&q)[4], unsigned long long k_desc, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WGMMA_S_REGS ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : WGMMA_S_OPERANDS(s)
                 : "r"(q[0]), "r"(q[1]), "r"(q[2]), "r"(q[3]), "l"(k_desc), "r"(accumulate));
}

// o += P[64 rows, 16 keys] (registers) V[16 keys, 128 dims].
template <bool kF16>
__forceinline__ void wgmma_pv(float (&o)[16][4], const unsigned (&p)[4], unsigned long long v_desc) {
    if constexpr (kF16) {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " WGMMA_O_REGS ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                     : WGMMA_O_OPERANDS(o)
                     : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v_desc));
    } else {
        asm volatile("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " WGMMA_O_REGS ", {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
                     : WGMMA_O_OPERANDS(o)
                     : "r"(p[0]), "r"(p[1]), "r"(p[2]), "r"(p[3]), "l"(v_desc));
    }
}

// Q's M rows row0 .. row0 + kThreads / 2 - 1 of a tile into the swizzled Q tile at `q_tile` (padding rows and
// rows past the chunk zero-filled), copied by thread `tid` of kThreads (cp.async): chunk i = tid + kThreads j,
// row row0 + i / (D / 8), 16-byte chunk i % (D / 8), in the 64-dim half chunk / 8. q_rows_to_f16 converts the
// same chunks in place once they landed.
template <int kThreads, int D>
__forceinline__ unsigned q_chunk_at(unsigned q_tile, int row0, int tid, int j, int& row, int& chunk) {
    constexpr int kRowShift = D == 256 ? 5 : 4;  // log2 of the 16-byte chunks per row, D / 8
    static_assert(D == 128 || D == 256, "Q tiles of 128 or 256 dims");
    const int i = tid + j * kThreads;
    row = row0 + (i >> kRowShift);
    chunk = i & ((1 << kRowShift) - 1);
    return q_tile + (chunk >> 3) * kQHalf + swizzled(row, chunk);
}

template <int kThreads, int D = 128>
__forceinline__ void copy_q_rows(unsigned q_tile, const PrefillTile& t, const bf16* q, int kv_head, int num_q_heads,
                                 int row0, int tid) {
    for (int j = 0; j < D / 16; ++j) {
        int r, chunk;
        const unsigned to = q_chunk_at<kThreads, D>(q_tile, row0, tid, j, r, chunk);
        const int qi = tile_query(t, r);
        const bf16* src = qi >= 0 ? q + tile_row_offset(t, r, qi, kv_head, num_q_heads, D) + chunk * 8 : q;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(qi >= 0 ? 16 : 0));
    }
}

// The chunks copy_q_rows<kThreads, D> gave thread `tid`, bf16 -> f16 in place (`q` points at the tile's
// shared-memory bytes, `q_tile` is their shared address): the f16 MMAs' Q.
template <int kThreads, int D = 128>
__forceinline__ void q_rows_to_f16(unsigned char* q, unsigned q_tile, int row0, int tid) {
    for (int j = 0; j < D / 16; ++j) {
        int r, chunk;
        uint4* at = reinterpret_cast<uint4*>(q + (q_chunk_at<kThreads, D>(q_tile, row0, tid, j, r, chunk) - q_tile));
        const uint4 v = *at;
        *at = make_uint4(bf16x2_to_f16x2(v.x), bf16x2_to_f16x2(v.y), bf16x2_to_f16x2(v.z), bf16x2_to_f16x2(v.w));
    }
}

// Keys [0, valid_keys) of `page` for one kv head into shared memory at `dst`, copied by thread `tid` of
// kThreads (cp.async, zero-filled past valid_keys): bf16 straight into a swizzled page tile (D / 64 halves of
// kPageHalf); int8 as the raw page, [64][D] bytes.
template <bool kInt8, int kThreads, int D = 128>
__forceinline__ void copy_page(unsigned dst, const void* cache, long long page, int kv_head, int num_kv_heads, int valid_keys, int tid) {
    constexpr int kChunks = kInt8 ? D / 16 : D / 8;  // 16-byte chunks per key row
    const unsigned char* base = static_cast<const unsigned char*>(cache);
#pragma unroll
    for (int j = 0; j < kKeyTile * kChunks / kThreads; ++j) {
        const int i = tid + j * kThreads;
        const int key = i / kChunks, chunk = i % kChunks;
        const bool valid = key < valid_keys;
        const unsigned char* src = valid ? base + ((page * kPageSize + key) * num_kv_heads + kv_head) * (kChunks * 16) + chunk * 16 : base;
        const unsigned to = dst + (kInt8 ? i * 16 : (chunk >> 3) * kPageHalf + swizzled(key, chunk));
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src), "r"(valid ? 16 : 0));
    }
}
#endif
