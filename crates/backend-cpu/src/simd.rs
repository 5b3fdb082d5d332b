//! Vector primitives for attention and elementwise kernels, with runtime
//! dispatch between an AVX-512, an AVX2+FMA and a portable implementation.
//!
//! Every function computes the same mathematical result on every path (up to
//! float reassociation in the sums); the portable path is the reference.

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
            if is_x86_feature_detected!("avx512f") {
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
}
