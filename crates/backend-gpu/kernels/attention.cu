// Paged attention: decode as flash-decoding (each block reduces one split of a
// sequence's pages for all query heads of one KV head; a merge kernel combines
// the splits with the online-softmax rescale) and prefill over a cached prefix
// (tiles of queries against tiles of keys in shared memory, online softmax, as
// FlashAttention), both with grouped-query attention and an optional sliding
// window. All arithmetic is f32; K and V are read from the cache in its type
// (f32, f16, bf16, FP8 E4M3 or E5M2) times the layer's k_scale / v_scale (1
// unless the cache is FP8 with checkpoint scales).
//
// Sequence metadata `seq_info` is [seqs, 4] int: q_start (row of the first new
// token), q_len, kv_len (tokens in the cache after this batch) and page_start
// (index of the first page in `page_table`). A sequence with kv_len 0 is
// padding: its output rows are written as zeros.
//
// Draft trees (prefill kernels only; a tree of one token is a decode): `tree`
// is null when no sequence of the batch is a tree, else 4 words per new token
// (engine-core's BatchLayout::tree_mask_words): depth + 1 for a tree token (0
// for a chain's), then bits over its sequence's new tokens (bit i % 32 of word
// 1 + i / 32: it sees new token i, an ancestor or itself). New token i sits at
// cache position prefix + i; its position for the sliding window is prefix +
// its depth.

__device__ __forceinline__ u32 kv_slot(const u32* page_table, int page_start, int pos,
                                       int page_size) {
    return page_table[page_start + pos / page_size] * (u32)page_size + (u32)(pos % page_size);
}

// ---------------------------------------------------------------------------
// Decode, part 1. Grid (seqs, kv_heads, splits), 128 threads (4 warps).
// Block (s, g, p) handles the pages of split p of sequence s for the query
// heads of KV head g, in chunks of G heads; each warp takes every 4th token.
// Lane l holds head dims l, l + 32, ... (DPL of them, head_dim <= 32 * DPL).
// Writes unnormalized partial outputs part_o [seqs, heads, splits, head_dim]
// and (max, sum) pairs part_ml [seqs, heads, splits, 2].
template <typename KV, int DPL, int G>
__device__ void decode_split_impl(const float* q, const KV* kc, const KV* vc, const int* seq_info,
                                  const u32* page_table, float* part_o, float* part_ml,
                                  int heads, int kv_heads, int head_dim, int page_size, int splits,
                                  float scale, int window, float k_scale, float v_scale) {
    __shared__ float sm_m[4][G];
    __shared__ float sm_l[4][G];
    __shared__ float sm_acc[4][G][32 * DPL];
    const int s = blockIdx.x, g = blockIdx.y, p = blockIdx.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int q_row = seq_info[4 * s + 0];
    const int kv_len = seq_info[4 * s + 2];
    const int page_start = seq_info[4 * s + 3];
    const int group = heads / kv_heads;
    // Split p covers whole pages [p * per, (p + 1) * per) of the sequence.
    const int pages = (kv_len + page_size - 1) / page_size;
    const int per = (pages + splits - 1) / splits;
    int t0 = p * per * page_size;
    int t1 = min(kv_len, (p + 1) * per * page_size);
    if (window > 0) t0 = max(t0, kv_len - window);
    const int qw = heads * head_dim;
    for (int g0 = 0; g0 < group; g0 += G) {
        const int gn = min(G, group - g0);
        float qv[G][DPL];
        float acc[G][DPL];
        float m[G], l[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            m[j] = -INFINITY;
            l[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                const int h = g * group + g0 + j;
                qv[j][i] = (j < gn && d < head_dim) ? q[(size_t)q_row * qw + h * head_dim + d] * scale
                                                    : 0.0f;
                acc[j][i] = 0.0f;
            }
        }
        for (int t = t0 + warp; t < t1; t += 4) {
            const size_t base =
                ((size_t)kv_slot(page_table, page_start, t, page_size) * kv_heads + g) * head_dim;
            float kr[DPL], vr[DPL];
#pragma unroll
            for (int i = 0; i < DPL; ++i) {
                const int d = lane + 32 * i;
                kr[i] = d < head_dim ? to_f32(kc[base + d]) * k_scale : 0.0f;
                vr[i] = d < head_dim ? to_f32(vc[base + d]) * v_scale : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < G; ++j) {
                if (j < gn) {
                    float sc = 0.0f;
#pragma unroll
                    for (int i = 0; i < DPL; ++i) sc += qv[j][i] * kr[i];
                    sc = warp_sum(sc);
                    const float mn = fmaxf(m[j], sc);
                    const float corr = expf(m[j] - mn);
                    const float pr = expf(sc - mn);
                    l[j] = l[j] * corr + pr;
                    m[j] = mn;
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[j][i] = acc[j][i] * corr + pr * vr[i];
                }
            }
        }
        // Combine the four warps.
#pragma unroll
        for (int j = 0; j < G; ++j) {
            if (lane == 0) {
                sm_m[warp][j] = m[j];
                sm_l[warp][j] = l[j];
            }
#pragma unroll
            for (int i = 0; i < DPL; ++i) sm_acc[warp][j][lane + 32 * i] = acc[j][i];
        }
        __syncthreads();
        for (int e = threadIdx.x; e < gn * head_dim; e += blockDim.x) {
            const int j = e / head_dim, d = e - j * head_dim;
            float mx = -INFINITY;
            for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sm_m[w][j]);
            float lsum = 0.0f, o = 0.0f;
            if (mx != -INFINITY) {
                for (int w = 0; w < 4; ++w) {
                    const float f = expf(sm_m[w][j] - mx);
                    lsum += sm_l[w][j] * f;
                    o += sm_acc[w][j][d] * f;
                }
            }
            const int h = g * group + g0 + j;
            const size_t at = ((size_t)s * heads + h) * splits + p;
            part_o[at * head_dim + d] = o;
            if (d == 0) {
                part_ml[2 * at] = mx;
                part_ml[2 * at + 1] = lsum;
            }
        }
        __syncthreads();
    }
}

#define DECODE_SPLIT(NAME, KV, DPL, G)                                                          \
    extern "C" __global__ void NAME(const float* q, const KV* kc, const KV* vc,                 \
                                    const int* seq_info, const u32* page_table, float* part_o,  \
                                    float* part_ml, int heads, int kv_heads, int head_dim,      \
                                    int page_size, int splits, float scale, int window,         \
                                    float k_scale, float v_scale) {                             \
        decode_split_impl<KV, DPL, G>(q, kc, vc, seq_info, page_table, part_o, part_ml, heads,  \
                                      kv_heads, head_dim, page_size, splits, scale, window,     \
                                      k_scale, v_scale);                                        \
    }

DECODE_SPLIT(decode_split_f32_d128, float, 4, 8)
DECODE_SPLIT(decode_split_f16_d128, f16_t, 4, 8)
DECODE_SPLIT(decode_split_bf16_d128, bf16_t, 4, 8)
DECODE_SPLIT(decode_split_f32_d256, float, 8, 4)
DECODE_SPLIT(decode_split_f16_d256, f16_t, 8, 4)
DECODE_SPLIT(decode_split_bf16_d256, bf16_t, 8, 4)
DECODE_SPLIT(decode_split_e4m3_d128, e4m3_t, 4, 8)
DECODE_SPLIT(decode_split_e5m2_d128, e5m2_t, 4, 8)
DECODE_SPLIT(decode_split_e4m3_d256, e4m3_t, 8, 4)
DECODE_SPLIT(decode_split_e5m2_d256, e5m2_t, 8, 4)

// Decode, part 2. Grid (seqs, heads), 128 threads: out = sum_p w_p o_p / sum_p w_p l_p
// with w_p = exp(m_p - max_p m_p).
extern "C" __global__ void decode_merge(const float* part_o, const float* part_ml,
                                        const int* seq_info, float* out, int heads, int head_dim,
                                        int splits) {
    const int s = blockIdx.x, h = blockIdx.y;
    const int row = seq_info[4 * s + 0];
    const size_t at = ((size_t)s * heads + h) * splits;
    float mx = -INFINITY;
    for (int p = 0; p < splits; ++p) mx = fmaxf(mx, part_ml[2 * (at + p)]);
    float* o = out + (size_t)row * heads * head_dim + (size_t)h * head_dim;
    if (mx == -INFINITY) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) o[d] = 0.0f;
        return;
    }
    float lsum = 0.0f;
    for (int p = 0; p < splits; ++p) {
        lsum += part_ml[2 * (at + p) + 1] * expf(part_ml[2 * (at + p)] - mx);
    }
    const float inv = lsum > 0.0f ? 1.0f / lsum : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int p = 0; p < splits; ++p) {
            const float w = expf(part_ml[2 * (at + p)] - mx);
            acc += w * part_o[(at + p) * head_dim + d];
        }
        o[d] = acc * inv;
    }
}

// ---------------------------------------------------------------------------
// Prefill over a cached prefix. Grid (query tiles, heads, seqs), 256 threads as
// 16 x 16 (tx, ty). A tile has BQ = 16 * RI queries and each key tile BK = 16 *
// CJ keys; thread (tx, ty) owns query rows ty + 16 i and score columns tx + 16 j,
// and output dims tx + 16 j (j < DJ, head_dim <= 16 * DJ). Dynamic shared
// memory: Q [BQ][hd + 1], K [BK][hd + 1], V [BK][hd], P [BQ][BK + 1] floats,
// then for a batch with a tree T [BQ][4] words.
//
// A chain's query sees cache positions lo..=its own. For a tree's tile, T
// holds per query its first visible position qlo (as an int) and the bits of
// the new tokens it sees within the window: its ancestors and itself, less
// the `qlo - prefix` shallowest (ancestors come in depth order, one per
// depth); the key tiles start where the window of a depth-0 token could.
template <typename KV, int RI, int CJ, int DJ>
__device__ void prefill_impl(const float* q, const KV* kc, const KV* vc, const int* seq_info,
                             const u32* page_table, const u32* tree, float* out, int heads,
                             int kv_heads, int head_dim, int page_size, float scale, int window,
                             float k_scale, float v_scale) {
    constexpr int BQ = 16 * RI;
    constexpr int BK = 16 * CJ;
    extern __shared__ float smem[];
    const int s = blockIdx.z, h = blockIdx.y;
    const int q_start = seq_info[4 * s + 0];
    const int q_len = seq_info[4 * s + 1];
    const int kv_len = seq_info[4 * s + 2];
    const int page_start = seq_info[4 * s + 3];
    const int qi0 = blockIdx.x * BQ;
    if (qi0 >= q_len) return;
    const int prefix = kv_len - q_len;
    const int hd = head_dim;
    const int hp = hd + 1;
    const int g = h / (heads / kv_heads);
    const int qw = heads * hd;
    float* Qs = smem;
    float* Ks = Qs + BQ * hp;
    float* Vs = Ks + BK * hp;
    float* Ps = Vs + BK * hd;
    u32* Ts = reinterpret_cast<u32*>(Ps + BQ * (BK + 1));
    const int tid = threadIdx.x;
    const int tx = tid & 15, ty = tid >> 4;

    for (int e = tid; e < BQ * hd; e += 256) {
        const int r = e / hd, d = e - r * hd;
        const int qi = qi0 + r;
        Qs[r * hp + d] = qi < q_len ? q[(size_t)(q_start + qi) * qw + h * hd + d] * scale : 0.0f;
    }
    const int n_rows = min(BQ, q_len - qi0);
    const int pos_first = prefix + qi0;
    const int pos_last = prefix + qi0 + n_rows - 1;
    // A tree's root has a mask row (depth + 1 = 1); a chain's rows are zero.
    const bool is_tree = tree != nullptr && tree[4 * (size_t)q_start] != 0u;
    const int lo = window > 0 ? max(0, (is_tree ? prefix : pos_first) - window + 1) : 0;
    if (is_tree && tid < n_rows) {
        const u32* row = tree + 4 * (size_t)(q_start + qi0 + tid);
        const int qlo = window > 0 ? prefix + (int)row[0] - window : 0;
        int drop = qlo - prefix;
        for (int w = 0; w < 3; ++w) {
            u32 bits = row[1 + w];
            for (; drop > 0 && bits != 0u; --drop) bits &= bits - 1u;
            Ts[4 * tid + 1 + w] = bits;
        }
        Ts[4 * tid] = (u32)qlo;
    }

    float o[RI][DJ];
    float m[RI], l[RI];
#pragma unroll
    for (int i = 0; i < RI; ++i) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
#pragma unroll
        for (int j = 0; j < DJ; ++j) o[i][j] = 0.0f;
    }

    for (int k0 = lo; k0 <= pos_last; k0 += BK) {
        __syncthreads();
        for (int e = tid; e < BK * hd; e += 256) {
            const int c = e / hd, d = e - c * hd;
            const int kp = k0 + c;
            float kv = 0.0f, vv = 0.0f;
            if (kp <= pos_last) {
                const size_t at =
                    ((size_t)kv_slot(page_table, page_start, kp, page_size) * kv_heads + g) * hd + d;
                kv = to_f32(kc[at]) * k_scale;
                vv = to_f32(vc[at]) * v_scale;
            }
            Ks[c * hp + d] = kv;
            Vs[c * hd + d] = vv;
        }
        __syncthreads();
        float sc[RI][CJ];
#pragma unroll
        for (int i = 0; i < RI; ++i)
#pragma unroll
            for (int j = 0; j < CJ; ++j) sc[i][j] = 0.0f;
        for (int d = 0; d < hd; ++d) {
            float a[RI], b[CJ];
#pragma unroll
            for (int i = 0; i < RI; ++i) a[i] = Qs[(ty + 16 * i) * hp + d];
#pragma unroll
            for (int j = 0; j < CJ; ++j) b[j] = Ks[(tx + 16 * j) * hp + d];
#pragma unroll
            for (int i = 0; i < RI; ++i)
#pragma unroll
                for (int j = 0; j < CJ; ++j) sc[i][j] += a[i] * b[j];
        }
#pragma unroll
        for (int i = 0; i < RI; ++i) {
            const int r = ty + 16 * i;
            // A tree's query: the prefix keys from its qlo, then T's bits.
            const int qpos = is_tree ? prefix - 1 : pos_first + r;
            const int qlo = is_tree ? (r < n_rows ? (int)Ts[4 * r] : 0)
                                    : (window > 0 ? qpos - window + 1 : 0);
            float rmax = -INFINITY;
#pragma unroll
            for (int j = 0; j < CJ; ++j) {
                const int kp = k0 + tx + 16 * j;
                const int nt = kp - prefix;
                const bool ok =
                    r < n_rows && ((kp <= qpos && kp >= qlo) ||
                                   (is_tree && nt >= 0 && kp <= pos_last &&
                                    ((Ts[4 * r + 1 + (nt >> 5)] >> (nt & 31)) & 1u)));
                if (!ok) sc[i][j] = -INFINITY;
                rmax = fmaxf(rmax, sc[i][j]);
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1)
                rmax = fmaxf(rmax, SHFL_XOR(rmax, off));
            const float mn = fmaxf(m[i], rmax);
            float rsum = 0.0f;
            if (mn == -INFINITY) {
#pragma unroll
                for (int j = 0; j < CJ; ++j) Ps[r * (BK + 1) + tx + 16 * j] = 0.0f;
            } else {
#pragma unroll
                for (int j = 0; j < CJ; ++j) {
                    const float pr = expf(sc[i][j] - mn);
                    Ps[r * (BK + 1) + tx + 16 * j] = pr;
                    rsum += pr;
                }
            }
#pragma unroll
            for (int off = 8; off > 0; off >>= 1)
                rsum += SHFL_XOR(rsum, off);
            if (mn != -INFINITY) {
                const float corr = expf(m[i] - mn);
                l[i] = l[i] * corr + rsum;
                m[i] = mn;
#pragma unroll
                for (int j = 0; j < DJ; ++j) o[i][j] *= corr;
            }
        }
        __syncthreads();
        for (int c = 0; c < BK; ++c) {
            float pv[RI];
#pragma unroll
            for (int i = 0; i < RI; ++i) pv[i] = Ps[(ty + 16 * i) * (BK + 1) + c];
#pragma unroll
            for (int j = 0; j < DJ; ++j) {
                const int d = tx + 16 * j;
                const float vv = d < hd ? Vs[c * hd + d] : 0.0f;
#pragma unroll
                for (int i = 0; i < RI; ++i) o[i][j] += pv[i] * vv;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RI; ++i) {
        const int r = ty + 16 * i;
        if (r < n_rows) {
            const float inv = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
            float* orow = out + (size_t)(q_start + qi0 + r) * qw + h * hd;
#pragma unroll
            for (int j = 0; j < DJ; ++j) {
                const int d = tx + 16 * j;
                if (d < hd) orow[d] = o[i][j] * inv;
            }
        }
    }
}

#define PREFILL(NAME, KV, RI, CJ, DJ)                                                          \
    extern "C" __global__ void __launch_bounds__(256)                                         \
        NAME(const float* q, const KV* kc, const KV* vc, const int* seq_info,                  \
             const u32* page_table, const u32* tree, float* out, int heads, int kv_heads,      \
             int head_dim, int page_size, float scale, int window, float k_scale,              \
             float v_scale) {                                                                  \
        prefill_impl<KV, RI, CJ, DJ>(q, kc, vc, seq_info, page_table, tree, out, heads,        \
                                     kv_heads, head_dim, page_size, scale, window, k_scale,    \
                                     v_scale);                                                 \
    }

PREFILL(prefill_f32_d128, float, 4, 4, 8)
PREFILL(prefill_f16_d128, f16_t, 4, 4, 8)
PREFILL(prefill_bf16_d128, bf16_t, 4, 4, 8)
PREFILL(prefill_f32_d256, float, 2, 2, 16)
PREFILL(prefill_f16_d256, f16_t, 2, 2, 16)
PREFILL(prefill_bf16_d256, bf16_t, 2, 2, 16)
// 16 x 16 tiles, for devices whose blocks get 64 KiB of shared memory (AMD
// LDS) and head dims above 128.
PREFILL(prefill_f32_d256_small, float, 1, 1, 16)
PREFILL(prefill_f16_d256_small, f16_t, 1, 1, 16)
PREFILL(prefill_bf16_d256_small, bf16_t, 1, 1, 16)
PREFILL(prefill_e4m3_d128, e4m3_t, 4, 4, 8)
PREFILL(prefill_e5m2_d128, e5m2_t, 4, 4, 8)
PREFILL(prefill_e4m3_d256, e4m3_t, 2, 2, 16)
PREFILL(prefill_e5m2_d256, e5m2_t, 2, 2, 16)
PREFILL(prefill_e4m3_d256_small, e4m3_t, 1, 1, 16)
PREFILL(prefill_e5m2_d256_small, e5m2_t, 1, 1, 16)
