// What the prefill attention kernels share (prefill_attention.cu: mma.sync, every arch;
// prefill_attention_sm90.cu: wgmma, sm_90a): the tile geometry of a block (GQA rows, causal key range,
// key-range splits), the partial workspace's row index, the exact int8 -> f16 conversion and 16-bit packing
// of int8 KV, and the per-m16-tile steps of the online softmax (with the int8 scales), P's packing and the store, on the accumulator layout both
// MMA kinds give a warp (rows g and g + 8 of a 16-row tile; s[nt][e]: key 8 nt + 2c + (e & 1) of row
// g + 8 (e >> 1); g = lane / 4, c = lane % 4).
// Included by the .cu files as "prefill_common.cuh" after attention_common.cuh; part of their cache keys.
#pragma once
#include "attention_common.cuh"

constexpr int kFlashRows = 128;  // M rows (chunk row, q head) per block
// M rows per mma.sync block at D = 256: a warp's f32 accumulators of one m16 tile (16 x 256) already take
// 128 registers, and the 16-bit Q, K and V tiles of 64 rows fill 99 KiB of shared memory
constexpr int kFlashRowsD256 = 64;
constexpr int kKeyTile = kPageSize;
constexpr float kLog2e = 1.4426950408889634f;

// Which rows and pages a block (or a combine block) works on; false when the block has nothing to do.
struct PrefillTile {
    int row0;             // the sequence's first row in q / out
    int chunk;            // C
    int ctx;              // L
    int first_pos;        // L - C: position of chunk row 0
    int group;            // G
    int tile_queries;     // Qt = R / G chunk rows per tile
    int q_begin;          // first chunk row of the tile
    int num_key_tiles;    // pages the tile sees: its last row's keys
    int pages_per_split;  // pps
};

__forceinline__ bool prefill_tile(PrefillTile& t, int tile, int seq, const int* context_lens, const int* query_start,
                                  int decode_max_queries, int num_q_heads, int num_kv_heads, int num_splits, int tile_rows) {
    t.row0 = query_start[seq];
    t.chunk = query_start[seq + 1] - t.row0;
    t.group = num_q_heads / num_kv_heads;
    t.tile_queries = tile_rows / t.group;
    t.q_begin = tile * t.tile_queries;
    if (t.chunk <= decode_max_queries || t.q_begin >= t.chunk) return false;
    t.ctx = context_lens[seq];
    t.first_pos = t.ctx - t.chunk;
    const int key_end = t.first_pos + min(t.q_begin + t.tile_queries, t.chunk);  // one past the tile's last key
    t.num_key_tiles = (key_end + kKeyTile - 1) / kKeyTile;
    const int pages = (t.ctx + kKeyTile - 1) / kKeyTile;
    t.pages_per_split = (pages + num_splits - 1) / num_splits;
    return true;
}

// A prefill block's share of the grid: blockIdx.x = split * tiles + (tiles - 1 - tile) (the longest causal
// tiles start first), blockIdx.y = kv head, blockIdx.z = sequence; pages [kt_begin, kt_end) of its split.
struct PrefillBlock {
    PrefillTile t;
    int tile, split, num_tiles, kv_head, seq, kt_begin, kt_end;
    const int* pages;  // the sequence's row of the block table
};

// false when the block has nothing to do (a decode sequence, a tile past the chunk, an empty split: the
// combine never reads those).
__forceinline__ bool prefill_block(PrefillBlock& b, const int* block_tables, int max_pages, const int* context_lens,
                                   const int* query_start, int decode_max_queries, int num_q_heads, int num_kv_heads,
                                   int num_splits, int tile_rows = kFlashRows) {
    b.num_tiles = gridDim.x / num_splits;
    b.tile = b.num_tiles - 1 - blockIdx.x % b.num_tiles;
    b.split = blockIdx.x / b.num_tiles;
    b.kv_head = blockIdx.y;
    b.seq = blockIdx.z;
    if (!prefill_tile(b.t, b.tile, b.seq, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,
                      num_splits, tile_rows)) {
        return false;
    }
    b.kt_begin = b.split * b.t.pages_per_split;
    b.kt_end = min(b.kt_begin + b.t.pages_per_split, b.t.num_key_tiles);
    b.pages = block_tables + (long long)b.seq * max_pages;
    return b.kt_begin < b.kt_end;
}

// Chunk row (relative to q_begin) of M row r, or -1 for padding rows and rows past the chunk.
__forceinline__ int tile_query(const PrefillTile& t, int r) {
    const int qi = r / t.group;
    return qi < t.tile_queries && t.q_begin + qi < t.chunk ? qi : -1;
}

// Element offset of M row r's (row, q head) in q / out, for a valid row qi = tile_query(t, r).
__forceinline__ long long tile_row_offset(const PrefillTile& t, int r, int qi, int kv_head, int num_q_heads, int head_dim) {
    const int head = kv_head * t.group + (r - qi * t.group);
    return ((long long)(t.row0 + t.q_begin + qi) * num_q_heads + head) * head_dim;
}

// Element offset of M row r's gates (OutputGate: rows `stride` apart, head h's from h * head_dim).
__forceinline__ long long tile_gate_offset(const PrefillTile& t, int r, int qi, int kv_head, int stride, int head_dim) {
    const int head = kv_head * t.group + (r - qi * t.group);
    return (long long)(t.row0 + t.q_begin + qi) * stride + (long long)head * head_dim;
}

// Two output values with their gates applied (gate words: one bf16x2 word per pair; none without a gate), packed.
__forceinline__ unsigned gated_pair(float lo, float hi, const bf16* gate) {
    if (gate == nullptr) return pack_bf16x2(lo, hi);
    const unsigned g = *reinterpret_cast<const unsigned*>(gate);
    return pack_bf16x2(gated(lo, bf16_lo(g)), gated(hi, bf16_hi(g)));
}

// Row index of M row r of (split, seq, tile, kv_head) in the partial workspace.
__forceinline__ long long partial_row(int split, int seq, int num_seqs, int tile, int num_tiles, int kv_head,
                                      int num_kv_heads, int r, int tile_rows) {
    return ((((long long)split * num_seqs + seq) * num_tiles + tile) * num_kv_heads + kv_head) * tile_rows + r;
}

// Four 8x8 16-bit matrices from shared memory (non-transposed); lanes 8i..8i+7 give matrix i's row addresses.
__forceinline__ void ldmatrix_x4_at(unsigned (&frag)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(address)
                 : "memory");
}

// 2^x on the SFU (ex2.approx.ftz: 2 ulp; -inf -> +0).
__forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> one f16x2 word, `lo` at the lower address (round to nearest even).
__forceinline__ unsigned pack_f16x2(float lo, float hi) {
    unsigned word;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(word) : "f"(hi), "f"(lo));
    return word;
}

// A bf16 pair as an f16 pair (round to nearest even): Q for the f16 MMAs.
__forceinline__ unsigned bf16x2_to_f16x2(unsigned pair) {
    return pack_f16x2(bf16_lo(pair), bf16_hi(pair));
}

// Two floats -> the 16-bit pair the P.V product takes.
template <bool kF16>
__forceinline__ unsigned pack16x2(float lo, float hi) {
    if constexpr (kF16) return pack_f16x2(lo, hi);
    else return pack_bf16x2(lo, hi);
}

// Bytes 0, 1 (`high` false) or 2, 3 (`high` true) of a word of 4 int8 values as an exact f16x2 pair:
// the byte + 128 becomes the low mantissa byte of 1024.0 (f16 0x6400: unit steps), minus 1152 = 1024 + 128.
template <bool kHigh>
__forceinline__ unsigned int8x2_to_f16x2(unsigned word) {
    const unsigned biased = word ^ 0x80808080u;
    const unsigned magic = __byte_perm(biased, 0x64646464u, kHigh ? 0x4342u : 0x4140u);
    unsigned value;
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(value) : "r"(magic), "r"(0x64806480u));
    return value;
}

// 16 int8 values (a 16-byte chunk of a key row) as exact f16: values 0-7 in `lo`, 8-15 in `hi`.
__forceinline__ void int8x16_to_f16x16(uint4 raw, uint4& lo, uint4& hi) {
    lo = make_uint4(int8x2_to_f16x2<false>(raw.x), int8x2_to_f16x2<true>(raw.x), int8x2_to_f16x2<false>(raw.y),
                    int8x2_to_f16x2<true>(raw.y));
    hi = make_uint4(int8x2_to_f16x2<false>(raw.z), int8x2_to_f16x2<true>(raw.z), int8x2_to_f16x2<false>(raw.w),
                    int8x2_to_f16x2<true>(raw.w));
}

// Causal mask of one m16 tile of S over page kt: keys past a row's position -> -inf (rows g and g + 8 sit at
// positions pos_lo and pos_hi).
__forceinline__ void mask_causal(float (&s)[8][4], int kt, int pos_lo, int pos_hi, int c) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int key = kt * kKeyTile + nt * 8 + 2 * c + (e & 1);
            if (key > (e < 2 ? pos_lo : pos_hi)) s[nt][e] = neg_inf();
        }
    }
}

// Online softmax of row g (h = 0) or g + 8 (h = 1) of one m16 tile over a page, in the log2 domain:
// s <- p = 2^(s * scale * log2 e - m) with m the row's running max (scaled); l, this thread's share of the
// row sum, rescaled and extended. Returns alpha, the factor the row's O must be rescaled by; `grew` is set
// when the row's max grew (alpha < 1).
__forceinline__ float softmax_rows(float (&s)[8][4], int h, float& m, float& l, float scale_log2, bool& grew) {
    float tile_max = neg_inf();
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) tile_max = fmaxf(tile_max, fmaxf(s[nt][2 * h], s[nt][2 * h + 1]));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float m_new = fmaxf(m, tile_max * scale_log2);
    const float m_use = m_new == neg_inf() ? 0.0f : m_new;  // nothing visible yet: keep exp2 away from NaN
    const float alpha = fast_exp2(m - m_use);
    grew |= m_new > m;
    m = m_new;
    float tile_sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 2 * h; e < 2 * h + 2; ++e) {
            s[nt][e] = fast_exp2(fmaf(s[nt][e], scale_log2, -m_use));
            tile_sum += s[nt][e];
        }
    }
    l = l * alpha + tile_sum;
    return alpha;
}

// int8 K: S's columns (one m16 tile over a page) times their keys' scales, scales[64] of the page.
__forceinline__ void scale_key_columns(float (&s)[8][4], const float* scales, int c) {
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const float2 sc = *reinterpret_cast<const float2*>(scales + nt * 8 + 2 * c);
        s[nt][0] *= sc.x;
        s[nt][1] *= sc.y;
        s[nt][2] *= sc.x;
        s[nt][3] *= sc.y;
    }
}

// O's rows g and g + 8 (one m16 tile, N n8 tiles) times their softmax_rows alphas.
template <int N>
__forceinline__ void rescale_rows(float (&o)[N][4], const float (&alpha)[2]) {
#pragma unroll
    for (int dt = 0; dt < N; ++dt) {
        o[dt][0] *= alpha[0];
        o[dt][1] *= alpha[0];
        o[dt][2] *= alpha[1];
        o[dt][3] *= alpha[1];
    }
}

// P (one m16 tile over a page) as the A fragments of P V: the accumulator layout of S tiles 2kk, 2kk + 1 is
// the A-fragment layout of P[:, 16kk : 16kk + 16] (keys 16kk + 2c, +1 and 16kk + 8 + 2c, +1), rounded to f16
// (kF16) or bf16. kVScales (int8 KV): P's columns times their keys' V scales (v_scales[64]) first.
template <bool kF16, bool kVScales = kF16>
__forceinline__ void pack_p(const float (&s)[8][4], unsigned (&p)[kKeyTile / 16][4], const float* v_scales, int c) {
#pragma unroll
    for (int kk = 0; kk < kKeyTile / 16; ++kk) {
        float2 vs0 = make_float2(1.0f, 1.0f), vs1 = make_float2(1.0f, 1.0f);
        if constexpr (kVScales) {
            vs0 = *reinterpret_cast<const float2*>(v_scales + kk * 16 + 2 * c);
            vs1 = *reinterpret_cast<const float2*>(v_scales + kk * 16 + 8 + 2 * c);
        }
        p[kk][0] = pack16x2<kF16>(s[2 * kk][0] * vs0.x, s[2 * kk][1] * vs0.y);
        p[kk][1] = pack16x2<kF16>(s[2 * kk][2] * vs0.x, s[2 * kk][3] * vs0.y);
        p[kk][2] = pack16x2<kF16>(s[2 * kk + 1][0] * vs1.x, s[2 * kk + 1][1] * vs1.y);
        p[kk][3] = pack16x2<kF16>(s[2 * kk + 1][2] * vs1.x, s[2 * kk + 1][3] * vs1.y);
    }
}

// Where a block's rows go: out, gated when there is a gate (one split), or the partial workspace (several:
// the combine gates).
struct PrefillOutput {
    bf16* out;
    float* partial_acc;
    float* partial_ml;
    OutputGate gate;
    int split, seq, tile, num_tiles, kv_head, num_q_heads, num_kv_heads, num_splits;
};

__forceinline__ PrefillOutput prefill_output(const PrefillBlock& b, bf16* out, float* partial_acc, float* partial_ml,
                                             OutputGate gate, int num_q_heads, int num_kv_heads, int num_splits) {
    return {out, partial_acc, partial_ml, gate, b.split, b.seq, b.tile, b.num_tiles, b.kv_head, num_q_heads, num_kv_heads,
            num_splits};
}

// Rows row0 + g and row0 + 8 + g of a block's tile of kRows M rows: O (D dims as D / 8 n8 tiles) normalized
// (and gated) into out, or with the running max m and the row sum into the workspace. l is this thread's share
// of the row sum.
template <int D, int kRows = kFlashRows>
__forceinline__ void store_rows(const PrefillOutput& dst, const PrefillTile& t, const float (&o)[D / 8][4],
                                const float (&m)[2], const float (&l)[2], int row0, int g, int c) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float sum = l[h];  // spread over the 4 threads of the row's quad
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        const int r = row0 + 8 * h + g;
        const int qi = tile_query(t, r);
        if (qi < 0) continue;
        if (dst.num_splits == 1) {
            const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
            bf16* out = dst.out + tile_row_offset(t, r, qi, dst.kv_head, dst.num_q_heads, D) + 2 * c;
            const OutputGate& og = dst.gate;
            const bf16* gate = og.gate == nullptr ? nullptr : og.gate + tile_gate_offset(t, r, qi, dst.kv_head, og.stride, D) + 2 * c;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                const bf16* pair_gate = gate == nullptr ? nullptr : gate + dt * 8;
                *reinterpret_cast<unsigned*>(out + dt * 8) = gated_pair(o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv, pair_gate);
            }
        } else {
            const long long prow = partial_row(dst.split, dst.seq, gridDim.z, dst.tile, dst.num_tiles, dst.kv_head,
                                               dst.num_kv_heads, r, kRows);
            float* acc = dst.partial_acc + prow * D + 2 * c;
#pragma unroll
            for (int dt = 0; dt < D / 8; ++dt) {
                *reinterpret_cast<float2*>(acc + dt * 8) = make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
            }
            if (c == 0) *reinterpret_cast<float2*>(dst.partial_ml + prow * 2) = make_float2(m[h], sum);
        }
    }
}
