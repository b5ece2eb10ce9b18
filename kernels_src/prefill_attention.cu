// Causal flash attention for prefill chunks, reading K/V from pages; GQA; bf16 tensor cores (mma.sync).
//
// Sequence b owns query rows query_start[b] .. query_start[b+1] (C rows: this step's chunk) and has
// L = context_lens[b] keys (the cached prefix plus this chunk, already written by rope_kv). Chunk row i sits
// at position L - C + i and attends to keys [0, L - C + i]:
//   out[row, h] = sum_k softmax_k(scale * q[row, h] . K[k, h / (Hq/Hkv)]) V[k, h / (Hq/Hkv)]
// S = Q K^T and O += P V run on mma.sync.m16n8k16 bf16 -> f32 (sm_80 .. sm_120a, no wgmma); online softmax
// in f32 (log2 domain); P is rounded to bf16 for the P.V product, the row sums stay f32.
//
// Layout: q bf16 [T, Hq, D]; K, V [num_pages, 64, Hkv, D] bf16 or int8 (+ f32 scales [num_pages, 64, Hkv],
// dequantized to bf16 while a tile is staged into shared memory); block_tables int32 [B, max_pages];
// context_lens int32 [B]; query_start int32 [B+1]; out bf16 [T, Hq, D]. Sequences with C <= decode_max_queries
// are skipped (decode_attention's in a mixed step).
// Launch: prefill_attention_d{64,128}_{bf16,int8}: grid (ceil(max_b C_b / 64), Hq, B), block 128
// (4 warps x 16 query rows = a 64-row query tile); blocks past their sequence's chunk exit at once.
// Key tiles are pages (64 keys); K of the next page loads (cp.async) during softmax and P.V, V of the next
// page during the next S. Static shared memory: K and V tiles, rows padded by 16 bytes so fragment loads
// and ldmatrix are conflict-free (34 KiB at D = 128). D = 256 is not instantiated (needs > 48 KiB).
#include "attention_common.cuh"

constexpr int kPrefillThreads = 128;
constexpr int kQueryTile = 64;  // 4 warps x 16 rows
constexpr int kKeyTile = kPageSize;
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct PrefillShape {
    static constexpr int kStride = D + 8;  // bf16 elements per shared row
    static constexpr int kKSteps = D / 16;  // k16 slices of the head dim in S = Q K^T
    static constexpr int kDimTiles = D / 8;  // n8 tiles of the head dim in O
};

// D = A(16x16, row) . B(16x8, col) + C with bf16 inputs and f32 accumulators.
__forceinline__ void mma_bf16(float (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four transposed 8x8 bf16 matrices; lanes 8i..8i+7 give the row addresses of matrix i.
__forceinline__ void ldmatrix_x4_trans(unsigned (&frag)[4], const unsigned short* row) {
    const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(address)
                 : "memory");
}

__forceinline__ unsigned shared_word(const unsigned short* p) {
    return *reinterpret_cast<const unsigned*>(p);
}

// Keys [0, valid_keys) of `page` for one kv head into a [64][kStride] bf16 tile; the rest zero-filled.
// bf16 goes through cp.async (waited for by the caller); int8 is dequantized in registers and stored.
template <int D, bool kInt8>
__forceinline__ void load_kv_tile(unsigned short* tile, const void* cache, const float* scales, long long page,
                                  int kv_head, int num_kv_heads, int valid_keys) {
    using P = PrefillShape<D>;
    constexpr int kDimsPerChunk = kInt8 ? 16 : 8;  // one 16-byte global load
    constexpr int kChunks = D / kDimsPerChunk;
    for (int i = threadIdx.x; i < kKeyTile * kChunks; i += kPrefillThreads) {
        const int key = i / kChunks;
        const int part = i % kChunks;
        const bool valid = key < valid_keys;
        const long long slot = page * kPageSize + key;
        const long long offset = valid ? kv_row_offset(slot, kv_head, num_kv_heads, D) + part * kDimsPerChunk : 0;
        unsigned short* dst = tile + key * P::kStride + part * kDimsPerChunk;
        if constexpr (kInt8) {
            uint4 raw = make_uint4(0, 0, 0, 0);
            float scale = 0.0f;
            if (valid) {
                raw = *reinterpret_cast<const uint4*>(static_cast<const signed char*>(cache) + offset);
                scale = scales[slot * num_kv_heads + kv_head];
            }
            const unsigned words[4] = {raw.x, raw.y, raw.z, raw.w};
            unsigned packed[8];
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                packed[2 * w] = pack_bf16x2(int8_at(words[w], 0) * scale, int8_at(words[w], 1) * scale);
                packed[2 * w + 1] = pack_bf16x2(int8_at(words[w], 2) * scale, int8_at(words[w], 3) * scale);
            }
            reinterpret_cast<uint4*>(dst)[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            reinterpret_cast<uint4*>(dst)[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
        } else {
            cp_async16(dst, static_cast<const bf16*>(cache) + offset, valid);
        }
    }
}

template <int D, bool kInt8>
__forceinline__ void prefill_attention(bf16* out, const bf16* q, const void* k_cache, const void* v_cache,
                                       const float* k_scale, const float* v_scale, const int* block_tables,
                                       int max_pages, const int* context_lens, const int* query_start,
                                       int decode_max_queries, int num_q_heads, int num_kv_heads, float scale) {
    using P = PrefillShape<D>;
    __shared__ alignas(16) unsigned short k_tile[kKeyTile * P::kStride];
    __shared__ alignas(16) unsigned short v_tile[kKeyTile * P::kStride];

    const int seq = blockIdx.z;
    const int head = blockIdx.y;
    const int row0 = query_start[seq];
    const int chunk = query_start[seq + 1] - row0;
    const int q_begin = blockIdx.x * kQueryTile;
    if (q_begin >= chunk || chunk <= decode_max_queries) return;
    const int ctx = context_lens[seq];
    const int first_pos = ctx - chunk;
    const int kv_head = head / (num_q_heads / num_kv_heads);
    const int key_end = first_pos + min(q_begin + kQueryTile, chunk);  // one past the last key the tile sees
    const int num_key_tiles = (key_end + kKeyTile - 1) / kKeyTile;
    const int* pages = block_tables + (long long)seq * max_pages;

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;  // mma groupID: fragment row (A, C) or column (B)
    const int c = lane & 3;   // mma threadID_in_group
    const int warp_row = warp * 16;

    // Q tile (rows past the chunk zero-filled) staged through k_tile into A fragments held for the block.
    for (int i = threadIdx.x; i < kQueryTile * (D / 8); i += kPrefillThreads) {
        const int r = i / (D / 8);
        const int part = i % (D / 8);
        const bool valid = q_begin + r < chunk;
        const long long offset = valid ? ((long long)(row0 + q_begin + r) * num_q_heads + head) * D + part * 8 : 0;
        cp_async16(k_tile + r * P::kStride + part * 8, q + offset, valid);
    }
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned qa[P::kKSteps][4];
#pragma unroll
    for (int ks = 0; ks < P::kKSteps; ++ks) {
        const unsigned short* base = k_tile + (warp_row + g) * P::kStride + ks * 16 + 2 * c;
        qa[ks][0] = shared_word(base);
        qa[ks][1] = shared_word(base + 8 * P::kStride);
        qa[ks][2] = shared_word(base + 8);
        qa[ks][3] = shared_word(base + 8 * P::kStride + 8);
    }
    __syncthreads();  // k_tile is overwritten by the first K page next

    load_kv_tile<D, kInt8>(k_tile, k_cache, k_scale, pages[0], kv_head, num_kv_heads, min(kKeyTile, ctx));
    cp_async_commit();
    load_kv_tile<D, kInt8>(v_tile, v_cache, v_scale, pages[0], kv_head, num_kv_heads, min(kKeyTile, ctx));
    cp_async_commit();

    float o[P::kDimTiles][4];
#pragma unroll
    for (int dt = 0; dt < P::kDimTiles; ++dt) o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    float m[2] = {neg_inf(), neg_inf()};  // rows g and g + 8 of this warp
    float l[2] = {0.0f, 0.0f};            // this thread's share of the row sums (reduced over the quad at the end)
    const int pos[2] = {first_pos + q_begin + warp_row + g, first_pos + q_begin + warp_row + g + 8};
    const float scale_log2 = scale * kLog2e;

    for (int kt = 0; kt < num_key_tiles; ++kt) {
        // Groups in flight here: K(kt), V(kt). Wait for K(kt).
        cp_async_wait<1>();
        __syncthreads();
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < P::kKSteps; ++ks) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const unsigned short* k_row = k_tile + (nt * 8 + g) * P::kStride + ks * 16 + 2 * c;
                mma_bf16(s[nt], qa[ks], shared_word(k_row), shared_word(k_row + 8));
            }
        }
        __syncthreads();  // every warp is done with k_tile
        const bool more = kt + 1 < num_key_tiles;
        if (more) load_kv_tile<D, kInt8>(k_tile, k_cache, k_scale, pages[kt + 1], kv_head, num_kv_heads, min(kKeyTile, ctx - (kt + 1) * kKeyTile));
        cp_async_commit();  // possibly empty, so the group count stays in step

        // Causal mask and online softmax. Rows past the chunk (pos >= L) see zero-filled keys past the
        // context; they stay finite and are never stored.
        float tile_max[2] = {neg_inf(), neg_inf()};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int key = kt * kKeyTile + nt * 8 + 2 * c + (e & 1);
                s[nt][e] = key <= pos[e >> 1] ? s[nt][e] * scale_log2 : neg_inf();
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nt][e]);
            }
        }
        float alpha[2], m_use[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
            tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
            const float m_new = fmaxf(m[h], tile_max[h]);
            m_use[h] = m_new == neg_inf() ? 0.0f : m_new;  // nothing visible yet: keep exp2 away from NaN
            alpha[h] = exp2f(m[h] - m_use[h]);
            m[h] = m_new;
        }
        float tile_sum[2] = {0.0f, 0.0f};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                s[nt][e] = exp2f(s[nt][e] - m_use[e >> 1]);
                tile_sum[e >> 1] += s[nt][e];
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + tile_sum[h];
#pragma unroll
        for (int dt = 0; dt < P::kDimTiles; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
        }

        // Groups in flight: V(kt), K(kt+1). Wait for V(kt).
        cp_async_wait<1>();
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) {
            // The accumulator layout of S tiles 2kk, 2kk+1 is the A-fragment layout of P[:, 16kk : 16kk+16].
            const unsigned pa[4] = {pack_bf16x2(s[2 * kk][0], s[2 * kk][1]), pack_bf16x2(s[2 * kk][2], s[2 * kk][3]),
                                    pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
            // ldmatrix.trans matrices: (keys +0..7, dims +0..7), (keys +8..15, dims +0..7), (keys +0..7,
            // dims +8..15), (keys +8..15, dims +8..15) = B fragments (b0, b1) of dim tiles 2dp and 2dp+1.
            const unsigned short* v_rows = v_tile + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * P::kStride + (lane >> 4) * 8;
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans(vb, v_rows + dp * 16);
                mma_bf16(o[2 * dp], pa, vb[0], vb[1]);
                mma_bf16(o[2 * dp + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // every warp is done with v_tile
        if (more) load_kv_tile<D, kInt8>(v_tile, v_cache, v_scale, pages[kt + 1], kv_head, num_kv_heads, min(kKeyTile, ctx - (kt + 1) * kKeyTile));
        cp_async_commit();
    }

    // Each row's sum is spread over the 4 threads of its quad.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = q_begin + warp_row + g + 8 * h;
        if (r >= chunk) continue;
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        bf16* dst = out + ((long long)(row0 + r) * num_q_heads + head) * D + 2 * c;
#pragma unroll
        for (int dt = 0; dt < P::kDimTiles; ++dt) {
            *reinterpret_cast<unsigned*>(dst + dt * 8) = pack_bf16x2(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv);
        }
    }
}

#define PREFILL_KERNEL(D, KIND, INT8)                                                                          \
    extern "C" __global__ void __launch_bounds__(kPrefillThreads) prefill_attention_d##D##_##KIND(              \
        bf16* out, const bf16* q, const void* k_cache, const void* v_cache, const float* k_scale,               \
        const float* v_scale, const int* block_tables, int max_pages, const int* context_lens,                 \
        const int* query_start, int decode_max_queries, int num_q_heads, int num_kv_heads, float scale) {      \
        enter_dependent_kernel();                                                                          \
        prefill_attention<D, INT8>(out, q, k_cache, v_cache, k_scale, v_scale, block_tables, max_pages,         \
                                   context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,   \
                                   scale);                                                                     \
    }

PREFILL_KERNEL(64, bf16, false)
PREFILL_KERNEL(128, bf16, false)
PREFILL_KERNEL(64, int8, true)
PREFILL_KERNEL(128, int8, true)
