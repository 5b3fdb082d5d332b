// Token selection on the device, one block of 1024 threads per row.
//
// Greedy rows (temperature < 1e-6 or top_k == 1) take the argmax, the lowest
// index among ties, skipping NaN, as `sampling::argmax` does. Other rows
// weight each finite logit by p = exp((x - max) / temperature) and keep the
// tokens that pass every filter: top-k (the k largest logits, found by a radix
// select over order-preserving keys; ties at the k-th value are all kept),
// top-p (the smallest head of largest logits whose mass reaches top_p of the
// top-k mass, found bit by bit the same way) and min-p (p >= min_p). A uniform
// u from `SeqRng::new(seed).next_f32()` then picks the first kept token, in
// index order, whose running mass exceeds u times the kept mass. The draw
// follows the same distribution as the host sampler, not the same token.
//
// params: [rows, 6] u32 = temperature bits, top_k, top_p bits, min_p bits,
// seed low, seed high.

#define SAMPLE_THREADS 1024

__device__ __forceinline__ u32 order_key(float f) {
    const u32 u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ bool finite_f(float f) {
    return (__float_as_uint(f) & 0x7f800000u) != 0x7f800000u;
}

// (value, index) argmax over a block: larger value wins, then the lower index.
__device__ void block_argmax(float& v, u32& i, float* sv, u32* si) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = SHFL_XOR(v, o);
        const u32 i2 = SHFL_XOR(i, o);
        if (v2 > v || (v2 == v && i2 < i) || (v != v && v2 == v2)) {
            v = v2;
            i = i2;
        }
    }
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? sv[lane] : -INFINITY;
    i = lane < (int)(blockDim.x >> 5) ? si[lane] : 0xffffffffu;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float v2 = SHFL_XOR(v, o);
        const u32 i2 = SHFL_XOR(i, o);
        if (v2 > v || (v2 == v && i2 < i) || (v != v && v2 == v2)) {
            v = v2;
            i = i2;
        }
    }
}

__device__ u32 block_count(u32 c, u32* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) c += SHFL_XOR(c, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = c;
    __syncthreads();
    u32 t = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) t += SHFL_XOR(t, o);
    return t;
}

// SeqRng::new(seed).next_f32(): SplitMix64 seeding, one xoshiro256** step.
__device__ float seq_rng_first_f32(u64 seed) {
    u64 x = seed;
    splitmix64(&x);
    const u64 s1 = splitmix64(&x);
    // xoshiro256**'s first output depends on the second state word only.
    const u64 result = rotl64(s1 * 5ull, 7) * 9ull;
    return (float)(result >> 40) / 16777216.0f;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* logits, const u32* params, u32* out, int rows, int vocab) {
    __shared__ float sv[32];
    __shared__ u32 si[32];
    __shared__ float sf[32];
    __shared__ u32 done;
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* x = logits + (size_t)row * vocab;
    const u32* pr = params + 6 * row;
    const float temp = __uint_as_float(pr[0]);
    const u32 top_k = pr[1];
    const float top_p = __uint_as_float(pr[2]);
    const float min_p = __uint_as_float(pr[3]);
    const u64 seed = (u64)pr[4] | ((u64)pr[5] << 32);
    const int tid = threadIdx.x;

    // Argmax: NaN never wins; all-NaN rows fall back to token 0.
    float bv = -INFINITY;
    u32 bi = 0xffffffffu;
    for (int j = tid; j < vocab; j += blockDim.x) {
        const float v = x[j];
        if (v > bv || (v == bv && (u32)j < bi)) {
            bv = v;
            bi = (u32)j;
        }
    }
    block_argmax(bv, bi, sv, si);
    const u32 arg = bi < (u32)vocab ? bi : 0u;
    const bool greedy = !(temp >= 1e-6f) || top_k == 1u;
    if (greedy || !finite_f(bv)) {
        if (tid == 0) out[row] = arg;
        return;
    }
    const float mx = bv;
    const float inv_t = 1.0f / temp;

    // Top-k threshold on keys: the k-th largest finite logit.
    u32 tk = 0u;
    if (top_k > 0u) {
        u32 fin = 0u;
        for (int j = tid; j < vocab; j += blockDim.x) fin += finite_f(x[j]) ? 1u : 0u;
        fin = block_count(fin, si);
        if (top_k < fin) {
            for (int bit = 31; bit >= 0; --bit) {
                const u32 cand = tk | (1u << bit);
                u32 c = 0u;
                for (int j = tid; j < vocab; j += blockDim.x) {
                    const float v = x[j];
                    c += (finite_f(v) && order_key(v) >= cand) ? 1u : 0u;
                }
                c = block_count(c, si);
                if (c >= top_k) tk = cand;
            }
        }
    }
    // Mass above a threshold key.
    float total = 0.0f;
    for (int j = tid; j < vocab; j += blockDim.x) {
        const float v = x[j];
        if (finite_f(v) && order_key(v) >= tk) total += expf((v - mx) * inv_t);
    }
    total = block_sum(total, sf);
    u32 tp = tk;
    if (top_p < 1.0f) {
        const float want = top_p * total;
        u32 t = 0u;
        for (int bit = 31; bit >= 0; --bit) {
            const u32 cand = t | (1u << bit);
            const u32 th = cand > tk ? cand : tk;
            float mass = 0.0f;
            for (int j = tid; j < vocab; j += blockDim.x) {
                const float v = x[j];
                if (finite_f(v) && order_key(v) >= th) mass += expf((v - mx) * inv_t);
            }
            mass = block_sum(mass, sf);
            if (mass >= want) t = cand;
        }
        tp = t > tk ? t : tk;
    }
    // Kept mass with min-p, and the last kept index (for rounding at the end).
    float kept = 0.0f;
    u32 last_kept = 0u;
    for (int j = tid; j < vocab; j += blockDim.x) {
        const float v = x[j];
        if (finite_f(v) && order_key(v) >= tp) {
            const float p = expf((v - mx) * inv_t);
            if (p >= min_p) {
                kept += p;
                last_kept = (u32)j;
            }
        }
    }
    kept = block_sum(kept, sf);
    if (tid == 0) done = 0u;
    __syncthreads();
    atomicMax(&done, last_kept);
    __syncthreads();
    last_kept = done;
    __syncthreads();
    if (!(kept > 0.0f)) {
        if (tid == 0) out[row] = arg;
        return;
    }
    const float r = seq_rng_first_f32(seed) * kept;
    // First kept index, in index order, whose running mass exceeds r.
    if (tid == 0) done = 0xffffffffu;
    float base = 0.0f;
    const int lane = tid & 31, warp = tid >> 5;
    const int warps = blockDim.x >> 5;
    for (int j0 = 0; j0 < vocab; j0 += blockDim.x) {
        const int j = j0 + tid;
        float p = 0.0f;
        if (j < vocab) {
            const float v = x[j];
            if (finite_f(v) && order_key(v) >= tp) {
                const float e = expf((v - mx) * inv_t);
                if (e >= min_p) p = e;
            }
        }
        // Inclusive block scan of p: within warps, then over warp totals.
        float sc = p;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = SHFL_UP(sc, o);
            if (lane >= o) sc += y;
        }
        __syncthreads();
        if (lane == 31) sf[warp] = sc;
        __syncthreads();
        if (warp == 0) {
            float w = lane < warps ? sf[lane] : 0.0f;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float y = SHFL_UP(w, o);
                if (lane >= o) w += y;
            }
            sf[lane] = w;
        }
        __syncthreads();
        const float incl = base + sc + (warp > 0 ? sf[warp - 1] : 0.0f);
        if (p > 0.0f && incl > r) atomicMin(&done, (u32)j);
        base += sf[warps - 1];
        __syncthreads();
        if (done != 0xffffffffu) break;
    }
    if (tid == 0) out[row] = done != 0xffffffffu ? done : last_kept;
}

// Token edits of logits rows (engine-core's `logit_edits`), one thread per
// edit. An edit is 6 words: row, token (bit 31: forbidden), then the f32 bits
// of pos_scale, neg_scale, penalty and bias. The logit x becomes -inf when
// forbidden, else (x * (x > 0 ? pos_scale : neg_scale) - penalty) + bias,
// each operation correctly rounded on its own (the _rn intrinsics are never
// contracted into an fma): the host's bits. Edits touch distinct entries.
extern "C" __global__ void edit_tokens(float* logits, const u32* edits, int n, int vocab) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const u32* e = edits + 6 * (size_t)i;
    const u32 tw = e[1];
    float* at = logits + (size_t)e[0] * vocab + (tw & 0x7fffffffu);
    if (tw >> 31) {
        *at = -INFINITY;
        return;
    }
    const float x = *at;
    const float s = __uint_as_float(x > 0.0f ? e[2] : e[3]);
    *at = __fadd_rn(__fsub_rn(__fmul_rn(x, s), __uint_as_float(e[4])), __uint_as_float(e[5]));
}

// Grammar masks: block (x, k) covers tokens of masked row k (`rows[k]`); a
// token whose bit (t % 32 of word t / 32 of mask k, `words` words a mask) is
// clear becomes -inf.
extern "C" __global__ void mask_rows(float* logits, const u32* rows, const u32* masks, int n,
                                     int vocab, int words) {
    const int k = blockIdx.y;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= n || t >= vocab) return;
    const u32 w = masks[(size_t)k * words + (t >> 5)];
    if (((w >> (t & 31)) & 1u) == 0u) logits[(size_t)rows[k] * vocab + t] = -INFINITY;
}

// Log-probability statistics of logits rows, one block of LP_THREADS per row:
// the row's log-sum-exp (m + log(sum(exp(x - m))) from its largest value m;
// m itself when m is not finite), then its `top` largest logits as
// (id, logit - lse), largest first and the lower id first among equal values:
// pick k is the best (value, id) strictly after pick k - 1 in that order, so
// no list of earlier picks is kept. NaN logits are never picked.
#define LP_THREADS 256

// (v, i) is a better pick than (w, j): any pick beats none; then the larger
// value, then the lower id.
__device__ __forceinline__ bool lp_better(float v, u32 i, float w, u32 j) {
    return j == 0xffffffffu || (i != 0xffffffffu && (v > w || (v == w && i < j)));
}

extern "C" __global__ void __launch_bounds__(LP_THREADS)
    logprob_stats(const float* logits, float* lse, u32* ids, float* vals, int rows, int vocab,
                  int top) {
    __shared__ float sv[LP_THREADS];
    __shared__ u32 si[LP_THREADS];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* x = logits + (size_t)row * vocab;
    const int t = threadIdx.x;
    float m = -INFINITY;
    for (int i = t; i < vocab; i += LP_THREADS) m = fmaxf(m, x[i]);
    sv[t] = m;
    __syncthreads();
    for (int s = LP_THREADS / 2; s > 0; s >>= 1) {
        if (t < s) sv[t] = fmaxf(sv[t], sv[t + s]);
        __syncthreads();
    }
    m = sv[0];
    __syncthreads();
    float l = m;
    if (finite_f(m)) {
        float s = 0.0f;
        for (int i = t; i < vocab; i += LP_THREADS) s += expf(x[i] - m);
        sv[t] = s;
        __syncthreads();
        for (int h = LP_THREADS / 2; h > 0; h >>= 1) {
            if (t < h) sv[t] += sv[t + h];
            __syncthreads();
        }
        l = m + logf(sv[0]);
        __syncthreads();
    }
    if (t == 0) lse[row] = l;
    float pv = 0.0f;
    u32 pid = 0xffffffffu;
    for (int k = 0; k < top; ++k) {
        float bv = -INFINITY;
        u32 bi = 0xffffffffu;
        for (int i = t; i < vocab; i += LP_THREADS) {
            const float v = x[i];
            const bool after = k == 0 || v < pv || (v == pv && (u32)i > pid);
            if (after && v == v && lp_better(v, (u32)i, bv, bi)) {
                bv = v;
                bi = (u32)i;
            }
        }
        sv[t] = bv;
        si[t] = bi;
        __syncthreads();
        for (int h = LP_THREADS / 2; h > 0; h >>= 1) {
            if (t < h && lp_better(sv[t + h], si[t + h], sv[t], si[t])) {
                sv[t] = sv[t + h];
                si[t] = si[t + h];
            }
            __syncthreads();
        }
        pv = sv[0];
        pid = si[0];
        if (t == 0) {
            ids[(size_t)row * top + k] = pid;
            vals[(size_t)row * top + k] = pv - l;
        }
        __syncthreads();
    }
}
