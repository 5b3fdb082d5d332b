//! AVX2 and AVX-512 GEMV for float weights (F32, F16, BF16) with f32 activations.
//!
//! Each weight row is read once for up to [`MAXM`] activation rows: the row
//! is converted to f32 one vector at a time and multiplied into `M`
//! accumulator vectors (FMA in lanes, reduced at the end of the row).
//! Preconditions (checked by `lib.rs` before any call): `w` holds `n_rows`
//! rows of `k` elements, `x` holds `m` rows of `k` f32, and
//! the output view holds `m` rows of `n_rows` columns.

use crate::DType;
use crate::gemm::OutMat;
use std::arch::x86_64::*;

/// Activation rows handled per pass over the weights.
pub const MAXM: usize = 8;

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;

fn code(dtype: DType) -> u8 {
    match dtype {
        DType::F16 => F16,
        DType::BF16 => BF16,
        _ => F32,
    }
}

/// Element size in bytes for a dtype code.
const fn esize(dt: u8) -> usize {
    if dt == F32 { 4 } else { 2 }
}

// ---------------------------------------------------------------- AVX-512

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn load16<const DT: u8>(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 16 elements are readable at `p`.
    unsafe {
        match DT {
            F32 => _mm512_loadu_ps(p as *const f32),
            F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_loadu_si256(p as *const __m256i),
            ))),
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn load16_masked<const DT: u8>(p: *const u8, mask: u16) -> __m512 {
    // SAFETY: masked-off lanes are not accessed (AVX-512 fault suppression);
    // the caller guarantees the unmasked elements are readable.
    unsafe {
        match DT {
            F32 => _mm512_maskz_loadu_ps(mask, p as *const f32),
            F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p as *const i16)),
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(mask, p as *const i16),
            ))),
        }
    }
}

/// Dot of one weight row (`k` elements at `w`) with `M` activation rows
/// (`x + i*k`), using `U` independent accumulators per activation row.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn row512<const DT: u8, const M: usize, const U: usize>(
    w: *const u8,
    x: *const f32,
    k: usize,
) -> [f32; M] {
    let es = esize(DT);
    let mut acc = [[_mm512_setzero_ps(); U]; M];
    let mut j = 0;
    // SAFETY: every load below reads elements j..j+16 (or masked lanes < k)
    // of a row of k elements, which the caller guarantees are in bounds.
    unsafe {
        while j + 16 * U <= k {
            for u in 0..U {
                let wv = load16::<DT>(w.add((j + 16 * u) * es));
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = _mm512_loadu_ps(x.add(i * k + j + 16 * u));
                    a[u] = _mm512_fmadd_ps(wv, xv, a[u]);
                }
            }
            j += 16 * U;
        }
        while j + 16 <= k {
            let wv = load16::<DT>(w.add(j * es));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_loadu_ps(x.add(i * k + j));
                a[0] = _mm512_fmadd_ps(wv, xv, a[0]);
            }
            j += 16;
        }
        if j < k {
            let mask: u16 = ((1u32 << (k - j)) - 1) as u16;
            let wv = load16_masked::<DT>(w.add(j * es), mask);
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm512_maskz_loadu_ps(mask, x.add(i * k + j));
                a[0] = _mm512_fmadd_ps(wv, xv, a[0]);
            }
        }
    }
    let mut res = [0.0f32; M];
    for (r, a) in res.iter_mut().zip(acc.iter()) {
        let mut s = a[0];
        for v in a.iter().skip(1) {
            s = _mm512_add_ps(s, *v);
        }
        *r = _mm512_reduce_add_ps(s);
    }
    res
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn rows512<const DT: u8, const M: usize, const U: usize>(
    w: &[u8],
    n_rows: usize,
    k: usize,
    x: &[f32],
    out: OutMat,
) {
    let rb = k * esize(DT);
    for r in 0..n_rows {
        // SAFETY: row r spans w[r*rb..(r+1)*rb] and x holds M rows of k
        // (both checked by the caller).
        let res = unsafe { row512::<DT, M, U>(w.as_ptr().add(r * rb), x.as_ptr(), k) };
        for (i, v) in res.iter().enumerate() {
            // SAFETY: i < M rows and r < n_rows columns of `out` (caller).
            unsafe { out.set(i, r, *v) };
        }
    }
}

// ---------------------------------------------------------------- AVX2

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load8<const DT: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 elements are readable at `p`.
    unsafe {
        match DT {
            F32 => _mm256_loadu_ps(p as *const f32),
            F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p as *const __m128i),
            ))),
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum256(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row256<const DT: u8, const M: usize, const U: usize>(
    w: *const u8,
    x: *const f32,
    k: usize,
) -> [f32; M] {
    let es = esize(DT);
    let mut acc = [[_mm256_setzero_ps(); U]; M];
    let mut j = 0;
    // SAFETY: every load reads elements j..j+8 < k of a row of k elements.
    unsafe {
        while j + 8 * U <= k {
            for u in 0..U {
                let wv = load8::<DT>(w.add((j + 8 * u) * es));
                for (i, a) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(i * k + j + 8 * u));
                    a[u] = _mm256_fmadd_ps(wv, xv, a[u]);
                }
            }
            j += 8 * U;
        }
        while j + 8 <= k {
            let wv = load8::<DT>(w.add(j * es));
            for (i, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_loadu_ps(x.add(i * k + j));
                a[0] = _mm256_fmadd_ps(wv, xv, a[0]);
            }
            j += 8;
        }
    }
    let mut res = [0.0f32; M];
    for (r, a) in res.iter_mut().zip(acc.iter()) {
        let mut s = a[0];
        for v in a.iter().skip(1) {
            s = _mm256_add_ps(s, *v);
        }
        *r = hsum256(s);
    }
    if j < k {
        for (i, r) in res.iter_mut().enumerate() {
            let mut t = 0.0f32;
            for jj in j..k {
                // SAFETY: jj < k, within the row and the activation row.
                let (wv, xv) = unsafe { (load_one::<DT>(w, jj), *x.add(i * k + jj)) };
                t += wv * xv;
            }
            *r += t;
        }
    }
    res
}

#[inline(always)]
unsafe fn load_one<const DT: u8>(w: *const u8, j: usize) -> f32 {
    // SAFETY: the caller guarantees element j is in bounds.
    unsafe {
        match DT {
            F32 => (w.add(4 * j) as *const f32).read_unaligned(),
            F16 => half::f16::from_bits((w.add(2 * j) as *const u16).read_unaligned()).to_f32(),
            _ => f32::from_bits(((w.add(2 * j) as *const u16).read_unaligned() as u32) << 16),
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows256<const DT: u8, const M: usize, const U: usize>(
    w: &[u8],
    n_rows: usize,
    k: usize,
    x: &[f32],
    out: OutMat,
) {
    let rb = k * esize(DT);
    for r in 0..n_rows {
        // SAFETY: row r spans w[r*rb..(r+1)*rb]; x holds M rows of k.
        let res = unsafe { row256::<DT, M, U>(w.as_ptr().add(r * rb), x.as_ptr(), k) };
        for (i, v) in res.iter().enumerate() {
            // SAFETY: i < M rows and r < n_rows columns of `out` (caller).
            unsafe { out.set(i, r, *v) };
        }
    }
}

// ---------------------------------------------------------------- dispatch

type RowsFn = unsafe fn(&[u8], usize, usize, &[f32], OutMat);

macro_rules! table {
    ($f:ident, $dt:expr) => {
        [
            $f::<$dt, 1, 4> as RowsFn,
            $f::<$dt, 2, 2>,
            $f::<$dt, 3, 2>,
            $f::<$dt, 4, 1>,
            $f::<$dt, 5, 1>,
            $f::<$dt, 6, 1>,
            $f::<$dt, 7, 1>,
            $f::<$dt, 8, 1>,
        ]
    };
}

/// GEMV over float weights.
///
/// # Safety
/// The CPU must support the features of `avx512` (AVX-512 F/BW/VL/DQ) or
/// AVX2+FMA+F16C otherwise; lengths must satisfy the module preconditions.
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_rows(
    avx512: bool,
    dtype: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: OutMat,
) {
    let dt = code(dtype);
    let tab: [RowsFn; MAXM] = match (avx512, dt) {
        (true, F32) => table!(rows512, F32),
        (true, F16) => table!(rows512, F16),
        (true, _) => table!(rows512, BF16),
        (false, F32) => table!(rows256, F32),
        (false, F16) => table!(rows256, F16),
        (false, _) => table!(rows256, BF16),
    };
    let mut i0 = 0;
    while i0 < m {
        let mm = (m - i0).min(MAXM);
        let xs = &x[i0 * k..(i0 + mm) * k];
        // SAFETY: features per this function's contract; xs holds mm rows
        // of k, and rows i0..i0+mm of `out` hold n_rows columns.
        unsafe { tab[mm - 1](w, n_rows, k, xs, out.starting_at(i0)) };
        i0 += mm;
    }
}
