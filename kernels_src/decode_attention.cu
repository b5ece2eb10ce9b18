// Flash-decoding over paged KV for decode and short verify steps (1..8 query rows per sequence), GQA.
//
// Sequence b owns query rows query_start[b] .. query_start[b+1] (Q rows, consecutive positions) and has
// L = context_lens[b] keys (already including this step's rows, written by rope_kv). Row j (0-based)
// attends causally to keys [0, L - Q + j]. For every q head h (kv head h / (Hq/Hkv)):
//   out[row, h] = sum_k softmax_k(scale * q[row, h] . K[k]) V[k]
// with K/V bf16, or int8 dequantized in registers as value * scale[page, slot, kv_head].
//
// Two kernels:
//   decode_attention_d{D}_{bf16,int8}_r{R}, D in {64, 128, 256}, R in {8, 32, 64}:
//     grid (num_splits, Hkv, B), block 128. Block (s, g, b) takes the R' = Q * (Hq/Hkv) rows of sequence b
//     that share kv head g (R' <= R, the instantiation's row capacity) and split s of b's pages (pages_per_split = ceil(ceil(L/64) / num_splits), page-aligned),
//     so each K/V tile is read from memory once for all heads of the group and all verify rows. Tiles of
//     kTileKeys keys (2-4 KiB of K) stream through a 3-stage cp.async pipeline; per tile: scores (thread
//     per (key, row group)), online softmax (warp per row), P.V (thread per (row group, dim pair)).
//     Writes unnormalized partials: acc f32 [num_splits, B * max_queries, Hq, D] and (max, sum) f32
//     [num_splits, B * max_queries, Hq, 2] in the log2 domain, row slot b * max_queries + j. A split with
//     no pages writes (-inf, 0) and no acc. Sequences with Q > max_queries (or Q = 0) are skipped: they
//     belong to prefill_attention in a mixed step.
//   decode_attention_combine: grid (B * max_queries, Hq), block 128: for the slots of decoded rows,
//     out = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp2(m_s - max_s m_s); splits with w_s = 0 are never
//     read (their acc is unwritten).
//
// Layout: q bf16 [T, Hq, D]; K, V [num_pages, 64, Hkv, D] bf16 or int8; k_scale, v_scale f32
// [num_pages, 64, Hkv] (int8 only, else null); block_tables int32 [B, max_pages]; context_lens int32 [B];
// query_start int32 [B+1]; out bf16 [T, Hq, D]. Static shared memory only (< 48 KiB, asserted per
// instantiation). Host contract: max_queries * Hq/Hkv <= R, num_splits <= kMaxSplits, Hq % Hkv == 0.
#include "attention_common.cuh"

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / 32;
constexpr int kMaxSplits = 256;
constexpr float kLog2e = 1.4426950408889634f;

template <int D, bool kInt8, int kMaxRows>
struct DecodeShape {
    static constexpr int kElemBytes = kInt8 ? 1 : 2;
    static constexpr int kRowBytes = D * kElemBytes;
    // Smaller tiles for the 64-row instantiations keep q + scores + stages under 48 KiB.
    static constexpr int kTileBytes = kMaxRows >= 64 ? 2048 : 4096;
    static constexpr int kTileKeys = kTileBytes / kRowBytes < 32 ? kTileBytes / kRowBytes : 32;
    static constexpr int kChunksPerRow = kRowBytes / 16;
    // Padded shared row: 16-byte reads of 8 consecutive keys land on distinct bank quads.
    static constexpr int kStride = kRowBytes + 16;
    static constexpr int kStages = 3;
    static constexpr int kScoreGroups = kDecodeThreads / kTileKeys;  // row groups in the score phase
    static constexpr int kPairs = D / 2;                             // dim pairs in the P.V phase
    static constexpr int kPvGroups = kDecodeThreads / kPairs;
    static constexpr int kRowsPerThread = kMaxRows / kPvGroups;
    static_assert(kPageSize % kTileKeys == 0, "a tile must never straddle two pages");
    static_assert(kTileKeys <= 32, "the softmax phase gives one key per lane");
    static_assert(kDecodeThreads % kTileKeys == 0 && kDecodeThreads % kPairs == 0, "thread mapping");
};

template <class S>
struct DecodeStage {
    alignas(16) unsigned char k[S::kTileKeys * S::kStride];
    alignas(16) unsigned char v[S::kTileKeys * S::kStride];
    float k_scale[S::kTileKeys];
    float v_scale[S::kTileKeys];
};

template <int D, class S, int kMaxRows>
struct DecodeSmem {
    DecodeStage<S> stage[S::kStages];
    alignas(16) unsigned short q[kMaxRows * D];  // bf16 bits, row r = j * group + hh
    float p[kMaxRows][S::kTileKeys];             // scores, then probabilities (times v_scale for int8)
    float m[kMaxRows];                           // running max (log2 domain)
    float l[kMaxRows];                           // running sum of probabilities
    float alpha[kMaxRows];                       // rescale of this tile: exp2(m_old - m_new)
};

// Everything a block needs to know about its (split, kv head, sequence).
struct DecodeWork {
    int seq, kv_head, group, row0, queries, rows, ctx, key_begin, key_end;
    int slot0, num_slots;  // first partial row slot of the sequence, slots in all (B * max_queries)
};

template <class S, class Smem>
__forceinline__ void load_tile(Smem& sm, int stage, int tile, const DecodeWork& w, const void* k_cache,
                               const void* v_cache, const float* k_scale, const float* v_scale,
                               const int* block_tables, int max_pages, int num_kv_heads, bool int8) {
    const int key0 = w.key_begin + tile * S::kTileKeys;
    const long long page = block_tables[(long long)w.seq * max_pages + key0 / kPageSize];
    const long long slot0 = page * kPageSize + key0 % kPageSize;
    DecodeStage<S>& st = sm.stage[stage];
    for (int c = threadIdx.x; c < S::kTileKeys * S::kChunksPerRow; c += kDecodeThreads) {
        const int key = c / S::kChunksPerRow;
        const int part = c % S::kChunksPerRow;
        const bool valid = key0 + key < w.key_end;
        const long long byte = valid ? kv_row_offset(slot0 + key, w.kv_head, num_kv_heads, 1) * S::kRowBytes + part * 16 : 0;
        cp_async16(st.k + key * S::kStride + part * 16, static_cast<const unsigned char*>(k_cache) + byte, valid);
        cp_async16(st.v + key * S::kStride + part * 16, static_cast<const unsigned char*>(v_cache) + byte, valid);
    }
    if (int8) {
        for (int key = threadIdx.x; key < S::kTileKeys; key += kDecodeThreads) {
            const bool valid = key0 + key < w.key_end;
            const long long index = valid ? (slot0 + key) * num_kv_heads + w.kv_head : 0;
            cp_async4(&st.k_scale[key], k_scale + index, valid);
            cp_async4(&st.v_scale[key], v_scale + index, valid);
        }
    }
}

// q . k over one 16-byte chunk of the key row: 8 bf16 or 16 int8 values (int8 scale applied by caller).
template <bool kInt8>
__forceinline__ float dot_chunk(const unsigned short* q, const unsigned char* k) {
    const uint4 kw = *reinterpret_cast<const uint4*>(k);
    const unsigned kwords[4] = {kw.x, kw.y, kw.z, kw.w};
    float dot = 0.0f;
    if constexpr (kInt8) {
        const uint4 qa = *reinterpret_cast<const uint4*>(q);
        const uint4 qb = *reinterpret_cast<const uint4*>(q + 8);
        const unsigned qwords[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            dot += bf16_lo(qwords[2 * i]) * int8_at(kwords[i], 0) + bf16_hi(qwords[2 * i]) * int8_at(kwords[i], 1);
            dot += bf16_lo(qwords[2 * i + 1]) * int8_at(kwords[i], 2) + bf16_hi(qwords[2 * i + 1]) * int8_at(kwords[i], 3);
        }
    } else {
        const uint4 qa = *reinterpret_cast<const uint4*>(q);
        const unsigned qwords[4] = {qa.x, qa.y, qa.z, qa.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) dot += bf16_lo(qwords[i]) * bf16_lo(kwords[i]) + bf16_hi(qwords[i]) * bf16_hi(kwords[i]);
    }
    return dot;
}

// Scores of the tile: thread (key, row group) computes rows rg, rg + kScoreGroups, ...; keys a row may not
// see (causal, or past the context) get -inf.
template <int D, bool kInt8, class S, class Smem>
__forceinline__ void tile_scores(Smem& sm, const DecodeStage<S>& st, int key0, const DecodeWork& w, float scale_log2) {
    const int key = threadIdx.x % S::kTileKeys;
    const int key_pos = key0 + key;
    const unsigned char* k_row = st.k + key * S::kStride;
    constexpr int kDimsPerChunk = 16 / S::kElemBytes;
    for (int r = threadIdx.x / S::kTileKeys; r < w.rows; r += S::kScoreGroups) {
        // Row r is query j = r / group; it sees keys up to L - Q + j, which also excludes every
        // zero-filled key past the context (key_end only cuts a split mid-page at the context end).
        const bool visible = key_pos <= w.ctx - w.queries + r / w.group;
        float score = neg_inf();
        if (visible) {
            float dot = 0.0f;
#pragma unroll
            for (int c = 0; c < S::kChunksPerRow; ++c) dot += dot_chunk<kInt8>(sm.q + r * D + c * kDimsPerChunk, k_row + c * 16);
            score = dot * scale_log2 * (kInt8 ? st.k_scale[key] : 1.0f);
        }
        sm.p[r][key] = score;
    }
}

// Online softmax, one warp per row: new running max, probabilities in place, rescale factor, running sum.
template <bool kInt8, class S, class Smem>
__forceinline__ void tile_softmax(Smem& sm, const DecodeStage<S>& st, const DecodeWork& w) {
    const int lane = threadIdx.x & 31;
    for (int r = threadIdx.x >> 5; r < w.rows; r += kDecodeWarps) {
        const float score = lane < S::kTileKeys ? sm.p[r][lane] : neg_inf();
        const float m_old = sm.m[r];
        const float m_new = fmaxf(m_old, warp_max(score));
        const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // a row with nothing visible yet stays at 0
        const float prob = exp2f(score - m_use);
        const float tile_sum = warp_sum(prob);
        if (lane < S::kTileKeys) sm.p[r][lane] = kInt8 ? prob * st.v_scale[lane] : prob;
        if (lane == 0) {
            const float alpha = exp2f(m_old - m_use);
            sm.alpha[r] = alpha;
            sm.l[r] = sm.l[r] * alpha + tile_sum;
            sm.m[r] = m_new;
        }
    }
}

// acc[row][dim pair] = acc * alpha + sum_k p[row][k] * V[k][pair]; thread (row group, pair).
template <int D, bool kInt8, class S, class Smem>
__forceinline__ void tile_pv(float (&acc)[S::kRowsPerThread][2], const Smem& sm, const DecodeStage<S>& st, const DecodeWork& w) {
    const int pair = threadIdx.x % S::kPairs;
    const int rg = threadIdx.x / S::kPairs;
#pragma unroll
    for (int i = 0; i < S::kRowsPerThread; ++i) {
        const int r = rg + i * S::kPvGroups;
        if (r < w.rows) {
            acc[i][0] *= sm.alpha[r];
            acc[i][1] *= sm.alpha[r];
        }
    }
    // Few rows per thread: unroll over keys for loads in flight; many: the row loop is unrolled already.
#pragma unroll(S::kRowsPerThread > 8 ? 1 : 4)
    for (int key = 0; key < S::kTileKeys; ++key) {
        float v0, v1;
        if constexpr (kInt8) {
            const unsigned short bytes = *reinterpret_cast<const unsigned short*>(st.v + key * S::kStride + pair * 2);
            v0 = int8_at(bytes, 0);
            v1 = int8_at(bytes, 1);
        } else {
            const unsigned word = *reinterpret_cast<const unsigned*>(st.v + key * S::kStride + pair * 4);
            v0 = bf16_lo(word);
            v1 = bf16_hi(word);
        }
#pragma unroll
        for (int i = 0; i < S::kRowsPerThread; ++i) {
            const int r = rg + i * S::kPvGroups;
            if (r < w.rows) {
                const float prob = sm.p[r][key];
                acc[i][0] += prob * v0;
                acc[i][1] += prob * v1;
            }
        }
    }
}

// Index of (split, row slot, q head) in the partial buffers, in units of one head row.
__forceinline__ long long partial_index(int split, int num_slots, int slot, int num_q_heads, int head) {
    return ((long long)split * num_slots + slot) * num_q_heads + head;
}

// Partial index of block row r (query r / group, head kv_head * group + r % group).
__forceinline__ long long partial_row(const DecodeWork& w, int split, int r, int num_q_heads) {
    return partial_index(split, w.num_slots, w.slot0 + r / w.group, num_q_heads, w.kv_head * w.group + r % w.group);
}

template <int D, bool kInt8, int kMaxRows>
__forceinline__ void decode_split(float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache,
                                  const void* v_cache, const float* k_scale, const float* v_scale,
                                  const int* block_tables, int max_pages, const int* context_lens,
                                  const int* query_start, int max_queries, int num_q_heads, int num_kv_heads, float scale) {
    using S = DecodeShape<D, kInt8, kMaxRows>;
    using Smem = DecodeSmem<D, S, kMaxRows>;
    static_assert(sizeof(Smem) <= 48 * 1024, "static shared memory limit");
    __shared__ Smem sm;

    DecodeWork w;
    w.seq = blockIdx.z;
    w.kv_head = blockIdx.y;
    w.group = num_q_heads / num_kv_heads;
    w.row0 = query_start[w.seq];
    w.queries = query_start[w.seq + 1] - w.row0;
    w.rows = w.queries * w.group;
    w.ctx = context_lens[w.seq];
    w.slot0 = w.seq * max_queries;
    w.num_slots = gridDim.z * max_queries;
    if (w.queries == 0 || w.queries > max_queries) return;  // nothing to do, or prefill_attention's
    if (w.rows > kMaxRows) __trap();  // host contract broken: refuse rather than drop rows silently
    const int split = blockIdx.x;
    const int pages = (w.ctx + kPageSize - 1) / kPageSize;
    const int pages_per_split = (pages + gridDim.x - 1) / gridDim.x;
    const int page_begin = split * pages_per_split;
    const int page_end = min(page_begin + pages_per_split, pages);

    if (page_begin >= page_end) {  // more splits than this sequence has pages: an empty partial
        for (int r = threadIdx.x; r < w.rows; r += kDecodeThreads) {
            const long long index = partial_row(w, split, r, num_q_heads);
            partial_ml[2 * index] = neg_inf();
            partial_ml[2 * index + 1] = 0.0f;
        }
        return;
    }
    w.key_begin = page_begin * kPageSize;
    w.key_end = min(page_end * kPageSize, w.ctx);
    const int num_tiles = (w.key_end - w.key_begin + S::kTileKeys - 1) / S::kTileKeys;

    for (int s = 0; s < S::kStages - 1; ++s) {
        if (s < num_tiles) load_tile<S>(sm, s, s, w, k_cache, v_cache, k_scale, v_scale, block_tables, max_pages, num_kv_heads, kInt8);
        cp_async_commit();
    }
    // q rows of the group (visible to all after the first barrier of the loop), softmax state.
    for (int c = threadIdx.x; c < w.rows * (D / 8); c += kDecodeThreads) {
        const int r = c / (D / 8);
        const int part = c % (D / 8);
        const bf16* src = q + ((long long)(w.row0 + r / w.group) * num_q_heads + w.kv_head * w.group + r % w.group) * D + part * 8;
        *reinterpret_cast<uint4*>(sm.q + r * D + part * 8) = *reinterpret_cast<const uint4*>(src);
    }
    for (int r = threadIdx.x; r < kMaxRows; r += kDecodeThreads) {
        sm.m[r] = neg_inf();
        sm.l[r] = 0.0f;
    }

    float acc[S::kRowsPerThread][2];
#pragma unroll
    for (int i = 0; i < S::kRowsPerThread; ++i) acc[i][0] = acc[i][1] = 0.0f;
    const float scale_log2 = scale * kLog2e;

    for (int tile = 0; tile < num_tiles; ++tile) {
        cp_async_wait<S::kStages - 2>();  // this thread's copies of `tile` have landed
        __syncthreads();                  // everyone's have; and everyone is done with tile - 1
        const int next = tile + S::kStages - 1;
        if (next < num_tiles) load_tile<S>(sm, next % S::kStages, next, w, k_cache, v_cache, k_scale, v_scale, block_tables, max_pages, num_kv_heads, kInt8);
        cp_async_commit();  // possibly empty: keeps the group count in step with the tile index

        const DecodeStage<S>& st = sm.stage[tile % S::kStages];
        tile_scores<D, kInt8, S>(sm, st, w.key_begin + tile * S::kTileKeys, w, scale_log2);
        __syncthreads();
        tile_softmax<kInt8, S>(sm, st, w);
        __syncthreads();
        tile_pv<D, kInt8, S>(acc, sm, st, w);
    }

    const int pair = threadIdx.x % S::kPairs;
    const int rg = threadIdx.x / S::kPairs;
#pragma unroll
    for (int i = 0; i < S::kRowsPerThread; ++i) {
        const int r = rg + i * S::kPvGroups;
        if (r < w.rows) {
            const long long index = partial_row(w, split, r, num_q_heads);
            *reinterpret_cast<float2*>(partial_acc + index * D + 2 * pair) = make_float2(acc[i][0], acc[i][1]);
        }
    }
    for (int r = threadIdx.x; r < w.rows; r += kDecodeThreads) {
        const long long index = partial_row(w, split, r, num_q_heads);
        partial_ml[2 * index] = sm.m[r];
        partial_ml[2 * index + 1] = sm.l[r];
    }
}

#define DECODE_KERNEL(D, KIND, INT8, R)                                                                        \
    extern "C" __global__ void __launch_bounds__(kDecodeThreads) decode_attention_d##D##_##KIND##_r##R(         \
        float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache, const void* v_cache,        \
        const float* k_scale, const float* v_scale, const int* block_tables, int max_pages,                    \
        const int* context_lens, const int* query_start, int max_queries, int num_q_heads, int num_kv_heads,   \
        float scale) {                                                                                         \
        decode_split<D, INT8, R>(partial_acc, partial_ml, q, k_cache, v_cache, k_scale, v_scale, block_tables, \
                                 max_pages, context_lens, query_start, max_queries, num_q_heads, num_kv_heads, \
                                 scale);                                                                       \
    }

#define DECODE_KERNELS(D, KIND, INT8) \
    DECODE_KERNEL(D, KIND, INT8, 8)   \
    DECODE_KERNEL(D, KIND, INT8, 32)  \
    DECODE_KERNEL(D, KIND, INT8, 64)

DECODE_KERNELS(64, bf16, false)
DECODE_KERNELS(128, bf16, false)
DECODE_KERNELS(256, bf16, false)
DECODE_KERNELS(64, int8, true)
DECODE_KERNELS(128, int8, true)
DECODE_KERNELS(256, int8, true)

extern "C" __global__ void __launch_bounds__(kDecodeThreads)
    decode_attention_combine(bf16* out, const float* partial_acc, const float* partial_ml, const int* query_start,
                             int num_splits, int num_seqs, int max_queries, int num_q_heads, int head_dim) {
    __shared__ float weight[kMaxSplits];
    __shared__ float inv_denominator;
    const int slot = blockIdx.x;
    const int head = blockIdx.y;
    const int seq = slot / max_queries;
    const int query = slot % max_queries;
    const int queries = query_start[seq + 1] - query_start[seq];
    if (queries > max_queries || query >= queries) return;  // a prefill sequence, or an unused slot
    const int num_slots = num_seqs * max_queries;
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        float m_max = neg_inf();
        for (int s = lane; s < num_splits; s += 32) m_max = fmaxf(m_max, partial_ml[2 * partial_index(s, num_slots, slot, num_q_heads, head)]);
        m_max = warp_max(m_max);
        float denominator = 0.0f;
        for (int s = lane; s < num_splits; s += 32) {
            const long long index = partial_index(s, num_slots, slot, num_q_heads, head);
            const float m = partial_ml[2 * index];
            const float w = m == neg_inf() ? 0.0f : exp2f(m - m_max);
            weight[s] = w;
            if (w > 0.0f) denominator += w * partial_ml[2 * index + 1];
        }
        denominator = warp_sum(denominator);
        if (lane == 0) inv_denominator = denominator > 0.0f ? 1.0f / denominator : 0.0f;
    }
    __syncthreads();
    const long long out_row = (long long)(query_start[seq] + query) * num_q_heads + head;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float value = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            if (weight[s] > 0.0f) value += weight[s] * partial_acc[partial_index(s, num_slots, slot, num_q_heads, head) * head_dim + d];
        }
        out[out_row * head_dim + d] = __float2bfloat16(value * inv_denominator);
    }
}
