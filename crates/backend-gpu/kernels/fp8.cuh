// FP8 KV cache storage: `e4m3_t` (OCP E4M3, the "fn" variant: no infinities,
// 0x7f NaN) and `e5m2_t` (OCP E5M2), one raw byte each. Encoding rounds to
// nearest even and saturates at the largest finite value (448, 57344), NaN to
// 0x7f / 0x7e; decoding is exact (E4M3's NaN codes read as +-480): the CPU
// backend's conversions (arbor_quant::scaled), so a cache written here holds
// the CPU's bytes. Uses only __float_as_uint, __uint_as_float, fabsf and
// rintf (round to nearest even), so the host compiles this file too (the
// backend's conversion test checks every code against the CPU's).

struct e4m3_t { unsigned char x; };
struct e5m2_t { unsigned char x; };

// 2^e as f32 (exact, -126 <= e <= 127).
__device__ __forceinline__ float fp8_pow2(int e) { return __uint_as_float((u32)(e + 127) << 23); }

// f32 -> FP8 with MBITS mantissa bits and exponent bias BIAS.
template <int MBITS, int BIAS>
__device__ __forceinline__ unsigned char fp8_encode(float v, float max_v, u32 max_code,
                                                    unsigned char nan) {
    const u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return nan;
    const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
    const float a = fabsf(v);
    if (a >= max_v) return (unsigned char)(sign | max_code);
    // Below the smallest normal 2^(1 - BIAS) the codes step by 2^(1 - BIAS - MBITS).
    if (a < fp8_pow2(1 - BIAS)) {
        return (unsigned char)(sign | (u32)rintf(a * fp8_pow2(BIAS - 1 + MBITS)));
    }
    int e = (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
    const float frac = a * fp8_pow2(-e);  // [1, 2), exact
    int m = (int)rintf((frac - 1.0f) * (float)(1 << MBITS));
    if (m == (1 << MBITS)) {
        m = 0;
        e += 1;
    }
    const u32 code = ((u32)(e + BIAS) << MBITS) | (u32)m;
    return (unsigned char)(sign | (code < max_code ? code : max_code));
}

// FP8 -> f32 (exact; E5M2's top exponent gives infinities and NaNs).
template <int MBITS, int BIAS>
__device__ __forceinline__ float fp8_decode(unsigned char c) {
    const u32 e = ((u32)c >> MBITS) & ((0x80u >> MBITS) - 1u);
    const u32 m = (u32)c & ((1u << MBITS) - 1u);
    float a;
    if (e == 0) {
        a = (float)m * fp8_pow2(1 - BIAS - MBITS);
    } else if (BIAS == 15 && e == 31) {
        a = m == 0 ? __uint_as_float(0x7f800000u) : __uint_as_float(0x7fc00000u);
    } else {
        a = (1.0f + (float)m * fp8_pow2(-MBITS)) * fp8_pow2((int)e - BIAS);
    }
    return (c & 0x80u) ? -a : a;
}

__device__ __forceinline__ float to_f32(e4m3_t v) { return fp8_decode<3, 7>(v.x); }
__device__ __forceinline__ float to_f32(e5m2_t v) { return fp8_decode<2, 15>(v.x); }
template <> __device__ __forceinline__ e4m3_t from_f32<e4m3_t>(float v) {
    e4m3_t r;
    r.x = fp8_encode<3, 7>(v, 448.0f, 0x7eu, 0x7f);
    return r;
}
template <> __device__ __forceinline__ e5m2_t from_f32<e5m2_t>(float v) {
    e5m2_t r;
    r.x = fp8_encode<2, 15>(v, 57344.0f, 0x7bu, 0x7e);
    return r;
}
