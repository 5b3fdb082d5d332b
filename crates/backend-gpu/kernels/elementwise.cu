// Row-wise and elementwise kernels: embedding lookup, RMSNorm (plain and fused
// with the residual add), rotary embedding, SiLU-and-mul, residual add, row
// gathering, casts for GEMM inputs, bias add, KV writes into pages and the
// synthetic-weight fill. Every index past its tensor reads as zero or is
// skipped, so padded rows of a CUDA-graph bucket are harmless.

// out[r, :] = table[ids[r], :] (zeros for an id outside the table).
template <typename T>
__device__ void embedding_impl(const T* table, const u32* ids, float* out, int rows, int dim,
                               int vocab) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const u32 id = ids[r];
    float* o = out + (size_t)r * dim;
    if (id >= (u32)vocab) {
        for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const T* src = table + (size_t)id * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = to_f32(src[i]);
}

extern "C" __global__ void embedding_f32(const float* table, const u32* ids, float* out, int rows,
                                         int dim, int vocab) {
    embedding_impl<float>(table, ids, out, rows, dim, vocab);
}
extern "C" __global__ void embedding_f16(const f16_t* table, const u32* ids, float* out, int rows,
                                         int dim, int vocab) {
    embedding_impl<f16_t>(table, ids, out, rows, dim, vocab);
}
extern "C" __global__ void embedding_bf16(const bf16_t* table, const u32* ids, float* out,
                                          int rows, int dim, int vocab) {
    embedding_impl<bf16_t>(table, ids, out, rows, dim, vocab);
}

// out = x / rms(x) * w, one block per row; `out` may be `x`.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int rows, int dim,
                                    float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const float* xr = x + (size_t)r * dim;
    float* o = out + (size_t)r * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = xr[i];
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float s = 1.0f / sqrtf(ss / (float)dim + eps);
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * s * w[i];
}

// residual += x; out = rms_norm(residual) * w, one block per row.
extern "C" __global__ void add_rms_norm(float* residual, const float* x, const float* w,
                                        float* out, int rows, int dim, float eps) {
    __shared__ float scratch[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    float* res = residual + (size_t)r * dim;
    const float* xr = x + (size_t)r * dim;
    float* o = out + (size_t)r * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        float v = res[i] + xr[i];
        res[i] = v;
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float s = 1.0f / sqrtf(ss / (float)dim + eps);
    // Each thread reads back only the elements it wrote above.
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = res[i] * s * w[i];
}

// Rotary embedding in place on x [tokens, heads * head_dim]; `half` frequencies.
// style 0: Neox (halves), 1: interleaved (adjacent pairs).
extern "C" __global__ void rope(float* x, const u32* positions, const float* inv_freq, int tokens,
                                int heads, int head_dim, int half, int style) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const float pos = (float)positions[t];
    float* row = x + (size_t)t * heads * head_dim;
    const int work = heads * half;
    for (int j = threadIdx.x; j < work; j += blockDim.x) {
        const int h = j / half;
        const int i = j - h * half;
        float s, c;
        sincosf(pos * inv_freq[i], &s, &c);
        float* v = row + h * head_dim;
        const int ia = style == 0 ? i : 2 * i;
        const int ib = style == 0 ? i + half : 2 * i + 1;
        const float a = v[ia];
        const float b = v[ib];
        v[ia] = a * c - b * s;
        v[ib] = b * c + a * s;
    }
}

// out = silu(gate) * up over n elements.
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// dst += src over n elements.
extern "C" __global__ void add_assign(float* dst, const float* src, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        dst[i] += src[i];
    }
}

// out[i, :] = x[rows[i], :] (zeros for a row past x).
extern "C" __global__ void gather_rows(const float* x, const u32* idx, float* out, int n, int dim,
                                       int xrows) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const u32 r = idx[i];
    float* o = out + (size_t)i * dim;
    if (r >= (u32)xrows) {
        for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = 0.0f;
        return;
    }
    const float* src = x + (size_t)r * dim;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) o[j] = src[j];
}

// dst[r, offset + j] = src[r, j] for r < rows, j < w: a block of columns of
// dst (rows dst_w wide) written from src [rows, w].
extern "C" __global__ void copy_cols(const float* src, float* dst, int rows, int w, int dst_w,
                                     int offset) {
    const u64 n = (u64)rows * w;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / w;
        dst[r * dst_w + offset + (i - r * w)] = src[i];
    }
}

// GEMM inputs: f32 activations rounded to the weight's 16-bit type.
extern "C" __global__ void cast_f32_bf16(const float* x, bf16_t* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        out[i] = from_f32<bf16_t>(x[i]);
    }
}
extern "C" __global__ void cast_f32_f16(const float* x, f16_t* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        out[i] = from_f32<f16_t>(x[i]);
    }
}

// out[r, :] += bias over rows of n.
extern "C" __global__ void add_bias(float* out, const float* bias, int rows, int n) {
    const u64 total = (u64)rows * n;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        out[i] += bias[i % (u64)n];
    }
}

// Writes new K and V rows ([tokens, width] f32) into their KV slots
// ([slots, width] of the cache type). A slot of 0xffffffff (padding) or past
// the cache is skipped.
// New K and V rows into their cache slots, divided by the layer's scales
// (k_scale and v_scale: 1 unless the cache is FP8 with checkpoint scales).
template <typename T>
__device__ void kv_write_impl(const float* k, const float* v, T* kc, T* vc, const u32* slots,
                              int tokens, int width, u32 num_slots, float k_scale,
                              float v_scale) {
    const int t = blockIdx.x;
    if (t >= tokens) return;
    const u32 s = slots[t];
    if (s >= num_slots) return;
    const float* kr = k + (size_t)t * width;
    const float* vr = v + (size_t)t * width;
    T* kd = kc + (size_t)s * width;
    T* vd = vc + (size_t)s * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        kd[i] = from_f32<T>(kr[i] / k_scale);
        vd[i] = from_f32<T>(vr[i] / v_scale);
    }
}

#define KV_WRITE(NAME, T)                                                                      \
    extern "C" __global__ void NAME(const float* k, const float* v, T* kc, T* vc,              \
                                    const u32* slots, int tokens, int width, u32 num_slots,    \
                                    float k_scale, float v_scale) {                            \
        kv_write_impl<T>(k, v, kc, vc, slots, tokens, width, num_slots, k_scale, v_scale);     \
    }

KV_WRITE(kv_write_f32, float)
KV_WRITE(kv_write_f16, f16_t)
KV_WRITE(kv_write_bf16, bf16_t)
KV_WRITE(kv_write_e4m3, e4m3_t)
KV_WRITE(kv_write_e5m2, e5m2_t)

// Synthetic weights for benchmarks: out[i] = offset + scale * u, u uniform in
// [-1, 1) from a hash of (seed, i).
template <typename T>
__device__ void fill_uniform_impl(T* out, u64 n, u64 seed, float scale, float offset) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        u64 st = seed ^ (i * 0xD1B54A32D192ED03ull);
        const u64 r = splitmix64(&st);
        const float u = (float)(r >> 40) * (1.0f / 16777216.0f) * 2.0f - 1.0f;
        out[i] = from_f32<T>(offset + scale * u);
    }
}

extern "C" __global__ void fill_uniform_f32(float* out, u64 n, u64 seed, float scale,
                                            float offset) {
    fill_uniform_impl<float>(out, n, seed, scale, offset);
}
extern "C" __global__ void fill_uniform_f16(f16_t* out, u64 n, u64 seed, float scale,
                                            float offset) {
    fill_uniform_impl<f16_t>(out, n, seed, scale, offset);
}
extern "C" __global__ void fill_uniform_bf16(bf16_t* out, u64 n, u64 seed, float scale,
                                             float offset) {
    fill_uniform_impl<bf16_t>(out, n, seed, scale, offset);
}
