//! AVX2 dequantization of every block format to f32.
//!
//! Produces bit-identical results to the scalar reference in `formats`: the
//! same integer quants, and the same f32 operations in the same order
//! (`q*d`, `q*d + m`, `(d*sc)*q - dmin*m`; no fused multiply-add). Used by
//! both SIMD levels (the work is dominated by stores, so 512-bit vectors
//! would not help).
//!
//! Preconditions (checked in `lib.rs`): `src` holds whole blocks and `dst`
//! exactly the elements they encode.

use super::kquants::{self as kq, KDec};
use super::legacy as lg;
use crate::DType;
use crate::formats::kquants::{q3k_scales, scale_min_k4};
use std::arch::x86_64::*;

/// Converts 32 bytes (signed or unsigned) to four vectors of 8 f32, in order.
#[inline(always)]
unsafe fn bytes_to_f32<const SIGNED: bool>(v: __m256i) -> [__m256; 4] {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let lo = _mm256_castsi256_si128(v);
        let hi = _mm256_extracti128_si256::<1>(v);
        let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
        parts.map(|p| {
            let i = if SIGNED {
                _mm256_cvtepi8_epi32(p)
            } else {
                _mm256_cvtepu8_epi32(p)
            };
            _mm256_cvtepi32_ps(i)
        })
    }
}

#[inline(always)]
unsafe fn legacy<const F: u8>(src: &[u8], dst: &mut [f32]) {
    let bbytes = lg::bb(F);
    for (b, y) in src.chunks_exact(bbytes).zip(dst.chunks_exact_mut(32)) {
        // SAFETY: b is one whole block and y holds 32 f32 (chunks_exact).
        unsafe {
            let p = b.as_ptr();
            let q = lg::decode::<F, false>(p);
            let d = _mm256_set1_ps(crate::formats::rd_f16(b, 0));
            let v = match F {
                lg::Q4_0 => bytes_to_f32::<true>(_mm256_sub_epi8(q, _mm256_set1_epi8(8))),
                lg::Q5_0 => bytes_to_f32::<true>(_mm256_sub_epi8(q, _mm256_set1_epi8(16))),
                lg::Q8_0 => bytes_to_f32::<true>(q),
                _ => bytes_to_f32::<false>(q),
            };
            let yp = y.as_mut_ptr();
            if F == lg::Q4_1 || F == lg::Q5_1 {
                let m = _mm256_set1_ps(crate::formats::rd_f16(b, 2));
                for (j, x) in v.iter().enumerate() {
                    _mm256_storeu_ps(yp.add(8 * j), _mm256_add_ps(_mm256_mul_ps(*x, d), m));
                }
            } else {
                for (j, x) in v.iter().enumerate() {
                    _mm256_storeu_ps(yp.add(8 * j), _mm256_mul_ps(*x, d));
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn kquant<const F: u8>(src: &[u8], dst: &mut [f32]) {
    // SAFETY: AVX2 is enabled in every caller.
    let z = unsafe { _mm256_setzero_si256() };
    let mut dec = KDec {
        wq: [z; 8],
        scv: [z; 8],
        coef: z,
        d: 0.0,
        dmin: 0.0,
    };
    for (b, y) in src.chunks_exact(kq::bb(F)).zip(dst.chunks_exact_mut(256)) {
        // Per-16-element scale (dl) and min (ml), as the scalar reference computes them.
        let mut dl = [0.0f32; 16];
        let mut ml = [0.0f32; 16];
        // SAFETY: b is one whole super-block and y holds 256 f32.
        unsafe {
            kq::decode::<F>(b.as_ptr(), &mut dec);
            match F {
                kq::Q2K => {
                    for g in 0..16 {
                        dl[g] = dec.d * (b[g] & 0xF) as f32;
                        ml[g] = dec.dmin * (b[g] >> 4) as f32;
                    }
                }
                kq::Q3K => {
                    let sc = q3k_scales(&b[96..108]);
                    for g in 0..16 {
                        dl[g] = dec.d * sc[g] as f32;
                    }
                }
                kq::Q4K | kq::Q5K => {
                    for g in 0..16 {
                        let (s, m) = scale_min_k4(g / 2, &b[4..16]);
                        dl[g] = dec.d * s as f32;
                        ml[g] = dec.dmin * m as f32;
                    }
                }
                _ => {
                    for g in 0..16 {
                        dl[g] = dec.d * (b[192 + g] as i8) as f32;
                    }
                }
            }
            let off = match F {
                kq::Q3K => 4,
                kq::Q6K => 32,
                _ => 0,
            };
            let yp = y.as_mut_ptr();
            for c in 0..8 {
                let q = _mm256_sub_epi8(dec.wq[c], _mm256_set1_epi8(off));
                let v = bytes_to_f32::<true>(q);
                for (j, x) in v.iter().enumerate() {
                    let g = 2 * c + j / 2;
                    let r = _mm256_mul_ps(*x, _mm256_set1_ps(dl[g]));
                    let r = if F == kq::Q3K || F == kq::Q6K {
                        r
                    } else {
                        _mm256_sub_ps(r, _mm256_set1_ps(ml[g]))
                    };
                    _mm256_storeu_ps(yp.add(32 * c + 8 * j), r);
                }
            }
        }
    }
}

#[inline(always)]
unsafe fn float(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let es = if dtype == DType::F32 { 4 } else { 2 };
    let n = dst.len();
    let main = n - n % 8;
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    // SAFETY: src holds n elements of es bytes and dst n f32; j + 8 <= main <= n.
    unsafe {
        let mut j = 0;
        while j < main {
            let v = match dtype {
                DType::F32 => _mm256_loadu_ps(s.add(4 * j) as *const f32),
                DType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(s.add(2 * j) as *const __m128i)),
                _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(s.add(2 * j) as *const __m128i),
                ))),
            };
            _mm256_storeu_ps(d.add(j), v);
            j += 8;
        }
    }
    crate::formats::float::dequantize(dtype, &src[main * es..], &mut dst[main..]);
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run(dtype: DType, src: &[u8], dst: &mut [f32]) -> bool {
    // SAFETY: features enabled by this function; lengths per caller.
    unsafe {
        match dtype {
            DType::F32 | DType::F16 | DType::BF16 => float(dtype, src, dst),
            DType::Q4_0 => legacy::<{ lg::Q4_0 }>(src, dst),
            DType::Q4_1 => legacy::<{ lg::Q4_1 }>(src, dst),
            DType::Q5_0 => legacy::<{ lg::Q5_0 }>(src, dst),
            DType::Q5_1 => legacy::<{ lg::Q5_1 }>(src, dst),
            DType::Q8_0 => legacy::<{ lg::Q8_0 }>(src, dst),
            DType::Q2_K => kquant::<{ kq::Q2K }>(src, dst),
            DType::Q3_K => kquant::<{ kq::Q3K }>(src, dst),
            DType::Q4_K => kquant::<{ kq::Q4K }>(src, dst),
            DType::Q5_K => kquant::<{ kq::Q5K }>(src, dst),
            DType::Q6_K => kquant::<{ kq::Q6K }>(src, dst),
            _ => return false,
        }
    }
    true
}

/// Dequantizes with AVX2; returns false for dtypes without a SIMD path.
///
/// # Safety
/// The CPU must have AVX2+FMA+F16C; `src` must hold whole blocks of `dtype`
/// and `dst` exactly the elements they encode.
pub unsafe fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) -> bool {
    // SAFETY: per this function's contract.
    unsafe { run(dtype, src, dst) }
}
