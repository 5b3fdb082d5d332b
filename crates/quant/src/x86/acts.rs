//! AVX2 quantization of activation blocks to Q8_0/Q8_1 values, exactly as
//! ggml's x86 `quantize_row_q8_0` (max |x| per block, `id = 127/amax`,
//! round half to even), so the result is bit-identical to the scalar
//! `acts::quantize_block_q8`.

use std::arch::x86_64::*;

/// f32 -> f16 -> f32 with F16C (round to nearest even, as `half`).
#[inline(always)]
unsafe fn f16_round(v: f32) -> f32 {
    // SAFETY: F16C is enabled in the caller.
    unsafe {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
            _mm_set_ss(v),
        )))
    }
}

/// Quantizes whole blocks of 32 values: writes the quants to `qs`, and for
/// each block the f16-rounded scale to `d`, ggml's `s` to `s` (Q8_1:
/// f16-rounded `amax/127 * sum`; otherwise `d * sum`) and the sum of its
/// quants to `sum`. Blocks holding non-finite values go through `scalar`, so
/// every block is bit-identical to the scalar path.
///
/// # Safety
/// The CPU must have AVX2+FMA+F16C; `x.len() == qs.len() == 32 * n` and `d`,
/// `s`, `sum` hold `n` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_q8_blocks(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sum: &mut [i32],
    round_s: bool,
    scalar: fn(&[f32], &mut [i8]) -> (f32, i32),
) {
    let nb = d.len();
    let expo = _mm256_set1_epi32(0x7f80_0000);
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..nb {
        // SAFETY: block b spans x[32b..32b+32] and qs[32b..32b+32] (contract).
        unsafe {
            let p = x.as_ptr().add(32 * b);
            let v0 = _mm256_loadu_ps(p);
            let v1 = _mm256_loadu_ps(p.add(8));
            let v2 = _mm256_loadu_ps(p.add(16));
            let v3 = _mm256_loadu_ps(p.add(24));
            let nonfinite = |v: __m256| {
                let e = _mm256_and_si256(_mm256_castps_si256(v), expo);
                _mm256_cmpeq_epi32(e, expo)
            };
            let bad = _mm256_or_si256(
                _mm256_or_si256(nonfinite(v0), nonfinite(v1)),
                _mm256_or_si256(nonfinite(v2), nonfinite(v3)),
            );
            if _mm256_testz_si256(bad, bad) == 0 {
                let (db, sb) = scalar(&x[32 * b..32 * b + 32], &mut qs[32 * b..32 * b + 32]);
                let dr = f16_round(db);
                d[b] = dr;
                s[b] = if round_s {
                    f16_round(db * sb as f32)
                } else {
                    dr * sb as f32
                };
                sum[b] = sb;
                continue;
            }
            let mut m = _mm256_andnot_ps(sign, v0);
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v1));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v2));
            m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v3));
            let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
            let amax = _mm_cvtss_f32(m4);
            let db = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mul = _mm256_set1_ps(id);
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let i0 = _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v0, mul)));
            let i1 = _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v1, mul)));
            let i2 = _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v2, mul)));
            let i3 = _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v3, mul)));
            let t = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
            let s4 = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
            let s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s4 = _mm_add_epi32(s4, _mm_shuffle_epi32::<0b01>(s4));
            let sb = _mm_cvtsi128_si32(s4);
            let dr = f16_round(db);
            d[b] = dr;
            s[b] = if round_s {
                f16_round(db * sb as f32)
            } else {
                dr * sb as f32
            };
            sum[b] = sb;
            let a = _mm256_packs_epi32(i0, i1);
            let c = _mm256_packs_epi32(i2, i3);
            let q = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, c), perm);
            _mm256_storeu_si256(qs.as_mut_ptr().add(32 * b) as *mut __m256i, q);
        }
    }
}

/// Quantizes whole super-blocks of 256 values to Q8_K exactly as ggml's
/// `quantize_row_q8_K_ref` (and the scalar `quantize_block_q8k`): quants to
/// `qs`, scales to `d`, sums of 16 quants to `bsums`. Super-blocks holding
/// non-finite values go through `scalar`.
///
/// # Safety
/// The CPU must have AVX2+FMA+F16C; `x.len() == qs.len() == 256 * n`,
/// `d.len() == n`, `bsums.len() == 16 * n`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize_q8k_blocks(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    bsums: &mut [i16],
    scalar: fn(&[f32], &mut [i8], &mut [i16]) -> f32,
) {
    let sign = _mm256_set1_ps(-0.0);
    let expo = _mm256_set1_epi32(0x7f80_0000);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for b in 0..d.len() {
        let xb = &x[256 * b..256 * b + 256];
        let qb = &mut qs[256 * b..256 * b + 256];
        let bs = &mut bsums[16 * b..16 * b + 16];
        // SAFETY: xb and qb hold 256 values (sliced above).
        unsafe {
            let p = xb.as_ptr();
            let mut m = _mm256_setzero_ps();
            let mut bad = _mm256_setzero_si256();
            for j in 0..32 {
                let v = _mm256_loadu_ps(p.add(8 * j));
                m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v));
                let e = _mm256_and_si256(_mm256_castps_si256(v), expo);
                bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(e, expo));
            }
            if _mm256_testz_si256(bad, bad) == 0 {
                d[b] = scalar(xb, qb, bs);
                continue;
            }
            let m4 = _mm_max_ps(_mm256_extractf128_ps::<1>(m), _mm256_castps256_ps128(m));
            let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
            if amax == 0.0 {
                qb.fill(0);
                bs.fill(0);
                d[b] = 0.0;
                continue;
            }
            // The first element with the largest magnitude gives the sign.
            let av = _mm256_set1_ps(amax);
            let mut max = amax;
            for j in 0..32 {
                let v = _mm256_loadu_ps(p.add(8 * j));
                let hit =
                    _mm256_movemask_ps(_mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_andnot_ps(sign, v), av));
                if hit != 0 {
                    max = xb[8 * j + hit.trailing_zeros() as usize];
                    break;
                }
            }
            let iscale = -127.0 / max;
            let mul = _mm256_set1_ps(iscale);
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            for c in 0..8 {
                let q = |o: usize| {
                    let v = _mm256_loadu_ps(p.add(32 * c + o));
                    _mm256_cvtps_epi32(_mm256_round_ps::<NEAREST>(_mm256_mul_ps(v, mul)))
                };
                let a = _mm256_packs_epi32(q(0), q(8));
                let bq = _mm256_packs_epi32(q(16), q(24));
                let v = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, bq), perm);
                _mm256_storeu_si256(qb.as_mut_ptr().add(32 * c) as *mut __m256i, v);
            }
            for (g, s) in bs.iter_mut().enumerate() {
                *s = qb[16 * g..16 * g + 16].iter().map(|&v| v as i16).sum();
            }
            d[b] = 1.0 / iscale;
        }
    }
}
