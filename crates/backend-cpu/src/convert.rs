//! Rows of half-precision values (f16, bf16) widened to f32, as the
//! attention reads the KV cache: one call per row, the CPU's F16C / AVX2
//! instructions inline over the whole row where the CPU has them (detected
//! once), the `half` crate's conversion elsewhere. Widening is exact, so
//! every path gives the same bits.

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
