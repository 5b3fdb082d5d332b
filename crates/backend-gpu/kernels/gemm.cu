// Linear layers with the scaled-block weights of HF quantized checkpoints
// (f8_s32, u4_s32, u8_s32, f4_s16) on tensor cores, reading the packed
// blocks directly: out[m][n] = sum over the weight row's blocks b of
// scale[n][b] * (sum over the block's inputs k of x[m][k] * code[n][k]).
//
// A code is what a block's scale multiplies: the E4M3 value, q - zero, or the
// E2M1 value, each exact in bf16 (an 8-bit zero point up to 256, as every
// GPTQ checkpoint's). x (f32) is split into a bf16 high part and a bf16
// remainder (mma.cuh), both multiplied, so a product carries about 16 bits
// of the f32 input: `mma.m16n8k16` sums a block's products in f32 (per
// 16 inputs one for the high parts and one for the remainders: four per
// 32-input block, two per 16-input f4_s16 block), and the block's sum times
// its scale (one fmaf) joins the output's f32 accumulator, blocks in order.
// An output depends only on its input row and weight row, in the same order
// for every tile shape, so rows do not change with the batch (checked on the
// host emulator and on the device).
//
// Tiles: 128 threads, four warps as WM x (4 / WM); a warp owns 16 rows and
// NT x 8 columns. Per chunk of 64 inputs the block converts its rows of x
// (BM x 64) and its weight rows' codes (BN x 64, with their scales) into
// shared memory, then each warp runs its products. Rows past m, columns past
// n and inputs past k are zeros. `gemm_<dtype>_m16` (16 x 32 tiles) serves
// decode-sized batches, `_m64` (64 x 64) larger ones.

#define GEMM_KC 64
#define GEMM_PAD 8

// Weight layout of dtype DT: elements per block, bytes per block.
template <int DT> struct ScaledBlock;
template <> struct ScaledBlock<0> { enum { ELEMS = 32, BYTES = 36 }; };  // f8_s32
template <> struct ScaledBlock<1> { enum { ELEMS = 32, BYTES = 20 }; };  // u4_s32
template <> struct ScaledBlock<2> { enum { ELEMS = 32, BYTES = 36 }; };  // u8_s32
template <> struct ScaledBlock<3> { enum { ELEMS = 16, BYTES = 12 }; };  // f4_s16

__device__ __forceinline__ float f16_at(const unsigned char* p) {
    f16_t s;
    s.x = (unsigned short)((u32)p[0] | ((u32)p[1] << 8));
    return to_f32(s);
}

// Element j's code of block `b` (exact in bf16, so its top 16 bits).
template <int DT> __device__ __forceinline__ float block_code(const unsigned char* b, u32 j) {
    if (DT == 0) return e4m3_value(b[j]);
    if (DT == 1) {
        const u32 byte = b[j & 15u];
        return (float)((int)(j < 16u ? (byte & 15u) : (byte >> 4)) - (int)b[18]);
    }
    if (DT == 2) return (float)((int)b[j] - (int)((u32)b[34] | ((u32)b[35] << 8)));
    const u32 byte = b[j & 7u];
    return e2m1_value(j < 8u ? (byte & 15u) : (byte >> 4));
}

template <int DT> __device__ __forceinline__ float block_scale(const unsigned char* b) {
    if (DT == 0) return f32_at(b + 32);
    if (DT == 1) return f16_at(b + 16);
    if (DT == 2) return f16_at(b + 32);
    return f32_at(b + 8);
}

// Writes a warp's accumulators, the m16n8 tiles j of rows row0.. and
// columns col0 + 8 j.., where they fall inside the m x n output.
template <int NT>
__device__ __forceinline__ void store_tile(const float (&acc)[NT][4], float* out, int m, int n,
                                           int row0, int col0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int j = 0; j < NT; ++j)
        for (int r = 0; r < 4; ++r) {
            const int row = row0 + g + 8 * (r >> 1);
            const int c = col0 + 8 * j + 2 * t + (r & 1);
            if (row < m && c < n) out[(u64)row * n + c] = acc[j][r];
        }
}

template <int DT, int WM, int NT>
__device__ void gemm_scaled_impl(const float* x, const unsigned char* w, float* out, int m, int n,
                                 int k) {
    enum {
        BM = 16 * WM,
        WN = 4 / WM,
        BN = 8 * NT * WN,
        BS = ScaledBlock<DT>::ELEMS,
        BB = ScaledBlock<DT>::BYTES,
        SC = GEMM_KC / BS,
        RS = GEMM_KC + GEMM_PAD,
    };
    __shared__ unsigned short xh[BM * RS], xl[BM * RS], wc[BN * RS];
    __shared__ float ws[BN * SC];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int blocks = k / BS;
    float acc[NT][4], part[NT][4];
    for (int j = 0; j < NT; ++j)
        for (int r = 0; r < 4; ++r) acc[j][r] = part[j][r] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += GEMM_KC) {
        for (int e = tid; e < BM * GEMM_KC; e += 128) {
            const int r = e / GEMM_KC, c = e % GEMM_KC;
            const float v =
                (m0 + r < m && k0 + c < k) ? x[(u64)(m0 + r) * k + k0 + c] : 0.0f;
            u32 lo;
            xh[r * RS + c] = (unsigned short)bf16_split(v, &lo);
            xl[r * RS + c] = (unsigned short)lo;
        }
        for (int e = tid; e < BN * GEMM_KC; e += 128) {
            const int r = e / GEMM_KC, c = e % GEMM_KC;
            float code = 0.0f;
            if (n0 + r < n && k0 + c < k) {
                const int kk = k0 + c;
                code = block_code<DT>(w + ((u64)(n0 + r) * blocks + kk / BS) * BB, kk % BS);
            }
            wc[r * RS + c] = (unsigned short)(__float_as_uint(code) >> 16);
        }
        for (int e = tid; e < BN * SC; e += 128) {
            const int r = e / SC, b = e % SC, kb = k0 / BS + b;
            ws[e] = (n0 + r < n && kb < blocks)
                        ? block_scale<DT>(w + ((u64)(n0 + r) * blocks + kb) * BB)
                        : 0.0f;
        }
        __syncthreads();
        for (int ks = 0; ks < GEMM_KC / 16; ++ks) {
            const int col = ks * 16 + 2 * t;
            const int r0 = (wm * 16 + g) * RS, r1 = r0 + 8 * RS;
            const u32 ah[4] = {ld_pair(xh + r0 + col), ld_pair(xh + r1 + col),
                               ld_pair(xh + r0 + col + 8), ld_pair(xh + r1 + col + 8)};
            const u32 al[4] = {ld_pair(xl + r0 + col), ld_pair(xl + r1 + col),
                               ld_pair(xl + r0 + col + 8), ld_pair(xl + r1 + col + 8)};
            for (int j = 0; j < NT; ++j) {
                const unsigned short* wr = wc + (wn * 8 * NT + 8 * j + g) * RS + col;
                const u32 b0 = ld_pair(wr), b1 = ld_pair(wr + 8);
                mma_bf16(part[j], ah, b0, b1);
                mma_bf16(part[j], al, b0, b1);
            }
            if (((ks + 1) * 16) % BS == 0) {
                const int b = (ks * 16) / BS;
                for (int j = 0; j < NT; ++j)
                    for (int r = 0; r < 4; ++r) {
                        const int c = wn * 8 * NT + 8 * j + 2 * t + (r & 1);
                        acc[j][r] = fmaf(part[j][r], ws[c * SC + b], acc[j][r]);
                        part[j][r] = 0.0f;
                    }
            }
        }
        __syncthreads();
    }
    store_tile<NT>(acc, out, m, n, m0 + wm * 16, n0 + wn * 8 * NT);
}

#define GEMM_SCALED(name, DT, WM, NT)                                                          \
    extern "C" __global__ void name(const float* x, const unsigned char* w, float* out, int m, \
                                    int n, int k) {                                            \
        gemm_scaled_impl<DT, WM, NT>(x, w, out, m, n, k);                                      \
    }
GEMM_SCALED(gemm_f8_s32_m16, 0, 1, 1)
GEMM_SCALED(gemm_f8_s32_m64, 0, 4, 8)
GEMM_SCALED(gemm_u4_s32_m16, 1, 1, 1)
GEMM_SCALED(gemm_u4_s32_m64, 1, 4, 8)
GEMM_SCALED(gemm_u8_s32_m16, 2, 1, 1)
GEMM_SCALED(gemm_u8_s32_m64, 2, 4, 8)
GEMM_SCALED(gemm_f4_s16_m16, 3, 1, 1)
GEMM_SCALED(gemm_f4_s16_m64, 3, 4, 8)

// ---------------------------------------------------------------------------
// W8A8 FP8 (NVIDIA sm_89+, f8a8_s32 weights: f8_s32's blocks under the
// w8a8_fp8 method): the input is quantized to E4M3 per row
// and 32-input block (scale = the block's max |x| / 448, codes of x * 448 /
// max rounded to nearest even, saturating: fp8.cuh's encoder; or the
// layer's static input scale for every block), then each
// 32-input block of the product is one `mma.m16n8k32` of E4M3 codes, its sum
// times the input block's scale times the weight block's scale joining the
// f32 accumulator (one fmaf), blocks in order. Both operands' codes go to
// the tensor cores unconverted, one instruction per 32 inputs where the bf16
// split takes four; the price is the input's 3-bit mantissa. A row's outputs
// depend only on its own input row, so they do not change with the batch.

// One warp per (row, 32-input block) of x [m][k]: hands `put` each lane's
// E4M3 code of x * (448 / amax) and the block's scale amax / 448, or, with a
// static input scale (`scale` > 0, `inv` its host-computed 1 / scale), the
// code of x * inv (saturating at 448) and `scale` for every block.
template <typename Put>
__device__ __forceinline__ void e4m3_blocks(const float* x, int m, int k, float inv,
                                            float scale, Put put) {
    const int lane = threadIdx.x & 31;
    const u64 blocks = (u64)m * (u64)(k / 32);
    for (u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < blocks;
         b += ((u64)gridDim.x * blockDim.x) >> 5) {
        const float v = x[b * 32 + lane];
        if (scale > 0.0f) {
            put(b * 32 + lane, lane, from_f32<e4m3_t>(v * inv), scale);
        } else {
            const float amax = warp_max(fabsf(v));
            const float run_inv = amax > 0.0f ? 448.0f / amax : 0.0f;
            put(b * 32 + lane, lane, from_f32<e4m3_t>(v * run_inv), amax / 448.0f);
        }
    }
}

// Codes `q` [m][k] and scales `s` [m][k / 32].
extern "C" __global__ void quant_act_e4m3(const float* x, unsigned char* q, float* s, int m,
                                          int k, float inv, float scale) {
    e4m3_blocks(x, m, k, inv, scale, [=](u64 i, int lane, e4m3_t code, float sc) {
        q[i] = code.x;
        if (lane == 0) s[i / 32] = sc;
    });
}

// The values quant_act_e4m3's codes and scales stand for, code times scale
// in f32 (arbor-quant's scaled::round_input_e4m3): the inputs of W8A8 FP8
// weights where no FP8 tensor core multiplies the codes themselves.
extern "C" __global__ void round_act_e4m3(const float* x, float* y, int m, int k, float inv,
                                          float scale) {
    e4m3_blocks(x, m, k, inv, scale,
                [=](u64 i, int, e4m3_t code, float sc) { y[i] = to_f32(code) * sc; });
}

template <int WM, int NT>
__device__ void gemm_w8a8_impl(const unsigned char* xq, const float* xs, const unsigned char* w,
                               float* out, int m, int n, int k) {
    enum { BM = 16 * WM, WN = 4 / WM, BN = 8 * NT * WN, RS = GEMM_KC + 16, SC = GEMM_KC / 32 };
    __shared__ unsigned char aq[BM * RS], wq[BN * RS];
    __shared__ float xsc[BM * SC], wsc[BN * SC];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int wm = warp / WN, wn = warp % WN;
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    const int blocks = k / 32;
    float acc[NT][4];
    for (int j = 0; j < NT; ++j)
        for (int r = 0; r < 4; ++r) acc[j][r] = 0.0f;

    for (int k0 = 0; k0 < k; k0 += GEMM_KC) {
        for (int e = tid; e < BM * GEMM_KC; e += 128) {
            const int r = e / GEMM_KC, c = e % GEMM_KC;
            const bool in = m0 + r < m && k0 + c < k;
            aq[r * RS + c] = in ? xq[(u64)(m0 + r) * k + k0 + c] : (unsigned char)0;
        }
        for (int e = tid; e < BN * GEMM_KC; e += 128) {
            const int r = e / GEMM_KC, c = e % GEMM_KC, kk = k0 + c;
            const bool in = n0 + r < n && kk < k;
            wq[r * RS + c] = in ? w[((u64)(n0 + r) * blocks + kk / 32) * 36 + kk % 32]
                                : (unsigned char)0;
        }
        for (int e = tid; e < (BM + BN) * SC; e += 128) {
            const int b = e % SC, kb = k0 / 32 + b;
            if (e < BM * SC) {
                const int r = e / SC;
                xsc[e] = (m0 + r < m && kb < blocks) ? xs[(u64)(m0 + r) * blocks + kb] : 0.0f;
            } else {
                const int r = (e - BM * SC) / SC;
                wsc[e - BM * SC] =
                    (n0 + r < n && kb < blocks) ? f32_at(w + ((u64)(n0 + r) * blocks + kb) * 36 + 32)
                                                : 0.0f;
            }
        }
        __syncthreads();
        for (int b = 0; b < SC; ++b) {
            const int col = b * 32 + 4 * t;
            const int ra = wm * 16 + g;
            const u32 a[4] = {ld_quad(aq + ra * RS + col), ld_quad(aq + (ra + 8) * RS + col),
                              ld_quad(aq + ra * RS + col + 16),
                              ld_quad(aq + (ra + 8) * RS + col + 16)};
            const float sa0 = xsc[ra * SC + b], sa1 = xsc[(ra + 8) * SC + b];
            for (int j = 0; j < NT; ++j) {
                const int cn = wn * 8 * NT + 8 * j;
                const unsigned char* wr = wq + (cn + g) * RS + col;
                float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_e4m3(part, a, ld_quad(wr), ld_quad(wr + 16));
                for (int r = 0; r < 4; ++r) {
                    const float sw = wsc[(cn + 2 * t + (r & 1)) * SC + b];
                    acc[j][r] = fmaf(part[r], (r < 2 ? sa0 : sa1) * sw, acc[j][r]);
                }
            }
        }
        __syncthreads();
    }
    store_tile<NT>(acc, out, m, n, m0 + wm * 16, n0 + wn * 8 * NT);
}

#define GEMM_W8A8(name, WM, NT)                                                              \
    extern "C" __global__ void name(const unsigned char* xq, const float* xs,                \
                                    const unsigned char* w, float* out, int m, int n, int k) { \
        gemm_w8a8_impl<WM, NT>(xq, xs, w, out, m, n, k);                                     \
    }
GEMM_W8A8(gemm_f8_s32_w8a8_m16, 1, 1)
GEMM_W8A8(gemm_f8_s32_w8a8_m64, 4, 8)
