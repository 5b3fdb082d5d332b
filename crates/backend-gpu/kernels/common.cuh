// Shared helpers of Arbor's GPU kernels, compiled at run time without headers:
// by NVRTC for NVIDIA GPUs and by hiprtc for AMD GPUs, from this one source.
//
// Storage types: `float` (f32), `bf16_t` and `f16_t` (raw 16-bit patterns).
// Conversions round to nearest even, as the `half` crate does on the host, so
// a value written to a bf16/f16 KV cache here has the same bits as on the CPU.
// All arithmetic is in f32. Kernels are compiled without fast-math.
//
// Portability: the kernels are written for warps of 32 lanes (`lane =
// threadIdx.x & 31`, `warp = threadIdx.x >> 5`, shuffles across offsets up to
// 16). On AMD GPUs with 64-wide wavefronts (CDNA: gfx9xx) a wavefront holds
// two such warps: `SHFL_XOR`, `SHFL_UP` and `SHFL` pass width 32, so they exchange
// only inside each 32-lane half, so every reduction computes exactly what it
// does on a 32-wide warp; 32-wide wavefronts (RDNA) are one warp. The only
// other differences are the f16 conversions (PTX `cvt` on NVIDIA, clang's
// `_Float16` on AMD; both round to nearest even). The host emulator of the
// backend's tests (kernels/host/simt.h, `ARBOR_HOST_SIMT`) takes the AMD path,
// with its own shuffles.

#if defined(__HIPCC_RTC__) || defined(__HIP__) || defined(ARBOR_HOST_SIMT)
#define ARBOR_HIP 1
#define SHFL_XOR(v, o) __shfl_xor((v), (o), 32)
#define SHFL_UP(v, o) __shfl_up((v), (o), 32)
#define SHFL(v, src) __shfl((v), (src), 32)
#else
#define SHFL_XOR(v, o) __shfl_xor_sync(0xffffffffu, (v), (o))
#define SHFL_UP(v, o) __shfl_up_sync(0xffffffffu, (v), (o))
#define SHFL(v, src) __shfl_sync(0xffffffffu, (v), (src))
#endif

// The block's dynamic shared memory (the launch's byte count) as `T name[]`.
#ifndef ARBOR_HOST_SIMT
#define DYNAMIC_SMEM(T, name) extern __shared__ T name[]
#endif

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

struct bf16_t { unsigned short x; };
struct f16_t { unsigned short x; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16_t v) {
    return __uint_as_float(((u32)v.x) << 16);
}
__device__ __forceinline__ float to_f32(f16_t v) {
#ifdef ARBOR_HIP
    return (float)__builtin_bit_cast(_Float16, v.x);
#else
    float f;
    unsigned short h = v.x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#endif
}

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ bf16_t from_f32<bf16_t>(float v) {
    u32 u = __float_as_uint(v);
    bf16_t r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        // NaN: keep it quiet and signed as the host does.
        r.x = (unsigned short)((u >> 16) | 0x40u);
        return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.x = (unsigned short)(u >> 16);
    return r;
}
template <> __device__ __forceinline__ f16_t from_f32<f16_t>(float v) {
#ifdef ARBOR_HIP
    unsigned short h = __builtin_bit_cast(unsigned short, (_Float16)v);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
#endif
    f16_t r;
    r.x = h;
    return r;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += SHFL_XOR(v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, SHFL_XOR(v, o));
    return v;
}

// Sum over all threads of a block of at most 1024 threads (a multiple of 32).
// `scratch` holds 32 floats. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

// SplitMix64 step, as `SeqRng` seeds itself on the host.
__device__ __forceinline__ u64 splitmix64(u64* x) {
    *x += 0x9E3779B97F4A7C15ull;
    u64 z = *x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ u64 rotl64(u64 x, int k) { return (x << k) | (x >> (64 - k)); }
