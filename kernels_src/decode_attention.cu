// Flash-decoding over paged KV for decode and short verify steps (1..8 query rows per sequence), GQA.
//
// Sequence b owns query rows query_start[b] .. query_start[b+1] (Q rows, consecutive positions) and has
// L = context_lens[b] keys (already including this step's rows, written by rope_kv). Row j (0-based)
// attends causally to keys [0, L - Q + j]. For every q head h (kv head h / (Hq/Hkv)):
//   out[row, h] = sum_k softmax_k(scale * q[row, h] . K[k]) V[k]
// with K/V bf16, or int8 values times scale[page, slot, kv_head].
//
// Two kernels:
//   decode_attention_d{D}_{bf16,int8}, D in {64, 128, 256}: grid (num_splits * row_groups, Hkv, B),
//     block 128 (4 warps). Block (split * row_groups + rg, g, b) takes rows rg*8 .. rg*8+7 of the
//     Q * (Hq/Hkv) rows of sequence b that share kv head g (row r: query r / group, head g*group + r % group)
//     and split `split` of b's pages (pages_per_split = ceil(ceil(L/64) / num_splits), page-aligned).
//     Warp w takes keys w*16 .. w*16+15 of every page of the split: it loads them from global memory
//     straight into registers (16-byte loads; a step's K and V loads are in flight together), in the
//     layouts of mma.sync.m16n8k16 fragments, and keeps its own online softmax. The 4 warps merge in
//     shared memory once at the end: the main loop has no block-wide barrier.
//       S = Q K^T      A = q (8 real rows of 16), B = K (k = dims, n = 8 keys). A lane's 16-byte chunk of
//                      a K row is its B fragment as loaded: dims are permuted alike in q and K, which a
//                      dot product does not see.
//       O^T += V^T P^T A = V^T (m = 16 dims, k = 16 keys), B = P^T (k = keys, n = 8 rows): S's C fragment
//                      is P's B fragment as it lies; V words are re-paired by key with byte permutes.
//     bf16 KV: bf16 mma; P rounded to bf16 (as in prefill_attention). int8 KV: f16 mma on the exact
//     integer values (int8 -> f16 through the 0x6400 exponent trick, no conversion instructions); q
//     rounded to f16 (exact for bf16 values of magnitude 6.1e-5 .. 65504); P * v_scale * 256 rounded to
//     f16 (the 256 keeps small products out of f16's subnormals; it is divided out at the end, so v_scale
//     must stay below 255). Softmax in f32, log2 domain. Writes unnormalized partials: acc f32
//     [num_splits, B * max_queries, Hq, D] and (max, sum) f32 [num_splits, B * max_queries, Hq, 2], row slot
//     b * max_queries + j. A split with no pages (or no visible key) writes (-inf, 0). Sequences with
//     Q > max_queries (or Q = 0) are skipped: they belong to prefill_attention in a mixed step.
//   decode_attention_combine: grid (B * max_queries, Hq), block 128: for the slots of decoded rows,
//     out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp2(m_s - max_s m_s); splits with w_s = 0 are never
//     read (their acc may be unwritten). Warp 0 lists the splits with w_s > 0 (in split order); thread
//     (group, 4 dims) sums listed splits group, group + 128 / (D/4), ... It writes every decoded row's
//     output (one split or many), so the gated attention's output gate is applied here, before the one
//     rounding to bf16: out *= sigmoid(gate[row * gate_stride + h * D + d]) (gate bf16, e.g. the fused qkv
//     rows' gate columns; gate null: no gate, the store unchanged).
//
// Layout: q bf16 [T, Hq, D]; K, V [num_pages, 64, Hkv, D] bf16 or int8; k_scale, v_scale f32
// [num_pages, 64, Hkv] (int8 only, else null); block_tables int32 [B, max_pages]; context_lens int32 [B];
// query_start int32 [B+1]; out bf16 [T, Hq, D]; gate bf16, rows gate_stride apart (8-byte aligned; null: none).
// Static shared memory: the warps' merge buffer (16 KiB at D = 128). Host contract: row_groups * 8 >= max_queries * Hq/Hkv, num_splits <= kMaxSplits, Hq % Hkv == 0.
#include <cuda_fp16.h>

#include "attention_common.cuh"

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kRowsPerBlock = 8;   // n of the P.V mma
constexpr int kKeysPerWarp = 16;   // per page: two n8 key tiles of S, the k16 of P.V
constexpr int kMaxSplits = 256;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kInt8PScale = 256.0f;
constexpr unsigned kF16Magic = 0x64646464u;  // high bytes of f16 1024 + u, u a byte
constexpr unsigned kF16Bias = 0x64806480u;   // f16x2 (1152, 1152): 1024 + the 128 of the sign flip

static_assert(kPageSize == kDecodeWarps * kKeysPerWarp, "one page per block step: each warp's keys stay in a page");

template <int D, bool kInt8>
struct DecodeShape {
    static constexpr int kElemBytes = kInt8 ? 1 : 2;
    static constexpr int kChunkDims = 16 / kElemBytes;       // dims per 16-byte load
    static constexpr int kKChunks = D / (4 * kChunkDims);    // a K row is shared by the 4 lanes of a quad
    static constexpr int kSlices = D / 16;                   // k16 slices of S
    static constexpr int kSlicesPerChunk = kChunkDims / 4;   // a slice takes 4 dims of a lane's chunk
    static constexpr int kLaneDims = D / 8;                  // V dims owned by a lane (its mma group)
    static constexpr int kVWords = kLaneDims * kElemBytes / 4;
    static constexpr int kDimTiles = D / 16;                 // m16 tiles of O^T
    // At D = 256 K and V registers together would spill: V is loaded once S has consumed K.
    static constexpr bool kLateV = D > 128;
    static_assert(kKChunks >= 1 && kVWords % 2 == 0, "head dim too small for the fragment layout");
};

// Registers of one warp step: 16 keys of K (two tiles of 8) and V, and the int8 scales.
template <class S>
struct StepRegs {
    uint4 k[2][S::kKChunks];
    unsigned v[4][S::kVWords];  // keys 2t, 2t+1, 8+2t, 9+2t (t = lane % 4): the P fragment's keys
    float k_scale[4];
    float v_scale[4];
};

// KV is read once per step: keep it out of L1.
__forceinline__ uint4 load_kv16(const unsigned char* p, bool valid) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (valid) asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__forceinline__ uint2 load_kv8(const unsigned char* p, bool valid) {
    uint2 v = make_uint2(0u, 0u);
    if (valid) asm("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

template <int N>
__forceinline__ void load_words(unsigned (&w)[N], const unsigned char* p, bool valid) {
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const uint4 v = load_kv16(p + 16 * i, valid);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
    } else {
        static_assert(N == 2, "8- or 16n-byte lane slices");
        const uint2 v = load_kv8(p, valid);
        w[0] = v.x, w[1] = v.y;
    }
}

template <bool kF16>
__forceinline__ void mma16816(float (&c)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    if constexpr (kF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// Two sign-flipped int8 bytes of `x` (picked by `selector`, as bytes 0 and 2) -> their exact f16x2 values.
__forceinline__ unsigned int8x2_to_f16x2(unsigned flipped, unsigned selector) {
    const unsigned biased = __byte_perm(flipped, kF16Magic, selector);  // f16 1024 + (x + 128)
    unsigned out;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(out) : "r"(biased), "r"(kF16Bias));
    return out;
}

__forceinline__ unsigned pack_f16x2(float lo, float hi) {
    const __half2 pair = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const unsigned*>(&pair);
}

// Everything a block needs to know about its (split, row group, kv head, sequence).
struct DecodeWork {
    int seq, kv_head, group, row0, queries, rows, ctx, split, row_base;
    int slot0, num_slots;  // first partial row slot of the sequence, slots in all (B * max_queries)
};

__forceinline__ long long partial_index(int split, int num_slots, int slot, int num_q_heads, int head) {
    return ((long long)split * num_slots + slot) * num_q_heads + head;
}

// Partial index of sequence row r (query r / group, head kv_head * group + r % group).
__forceinline__ long long partial_row(const DecodeWork& w, int r, int num_q_heads) {
    return partial_index(w.split, w.num_slots, w.slot0 + r / w.group, num_q_heads, w.kv_head * w.group + r % w.group);
}

// q row `lane / 4` of the block as S's A fragment (rows 8..15 of the mma are zero): a0, a2 per slice.
template <int D, bool kInt8>
__forceinline__ void load_q(unsigned (&qa)[D / 16][2], const bf16* q, const DecodeWork& w, int num_q_heads) {
    using S = DecodeShape<D, kInt8>;
    const int lane = threadIdx.x & 31;
    const int r = w.row_base + (lane >> 2);
    const int t = lane & 3;
    const bool valid = r < w.rows;
    const bf16* row = q + ((long long)(w.row0 + (valid ? r : 0) / w.group) * num_q_heads + w.kv_head * w.group + (valid ? r : 0) % w.group) * D;
#pragma unroll
    for (int c = 0; c < S::kKChunks; ++c) {
        // The lane's K chunk c covers dims c * 4 * kChunkDims + t * kChunkDims + [0, kChunkDims).
        const bf16* src = row + (c * 4 + t) * S::kChunkDims;
        if constexpr (kInt8) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                uint4 v = valid ? *reinterpret_cast<const uint4*>(src + 8 * h) : make_uint4(0u, 0u, 0u, 0u);
                const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
                for (int i = 0; i < 2; ++i) {  // slice c*4 + 2h + i: dims 4i .. 4i+3 of this half
                    qa[c * 4 + 2 * h + i][0] = pack_f16x2(bf16_lo(words[2 * i]), bf16_hi(words[2 * i]));
                    qa[c * 4 + 2 * h + i][1] = pack_f16x2(bf16_lo(words[2 * i + 1]), bf16_hi(words[2 * i + 1]));
                }
            }
        } else {
            const uint4 v = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0u, 0u, 0u, 0u);
            qa[2 * c][0] = v.x, qa[2 * c][1] = v.y, qa[2 * c + 1][0] = v.z, qa[2 * c + 1][1] = v.w;
        }
    }
}

// K of the warp's 16 keys: lane (g, t) loads chunk c of keys g and 8 + g.
template <class S>
__forceinline__ void load_k(StepRegs<S>& regs, const unsigned char* k_cache, const float* k_scale, long long slot,
                            int key, int key_end, int kv_head, int num_kv_heads, bool int8) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    constexpr int kRowBytes = S::kChunkDims * 4 * S::kKChunks * S::kElemBytes;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
        const int offset = 8 * tile + g;
        const unsigned char* row = k_cache + kv_row_offset(slot + offset, kv_head, num_kv_heads, 1) * kRowBytes;
#pragma unroll
        for (int c = 0; c < S::kKChunks; ++c) regs.k[tile][c] = load_kv16(row + (c * 4 + t) * 16, key + offset < key_end);
    }
    if (int8) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int offset = 2 * t + (i & 1) + 8 * (i >> 1);
            regs.k_scale[i] = key + offset < key_end ? k_scale[(slot + offset) * num_kv_heads + kv_head] : 0.0f;
        }
    }
}

// V of the keys of P's fragment (2t, 2t+1, 8+2t, 9+2t), dims g * D/8 .. + D/8.
template <class S>
__forceinline__ void load_v(StepRegs<S>& regs, const unsigned char* v_cache, const float* v_scale, long long slot,
                            int key, int key_end, int kv_head, int num_kv_heads, bool int8) {
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    constexpr int kRowBytes = S::kLaneDims * 8 * S::kElemBytes;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int offset = 2 * t + (i & 1) + 8 * (i >> 1);
        const bool valid = key + offset < key_end;
        const unsigned char* row = v_cache + kv_row_offset(slot + offset, kv_head, num_kv_heads, 1) * kRowBytes;
        load_words(regs.v[i], row + g * S::kLaneDims * S::kElemBytes, valid);
        if (int8) regs.v_scale[i] = valid ? v_scale[(slot + offset) * num_kv_heads + kv_head] : 0.0f;
    }
}

// S for the lane's row g and keys 2t, 2t+1 (tile 0) and 8+2t, 9+2t (tile 1).
template <int D, bool kInt8>
__forceinline__ void step_scores(float (&s)[4], const unsigned (&qa)[D / 16][2], const StepRegs<DecodeShape<D, kInt8>>& regs) {
    using S = DecodeShape<D, kInt8>;
#pragma unroll
    for (int tile = 0; tile < 2; ++tile) {
        float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int slice = 0; slice < S::kSlices; ++slice) {
            const uint4 chunk = regs.k[tile][slice / S::kSlicesPerChunk];
            const unsigned words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
            unsigned b0, b1;
            if constexpr (kInt8) {  // slice = 4 dims (one word) of the chunk
                const unsigned flipped = words[slice % 4] ^ 0x80808080u;
                b0 = int8x2_to_f16x2(flipped, 0x4140);
                b1 = int8x2_to_f16x2(flipped, 0x4342);
            } else {  // slice = 4 dims (two words) of the chunk
                b0 = words[2 * (slice % 2)];
                b1 = words[2 * (slice % 2) + 1];
            }
            mma16816<kInt8>(c, qa[slice][0], 0u, qa[slice][1], 0u, b0, b1);
        }
        s[2 * tile] = c[0];
        s[2 * tile + 1] = c[1];
    }
}

// O^T += V^T P^T over the step's 16 keys; p holds the B fragment (P of keys 2t, 2t+1 | 8+2t, 9+2t).
template <int D, bool kInt8>
__forceinline__ void step_pv(float (&acc)[D / 16][4], const StepRegs<DecodeShape<D, kInt8>>& regs, unsigned p0, unsigned p1) {
    using S = DecodeShape<D, kInt8>;
    const auto& v = regs.v;
#pragma unroll
    for (int i = 0; i < S::kDimTiles; ++i) {
        // Tile i: dims d0 = g * D/8 + 2i (mma row g) and d0 + 1 (mma row g + 8).
        unsigned a0, a1, a2, a3;
        if constexpr (kInt8) {
            const unsigned selector = i & 1 ? 0x7362 : 0x5140;  // bytes (d0, d1) of keys (k0, k1), interleaved
            // The sign flip commutes with the byte permute: one XOR per pair of keys.
            const unsigned x01 = __byte_perm(v[0][i / 2], v[1][i / 2], selector) ^ 0x80808080u;
            const unsigned x23 = __byte_perm(v[2][i / 2], v[3][i / 2], selector) ^ 0x80808080u;
            a0 = int8x2_to_f16x2(x01, 0x4140), a1 = int8x2_to_f16x2(x01, 0x4342);
            a2 = int8x2_to_f16x2(x23, 0x4140), a3 = int8x2_to_f16x2(x23, 0x4342);
        } else {
            a0 = __byte_perm(v[0][i], v[1][i], 0x5410), a1 = __byte_perm(v[0][i], v[1][i], 0x7632);
            a2 = __byte_perm(v[2][i], v[3][i], 0x5410), a3 = __byte_perm(v[2][i], v[3][i], 0x7632);
        }
        mma16816<kInt8>(acc[i], a0, a1, a2, a3, p0, p1);
    }
}

// Per-warp online softmax state of row g (m, and this lane's share of l).
struct WarpSoftmax {
    float m = neg_inf();
    float l = 0.0f;
};

// One warp step: 16 keys starting at sequence position `key` in page `page` (keys >= key_end not read).
template <int D, bool kInt8>
__forceinline__ void warp_step(float (&acc)[D / 16][4], WarpSoftmax& sm, const unsigned (&qa)[D / 16][2], int page, int key,
                               int key_end, int limit, const void* k_cache, const void* v_cache, const float* k_scale,
                               const float* v_scale, int kv_head, int num_kv_heads, float scale_log2) {
    using S = DecodeShape<D, kInt8>;
    const int lane = threadIdx.x & 31;
    const int t = lane & 3;
    const long long slot = (long long)page * kPageSize + key % kPageSize;
    StepRegs<S> regs;
    load_k(regs, static_cast<const unsigned char*>(k_cache), k_scale, slot, key, key_end, kv_head, num_kv_heads, kInt8);
    if constexpr (!S::kLateV) load_v(regs, static_cast<const unsigned char*>(v_cache), v_scale, slot, key, key_end, kv_head, num_kv_heads, kInt8);

    float s[4];
    step_scores<D, kInt8>(s, qa, regs);
    float tile_max = neg_inf();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int position = key + 2 * t + (i & 1) + 8 * (i >> 1);
        // Invisible keys (causal, past the context, or an unused row: limit -1) get -inf.
        s[i] = position <= limit ? s[i] * scale_log2 * (kInt8 ? regs.k_scale[i] : 1.0f) : neg_inf();
        tile_max = fmaxf(tile_max, s[i]);
    }
    if constexpr (S::kLateV) load_v(regs, static_cast<const unsigned char*>(v_cache), v_scale, slot, key, key_end, kv_head, num_kv_heads, kInt8);
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(sm.m, tile_max);
    const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // a row with nothing visible yet stays at 0
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = exp2f(s[i] - m_use);
    const float alpha = exp2f(sm.m - m_use);
    sm.l = sm.l * alpha + (p[0] + p[1]) + (p[2] + p[3]);
    sm.m = m_new;

    // O^T's columns are rows 2t and 2t+1: their rescale factors live in lanes 8t and 8t + 4.
    const float alpha_even = __shfl_sync(0xffffffffu, alpha, 8 * t);
    const float alpha_odd = __shfl_sync(0xffffffffu, alpha, 8 * t + 4);
#pragma unroll
    for (int i = 0; i < S::kDimTiles; ++i) {
        acc[i][0] *= alpha_even, acc[i][2] *= alpha_even;
        acc[i][1] *= alpha_odd, acc[i][3] *= alpha_odd;
    }
    unsigned p0, p1;
    if constexpr (kInt8) {
        p0 = pack_f16x2(p[0] * regs.v_scale[0] * kInt8PScale, p[1] * regs.v_scale[1] * kInt8PScale);
        p1 = pack_f16x2(p[2] * regs.v_scale[2] * kInt8PScale, p[3] * regs.v_scale[3] * kInt8PScale);
    } else {
        p0 = pack_bf16x2(p[0], p[1]);
        p1 = pack_bf16x2(p[2], p[3]);
    }
    step_pv<D, kInt8>(acc, regs, p0, p1);
}

template <int D>
struct MergeSmem {
    float o[kDecodeWarps][kRowsPerBlock][D];
    float m[kDecodeWarps][kRowsPerBlock];
    float l[kDecodeWarps][kRowsPerBlock];
};

// Merge the 4 warps' (m, l, O^T) of the block's rows and write the split's partials.
template <int D, bool kInt8>
__forceinline__ void merge_and_store(MergeSmem<D>& sm, const float (&acc)[D / 16][4], WarpSoftmax state, const DecodeWork& w,
                                     float* partial_acc, float* partial_ml, int num_q_heads) {
    using S = DecodeShape<D, kInt8>;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    state.l += __shfl_xor_sync(0xffffffffu, state.l, 1);
    state.l += __shfl_xor_sync(0xffffffffu, state.l, 2);
    if (t == 0) {
        sm.m[warp][g] = state.m;
        sm.l[warp][g] = state.l;
    }
    __syncthreads();
    // This warp's weight for row r: exp2(m_warp - max over warps), 0 where the row saw nothing.
    auto weight = [&](int warp_index, int r) {
        float m_max = neg_inf();
#pragma unroll
        for (int i = 0; i < kDecodeWarps; ++i) m_max = fmaxf(m_max, sm.m[i][r]);
        return m_max == neg_inf() ? 0.0f : exp2f(sm.m[warp_index][r] - m_max);
    };
    constexpr float kUnscale = kInt8 ? 1.0f / kInt8PScale : 1.0f;
    const float w_even = weight(warp, 2 * t) * kUnscale, w_odd = weight(warp, 2 * t + 1) * kUnscale;
#pragma unroll
    for (int i = 0; i < S::kDimTiles; ++i) {
        const int d0 = g * S::kLaneDims + 2 * i;
        *reinterpret_cast<float2*>(&sm.o[warp][2 * t][d0]) = make_float2(acc[i][0] * w_even, acc[i][2] * w_even);
        *reinterpret_cast<float2*>(&sm.o[warp][2 * t + 1][d0]) = make_float2(acc[i][1] * w_odd, acc[i][3] * w_odd);
    }
    __syncthreads();
    const int rows_here = min(kRowsPerBlock, w.rows - w.row_base);
    for (int i = threadIdx.x; i < rows_here * (D / 4); i += kDecodeThreads) {
        const int r = i / (D / 4), d = 4 * (i % (D / 4));
        float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int k = 0; k < kDecodeWarps; ++k) {
            const float4 v = *reinterpret_cast<const float4*>(&sm.o[k][r][d]);
            sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
        }
        *reinterpret_cast<float4*>(partial_acc + partial_row(w, w.row_base + r, num_q_heads) * D + d) = sum;
    }
    if (threadIdx.x < rows_here) {
        const int r = threadIdx.x;
        float m_max = neg_inf(), l_sum = 0.0f;
#pragma unroll
        for (int k = 0; k < kDecodeWarps; ++k) m_max = fmaxf(m_max, sm.m[k][r]);
#pragma unroll
        for (int k = 0; k < kDecodeWarps; ++k) l_sum += weight(k, r) * sm.l[k][r];
        const long long index = partial_row(w, w.row_base + r, num_q_heads);
        partial_ml[2 * index] = m_max;
        partial_ml[2 * index + 1] = m_max == neg_inf() ? 0.0f : l_sum;
    }
}

template <int D, bool kInt8>
__forceinline__ void decode_split(float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache,
                                  const void* v_cache, const float* k_scale, const float* v_scale,
                                  const int* block_tables, int max_pages, const int* context_lens,
                                  const int* query_start, int max_queries, int num_q_heads, int num_kv_heads, float scale,
                                  int row_groups) {
    __shared__ MergeSmem<D> smem;
    DecodeWork w;
    w.seq = blockIdx.z;
    w.kv_head = blockIdx.y;
    w.group = num_q_heads / num_kv_heads;
    w.row0 = query_start[w.seq];
    w.queries = query_start[w.seq + 1] - w.row0;
    w.rows = w.queries * w.group;
    w.ctx = context_lens[w.seq];
    w.split = blockIdx.x / row_groups;
    w.row_base = (blockIdx.x % row_groups) * kRowsPerBlock;
    w.slot0 = w.seq * max_queries;
    w.num_slots = gridDim.z * max_queries;
    if (w.queries == 0 || w.queries > max_queries || w.row_base >= w.rows) return;  // prefill's, or no rows here
    const int num_splits = gridDim.x / row_groups;
    const int pages = (w.ctx + kPageSize - 1) / kPageSize;
    const int pages_per_split = (pages + num_splits - 1) / num_splits;
    const int page_begin = w.split * pages_per_split;
    const int page_end = min(page_begin + pages_per_split, pages);

    if (page_begin >= page_end) {  // more splits than this sequence has pages: an empty partial
        const int rows_here = min(kRowsPerBlock, w.rows - w.row_base);
        if (threadIdx.x < rows_here) {
            const long long index = partial_row(w, w.row_base + threadIdx.x, num_q_heads);
            partial_ml[2 * index] = neg_inf();
            partial_ml[2 * index + 1] = 0.0f;
        }
        return;
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int r = w.row_base + (lane >> 2);
    const int limit = r < w.rows ? w.ctx - w.queries + r / w.group : -1;  // last key row r sees
    const int key_end = min(page_end * kPageSize, w.ctx);
    const int* table = block_tables + (long long)w.seq * max_pages;

    unsigned qa[D / 16][2];
    load_q<D, kInt8>(qa, q, w, num_q_heads);
    float acc[D / 16][4];
#pragma unroll
    for (int i = 0; i < D / 16; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;
    WarpSoftmax state;
    const float scale_log2 = scale * kLog2e;

    int page = table[page_begin];
    for (int p = page_begin; p < page_end; ++p) {
        const int next = p + 1 < page_end ? table[p + 1] : 0;  // in flight during this step
        const int key = p * kPageSize + warp * kKeysPerWarp;
        if (key < key_end) {
            warp_step<D, kInt8>(acc, state, qa, page, key, key_end, limit, k_cache, v_cache, k_scale, v_scale, w.kv_head,
                                num_kv_heads, scale_log2);
        }
        page = next;
    }
    merge_and_store<D, kInt8>(smem, acc, state, w, partial_acc, partial_ml, num_q_heads);
}

// int8 steps hold half the bytes of bf16 ones: 4 resident blocks (16 warps) instead of 3 keep as many bytes
// in flight (register cap 128).
template <int D, bool kInt8>
constexpr int kMinBlocks = kInt8 && D <= 128 ? 4 : 1;

#define DECODE_KERNEL(D, KIND, INT8)                                                                           \
    extern "C" __global__ void __launch_bounds__(kDecodeThreads, kMinBlocks<D, INT8>) decode_attention_d##D##_##KIND(             \
        float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache, const void* v_cache,        \
        const float* k_scale, const float* v_scale, const int* block_tables, int max_pages,                    \
        const int* context_lens, const int* query_start, int max_queries, int num_q_heads, int num_kv_heads,   \
        float scale, int row_groups) {                                                                         \
        enter_dependent_kernel();                                                                          \
        decode_split<D, INT8>(partial_acc, partial_ml, q, k_cache, v_cache, k_scale, v_scale, block_tables,    \
                              max_pages, context_lens, query_start, max_queries, num_q_heads, num_kv_heads,    \
                              scale, row_groups);                                                              \
    }

DECODE_KERNEL(64, bf16, false)
DECODE_KERNEL(128, bf16, false)
DECODE_KERNEL(256, bf16, false)
DECODE_KERNEL(64, int8, true)
DECODE_KERNEL(128, int8, true)
DECODE_KERNEL(256, int8, true)

// Split weights of one (slot, head), by warp 0: every split wrote its (m, l) (an empty one (-inf, 0)), so all
// of them are loaded at once, in one round trip; the splits with weight > 0 are listed in split order.
struct CombineWeights {
    int split[kMaxSplits];
    float weight[kMaxSplits];
    int count;
    float inv_denominator;
};

__forceinline__ void combine_weights(CombineWeights& cw, const float* partial_ml, int num_splits, int num_slots, int slot,
                                     int num_q_heads, int head) {
    constexpr int kPerLane = kMaxSplits / 32;
    const int lane = threadIdx.x & 31;
    float2 ml[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const int s = lane + 32 * i;
        ml[i] = s < num_splits ? *reinterpret_cast<const float2*>(partial_ml + 2 * partial_index(s, num_slots, slot, num_q_heads, head))
                               : make_float2(neg_inf(), 0.0f);
    }
    float m_max = neg_inf();
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) m_max = fmaxf(m_max, ml[i].x);
    m_max = warp_max(m_max);
    float denominator = 0.0f;
    int count = 0;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
        const float w = ml[i].x == neg_inf() ? 0.0f : exp2f(ml[i].x - m_max);
        const unsigned listed = __ballot_sync(0xffffffffu, w > 0.0f);
        if (w > 0.0f) {
            const int at = count + __popc(listed & ((1u << lane) - 1u));
            cw.split[at] = lane + 32 * i;
            cw.weight[at] = w;
            denominator += w * ml[i].y;
        }
        count += __popc(listed);
    }
    denominator = warp_sum(denominator);
    if (lane == 0) {
        cw.count = count;
        cw.inv_denominator = denominator > 0.0f ? 1.0f / denominator : 0.0f;
    }
}

// The kernel sits between attention and o_proj on every layer's critical path, so it is built for latency:
// the rows' range and all (m, l) pairs are loaded together, then the acc rows of the listed splits (several
// in flight per thread): two dependent round trips to L2. Blocks of unused slots load the (m, l) pairs too
// (a few KB of L2 reads per layer) before they learn that they have no row.
extern "C" __global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_combine(bf16* out, const float* partial_acc, const float* partial_ml, const int* query_start,
                             int num_splits, int num_seqs, int max_queries, int num_q_heads, int head_dim,
                             const bf16* gate, int gate_stride) {
    enter_dependent_kernel();
    __shared__ CombineWeights cw;
    __shared__ float4 part[kDecodeThreads];
    const int slot = blockIdx.x;
    const int head = blockIdx.y;
    const int seq = slot / max_queries;
    const int query = slot % max_queries;
    const int first_row = query_start[seq];
    const int queries = query_start[seq + 1] - first_row;
    const int num_slots = num_seqs * max_queries;
    if (threadIdx.x < 32) combine_weights(cw, partial_ml, num_splits, num_slots, slot, num_q_heads, head);
    __syncthreads();
    if (queries > max_queries || query >= queries) return;  // a prefill sequence, or an unused slot
    // Thread (group, column): 4 dims of the listed splits group, group + groups, ...
    const int columns = head_dim / 4;
    const int groups = kDecodeThreads / columns;
    const int column = threadIdx.x % columns;
    const int group = threadIdx.x / columns;
    float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    const int count = cw.count;
#pragma unroll 4
    for (int i = group; i < count; i += groups) {
        const float w = cw.weight[i];
        const float4 v = *reinterpret_cast<const float4*>(partial_acc + partial_index(cw.split[i], num_slots, slot, num_q_heads, head) * head_dim + 4 * column);
        sum.x += w * v.x, sum.y += w * v.y, sum.z += w * v.z, sum.w += w * v.w;
    }
    part[threadIdx.x] = sum;
    __syncthreads();
    if (group != 0) return;
    for (int g = 1; g < groups; ++g) {
        const float4 v = part[g * columns + column];
        sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const float scale = cw.inv_denominator;
    const long long row = first_row + query;
    float4 o = make_float4(sum.x * scale, sum.y * scale, sum.z * scale, sum.w * scale);
    if (gate != nullptr) {
        const uint2 g = *reinterpret_cast<const uint2*>(gate + row * gate_stride + (long long)head * head_dim + 4 * column);
        o = make_float4(gated(o.x, bf16_lo(g.x)), gated(o.y, bf16_hi(g.x)), gated(o.z, bf16_lo(g.y)), gated(o.w, bf16_hi(g.y)));
    }
    const uint2 packed = make_uint2(pack_bf16x2(o.x, o.y), pack_bf16x2(o.z, o.w));
    *reinterpret_cast<uint2*>(out + (row * num_q_heads + head) * head_dim + 4 * column) = packed;
}
