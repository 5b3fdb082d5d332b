// Tensor-core products shared by the kernels that use them (the prefill
// attention of attention.cu, the scaled-block GEMM of gemm.cu): `mma_bf16`,
// one `mma.sync.m16n8k16` with bf16 inputs and f32 accumulation for a warp,
// and the split of an f32 into a bf16 high part and a bf16 remainder (x = hi
// + lo to about 16 significant bits), so a product of a bf16-exact operand
// with both parts carries about 16 bits of the f32 operand.
//
// `mma_bf16` is the PTX instruction on NVIDIA; hiprtc gets the same product
// computed lane by lane from the fragment layout (the launchers never pick
// the tensor-core kernels on AMD GPUs; they are compiled so every backend has
// one table).

__device__ __forceinline__ float bf16_bits_f32(u32 bits) { return __uint_as_float(bits << 16); }

#if defined(ARBOR_HOST_SIMT)
// The host emulator of the backend's tests (kernels/host/simt.h) computes it
// from the fragment layout with exact products.
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    simt_mma_bf16(c, a, b0, b1);
}
#elif !defined(ARBOR_HIP)
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
// m16n8k16 by its fragment layout: lane (g = lane / 4, t = lane % 4) holds
// A[g][2t..2t+1] (a0), A[g+8][2t..] (a1), A[g][2t+8..] (a2), A[g+8][2t+8..]
// (a3), B[2t..2t+1][g] (b0), B[2t+8..][g] (b1), and C[g][2t], C[g][2t+1],
// C[g+8][2t], C[g+8][2t+1].
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    for (int k = 0; k < 16; ++k) {
        const int src = (k & 7) >> 1, sh = 16 * (k & 1);
        const u32 x0 = SHFL(k < 8 ? a[0] : a[2], g * 4 + src);
        const u32 x1 = SHFL(k < 8 ? a[1] : a[3], g * 4 + src);
        const u32 y0 = SHFL(k < 8 ? b0 : b1, 8 * t + src);
        const u32 y1 = SHFL(k < 8 ? b0 : b1, 8 * t + 4 + src);
        const float f0 = bf16_bits_f32((x0 >> sh) & 0xffffu);
        const float f1 = bf16_bits_f32((x1 >> sh) & 0xffffu);
        const float e0 = bf16_bits_f32((y0 >> sh) & 0xffffu);
        const float e1 = bf16_bits_f32((y1 >> sh) & 0xffffu);
        c[0] += f0 * e0;
        c[1] += f0 * e1;
        c[2] += f1 * e0;
        c[3] += f1 * e1;
    }
}
#endif

__device__ __forceinline__ u32 bf16_round_bits(float v) { return (u32)from_f32<bf16_t>(v).x; }

// x = hi + lo in bf16; returns hi's bits, lo's through `lo`.
__device__ __forceinline__ u32 bf16_split(float x, u32* lo) {
    const u32 hi = bf16_round_bits(x);
    *lo = bf16_round_bits(x - bf16_bits_f32(hi));
    return hi;
}

__device__ __forceinline__ u32 ld_quad(const unsigned char* p) {
    return *reinterpret_cast<const u32*>(p);
}

// `mma.sync.m16n8k32` with E4M3 inputs and f32 accumulation (NVIDIA sm_89+;
// the launcher picks its kernels only there: on older targets and on AMD
// GPUs, where no such instruction exists, it traps). Lane (g, t) holds
// A[g][4t..4t+3] (a0, a byte each), A[g+8][4t..] (a1), A[g][16+4t..] (a2),
// A[g+8][16+4t..] (a3), B[4t..4t+3][g] (b0), B[16+4t..][g] (b1); C as
// m16n8k16.
#if defined(ARBOR_HOST_SIMT)
__device__ __forceinline__ void mma_e4m3(float* c, const u32* a, u32 b0, u32 b1) {
    simt_mma_e4m3(c, a, b0, b1);
}
#elif defined(ARBOR_HIP)
__device__ __forceinline__ void mma_e4m3(float*, const u32*, u32, u32) { __builtin_trap(); }
#else
__device__ __forceinline__ void mma_e4m3(float* c, const u32* a, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
}
#endif

// Packs two f32 (x at the lower index) as bf16 pairs: high parts and remainders.
__device__ __forceinline__ void bf16_split_pack(float x, float y, u32* hi, u32* lo) {
    u32 xl, yl;
    const u32 xh = bf16_split(x, &xl), yh = bf16_split(y, &yl);
    *hi = xh | (yh << 16);
    *lo = xl | (yl << 16);
}

__device__ __forceinline__ u32 ld_pair(const unsigned short* p) {
    return *reinterpret_cast<const u32*>(p);
}

