// Causal flash attention for prefill chunks, reading K/V from pages; GQA; bf16 tensor cores (mma.sync);
// the key range optionally split across blocks (flash-decoding for prefill) and merged by a combine kernel.
//
// Sequence b owns query rows query_start[b] .. query_start[b+1] (C rows: this step's chunk) and has
// L = context_lens[b] keys (the cached prefix plus this chunk, already written by rope_kv). Chunk row i sits
// at position L - C + i and attends to keys [0, L - C + i]:
//   out[row, h] = sum_k softmax_k(scale * q[row, h] . K[k, h / G]) V[k, h / G],  G = Hq / Hkv
// S = Q K^T and O += P V run on mma.sync.m16n8k16 -> f32 (sm_80 .. sm_120a, no wgmma); online softmax in
// f32 (log2 domain); the row sums stay f32. bf16 KV: bf16 mma, P rounded to bf16. int8 KV: f16 mma on the
// exact int8 values (staged into shared memory as f16 with a byte-permute and one f16x2 subtract, no
// int->float conversion), Q rounded bf16 -> f16 (exact but for |q| >= 65504 or subnormals), the per-key
// scales applied in f32 to S's columns (K) and to P's columns before P is rounded to f16 (V); i.e. the
// math of the dequantized values k * scale_k, v * scale_v without rounding them.
//
// Layout: q bf16 [T, Hq, D]; K, V [num_pages, 64, Hkv, D] bf16 or int8 (+ f32 scales [num_pages, 64, Hkv]);
// block_tables int32 [B, max_pages];
// context_lens int32 [B]; query_start int32 [B+1]; out bf16 [T, Hq, D]. Sequences with C <= decode_max_queries
// are skipped (decode_attention's in a mixed step).
// Output gate (gated attention; gate null: none, the stores unchanged): out[row, h, d] *= sigmoid(gate[row *
// gate_stride + h * D + d]), gate bf16 (4-byte aligned: the fused qkv rows' gate columns), applied in f32
// where the output is stored (the block with one split, prefill_attention_combine with several), before the
// one rounding to bf16. The kernels with several splits ignore it (their partials are ungated).
//
// Tiles (GQA sharing): a block owns one kv head and a tile of R = 128 M rows (64 at D = 256) = Qt = R / G chunk rows
// x the G q heads of that kv head (row r: chunk row q_begin + r / G, q head kv_head * G + r % G; when G does
// not divide R the last R - Qt * G rows are padding). Each K/V page is staged (and int8-dequantized) once for
// all G heads. G <= R.
// Splits: the sequence's ceil(L / 64) pages are cut into num_splits ranges of pps = ceil(pages / num_splits)
// pages; split s covers pages [s * pps, (s + 1) * pps) clipped to the pages its tile sees (empty splits exit
// at once). num_splits == 1: the block normalizes and writes out. num_splits > 1: it writes its unnormalized
// f32 partials to the workspace, and prefill_attention_combine_d{64,128,256} merges the non-empty splits:
//   partial_acc f32 [num_splits, B, tiles, Hkv, R, D], partial_ml f32 [num_splits, B, tiles, Hkv, R, 2]
//   (m = running max of scale * log2(e) * s, -inf if the row saw no key in the split; l = sum of
//   exp2(s - m)); out = sum_s exp2(m_s - M) acc_s / sum_s exp2(m_s - M) l_s, M = max_s m_s.
// Launch: prefill_attention_d{64,128,256}_{bf16,int8}: grid (tiles * num_splits, Hkv, B) with tiles =
// ceil(max_b C_b / Qt), blockIdx.x = split * tiles + (tiles - 1 - tile) (the longest causal tiles first);
// block 128 (4 warps x 32 M rows, two m16 tiles each; at D = 256 4 warps x 16 M rows, one m16 tile each, so
// that a thread's O accumulators are 128 registers); dynamic shared memory FlashSmem<D, int8>::kBytes
// (attention_plan.prefill_smem_bytes: 68 KiB bf16 / 69.5 KiB int8 at D = 128, 36 / 37.5 KiB at D = 64,
// 99 / 98.5 KiB at D = 256, within the 99 KiB of sm_86/89/120 blocks; the kernel traps on less); blocks past their sequence's chunk exit at once. prefill_attention_combine_d{64,128,256}
// (only when num_splits > 1): grid (tiles * R / 16, Hkv, B), blockIdx.x = tile * R / 16 + row group; block 128
// (M rows 16 g .. 16 g + 15 of the tile: warp w merges rows w, w + 4, ...; each lane D / 32 dims);
// prefill_attention_combine_d256_r128 the same for the sm_90a kernel's 128-row tiles at D = 256.
// Pipeline (key tiles are pages of 64 keys; one K and one V tile in shared memory): top of page kt: wait for
// K(kt) and a barrier, start V(kt)'s cp.async, S = Q K^T (Q and K fragments by ldmatrix; each K fragment feeds
// the warp's two m tiles), causal mask only on pages that reach past the tile's first position, online
// softmax (exp2 on the SFU, O rescaled only when a row's max grew), P packed to 16 bits; wait for V(kt) and a
// barrier, start K(kt + 1)'s cp.async, O += P V (V fragments by ldmatrix.trans). int8: the pages land raw
// ([64][D + 16] bytes; [64][D] at D = 256, K's chunks swizzled: FlashSmem); S takes K's B fragments straight
// from the raw page (one 32-bit word = 4 int8 dims -> two exact f16x2 words; Q's dims are permuted within each
// k step to match, once, when it is staged), V is converted to an f16 tile by all threads after the middle
// barrier (then another barrier); both pages' scales arrive with K. Rows of every 16-bit tile are padded by
// 16 bytes, so ldmatrix, the K words and the cp.async stores are conflict-free. sm_90a runs this kernel at D = 64, and for int8 KV at
// D = 256 when the pages are not widened (its wgmma kernels: bf16 and widened at D = 128 and 256, int8 at 128).
#include "attention_common.cuh"
#include "prefill_common.cuh"

constexpr int kPrefillThreads = 128;
constexpr int kCombineRows = 16;  // M rows per combine block (4 per warp): many blocks keep many loads in flight

// M rows per block at head dim D: 4 warps x 32 (two m16 tiles each), or x 16 (one) at D = 256.
template <int D>
constexpr int kTileRows = D == 256 ? kFlashRowsD256 : kFlashRows;

// D = A(16x16, row) . B(16x8, col) + C with 16-bit float inputs (bf16: bf16 KV; f16: int8 KV) and f32 accumulators.
template <bool kF16>
__forceinline__ void mma16(float (&acc)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    if constexpr (kF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// 16 int8 values (one 16-byte chunk of a key row) as exact f16 into 32 bytes of shared memory at `dst`.
__forceinline__ void int8x16_to_f16(unsigned short* dst, uint4 raw) {
    uint4* out = reinterpret_cast<uint4*>(dst);
    int8x16_to_f16x16(raw, out[0], out[1]);
}

// ---- The kernel: 128 M rows per block (4 warps x 32; 64 = 4 x 16 at D = 256), Q in shared memory, every
// fragment through ldmatrix ----

__forceinline__ void ldmatrix_x4_trans_at(unsigned (&frag)[4], unsigned address) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
                 : "r"(address)
                 : "memory");
}

// The kernel's dynamic shared memory (byte offsets; attention_ops.prefill_smem_bytes mirrors kBytes):
// Q [kTileRows<D>][D + 8] 16-bit; bf16 KV: K and V [64][D + 8] bf16; int8 KV: V [64][D + 8] f16 (converted from its
// raw page), the raw K and V pages (cp.async targets; S reads K's int8 words directly) and the 2 x 64 f32 scales.
// Raw rows are [D + 16] bytes, which keeps S's 32-bit K reads conflict-free (lane (g, c) at bank 4g + c); at
// D = 256, where that padding would take the tiles past the 99 KiB of an sm_86 / sm_89 / sm_120 block, they are
// [D] bytes and K's 16-byte chunk q of key r sits at chunk q ^ (r % 8) (kSwizzledRaw: the same banks, no
// padding; the V page is only read whole rows at a time by its conversion, which needs neither).
template <int D, bool kInt8>
struct FlashSmem {
    static constexpr int kStride = D + 8;      // 16-bit elements per row: +16 bytes, ldmatrix conflict-free
    static constexpr bool kSwizzledRaw = D == 256;
    static constexpr int kRawStride = kSwizzledRaw ? D : D + 16;  // bytes per raw int8 row
    static constexpr int kQ = 0;
    static constexpr int kK = kQ + kTileRows<D> * kStride * 2;
    static constexpr int kV = kK + (kInt8 ? 0 : kKeyTile * kStride * 2);
    static constexpr int kKRaw = kV + kKeyTile * kStride * 2;
    static constexpr int kVRaw = kKRaw + (kInt8 ? kKeyTile * kRawStride : 0);
    static constexpr int kKScale = kVRaw + (kInt8 ? kKeyTile * kRawStride : 0);
    static constexpr int kVScale = kKScale + (kInt8 ? kKeyTile * 4 : 0);
    static constexpr int kBytes = kVScale + (kInt8 ? kKeyTile * 4 : 0);
};

// Keys [0, valid_keys) of `page` for one kv head (kRowBytes per key: D * 2 for bf16, D for int8) into a
// shared tile of `dst_stride` bytes per key at shared address `dst`, through cp.async (waited for by the
// caller); the rest zero-filled. Thread t copies the 16-byte chunk t % chunks of keys t / chunks + j * passes,
// to chunk (t % chunks) ^ (key % 8) of its row with kSwizzle.
template <int kRowBytes, bool kSwizzle = false>
__forceinline__ void load_page_async(unsigned dst, int dst_stride, const void* cache, long long page, int kv_head,
                                     int num_kv_heads, int valid_keys) {
    constexpr int kChunks = kRowBytes / 16;
    constexpr int kKeysPerPass = kPrefillThreads / kChunks;
    static_assert(kKeysPerPass * kChunks == kPrefillThreads && kKeyTile % kKeysPerPass == 0, "whole passes");
    const int key0 = threadIdx.x / kChunks;
    const int part = threadIdx.x % kChunks;
    const unsigned char* base = static_cast<const unsigned char*>(cache);
    const unsigned char* src = base + ((page * kPageSize + key0) * num_kv_heads + kv_head) * kRowBytes + part * 16;
    const long long pass_bytes = (long long)kKeysPerPass * num_kv_heads * kRowBytes;
#pragma unroll
    for (int j = 0; j < kKeyTile / kKeysPerPass; ++j) {
        const bool valid = key0 + j * kKeysPerPass < valid_keys;
        const int key = key0 + j * kKeysPerPass;
        const unsigned to = dst + key * dst_stride + (kSwizzle ? part ^ (key & 7) : part) * 16;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(valid ? src + j * pass_bytes : base),
                     "r"(valid ? 16 : 0));
    }
}

// The per-key f32 scales of keys [0, valid_keys) of an int8 `page` for one kv head into scale_tile[64]
// (cp.async, zero-filled past valid_keys).
__forceinline__ void load_page_scales_async(float* scale_tile, const float* scales, long long page, int kv_head,
                                            int num_kv_heads, int valid_keys) {
    if (threadIdx.x < kKeyTile) {
        const int key = threadIdx.x;
        const bool valid = key < valid_keys;
        cp_async4(scale_tile + key, scales + (valid ? (page * kPageSize + key) * num_kv_heads + kv_head : 0), valid);
    }
}

// A raw int8 tile (landed, rows `raw_stride` bytes apart, unswizzled) into the [64][D + 8] f16 tile: exact values.
template <int D>
__forceinline__ void convert_int8_page(unsigned short* tile, const unsigned char* raw, int raw_stride) {
    constexpr int kChunks = D / 16;
#pragma unroll
    for (int i = threadIdx.x; i < kKeyTile * kChunks; i += kPrefillThreads) {
        const int key = i / kChunks;
        const int part = i % kChunks;
        int8x16_to_f16(tile + key * (D + 8) + part * 16, *reinterpret_cast<const uint4*>(raw + key * raw_stride + part * 16));
    }
}

template <int D, bool kInt8>
__forceinline__ void flash_prefill_attention(bf16* out, float* partial_acc, float* partial_ml, const bf16* q,
                                             const void* k_cache, const void* v_cache, const float* k_scale,
                                             const float* v_scale, const int* block_tables, int max_pages,
                                             const int* context_lens, const int* query_start, int decode_max_queries,
                                             int num_q_heads, int num_kv_heads, float scale, int num_splits, OutputGate gate) {
    using S = FlashSmem<D, kInt8>;
    constexpr int kRows = kTileRows<D>;
    constexpr int kMTiles = kRows / (16 * kPrefillThreads / 32);  // m16 tiles per warp
    constexpr int kStride = S::kStride;
    constexpr int kKSteps = D / 16;
    constexpr int kDimTiles = D / 8;
    // k steps of S unrolled: not all (ptxas would hoist every step's fragments and spill on sm_120a)
    constexpr int kSUnroll = kInt8 ? 1 : 2;
    extern __shared__ __align__(16) unsigned char flash_smem[];
    unsigned dynamic_bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic_bytes));
    if (dynamic_bytes < S::kBytes) __trap();  // the launch's smem must match attention_ops.prefill_smem_bytes
    unsigned short* q_tile = reinterpret_cast<unsigned short*>(flash_smem + S::kQ);
    unsigned short* k_tile = reinterpret_cast<unsigned short*>(flash_smem + S::kK);
    unsigned short* v_tile = reinterpret_cast<unsigned short*>(flash_smem + S::kV);
    unsigned char* k_raw = flash_smem + S::kKRaw;
    unsigned char* v_raw = flash_smem + S::kVRaw;
    float* k_scale_tile = reinterpret_cast<float*>(flash_smem + S::kKScale);
    float* v_scale_tile = reinterpret_cast<float*>(flash_smem + S::kVScale);
    const unsigned k_at = smem_address(k_tile), v_at = smem_address(v_tile);
    const unsigned k_raw_at = smem_address(k_raw), v_raw_at = smem_address(v_raw);

    PrefillBlock b;
    if (!prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads,
                       num_kv_heads, num_splits, kRows)) {
        return;
    }
    const PrefillTile& t = b.t;
    const int kv_head = b.kv_head, kt_begin = b.kt_begin, kt_end = b.kt_end, ctx = t.ctx;
    const int* pages = b.pages;

    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;  // mma groupID: fragment row (A, C) or column (B)
    const int c = lane & 3;   // mma threadID_in_group
    const int warp_row = warp * 16 * kMTiles;

    // Q tile (padding rows and rows past the chunk zero-filled), then K of the first page.
    for (int i = threadIdx.x; i < kRows * (D / 8); i += kPrefillThreads) {
        const int r = i / (D / 8);
        const int part = i % (D / 8);
        const int qi = tile_query(t, r);
        const long long offset = qi >= 0 ? tile_row_offset(t, r, qi, kv_head, num_q_heads, D) + part * 8 : 0;
        cp_async16(q_tile + r * kStride + part * 8, q + offset, qi >= 0);
    }
    cp_async_commit();
    const int first_keys = min(kKeyTile, ctx - kt_begin * kKeyTile);
    if constexpr (kInt8) {
        load_page_async<D, S::kSwizzledRaw>(k_raw_at, S::kRawStride, k_cache, pages[kt_begin], kv_head, num_kv_heads, first_keys);
        load_page_scales_async(k_scale_tile, k_scale, pages[kt_begin], kv_head, num_kv_heads, first_keys);
        load_page_scales_async(v_scale_tile, v_scale, pages[kt_begin], kv_head, num_kv_heads, first_keys);
    } else {
        load_page_async<2 * D>(k_at, 2 * kStride, k_cache, pages[kt_begin], kv_head, num_kv_heads, first_keys);
    }
    cp_async_commit();
    if constexpr (kInt8) {
        // int8 KV multiplies in f16 (exact int8 values): Q bf16 -> f16, and within each k step of 16 dims the
        // dim pairs reordered 0, 2, 4, 6, 1, 3, 5, 7, so that the A fragment's k slots (2c, 2c+1 | 2c+8, 2c+9)
        // hold dims 4c, 4c+1 | 4c+2, 4c+3: the order of the 4 int8 values of K's 32-bit word at dim 4c, which
        // S then reads as its B fragment without a 16-bit copy of K (the dot product is the same sum).
        cp_async_wait<1>();
        __syncthreads();  // a k step's two 16-byte chunks were copied by two threads
        for (int i = threadIdx.x; i < kRows * kKSteps; i += kPrefillThreads) {
            uint4* step = reinterpret_cast<uint4*>(q_tile + (i / kKSteps) * kStride + (i % kKSteps) * 16);
            const uint4 lo = step[0], hi = step[1];
            const unsigned in[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
            unsigned f16[8];
#pragma unroll
            for (int w = 0; w < 8; ++w) f16[w] = bf16x2_to_f16x2(in[w]);
            step[0] = make_uint4(f16[0], f16[2], f16[4], f16[6]);
            step[1] = make_uint4(f16[1], f16[3], f16[5], f16[7]);
        }
    }

    // Every ldmatrix.x4 here reads a 16 x 16 block: lane l gives the address of row l % 16, columns 8 (l / 16)
    // (matrices: rows 0-7 / 8-15 x columns 0-7, then rows 0-7 / 8-15 x columns 8-15).
    // Q (A of m tile mt): rows warp_row + 16 mt + .., dims 16 ks + ..: a0..a3 in order.
    // K (bf16; B of n tiles 2np, 2np + 1): keys 16 np + .., dims 16 ks + ..: b0, b1 of tile 2np = regs 0, 2; of 2np + 1 = 1, 3.
    // V (transposed: B of dim tiles 2dp, 2dp + 1): keys 16 kk + .., dims 16 dp + ..: b0, b1 of 2dp = 0, 1; of 2dp + 1 = 2, 3.
    const unsigned lane_offset = ((lane & 15) * kStride + (lane >> 4) * 8) * 2;
    const unsigned q_lane = smem_address(q_tile + warp_row * kStride) + lane_offset;
    const unsigned k_lane = k_at + lane_offset;
    const unsigned v_lane = v_at + lane_offset;
    const unsigned char* k_raw_lane = k_raw + g * S::kRawStride + 4 * c;  // int8: this lane's K words (32-bit, conflict-free)

    float o[kMTiles][kDimTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int dt = 0; dt < kDimTiles; ++dt) o[mt][dt][0] = o[mt][dt][1] = o[mt][dt][2] = o[mt][dt][3] = 0.0f;
    }
    float m[kMTiles][2], l[kMTiles][2];  // [m tile][rows g, g + 8]: running max (log2 domain, scaled) and this thread's share of the sum
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            m[mt][h] = neg_inf();
            l[mt][h] = 0.0f;
        }
    }
    const int min_pos = t.first_pos + t.q_begin;  // the tile's first position: earlier pages need no mask
    const int group = t.group;
    const float scale_log2 = scale * kLog2e;

    for (int kt = kt_begin; kt < kt_end; ++kt) {
        cp_async_wait<0>();  // K(kt) (and Q) landed; every warp is past P.V(kt - 1), so V's tiles are free
        __syncthreads();
        const int keys = min(kKeyTile, ctx - kt * kKeyTile);
        if constexpr (kInt8) load_page_async<D>(v_raw_at, S::kRawStride, v_cache, pages[kt], kv_head, num_kv_heads, keys);
        else load_page_async<2 * D>(v_at, 2 * kStride, v_cache, pages[kt], kv_head, num_kv_heads, keys);
        cp_async_commit();  // V(kt) flies during S and the softmax

        // S = Q K^T: each K fragment feeds the warp's m tiles.
        float s[kMTiles][8][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) s[mt][nt][0] = s[mt][nt][1] = s[mt][nt][2] = s[mt][nt][3] = 0.0f;
        }
#pragma unroll kSUnroll
        for (int ks = 0; ks < kKSteps; ++ks) {
            unsigned qa[kMTiles][4];
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) ldmatrix_x4_at(qa[mt], q_lane + (16 * mt * kStride + 16 * ks) * 2);
            if constexpr (kInt8) {
                // B fragment of n tile nt: key 8 nt + g, int8 dims 16 ks + 4c .. 4c + 3 -> (b0, b1) (see the Q staging)
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
                    const int chunk = S::kSwizzledRaw ? ks ^ g : ks;  // key 8 nt + g: its row bits below 8 are g
                    const unsigned word = *reinterpret_cast<const unsigned*>(k_raw_lane + nt * 8 * S::kRawStride + 16 * chunk);
                    const unsigned b0 = int8x2_to_f16x2<false>(word), b1 = int8x2_to_f16x2<true>(word);
#pragma unroll
                    for (int mt = 0; mt < kMTiles; ++mt) mma16<true>(s[mt][nt], qa[mt], b0, b1);
                }
            } else {
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    unsigned kb[4];
                    ldmatrix_x4_at(kb, k_lane + (16 * np * kStride + 16 * ks) * 2);
#pragma unroll
                    for (int mt = 0; mt < kMTiles; ++mt) {
                        mma16<false>(s[mt][2 * np], qa[mt], kb[0], kb[2]);
                        mma16<false>(s[mt][2 * np + 1], qa[mt], kb[1], kb[3]);
                    }
                }
            }
        }
        if constexpr (kInt8) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) scale_key_columns(s[mt], k_scale_tile, c);
        }
        // Causal mask, only on pages reaching past the tile's first position (earlier keys are visible to
        // every row and lie inside the context). Padding rows sit past the tile; zero Q keeps them finite,
        // and they are never stored.
        if (kt * kKeyTile + kKeyTile - 1 > min_pos) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) {
                const int row = warp_row + 16 * mt + g;
                mask_causal(s[mt], kt, min_pos + row / group, min_pos + (row + 8) / group, c);
            }
        }
        // O and l rescaled only when a row's max grew (a warp-uniform test).
        float alpha[kMTiles][2];
        bool grew = false;
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
            for (int h = 0; h < 2; ++h) alpha[mt][h] = softmax_rows(s[mt], h, m[mt][h], l[mt][h], scale_log2, grew);
        }
        if (__any_sync(0xffffffffu, grew)) {
#pragma unroll
            for (int mt = 0; mt < kMTiles; ++mt) rescale_rows(o[mt], alpha[mt]);
        }
        // P packed now so only half the registers stay live through the wait (int8: with V's scales, loaded
        // with K).
        unsigned pa[kMTiles][kKeyTile / 16][4];
#pragma unroll
        for (int mt = 0; mt < kMTiles; ++mt) pack_p<kInt8>(s[mt], pa[mt], v_scale_tile, c);

        cp_async_wait<0>();  // V(kt) landed; every warp is done with K(kt) and the scales of page kt
        __syncthreads();
        if (kt + 1 < kt_end) {  // K(kt + 1) flies during P.V
            const int next_keys = min(kKeyTile, ctx - (kt + 1) * kKeyTile);
            if constexpr (kInt8) {
                load_page_async<D, S::kSwizzledRaw>(k_raw_at, S::kRawStride, k_cache, pages[kt + 1], kv_head, num_kv_heads, next_keys);
                load_page_scales_async(k_scale_tile, k_scale, pages[kt + 1], kv_head, num_kv_heads, next_keys);
                load_page_scales_async(v_scale_tile, v_scale, pages[kt + 1], kv_head, num_kv_heads, next_keys);
            } else {
                load_page_async<2 * D>(k_at, 2 * kStride, k_cache, pages[kt + 1], kv_head, num_kv_heads, next_keys);
            }
        }
        cp_async_commit();
        if constexpr (kInt8) {
            convert_int8_page<D>(v_tile, v_raw, S::kRawStride);
            __syncthreads();  // v_tile converted
        }

        // O += P V.
#pragma unroll
        for (int kk = 0; kk < kKeyTile / 16; ++kk) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                unsigned vb[4];
                ldmatrix_x4_trans_at(vb, v_lane + (16 * kk * kStride + 16 * dp) * 2);
#pragma unroll
                for (int mt = 0; mt < kMTiles; ++mt) {
                    mma16<kInt8>(o[mt][2 * dp], pa[mt][kk], vb[0], vb[1]);
                    mma16<kInt8>(o[mt][2 * dp + 1], pa[mt][kk], vb[2], vb[3]);
                }
            }
        }
    }

    // The tile's geometry again (cheap loads), rather than registers held through the loop.
    prefill_block(b, block_tables, max_pages, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,
                  num_splits, kRows);
    const PrefillOutput dst = prefill_output(b, out, partial_acc, partial_ml, gate, num_q_heads, num_kv_heads, num_splits);
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) store_rows<D, kRows>(dst, t, o[mt], m[mt], l[mt], warp_row + 16 * mt, g, c);
}

// N bf16 pairs to `dst` in one store (N = 1, 2 or 4: 4, 8 or 16 bytes, aligned to their size).
template <int N>
__forceinline__ void store_words(bf16* dst, const unsigned (&words)[N]) {
    if constexpr (N == 4) *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    else if constexpr (N == 2) *reinterpret_cast<uint2*>(dst) = make_uint2(words[0], words[1]);
    else *reinterpret_cast<unsigned*>(dst) = words[0];
}

// Merges the non-empty splits of one (tile, kv head, sequence): see the header. Splits past
// ceil(num_key_tiles / pps) were empty and never wrote their partials.
template <int D, int kRows>
__forceinline__ void prefill_attention_combine(bf16* out, const float* partial_acc, const float* partial_ml,
                                               const int* context_lens, const int* query_start, int decode_max_queries,
                                               int num_q_heads, int num_kv_heads, int num_splits, OutputGate gate) {
    constexpr int kPerLane = D / 32;
    static_assert(kPerLane == 2 || kPerLane == 4 || kPerLane == 8, "combine lanes hold 2, 4 or 8 dims");
    constexpr int kVec = kPerLane == 2 ? 2 : 4;  // floats per partial load
    static_assert(kRows % kCombineRows == 0, "whole row groups");
    constexpr int kRowGroups = kRows / kCombineRows;
    const int num_tiles = gridDim.x / kRowGroups;
    const int tile = blockIdx.x / kRowGroups;
    const int row_begin = (blockIdx.x % kRowGroups) * kCombineRows;
    const int kv_head = blockIdx.y;
    const int seq = blockIdx.z;
    PrefillTile t;
    if (!prefill_tile(t, tile, seq, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads, num_splits, kRows)) return;
    const int used = (t.num_key_tiles + t.pages_per_split - 1) / t.pages_per_split;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    for (int r = row_begin + warp; r < row_begin + kCombineRows; r += kPrefillThreads / 32) {
        const int qi = tile_query(t, r);
        if (qi < 0) continue;
        float m_max = neg_inf();
#pragma unroll 4
        for (int s = 0; s < used; ++s) {
            m_max = fmaxf(m_max, partial_ml[partial_row(s, seq, gridDim.z, tile, num_tiles, kv_head, num_kv_heads, r, kRows) * 2]);
        }
        const float m_use = m_max == neg_inf() ? 0.0f : m_max;  // split 0 holds key 0, so never -inf
        float acc[kPerLane] = {};
        float sum = 0.0f;
#pragma unroll 4
        for (int s = 0; s < used; ++s) {
            const long long prow = partial_row(s, seq, gridDim.z, tile, num_tiles, kv_head, num_kv_heads, r, kRows);
            const float2 ml = *reinterpret_cast<const float2*>(partial_ml + prow * 2);
            const float w = exp2f(ml.x - m_use);  // 0 where the row saw no key of split s (its acc is 0)
            sum += w * ml.y;
            const float* src = partial_acc + prow * D + lane * kPerLane;
#pragma unroll
            for (int v = 0; v < kPerLane; v += kVec) {
                if constexpr (kVec == 4) {
                    const float4 a = *reinterpret_cast<const float4*>(src + v);
                    acc[v] += w * a.x;
                    acc[v + 1] += w * a.y;
                    acc[v + 2] += w * a.z;
                    acc[v + 3] += w * a.w;
                } else {
                    const float2 a = *reinterpret_cast<const float2*>(src + v);
                    acc[v] += w * a.x;
                    acc[v + 1] += w * a.y;
                }
            }
        }
        const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
        const bf16* gates =
            gate.gate == nullptr ? nullptr : gate.gate + tile_gate_offset(t, r, qi, kv_head, gate.stride, D) + lane * kPerLane;
        unsigned words[kPerLane / 2];
#pragma unroll
        for (int p = 0; p < kPerLane / 2; ++p) {
            words[p] = gated_pair(acc[2 * p] * inv, acc[2 * p + 1] * inv, gates == nullptr ? nullptr : gates + 2 * p);
        }
        store_words(out + tile_row_offset(t, r, qi, kv_head, num_q_heads, D) + lane * kPerLane, words);
    }
}

#define PREFILL_KERNEL(NAME, IMPL, D, KIND, INT8)                                                              \
    extern "C" __global__ void __launch_bounds__(kPrefillThreads) NAME##_d##D##_##KIND(                         \
        bf16* out, float* partial_acc, float* partial_ml, const bf16* q, const void* k_cache,                   \
        const void* v_cache, const float* k_scale, const float* v_scale, const int* block_tables,               \
        int max_pages, const int* context_lens, const int* query_start, int decode_max_queries,                 \
        int num_q_heads, int num_kv_heads, float scale, int num_splits, const bf16* gate, int gate_stride) {   \
        enter_dependent_kernel();                                                                              \
        IMPL<D, INT8>(out, partial_acc, partial_ml, q, k_cache, v_cache, k_scale, v_scale, block_tables,       \
                      max_pages, context_lens, query_start, decode_max_queries, num_q_heads, num_kv_heads,     \
                      scale, num_splits, OutputGate{gate, gate_stride});                                       \
    }

#define PREFILL_COMBINE(NAME, D, ROWS)                                                                         \
    extern "C" __global__ void __launch_bounds__(kPrefillThreads) NAME(                                        \
        bf16* out, const float* partial_acc, const float* partial_ml, const int* context_lens,                 \
        const int* query_start, int decode_max_queries, int num_q_heads, int num_kv_heads, int num_splits,     \
        const bf16* gate, int gate_stride) {                                                                   \
        enter_dependent_kernel();                                                                              \
        prefill_attention_combine<D, ROWS>(out, partial_acc, partial_ml, context_lens, query_start,            \
                                           decode_max_queries, num_q_heads, num_kv_heads, num_splits,          \
                                           OutputGate{gate, gate_stride});                                     \
    }

PREFILL_KERNEL(prefill_attention, flash_prefill_attention, 64, bf16, false)
PREFILL_KERNEL(prefill_attention, flash_prefill_attention, 128, bf16, false)
PREFILL_KERNEL(prefill_attention, flash_prefill_attention, 256, bf16, false)
PREFILL_KERNEL(prefill_attention, flash_prefill_attention, 64, int8, true)
PREFILL_KERNEL(prefill_attention, flash_prefill_attention, 128, int8, true)
PREFILL_KERNEL(prefill_attention, flash_prefill_attention, 256, int8, true)
PREFILL_COMBINE(prefill_attention_combine_d64, 64, kTileRows<64>)
PREFILL_COMBINE(prefill_attention_combine_d128, 128, kTileRows<128>)
PREFILL_COMBINE(prefill_attention_combine_d256, 256, kTileRows<256>)
// the sm_90a wgmma kernel's partials at D = 256 (prefill_attention_sm90.cu: 128-row tiles)
PREFILL_COMBINE(prefill_attention_combine_d256_r128, 256, kFlashRows)
