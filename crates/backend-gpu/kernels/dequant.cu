// Dequantization of the scaled weight blocks of HF quantized checkpoints
// (see arbor_engine_core::dtype) to f32, for the dequantizing GEMM of
// linear.rs: each element gets the value the CPU kernels compute, bit for bit
// (e4m3 x scale, (q - zero) x scale, e2m1 x scale; one rounding each).

__device__ __forceinline__ float e4m3_value(u32 c) {
    u32 e = (c >> 3) & 15u;
    float m = (float)(c & 7u);
    float v = e == 0u ? m * 0.001953125f : (1.0f + m * 0.125f) * __uint_as_float((e + 120u) << 23);
    return (c & 0x80u) ? -v : v;
}

__device__ __forceinline__ float e2m1_value(u32 c) {
    u32 ex = (c >> 1) & 3u;
    float mb = (float)(c & 1u);
    float v = ex == 0u ? mb * 0.5f : (1.0f + mb * 0.5f) * (float)(1u << (ex - 1u));
    return (c & 8u) ? -v : v;
}

__device__ __forceinline__ float f32_at(const unsigned char* p) {
    u32 b = (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
    return __uint_as_float(b);
}

// f8_s32: 32 E4M3 bytes then an f32 scale per 36-byte block; n elements.
extern "C" __global__ void dequant_f8_s32(const unsigned char* w, float* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const unsigned char* b = w + (i / 32) * 36;
        out[i] = e4m3_value(b[i % 32]) * f32_at(b + 32);
    }
}

// u4_s32: 16 bytes of nibbles (element j < 16 low, 16 + j high), an f16
// scale and a u8 zero per 20-byte block.
extern "C" __global__ void dequant_u4_s32(const unsigned char* w, float* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const unsigned char* b = w + (i / 32) * 20;
        u32 j = (u32)(i % 32);
        u32 byte = b[j & 15u];
        u32 q = j < 16u ? (byte & 15u) : (byte >> 4);
        f16_t s;
        s.x = (unsigned short)((u32)b[16] | ((u32)b[17] << 8));
        out[i] = (float)((int)q - (int)b[18]) * to_f32(s);
    }
}

// u8_s32: 32 bytes of values, an f16 scale and a u16 zero point (8-bit
// GPTQ's zeros reach 256) per 36-byte block.
extern "C" __global__ void dequant_u8_s32(const unsigned char* w, float* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const unsigned char* b = w + (i / 32) * 36;
        u32 q = b[i % 32];
        f16_t s;
        s.x = (unsigned short)((u32)b[32] | ((u32)b[33] << 8));
        int z = (int)((u32)b[34] | ((u32)b[35] << 8));
        out[i] = (float)((int)q - z) * to_f32(s);
    }
}

// f4_s16: 8 bytes of E2M1 nibbles (element j < 8 low, 8 + j high) and an f32
// scale per 12-byte block.
extern "C" __global__ void dequant_f4_s16(const unsigned char* w, float* out, u64 n) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        const unsigned char* b = w + (i / 16) * 12;
        u32 j = (u32)(i % 16);
        u32 byte = b[j & 7u];
        out[i] = e2m1_value(j < 8u ? (byte & 15u) : (byte >> 4)) * f32_at(b + 8);
    }
}
