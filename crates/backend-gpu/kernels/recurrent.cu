// Gated DeltaNet layers' recurrence (engine-core's backend/recurrent.rs holds the reference,
// `gated_delta_group`, and the shapes) and gated attention's sigmoid output gate.
//
// gated_delta_net: one block per (sequence, query/key head group). Per token, in order: each
// thread convolves its channels of the group (the causal depthwise convolution with SiLU over the
// slot's `kernel - 1` past inputs, which it then shifts), thread 0 sums the squares of the query
// and key heads (fixed order), and each thread `h * v_dim + j` updates column `j` of value head
// `h`'s state `S [k_dim, v_dim]` (decay, kv_mem = S^T k, delta = (v - kv_mem) * beta,
// S += k (x) delta, o = S^T q), held in its own registers/local memory between tokens. Every
// token runs the same operations in the same order whatever the batch, so the state after a
// token does not depend on how the tokens were chunked or batched. A `fresh` sequence starts
// from zero state. Snapshots copy the state after the sequence's first `n` tokens (its conv
// channels and state columns) into another slot, each by the thread that owns the part.
//
// Tables: `seqs` holds 6 u32 per sequence (first row, rows, slot, fresh, first snapshot,
// snapshots); `snaps` holds (n, slot) pairs. Dynamic shared memory: 2 * k_dim + group * v_dim + 2
// floats (the token's convolved queries, keys and values, then the two inverse norms).

#define GDN_MAX_K_DIM 256

__device__ __forceinline__ float gdn_softplus(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// Group `kh`'s channel `c` (its queries, keys, then values) as a channel of the projection.
__device__ __forceinline__ int gdn_channel(int c, int kh, int dk, int dv, int g, int k_heads) {
    if (c < dk) return kh * dk + c;
    if (c < 2 * dk) return k_heads * dk + kh * dk + (c - dk);
    return 2 * k_heads * dk + kh * g * dv + (c - 2 * dk);
}

extern "C" __global__ void gated_delta_net(const float* mixed, const float* a, const float* b,
                                           const float* conv_w, const float* a_log,
                                           const float* dt_bias, float* conv_state,
                                           float* rec_state, float* out, const u32* seqs,
                                           const u32* snaps, int channels, int kernel,
                                           int k_heads, int v_heads, int dk, int dv) {
    DYNAMIC_SMEM(float, x);
    const u32* sq = seqs + 6 * blockIdx.x;
    const int row0 = (int)sq[0];
    const int n = (int)sq[1];
    const size_t slot = sq[2];
    const bool fresh = sq[3] != 0;
    const int snap0 = (int)sq[4];
    const int nsnap = (int)sq[5];
    const int kh = blockIdx.y;
    const int g = v_heads / k_heads;
    const int past = kernel - 1;
    const int group_channels = 2 * dk + g * dv;
    const size_t conv_len = (size_t)channels * past;
    const size_t rec_len = (size_t)v_heads * dk * dv;
    float* cs = conv_state + slot * conv_len;
    float* norms = x + group_channels;
    const int tid = threadIdx.x;
    const bool owns_column = tid < g * dv;
    const int h = owns_column ? tid / dv : 0;
    const int j = owns_column ? tid - h * dv : 0;
    const int vh = kh * g + h;
    const size_t col0 = (size_t)vh * dk * dv + j;
    float col[GDN_MAX_K_DIM];
    if (owns_column) {
        const float* s = rec_state + slot * rec_len + col0;
        for (int r = 0; r < dk; ++r) col[r] = fresh ? 0.0f : s[(size_t)r * dv];
    }
    if (fresh) {
        for (int c = tid; c < group_channels; c += blockDim.x) {
            float* st = cs + (size_t)gdn_channel(c, kh, dk, dv, g, k_heads) * past;
            for (int p = 0; p < past; ++p) st[p] = 0.0f;
        }
    }
    const float scale = 1.0f / sqrtf((float)dk);
    for (int i = 0; i < n; ++i) {
        const size_t row = (size_t)row0 + i;
        for (int c = tid; c < group_channels; c += blockDim.x) {
            const int ch = gdn_channel(c, kh, dk, dv, g, k_heads);
            float* st = cs + (size_t)ch * past;
            const float* w = conv_w + (size_t)ch * kernel;
            const float cur = mixed[row * channels + ch];
            float acc = 0.0f;
            for (int p = 0; p < past; ++p) acc += w[p] * st[p];
            acc += w[past] * cur;
            x[c] = acc / (1.0f + expf(-acc));
            for (int p = 0; p + 1 < past; ++p) st[p] = st[p + 1];
            st[past - 1] = cur;
            for (int s = 0; s < nsnap; ++s) {
                const u32* sn = snaps + 2 * (snap0 + s);
                if ((int)sn[0] != i + 1) continue;
                float* d = conv_state + (size_t)sn[1] * conv_len + (size_t)ch * past;
                for (int p = 0; p < past; ++p) d[p] = st[p];
            }
        }
        __syncthreads();
        if (tid == 0) {
            float sq_q = 0.0f, sq_k = 0.0f;
            for (int r = 0; r < dk; ++r) sq_q += x[r] * x[r];
            for (int r = 0; r < dk; ++r) sq_k += x[dk + r] * x[dk + r];
            norms[0] = 1.0f / sqrtf(sq_q + 1e-6f) * scale;
            norms[1] = 1.0f / sqrtf(sq_k + 1e-6f);
        }
        __syncthreads();
        if (owns_column) {
            const float qn = norms[0], kn = norms[1];
            const float a_neg = -expf(a_log[vh]);
            const float decay = expf(a_neg * gdn_softplus(a[row * v_heads + vh] + dt_bias[vh]));
            const float bx = b[row * v_heads + vh];
            const float beta = 1.0f / (1.0f + expf(-bx));
            float mem = 0.0f;
            for (int r = 0; r < dk; ++r) {
                const float sv = col[r] * decay;
                col[r] = sv;
                mem += sv * (x[dk + r] * kn);
            }
            const float d = (x[2 * dk + h * dv + j] - mem) * beta;
            float o = 0.0f;
            for (int r = 0; r < dk; ++r) {
                const float sv = col[r] + (x[dk + r] * kn) * d;
                col[r] = sv;
                o += sv * (x[r] * qn);
            }
            out[row * ((size_t)v_heads * dv) + (size_t)vh * dv + j] = o;
            for (int s = 0; s < nsnap; ++s) {
                const u32* sn = snaps + 2 * (snap0 + s);
                if ((int)sn[0] != i + 1) continue;
                float* dst = rec_state + (size_t)sn[1] * rec_len + col0;
                for (int r = 0; r < dk; ++r) dst[(size_t)r * dv] = col[r];
            }
        }
        __syncthreads();
    }
    if (owns_column) {
        float* s = rec_state + slot * rec_len + col0;
        for (int r = 0; r < dk; ++r) s[(size_t)r * dv] = col[r];
    }
}

// out = x * sigmoid(gate) over n elements.
extern "C" __global__ void sigmoid_mul(const float* gate, const float* x, float* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        out[i] = x[i] / (1.0f + expf(-gate[i]));
    }
}
