//! Vector primitives for attention and elementwise kernels, with runtime
//! dispatch between an AVX-512, an AVX2+FMA and a portable implementation.
//!
//! [`dot`] and [`axpy`] compute the same mathematical result on every path
//! (up to float reassociation in the sums). The attention kernels
//! ([`scores`], [`weighted_sum`]) are exact on every path: each output
//! element is one chain of fused multiply-adds in a fixed order (`mul_add`
//! in the portable code, `vfmadd` in the SIMD code), so every level gives
//! the same bits, and an element's value never depends on the tile or the
//! vector lane it is computed in; [`weighted_sum_narrow`] is
//! [`weighted_sum`] over f16, bf16 or FP8 rows read in place, with the
//! same bits. The softmax and SiLU kernels (`exp`,
//! `sum`, `max`, `silu_mul`) are in `softmax`, re-exported here.

mod softmax;

use crate::convert::Narrow;

pub use softmax::{exp, exp_slice, max, silu_mul, sum};
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

/// [`weighted_sum`] over narrow value rows read in place (offset `t` is
/// the `hd` elements of `format` at element `vrows[t] * hd` of `vn`: a KV
/// cache's rows), widened as they are read with the row conversions'
/// operations (`crate::convert`; FP8 times its scale): the same bits as
/// [`weighted_sum`] over the widened rows, without writing them out first.
/// Returns false, computing nothing, where [`reads_narrow_values`] is
/// false: the caller then widens the rows and calls [`weighted_sum`].
///
/// # Safety
/// For every visible offset `t`, `vn + vrows[t] * hd * format.bytes()`
/// points to `hd` readable elements.
#[allow(clippy::too_many_arguments)]
pub unsafe fn weighted_sum_narrow(
    e: &[f32],
    es: usize,
    rows: usize,
    vn: *const u8,
    format: Narrow,
    vrows: &[usize],
    hd: usize,
    vis: Visible<'_>,
    inv: &[f32],
    o: &mut [f32],
) -> bool {
    let end = vis.end.max(vis.extra.last().map_or(0, |&t| t as usize + 1));
    assert!(vis.start <= vis.end && end <= es);
    assert!(rows == 0 || e.len() >= (rows - 1) * es + end);
    assert!(vrows.len() >= end && o.len() >= rows * hd && inv.len() >= rows);
    if !reads_narrow_values(hd) {
        return false;
    }
    match level() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX-512F, AVX2 and F16C (checked); every
        // offset read is checked above or is the caller's contract.
        Level::Avx512 if hd.is_multiple_of(16) => unsafe {
            wsum_avx512_n(e, es, rows, vn, format, vrows, hd, vis, inv, o);
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked); as above.
        _ => unsafe { wsum_avx2_n(e, es, rows, vn, format, vrows, hd, vis, inv, o) },
        #[cfg(not(target_arch = "x86_64"))]
        _ => unreachable!("reads_narrow_values is false off x86"),
    }
    true
}

/// Whether [`weighted_sum_narrow`] runs (rather than returning false) for
/// rows of `hd` values on this CPU: AVX-512F or AVX2 with FMA and F16C.
pub fn reads_narrow_values(hd: usize) -> bool {
    match level() {
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 | Level::Avx512 => hd.is_multiple_of(8) && crate::convert::has_avx2_f16c(),
        _ => false,
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
/// would spill). `$driver` reads f32 value rows, `$driver_n` narrow rows in
/// place (`FMT` > 0, a [`narrow_code`]: row `t` at element `vrows[t] * hd`
/// of `vn`), widened by `$loadn` as they are read; the arithmetic is the
/// same.
macro_rules! wsum_level {
    ($tile:ident, $body:ident, $driver:ident, $driver_n:ident, $feat:literal, $feat_n:literal,
     $vt:ty, $zero:ident, $set1:ident, $load:ident, $loadn:ident, $fma:ident, $mul:ident,
     $store:ident, $lanes:expr, $maxn:expr) => {
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $tile<const R: usize, const N: usize, const FMT: u8>(
            e: *const f32,
            es: usize,
            v: *const f32,
            vn: *const u8,
            vrows: *const usize,
            scale: f32,
            hd: usize,
            d0: usize,
            vis: Visible<'_>,
            inv: *const f32,
            o: *mut f32,
        ) {
            // SAFETY: rows r < R of e (stride es) hold every visible offset,
            // v (or vn at vrows) holds their rows, and d0 + N * lanes <= hd
            // (checked by the callers and the driver).
            unsafe {
                let mut acc: [[$vt; N]; R] = [[$zero(); N]; R];
                let width = narrow_of(FMT, 1.0).bytes();
                for t in vis.iter() {
                    let mut vv: [$vt; N] = [$zero(); N];
                    if FMT > 0 {
                        let vp = vn.add((*vrows.add(t) * hd + d0) * width);
                        for (c, x) in vv.iter_mut().enumerate() {
                            *x = $loadn::<FMT>(vp.add($lanes * c * width), scale);
                        }
                    } else {
                        let vp = v.add(t * hd + d0);
                        for (c, x) in vv.iter_mut().enumerate() {
                            *x = $load(vp.add($lanes * c));
                        }
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
        #[inline(always)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $body<const FMT: u8>(
            e: &[f32],
            es: usize,
            rows: usize,
            v: *const f32,
            vn: *const u8,
            vrows: *const usize,
            scale: f32,
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
                                    4 => $tile::<$r, 4, FMT>(
                                        ep, es, v, vn, vrows, scale, hd, d0, vis, ip, op,
                                    ),
                                    3 => $tile::<$r, 3, FMT>(
                                        ep, es, v, vn, vrows, scale, hd, d0, vis, ip, op,
                                    ),
                                    2 => $tile::<$r, 2, FMT>(
                                        ep, es, v, vn, vrows, scale, hd, d0, vis, ip, op,
                                    ),
                                    _ => $tile::<$r, 1, FMT>(
                                        ep, es, v, vn, vrows, scale, hd, d0, vis, ip, op,
                                    ),
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
            let (vn, vrows) = (std::ptr::null(), std::ptr::null());
            // SAFETY: the caller's checks; `FMT` 0 reads v, not vn.
            unsafe { $body::<0>(e, es, rows, v.as_ptr(), vn, vrows, 1.0, hd, vis, inv, o) }
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat_n)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $driver_n(
            e: &[f32],
            es: usize,
            rows: usize,
            vn: *const u8,
            format: Narrow,
            vrows: &[usize],
            hd: usize,
            vis: Visible<'_>,
            inv: &[f32],
            o: &mut [f32],
        ) {
            let (v, vr) = (std::ptr::null(), vrows.as_ptr());
            let scale = match format {
                Narrow::Fp8 { scale, .. } => scale,
                _ => 1.0,
            };
            // SAFETY: the caller's contract and checks; a narrow `FMT`
            // reads vn, not v.
            unsafe {
                match narrow_code(format) {
                    1 => $body::<1>(e, es, rows, v, vn, vr, scale, hd, vis, inv, o),
                    2 => $body::<2>(e, es, rows, v, vn, vr, scale, hd, vis, inv, o),
                    3 => $body::<3>(e, es, rows, v, vn, vr, scale, hd, vis, inv, o),
                    _ => $body::<4>(e, es, rows, v, vn, vr, scale, hd, vis, inv, o),
                }
            }
        }
    };
}

/// A narrow format's code for the kernels' `FMT`: 1 f16, 2 bf16, 3 E4M3,
/// 4 E5M2 (0 is f32).
fn narrow_code(format: Narrow) -> u8 {
    match format {
        Narrow::F16 => 1,
        Narrow::BF16 => 2,
        Narrow::Fp8 { e4m3: true, .. } => 3,
        Narrow::Fp8 { e4m3: false, .. } => 4,
    }
}

/// The format of code `fmt` (> 0) with FP8 scale `scale`.
#[inline(always)]
const fn narrow_of(fmt: u8, scale: f32) -> Narrow {
    match fmt {
        1 => Narrow::F16,
        2 => Narrow::BF16,
        3 => Narrow::Fp8 { e4m3: true, scale },
        _ => Narrow::Fp8 { e4m3: false, scale },
    }
}

/// Eight elements of format code `FMT` at `p`, widened by the row
/// conversions' `convert::x86::widen8`.
///
/// # Safety
/// AVX2 and F16C; 8 readable elements at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_n8<const FMT: u8>(p: *const u8, scale: f32) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe { crate::convert::x86::widen8(p, narrow_of(FMT, scale)) }
}

/// Sixteen elements of format code `FMT` at `p`: `convert::x86::widen16`.
///
/// # Safety
/// AVX-512F and F16C; 16 readable elements at `p`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn load_n16<const FMT: u8>(p: *const u8, scale: f32) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe { crate::convert::x86::widen16(p, narrow_of(FMT, scale)) }
}

wsum_level!(
    wsum_tile512,
    wsum_body512,
    wsum_avx512,
    wsum_avx512_n,
    "avx512f",
    "avx512f,avx2,f16c",
    __m512,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_loadu_ps,
    load_n16,
    _mm512_fmadd_ps,
    _mm512_mul_ps,
    _mm512_storeu_ps,
    16,
    4
);
wsum_level!(
    wsum_tile256,
    wsum_body256,
    wsum_avx2,
    wsum_avx2_n,
    "avx2,fma",
    "avx2,fma,f16c",
    __m256,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_loadu_ps,
    load_n8,
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
            // Narrow rows read in place, scattered over a larger cache, give
            // the bits of the f32 path over the same rows widened: f16 and
            // bf16 codes, and every FP8 byte (37 is odd, so i * 37 mod 256
            // takes every value), at two scales.
            let formats = [
                Narrow::F16,
                Narrow::BF16,
                Narrow::Fp8 {
                    e4m3: true,
                    scale: 1.0,
                },
                Narrow::Fp8 {
                    e4m3: false,
                    scale: 0.0173,
                },
            ];
            for format in formats {
                let w = format.bytes();
                let n_rows = 3 * sp;
                let cache: Vec<u8> = (0..n_rows * hd * w).map(|i| (i * 37 % 256) as u8).collect();
                let vrows: Vec<usize> = (0..sp).map(|t| (t * 7 + 2) % n_rows).collect();
                let mut widened = vec![0.0f32; sp * hd];
                for (t, &r) in vrows.iter().enumerate() {
                    let row = &cache[r * hd * w..(r + 1) * hd * w];
                    let out = &mut widened[t * hd..(t + 1) * hd];
                    match format {
                        Narrow::F16 => {
                            let h: Vec<half::f16> = row
                                .chunks_exact(2)
                                .map(|b| half::f16::from_le_bytes([b[0], b[1]]))
                                .collect();
                            crate::convert::f16_to_f32(&h, out);
                        }
                        Narrow::BF16 => {
                            let h: Vec<half::bf16> = row
                                .chunks_exact(2)
                                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]))
                                .collect();
                            crate::convert::bf16_to_f32(&h, out);
                        }
                        Narrow::Fp8 { e4m3, scale } => {
                            crate::convert::fp8_to_f32(row, e4m3, scale, out)
                        }
                    }
                }
                // NaN codes in the rows give NaN outputs on both paths.
                let mut o3 = vec![0.0; rows * hd];
                let mut o4 = vec![0.0; rows * hd];
                weighted_sum_portable(&e, sp, rows, &widened, hd, vis, &inv, &mut o3);
                // SAFETY: every row index is inside the cache.
                let ran = unsafe {
                    weighted_sum_narrow(
                        &e,
                        sp,
                        rows,
                        cache.as_ptr(),
                        format,
                        &vrows,
                        hd,
                        vis,
                        &inv,
                        &mut o4,
                    )
                };
                assert_eq!(ran, reads_narrow_values(hd), "hd {hd}");
                if ran {
                    assert!(
                        o3.iter()
                            .zip(&o4)
                            .all(|(x, y)| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan())),
                        "{format:?} hd {hd}"
                    );
                }
            }
        }
    }
}
