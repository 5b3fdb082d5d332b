//! Rows of KV cache elements converted as the attention reads and writes
//! them: half-precision values (f16, bf16) and FP8 bytes (E4M3, E5M2)
//! widened to f32, and f32 rows encoded to FP8. One call per row, or per 8
//! key rows widened and transposed at once for the attention's key gather
//! ([`rows_transposed`], FP8 included); the CPU's F16C / AVX2 instructions inline
//! over the whole row where the CPU has them (detected once), the `half`
//! crate's conversion and `arbor_quant::scaled`'s scalar codecs elsewhere
//! and for the tails.
//! Widening is exact and the FP8 scale is one operation after it (or before
//! the encoding), and the vector encoder applies the scalar encoder's
//! operations lane by lane, so every path gives the same bits.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

/// Whether the CPU has AVX2 and F16C (detected once; false with
/// `ARBOR_CPU_PORTABLE`).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn has_avx2_f16c() -> bool {
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

/// A narrow KV cache element format, as [`rows_transposed`] widens it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Narrow {
    F16,
    BF16,
    /// FP8 (E4M3 when `e4m3`, else E5M2) times the cache's `scale`.
    Fp8 {
        e4m3: bool,
        scale: f32,
    },
}

impl Narrow {
    /// Bytes per element.
    pub fn bytes(self) -> usize {
        match self {
            Narrow::F16 | Narrow::BF16 => 2,
            Narrow::Fp8 { .. } => 1,
        }
    }
}

/// Eight cache rows of `hd` values in `format`, widened and transposed in
/// one pass: `dst[d * stride + l] = f32(rows[l][d])` for `d < hd`, `l < 8`:
/// the attention's key gather without a round trip through an f32 row
/// buffer. The values are the row conversions' ([`f16_to_f32`],
/// [`bf16_to_f32`], [`fp8_to_f32`]: the same operations lane by lane).
/// Returns false, writing nothing, where the CPU lacks AVX2 and F16C: the
/// caller then converts row by row.
///
/// # Safety
/// Each `rows[l]` points to `hd` readable elements of `format`.
#[inline]
pub unsafe fn rows_transposed(
    rows: &[*const u8; 8],
    format: Narrow,
    hd: usize,
    dst: &mut [f32],
    stride: usize,
) -> bool {
    assert!(hd == 0 || dst.len() >= (hd - 1) * stride + 8);
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: the CPU has AVX2 and F16C (checked above); the rows are
        // readable (the caller's contract) and dst is long enough (checked).
        unsafe { x86::rows_transposed(rows, format, hd, dst, stride) };
        return true;
    }
    let _ = (rows, format, stride);
    false
}

/// One element of `format` at `p`, widened (the scalar conversions).
///
/// # Safety
/// `p` points to a readable element of `format`.
#[inline(always)]
unsafe fn widen_one(p: *const u8, format: Narrow) -> f32 {
    // SAFETY: the caller's contract; unaligned reads.
    unsafe {
        match format {
            Narrow::F16 => f16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            Narrow::BF16 => bf16::from_bits((p as *const u16).read_unaligned()).to_f32(),
            Narrow::Fp8 { e4m3: true, scale } => arbor_quant::scaled::e4m3_to_f32(*p) * scale,
            Narrow::Fp8 { e4m3: false, scale } => arbor_quant::scaled::e5m2_to_f32(*p) * scale,
        }
    }
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

/// `dst[i] = fp8(src[i] / scale)` (E4M3 when `e4m3`, else E5M2), for the
/// shorter of the two lengths: the bytes of `arbor_quant::scaled`'s
/// `f32_to_e4m3` / `f32_to_e5m2` (round to nearest even, saturation, NaN
/// codes), 8 at a time where the CPU has AVX2.
#[inline]
pub fn f32_to_fp8(src: &[f32], e4m3: bool, scale: f32, dst: &mut [u8]) {
    let n = src.len().min(dst.len());
    let (src, dst) = (&src[..n], &mut dst[..n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2_f16c() {
        // SAFETY: the CPU has AVX2 (checked above).
        done = unsafe { x86::fp8_encode_rows(src, e4m3, scale, dst) };
    }
    let encode = if e4m3 {
        arbor_quant::scaled::f32_to_e4m3
    } else {
        arbor_quant::scaled::f32_to_e5m2
    };
    for (o, &v) in dst[done..].iter_mut().zip(&src[done..]) {
        *o = encode(v / scale);
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::Narrow;
    use arbor_quant::scaled::x86::{e4m3_f16_128, e4m3_f16_256};
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
        let format = Narrow::Fp8 { e4m3, scale };
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), widen8(src.as_ptr().add(i), format));
                i += 8;
            }
        }
        i
    }

    /// f32 to FP8 bytes, 8 at a time, with the scalar encoders' operations
    /// lane by lane: `a = |v / scale|`; below the smallest normal the code
    /// is `round_even(a * 2^(mantissa bits + 1 - min exponent))`; above it
    /// the exponent field plus `round_even((frac - 1) * 2^mantissa bits)`,
    /// whose carry into the exponent is the scalar `m == 8` case, capped at
    /// the largest finite code; then saturation and NaN. Returns the
    /// elements done (a multiple of 8).
    ///
    /// # Safety
    /// AVX2; `src` and `dst` of equal length.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn fp8_encode_rows(
        src: &[f32],
        e4m3: bool,
        scale: f32,
        dst: &mut [u8],
    ) -> usize {
        // (mantissa bits, exponent bias, smallest normal, subnormal step
        // inverse, largest code, saturation threshold, NaN code).
        let (mb, bias, min_normal, sub_mul, max_code, sat, nan) = if e4m3 {
            (3, 7, f32::from_bits(0x3c80_0000), 512.0, 0x7e, 448.0, 0x7f)
        } else {
            (
                2,
                15,
                f32::from_bits(0x3880_0000),
                65536.0,
                0x7b,
                57344.0,
                0x7e,
            )
        };
        const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        let n = src.len();
        let mut i = 0;
        let mut codes = [0i32; 8];
        // SAFETY: i + 8 <= n for both slices.
        unsafe {
            let sc = _mm256_set1_ps(scale);
            let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
            while i + 8 <= n {
                let v = _mm256_div_ps(_mm256_loadu_ps(src.as_ptr().add(i)), sc);
                let a = _mm256_and_ps(v, abs_mask);
                let ai = _mm256_castps_si256(a);
                // Subnormal codes.
                let sub = _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(
                    a,
                    _mm256_set1_ps(sub_mul),
                )));
                // Normal codes: the biased exponent field, then the rounded
                // mantissa added (its carry moves into the exponent).
                let e = _mm256_sub_epi32(_mm256_srli_epi32::<23>(ai), _mm256_set1_epi32(127));
                let frac = _mm256_castsi256_ps(_mm256_or_si256(
                    _mm256_and_si256(ai, _mm256_set1_epi32(0x007f_ffff)),
                    _mm256_set1_epi32(0x3f80_0000),
                ));
                let m = _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(
                    _mm256_sub_ps(frac, _mm256_set1_ps(1.0)),
                    _mm256_set1_ps((1 << mb) as f32),
                )));
                let field = _mm256_sll_epi32(
                    _mm256_add_epi32(e, _mm256_set1_epi32(bias)),
                    _mm_cvtsi32_si128(mb),
                );
                let normal =
                    _mm256_min_epi32(_mm256_add_epi32(field, m), _mm256_set1_epi32(max_code));
                let is_sub =
                    _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LT_OQ>(a, _mm256_set1_ps(min_normal)));
                let mut code = _mm256_blendv_epi8(normal, sub, is_sub);
                let is_sat =
                    _mm256_castps_si256(_mm256_cmp_ps::<_CMP_GE_OQ>(a, _mm256_set1_ps(sat)));
                code = _mm256_blendv_epi8(code, _mm256_set1_epi32(max_code), is_sat);
                // The sign bit of v on every code; NaN takes its code alone.
                let sign = _mm256_and_si256(
                    _mm256_srli_epi32::<24>(_mm256_castps_si256(v)),
                    _mm256_set1_epi32(0x80),
                );
                code = _mm256_or_si256(code, sign);
                let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
                code = _mm256_blendv_epi8(code, _mm256_set1_epi32(nan), is_nan);
                _mm256_storeu_si256(codes.as_mut_ptr() as *mut __m256i, code);
                for (o, c) in dst[i..i + 8].iter_mut().zip(codes) {
                    *o = c as u8;
                }
                i += 8;
            }
        }
        i
    }

    /// Eight elements of `format` at `p`, widened with the row
    /// conversions' operations (FP8: the byte as f16 bits, for E4M3 in
    /// `arbor_quant::scaled::x86`'s three operations, `vcvtph2ps`, × 256 for
    /// E4M3, then × scale), for every 8-lane reader of a narrow
    /// cache: [`fp8_rows`], [`rows_transposed`] and the attention's
    /// in-place weighted sum.
    ///
    /// # Safety
    /// AVX2 and F16C; 8 readable elements at `p`.
    #[inline(always)]
    pub(crate) unsafe fn widen8(p: *const u8, format: Narrow) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            match format {
                Narrow::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                Narrow::BF16 => {
                    let h = _mm_loadu_si128(p as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                }
                Narrow::Fp8 { e4m3, scale } => {
                    let b = _mm_cvtepu8_epi16(_mm_loadl_epi64(p as *const __m128i));
                    let v = if e4m3 {
                        _mm256_mul_ps(_mm256_cvtph_ps(e4m3_f16_128(b)), _mm256_set1_ps(256.0))
                    } else {
                        _mm256_cvtph_ps(_mm_slli_epi16::<8>(b))
                    };
                    _mm256_mul_ps(v, _mm256_set1_ps(scale))
                }
            }
        }
    }

    /// Sixteen elements of `format` at `p`: [`widen8`]'s operations at
    /// 512-bit width, for the 16-lane in-place weighted sum.
    ///
    /// # Safety
    /// AVX-512F and F16C; 16 readable elements at `p`.
    #[inline(always)]
    pub(crate) unsafe fn widen16(p: *const u8, format: Narrow) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            match format {
                Narrow::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
                Narrow::BF16 => {
                    let h = _mm256_loadu_si256(p as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                Narrow::Fp8 { e4m3, scale } => {
                    let b = _mm256_cvtepu8_epi16(_mm_loadu_si128(p as *const __m128i));
                    let v = if e4m3 {
                        _mm512_mul_ps(_mm512_cvtph_ps(e4m3_f16_256(b)), _mm512_set1_ps(256.0))
                    } else {
                        _mm512_cvtph_ps(_mm256_slli_epi16::<8>(b))
                    };
                    _mm512_mul_ps(v, _mm512_set1_ps(scale))
                }
            }
        }
    }

    /// See [`super::rows_transposed`].
    ///
    /// # Safety
    /// AVX2 and F16C; each row holds `hd` elements; `dst` holds rows
    /// `d < hd` of 8 values at `stride`.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn rows_transposed(
        rows: &[*const u8; 8],
        format: Narrow,
        hd: usize,
        dst: &mut [f32],
        stride: usize,
    ) {
        let width = format.bytes();
        let mut d0 = 0;
        // SAFETY: d0 + 8 <= hd, so every load is inside its row and every
        // store inside dst (the caller's contract).
        unsafe {
            while d0 + 8 <= hd {
                let mut r = [_mm256_setzero_ps(); 8];
                for (l, x) in r.iter_mut().enumerate() {
                    *x = widen8(rows[l].add(d0 * width), format);
                }
                let c = crate::simd::transpose8x8(r);
                for (i, v) in c.iter().enumerate() {
                    _mm256_storeu_ps(dst.as_mut_ptr().add((d0 + i) * stride), *v);
                }
                d0 += 8;
            }
            for d in d0..hd {
                for (l, &row) in rows.iter().enumerate() {
                    dst[d * stride + l] = super::widen_one(row.add(d * width), format);
                }
            }
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

    /// The fused key gather gives the row conversions' values, transposed:
    /// every f16 and bf16 bit pattern and every FP8 byte (NaNs, infinities,
    /// subnormals; FP8 at two scales) passes through, for head sizes with
    /// and without a tail of fewer than 8 values, into a padded stride.
    #[test]
    fn transposed_rows_match_the_row_conversions() {
        let formats = [
            Narrow::F16,
            Narrow::BF16,
            Narrow::Fp8 {
                e4m3: true,
                scale: 1.0,
            },
            Narrow::Fp8 {
                e4m3: true,
                scale: 0.0173,
            },
            Narrow::Fp8 {
                e4m3: false,
                scale: 1.0,
            },
            Narrow::Fp8 {
                e4m3: false,
                scale: 0.0173,
            },
        ];
        for format in formats {
            let codes = if format.bytes() == 2 {
                1usize << 16
            } else {
                256
            };
            for hd in [64usize, 12, 3] {
                let stride = 24;
                for start in (0..codes).step_by(8 * hd) {
                    // Row l holds codes start + l * hd .. (wrapping).
                    let code = |i: usize| ((start + i) % codes) as u16;
                    let bytes: Vec<u8> = (0..8 * hd)
                        .flat_map(|i| match format.bytes() {
                            2 => code(i).to_le_bytes().to_vec(),
                            _ => vec![code(i) as u8],
                        })
                        .collect();
                    let w = format.bytes();
                    let rows: [*const u8; 8] =
                        std::array::from_fn(|l| bytes[l * hd * w..].as_ptr());
                    let mut dst = vec![f32::NAN; (hd - 1) * stride + 8];
                    // SAFETY: each row holds hd elements.
                    if !unsafe { rows_transposed(&rows, format, hd, &mut dst, stride) } {
                        eprintln!("skipped: no AVX2 + F16C here");
                        return;
                    }
                    for l in 0..8 {
                        let codes_l: Vec<u16> = (0..hd).map(|d| code(l * hd + d)).collect();
                        let mut want = vec![0.0f32; hd];
                        match format {
                            Narrow::F16 => {
                                let h: Vec<f16> =
                                    codes_l.iter().map(|&b| f16::from_bits(b)).collect();
                                f16_to_f32(&h, &mut want);
                            }
                            Narrow::BF16 => {
                                let h: Vec<bf16> =
                                    codes_l.iter().map(|&b| bf16::from_bits(b)).collect();
                                bf16_to_f32(&h, &mut want);
                            }
                            Narrow::Fp8 { e4m3, scale } => {
                                let b: Vec<u8> = codes_l.iter().map(|&c| c as u8).collect();
                                fp8_to_f32(&b, e4m3, scale, &mut want);
                            }
                        }
                        let got: Vec<f32> = (0..hd).map(|d| dst[d * stride + l]).collect();
                        assert_same(
                            &got,
                            codes_l.iter().copied().zip(want),
                            &format!("{format:?} hd {hd} lane {l}"),
                        );
                    }
                }
            }
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
    fn fp8_encoding_matches_the_scalar_encoders_byte_for_byte() {
        // Every FP8 value and its midpoints with both neighbours (the ties),
        // their negatives, f32 subnormals, zeros, infinities, NaN, the
        // saturation edges, and a spread of magnitudes; two scales.
        let mut x: Vec<f32> = Vec::new();
        for e4m3 in [true, false] {
            let dec = |b: u8| {
                if e4m3 {
                    arbor_quant::scaled::e4m3_to_f32(b)
                } else {
                    arbor_quant::scaled::e5m2_to_f32(b)
                }
            };
            for b in 0..=255u8 {
                let (v, w) = (dec(b), dec(b.wrapping_add(1)));
                x.extend([v, (v + w) / 2.0, f32::from_bits(v.to_bits() + 1)]);
            }
        }
        x.extend([
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(1),
            f32::MIN_POSITIVE,
            447.9,
            448.0,
            464.0,
            57343.0,
            57344.0,
            1e30,
        ]);
        let mut s = 7u32;
        for _ in 0..4000 {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            let mag = f32::from_bits(0x3000_0000 + (s >> 4) % 0x1400_0000);
            x.push(if s & 1 == 0 { mag } else { -mag });
        }
        for e4m3 in [true, false] {
            for scale in [1.0f32, 0.0173, 3.5] {
                let mut got = vec![0u8; x.len()];
                f32_to_fp8(&x, e4m3, scale, &mut got);
                for (g, &v) in got.iter().zip(&x) {
                    let w = if e4m3 {
                        arbor_quant::scaled::f32_to_e4m3(v / scale)
                    } else {
                        arbor_quant::scaled::f32_to_e5m2(v / scale)
                    };
                    assert_eq!(
                        *g,
                        w,
                        "e4m3={e4m3} scale={scale} v={v:e} ({:#010x})",
                        v.to_bits()
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
