// Token selection on the device: greedy argmax, and temperature sampling restricted by top-k, top-p and
// min-p, each row ending in one int32 token id so the host reads 4 bytes per sequence.
//
// argmax_f32: out[r] = argmax(logits[r, :]), the lowest index among equal maxima (np.argmax's rule); NaN
// never compares greater, so a row with NaNs yields the argmax of its numbers; an all-NaN row yields 0.
//
// sample_{begin,radix,draw}: the distribution of ninfer_rt/engine/sampling.py, with no penalties. Per row,
// with T the temperature and xmax the row's largest logit (NaN counts as -inf):
//   w_i  = exp((x_i - xmax) / T)  (1 where x_i == xmax, 0 where x_i == -inf; f32), W_i = round(w_i * 2^40)
//          (u64 fixed point: every sum below is an exact integer sum, the same in any order)
//   top-k (0 < k < vocab): keep x_i >= the k-th largest logit (ties with it are all kept)
//   top-p (p < 1): Z_K = sum of W over the top-k set; keep x_i when the mass of the tokens strictly more
//          likely than token i, sum_{x_j > x_i} W_j, is < p * Z_K (ties are kept or dropped together)
//   min-p (m > 0): keep w_i >= m (w of the most likely token is 1)
//   draw: the kept tokens in index order, C_i = sum of W over kept j <= i; R = floor(u * C_last) (at most
//          C_last - 1); the token is the first kept i with C_i > R: numpy's Generator.choice(p=...) order,
//          so the host path (which draws the same u) picks the same token up to float rounding.
// The top-k and top-p thresholds are found by radix selection over the logits' order-preserving 32-bit
// keys, 11 + 11 + 10 bits: a pass histograms (count, and W-mass for top-p) the keys that match the digits
// chosen so far, and the last block of the pass to finish picks the next digit. No sort.
//
// Passes, one launch each, all grid (S, rows) x 256 threads, S = ceil(vocab / slice) <= 64 blocks per
// row, each reading its `slice` (a multiple of 4) with float4 loads when vocab % 4 == 0:
//   sample_begin                      row max (and argmax; greedy rows are finished here), top-k digit 1
//   sample_radix stage 1, 2           top-k digits 2 and 3 (only when some row has top-k)
//   sample_radix stage 4, 5, 6        top-p digits 1..3 (only when some row has top-p)
//   sample_draw                       kept mass per block, then the last block finds the token
// Each pass's blocks publish partial results to `scratch`, __threadfence, and count themselves on a per-row
// counter; the last block to arrive reduces the partials and resets the counter and the histograms to 0,
// so the scratch is clean after every pass (safe in a replayed CUDA graph) and only needs zeroing once
// when allocated. One scratch per stream: two launches must never run concurrently on one scratch.
//
// Layouts: logits f32 [rows, vocab] row-major (16-byte aligned); out int32 [rows]; params int32 [rows, 8]
// (SampleParams below; packed by ninfer_rt/engine/sampling.py pack_device_params); scratch: per row
// kArgmaxRowBytes (argmax_f32) or kSampleRowBytes (sampling) bytes, zeroed once.

#include "common.cuh"

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxSlices = 64;  // blocks per row; <= kThreads so the last block reads one partial per thread
constexpr int kUnroll = 4;      // float4 loads in flight per thread
constexpr int kBins = 2048;     // radix digits of 11 bits (the last digit has 10)
constexpr int kBinsPerThread = kBins / kThreads;
constexpr float kFixedOne = 1099511627776.0f;  // 2^40: W = round(w * 2^40)

constexpr int kArgmaxRowBytes = 16 + kMaxSlices * 8;
// SampleState (64) + partials (kMaxSlices * 8) + counts (kBins * 4) + masses (kBins * 8)
constexpr int kSampleRowBytes = 64 + kMaxSlices * 8 + kBins * 4 + kBins * 8;

enum SampleFlags : int {
    kGreedy = 1,  // argmax (temperature 0, or a row the host samples itself: its token is ignored)
    kTopK = 2,
    kTopP = 4,
    kMinP = 8,
};

struct SampleParams {  // 8 words per row
    float temperature;
    int top_k;
    float top_p;
    float min_p;
    float u;  // uniform [0, 1) from the request's generator
    int flags;
    int pad[2];
};

struct SampleState {  // the first 64 bytes of a row's scratch
    unsigned counter;  // blocks of the current pass that have finished
    float xmax;
    unsigned key_k;  // top-k threshold key (0: none)
    unsigned key_p;  // top-p threshold key (0: none)
    unsigned prefix;  // digits chosen so far by the radix pass in progress
    unsigned pad0;
    unsigned long long above;  // count (top-k) or W-mass (top-p) of the keys above the prefix's range
    unsigned long long z_k;  // W-mass of the top-k set (all tokens without top-k)
};

struct Best {
    float value;
    int index;
};

__forceinline__ Best better(Best a, Best b) {
    if (b.value > a.value || (b.value == a.value && b.index < a.index)) return b;
    return a;
}

__forceinline__ Best warp_best(Best v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        Best other{__shfl_xor_sync(0xffffffffu, v.value, offset), __shfl_xor_sync(0xffffffffu, v.index, offset)};
        v = better(v, other);
    }
    return v;
}

__forceinline__ float neg_inf() { return -__int_as_float(0x7f800000); }

// The block's best in thread 0 (other threads: unspecified).
__forceinline__ Best block_best(Best v) {
    __shared__ Best partial[kWarps];
    v = warp_best(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < kWarps ? partial[lane] : Best{neg_inf(), 0x7fffffff};
        v = warp_best(v);
    }
    return v;
}

__forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

// Sum over the block, in every thread. Integer: the result does not depend on the order.
__forceinline__ unsigned long long block_sum_u64(unsigned long long v) {
    __shared__ unsigned long long partial[kWarps];
    v = warp_sum_u64(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) v += partial[w];
    return v;
}

// Exclusive prefix sum over the block in thread order; `total` gets the block's sum.
__forceinline__ unsigned long long block_exclusive_scan_u64(unsigned long long v, unsigned long long& total) {
    __shared__ unsigned long long warp_totals[kWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned long long inclusive = v;
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
        const unsigned long long other = __shfl_up_sync(0xffffffffu, inclusive, offset);
        if (lane >= offset) inclusive += other;
    }
    __syncthreads();
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    unsigned long long before = 0;
    total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
        if (w < warp) before += warp_totals[w];
        total += warp_totals[w];
    }
    return before + inclusive - v;
}

// NaN reads as -inf everywhere in the sampler.
__forceinline__ float sanitize(float x) { return x != x ? neg_inf() : x; }

// Order-preserving: a > b (as floats, NaN already -inf) <=> key(a) > key(b).
__forceinline__ unsigned order_key(float x) {
    const unsigned bits = __float_as_uint(x);
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

// exp((x - xmax) / T) as exp2((x - xmax) * log2(e) / T); explicit roundings so every call site (the
// passes and the last block's re-scan) computes the same bits.
__forceinline__ float weight(float x, float xmax, float scale) {
    if (x == neg_inf()) return 0.0f;
    if (x == xmax) return 1.0f;
    return exp2f(__fmul_rn(__fsub_rn(x, xmax), scale));
}

__forceinline__ unsigned long long fixed(float w) { return __float2ull_rn(__fmul_rn(w, kFixedOne)); }

__forceinline__ float weight_scale(float temperature) { return __fdiv_rn(1.4426950408889634f, temperature); }

// Calls visit(x, i) for every element i of [begin, end) of `row`: kUnroll float4 loads per thread issued
// before any is used when `vec` (end and begin multiples of 4), else scalar loads.
template <typename Visit>
__forceinline__ void for_each_in_slice(const float* row, int begin, int end, bool vec, Visit visit) {
    if (vec) {
        for (int base = begin + 4 * threadIdx.x; base < end; base += 4 * kUnroll * kThreads) {
            float4 v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + 4 * u * kThreads;
                if (i < end) v[u] = *reinterpret_cast<const float4*>(row + i);
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + 4 * u * kThreads;
                if (i < end) {
                    visit(v[u].x, i);
                    visit(v[u].y, i + 1);
                    visit(v[u].z, i + 2);
                    visit(v[u].w, i + 3);
                }
            }
        }
    } else {
        for (int base = begin + threadIdx.x; base < end; base += kUnroll * kThreads) {
            float v[kUnroll];
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kThreads;
                if (i < end) v[u] = row[i];
            }
#pragma unroll
            for (int u = 0; u < kUnroll; ++u) {
                const int i = base + u * kThreads;
                if (i < end) visit(v[u], i);
            }
        }
    }
}

// Publishes nothing itself: call after writing this block's partials. True in every thread of the last
// block of the row to arrive, which has reset the counter; partials written by the others are then visible.
__forceinline__ bool last_block_of_row(unsigned* counter) {
    __shared__ bool last;
    __threadfence();  // this thread's partial writes are visible device-wide before the block counts itself
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1u) == gridDim.x - 1;
        if (last) atomicExch(counter, 0u);
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

struct Slice {
    int begin, end;
    bool vec;
};

__forceinline__ Slice my_slice(int vocab, int slice) {
    const int begin = blockIdx.x * slice;
    return Slice{begin, min(vocab, begin + slice), (vocab & 3) == 0};
}

// -- greedy ---------------------------------------------------------------------------------------------

// Launch: grid (S, rows), block kThreads; slice = multiple of 4 with S * slice >= vocab, S <= kMaxSlices.
extern "C" __global__ void __launch_bounds__(kThreads) argmax_f32(
    int* out, const float* logits, int vocab, int slice, unsigned char* scratch) {
    enter_dependent_kernel();
    const int r = blockIdx.y;
    const float* row = logits + (long long)r * vocab;
    unsigned char* mine = scratch + (long long)r * kArgmaxRowBytes;
    unsigned* counter = reinterpret_cast<unsigned*>(mine);
    Best* partials = reinterpret_cast<Best*>(mine + 16);
    const Slice s = my_slice(vocab, slice);
    // -inf with index vocab loses to every real value; an all-NaN row answers 0 below.
    Best best{neg_inf(), vocab};
    for_each_in_slice(row, s.begin, s.end, s.vec, [&](float x, int i) { best = better(best, Best{x, i}); });
    best = block_best(best);
    if (threadIdx.x == 0) partials[blockIdx.x] = best;
    if (!last_block_of_row(counter)) return;
    best = Best{neg_inf(), vocab};
    if (threadIdx.x < gridDim.x) {
        const Best* p = partials + threadIdx.x;
        best = Best{__ldcg(&p->value), __ldcg(&p->index)};
    }
    best = block_best(best);
    if (threadIdx.x == 0) out[r] = best.index < vocab ? best.index : 0;
}

// -- sampling -------------------------------------------------------------------------------------------

struct SampleRow {
    SampleState* state;
    unsigned long long* partials;  // kMaxSlices
    unsigned* counts;  // kBins
    unsigned long long* masses;  // kBins
};

__forceinline__ SampleRow sample_row(unsigned char* scratch, int r) {
    unsigned char* mine = scratch + (long long)r * kSampleRowBytes;
    return SampleRow{
        reinterpret_cast<SampleState*>(mine),
        reinterpret_cast<unsigned long long*>(mine + 64),
        reinterpret_cast<unsigned*>(mine + 64 + kMaxSlices * 8),
        reinterpret_cast<unsigned long long*>(mine + 64 + kMaxSlices * 8 + kBins * 4),
    };
}

// Digit `level` (0, 1, 2) of a key: bits 31..21, 20..10, 9..0.
__forceinline__ int digit_shift(int level) { return level == 0 ? 21 : (level == 1 ? 10 : 0); }
__forceinline__ unsigned digit_mask(int level) { return level == 2 ? 0x3ffu : 0x7ffu; }
// The key bits fixed by the digits before `level`.
__forceinline__ unsigned prefix_mask(int level) { return level == 0 ? 0u : (level == 1 ? 0xffe00000u : 0xfffffc00u); }

__shared__ unsigned s_counts[kBins];
__shared__ unsigned long long s_masses[kBins];

__forceinline__ void clear_shared_bins(bool with_mass) {
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
        s_counts[b] = 0;
        if (with_mass) s_masses[b] = 0;
    }
    __syncthreads();
}

// Adds the block's non-empty bins to the row's global histogram.
__forceinline__ void flush_bins(const SampleRow& g, bool with_mass) {
    __syncthreads();
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
        const unsigned c = s_counts[b];
        if (c) {
            atomicAdd(g.counts + b, c);
            if (with_mass && s_masses[b]) atomicAdd(g.masses + b, s_masses[b]);
        }
    }
}

// Last block: picks the digit of `level` from the row's histogram, updates state->prefix/above, and
// clears the global histogram. Digits are visited from the largest down (position j = kBins - 1 - digit);
// thread t owns positions [t * kBinsPerThread, (t + 1) * kBinsPerThread).
//   top-k (by_mass false): the digit where the count from the top reaches k.
//   top-p (by_mass true): the lowest non-empty digit whose mass strictly above (plus `above`) is < target.
__forceinline__ void choose_digit(const SampleRow& g, int level, bool by_mass, unsigned long long k, double target) {
    __shared__ int chosen;
    __shared__ unsigned long long chosen_before;
    unsigned long long amounts[kBinsPerThread];  // count (top-k) or mass (top-p) of each owned digit
    bool present[kBinsPerThread];
    unsigned long long mine = 0;
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q) {
        const int digit = kBins - 1 - (threadIdx.x * kBinsPerThread + q);
        const unsigned count = __ldcg(g.counts + digit);
        present[q] = count != 0;
        amounts[q] = by_mass ? __ldcg(g.masses + digit) : count;
        mine += amounts[q];
    }
    if (threadIdx.x == 0) {
        chosen = -1;
        chosen_before = 0;
    }
    unsigned long long total;
    unsigned long long before = block_exclusive_scan_u64(mine, total);  // syncs: `chosen` is set
    const unsigned long long above = g.state->above;
    unsigned long long starts[kBinsPerThread];
#pragma unroll
    for (int q = 0; q < kBinsPerThread; ++q) {
        const int position = threadIdx.x * kBinsPerThread + q;
        starts[q] = before;
        if (present[q]) {
            if (!by_mass) {
                if (above + before < k && k <= above + before + amounts[q]) chosen = position;  // exactly one
            } else if ((double)(above + before) < target) {
                atomicMax(&chosen, position);  // the qualifying positions are a prefix: take its end
            }
        }
        before += amounts[q];
    }
    __syncthreads();
    const int found = chosen;
    if (found >= 0 && found / kBinsPerThread == (int)threadIdx.x) {
#pragma unroll
        for (int q = 0; q < kBinsPerThread; ++q)
            if (q == found % kBinsPerThread) chosen_before = starts[q];
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // Always found: the parent digit's range is non-empty, holds the k-th key, and (top-p) the mass
        // above it is < target. Only a row without mass (all -inf: target 0) gets here with none, and
        // then the largest digit is as good as any (nothing is kept, the draw answers token 0).
        const unsigned digit = kBins - 1 - (found < 0 ? 0 : found);
        g.state->prefix |= (digit & digit_mask(level)) << digit_shift(level);
        g.state->above = above + chosen_before;
    }
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
        g.counts[b] = 0;
        if (by_mass) g.masses[b] = 0;
    }
}

// Launch: grid (S, rows), block kThreads. Row max (and argmax: greedy rows end here, out[r] is written),
// top-k's first digit for rows with kTopK. Initialises the row's state for the later passes.
extern "C" __global__ void __launch_bounds__(kThreads) sample_begin(
    int* out, const SampleParams* params, const float* logits, int vocab, int slice, unsigned char* scratch) {
    enter_dependent_kernel();
    const int r = blockIdx.y;
    const SampleParams p = params[r];
    const float* row = logits + (long long)r * vocab;
    const SampleRow g = sample_row(scratch, r);
    const Slice s = my_slice(vocab, slice);
    const bool topk = (p.flags & kTopK) && !(p.flags & kGreedy);
    if (topk) clear_shared_bins(false);
    Best best{neg_inf(), vocab};
    for_each_in_slice(row, s.begin, s.end, s.vec, [&](float x, int i) {
        best = better(best, Best{x, i});
        if (topk) atomicAdd(&s_counts[order_key(sanitize(x)) >> 21], 1u);
    });
    best = block_best(best);
    Best* partials = reinterpret_cast<Best*>(g.partials);
    if (threadIdx.x == 0) partials[blockIdx.x] = best;
    if (topk) flush_bins(g, false);
    if (!last_block_of_row(&g.state->counter)) return;
    best = Best{neg_inf(), vocab};
    if (threadIdx.x < gridDim.x) {
        const Best* q = partials + threadIdx.x;
        best = Best{__ldcg(&q->value), __ldcg(&q->index)};
    }
    best = block_best(best);
    __shared__ float xmax;
    if (threadIdx.x == 0) {
        out[r] = best.index < vocab ? best.index : 0;  // the greedy token; sample_draw overwrites sampled rows
        xmax = best.index < vocab ? best.value : neg_inf();  // all-NaN: -inf, so every weight is 0
        g.state->xmax = xmax;
        g.state->key_k = 0;
        g.state->key_p = 0;
        g.state->prefix = 0;
        g.state->above = 0;
        g.state->z_k = 0;
    }
    __syncthreads();
    if (topk) {
        choose_digit(g, 0, false, (unsigned long long)p.top_k, 0.0);
    }
}

// Launch: grid (S, rows), block kThreads. stage 1, 2: top-k digits 2, 3 (rows with kTopK);
// stage 4, 5, 6: top-p digits 1, 2, 3 (rows with kTopP; stage 4 also sums Z_K).
extern "C" __global__ void __launch_bounds__(kThreads) sample_radix(
    const SampleParams* params, const float* logits, int vocab, int slice, unsigned char* scratch, int stage) {
    enter_dependent_kernel();
    const int r = blockIdx.y;
    const SampleParams p = params[r];
    const bool by_mass = stage >= 4;
    if (p.flags & kGreedy) return;
    if (!(p.flags & (by_mass ? kTopP : kTopK))) return;
    const int level = by_mass ? stage - 4 : stage;
    const float* row = logits + (long long)r * vocab;
    const SampleRow g = sample_row(scratch, r);
    const Slice s = my_slice(vocab, slice);
    const float xmax = g.state->xmax;
    const float scale = weight_scale(p.temperature);
    const unsigned key_k = g.state->key_k;
    const unsigned want = level == 0 ? 0u : g.state->prefix;
    const unsigned fixed_bits = prefix_mask(level);
    const int shift = digit_shift(level);
    const unsigned mask = digit_mask(level);
    clear_shared_bins(by_mass);
    unsigned long long z = 0;
    for_each_in_slice(row, s.begin, s.end, s.vec, [&](float x, int) {
        x = sanitize(x);
        const unsigned key = order_key(x);
        unsigned long long w = 0;
        if (by_mass) {
            w = fixed(weight(x, xmax, scale));
            if (level == 0 && key >= key_k) z += w;
        }
        if ((key & fixed_bits) == want) {
            const int digit = (key >> shift) & mask;
            atomicAdd(&s_counts[digit], 1u);
            if (by_mass && w) atomicAdd(&s_masses[digit], w);
        }
    });
    flush_bins(g, by_mass);
    if (by_mass && level == 0) {
        z = block_sum_u64(z);
        if (threadIdx.x == 0 && z) atomicAdd(&g.state->z_k, z);
    }
    if (!last_block_of_row(&g.state->counter)) return;
    if (by_mass && level == 0 && threadIdx.x == 0) {
        g.state->prefix = 0;
        g.state->above = 0;
    }
    __syncthreads();
    const double target = by_mass ? (double)p.top_p * (double)__ldcg(&g.state->z_k) : 0.0;
    choose_digit(g, level, by_mass, (unsigned long long)p.top_k, target);
    __syncthreads();
    if (threadIdx.x == 0 && level == 2) {
        if (by_mass) g.state->key_p = g.state->prefix;
        else g.state->key_k = g.state->prefix;
    }
}

// Launch: grid (S, rows), block kThreads. For sampled rows: out[r] = the first kept token in index order
// whose cumulative kept W exceeds R = floor(u * total kept W).
extern "C" __global__ void __launch_bounds__(kThreads) sample_draw(
    int* out, const SampleParams* params, const float* logits, int vocab, int slice, unsigned char* scratch) {
    enter_dependent_kernel();
    const int r = blockIdx.y;
    const SampleParams p = params[r];
    if (p.flags & kGreedy) return;
    const float* row = logits + (long long)r * vocab;
    const SampleRow g = sample_row(scratch, r);
    const float xmax = g.state->xmax;
    const float scale = weight_scale(p.temperature);
    const unsigned threshold = max((p.flags & kTopK) ? g.state->key_k : 0u, (p.flags & kTopP) ? g.state->key_p : 0u);
    const float min_p = (p.flags & kMinP) ? p.min_p : 0.0f;
    auto kept_weight = [&](float x) -> unsigned long long {
        x = sanitize(x);
        const float w = weight(x, xmax, scale);
        return order_key(x) >= threshold && w >= min_p ? fixed(w) : 0ull;
    };
    const Slice s = my_slice(vocab, slice);
    unsigned long long mass = 0;
    for_each_in_slice(row, s.begin, s.end, s.vec, [&](float x, int) { mass += kept_weight(x); });
    mass = block_sum_u64(mass);
    if (threadIdx.x == 0) g.partials[blockIdx.x] = mass;
    if (!last_block_of_row(&g.state->counter)) return;

    // Which slice holds the token: partial sums in block order.
    unsigned long long total;
    const unsigned long long mine = threadIdx.x < gridDim.x ? __ldcg(g.partials + threadIdx.x) : 0ull;
    const unsigned long long start = block_exclusive_scan_u64(mine, total);
    __shared__ int token;
    __shared__ int target_slice;
    __shared__ unsigned long long remaining;
    if (threadIdx.x == 0) {
        token = 0;  // no kept mass (an all -inf row): token 0, as argmax answers
        target_slice = -1;
    }
    __syncthreads();
    if (total == 0) {
        if (threadIdx.x == 0) out[r] = 0;
        return;
    }
    const double scaled = (double)p.u * (double)total;
    unsigned long long R = scaled >= (double)total ? total - 1 : (unsigned long long)scaled;
    if (R >= total) R = total - 1;
    if (threadIdx.x < gridDim.x && start <= R && R < start + mine) {
        target_slice = threadIdx.x;
        remaining = R - start;
    }
    __syncthreads();
    // Scan that slice in index order, kThreads tokens at a time.
    const int begin = target_slice * slice, end = min(vocab, begin + slice);
    unsigned long long carry = 0;
    const unsigned long long want = remaining;
    for (int base = begin; base < end; base += kThreads) {
        const int i = base + threadIdx.x;
        const unsigned long long w = i < end ? kept_weight(row[i]) : 0ull;
        unsigned long long chunk;
        const unsigned long long before = block_exclusive_scan_u64(w, chunk);
        // the one thread whose cumulative range (carry + before, carry + before + w] holds want + 1
        if (w && carry + before <= want && want < carry + before + w) token = i;
        carry += chunk;
        if (carry > want) break;  // uniform across the block: every thread holds the same carry
    }
    __syncthreads();
    if (threadIdx.x == 0) out[r] = token;
}
