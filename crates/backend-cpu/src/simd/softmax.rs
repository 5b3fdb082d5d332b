//! `e^x`, softmax sums, the maximum and SiLU: the elementwise kernels of
//! the attention's softmax and the feed-forward gate, with the same
//! dispatch as the rest of [`super`]. Every path gives the same bits: the
//! vector kernels apply [`exp`]'s operations lane by lane and finish their
//! tails with them, and [`sum`]'s order depends only on the length.

use super::{Level, level};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Above this, [`exp`] is +inf.
const EXP_HI: f32 = 88.3;
/// Below this, [`exp`] is 0.
const EXP_LO: f32 = -87.3;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// Cephes `expf` polynomial, highest degree first.
const EXP_P: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    0.166_666_65,
    0.5,
];

/// `e^x` (Cephes' `expf`: about 1 ulp; 0 below -87.3, +inf above 88.3, NaN
/// kept). The SIMD kernels ([`exp_slice`], [`silu_mul`]) apply exactly
/// these operations lane by lane, so every element gets the same bits
/// whether it is computed here, in a vector, or in a vector's tail.
#[inline]
pub fn exp(x: f32) -> f32 {
    exp_ops(x)
}

/// [`exp`]'s operations, inlined into [`exp`] and [`exp_fma`].
#[inline(always)]
fn exp_ops(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > EXP_HI {
        return f32::INFINITY;
    }
    if x < EXP_LO {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = EXP_P[0];
    for &c in &EXP_P[1..] {
        p = p.mul_add(r, c);
    }
    let y = p.mul_add(r * r, r) + 1.0;
    y * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// [`exp`] compiled with AVX2 and FMA, so that its `mul_add`s are
/// instructions instead of calls to libm's `fmaf` (the same exactly rounded
/// result): the vector kernels' scalar tails use it.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_fma(x: f32) -> f32 {
    exp_ops(x)
}

/// [`exp`] through [`exp_fma`] at the levels with FMA.
#[inline]
fn exp_at(level: Level, x: f32) -> f32 {
    match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: both vector levels imply AVX2 and FMA.
        Level::Avx512 | Level::Avx2 => unsafe { exp_fma(x) },
        Level::Portable => exp(x),
    }
}

/// `x[i] = exp(x[i])` for every element.
pub fn exp_slice(x: &mut [f32]) {
    let level = level();
    let done = match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F; the kernel stays inside `x`.
        Level::Avx512 => unsafe { exp_slice_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA; as above.
        Level::Avx2 => unsafe { exp_slice_avx2(x) },
        Level::Portable => 0,
    };
    for v in &mut x[done..] {
        *v = exp_at(level, *v);
    }
}

/// Σ x in a fixed order that depends only on the length: element `i` goes
/// to lane `i % 16`, lanes are summed in order, then pairwise (`l + l+8`,
/// `l + l+4`, `l + l+2`, `l + l+1`).
pub fn sum(x: &[f32]) -> f32 {
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F.
        Level::Avx512 => unsafe { sum_avx512(x) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2.
        Level::Avx2 => unsafe { sum_avx2(x) },
        Level::Portable => sum_portable(x),
    }
}

/// Reference [`sum`].
pub fn sum_portable(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 16];
    for (i, &v) in x.iter().enumerate() {
        acc[i % 16] += v;
    }
    let mut w = 8;
    while w > 0 {
        for l in 0..w {
            acc[l] += acc[l + w];
        }
        w /= 2;
    }
    acc[0]
}

/// The largest element (NEG_INFINITY when empty).
pub fn max(x: &[f32]) -> f32 {
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `o[i] = g[i] / (1 + exp(-g[i])) * u[i]` (SiLU and multiply), with
/// [`exp`]'s arithmetic in every lane.
pub fn silu_mul(g: &[f32], u: &[f32], o: &mut [f32]) {
    let n = g.len().min(u.len()).min(o.len());
    let level = level();
    let done = match level {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F; the kernel stays below n.
        Level::Avx512 => unsafe { silu_mul_avx512(&g[..n], &u[..n], &mut o[..n]) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA; as above.
        Level::Avx2 => unsafe { silu_mul_avx2(&g[..n], &u[..n], &mut o[..n]) },
        Level::Portable => 0,
    };
    for i in done..n {
        o[i] = g[i] / (1.0 + exp_at(level, -g[i])) * u[i];
    }
}

/// Defines the vector [`exp`] of one level (`$w` lanes).
macro_rules! exp_level {
    ($vexp:ident, $feat:literal, $vt:ty, $w:expr, $set1:ident, $mul:ident, $add:ident,
     $fma:ident, $round:expr, $cvt:ident, $seti:ident, $addi:ident, $slli:ident,
     $cast:ident, $sel:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn $vexp(x: $vt) -> $vt {
            // SAFETY: the features are enabled in every caller.
            unsafe {
                let n = $round($mul(x, $set1(LOG2E)));
                let r = $fma(n, $set1(-LN2_HI), x);
                let r = $fma(n, $set1(-LN2_LO), r);
                let mut p = $set1(EXP_P[0]);
                for &c in &EXP_P[1..] {
                    p = $fma(p, r, $set1(c));
                }
                let y = $add($fma(p, $mul(r, r), r), $set1(1.0));
                let sc = $cast($slli($addi($cvt(n), $seti(127))));
                $sel(x, $mul(y, sc))
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sel512(x: __m512, v: __m512) -> __m512 {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe {
        let small = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(EXP_LO));
        let big = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, _mm512_set1_ps(EXP_HI));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let v = _mm512_mask_blend_ps(small, v, _mm512_setzero_ps());
        let v = _mm512_mask_blend_ps(big, v, _mm512_set1_ps(f32::INFINITY));
        _mm512_mask_blend_ps(nan, v, x)
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn sel256(x: __m256, v: __m256) -> __m256 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let small = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
        let big = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(EXP_HI));
        let nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(x, x);
        let v = _mm256_blendv_ps(v, _mm256_setzero_ps(), small);
        let v = _mm256_blendv_ps(v, _mm256_set1_ps(f32::INFINITY), big);
        _mm256_blendv_ps(v, x, nan)
    }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn round512(v: __m512) -> __m512 {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe { _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn round256(v: __m256) -> __m256 {
    // SAFETY: AVX is enabled in every caller.
    unsafe { _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn slli512(v: __m512i) -> __m512i {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe { _mm512_slli_epi32::<23>(v) }
}

#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn slli256(v: __m256i) -> __m256i {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe { _mm256_slli_epi32::<23>(v) }
}

exp_level!(
    vexp512,
    "avx512f",
    __m512,
    16,
    _mm512_set1_ps,
    _mm512_mul_ps,
    _mm512_add_ps,
    _mm512_fmadd_ps,
    round512,
    _mm512_cvtps_epi32,
    _mm512_set1_epi32,
    _mm512_add_epi32,
    slli512,
    _mm512_castsi512_ps,
    sel512
);
exp_level!(
    vexp256,
    "avx2,fma",
    __m256,
    8,
    _mm256_set1_ps,
    _mm256_mul_ps,
    _mm256_add_ps,
    _mm256_fmadd_ps,
    round256,
    _mm256_cvtps_epi32,
    _mm256_set1_epi32,
    _mm256_add_epi32,
    slli256,
    _mm256_castsi256_ps,
    sel256
);

/// Whole vectors of [`exp_slice`]; returns how many elements were done.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_slice_avx512(x: &mut [f32]) -> usize {
    let mut i = 0;
    // SAFETY: 16 elements at i < len - 15.
    unsafe {
        while i + 16 <= x.len() {
            let p = x.as_mut_ptr().add(i);
            _mm512_storeu_ps(p, vexp512(_mm512_loadu_ps(p)));
            i += 16;
        }
    }
    i
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_slice_avx2(x: &mut [f32]) -> usize {
    let mut i = 0;
    // SAFETY: 8 elements at i < len - 7.
    unsafe {
        while i + 8 <= x.len() {
            let p = x.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, vexp256(_mm256_loadu_ps(p)));
            i += 8;
        }
    }
    i
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn silu_mul_avx512(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    let mut i = 0;
    // SAFETY: 16 elements at i < len - 15 of the three equal-length slices.
    unsafe {
        let one = _mm512_set1_ps(1.0);
        while i + 16 <= o.len() {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let neg = _mm512_xor_si512(_mm512_castps_si512(gv), _mm512_set1_epi32(i32::MIN));
            let e = vexp512(_mm512_castsi512_ps(neg));
            let s = _mm512_div_ps(gv, _mm512_add_ps(one, e));
            let v = _mm512_mul_ps(s, _mm512_loadu_ps(u.as_ptr().add(i)));
            _mm512_storeu_ps(o.as_mut_ptr().add(i), v);
            i += 16;
        }
    }
    i
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &[f32], u: &[f32], o: &mut [f32]) -> usize {
    let mut i = 0;
    // SAFETY: 8 elements at i < len - 7 of the three equal-length slices.
    unsafe {
        let one = _mm256_set1_ps(1.0);
        while i + 8 <= o.len() {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let e = vexp256(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0)));
            let s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
            let v = _mm256_mul_ps(s, _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(o.as_mut_ptr().add(i), v);
            i += 8;
        }
    }
    i
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_avx512(x: &[f32]) -> f32 {
    let n = x.len();
    let mut i = 0;
    // SAFETY: full vectors below n, then a masked tail.
    unsafe {
        let mut acc = _mm512_setzero_ps();
        while i + 16 <= n {
            acc = _mm512_add_ps(acc, _mm512_loadu_ps(x.as_ptr().add(i)));
            i += 16;
        }
        if i < n {
            let mask = ((1u32 << (n - i)) - 1) as u16;
            acc = _mm512_mask_add_ps(
                acc,
                mask,
                acc,
                _mm512_maskz_loadu_ps(mask, x.as_ptr().add(i)),
            );
        }
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(acc),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc))),
        );
        hsum8(h)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_avx2(x: &[f32]) -> f32 {
    let n = x.len();
    let mut i = 0;
    // SAFETY: full 16-element groups below n; the tail is added lane by lane.
    unsafe {
        let mut a0 = _mm256_setzero_ps();
        let mut a1 = _mm256_setzero_ps();
        while i + 16 <= n {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(x.as_ptr().add(i)));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(x.as_ptr().add(i + 8)));
            i += 16;
        }
        let mut lanes = [0.0f32; 16];
        _mm256_storeu_ps(lanes.as_mut_ptr(), a0);
        _mm256_storeu_ps(lanes.as_mut_ptr().add(8), a1);
        for (l, &v) in x[i..].iter().enumerate() {
            lanes[l] += v;
        }
        let h = _mm256_add_ps(
            _mm256_loadu_ps(lanes.as_ptr()),
            _mm256_loadu_ps(lanes.as_ptr().add(8)),
        );
        hsum8(h)
    }
}

/// `((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))` of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn hsum8(h: __m256) -> f32 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_sum_and_silu_are_exact_on_every_path() {
        let mut x: Vec<f32> = (0..2000).map(|i| (i as f32 - 1200.0) * 0.0937).collect();
        x.extend([
            0.0,
            -0.0,
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            88.29,
            88.31,
            -87.29,
            -87.31,
            1e-30,
            -1e-30,
            f32::MIN_POSITIVE,
        ]);
        let mut v = x.clone();
        exp_slice(&mut v);
        for (a, &b) in v.iter().zip(&x) {
            assert_eq!(a.to_bits(), exp(b).to_bits(), "exp({b})");
            if b.is_finite() && b > -80.0 && b < 80.0 {
                let want = (b as f64).exp();
                assert!(((*a as f64) - want).abs() <= 3e-7 * want, "exp({b}) = {a}");
            }
        }
        for n in [0, 1, 15, 16, 17, 100, 1001] {
            assert_eq!(
                sum(&x[..n]).to_bits(),
                sum_portable(&x[..n]).to_bits(),
                "sum of {n}"
            );
        }
        let u: Vec<f32> = (0..x.len()).map(|i| (i as f32 * 0.1).cos()).collect();
        let mut o = vec![0.0; x.len()];
        silu_mul(&x, &u, &mut o);
        for i in 0..x.len() {
            let want = x[i] / (1.0 + exp(-x[i])) * u[i];
            assert_eq!(o[i].to_bits(), want.to_bits(), "silu({})", x[i]);
        }
    }
}
