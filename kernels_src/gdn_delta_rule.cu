// Gated DeltaNet: the gated delta rule (recurrent and chunked forms) and the gated output RMSNorm.
//
// Prologue, fused into both delta-rule kernels (per row t, value head h, key head kh = h / (Hv / Hk)):
//   q = l2norm(conv[t, q of kh]) * dk^-0.5,  k = l2norm(conv[t, k of kh]),  v = conv[t, v of h]
//   beta = sigmoid(b[t, h]),  g = -exp(A_log[h]) * softplus(a[t, h] + dt_bias[h])
// Delta rule, per (sequence, value head), state S [dk, dv] from the sequence's slot:
//   S = e^g S;  delta = beta (v - S^T k);  S += k delta^T;  o_t = S^T q
// States after the row counts the targets ask for are stored into the target slots (gdn_common.cuh).
// Output norm (gdn_gated_norm): y[t, h] = w * rmsnorm(o[t, h]) * silu(z[t, h]) over the value head dim.
//
// Layout: conv bf16 [T, C] (gdn_conv.cu's output, C = 2 Hk dk + Hv dv: q heads, k heads, v heads);
// x = the fused projection's rows [q | k | v | z | b | a], bf16, `x_stride` apart: z at column C, b at
// `gate_column` = C + Hv dv, a at gate_column + Hv. A_log, dt_bias, w f32 (WeightRole.PARAMETER).
// o f32 [T, Hv, dv]; y bf16 [T, Hv dv]. States f32 [Hv, dk, dv] per slot and layer. Math in f32.
// Columns of S are independent (S[:, c] evolves from v[:, c] alone), so both kernels split dv into column
// groups, one block each: grid (dv / group, Hv, B).
//
// gdn_recurrent_d{dk}: sequences of 1..8 rows (decode, k+1-row verification; others skipped). Block 128 =
// 4 warps over a group of 16 columns: each thread holds one float4 of 4 columns in dk/32 rows (row slots of
// 8 per warp, 32 per block), in registers. The state is read once, with 16-byte loads issued straight after
// the step's tables (before the row prologue), and each requested state stored straight from registers.
// Each warp normalises q and k itself (the thread's rows by shuffle); per row the column sums of S^T k and
// S^T q are reduced by shuffles within a warp and through shared memory across the 4 warps (one block
// barrier) and give o = (e^g S)^T q + delta (k . q). At the 27B shape (48 heads of 128 x 128) one sequence
// is 384 blocks streaming 3 MiB in and 3 MiB out: bandwidth-bound by design.
//
// gdn_chunked_d{dk}_c{group}: sequences of more than 8 rows. Block 256, dynamic shared memory
// (chunked_smem_floats below). Chunks of 64 rows from the sequence's first row, also cut at every requested
// row count (so a requested state is a state between chunks). Per chunk (UT/WY form, as
// exec/numpy_delta_rule.chunked_gated_delta_rule): cum = cumsum(g), D_ij = e^(cum_i - cum_j),
//   P = tril(q k^T * D),  A = strict_tril(beta k k^T * D),  T = (I + A)^-1 (block doubling),
//   v_new = T (beta v - beta e^cum (k S)),  o = e^cum q S + P v_new,
//   S = e^cum_last S + (k e^(cum_last - cum))^T v_new.
// Every product on the tensor cores in split bf16 (gdn_split_mma.cuh: f32 operands in shared memory, each
// x = hi + lo, three mma.sync per 16-deep step, relative error ~2^-16), one 16-row warp tile per warp; the
// squares skip their tiles above the diagonal; the inverse in f32 FMA. Per (chunk, 32-column block) at dk
// 128 about 390 mma.sync per warp; two blocks per H200 SM (106 KiB of shared memory, <= 128 registers), so
// the 27B shape's 192 blocks are one wave. Expected, not yet measured: ~5-7 us per chunk, ~60 us for 531
// rows and ~0.8 ms for 8,192 on an H200.
#include "attention_common.cuh"
#include "gdn_delta_rule_common.cuh"
#include "gdn_split_mma.cuh"

constexpr int kRecurrentThreads = 128;
constexpr int kRecurrentColumns = 16;  // 4 lanes x float4
constexpr int kChunkThreads = 256;

// -- recurrent ------------------------------------------------------------------------------------------

// Thread (warp w, lane l) of a recurrent block owns value columns column0 + 4 (l % 4) .. + 3 (one float4)
// of the state rows slot + 32 i, slot = 8 w + l / 4: a warp instruction moves 8 rows x 64 contiguous bytes.
constexpr int kRecurrentRowSlots = kRecurrentThreads / 4;

template <int DK>
__forceinline__ void store_tile_rows(float* dst, const float4 (&s)[DK / kRecurrentRowSlots], long long row_step) {
#pragma unroll
    for (int i = 0; i < DK / kRecurrentRowSlots; ++i) *reinterpret_cast<float4*>(dst + i * row_step) = s[i];
}

__forceinline__ float4 load_bf16x4(const bf16* src) {
    const uint2 raw = *reinterpret_cast<const uint2*>(src);
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
    return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// Row `row`'s q and k of `key_head`, L2-normalised (q also scaled), computed by every warp on its own (no
// block barrier): lane l reads dims l + 32 e, and the thread's own state rows slot + 32 i come from lane
// `slot` by shuffle. Returns k . q of the normalised vectors.
template <int DK>
__forceinline__ float normalised_qk(float (&q_rows)[DK / 32], float (&k_rows)[DK / 32], const bf16* qk, int key_stride,
                                    int slot, int lane) {
    float qv[DK / 32], kv[DK / 32], qq = 0.0f, kk = 0.0f, qk_dot = 0.0f;
#pragma unroll
    for (int e = 0; e < DK / 32; ++e) {
        qv[e] = __bfloat162float(qk[lane + 32 * e]);
        kv[e] = __bfloat162float(qk[key_stride + lane + 32 * e]);
        qq += qv[e] * qv[e];
        kk += kv[e] * kv[e];
        qk_dot += qv[e] * kv[e];
    }
    const float q_scale = rsqrtf(warp_sum(qq) + kL2NormEps) * rsqrtf((float)DK);
    const float k_scale = rsqrtf(warp_sum(kk) + kL2NormEps);
#pragma unroll
    for (int e = 0; e < DK / 32; ++e) {
        q_rows[e] = __shfl_sync(0xffffffffu, qv[e], slot) * q_scale;
        k_rows[e] = __shfl_sync(0xffffffffu, kv[e], slot) * k_scale;
    }
    return warp_sum(qk_dot) * q_scale * k_scale;
}

// The sum over the 8 row slots of a warp (lanes of one column quad: lane bits 2..4).
__forceinline__ float4 quad_column_sum(float4 value) {
#pragma unroll
    for (int offset = 4; offset < 32; offset <<= 1) {
        value.x += __shfl_xor_sync(0xffffffffu, value.x, offset);
        value.y += __shfl_xor_sync(0xffffffffu, value.y, offset);
        value.z += __shfl_xor_sync(0xffffffffu, value.z, offset);
        value.w += __shfl_xor_sync(0xffffffffu, value.w, offset);
    }
    return value;
}

__forceinline__ float4 scaled(float4 a, float x) { return make_float4(a.x * x, a.y * x, a.z * x, a.w * x); }

// a x + c, per component
__forceinline__ float4 fma4(float4 a, float x, float4 c) {
    return make_float4(fmaf(a.x, x, c.x), fmaf(a.y, x, c.y), fmaf(a.z, x, c.z), fmaf(a.w, x, c.w));
}

// One block barrier per row: the cross-warp sums of S^T k and S^T q, double-buffered by row parity (a
// buffer is rewritten two rows later, after the next row's barrier). The step's tables are read together
// and the state right after them, before the row prologue, so the state's loads wait on one table latency.
template <int DK>
__forceinline__ void recurrent(const DeltaRuleArgs& p) {
    constexpr int kRows = DK / kRecurrentRowSlots, kWarps = kRecurrentThreads / 32;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slot = warp * 8 + (lane >> 2), quad = lane & 3;
    const int head = blockIdx.y, seq = blockIdx.z;
    const int column = blockIdx.x * kRecurrentColumns + 4 * quad;
    const float decay_rate = expf(p.a_log[head]), bias = p.dt_bias[head];  // weights: before the wait
    enter_dependent_kernel();
    const int first = p.query_start[seq], length = p.query_start[seq + 1] - first, source = p.states.slots[seq];
    if (length == 0 || length > kRecurrentMaxRows) return;  // uniform over the block
    const long long row_step = (long long)kRecurrentRowSlots * p.value_dim;
    const long long tile = ((long long)head * DK + slot) * p.value_dim + column;  // this thread's first row
    float4 s[kRows];
    const float* src = p.states.recurrent(source) + tile;
#pragma unroll
    for (int i = 0; i < kRows; ++i) s[i] = *reinterpret_cast<const float4*>(src + i * row_step);
    const int key_head = head / (p.value_heads / p.key_heads), channels = p.conv_channels(DK);
    const int initial_target = p.states.target_after(seq, 0, length);
    if (initial_target >= 0) store_tile_rows<DK>(p.states.recurrent(initial_target) + tile, s, row_step);

    __shared__ float4 partial[2][2][kWarps][kRecurrentColumns / 4];
    for (int t = 0; t < length; ++t) {
        const long long row = first + t;
        float q_rows[kRows], k_rows[kRows];
        const float kq = normalised_qk<DK>(q_rows, k_rows, p.conv + row * channels + key_head * DK, p.key_heads * DK, slot, lane);
        float beta, g;
        p.gating(row, head, decay_rate, bias, beta, g);
        const float decay = expf(g);
        const float4 v = load_bf16x4(p.conv + row * channels + 2 * p.key_heads * DK + head * p.value_dim + column);
        float4 pk = make_float4(0.0f, 0.0f, 0.0f, 0.0f), pq = pk;
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            s[i] = scaled(s[i], decay);
            pk = fma4(s[i], k_rows[i], pk);
            pq = fma4(s[i], q_rows[i], pq);
        }
        float4 (&sums)[2][kWarps][kRecurrentColumns / 4] = partial[t & 1];
        pk = quad_column_sum(pk);
        pq = quad_column_sum(pq);
        if (lane < 4) {
            sums[0][warp][quad] = pk;
            sums[1][warp][quad] = pq;
        }
        __syncthreads();
        float4 sk = sums[0][0][quad], sq = sums[1][0][quad];
#pragma unroll
        for (int w = 1; w < kWarps; ++w) {
            const float4 a = sums[0][w][quad], b = sums[1][w][quad];
            sk = make_float4(sk.x + a.x, sk.y + a.y, sk.z + a.z, sk.w + a.w);
            sq = make_float4(sq.x + b.x, sq.y + b.y, sq.z + b.z, sq.w + b.w);
        }
        const float4 delta = make_float4(beta * (v.x - sk.x), beta * (v.y - sk.y), beta * (v.z - sk.z), beta * (v.w - sk.w));
#pragma unroll
        for (int i = 0; i < kRows; ++i) s[i] = fma4(delta, k_rows[i], s[i]);
        if (threadIdx.x < 4) *reinterpret_cast<float4*>(p.out + (row * p.value_heads + head) * p.value_dim + column) = fma4(delta, kq, sq);
        const int target = p.states.target_after(seq, t + 1, length);
        if (target >= 0) store_tile_rows<DK>(p.states.recurrent(target) + tile, s, row_step);
    }
}

// -- chunked --------------------------------------------------------------------------------------------

// Shared memory of gdn_chunked_d{DK}_c{CV}, in floats (linear_attn_ops.chunked_smem_bytes mirrors it):
// k, q [64][DK+1] (q's region later holds A and T [64][64] and v_new [64][CV]), P [64][65], S [DK][CV],
// v [64][CV], cum, beta, tail decay [64]. The output's e^cum q S part stays in registers (the same warp
// tile as P v_new), so at dk 128 a block of 32 columns takes 106 KiB and two blocks share an H200 SM.
template <int DK, int CV>
struct ChunkSmem {
    static constexpr int kRowStride = DK + 1;
    static constexpr int kQRegion = kChunk * kRowStride > 2 * kChunk * kChunk ? kChunk * kRowStride : 2 * kChunk * kChunk;
    static constexpr int kFloats = kChunk * kRowStride + kQRegion + kChunk * (kChunk + 1) + DK * CV + kChunk * CV + 3 * kChunk;
    float* k;
    float* q;
    float* a;
    float* t;
    float* v_new;
    float* p;
    float* s;
    float* v;
    float* cum;
    float* beta;
    float* tail;

    __device__ explicit ChunkSmem(float* base)
        : k(base), q(base + kChunk * kRowStride), a(q), t(q + kChunk * kChunk), v_new(q), p(q + kQRegion),
          s(p + kChunk * (kChunk + 1)), v(s + DK * CV), cum(v + kChunk * CV), beta(cum + kChunk), tail(beta + kChunk) {}
};

// Rows [pos, pos + length) of the sequence: q, k normalised, beta v of the block's columns, g -> cum, beta.
// Rows past `length` are zeros (g = 0), which changes nothing in the chunk's products.
template <int DK, int CV>
__forceinline__ void load_chunk(const ChunkSmem<DK, CV>& sm, const DeltaRuleArgs& p, long long first_row, int length,
                                int head, int key_head, int column0, float decay_rate, float bias) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, channels = p.conv_channels(DK);
    for (int r = warp; r < kChunk; r += kChunkThreads / 32) {
        const bool valid = r < length;
        const long long row = first_row + r;
        float qv[DK / 32], kv[DK / 32];
        p.normalised_row<DK>(qv, kv, row, key_head, valid);
#pragma unroll
        for (int e = 0; e < DK / 32; ++e) {
            sm.q[r * (DK + 1) + lane + 32 * e] = qv[e];
            sm.k[r * (DK + 1) + lane + 32 * e] = kv[e];
        }
        const bf16* v_row = p.conv + row * channels + 2 * p.key_heads * DK + head * p.value_dim + column0;
        if (lane < CV) sm.v[r * CV + lane] = valid ? __bfloat162float(v_row[lane]) : 0.0f;
        if (lane == 0) {
            float beta = 0.0f, g = 0.0f;
            if (valid) p.gating(row, head, decay_rate, bias, beta, g);
            sm.cum[r] = g;
            sm.beta[r] = beta;
        }
    }
}

// One chunk of `length` rows starting at sequence row `pos`; S (sm.s) is the state before it, after it on
// return. Every product runs on the tensor cores (gdn_split_mma.cuh), one warp tile per warp: the 64 x 64
// squares skip their tiles above the diagonal (and T v, P v_new the zero part of T, P); the inverse is f32.
template <int DK, int CV>
__forceinline__ void chunk_step(const ChunkSmem<DK, CV>& sm, const DeltaRuleArgs& p, long long first_row, int length,
                                int head, int key_head, int column0, float decay_rate, float bias) {
    constexpr int kStride = DK + 1;
    using Square = WarpTile<kChunk, kChunk>;
    using Narrow = WarpTile<kChunk, CV>;
    using State = WarpTile<DK, CV>;
    const int warp = threadIdx.x >> 5;
    const Square square(warp);
    const Narrow narrow(warp);
    const int square_depth = square.n0 <= square.m0 + 15 ? DK : 0;  // 0: a tile above the diagonal
    const int lower_depth = narrow.m0 + 16;                          // T and P are zero right of their diagonal
    const auto q_at = [&](int m, int l) { return sm.q[m * kStride + l]; };
    const auto k_at = [&](int m, int l) { return sm.k[m * kStride + l]; };
    const auto k_rows = [&](int l, int n) { return sm.k[n * kStride + l]; };
    const auto s_at = [&](int l, int n) { return sm.s[l * CV + n]; };
    load_chunk<DK, CV>(sm, p, first_row, length, head, key_head, column0, decay_rate, bias);
    __syncthreads();
    prefix_sum_64(sm.cum);
    __syncthreads();
    const float* cum = sm.cum;
    // P = tril(q k^T D) and o = e^cum q S (kept in registers): the last reads of q
    float sq[Square::NT][4], o[Narrow::NT][4];
    split_mma(sq, square.m0, square.n0, square_depth, q_at, k_rows);
    square.each(sq, [&](int m, int n, float x) { sm.p[m * (kChunk + 1) + n] = m >= n ? x * expf(cum[m] - cum[n]) : 0.0f; });
    split_mma(o, narrow.m0, narrow.n0, DK, q_at, s_at);
    narrow.scale_rows(o, [&](int m) { return expf(cum[m]); });
    __syncthreads();
    // A = strict_tril(beta k k^T D), T = I, v <- beta (v - e^cum k S): q's region now holds A and T
    split_mma(sq, square.m0, square.n0, square_depth, k_at, k_rows);
    square.each(sq, [&](int m, int n, float x) {
        sm.a[m * kChunk + n] = m > n ? sm.beta[m] * x * expf(cum[m] - cum[n]) : 0.0f;
        sm.t[m * kChunk + n] = m == n ? 1.0f : 0.0f;
    });
    float nv[Narrow::NT][4];
    split_mma(nv, narrow.m0, narrow.n0, DK, k_at, s_at);
    narrow.each(nv, [&](int m, int n, float x) { sm.v[m * CV + n] = sm.beta[m] * (sm.v[m * CV + n] - expf(cum[m]) * x); });
    __syncthreads();
    invert_unit_lower(sm.a, sm.t);
    // v_new = T v (into A's place), and the tail decays of the state update
    split_mma(nv, narrow.m0, narrow.n0, lower_depth, [&](int m, int l) { return sm.t[m * kChunk + l]; },
              [&](int l, int n) { return sm.v[l * CV + n]; });
    narrow.each(nv, [&](int m, int n, float x) { sm.v_new[m * CV + n] = x; });
    const float last = cum[kChunk - 1];  // padding rows have g = 0: the last row's cum
    if (threadIdx.x < kChunk) sm.tail[threadIdx.x] = expf(last - cum[threadIdx.x]);
    __syncthreads();
    // o += P v_new (stored), S = e^last S + (k tail)^T v_new
    const auto v_new_at = [&](int l, int n) { return sm.v_new[l * CV + n]; };
    split_mma(nv, narrow.m0, narrow.n0, lower_depth, [&](int m, int l) { return sm.p[m * (kChunk + 1) + l]; }, v_new_at);
    float* out = p.out + (first_row * p.value_heads + head) * p.value_dim + column0;
    const long long out_row = (long long)p.value_heads * p.value_dim;
#pragma unroll
    for (int nt = 0; nt < Narrow::NT; ++nt)
#pragma unroll
        for (int r = 0; r < 4; ++r) nv[nt][r] += o[nt][r];
    narrow.each(nv, [&](int m, int n, float x) {
        if (m < length) out[m * out_row + n] = x;
    });
    const State state(warp);
    float update[State::NT][4];
    split_mma(update, state.m0, state.n0, kChunk, [&](int d, int l) { return sm.k[l * kStride + d] * sm.tail[l]; }, v_new_at);
    const float total = expf(last);
    state.each(update, [&](int d, int n, float x) { sm.s[d * CV + n] = total * sm.s[d * CV + n] + x; });
    __syncthreads();
}

// The end of the chunk starting at `pos`: the next multiple of 64, cut earlier at any requested row count.
__forceinline__ int chunk_end(const StateSlots& states, int seq, int pos, int length) {
    int end = min(length, (pos / kChunk + 1) * kChunk);
    for (int i = 0; i < states.num_targets; ++i) {
        const int count = length - states.num_targets + 1 + i;
        if (states.targets[seq * states.num_targets + i] >= 0 && count > pos && count < end) end = count;
    }
    return end;
}

template <int DK, int CV>
__forceinline__ void chunked(const DeltaRuleArgs& p) {
    extern __shared__ float chunk_smem[];
    const ChunkSmem<DK, CV> sm(chunk_smem);
    const int head = blockIdx.y, seq = blockIdx.z, column0 = blockIdx.x * CV;
    const float decay_rate = expf(p.a_log[head]), bias = p.dt_bias[head];  // weights: before the wait
    enter_dependent_kernel();
    const SequenceRows rows = sequence_rows(p.query_start, seq);
    if (rows.length <= kRecurrentMaxRows) return;  // the recurrent kernel's (uniform over the block)
    const int key_head = head / (p.value_heads / p.key_heads);
    const long long tile = (long long)head * DK * p.value_dim + column0;
    load_tile<DK, CV>(sm.s, p.states.recurrent(p.states.slots[seq]) + tile, p.value_dim);
    __syncthreads();  // the whole tile is read before any target (maybe the source slot) is written
    const int initial_target = p.states.target_after(seq, 0, rows.length);
    if (initial_target >= 0) store_tile<DK, CV>(sm.s, p.states.recurrent(initial_target) + tile, p.value_dim);
    for (int pos = 0; pos < rows.length;) {
        const int end = chunk_end(p.states, seq, pos, rows.length);
        chunk_step<DK, CV>(sm, p, rows.first + pos, end - pos, head, key_head, column0, decay_rate, bias);
        const int target = p.states.target_after(seq, end, rows.length);
        if (target >= 0) store_tile<DK, CV>(sm.s, p.states.recurrent(target) + tile, p.value_dim);
        pos = end;
    }
}

// -- gated output norm ------------------------------------------------------------------------------------

// Grid (T, ceil(Hv / 4)), block 128: warp w of block (t, g) normalises head 4g + w of row t; lanes stride
// over the head's dv values. A warp per head: with one block per row walking its heads, a decode step's
// 48 heads took 19 us of a 7 ms 27B step in each of 48 layers (H200, 2026-12-05).
extern "C" __global__ void __launch_bounds__(128) gdn_gated_norm(bf16* y, const float* o, const bf16* x, int x_stride,
                                                                   int z_column, const float* weight, int value_heads,
                                                                   int value_dim, float eps) {
    enter_dependent_kernel();
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.y * 4 + (threadIdx.x >> 5);
    const long long row = blockIdx.x;
    if (head < value_heads) {
        const float* o_head = o + (row * value_heads + head) * value_dim;
        float sum_squares = 0.0f;
        for (int d = lane; d < value_dim; d += 32) sum_squares += o_head[d] * o_head[d];
        const float inv_rms = rsqrtf(warp_sum(sum_squares) / value_dim + eps);
        const bf16* z = x + row * x_stride + z_column + head * value_dim;
        bf16* out = y + (row * value_heads + head) * value_dim;
        for (int d = lane; d < value_dim; d += 32) {
            const float gate = __bfloat162float(z[d]);
            out[d] = __float2bfloat16(weight[d] * (o_head[d] * inv_rms) * (gate * gdn_sigmoid(gate)));
        }
    }
}

#define RECURRENT_KERNEL(DK)                                                                                   \
    extern "C" __global__ void __launch_bounds__(kRecurrentThreads) gdn_recurrent_d##DK(DELTA_RULE_PARAMS) {  \
        recurrent<DK>(DELTA_RULE_ARGS);                                                                        \
    }

#define CHUNKED_KERNEL(DK, CV)                                                                                 \
    extern "C" __global__ void __launch_bounds__(kChunkThreads, 2) gdn_chunked_d##DK##_c##CV(DELTA_RULE_PARAMS) { \
        chunked<DK, CV>(DELTA_RULE_ARGS);                                                                      \
    }

RECURRENT_KERNEL(64)
RECURRENT_KERNEL(128)
CHUNKED_KERNEL(64, 16)
CHUNKED_KERNEL(64, 32)
CHUNKED_KERNEL(128, 16)
CHUNKED_KERNEL(128, 32)
