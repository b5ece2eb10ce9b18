// Per-step attention input preparation: optional q/k RMSNorm per head, NeoX RoPE, K/V write into pages.
//
// For each new token t (row of the fused QKV projection) and position p = positions[t]:
//   q_h = qkv[t, h*D : (h+1)*D]                       h < Hq
//   k_h = qkv[t, (Hq+h)*D : ...], v_h = qkv[t, (Hq+Hkv+h)*D : ...]   h < Hkv
//   x  <- q_norm * (x * rsqrt(mean(x^2) + eps))         for q heads when q_norm != null (k: k_norm)
//   x' [i]       = x[i] * cos[p, i] - x[i + R/2] * sin[p, i]          i < R/2 (NeoX: i pairs with i + R/2)
//   x' [i + R/2] = x[i + R/2] * cos[p, i] + x[i] * sin[p, i]            dims >= R untouched
// R = rotary_dim: D, or (partial RoPE, the hybrid's 25%) at most D/2 with (R/2) % (D/64) == 0.
//   q_out[t, h] = q'_h (bf16);  K[slot] = k'_h, V[slot] = v_h, slot = slot_mapping[t] (skipped when < 0:
//   padding rows of a captured graph bucket).
// int8 KV: per (slot, kv_head) scale = absmax/127 (1.0 for an all-zero row, as kv/cache.py's host
// quantizer), value = clamp(rint(x / scale), -127, 127); quantized from the f32 result of norm + RoPE.
//
// Layout: qkv bf16 [T, qkv_stride] (q heads, k heads, v heads first; the hybrid's gate rows may follow);
// q_norm, k_norm [D] (or null), bf16, or f32 when norm_f32 (zero-centred gains 1 + w formed in f32);
// cos_sin f32 [max_pos, 2, R/2] (row p: cos[0..R/2), then sin[0..R/2); YaRN's attention scaling already
// folded in by the host);
// positions, slot_mapping int32 [T]; q_out bf16 [T, Hq, D];
// K, V [num_pages, 64, Hkv, D] bf16 or int8, k_scale, v_scale f32 [num_pages, 64, Hkv] (int8 only).
// Math in f32; each output rounded once on store.
// Launch: grid (ceil((Hq + Hkv) / 4), T), block 128: one warp per (token, head); warps Hq.. handle the kv
// head's K and V. Lane l owns dims [l*E, l*E+E) and their RoPE partners [D/2 + l*E, ...), E = D/64, so a
// rotation never crosses lanes. Kernels rope_kv_d{64,128,256}_{bf16,int8}; no shared memory.
#include "attention_common.cuh"

constexpr int kRopeWarps = 4;

template <int D>
struct HeadSlice {
    static constexpr int kPer = D / 64;  // elements per lane in each half
    float lo[kPer];  // dims lane*kPer + e
    float hi[kPer];  // dims D/2 + lane*kPer + e
};

template <int D>
__forceinline__ void load_head(HeadSlice<D>& x, const bf16* src, int lane) {
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        x.lo[e] = __bfloat162float(src[lane * HeadSlice<D>::kPer + e]);
        x.hi[e] = __bfloat162float(src[D / 2 + lane * HeadSlice<D>::kPer + e]);
    }
}

template <int D>
__forceinline__ void load_gain(HeadSlice<D>& gain, const void* src, bool f32, int lane) {
    if (!f32) {
        load_head<D>(gain, static_cast<const bf16*>(src), lane);
        return;
    }
    const float* w = static_cast<const float*>(src);
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        gain.lo[e] = w[lane * HeadSlice<D>::kPer + e];
        gain.hi[e] = w[D / 2 + lane * HeadSlice<D>::kPer + e];
    }
}

template <int D>
__forceinline__ void rms_normalize(HeadSlice<D>& x, const HeadSlice<D>& gain, float eps) {
    float sum_squares = 0.0f;
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) sum_squares += x.lo[e] * x.lo[e] + x.hi[e] * x.hi[e];
    const float inv_rms = rsqrtf(warp_sum(sum_squares) / D + eps);
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        x.lo[e] = gain.lo[e] * (x.lo[e] * inv_rms);
        x.hi[e] = gain.hi[e] * (x.hi[e] * inv_rms);
    }
}

template <int D>
__forceinline__ void rotate(HeadSlice<D>& x, const float* cos_sin_row, int lane) {
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        const int i = lane * HeadSlice<D>::kPer + e;
        const float c = cos_sin_row[i];
        const float s = cos_sin_row[D / 2 + i];
        const float a = x.lo[e];
        const float b = x.hi[e];
        x.lo[e] = a * c - b * s;
        x.hi[e] = b * c + a * s;
    }
}

// Partial RoPE (R <= D/2): dims i < R live in the low halves, i's partner i + R/2 in the same element of the
// lane (R/2) / kPer further on, so the rotation is a pair of shuffles; the high halves are untouched.
template <int D>
__forceinline__ void rotate_partial(HeadSlice<D>& x, const float* cos_sin_row, int lane, int rotary_dim) {
    const int half = rotary_dim / 2;
    const int shift = half / HeadSlice<D>::kPer;
    float turned[HeadSlice<D>::kPer];
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        const float above = __shfl_down_sync(0xffffffffu, x.lo[e], shift);  // dim i + R/2
        const float below = __shfl_up_sync(0xffffffffu, x.lo[e], shift);    // dim i - R/2
        const int i = lane * HeadSlice<D>::kPer + e;
        turned[e] = x.lo[e];
        if (i < half) {
            turned[e] = x.lo[e] * cos_sin_row[i] - above * cos_sin_row[half + i];
        } else if (i < rotary_dim) {
            turned[e] = x.lo[e] * cos_sin_row[i - half] + below * cos_sin_row[i];
        }
    }
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) x.lo[e] = turned[e];
}

template <int D>
__forceinline__ void store_bf16(bf16* dst, const HeadSlice<D>& x, int lane) {
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        dst[lane * HeadSlice<D>::kPer + e] = __float2bfloat16(x.lo[e]);
        dst[D / 2 + lane * HeadSlice<D>::kPer + e] = __float2bfloat16(x.hi[e]);
    }
}

// Symmetric int8 with one f32 scale for the whole head row, identical to kv/cache.py quantize_int8.
template <int D>
__forceinline__ void store_int8(signed char* dst, float* scale_dst, const HeadSlice<D>& x, int lane) {
    float absmax = 0.0f;
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) absmax = fmaxf(absmax, fmaxf(fabsf(x.lo[e]), fabsf(x.hi[e])));
    absmax = warp_max(absmax);
    const float scale = absmax > 0.0f ? absmax / 127.0f : 1.0f;
#pragma unroll
    for (int e = 0; e < HeadSlice<D>::kPer; ++e) {
        const int lo = min(127, max(-127, __float2int_rn(x.lo[e] / scale)));
        const int hi = min(127, max(-127, __float2int_rn(x.hi[e] / scale)));
        dst[lane * HeadSlice<D>::kPer + e] = static_cast<signed char>(lo);
        dst[D / 2 + lane * HeadSlice<D>::kPer + e] = static_cast<signed char>(hi);
    }
    if (lane == 0) *scale_dst = scale;
}

template <int D, bool kInt8>
__forceinline__ void store_kv(void* cache, float* scales, long long slot, int kv_head, int num_kv_heads,
                              const HeadSlice<D>& x, int lane) {
    const long long offset = kv_row_offset(slot, kv_head, num_kv_heads, D);
    if constexpr (kInt8) {
        store_int8<D>(static_cast<signed char*>(cache) + offset, scales + slot * num_kv_heads + kv_head, x, lane);
    } else {
        store_bf16<D>(static_cast<bf16*>(cache) + offset, x, lane);
    }
}

// On every layer's critical path, so built for latency: the norm gains (weights) are loaded before the wait
// for the previous kernel; the position, the slot and the head's values (q, or k and v) after it in one round
// trip; the cos/sin row, which depends on the position, in a second.
template <int D, bool kInt8>
__forceinline__ void rope_kv(bf16* q_out, void* k_cache, void* v_cache, float* k_scale, float* v_scale,
                             const bf16* qkv, const void* q_norm, const void* k_norm, float eps, const float* cos_sin,
                             const int* positions, const int* slot_mapping, int num_q_heads, int num_kv_heads,
                             int qkv_stride, int rotary_dim, int norm_f32) {
    const int lane = threadIdx.x & 31;
    const int head = blockIdx.x * kRopeWarps + (threadIdx.x >> 5);
    const bool exists = head < num_q_heads + num_kv_heads;
    const bool is_q = head < num_q_heads;
    const void* norm = is_q ? q_norm : k_norm;
    HeadSlice<D> gain;
    if (exists && norm != nullptr) load_gain<D>(gain, norm, norm_f32 != 0, lane);
    enter_dependent_kernel();
    if (!exists) return;  // whole warps leave; the kernel has no block barrier
    const int token = blockIdx.y;
    const bf16* row = qkv + (long long)token * qkv_stride;
    const int position = positions[token];
    const int slot = is_q ? 0 : slot_mapping[token];
    const int kv_head = head - num_q_heads;
    HeadSlice<D> x, v;
    load_head<D>(x, row + head * D, lane);  // q head `head`, or k head `kv_head` (K follows the Hq q heads)
    if (!is_q) load_head<D>(v, row + (num_q_heads + num_kv_heads + kv_head) * D, lane);
    if (norm != nullptr) rms_normalize<D>(x, gain, eps);
    if (rotary_dim == D) {
        rotate<D>(x, cos_sin + (long long)position * D, lane);
    } else {
        rotate_partial<D>(x, cos_sin + (long long)position * rotary_dim, lane, rotary_dim);
    }
    if (is_q) {
        store_bf16<D>(q_out + ((long long)token * num_q_heads + head) * D, x, lane);
        return;
    }
    if (slot < 0) return;
    store_kv<D, kInt8>(k_cache, k_scale, slot, kv_head, num_kv_heads, x, lane);
    store_kv<D, kInt8>(v_cache, v_scale, slot, kv_head, num_kv_heads, v, lane);
}

#define ROPE_KV_KERNEL(D, KIND, INT8)                                                                          \
    extern "C" __global__ void __launch_bounds__(128) rope_kv_d##D##_##KIND(                                   \
        bf16* q_out, void* k_cache, void* v_cache, float* k_scale, float* v_scale, const bf16* qkv,             \
        const void* q_norm, const void* k_norm, float eps, const float* cos_sin, const int* positions,         \
        const int* slot_mapping, int num_q_heads, int num_kv_heads, int qkv_stride, int rotary_dim,            \
        int norm_f32) {                                                                                        \
        rope_kv<D, INT8>(q_out, k_cache, v_cache, k_scale, v_scale, qkv, q_norm, k_norm, eps, cos_sin,          \
                         positions, slot_mapping, num_q_heads, num_kv_heads, qkv_stride, rotary_dim, norm_f32); \
    }

ROPE_KV_KERNEL(64, bf16, false)
ROPE_KV_KERNEL(128, bf16, false)
ROPE_KV_KERNEL(256, bf16, false)
ROPE_KV_KERNEL(64, int8, true)
ROPE_KV_KERNEL(128, int8, true)
ROPE_KV_KERNEL(256, int8, true)
