// Gated DeltaNet: the chunked delta rule split into three passes, so that only the state update is sequential.
//
// Same math, prologue, tables and targets as gdn_chunked_d{dk}_c{group} (gdn_delta_rule.cu, whose header
// defines them), for the sequences of more than 8 rows of a step; per (chunk, value head), UT/WY form:
//   cum = cumsum(g),  D_ij = e^(cum_i - cum_j),  A = strict_tril(beta k k^T * D),  T = (I + A)^-1,
//   w = T (beta e^cum k),  u = T (beta v)                                  state-independent: pass 1
//   v_new = u - w S,  S' = e^cum_last S + (k e^(cum_last - cum))^T v_new  sequential over chunks: pass 2
//   o = e^cum q S + tril(q k^T * D) v_new                                  given S before the chunk: pass 3
// Chunks: cut at multiples of 64 from the sequence's first row and at every row count the targets may ask for
// (len - S + 1 .. len - 1, padded targets included, so the chunks follow from the query lengths and the target
// width alone); chunk_point gives the c-th cut in closed form (gdn_split_plan.py mirrors it). The chunks of
// the step's chunked sequences are numbered consecutively (chunk_base): the number indexes the stored states.
//
// Workspace (gdn_split_plan.SplitWorkspace), by flat row: q, k normalised f32 [T, Hk, dk] (written by the
// first value head of each key head), w [T, Hv, 2, dk] as bf16 hi/lo planes (SplitPlanes), u f32 [T, Hv, dv]
// (pass 2 overwrites it with v_new), cum f32 [T, Hv]; by chunk number: h f32 [chunks, Hv, dk, dv], the state
// before the chunk, and kt [chunks, Hk, 2, dk, 64], the chunk's k^T zero-padded to 64 rows as bf16 planes.
// The sequential pass's operands come split (w, k^T) or are split once per chunk (S, e^(last - cum) v_new)
// instead of by every warp at every fragment load: its chunk loop is ~1,390 SASS instructions a warp on
// sm_90a (nvdisasm: 24 HMMA a 32-deep step of v_new = u - w S, 12 a 16-deep step of the update) against
// ~2,170 when every fragment was split from f32.
//
// Launch shapes, block 256 (8 warps, the split-bf16 warp tiles of gdn_split_mma.cuh):
//   gdn_split_terms_d{dk}:       grid (max chunks of a sequence, Hv, B); blocks past their sequence's chunks exit.
//   gdn_split_carry_d{dk}_c{cv}: grid (dv / cv, Hv, B), each walking its sequence's chunks in order.
//   gdn_split_out_d{dk}:         grid (max chunks of a sequence, Hv, B).
// Every pass issues its global reads before it first waits on any: the raw q and k rows and the rows of w,
// k^T, q and k by cp.async, the next value columns (passes 1 and 3) or the next chunk's w, u and cum (pass 2)
// while the current product runs. Shared memory (split_smem_bytes in linear_attn_ops.py mirrors it) at dk 128:
// terms 75 KiB, carry 96 KiB (cv 32) / 83 KiB (cv 16), out 92 KiB: all fit sm_120's 99 KiB; two blocks per
// H200 SM. Measured times: docs/findings.md ("The chunked delta rule split in three passes").
#include "attention_common.cuh"
#include "gdn_delta_rule_common.cuh"
#include "gdn_split_mma.cuh"

constexpr int kSplitThreads = 256;  // kSplitMmaWarps warps
constexpr int kOutputColumns = 32;  // value columns per step of the passes that cover a whole head (u, o)

// Row stride in shared memory of a `columns`-wide tile read as split_mma's b operand: lane (g, t) reads rows
// 2t, 2t + 1 at column g, so rows 4 floats longer than a multiple of 32 land on 32 distinct banks (a stride of
// 32 would put all four t of a column on one bank).
constexpr int operand_stride(int columns) {
    return columns + 4;
}
constexpr int kOutputStride = operand_stride(kOutputColumns);

// Row stride, in bf16, of a split plane whose rows hold `depth` reduction indices: a fragment word of lane
// (g, t) is word 4 g + t of a 32-bank window (the rows are 16 bytes longer than a multiple of 128), and the
// rows stay 16-byte aligned for cp.async.
constexpr int plane_stride(int depth) {
    return depth + 8;
}

struct SplitWorkspace {
    float* q;    // [T, Hk, DK]
    float* k;    // [T, Hk, DK]
    bf16* w;     // [T, Hv, 2, DK]: hi plane, lo plane (SplitPlanes)
    float* u;    // [T, Hv, dv]: u, then v_new
    float* cum;  // [T, Hv]
    float* h;    // [chunks, Hv, DK, dv]
    bf16* kt;    // [chunks, Hk, 2, DK, 64]: k^T of the chunk's rows (zero past them), hi plane, lo plane
};

// The hi/lo planes of row `row`'s w for value head `head`.
template <int DK>
__forceinline__ SplitPlanes w_planes(const SplitWorkspace& ws, long long row, int value_heads, int head) {
    bf16* hi = ws.w + (row * value_heads + head) * 2 * DK;
    return {hi, hi + DK, value_heads * 2 * DK};  // stride: to the same head's next row
}

// The hi/lo planes of k^T for chunk `number` and key head `key_head`: rows of 64 bf16, one per key dim.
template <int DK>
__forceinline__ SplitPlanes kt_planes(const SplitWorkspace& ws, int number, int key_heads, int key_head) {
    bf16* hi = ws.kt + ((long long)number * key_heads + key_head) * 2 * DK * kChunk;
    return {hi, hi + DK * kChunk, kChunk};
}

// -- chunks ---------------------------------------------------------------------------------------------

__forceinline__ int first_extra_cut(int length, int num_targets) {
    return max(1, length - num_targets + 1);
}

__forceinline__ int chunk_count(int length, int num_targets) {
    int extra = 0;
    for (int n = first_extra_cut(length, num_targets); n < length; ++n) extra += n % kChunk != 0;
    return 1 + (length - 1) / kChunk + extra;
}

// The row count where chunk c starts (c = chunk_count: the length): the extra cut whose place among the sorted
// cuts is c, else the multiple of 64 left after the extra cuts placed before c.
__forceinline__ int chunk_point(int length, int num_targets, int c) {
    if (c == 0) return 0;
    int before = 0, rank = 0;
    for (int n = first_extra_cut(length, num_targets); n < length; ++n) {
        if (n % kChunk == 0) continue;
        const int place = 1 + (n - 1) / kChunk + rank++;
        if (place == c) return n;
        before += place < c;
    }
    return min(length, kChunk * (c - before));
}

// The number of sequence `seq`'s first chunk: the chunks of the chunked sequences before it.
__forceinline__ int chunk_base(const int* query_start, int seq, int num_targets) {
    int base = 0;
    for (int b = 0; b < seq; ++b) {
        const int length = query_start[b + 1] - query_start[b];
        if (length > kRecurrentMaxRows) base += chunk_count(length, num_targets);
    }
    return base;
}

struct SplitChunk {
    long long first;  // flat row
    int rows;         // 0: no such chunk
    int number;
};

// Chunk c of sequence seq, for the per-chunk passes.
__forceinline__ SplitChunk find_chunk(const DeltaRuleArgs& p, int seq, int c) {
    const SequenceRows rows = sequence_rows(p.query_start, seq);
    const int targets = p.states.num_targets;
    if (rows.length <= kRecurrentMaxRows || c >= chunk_count(rows.length, targets)) return {0, 0, 0};
    const int start = chunk_point(rows.length, targets, c);
    return {rows.first + start, chunk_point(rows.length, targets, c + 1) - start, chunk_base(p.query_start, seq, targets) + c};
}

// A ROWS x COLUMNS block of f32 rows `src_stride` apart, rows >= `rows` zero, staged through registers: every
// thread issues all its 16-byte loads before any store, so a block costs one memory latency, not one per row.
template <int ROWS, int COLUMNS>
struct Block {
    static constexpr int kQuads = ROWS * COLUMNS / 4, kPerThread = (kQuads + kSplitThreads - 1) / kSplitThreads;
    float4 values[kPerThread];

    __forceinline__ void fetch(const float* src, long long src_stride, int rows) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int quad = threadIdx.x + i * kSplitThreads, r = quad / (COLUMNS / 4), c = 4 * (quad % (COLUMNS / 4));
            values[i] = quad < kQuads && r < rows ? *reinterpret_cast<const float4*>(src + r * src_stride + c) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        }
    }

    // from tile[r * stride + c], all of its rows
    __forceinline__ void take(const float* tile, int stride) {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int quad = threadIdx.x + i * kSplitThreads, r = quad / (COLUMNS / 4), c = 4 * (quad % (COLUMNS / 4));
            if (quad >= kQuads) continue;
            const float* at = tile + r * stride + c;
            values[i] = make_float4(at[0], at[1], at[2], at[3]);
        }
    }

    // to rows `dst_stride` apart, 16 bytes a store
    __forceinline__ void store(float* dst, long long dst_stride) const {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int quad = threadIdx.x + i * kSplitThreads, r = quad / (COLUMNS / 4), c = 4 * (quad % (COLUMNS / 4));
            if (quad < kQuads) *reinterpret_cast<float4*>(dst + r * dst_stride + c) = values[i];
        }
    }

    // into tile[r * stride + c]
    __forceinline__ void put(float* tile, int stride) const {
#pragma unroll
        for (int i = 0; i < kPerThread; ++i) {
            const int quad = threadIdx.x + i * kSplitThreads, r = quad / (COLUMNS / 4), c = 4 * (quad % (COLUMNS / 4));
            if (quad >= kQuads) continue;
            float* dst = tile + r * stride + c;
            dst[0] = values[i].x;
            dst[1] = values[i].y;
            dst[2] = values[i].z;
            dst[3] = values[i].w;
        }
    }
};

// cum of the chunk's rows for value head `head` into cum[64] (padding rows 0), by the first 64 threads.
__forceinline__ void load_cum(float* cum, const SplitWorkspace& ws, long long first, int length, int value_heads, int head) {
    if (threadIdx.x < kChunk) cum[threadIdx.x] = threadIdx.x < length ? ws.cum[(first + threadIdx.x) * value_heads + head] : 0.0f;
}

__forceinline__ float* row_at(float* base, long long row, int heads, int head, int width) {
    return base + (row * heads + head) * width;
}

// -- pass 1: the chunk's terms ------------------------------------------------------------------------------

// k [64][DK+4], A and T [64][64] (before the inverse: the raw q and k rows, bf16 [2][64][DK]), beta v of 32
// columns [64][36], cum, beta, beta e^cum [64].
template <int DK>
struct TermsSmem {
    static constexpr int kKeyStride = operand_stride(DK);
    static constexpr int kFloats = kChunk * kKeyStride + 2 * kChunk * kChunk + kChunk * kOutputStride + 3 * kChunk;
    static_assert(2 * kChunk * DK * sizeof(bf16) <= 2 * kChunk * kChunk * sizeof(float), "the raw rows fit A and T");
    float *k, *a, *t, *v, *cum, *beta, *scale;
    bf16* raw;

    __device__ explicit TermsSmem(float* base)
        : k(base), a(k + kChunk * kKeyStride), t(a + kChunk * kChunk), v(t + kChunk * kChunk), cum(v + kChunk * kOutputStride),
          beta(cum + kChunk), scale(beta + kChunk), raw(reinterpret_cast<bf16*>(a)) {}
};

// The chunk's raw q and k rows (bf16, q's 64 rows first) copied into `raw` with cp.async, zeros past its rows.
template <int DK>
__forceinline__ void copy_raw_qk(bf16* raw, const DeltaRuleArgs& p, const SplitChunk& chunk, int key_head) {
    constexpr int kRowQuads = DK / 8, kQuads = 2 * kChunk * kRowQuads;
    static_assert(kQuads % kSplitThreads == 0, "whole rounds of 16-byte copies");
    const long long channels = p.conv_channels(DK);
#pragma unroll
    for (int i = 0; i < kQuads / kSplitThreads; ++i) {
        const int quad = threadIdx.x + i * kSplitThreads, half = quad / (kChunk * kRowQuads);
        const int r = quad / kRowQuads % kChunk, c = 8 * (quad % kRowQuads);
        const bool valid = r < chunk.rows;
        const bf16* src = p.conv + (chunk.first + r) * channels + half * p.key_heads * DK + key_head * DK + c;
        cp_async16(raw + (half * kChunk + r) * DK + c, valid ? src : p.conv, valid);
    }
    cp_async_commit();
}

// 32 value columns of the chunk's v rows (bf16), one 16-byte load a thread: row tid / 4, columns 8 (tid % 4).
struct ValueColumns {
    static_assert(kChunk * kOutputColumns == 8 * kSplitThreads, "one 16-byte load a thread");
    uint4 raw;

    __forceinline__ void fetch(const DeltaRuleArgs& p, const SplitChunk& chunk, long long channels, int v_column) {
        const int r = threadIdx.x / 4, c = 8 * (threadIdx.x % 4);
        raw = r < chunk.rows ? *reinterpret_cast<const uint4*>(p.conv + (chunk.first + r) * channels + v_column + c)
                             : make_uint4(0u, 0u, 0u, 0u);
    }

    // beta v into v[64][kOutputStride]
    __forceinline__ void put_scaled(float* v, const float* beta) const {
        const int r = threadIdx.x / 4, c = 8 * (threadIdx.x % 4);
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = __bfloat1622float2(pairs[i]);
            v[r * kOutputStride + c + 2 * i] = beta[r] * f.x;
            v[r * kOutputStride + c + 2 * i + 1] = beta[r] * f.y;
        }
    }
};

// The chunk's rows normalised from the raw copy, a warp a row: k into shared memory, q and k into the
// workspace where this block writes them (one value head per key head does).
template <int DK>
__forceinline__ void normalise_rows(const TermsSmem<DK>& sm, const DeltaRuleArgs& p, const SplitWorkspace& ws, const SplitChunk& chunk,
                                    int key_head, bool stores_qk) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = warp; r < kChunk; r += kSplitThreads / 32) {
        float qv[DK / 32], kv[DK / 32];
#pragma unroll
        for (int e = 0; e < DK / 32; ++e) {
            qv[e] = __bfloat162float(sm.raw[r * DK + lane + 32 * e]);
            kv[e] = __bfloat162float(sm.raw[(kChunk + r) * DK + lane + 32 * e]);
        }
        l2_normalise_qk<DK>(qv, kv);
        const long long row = chunk.first + r;
        float* q_out = row_at(ws.q, row, p.key_heads, key_head, DK);
        float* k_out = row_at(ws.k, row, p.key_heads, key_head, DK);
#pragma unroll
        for (int e = 0; e < DK / 32; ++e) {
            sm.k[r * sm.kKeyStride + lane + 32 * e] = kv[e];
            if (r < chunk.rows && stores_qk) {
                q_out[lane + 32 * e] = qv[e];
                k_out[lane + 32 * e] = kv[e];
            }
        }
    }
}

// k^T of the chunk (sm.k [64][DK + 4], zero rows past the chunk) into its planes in the workspace, a warp
// covering 8 key dims x 4 row pairs at a time: the reads hit 32 banks, every 4 lanes store 16 bytes.
template <int DK>
__forceinline__ void store_kt(const float* k, const SplitPlanes& kt) {
    constexpr int kBlocks = (DK / 8) * (kChunk / 8);
    static_assert(kBlocks % (kSplitThreads / 32) == 0, "whole rounds of warp blocks");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 4
    for (int block = warp; block < kBlocks; block += kSplitThreads / 32) {
        const int d = 8 * (block % (DK / 8)) + lane % 8, l = 2 * (4 * (block / (DK / 8)) + lane / 8);
        const SplitPair pair = split_bf16x2(k[l * operand_stride(DK) + d], k[(l + 1) * operand_stride(DK) + d]);
        *reinterpret_cast<unsigned*>(kt.hi + d * kt.stride + l) = pair.hi;
        *reinterpret_cast<unsigned*>(kt.lo + d * kt.stride + l) = pair.lo;
    }
}

// Every global read is issued before the first wait: the raw q and k rows (cp.async), the first 32 value
// columns (registers), the gating inputs; then each column group's product runs while the next group loads.
template <int DK>
__forceinline__ void chunk_terms(const DeltaRuleArgs& p, const SplitWorkspace& ws) {
    extern __shared__ float split_smem[];
    const TermsSmem<DK> sm(split_smem);
    const int head = blockIdx.y, warp = threadIdx.x >> 5, ratio = p.value_heads / p.key_heads, key_head = head / ratio;
    const float decay_rate = expf(p.a_log[head]), bias = p.dt_bias[head];  // weights: before the wait
    enter_dependent_kernel();
    const SplitChunk chunk = find_chunk(p, blockIdx.z, blockIdx.x);
    if (chunk.rows == 0) return;  // uniform over the block
    const long long channels = p.conv_channels(DK);
    const int v_column = 2 * p.key_heads * DK + head * p.value_dim;
    copy_raw_qk<DK>(sm.raw, p, chunk, key_head);
    ValueColumns v;
    v.fetch(p, chunk, channels, v_column);
    if (threadIdx.x < kChunk) {
        const int r = threadIdx.x;
        float beta = 0.0f, g = 0.0f;
        if (r < chunk.rows) p.gating(chunk.first + r, head, decay_rate, bias, beta, g);
        sm.cum[r] = g;
        sm.beta[r] = beta;
    }
    cp_async_wait<0>();
    __syncthreads();
    normalise_rows<DK>(sm, p, ws, chunk, key_head, head % ratio == 0);
    __syncthreads();  // the raw rows are read: A and T take their place
    prefix_sum_64(sm.cum);
    __syncthreads();
    if (threadIdx.x < kChunk) {
        const int r = threadIdx.x;
        sm.scale[r] = sm.beta[r] * expf(sm.cum[r]);
        if (r < chunk.rows) *row_at(ws.cum, chunk.first + r, p.value_heads, head, 1) = sm.cum[r];
    }
    using Square = WarpTile<kChunk, kChunk>;
    const Square square(warp);
    float sq[Square::NT][4];
    const auto k_at = [&](int m, int l) { return sm.k[m * sm.kKeyStride + l]; };
    split_mma(sq, square.m0, square.n0, square.n0 <= square.m0 + 15 ? DK : 0, k_at, [&](int l, int n) { return k_at(n, l); });
    square.each(sq, [&](int m, int n, float x) {
        sm.a[m * kChunk + n] = m > n ? sm.beta[m] * x * expf(sm.cum[m] - sm.cum[n]) : 0.0f;
        sm.t[m * kChunk + n] = m == n ? 1.0f : 0.0f;
    });
    __syncthreads();
    invert_unit_lower(sm.a, sm.t);
    const auto t_at = [&](int m, int l) { return sm.t[m * kChunk + l]; };
    using Wide = WarpTile<kChunk, DK>;
    const Wide wide(warp);
    float wa[Wide::NT][4];
    split_mma(wa, wide.m0, wide.n0, wide.m0 + 16, t_at, [&](int l, int n) { return sm.scale[l] * k_at(l, n); });
    wide.each_pair(wa, [&](int m, int n, float x0, float x1) {
        if (m >= chunk.rows) return;
        const SplitPair pair = split_bf16x2(x0, x1);
        const SplitPlanes w = w_planes<DK>(ws, chunk.first + m, p.value_heads, head);
        *reinterpret_cast<unsigned*>(w.hi + n) = pair.hi;
        *reinterpret_cast<unsigned*>(w.lo + n) = pair.lo;
    });
    if (head % ratio == 0) store_kt<DK>(sm.k, kt_planes<DK>(ws, chunk.number, p.key_heads, key_head));
    using Narrow = WarpTile<kChunk, kOutputColumns>;
    const Narrow narrow(warp);
    for (int column0 = 0; column0 < p.value_dim; column0 += kOutputColumns) {
        v.put_scaled(sm.v, sm.beta);
        __syncthreads();
        if (column0 + kOutputColumns < p.value_dim) v.fetch(p, chunk, channels, v_column + column0 + kOutputColumns);
        float ua[Narrow::NT][4];
        split_mma(ua, narrow.m0, narrow.n0, narrow.m0 + 16, t_at, [&](int l, int n) { return sm.v[l * kOutputStride + n]; });
        narrow.each(ua, [&](int m, int n, float x) {
            if (m < chunk.rows) row_at(ws.u, chunk.first + m, p.value_heads, head, p.value_dim)[column0 + n] = x;
        });
        __syncthreads();
    }
}

// -- pass 2: the state through the chunks ---------------------------------------------------------------

// The operands of the chunk's two products as split planes (the state f32 lives in registers): S^T [CV][DK+8],
// w [64][DK+8], k^T [DK][72], (tail v_new)^T [CV][72]; cum [64]. kFloats counts f32 words (a pair of bf16
// planes takes one word per element).
template <int DK, int CV>
struct CarrySmem {
    static constexpr int kKeyPlane = plane_stride(DK);     // rows of S^T and of w
    static constexpr int kRowPlane = plane_stride(kChunk);  // rows of k^T and of (tail v_new)^T
    static constexpr int kFloats = CV * kKeyPlane + kChunk * kKeyPlane + DK * kRowPlane + CV * kRowPlane + kChunk;
    SplitPlanes s, w, k, v;
    float* cum;

    __device__ explicit CarrySmem(float* base) {
        bf16* at = reinterpret_cast<bf16*>(base);
        const auto take = [&](int rows, int stride) {
            const SplitPlanes planes{at, at + rows * stride, stride};
            at += 2 * rows * stride;
            return planes;
        };
        s = take(CV, kKeyPlane);
        w = take(kChunk, kKeyPlane);
        k = take(DK, kRowPlane);
        v = take(CV, kRowPlane);
        cum = reinterpret_cast<float*>(at);
    }
};

// `rows` rows of both planes, ROW_BYTES each, from `src` (planes `src_plane` bf16 apart, rows `src_stride`
// apart) into `dst` by cp.async, zeros past `rows`; the caller commits.
template <int ROWS, int ROW_BYTES>
__forceinline__ void copy_planes_async(const SplitPlanes& dst, const bf16* src, long long src_stride, long long src_plane, int rows) {
    constexpr int kRowQuads = ROW_BYTES / 16, kQuads = 2 * ROWS * kRowQuads;
    static_assert(kQuads % kSplitThreads == 0, "whole rounds of 16-byte copies");
#pragma unroll
    for (int i = 0; i < kQuads / kSplitThreads; ++i) {
        const int quad = threadIdx.x + i * kSplitThreads, plane = quad / (ROWS * kRowQuads);
        const int r = quad / kRowQuads % ROWS, c = 8 * (quad % kRowQuads);
        bf16* to = (plane == 0 ? dst.hi : dst.lo) + r * dst.stride + c;
        cp_async16(to, r < rows ? src + plane * src_plane + r * src_stride + c : src, r < rows);
    }
}

// A chunk of the sequential pass: its first flat row, its length and its number.
struct CarriedChunk {
    long long first;
    int length;
    int number;
};

// The carry's registers: the state tile S [DK][CV] (f32, State's accumulator layout) and the chunk's u at
// the v_new product's accumulator places.
template <int DK, int CV>
struct CarryTiles {
    using State = WarpTile<DK, CV>;
    using Narrow = WarpTile<kChunk, CV>;
    float s[State::NT][4];
    float u[Narrow::NT][4];
};

// The next chunk's w (cp.async into its planes, free once v_new is computed), u (registers) and cum
// (a register of the first 64 threads), on their way in while the current chunk finishes.
template <int DK, int CV>
__forceinline__ float fetch_terms(const CarrySmem<DK, CV>& sm, CarryTiles<DK, CV>& tiles, const DeltaRuleArgs& p,
                                  const SplitWorkspace& ws, CarriedChunk next, int head, int column0) {
    const SplitPlanes w = w_planes<DK>(ws, next.first, p.value_heads, head);
    copy_planes_async<kChunk, DK * 2>(sm.w, w.hi, w.stride, DK, next.length);
    cp_async_commit();
    const typename CarryTiles<DK, CV>::Narrow narrow(threadIdx.x >> 5);
    const float* u = row_at(ws.u, next.first, p.value_heads, head, p.value_dim) + column0;
    const long long stride = (long long)p.value_heads * p.value_dim;
    narrow.each_pair(tiles.u, [&](int m, int n, float& x0, float& x1) {
        const float2 pair = m < next.length ? *reinterpret_cast<const float2*>(u + m * stride + n) : make_float2(0.0f, 0.0f);
        x0 = pair.x;
        x1 = pair.y;
    });
    return threadIdx.x < next.length ? ws.cum[(next.first + threadIdx.x) * p.value_heads + head] : 0.0f;
}

// The state tile (registers) into S^T's planes.
template <int DK, int CV>
__forceinline__ void put_state_planes(const CarrySmem<DK, CV>& sm, const CarryTiles<DK, CV>& tiles) {
    const typename CarryTiles<DK, CV>::State state(threadIdx.x >> 5);
    state.each_pair(tiles.s, [&](int d, int n, float x0, float x1) {
        sm.s.put(n, d, x0);
        sm.s.put(n + 1, d, x1);
    });
}

// The state tile after `count` rows into `chunk_state` (unless null) and the target that asks for it, if any.
template <int DK, int CV>
__forceinline__ void store_state(const CarryTiles<DK, CV>& tiles, float* chunk_state, const StateSlots& states, int seq, int count,
                                 int length, long long tile, int value_dim) {
    const typename CarryTiles<DK, CV>::State state(threadIdx.x >> 5);
    const int target = states.target_after(seq, count, length);
    float* const target_tile = target >= 0 ? states.recurrent(target) + tile : nullptr;
    state.each_pair(tiles.s, [&](int d, int n, float x0, float x1) {
        if (chunk_state != nullptr) *reinterpret_cast<float2*>(chunk_state + (long long)d * value_dim + n) = make_float2(x0, x1);
        if (target_tile != nullptr) *reinterpret_cast<float2*>(target_tile + (long long)d * value_dim + n) = make_float2(x0, x1);
    });
}

// One chunk. On entry S^T's planes and the registers hold the state before it, sm.w, sm.cum and tiles.u the
// chunk's terms; on return the state after it is in the registers (not yet in the planes), v_new over u in the
// workspace, and the next chunk's terms on their way (w by cp.async, cum in the returned register).
template <int DK, int CV>
__forceinline__ float carry_chunk(const CarrySmem<DK, CV>& sm, CarryTiles<DK, CV>& tiles, const DeltaRuleArgs& p, const SplitWorkspace& ws,
                                  CarriedChunk chunk, CarriedChunk next, int head, int key_head, int column0) {
    const int warp = threadIdx.x >> 5, length = chunk.length;
    const SplitPlanes kt = kt_planes<DK>(ws, chunk.number, p.key_heads, key_head);
    copy_planes_async<DK, kChunk * 2>(sm.k, kt.hi, kt.stride, DK * kChunk, DK);
    cp_async_commit();  // lands while v_new is computed
    const float last = sm.cum[length - 1];
    const typename CarryTiles<DK, CV>::Narrow narrow(warp);
    float nv[CarryTiles<DK, CV>::Narrow::NT][4] = {};
    planes_mma(nv, narrow.m0, narrow.n0, DK, sm.w, sm.s);
#pragma unroll
    for (int nt = 0; nt < CarryTiles<DK, CV>::Narrow::NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) nv[nt][r] = tiles.u[nt][r] - nv[nt][r];  // v_new
    float* const v_new_rows = row_at(ws.u, chunk.first, p.value_heads, head, p.value_dim) + column0;
    const long long stride = (long long)p.value_heads * p.value_dim;
    narrow.each_pair(nv, [&](int m, int n, float v0, float v1) {
        if (m < length) *reinterpret_cast<float2*>(v_new_rows + m * stride + n) = make_float2(v0, v1);
        const float tail = expf(last - sm.cum[m]);  // padding rows: v_new = 0
        sm.v.put(n, m, tail * v0);
        sm.v.put(n + 1, m, tail * v1);
    });
    cp_async_wait<0>();
    __syncthreads();  // k^T has landed and (tail v_new)^T is whole; w is read no more
    const float next_cum = next.length > 0 ? fetch_terms<DK, CV>(sm, tiles, p, ws, next, head, column0) : 0.0f;
    const typename CarryTiles<DK, CV>::State state(warp);
    const float total = expf(last);
#pragma unroll
    for (int nt = 0; nt < CarryTiles<DK, CV>::State::NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) tiles.s[nt][r] *= total;
    planes_mma(tiles.s, state.m0, state.n0, (length + 15) & ~15, sm.k, sm.v);
    return next_cum;
}

template <int DK, int CV>
__forceinline__ void carry_states(const DeltaRuleArgs& p, const SplitWorkspace& ws) {
    extern __shared__ float split_smem[];
    const CarrySmem<DK, CV> sm(split_smem);
    const int head = blockIdx.y, seq = blockIdx.z, column0 = blockIdx.x * CV;
    enter_dependent_kernel();
    const SequenceRows rows = sequence_rows(p.query_start, seq);
    if (rows.length <= kRecurrentMaxRows) return;  // the recurrent kernel's (uniform over the block)
    const int targets = p.states.num_targets, count = chunk_count(rows.length, targets);
    const int base = chunk_base(p.query_start, seq, targets), key_head = head / (p.value_heads / p.key_heads);
    const long long tile = (long long)head * DK * p.value_dim + column0, state_floats = (long long)p.value_heads * DK * p.value_dim;
    const auto carried = [&](int c) {
        const int start = chunk_point(rows.length, targets, c);
        return c < count ? CarriedChunk{rows.first + start, chunk_point(rows.length, targets, c + 1) - start, base + c}
                         : CarriedChunk{0, 0, 0};
    };
    CarryTiles<DK, CV> tiles;
    const typename CarryTiles<DK, CV>::State state((int)threadIdx.x >> 5);
    const float* initial = p.states.recurrent(p.states.slots[seq]) + tile;
    state.each_pair(tiles.s, [&](int d, int n, float& x0, float& x1) {
        const float2 pair = *reinterpret_cast<const float2*>(initial + (long long)d * p.value_dim + n);
        x0 = pair.x;
        x1 = pair.y;
    });
    float cum = fetch_terms<DK, CV>(sm, tiles, p, ws, carried(0), head, column0);
    put_state_planes<DK, CV>(sm, tiles);
    __syncthreads();  // the whole tile is read (into the planes) before any target, maybe the source slot, is written
    float* const before = ws.h + base * state_floats + tile;  // the state before chunk c at c * state_floats
    store_state<DK, CV>(tiles, before, p.states, seq, 0, rows.length, tile, p.value_dim);
    for (int c = 0, start = 0; c < count; ++c) {
        if (threadIdx.x < kChunk) sm.cum[threadIdx.x] = cum;
        cp_async_wait<0>();
        __syncthreads();  // the chunk's terms and the state's planes are in place
        const CarriedChunk chunk = carried(c);
        cum = carry_chunk<DK, CV>(sm, tiles, p, ws, chunk, carried(c + 1), head, key_head, column0);
        start += chunk.length;
        __syncthreads();  // S^T, (tail v_new)^T, k^T and cum are read no more
        put_state_planes<DK, CV>(sm, tiles);
        store_state<DK, CV>(tiles, c + 1 < count ? before + (c + 1) * state_floats : nullptr, p.states, seq, start, rows.length, tile,
                            p.value_dim);
    }
}

// -- pass 3: the outputs ----------------------------------------------------------------------------------

// q and k [64][DK+4] (k's region later holds S's 32 columns [DK][36]), P [64][65], v_new [64][36], cum [64].
template <int DK>
struct OutputSmem {
    static constexpr int kKeyStride = operand_stride(DK);
    static constexpr int kFloats = 2 * kChunk * kKeyStride + kChunk * (kChunk + 1) + kChunk * kOutputStride + kChunk;
    static_assert(DK * kOutputStride <= kChunk * kKeyStride, "S's columns fit k's region");
    float *q, *k, *s, *p, *v, *cum;

    __device__ explicit OutputSmem(float* base)
        : q(base), k(q + kChunk * kKeyStride), s(k), p(k + kChunk * kKeyStride), v(p + kChunk * (kChunk + 1)), cum(v + kChunk * kOutputStride) {}
};

// `rows` rows of DK floats, `src_stride` apart, into tile[r * (DK + 4) + c] by cp.async (zeros past `rows`);
// the caller commits.
template <int DK>
__forceinline__ void copy_rows_async(float* tile, const float* src, long long src_stride, int rows) {
    constexpr int kRowQuads = DK / 4, kQuads = kChunk * kRowQuads;
    static_assert(kQuads % kSplitThreads == 0, "whole rounds of 16-byte copies");
#pragma unroll
    for (int i = 0; i < kQuads / kSplitThreads; ++i) {
        const int quad = threadIdx.x + i * kSplitThreads, r = quad / kRowQuads, c = 4 * (quad % kRowQuads);
        cp_async16(tile + r * operand_stride(DK) + c, r < rows ? src + r * src_stride + c : src, r < rows);
    }
}

// 32 columns of the state before the chunk and of its v_new, through registers: fetched while the previous
// columns' products run.
template <int DK>
struct OutputColumns {
    Block<DK, kOutputColumns> state;
    Block<kChunk, kOutputColumns> v_new;

    __forceinline__ void fetch(const float* chunk_state, const float* v_new_rows, long long value_stride, int value_dim, int rows,
                               int column0) {
        state.fetch(chunk_state + column0, value_dim, DK);
        v_new.fetch(v_new_rows + column0, value_stride, rows);
    }
};

template <int DK>
__forceinline__ void chunk_outputs(const DeltaRuleArgs& p, const SplitWorkspace& ws) {
    extern __shared__ float split_smem[];
    const OutputSmem<DK> sm(split_smem);
    const int head = blockIdx.y, warp = threadIdx.x >> 5, key_head = head / (p.value_heads / p.key_heads);
    enter_dependent_kernel();
    const SplitChunk chunk = find_chunk(p, blockIdx.z, blockIdx.x);
    if (chunk.rows == 0) return;  // uniform over the block
    const long long key_stride = (long long)p.key_heads * DK, value_stride = (long long)p.value_heads * p.value_dim;
    copy_rows_async<DK>(sm.q, row_at(ws.q, chunk.first, p.key_heads, key_head, DK), key_stride, chunk.rows);
    copy_rows_async<DK>(sm.k, row_at(ws.k, chunk.first, p.key_heads, key_head, DK), key_stride, chunk.rows);
    cp_async_commit();
    const float* state = ws.h + ((long long)chunk.number * p.value_heads + head) * DK * p.value_dim;
    const float* v_new_rows = row_at(ws.u, chunk.first, p.value_heads, head, p.value_dim);
    OutputColumns<DK> columns;
    columns.fetch(state, v_new_rows, value_stride, p.value_dim, chunk.rows, 0);
    load_cum(sm.cum, ws, chunk.first, chunk.rows, p.value_heads, head);
    cp_async_wait<0>();
    __syncthreads();
    using Square = WarpTile<kChunk, kChunk>;
    const Square square(warp);
    float sq[Square::NT][4];
    const auto q_at = [&](int m, int l) { return sm.q[m * sm.kKeyStride + l]; };
    split_mma(sq, square.m0, square.n0, square.n0 <= square.m0 + 15 ? DK : 0, q_at,
              [&](int l, int n) { return sm.k[n * sm.kKeyStride + l]; });
    square.each(sq, [&](int m, int n, float x) { sm.p[m * (kChunk + 1) + n] = m >= n ? x * expf(sm.cum[m] - sm.cum[n]) : 0.0f; });
    __syncthreads();  // k is read no more: its region takes the state's columns
    using Narrow = WarpTile<kChunk, kOutputColumns>;
    const Narrow narrow(warp);
    for (int column0 = 0; column0 < p.value_dim; column0 += kOutputColumns) {
        columns.state.put(sm.s, kOutputStride);
        columns.v_new.put(sm.v, kOutputStride);
        __syncthreads();
        if (column0 + kOutputColumns < p.value_dim)
            columns.fetch(state, v_new_rows, value_stride, p.value_dim, chunk.rows, column0 + kOutputColumns);
        float o[Narrow::NT][4], pv[Narrow::NT][4];
        split_mma(o, narrow.m0, narrow.n0, DK, q_at, [&](int l, int n) { return sm.s[l * kOutputStride + n]; });
        narrow.scale_rows(o, [&](int m) { return expf(sm.cum[m]); });
        split_mma(pv, narrow.m0, narrow.n0, narrow.m0 + 16, [&](int m, int l) { return sm.p[m * (kChunk + 1) + l]; },
                  [&](int l, int n) { return sm.v[l * kOutputStride + n]; });
#pragma unroll
        for (int nt = 0; nt < Narrow::NT; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r) pv[nt][r] += o[nt][r];
        narrow.each(pv, [&](int m, int n, float x) {
            if (m < chunk.rows) row_at(p.out, chunk.first + m, p.value_heads, head, p.value_dim)[column0 + n] = x;
        });
        __syncthreads();
    }
}

#define SPLIT_PARAMS DELTA_RULE_PARAMS, float *ws_q, float *ws_k, bf16 *ws_w, float *ws_u, float *ws_cum, float *ws_h, bf16 *ws_kt
#define SPLIT_WORKSPACE SplitWorkspace{ws_q, ws_k, ws_w, ws_u, ws_cum, ws_h, ws_kt}

#define SPLIT_KERNELS(DK)                                                                                      \
    extern "C" __global__ void __launch_bounds__(kSplitThreads, 2) gdn_split_terms_d##DK(SPLIT_PARAMS) {      \
        chunk_terms<DK>(DELTA_RULE_ARGS, SPLIT_WORKSPACE);                                                     \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(kSplitThreads, 2) gdn_split_out_d##DK(SPLIT_PARAMS) {        \
        chunk_outputs<DK>(DELTA_RULE_ARGS, SPLIT_WORKSPACE);                                                   \
    }

#define CARRY_KERNEL(DK, CV)                                                                                   \
    extern "C" __global__ void __launch_bounds__(kSplitThreads, 2) gdn_split_carry_d##DK##_c##CV(SPLIT_PARAMS) { \
        carry_states<DK, CV>(DELTA_RULE_ARGS, SPLIT_WORKSPACE);                                                \
    }

SPLIT_KERNELS(64)
SPLIT_KERNELS(128)
CARRY_KERNEL(64, 16)
CARRY_KERNEL(64, 32)
CARRY_KERNEL(128, 16)
CARRY_KERNEL(128, 32)
