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

// Row s of `seq_info`.
struct SeqInfo {
    int q_start, q_len, kv_len, page_start;
};
__device__ __forceinline__ SeqInfo seq_at(const int* seq_info, int s) {
    SeqInfo r;
    r.q_start = seq_info[4 * s + 0];
    r.q_len = seq_info[4 * s + 1];
    r.kv_len = seq_info[4 * s + 2];
    r.page_start = seq_info[4 * s + 3];
    return r;
}

// ---------------------------------------------------------------------------
// Vector loads of KV elements: N consecutive elements (N * sizeof(KV) a
// multiple of 4 bytes, the address aligned to that size) as f32 times `s`.
template <int W> struct alignas(4 * W) Words { u32 w[W]; };

// Element i of packed words: the storage types of 1 and 2 bytes (`x` holds
// the bits), and f32.
template <typename KV> __device__ __forceinline__ float kv_elem(const u32* w, int i) {
    constexpr int BITS = 8 * (int)sizeof(KV);
    constexpr int PER = 32 / BITS;
    KV v;
    v.x = (decltype(v.x))(w[i / PER] >> (BITS * (i % PER)));
    return to_f32(v);
}
template <> __device__ __forceinline__ float kv_elem<float>(const u32* w, int i) {
    return __uint_as_float(w[i]);
}

template <typename KV, int N>
__device__ __forceinline__ void load_kv(const KV* p, float s, float* f) {
    constexpr int W = (N * (int)sizeof(KV)) / 4;
    const Words<W> r = *reinterpret_cast<const Words<W>*>(p);
#pragma unroll
    for (int i = 0; i < N; ++i) f[i] = kv_elem<KV>(r.w, i) * s;
}

// N elements of a row at p, times s: one vector load (VEC: N elements make
// whole words of a power-of-two count, at an address aligned to them), else
// element by element.
template <typename KV, int N, bool VEC> struct RowLoad {
    static __device__ __forceinline__ void load(const KV* p, float s, float* f) {
#pragma unroll
        for (int i = 0; i < N; ++i) f[i] = to_f32(p[i]) * s;
    }
};
template <typename KV, int N> struct RowLoad<KV, N, true> {
    static __device__ __forceinline__ void load(const KV* p, float s, float* f) {
        load_kv<KV, N>(p, s, f);
    }
};

// Decode split sizes (attention.rs mirrors them in `decode_splits`).
#define DECODE_SPLIT_MIN_TOKENS 64
#define DECODE_MAX_SPLITS 16

// ---------------------------------------------------------------------------
// Decode, part 1. Grid (seqs, kv_heads, splits), 128 threads (4 warps).
// Block (s, g, p) handles the pages of split p of sequence s for the query
// heads of KV head g, in chunks of G heads (their scaled queries in shared
// memory). Each warp takes every 4th tile of 32 consecutive tokens: lane t
// computes the scores of token t of the tile against the G queries from its
// whole K row; the tile's softmax update is one warp max per head; then the
// tile's V rows are accumulated token by token, lane l holding head dims
// DPL * l .. DPL * l + DPL - 1 (head_dim <= 32 * DPL), each token's weight
// broadcast from its lane. Loads are batched (four K chunks, VB V rows)
// so that each warp keeps several in flight. Rows are read with vector loads when head_dim is
// a multiple of 8 (every element's address then aligned), else element by
// element; a lane's V dims too when VEC_V (DPL elements make a power-of-two
// number of words: not latent attention's 18 of 576). Writes unnormalized partial outputs part_o [seqs, heads, splits,
// head_dim] and (max, sum) pairs part_ml [seqs, heads, splits, 2].
//
// A sequence's splits depend on its own length alone (each covers at least
// DECODE_SPLIT_MIN_TOKENS tokens, whole pages, and a sequence has at most
// DECODE_MAX_SPLITS), never on `splits` (the grid, at least the most any
// sequence of the batch needs): so its partial sums and its output are the
// same bits alone, in any batch and in any graph bucket. Blocks past a
// sequence's splits write empty partials (max -inf, sums 0), which the merge
// adds as exact zeros.
// Inlined into each kernel, so that each owns exactly its own shared arrays
// (hiprtc otherwise counted the shared memory of every FP8 instantiation
// against each: 82,688 bytes of a 65,536-byte limit).
template <typename KV, int DPL, int G, int VB, bool VEC_V>
__device__ __forceinline__ void decode_split_impl(
    const float* q, const KV* kc, const KV* vc, const int* seq_info, const u32* page_table,
    float* part_o, float* part_ml, int heads, int kv_heads, int head_dim, int page_size,
    int splits, float scale, int window, float k_scale, float v_scale) {
    __shared__ float sm_q[G][32 * DPL];
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
    const int min_pages = (DECODE_SPLIT_MIN_TOKENS + page_size - 1) / page_size;
    int per = max(min_pages, (pages + DECODE_MAX_SPLITS - 1) / DECODE_MAX_SPLITS);
    per = max(per, (pages + splits - 1) / splits);  // a short grid never drops tokens
    int t0 = p * per * page_size;
    int t1 = min(kv_len, (p + 1) * per * page_size);
    if (window > 0) t0 = max(t0, kv_len - window);
    const int qw = heads * head_dim;
    const bool vec = (head_dim & 7) == 0;
    const int d0 = DPL * lane;
    for (int g0 = 0; g0 < group; g0 += G) {
        const int gn = min(G, group - g0);
        __syncthreads();
        // Zero past head_dim, so the score loop may run whole chunks.
        for (int e = threadIdx.x; e < G * 32 * DPL; e += blockDim.x) {
            const int j = e / (32 * DPL), d = e - j * (32 * DPL);
            sm_q[j][d] = j < gn && d < head_dim
                             ? q[(size_t)q_row * qw + (g * group + g0 + j) * head_dim + d] * scale
                             : 0.0f;
        }
        __syncthreads();
        float acc[G][DPL];
        float m[G], lsum[G];
#pragma unroll
        for (int j = 0; j < G; ++j) {
            m[j] = -INFINITY;
            lsum[j] = 0.0f;
#pragma unroll
            for (int i = 0; i < DPL; ++i) acc[j][i] = 0.0f;
        }
        for (int tt = t0 + 32 * warp; tt < t1; tt += 128) {
            const int t = tt + lane;
            const bool valid = t < t1;
            const u32 slot = valid ? kv_slot(page_table, page_start, t, page_size) : 0u;
            // Scores of this lane's token.
            float sc[G];
#pragma unroll
            for (int j = 0; j < G; ++j) sc[j] = 0.0f;
            if (valid) {
                const KV* krow = kc + ((size_t)slot * kv_heads + g) * head_dim;
                if (vec) {
                    // Four 8-element loads in flight, then their products
                    // (d is a multiple of 32 below 32 * DPL, so d + 31 is
                    // inside sm_q, zero past head_dim).
                    for (int d = 0; d < head_dim; d += 32) {
                        float kf[4][8];
#pragma unroll
                        for (int c = 0; c < 4; ++c) {
                            if (d + 8 * c < head_dim) {
                                load_kv<KV, 8>(krow + d + 8 * c, k_scale, kf[c]);
                            } else {
#pragma unroll
                                for (int e = 0; e < 8; ++e) kf[c][e] = 0.0f;
                            }
                        }
#pragma unroll
                        for (int j = 0; j < G; ++j) {
                            if (j < gn) {
                                float a = sc[j];
#pragma unroll
                                for (int c = 0; c < 4; ++c)
#pragma unroll
                                    for (int e = 0; e < 8; ++e)
                                        a += sm_q[j][d + 8 * c + e] * kf[c][e];
                                sc[j] = a;
                            }
                        }
                    }
                } else {
                    for (int d = 0; d < head_dim; ++d) {
                        const float kf = to_f32(krow[d]) * k_scale;
#pragma unroll
                        for (int j = 0; j < G; ++j) sc[j] += sm_q[j][d] * kf;
                    }
                }
            }
            // The tile's softmax update; pr[j] is this lane's token's weight.
            float pr[G];
#pragma unroll
            for (int j = 0; j < G; ++j) {
                pr[j] = 0.0f;
                if (j < gn) {
                    const float sj = valid ? sc[j] : -INFINITY;
                    const float mn = fmaxf(m[j], warp_max(sj));
                    const float corr = expf(m[j] - mn);
                    pr[j] = valid ? expf(sj - mn) : 0.0f;
                    lsum[j] = lsum[j] * corr + pr[j];
                    m[j] = mn;
#pragma unroll
                    for (int i = 0; i < DPL; ++i) acc[j][i] *= corr;
                }
            }
            // The tile's V rows, VB tokens' loads in flight at a time
            // (tokens past the tile's end have weight 0 and read nothing).
            const int n = min(32, t1 - tt);
            for (int u0 = 0; u0 < n; u0 += VB) {
                float vr[VB][DPL];
#pragma unroll
                for (int uu = 0; uu < VB; ++uu) {
                    const int u = u0 + uu;
                    const u32 su = SHFL(slot, u);
                    const KV* vrow = vc + ((size_t)su * kv_heads + g) * head_dim;
                    if (u < n && d0 < head_dim) {
                        if (vec) {
                            RowLoad<KV, DPL, VEC_V>::load(vrow + d0, v_scale, vr[uu]);
                        } else {
#pragma unroll
                            for (int i = 0; i < DPL; ++i)
                                vr[uu][i] =
                                    d0 + i < head_dim ? to_f32(vrow[d0 + i]) * v_scale : 0.0f;
                        }
                    } else {
#pragma unroll
                        for (int i = 0; i < DPL; ++i) vr[uu][i] = 0.0f;
                    }
                }
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    if (j < gn) {
#pragma unroll
                        for (int uu = 0; uu < VB; ++uu) {
                            const float w = SHFL(pr[j], u0 + uu);
#pragma unroll
                            for (int i = 0; i < DPL; ++i) acc[j][i] += w * vr[uu][i];
                        }
                    }
                }
            }
        }
        // Combine the four warps.
#pragma unroll
        for (int j = 0; j < G; ++j) {
            const float l = warp_sum(lsum[j]);
            if (lane == 0) {
                sm_m[warp][j] = m[j];
                sm_l[warp][j] = l;
            }
#pragma unroll
            for (int i = 0; i < DPL; ++i) sm_acc[warp][j][d0 + i] = acc[j][i];
        }
        __syncthreads();
        for (int e = threadIdx.x; e < gn * head_dim; e += blockDim.x) {
            const int j = e / head_dim, d = e - j * head_dim;
            float mx = -INFINITY;
            for (int w = 0; w < 4; ++w) mx = fmaxf(mx, sm_m[w][j]);
            float lsum_all = 0.0f, o = 0.0f;
            if (mx != -INFINITY) {
                for (int w = 0; w < 4; ++w) {
                    const float f = expf(sm_m[w][j] - mx);
                    lsum_all += sm_l[w][j] * f;
                    o += sm_acc[w][j][d] * f;
                }
            }
            const int h = g * group + g0 + j;
            const size_t at = ((size_t)s * heads + h) * splits + p;
            part_o[at * head_dim + d] = o;
            if (d == 0) {
                part_ml[2 * at] = mx;
                part_ml[2 * at + 1] = lsum_all;
            }
        }
    }
}

#define DECODE_SPLIT(NAME, KV, DPL, G, VB, VEC_V)                                               \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        NAME(const float* q, const KV* kc, const KV* vc, const int* seq_info,                  \
             const u32* page_table, float* part_o, float* part_ml, int heads, int kv_heads,    \
             int head_dim, int page_size, int splits, float scale, int window, float k_scale,  \
             float v_scale) {                                                                  \
        decode_split_impl<KV, DPL, G, VB, VEC_V>(q, kc, vc, seq_info, page_table, part_o,       \
                                                 part_ml, heads, kv_heads, head_dim,          \
                                                 page_size, splits, scale, window, k_scale,    \
                                                 v_scale);                                     \
    }

DECODE_SPLIT(decode_split_f32_d128, float, 4, 8, 8, true)
DECODE_SPLIT(decode_split_f16_d128, f16_t, 4, 8, 8, true)
DECODE_SPLIT(decode_split_bf16_d128, bf16_t, 4, 8, 8, true)
DECODE_SPLIT(decode_split_f32_d256, float, 8, 4, 8, true)
DECODE_SPLIT(decode_split_f16_d256, f16_t, 8, 4, 8, true)
DECODE_SPLIT(decode_split_bf16_d256, bf16_t, 8, 4, 8, true)
DECODE_SPLIT(decode_split_e4m3_d128, e4m3_t, 4, 8, 8, true)
DECODE_SPLIT(decode_split_e5m2_d128, e5m2_t, 4, 8, 8, true)
DECODE_SPLIT(decode_split_e4m3_d256, e4m3_t, 8, 4, 8, true)
DECODE_SPLIT(decode_split_e5m2_d256, e5m2_t, 8, 4, 8, true)
// Latent attention's head (DeepSeek: 64 rotary + 512 latent dims, one KV
// head for every query head): four query heads per pass over the split's
// tokens (46 KiB of static shared memory, under the 48 KiB limit), two V rows
// in flight, V dims read element by element.
DECODE_SPLIT(decode_split_f32_d576, float, 18, 4, 2, false)
DECODE_SPLIT(decode_split_f16_d576, f16_t, 18, 4, 2, false)
DECODE_SPLIT(decode_split_bf16_d576, bf16_t, 18, 4, 2, false)
DECODE_SPLIT(decode_split_e4m3_d576, e4m3_t, 18, 4, 2, false)
DECODE_SPLIT(decode_split_e5m2_d576, e5m2_t, 18, 4, 2, false)

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
    DYNAMIC_SMEM(float, smem);
    const int s = blockIdx.z, h = blockIdx.y;
    const SeqInfo si = seq_at(seq_info, s);
    const int q_start = si.q_start, q_len = si.q_len, kv_len = si.kv_len;
    const int page_start = si.page_start;
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
// 16 x 16 tiles up to latent attention's 576 dims (109 KiB of shared memory:
// NVIDIA's opt-in sizes, not AMD's 64 KiB of LDS).
PREFILL(prefill_f32_d576, float, 1, 1, 36)
PREFILL(prefill_f16_d576, f16_t, 1, 1, 36)
PREFILL(prefill_bf16_d576, bf16_t, 1, 1, 36)
PREFILL(prefill_e4m3_d576, e4m3_t, 1, 1, 36)
PREFILL(prefill_e5m2_d576, e5m2_t, 1, 1, 36)

// ---------------------------------------------------------------------------
// Prefill on tensor cores (NVIDIA sm_80+, bf16 caches, head_dim 64 or 128, no
// draft trees; the launcher picks it, else the kernels above). Grid (query
// tiles of 64, heads, seqs), 128 threads: warp w owns query rows 16 w ..
// 16 w + 15 of the tile, as FlashAttention-2. Per key tile of 64: S = Q Kᵀ and
// O += P V with `mma.m16n8k16` bf16 products accumulated in f32. K and V are
// the cache's bf16 values exactly; Q (f32, times `scale`) and P (f32) are
// each split into a bf16 high part and a bf16 remainder, both multiplied, so
// a product carries about 16 bits of the f32 operand (near the f32 kernels;
// checked against the CPU within the same tolerance). The online softmax is
// per row in f32: a row's 64 scores sit in the 4 lanes of a quad, reduced by
// two shuffles. Masking (causal, sliding window, padding rows) is the f32
// kernels'. Shared memory (bf16 bits): Qh, Ql, K [64][hd + 8], V transposed
// [hd][64 + 8] (padded so fragment loads hit distinct banks), the tile's
// slots [64].
//
// `mma_bf16` and the bf16 split are kernels/mma.cuh's.

template <int HD>
__device__ void prefill_mma_impl(const float* q, const bf16_t* kc, const bf16_t* vc,
                                 const int* seq_info, const u32* page_table, float* out,
                                 int heads, int kv_heads, int page_size, float scale, int window,
                                 float k_scale, float v_scale) {
    constexpr int BQ = 64, BK = 64;
    constexpr int QS = HD + 8;
    constexpr int VS = BK + 8;
    DYNAMIC_SMEM(float, smem);
    unsigned short* Qh = reinterpret_cast<unsigned short*>(smem);
    unsigned short* Ql = Qh + BQ * QS;
    unsigned short* Ks = Ql + BQ * QS;
    unsigned short* Vt = Ks + BK * QS;
    u32* slots = reinterpret_cast<u32*>(Vt + HD * VS);
    const int s = blockIdx.z, h = blockIdx.y;
    const SeqInfo si = seq_at(seq_info, s);
    const int q_start = si.q_start, q_len = si.q_len, kv_len = si.kv_len;
    const int page_start = si.page_start;
    const int qi0 = blockIdx.x * BQ;
    if (qi0 >= q_len) return;
    const int prefix = kv_len - q_len;
    const int gkv = h / (heads / kv_heads);
    const int qw = heads * HD;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int gr = lane >> 2, tq = lane & 3;
    const int n_rows = min(BQ, q_len - qi0);
    const int pos_first = prefix + qi0;
    const int pos_last = prefix + qi0 + n_rows - 1;
    const int lo = window > 0 ? max(0, pos_first - window + 1) : 0;

    for (int e = tid; e < BQ * HD; e += 128) {
        const int r = e / HD, d = e - r * HD;
        const float x = r < n_rows ? q[(size_t)(q_start + qi0 + r) * qw + h * HD + d] * scale : 0.0f;
        u32 l;
        Qh[r * QS + d] = (unsigned short)bf16_split(x, &l);
        Ql[r * QS + d] = (unsigned short)l;
    }

    const int r0 = warp * 16 + gr, r1 = r0 + 8;
    const int qpos0 = pos_first + r0, qpos1 = pos_first + r1;
    const int qlo0 = window > 0 ? qpos0 - window + 1 : 0;
    const int qlo1 = window > 0 ? qpos1 - window + 1 : 0;
    const bool live0 = r0 < n_rows, live1 = r1 < n_rows;
    float o[HD / 8][4];
#pragma unroll
    for (int dn = 0; dn < HD / 8; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.0f, l1 = 0.0f;

    for (int k0 = lo; k0 <= pos_last; k0 += BK) {
        __syncthreads();
        if (tid < BK) {
            const int kp = k0 + tid;
            slots[tid] = kp <= pos_last ? kv_slot(page_table, page_start, kp, page_size) : 0xffffffffu;
        }
        __syncthreads();
        // K rows and V columns of the tile, 8 dims (16 bytes) per item; a
        // warp's lanes take consecutive keys.
        for (int e = tid; e < BK * (HD / 8); e += 128) {
            const int key = e % BK, c = e / BK;
            const u32 sl = slots[key];
            Words<4> kr, vr;
            if (sl != 0xffffffffu) {
                const size_t at = ((size_t)sl * kv_heads + gkv) * HD + 8 * c;
                kr = *reinterpret_cast<const Words<4>*>(kc + at);
                vr = *reinterpret_cast<const Words<4>*>(vc + at);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) kr.w[i] = vr.w[i] = 0u;
            }
            *reinterpret_cast<Words<4>*>(Ks + key * QS + 8 * c) = kr;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                Vt[(8 * c + i) * VS + key] = (unsigned short)(vr.w[i >> 1] >> (16 * (i & 1)));
        }
        __syncthreads();

        // S = Q Kᵀ for this warp's 16 rows and the tile's 64 keys.
        float sc[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int kd = 0; kd < HD / 16; ++kd) {
            const int col = kd * 16 + 2 * tq;
            u32 ah[4], al[4];
            ah[0] = ld_pair(Qh + r0 * QS + col);
            ah[1] = ld_pair(Qh + r1 * QS + col);
            ah[2] = ld_pair(Qh + r0 * QS + col + 8);
            ah[3] = ld_pair(Qh + r1 * QS + col + 8);
            al[0] = ld_pair(Ql + r0 * QS + col);
            al[1] = ld_pair(Ql + r1 * QS + col);
            al[2] = ld_pair(Ql + r0 * QS + col + 8);
            al[3] = ld_pair(Ql + r1 * QS + col + 8);
#pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                const unsigned short* kr = Ks + (n * 8 + gr) * QS + col;
                const u32 b0 = ld_pair(kr), b1 = ld_pair(kr + 8);
                mma_bf16(sc[n], ah, b0, b1);
                mma_bf16(sc[n], al, b0, b1);
            }
        }

        // Mask, then the online softmax of rows r0 (elements 0, 1) and r1 (2, 3).
        float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int kp = k0 + n * 8 + 2 * tq + e;
                const bool ok0 = live0 && kp <= qpos0 && kp >= qlo0;
                const bool ok1 = live1 && kp <= qpos1 && kp >= qlo1;
                sc[n][e] = ok0 ? sc[n][e] * k_scale : -INFINITY;
                sc[n][2 + e] = ok1 ? sc[n][2 + e] * k_scale : -INFINITY;
                mx0 = fmaxf(mx0, sc[n][e]);
                mx1 = fmaxf(mx1, sc[n][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, SHFL_XOR(mx0, 1));
        mx0 = fmaxf(mx0, SHFL_XOR(mx0, 2));
        mx1 = fmaxf(mx1, SHFL_XOR(mx1, 1));
        mx1 = fmaxf(mx1, SHFL_XOR(mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        // A row that has seen no visible key yet keeps zero weights.
        const float c0 = mn0 == -INFINITY ? 1.0f : expf(m0 - mn0);
        const float c1 = mn1 == -INFINITY ? 1.0f : expf(m1 - mn1);
        float ps0 = 0.0f, ps1 = 0.0f;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float p0 = mn0 == -INFINITY ? 0.0f : expf(sc[n][e] - mn0);
                const float p1 = mn1 == -INFINITY ? 0.0f : expf(sc[n][2 + e] - mn1);
                sc[n][e] = p0;
                sc[n][2 + e] = p1;
                ps0 += p0;
                ps1 += p1;
            }
        }
        l0 = l0 * c0 + ps0;
        l1 = l1 * c1 + ps1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            o[dn][0] *= c0;
            o[dn][1] *= c0;
            o[dn][2] *= c1;
            o[dn][3] *= c1;
        }

        // O += P V: the accumulator of key chunks 2kk and 2kk + 1 is the A
        // fragment of keys 16kk .. 16kk + 15.
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            u32 ph[4], pl[4];
            bf16_split_pack(sc[2 * kk][0], sc[2 * kk][1], &ph[0], &pl[0]);
            bf16_split_pack(sc[2 * kk][2], sc[2 * kk][3], &ph[1], &pl[1]);
            bf16_split_pack(sc[2 * kk + 1][0], sc[2 * kk + 1][1], &ph[2], &pl[2]);
            bf16_split_pack(sc[2 * kk + 1][2], sc[2 * kk + 1][3], &ph[3], &pl[3]);
#pragma unroll
            for (int dn = 0; dn < HD / 8; ++dn) {
                const unsigned short* vr = Vt + (dn * 8 + gr) * VS + kk * 16 + 2 * tq;
                const u32 b0 = ld_pair(vr), b1 = ld_pair(vr + 8);
                mma_bf16(o[dn], ph, b0, b1);
                mma_bf16(o[dn], pl, b0, b1);
            }
        }
    }

    l0 += SHFL_XOR(l0, 1);
    l0 += SHFL_XOR(l0, 2);
    l1 += SHFL_XOR(l1, 1);
    l1 += SHFL_XOR(l1, 2);
    const float inv0 = l0 > 0.0f ? v_scale / l0 : 0.0f;
    const float inv1 = l1 > 0.0f ? v_scale / l1 : 0.0f;
    if (live0) {
        float* orow = out + (size_t)(q_start + qi0 + r0) * qw + h * HD;
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            orow[dn * 8 + 2 * tq] = o[dn][0] * inv0;
            orow[dn * 8 + 2 * tq + 1] = o[dn][1] * inv0;
        }
    }
    if (live1) {
        float* orow = out + (size_t)(q_start + qi0 + r1) * qw + h * HD;
#pragma unroll
        for (int dn = 0; dn < HD / 8; ++dn) {
            orow[dn * 8 + 2 * tq] = o[dn][2] * inv1;
            orow[dn * 8 + 2 * tq + 1] = o[dn][3] * inv1;
        }
    }
}

// Same parameters as the f32 prefill kernels (head_dim is the template's;
// the tree pointer must be null).
#define PREFILL_MMA(NAME, HD)                                                                  \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        NAME(const float* q, const bf16_t* kc, const bf16_t* vc, const int* seq_info,          \
             const u32* page_table, const u32* tree, float* out, int heads, int kv_heads,      \
             int head_dim, int page_size, float scale, int window, float k_scale,              \
             float v_scale) {                                                                  \
        prefill_mma_impl<HD>(q, kc, vc, seq_info, page_table, out, heads, kv_heads, page_size, \
                             scale, window, k_scale, v_scale);                                 \
    }

PREFILL_MMA(prefill_mma_bf16_d64, 64)
PREFILL_MMA(prefill_mma_bf16_d128, 128)
