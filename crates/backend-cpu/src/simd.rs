//! Vector primitives for attention and elementwise kernels, with runtime
//! dispatch between an AVX-512, an AVX2+FMA and a portable implementation.
//!
//! [`dot`] and [`axpy`] compute the same mathematical result on every path
//! (up to float reassociation in the sums). The attention kernels
//! ([`scores`], [`weighted_sum`]) are exact on every path: each output
//! element is one chain of fused multiply-adds in a fixed order (`mul_add`
//! in the portable code, `vfmadd` in the SIMD code), so every level gives
//! the same bits, and an element's value never depends on the tile or the
//! vector lane it is computed in.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Level {
    Portable,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

fn level() -> Level {
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("ARBOR_CPU_PORTABLE").is_some() {
                return Level::Portable;
            }
            // ARBOR_CPU_SIMD=avx2 lowers the level (to test that path).
            let cap = std::env::var("ARBOR_CPU_SIMD").unwrap_or_default();
            if cap == "portable" {
                return Level::Portable;
            }
            if cap != "avx2" && is_x86_feature_detected!("avx512f") {
                return Level::Avx512;
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                return Level::Avx2;
            }
        }
        Level::Portable
    })
}

/// Dot product of two equal-length slices (the shorter length is used).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F (checked in `level`).
        Level::Avx512 => unsafe { dot_avx512(a, b) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA (checked in `level`).
        Level::Avx2 => unsafe { dot_avx2(a, b) },
        Level::Portable => dot_portable(a, b),
    }
}

/// `y += alpha * x` over the shorter length.
#[inline]
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &mut y[..n]);
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F.
        Level::Avx512 => unsafe { axpy_avx512(alpha, x, y) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA.
        Level::Avx2 => unsafe { axpy_avx2(alpha, x, y) },
        Level::Portable => axpy_portable(alpha, x, y),
    }
}

/// Reference dot product.
pub fn dot_portable(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

fn axpy_portable(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc0 = _mm512_setzero_ps();
    let mut acc1 = _mm512_setzero_ps();
    let mut i = 0;
    // SAFETY: every load reads 16 floats at i < n - 15 of both slices.
    unsafe {
        while i + 32 <= n {
            acc0 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i + 16)),
                _mm512_loadu_ps(b.as_ptr().add(i + 16)),
                acc1,
            );
            i += 32;
        }
        while i + 16 <= n {
            acc0 = _mm512_fmadd_ps(
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            i += 16;
        }
    }
    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len();
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY: every load reads 8 floats at i < n - 7 of both slices.
    unsafe {
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                acc1,
            );
            i += 16;
        }
        while i + 8 <= n {
            acc0 = _mm256_fmadd_ps(
                _mm256_loadu_ps(a.as_ptr().add(i)),
                _mm256_loadu_ps(b.as_ptr().add(i)),
                acc0,
            );
            i += 8;
        }
    }
    let v = _mm256_add_ps(acc0, acc1);
    let hi = _mm256_extractf128_ps(v, 1);
    let lo = _mm256_castps256_ps128(v);
    let s4 = _mm_add_ps(hi, lo);
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
    let mut s = _mm_cvtss_f32(s1);
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn axpy_avx512(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let va = _mm512_set1_ps(alpha);
    let mut i = 0;
    // SAFETY: 16-float loads and stores at i < n - 15 of both slices.
    unsafe {
        while i + 16 <= n {
            let yp = y.as_mut_ptr().add(i);
            _mm512_storeu_ps(
                yp,
                _mm512_fmadd_ps(va, _mm512_loadu_ps(x.as_ptr().add(i)), _mm512_loadu_ps(yp)),
            );
            i += 16;
        }
    }
    while i < n {
        y[i] += alpha * x[i];
        i += 1;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(alpha: f32, x: &[f32], y: &mut [f32]) {
    let n = x.len();
    let va = _mm256_set1_ps(alpha);
    let mut i = 0;
    // SAFETY: 8-float loads and stores at i < n - 7 of both slices.
    unsafe {
        while i + 8 <= n {
            let yp = y.as_mut_ptr().add(i);
            _mm256_storeu_ps(
                yp,
                _mm256_fmadd_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)), _mm256_loadu_ps(yp)),
            );
            i += 8;
        }
    }
    while i < n {
        y[i] += alpha * x[i];
        i += 1;
    }
}

/// Attention scores: `out[r * sp + t] = (Σ_d q[r * hd + d] · kt[d * sp + t]) · scale`
/// for `r < nq`, `t < sp`, the sum a chain of fused multiply-adds over `d`
/// in order starting from zero (keys in lanes, so no horizontal sums).
/// `kt` is the keys transposed (`hd` rows of `sp`); `sp` must be a multiple
/// of 16.
pub fn scores(q: &[f32], kt: &[f32], nq: usize, hd: usize, sp: usize, scale: f32, out: &mut [f32]) {
    assert!(
        sp.is_multiple_of(16),
        "score span {sp} is not a multiple of 16"
    );
    assert!(q.len() >= nq * hd && kt.len() >= hd * sp && out.len() >= nq * sp);
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F; lengths checked above.
        Level::Avx512 => unsafe { scores_avx512(q, kt, nq, hd, sp, scale, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA; lengths checked above.
        Level::Avx2 => unsafe { scores_avx2(q, kt, nq, hd, sp, scale, out) },
        Level::Portable => scores_portable(q, kt, nq, hd, sp, scale, out),
    }
}

/// Reference [`scores`].
pub fn scores_portable(
    q: &[f32],
    kt: &[f32],
    nq: usize,
    hd: usize,
    sp: usize,
    scale: f32,
    out: &mut [f32],
) {
    for r in 0..nq {
        let o = &mut out[r * sp..(r + 1) * sp];
        o.fill(0.0);
        for d in 0..hd {
            let qd = q[r * hd + d];
            for (x, &k) in o.iter_mut().zip(&kt[d * sp..(d + 1) * sp]) {
                *x = qd.mul_add(k, *x);
            }
        }
        for x in o.iter_mut() {
            *x *= scale;
        }
    }
}

/// The keys a query attends to, in position order: the span offsets
/// `start..end`, then those in `extra` (increasing, all past `end`).
#[derive(Clone, Copy, Debug)]
pub struct Visible<'a> {
    /// First offset of the contiguous run.
    pub start: usize,
    /// End (exclusive) of the contiguous run.
    pub end: usize,
    /// Further span offsets (draft-tree ancestors).
    pub extra: &'a [u32],
}

impl Visible<'_> {
    /// Every visible offset, in order.
    pub fn iter(&self) -> impl Iterator<Item = usize> + '_ {
        (self.start..self.end).chain(self.extra.iter().map(|&t| t as usize))
    }
}

/// For each of `rows` queries sharing the visible keys `vis`:
/// `o[r * hd + d] = (Σ_t e[r * es + t] · v[t * hd + d]) · inv[r]` over the
/// visible offsets `t` in order, the sum a chain of fused multiply-adds from
/// zero (one per element; rows are grouped only to share the loads of `v`).
#[allow(clippy::too_many_arguments)]
pub fn weighted_sum(
    e: &[f32],
    es: usize,
    rows: usize,
    v: &[f32],
    hd: usize,
    vis: Visible<'_>,
    inv: &[f32],
    o: &mut [f32],
) {
    let end = vis.end.max(vis.extra.last().map_or(0, |&t| t as usize + 1));
    assert!(vis.start <= vis.end && end <= es);
    assert!(rows == 0 || e.len() >= (rows - 1) * es + end);
    assert!(v.len() >= end * hd && o.len() >= rows * hd && inv.len() >= rows);
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F; every offset read is checked above.
        Level::Avx512 if hd.is_multiple_of(16) => unsafe {
            wsum_avx512(e, es, rows, v, hd, vis, inv, o)
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 and FMA; as above.
        Level::Avx2 | Level::Avx512 if hd.is_multiple_of(8) => unsafe {
            wsum_avx2(e, es, rows, v, hd, vis, inv, o)
        },
        _ => weighted_sum_portable(e, es, rows, v, hd, vis, inv, o),
    }
}

/// Reference [`weighted_sum`].
#[allow(clippy::too_many_arguments)]
pub fn weighted_sum_portable(
    e: &[f32],
    es: usize,
    rows: usize,
    v: &[f32],
    hd: usize,
    vis: Visible<'_>,
    inv: &[f32],
    o: &mut [f32],
) {
    for r in 0..rows {
        let o = &mut o[r * hd..(r + 1) * hd];
        o.fill(0.0);
        for t in vis.iter() {
            let et = e[r * es + t];
            for (x, &vv) in o.iter_mut().zip(&v[t * hd..(t + 1) * hd]) {
                *x = et.mul_add(vv, *x);
            }
        }
        for x in o.iter_mut() {
            *x *= inv[r];
        }
    }
}

/// `dst[d * stride + l] = src[l * hd + d]` for `l < 8`, `d < hd`: eight
/// rows of `hd` values transposed into eight columns (an exact copy).
pub fn transpose8(src: &[f32], hd: usize, dst: &mut [f32], stride: usize) {
    assert!(src.len() >= 8 * hd && (hd == 0 || dst.len() >= (hd - 1) * stride + 8));
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2 (implied by both levels); lengths checked above.
        Level::Avx2 | Level::Avx512 => unsafe { transpose8_avx(src, hd, dst, stride) },
        Level::Portable => transpose8_portable(src, hd, dst, stride, 0),
    }
}

fn transpose8_portable(src: &[f32], hd: usize, dst: &mut [f32], stride: usize, from: usize) {
    for d in from..hd {
        for l in 0..8 {
            dst[d * stride + l] = src[l * hd + d];
        }
    }
}

/// The 8x8 transposition of eight rows of 8 lanes in registers: lane `l`
/// of output `d` is lane `d` of input `l`. For kernels compiled with AVX.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn transpose8x8(r: [__m256; 8]) -> [__m256; 8] {
    // SAFETY: register shuffles; the caller runs with AVX enabled.
    unsafe {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
        let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(u0, u4),
            _mm256_permute2f128_ps::<0x20>(u1, u5),
            _mm256_permute2f128_ps::<0x20>(u2, u6),
            _mm256_permute2f128_ps::<0x20>(u3, u7),
            _mm256_permute2f128_ps::<0x31>(u0, u4),
            _mm256_permute2f128_ps::<0x31>(u1, u5),
            _mm256_permute2f128_ps::<0x31>(u2, u6),
            _mm256_permute2f128_ps::<0x31>(u3, u7),
        ]
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8_avx(src: &[f32], hd: usize, dst: &mut [f32], stride: usize) {
    let mut d0 = 0;
    // SAFETY: rows l < 8 hold hd values and dst holds rows d < hd of 8
    // columns (checked by `transpose8`); d0 + 8 <= hd.
    unsafe {
        while d0 + 8 <= hd {
            let mut r = [_mm256_setzero_ps(); 8];
            for (l, x) in r.iter_mut().enumerate() {
                *x = _mm256_loadu_ps(src.as_ptr().add(l * hd + d0));
            }
            for (i, v) in transpose8x8(r).iter().enumerate() {
                _mm256_storeu_ps(dst.as_mut_ptr().add((d0 + i) * stride), *v);
            }
            d0 += 8;
        }
    }
    transpose8_portable(src, hd, dst, stride, d0);
}

// ------------------------------------------------ exp, softmax sums, SiLU

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

/// Defines the SIMD [`scores`] of one level: tiles of 4 query rows (`rows`
/// valid; row pointers past `rows` repeat the last row and their results are
/// dropped) by `C` vectors of `$lanes` keys, `$wide` vectors per main step.
macro_rules! scores_level {
    ($tile:ident, $driver:ident, $feat:literal, $vt:ty, $zero:ident, $set1:ident, $load:ident,
     $fma:ident, $mul:ident, $store:ident, $lanes:expr, $wide:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $tile<const C: usize>(
            q: *const f32,
            kt: *const f32,
            hd: usize,
            sp: usize,
            rows: usize,
            t0: usize,
            scale: f32,
            out: *mut f32,
        ) {
            // SAFETY: rows r < rows of q (hd each) and out (sp each), and
            // columns t0..t0 + lanes * C < sp of kt and out are in bounds (caller).
            unsafe {
                let qr: [*const f32; 4] = [
                    q,
                    q.add(hd * 1usize.min(rows - 1)),
                    q.add(hd * 2usize.min(rows - 1)),
                    q.add(hd * 3usize.min(rows - 1)),
                ];
                let mut acc: [[$vt; C]; 4] = [[$zero(); C]; 4];
                for d in 0..hd {
                    let kp = kt.add(d * sp + t0);
                    let mut kv: [$vt; C] = [$zero(); C];
                    for (c, x) in kv.iter_mut().enumerate() {
                        *x = $load(kp.add($lanes * c));
                    }
                    for (a, &qp) in acc.iter_mut().zip(&qr) {
                        let qb = $set1(*qp.add(d));
                        for (ac, &k) in a.iter_mut().zip(&kv) {
                            *ac = $fma(qb, k, *ac);
                        }
                    }
                }
                let sv = $set1(scale);
                for (r, a) in acc.iter().enumerate().take(rows) {
                    for (c, ac) in a.iter().enumerate() {
                        $store(out.add(r * sp + t0 + $lanes * c), $mul(*ac, sv));
                    }
                }
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $driver(
            q: &[f32],
            kt: &[f32],
            nq: usize,
            hd: usize,
            sp: usize,
            scale: f32,
            out: &mut [f32],
        ) {
            let mut r0 = 0;
            while r0 < nq {
                let rows = (nq - r0).min(4);
                // SAFETY: rows r0..r0+rows exist; columns stay below sp (checked by `scores`).
                unsafe {
                    let qp = q.as_ptr().add(r0 * hd);
                    let op = out.as_mut_ptr().add(r0 * sp);
                    let mut t = 0;
                    while t + $lanes * $wide <= sp {
                        $tile::<$wide>(qp, kt.as_ptr(), hd, sp, rows, t, scale, op);
                        t += $lanes * $wide;
                    }
                    while t < sp {
                        $tile::<1>(qp, kt.as_ptr(), hd, sp, rows, t, scale, op);
                        t += $lanes;
                    }
                }
                r0 += rows;
            }
        }
    };
}

scores_level!(
    scores_tile512,
    scores_avx512,
    "avx512f",
    __m512,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    _mm512_fmadd_ps,
    _mm512_mul_ps,
    _mm512_storeu_ps,
    16,
    4
);
scores_level!(
    scores_tile256,
    scores_avx2,
    "avx2,fma",
    __m256,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    _mm256_fmadd_ps,
    _mm256_mul_ps,
    _mm256_storeu_ps,
    8,
    2
);

/// Defines the SIMD [`weighted_sum`] of one level: tiles of `R <= 4` rows
/// by `N <= $maxn` vectors of `$lanes` floats, starting at element `d0`
/// (`$maxn` keeps the `R * N` accumulators in registers: 16 of AVX2's 16
/// would spill).
macro_rules! wsum_level {
    ($tile:ident, $driver:ident, $feat:literal, $vt:ty, $zero:ident, $set1:ident, $load:ident,
     $fma:ident, $mul:ident, $store:ident, $lanes:expr, $maxn:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $tile<const R: usize, const N: usize>(
            e: *const f32,
            es: usize,
            v: *const f32,
            hd: usize,
            d0: usize,
            vis: Visible<'_>,
            inv: *const f32,
            o: *mut f32,
        ) {
            // SAFETY: rows r < R of e (stride es) hold every visible offset,
            // v holds their rows, and d0 + N * lanes <= hd (checked by
            // `weighted_sum` and the driver).
            unsafe {
                let mut acc: [[$vt; N]; R] = [[$zero(); N]; R];
                for t in vis.iter() {
                    let vp = v.add(t * hd + d0);
                    let mut vv: [$vt; N] = [$zero(); N];
                    for (c, x) in vv.iter_mut().enumerate() {
                        *x = $load(vp.add($lanes * c));
                    }
                    for (r, a) in acc.iter_mut().enumerate() {
                        let et = $set1(*e.add(r * es + t));
                        for (ac, &x) in a.iter_mut().zip(&vv) {
                            *ac = $fma(et, x, *ac);
                        }
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    let iv = $set1(*inv.add(r));
                    for (c, ac) in a.iter().enumerate() {
                        $store(o.add(r * hd + d0 + $lanes * c), $mul(*ac, iv));
                    }
                }
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $driver(
            e: &[f32],
            es: usize,
            rows: usize,
            v: &[f32],
            hd: usize,
            vis: Visible<'_>,
            inv: &[f32],
            o: &mut [f32],
        ) {
            let mut r0 = 0;
            while r0 < rows {
                let rr = (rows - r0).min(4);
                let mut d0 = 0;
                while d0 < hd {
                    let n = ((hd - d0) / $lanes).min($maxn);
                    // SAFETY: rows r0..r0+rr and elements d0..d0+n*lanes are in
                    // bounds (hd is a multiple of the lane count).
                    unsafe {
                        let (ep, ip) = (e.as_ptr().add(r0 * es), inv.as_ptr().add(r0));
                        let op = o.as_mut_ptr().add(r0 * hd);
                        macro_rules! go {
                            ($r:literal) => {
                                match n {
                                    4 => $tile::<$r, 4>(ep, es, v.as_ptr(), hd, d0, vis, ip, op),
                                    3 => $tile::<$r, 3>(ep, es, v.as_ptr(), hd, d0, vis, ip, op),
                                    2 => $tile::<$r, 2>(ep, es, v.as_ptr(), hd, d0, vis, ip, op),
                                    _ => $tile::<$r, 1>(ep, es, v.as_ptr(), hd, d0, vis, ip, op),
                                }
                            };
                        }
                        match rr {
                            4 => go!(4),
                            3 => go!(3),
                            2 => go!(2),
                            _ => go!(1),
                        }
                    }
                    d0 += n * $lanes;
                }
                r0 += rr;
            }
        }
    };
}

wsum_level!(
    wsum_tile512,
    wsum_avx512,
    "avx512f",
    __m512,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    _mm512_fmadd_ps,
    _mm512_mul_ps,
    _mm512_storeu_ps,
    16,
    4
);
wsum_level!(
    wsum_tile256,
    wsum_avx2,
    "avx2,fma",
    __m256,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    _mm256_fmadd_ps,
    _mm256_mul_ps,
    _mm256_storeu_ps,
    8,
    2
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dispatch_matches_portable() {
        for n in [0, 1, 7, 16, 31, 64, 100, 577] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let r = dot_portable(&a, &b);
            assert!((dot(&a, &b) - r).abs() <= 1e-4 * (1.0 + r.abs()));
            let mut y1 = b.clone();
            let mut y2 = b.clone();
            axpy(0.5, &a, &mut y1);
            axpy_portable(0.5, &a, &mut y2);
            for (p, q) in y1.iter().zip(&y2) {
                assert!((p - q).abs() < 1e-6);
            }
        }
    }

    fn vals(n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|i| ((i as f32 + 0.5) * a).sin()).collect()
    }

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

    #[test]
    fn transpose8_transposes() {
        for hd in [1, 8, 20, 64] {
            let src = vals(8 * hd, 0.3);
            let stride = 24;
            let mut a = vec![0.0; hd * stride];
            let mut b = vec![0.0; hd * stride];
            transpose8(&src, hd, &mut a, stride);
            transpose8_portable(&src, hd, &mut b, stride, 0);
            assert_eq!(a, b);
            if hd > 3 {
                assert_eq!(a[3 * stride + 5], src[5 * hd + 3]);
            }
        }
    }

    #[test]
    fn attention_kernels_are_exact_on_every_path() {
        for (nq, hd, sp) in [
            (1, 16, 16),
            (3, 64, 80),
            (7, 8, 144),
            (5, 40, 32),
            (4, 128, 64),
        ] {
            let q = vals(nq * hd, 0.37);
            let kt = vals(hd * sp, 0.11);
            let mut a = vec![0.0; nq * sp];
            let mut b = vec![0.0; nq * sp];
            scores(&q, &kt, nq, hd, sp, 0.125, &mut a);
            scores_portable(&q, &kt, nq, hd, sp, 0.125, &mut b);
            assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
            let rows = 1 + nq % 5;
            let e = vals(rows * sp, 0.7);
            let v = vals(sp * hd, 0.23);
            let inv = vals(rows, 0.9);
            let extra: Vec<u32> = (sp as u32 / 2..sp as u32).step_by(3).collect();
            let vis = Visible {
                start: 1,
                end: sp / 2,
                extra: &extra,
            };
            let mut o1 = vec![0.0; rows * hd];
            let mut o2 = vec![0.0; rows * hd];
            weighted_sum(&e, sp, rows, &v, hd, vis, &inv, &mut o1);
            weighted_sum_portable(&e, sp, rows, &v, hd, vis, &inv, &mut o2);
            assert!(o1.iter().zip(&o2).all(|(x, y)| x.to_bits() == y.to_bits()));
        }
    }
}
