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
// Workspace (gdn_split_plan.SplitWorkspace), by flat row: norms f32 [T, Hk, 2] (the scales that L2-normalise
// the raw q and k rows, written by the first value head of each key head), w [T, Hv, 2, dk] as bf16 hi/lo
// planes (SplitPlanes), u f32 [T, Hv, dv] (pass 2 overwrites it with v_new), cum f32 [T, Hv]; by chunk
// number: h [chunks, Hv, 2, dv, dk], S^T before the chunk, and kt [chunks, Hk, 2, dk, 64], the chunk's
// normalised k^T zero-padded to 64 rows, both as bf16 planes.
//
// Products: every operand is either exact (the raw q, k, v rows: bf16 as the conv stored them, their norms
// applied as row or column scales) or split into a bf16 pair x = hi + lo (gdn_split_mma.cuh), and a product
// takes one tensor-core term per pair of parts that are not both lo: k k^T and q k^T one, w, u and q S two,
// v_new = u - w S, the state update and P v_new three. An operand used more than once is split once, into
// planes (w, k^T, S^T, T scaled, P, e^(last - cum) v_new), not by every warp at every fragment load: the
// sequential pass's chunk loop is ~1,540 SASS instructions a warp on sm_90a (nvdisasm) against ~2,170 when
// every fragment was split from f32.
//
// Launch shapes, block 256 (8 warps, the warp tiles of gdn_split_mma.cuh):
//   gdn_split_terms_d{dk}:       grid (max chunks of a sequence, Hv, B); blocks past their sequence's chunks exit.
//   gdn_split_carry_d{dk}_c{cv}: grid (dv / cv, Hv, B), each walking its sequence's chunks in order.
//   gdn_split_out_d{dk}:         grid (max chunks of a sequence, Hv, B).
// Every pass issues its global reads before it first waits on any (cp.async for the rows of q, k, w, k^T and
// S^T; the next value columns or the next chunk's u while the current product runs). Shared memory
// (split_smem_bytes in linear_attn_ops.py mirrors it) at dk 128: terms 73 KiB, carry 96 KiB (cv 32) / 83 KiB
// (cv 16), out 96 KiB: all fit sm_120's 99 KiB; two blocks per H200 SM. Measured times: docs/findings.md
// ("The chunked delta rule split in three passes").
#include "gdn_split_common.cuh"

// -- pass 1: the chunk's terms ------------------------------------------------------------------------------

// The raw k rows [64][DK+8] (bf16: exact operands), the raw q rows [64][DK] (only for their norms; in A's
// place), A and T [64][64] f32 (the inverse), T scaled by a column vector as split planes [64][72], 32 raw v
// columns [64][40], and cum, beta, the w scale beta e^cum |k|^-1, |k|^-1 [64].
template <int DK>
struct TermsSmem {
    static constexpr int kKeyPlane = plane_stride(DK), kValuePlane = plane_stride(kOutputColumns);
    static constexpr int kFloats =
        kChunk * kKeyPlane / 2 + 2 * kChunk * kChunk + kChunk * plane_stride(kChunk) + kChunk * kValuePlane / 2 + 4 * kChunk;
    static_assert(kChunk * DK * sizeof(bf16) <= kChunk * kChunk * sizeof(float), "the raw q rows fit A");
    bf16 *k, *q, *v;
    float *a, *t, *cum, *beta, *scale, *k_norm;
    SplitPlanes scaled_t;

    __device__ explicit TermsSmem(float* base) {
        k = reinterpret_cast<bf16*>(base);
        a = base + kChunk * kKeyPlane / 2;
        q = reinterpret_cast<bf16*>(a);
        t = a + kChunk * kChunk;
        bf16* planes = reinterpret_cast<bf16*>(t + kChunk * kChunk);
        scaled_t = {planes, planes + kChunk * plane_stride(kChunk), plane_stride(kChunk)};
        v = planes + 2 * kChunk * plane_stride(kChunk);
        cum = reinterpret_cast<float*>(v + kChunk * kValuePlane);
        beta = cum + kChunk;
        scale = beta + kChunk;
        k_norm = scale + kChunk;
    }
};

// 32 value columns of the chunk's v rows (bf16), one 16-byte load a thread: row tid / 4, columns 8 (tid % 4).
struct ValueColumns {
    static_assert(kChunk * kOutputColumns == 8 * kSplitThreads, "one 16-byte load a thread");
    uint4 raw;

    __forceinline__ void fetch(const DeltaRuleArgs& p, const SplitChunk& chunk, long long channels, int v_column) {
        const int r = threadIdx.x / 4, c = 8 * (threadIdx.x % 4);
        raw = r < chunk.rows ? *reinterpret_cast<const uint4*>(p.conv + (chunk.first + r) * channels + v_column + c)
                             : make_uint4(0u, 0u, 0u, 0u);
    }

    __forceinline__ void put(bf16* v) const {
        *reinterpret_cast<uint4*>(v + threadIdx.x / 4 * plane_stride(kOutputColumns) + 8 * (threadIdx.x % 4)) = raw;
    }
};

// The L2 norms of the chunk's raw q and k rows, a warp a row: k's reciprocal into shared memory, both scales
// (q's with dk^-0.5) into the workspace where this block writes them (one value head per key head does).
template <int DK>
__forceinline__ void row_norms(const TermsSmem<DK>& sm, const DeltaRuleArgs& p, const SplitWorkspace& ws, const SplitChunk& chunk,
                               int key_head, bool stores_norms) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = warp; r < kChunk; r += kSplitThreads / 32) {
        float qv[DK / 32], kv[DK / 32];
#pragma unroll
        for (int e = 0; e < DK / 32; ++e) {
            qv[e] = __bfloat162float(sm.q[r * DK + lane + 32 * e]);
            kv[e] = __bfloat162float(sm.k[r * sm.kKeyPlane + lane + 32 * e]);
        }
        const RowScales scales = l2_scales<DK>(qv, kv);
        if (lane == 0) {
            sm.k_norm[r] = scales.k;
            if (r < chunk.rows && stores_norms) {
                float* out = ws.norms + ((chunk.first + r) * p.key_heads + key_head) * 2;
                out[0] = scales.q;
                out[1] = scales.k;
            }
        }
    }
}

// k^T of the chunk, L2-normalised (zero rows past the chunk), into its planes in the workspace, a warp covering
// 8 key dims x 4 row pairs at a time: the reads hit distinct words, every 4 lanes store 16 bytes.
template <int DK>
__forceinline__ void store_kt(const TermsSmem<DK>& sm, const SplitPlanes& kt) {
    constexpr int kBlocks = (DK / 8) * (kChunk / 8);
    static_assert(kBlocks % (kSplitThreads / 32) == 0, "whole rounds of warp blocks");
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll 4
    for (int block = warp; block < kBlocks; block += kSplitThreads / 32) {
        const int d = 8 * (block % (DK / 8)) + lane % 8, l = 2 * (4 * (block / (DK / 8)) + lane / 8);
        const float k0 = __bfloat162float(sm.k[l * sm.kKeyPlane + d]), k1 = __bfloat162float(sm.k[(l + 1) * sm.kKeyPlane + d]);
        kt.put_pair(d, l, sm.k_norm[l] * k0, sm.k_norm[l + 1] * k1);
    }
}

// T with column l scaled by column[l], split into sm.scaled_t.
template <int DK>
__forceinline__ void put_scaled_t(const TermsSmem<DK>& sm, const float* column) {
    for (int idx = threadIdx.x; idx < kChunk * kChunk / 2; idx += kSplitThreads) {
        const int m = idx / (kChunk / 2), l = 2 * (idx % (kChunk / 2));
        sm.scaled_t.put_pair(m, l, sm.t[m * kChunk + l] * column[l], sm.t[m * kChunk + l + 1] * column[l + 1]);
    }
}

// Every global read is issued before the first wait: the raw q and k rows (cp.async), the first 32 value
// columns (registers), the gating inputs; then each column group's product runs while the next group loads.
// Products of raw (exact bf16) rows take one or two tensor-core terms, the norms applied as row scales:
// k k^T one, w = (T beta e^cum |k|^-1) k and u = (T beta) v two each.
template <int DK>
__forceinline__ void chunk_terms(const DeltaRuleArgs& p, const SplitWorkspace& ws) {
    extern __shared__ float split_smem[];
    const TermsSmem<DK> sm(split_smem);
    const int head = blockIdx.y, warp = threadIdx.x >> 5, ratio = p.value_heads / p.key_heads, key_head = head / ratio;
    const bool writes_key_head = head % ratio == 0;  // the norms and k^T are the key head's: one value head writes them
    const float decay_rate = expf(p.a_log[head]), bias = p.dt_bias[head];  // weights: before the wait
    enter_dependent_kernel();
    const SplitChunk chunk = find_chunk(p, blockIdx.z, blockIdx.x);
    if (chunk.rows == 0) return;  // uniform over the block
    const long long channels = p.conv_channels(DK);
    const int v_column = 2 * p.key_heads * DK + head * p.value_dim;
    copy_conv_rows<DK>(sm.q, DK, p, chunk, key_head * DK);
    copy_conv_rows<DK>(sm.k, sm.kKeyPlane, p, chunk, (p.key_heads + key_head) * DK);
    cp_async_commit();
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
    row_norms<DK>(sm, p, ws, chunk, key_head, writes_key_head);
    __syncthreads();  // the raw q rows are read: A takes their place
    prefix_sum_64(sm.cum);
    __syncthreads();
    if (threadIdx.x < kChunk) {
        const int r = threadIdx.x;
        sm.scale[r] = sm.beta[r] * expf(sm.cum[r]) * sm.k_norm[r];
        if (r < chunk.rows) *row_at(ws.cum, chunk.first + r, p.value_heads, head, 1) = sm.cum[r];
    }
    const ExactRows k_rows{sm.k, sm.kKeyPlane};
    using Square = WarpTile<kChunk, kChunk>;
    const Square square(warp);
    float sq[Square::NT][4] = {};
    fragment_mma(sq, square.m0, square.n0, square.n0 <= square.m0 + 15 ? DK : 0, k_rows, k_rows);
    square.each(sq, [&](int m, int n, float x) {
        sm.a[m * kChunk + n] = m > n ? sm.beta[m] * (sm.k_norm[m] * sm.k_norm[n] * x) * expf(sm.cum[m] - sm.cum[n]) : 0.0f;
        sm.t[m * kChunk + n] = m == n ? 1.0f : 0.0f;
    });
    __syncthreads();
    invert_unit_lower(sm.a, sm.t);
    put_scaled_t<DK>(sm, sm.scale);
    __syncthreads();
    using Wide = WarpTile<kChunk, DK>;
    const Wide wide(warp);
    float wa[Wide::NT][4] = {};
    fragment_mma(wa, wide.m0, wide.n0, wide.m0 + 16, sm.scaled_t, ExactColumns{sm.k, sm.kKeyPlane});
    wide.each_pair(wa, [&](int m, int n, float x0, float x1) {
        if (m < chunk.rows) w_planes<DK>(ws, chunk.first + m, p.value_heads, head).put_pair(0, n, x0, x1);
    });
    if (writes_key_head) store_kt<DK>(sm, kt_planes<DK>(ws, chunk.number, p.key_heads, key_head));
    __syncthreads();  // T beta e^cum |k|^-1 is read no more
    put_scaled_t<DK>(sm, sm.beta);
    using Narrow = WarpTile<kChunk, kOutputColumns>;
    const Narrow narrow(warp);
    for (int column0 = 0; column0 < p.value_dim; column0 += kOutputColumns) {
        v.put(sm.v);
        __syncthreads();
        if (column0 + kOutputColumns < p.value_dim) v.fetch(p, chunk, channels, v_column + column0 + kOutputColumns);
        float ua[Narrow::NT][4] = {};
        fragment_mma(ua, narrow.m0, narrow.n0, narrow.m0 + 16, sm.scaled_t, ExactColumns{sm.v, sm.kValuePlane});
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

// The state tile after `count` rows into the target that asks for it, if any.
template <int DK, int CV>
__forceinline__ void store_target(const CarryTiles<DK, CV>& tiles, const StateSlots& states, int seq, int count, int length, long long tile,
                                  int value_dim) {
    const int target = states.target_after(seq, count, length);
    if (target < 0) return;
    float* const target_tile = states.recurrent(target) + tile;
    const typename CarryTiles<DK, CV>::State state(threadIdx.x >> 5);
    state.each_pair(tiles.s, [&](int d, int n, float x0, float x1) {
        *reinterpret_cast<float2*>(target_tile + (long long)d * value_dim + n) = make_float2(x0, x1);
    });
}

// S^T's planes (shared memory, the state before chunk `number`) into the workspace's h for the output pass,
// 16 bytes a copy.
template <int DK, int CV>
__forceinline__ void store_state_planes(const CarrySmem<DK, CV>& sm, const SplitPlanes& h, int column0) {
    each_plane_piece<CV, DK * 2>([&](int plane, int n, int c) {
        const bf16* from = (plane == 0 ? sm.s.hi : sm.s.lo) + n * sm.s.stride + c;
        *reinterpret_cast<uint4*>((plane == 0 ? h.hi : h.lo) + (column0 + n) * h.stride + c) = *reinterpret_cast<const uint4*>(from);
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
    fragment_mma(nv, narrow.m0, narrow.n0, DK, sm.w, sm.s);
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
    fragment_mma(tiles.s, state.m0, state.n0, (length + 15) & ~15, sm.k, sm.v);
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
    const long long tile = (long long)head * DK * p.value_dim + column0;
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
    store_target<DK, CV>(tiles, p.states, seq, 0, rows.length, tile, p.value_dim);
    for (int c = 0, start = 0; c < count; ++c) {
        if (threadIdx.x < kChunk) sm.cum[threadIdx.x] = cum;
        cp_async_wait<0>();
        __syncthreads();  // the chunk's terms and the state's planes are in place
        const CarriedChunk chunk = carried(c);
        store_state_planes<DK, CV>(sm, h_planes<DK>(ws, chunk.number, p.value_heads, head, p.value_dim), column0);
        cum = carry_chunk<DK, CV>(sm, tiles, p, ws, chunk, carried(c + 1), head, key_head, column0);
        start += chunk.length;
        __syncthreads();  // S^T, (tail v_new)^T, k^T and cum are read no more
        put_state_planes<DK, CV>(sm, tiles);
        store_target<DK, CV>(tiles, p.states, seq, start, rows.length, tile, p.value_dim);
    }
}

// -- pass 3: the outputs ----------------------------------------------------------------------------------

// The raw q and k rows [64][DK+8] (bf16), P = tril(q k^T * D) as split planes [64][72], two buffers of 32
// columns of S^T as split planes [32][DK+8], those columns of v_new [64][36] f32, and cum and the two norms
// of the chunk's rows [64].
template <int DK>
struct OutputSmem {
    static constexpr int kKeyPlane = plane_stride(DK);
    static constexpr int kFloats = kChunk * kKeyPlane + kChunk * plane_stride(kChunk) + 2 * kOutputColumns * kKeyPlane +
                                   kChunk * kOutputStride + 3 * kChunk;
    bf16 *q, *k, *columns;
    SplitPlanes p;
    float *v, *cum, *q_norm, *k_norm;

    __device__ explicit OutputSmem(float* base) {
        q = reinterpret_cast<bf16*>(base);
        k = q + kChunk * kKeyPlane;
        bf16* at = k + kChunk * kKeyPlane;
        p = {at, at + kChunk * plane_stride(kChunk), plane_stride(kChunk)};
        at += 2 * kChunk * plane_stride(kChunk);
        columns = at;
        v = reinterpret_cast<float*>(at + 4 * kOutputColumns * kKeyPlane);
        cum = v + kChunk * kOutputStride;
        q_norm = cum + kChunk;
        k_norm = q_norm + kChunk;
    }

    // buffer 0 or 1 of S^T's columns (computed, not indexed: an indexed array would live in local memory)
    __forceinline__ SplitPlanes state_columns(int buffer) const {
        bf16* hi = columns + buffer * 2 * kOutputColumns * kKeyPlane;
        return {hi, hi + kOutputColumns * kKeyPlane, kKeyPlane};
    }
};

// The chunk's cum and the norms of its rows (zeros past them), by the first 64 threads.
__forceinline__ void load_row_terms(float* cum, float* q_norm, float* k_norm, const DeltaRuleArgs& p, const SplitWorkspace& ws,
                                    const SplitChunk& chunk, int head, int key_head) {
    const int r = threadIdx.x;
    if (r >= kChunk) return;
    const bool valid = r < chunk.rows;
    const float* norms = ws.norms + ((chunk.first + r) * p.key_heads + key_head) * 2;
    cum[r] = valid ? ws.cum[(chunk.first + r) * p.value_heads + head] : 0.0f;
    q_norm[r] = valid ? norms[0] : 0.0f;
    k_norm[r] = valid ? norms[1] : 0.0f;
}

// Every global read is issued before the first wait (the raw q and k rows and S^T's first columns by cp.async,
// the first v_new columns through registers); each column group's products run while the next group loads.
// q k^T takes one tensor-core term (raw rows, the norms applied after), q S two, P v_new three.
template <int DK>
__forceinline__ void chunk_outputs(const DeltaRuleArgs& p, const SplitWorkspace& ws) {
    extern __shared__ float split_smem[];
    const OutputSmem<DK> sm(split_smem);
    const int head = blockIdx.y, warp = threadIdx.x >> 5, key_head = head / (p.value_heads / p.key_heads);
    enter_dependent_kernel();
    const SplitChunk chunk = find_chunk(p, blockIdx.z, blockIdx.x);
    if (chunk.rows == 0) return;  // uniform over the block
    const long long value_stride = (long long)p.value_heads * p.value_dim;
    copy_conv_rows<DK>(sm.q, sm.kKeyPlane, p, chunk, key_head * DK);
    copy_conv_rows<DK>(sm.k, sm.kKeyPlane, p, chunk, (p.key_heads + key_head) * DK);
    const SplitPlanes state = h_planes<DK>(ws, chunk.number, p.value_heads, head, p.value_dim);
    copy_planes_async<kOutputColumns, DK * 2>(sm.state_columns(0), state.hi, state.stride, state.lo - state.hi, kOutputColumns);
    cp_async_commit();
    const float* v_new_rows = row_at(ws.u, chunk.first, p.value_heads, head, p.value_dim);
    Block<kChunk, kOutputColumns> v_new;
    v_new.fetch(v_new_rows, value_stride, chunk.rows);
    load_row_terms(sm.cum, sm.q_norm, sm.k_norm, p, ws, chunk, head, key_head);
    cp_async_wait<0>();
    __syncthreads();
    using Square = WarpTile<kChunk, kChunk>;
    const Square square(warp);
    float sq[Square::NT][4] = {};
    const ExactRows q_rows{sm.q, sm.kKeyPlane};
    fragment_mma(sq, square.m0, square.n0, square.n0 <= square.m0 + 15 ? DK : 0, q_rows, ExactRows{sm.k, sm.kKeyPlane});
    const auto decayed = [&](int m, int n, float x) {
        return m >= n ? sm.q_norm[m] * sm.k_norm[n] * x * expf(sm.cum[m] - sm.cum[n]) : 0.0f;
    };
    square.each_pair(sq, [&](int m, int n, float x0, float x1) { sm.p.put_pair(m, n, decayed(m, n, x0), decayed(m, n + 1, x1)); });
    using Narrow = WarpTile<kChunk, kOutputColumns>;
    const Narrow narrow(warp);
    for (int column0 = 0, buffer = 0; column0 < p.value_dim; column0 += kOutputColumns, buffer ^= 1) {
        const bool more = column0 + kOutputColumns < p.value_dim;
        v_new.put(sm.v, kOutputStride);
        if (more) {  // into the buffer the previous group's product read before the last barrier
            copy_planes_async<kOutputColumns, DK * 2>(sm.state_columns(buffer ^ 1), state.hi + (column0 + kOutputColumns) * state.stride, state.stride,
                                                      state.lo - state.hi, kOutputColumns);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // this group's S^T columns, v_new and (first group) P are in place
        if (more) v_new.fetch(v_new_rows + column0 + kOutputColumns, value_stride, chunk.rows);
        float o[Narrow::NT][4] = {}, pv[Narrow::NT][4] = {};
        fragment_mma(o, narrow.m0, narrow.n0, DK, q_rows, sm.state_columns(buffer));
        narrow.scale_rows(o, [&](int m) { return sm.q_norm[m] * expf(sm.cum[m]); });
        fragment_mma(pv, narrow.m0, narrow.n0, narrow.m0 + 16, sm.p, f32_columns([&](int l, int n) { return sm.v[l * kOutputStride + n]; }));
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

#define SPLIT_PARAMS DELTA_RULE_PARAMS, float *ws_norms, bf16 *ws_w, float *ws_u, float *ws_cum, bf16 *ws_h, bf16 *ws_kt
#define SPLIT_WORKSPACE SplitWorkspace{ws_norms, ws_w, ws_u, ws_cum, ws_h, ws_kt}

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
