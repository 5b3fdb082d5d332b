//! Rows of half-precision values (f16, bf16) and FP8 bytes (E4M3, E5M2)
//! widened to f32, as the attention reads the KV cache: one call per row,
//! the CPU's F16C / AVX2 instructions inline over the whole row where the
//! CPU has them (detected once), the `half` crate's conversion and
//! `arbor_quant::scaled`'s decoders elsewhere. Widening is exact and the
//! FP8 scale is one multiplication after it, so every path gives the same
//! bits.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

#[cfg(target_arch = "x86_64")]
#[inline]
fn has_avx2_f16c() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| {
        std::env::var_os("ARBOR_CPU_PORTABLE").is_none()
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("f16c")
    })
}

/// `dst[i] = src[i]` widened, for the shorter of the two lengths.
#[inline]
pub fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: the CPU has AVX2 and F16C (checked above).
        unsafe { x86::f16_rows(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst);
}

/// `dst[i] = src[i]` widened, for the shorter of the two lengths.
#[inline]
pub fn bf16_to_f32(src: &[bf16], dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: the CPU has AVX2 (checked above).
        unsafe { x86::bf16_rows(src, dst) };
        return;
    }
    src.convert_to_f32_slice(dst);
}

/// `dst[i] = fp8(src[i]) * scale` (E4M3 when `e4m3`, else E5M2), for the
/// shorter of the two lengths; the bits of `arbor_quant::scaled`'s
/// `e4m3_to_f32` / `e5m2_to_f32` times `scale`.
#[inline]
pub fn fp8_to_f32(src: &[u8], e4m3: bool, scale: f32, dst: &mut [f32]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: the CPU has AVX2 and F16C (checked above).
        done = unsafe { x86::fp8_rows(src, e4m3, scale, dst) };
    }
    let decode = if e4m3 {
        arbor_quant::scaled::e4m3_to_f32
    } else {
        arbor_quant::scaled::e5m2_to_f32
    };
    for (o, &b) in dst[done..].iter_mut().zip(&src[done..]) {
        *o = decode(b) * scale;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use half::slice::HalfFloatSliceExt;
    use half::{bf16, f16};
    use std::arch::x86_64::*;

    /// # Safety
    /// AVX2 and F16C; `src` and `dst` of equal length.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f16_rows(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            while i + 8 <= n {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
                i += 8;
            }
        }
        // Rows are usually whole vectors: skip the `half` crate's call
        // (its own feature check) when nothing is left.
        if i < n {
            src[i..].convert_to_f32_slice(&mut dst[i..]);
        }
    }

    /// FP8 bytes to f32 times `scale`, 8 at a time: the byte becomes the f16
    /// bits `arbor_quant::scaled` decodes through (E4M3: sign and the 7 other
    /// bits shifted into an f16 of a 256th of the value; E5M2: the high byte
    /// of an f16), `vcvtph2ps` widens them exactly, then the same
    /// multiplications as the scalar decoder. Returns the elements done (a
    /// multiple of 8).
    ///
    /// # Safety
    /// AVX2 and F16C; `src` and `dst` of equal length.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn fp8_rows(src: &[u8], e4m3: bool, scale: f32, dst: &mut [f32]) -> usize {
        let n = src.len();
        let mut i = 0;
        let sc = _mm256_set1_ps(scale);
        let k256 = _mm256_set1_ps(256.0);
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            while i + 8 <= n {
                let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(src.as_ptr().add(i) as *const __m128i));
                let v = if e4m3 {
                    let sign = _mm_slli_epi16::<8>(_mm_and_si128(b, _mm_set1_epi16(0x80)));
                    let mag = _mm_slli_epi16::<7>(_mm_and_si128(b, _mm_set1_epi16(0x7f)));
                    _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, mag)), k256)
                } else {
                    _mm256_cvtph_ps(_mm_slli_epi16::<8>(b))
                };
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_mul_ps(v, sc));
                i += 8;
            }
        }
        i
    }

    /// # Safety
    /// AVX2; `src` and `dst` of equal length.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn bf16_rows(src: &[bf16], dst: &mut [f32]) {
        let n = src.len();
        let mut i = 0;
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            while i + 8 <= n {
                let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
                let w = _mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h));
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_castsi256_ps(w));
                i += 8;
            }
        }
        if i < n {
            src[i..].convert_to_f32_slice(&mut dst[i..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_same(got: &[f32], want: impl Iterator<Item = (u16, f32)>, what: &str) {
        for (g, (bits, w)) in got.iter().zip(want) {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{what} {bits:#06x}"
            );
        }
    }

    #[test]
    fn fp8_widening_matches_the_scalar_decoders_bit_for_bit() {
        // Every byte, in rows of 261 (a ragged tail), with scale 1 and a
        // checkpoint-like scale.
        let bytes: Vec<u8> = (0..261).map(|i| (i * 7 % 256) as u8).collect();
        let mut got = vec![0.0f32; bytes.len()];
        for e4m3 in [true, false] {
            for scale in [1.0f32, 0.0173] {
                fp8_to_f32(&bytes, e4m3, scale, &mut got);
                for (g, &b) in got.iter().zip(&bytes) {
                    let w = if e4m3 {
                        arbor_quant::scaled::e4m3_to_f32(b)
                    } else {
                        arbor_quant::scaled::e5m2_to_f32(b)
                    } * scale;
                    assert!(
                        g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                        "e4m3={e4m3} scale={scale} byte {b:#04x}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn widening_matches_the_half_crate_bit_for_bit() {
        // Every f16 and bf16 bit pattern, in rows of 37 (a ragged tail).
        let all: Vec<u16> = (0..=u16::MAX).collect();
        for row in all.chunks(37) {
            let mut got = vec![0f32; row.len()];
            let h: Vec<f16> = row.iter().map(|&b| f16::from_bits(b)).collect();
            f16_to_f32(&h, &mut got);
            assert_same(&got, h.iter().map(|x| (x.to_bits(), x.to_f32())), "f16");
            let b: Vec<bf16> = row.iter().map(|&v| bf16::from_bits(v)).collect();
            bf16_to_f32(&b, &mut got);
            assert_same(&got, b.iter().map(|x| (x.to_bits(), x.to_f32())), "bf16");
        }
    }
}
