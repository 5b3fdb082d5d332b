//! AVX2 GEMV of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) that
//! computes every output element bit for bit as the AVX2 tiled GEMM
//! (`x86::gemm`, `x86::tile_avx2`) does, without packing the weights: below
//! [`AVX2_GEMM_MIN_M`] activation rows packing costs more than it saves
//! (measured on Zen 2 with the SIMD packer `x86::pack_avx2`: on a 576 x 1536
//! Q4_1 product, one thread, the tiled GEMM takes 41 µs at m = 1 against
//! this GEMV's 45 µs, and 97 against 176 µs at m = 8; for decode, m = 1, this
//! GEMV stays, as its weight prefetching suits weights streamed from memory).
//!
//! Per output `(i, r)` the order is the GEMM's: for each chunk of
//! `KC_BLOCKS` blocks, `f = 0`, then for each block `b` in order the exact
//! integer dot `s` (with the format's offset subtracted as
//! `isum << shift`), `f = fma(f32(s), d_w * d_a, f)` and, for Q4_1/Q5_1,
//! `f = fma(m_w, s_a, f)`; the chunk sums are added in order (`f + total`).
//! Integer sums are exact however they are formed, so computing them here
//! as eight `vpmaddubsw`/`vpmaddwd` partial lanes per weight row, reduced
//! across eight rows at once (`reduce8`, one lane per weight row), gives the
//! GEMM's integers; the float steps are the same instructions on the same
//! values. Lanes are weight rows, so eight rows are decoded per block and
//! shared by every activation row.
//!
//! Weight rows are read eight at a time, a block of each in turn, which the
//! hardware prefetchers follow poorly (eight interleaved streams per
//! thread); so while a group of rows is computed, the next group's bytes
//! (contiguous: rows are adjacent) are prefetched, `ceil(8 * block bytes /
//! 64)` cache lines per block, which covers the group (eight rows of `nb`
//! 20-byte Q4_1 blocks are 2.5 `nb` lines). Prefetching changes no
//! arithmetic.
//!
//! Preconditions (checked in `lib.rs`): `w` holds `n_rows` rows of `k / 32`
//! blocks; the activations hold `m < AVX2_GEMM_MIN_M` rows in the natural
//! layout (`PreparedActs::qs`) with scales, sums and (Q8_1) `s`; the output
//! view is valid for `m` rows of `n_rows` columns.

use super::Prefetch;
use super::legacy::{Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, bb, decode, dot8, reduce8};
use crate::DType;
use crate::acts::PreparedActs;
use crate::gemm::{KC_BLOCKS, OutMat, bias_shift, has_min};
use std::arch::x86_64::*;

/// From this many activation rows the AVX2 level takes the tiled GEMM.
pub(crate) const AVX2_GEMM_MIN_M: usize = 4;

/// Row groups ahead of the one computed whose bytes are prefetched.
const PREFETCH_GROUPS: usize = 1;

/// f16 values at `p + l * stride` for the eight lanes, as f32.
#[inline(always)]
unsafe fn halves(rows: &[*const u8; 8], off: usize) -> __m256 {
    // SAFETY: two bytes are readable at every rows[l] + off (caller).
    unsafe {
        let h = |l: usize| (rows[l].add(off) as *const i16).read_unaligned();
        _mm256_cvtph_ps(_mm_setr_epi16(
            h(0),
            h(1),
            h(2),
            h(3),
            h(4),
            h(5),
            h(6),
            h(7),
        ))
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run<const F: u8>(w: &[u8], n_rows: usize, k: usize, acts: &PreparedActs, out: OutMat) {
    let nb = k / 32;
    let bbytes = bb(F);
    let rb = nb * bbytes;
    // Cache lines of the prefetched group per block.
    let lines = (8 * bbytes).div_ceil(64);
    let m = acts.m;
    let sh = bias_shift(F, false);
    let qs = acts.qs.as_ptr();
    let (ad, asum, ais) = (acts.d.as_ptr(), acts.s.as_ptr(), acts.isum.as_ptr());
    let mut f = [_mm256_setzero_ps(); AVX2_GEMM_MIN_M];
    let mut tot = [_mm256_setzero_ps(); AVX2_GEMM_MIN_M];
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mut r0 = 0;
    while r0 < n_rows {
        let nr = (n_rows - r0).min(8);
        let mut rows = [w.as_ptr(); 8];
        for (l, p) in rows.iter_mut().enumerate() {
            // SAFETY: row r0 + min(l, nr-1) < n_rows exists.
            *p = unsafe { w.as_ptr().add((r0 + l.min(nr - 1)) * rb) };
        }
        // The next group's bytes, prefetched while this group runs.
        let ahead = r0 + 8 * PREFETCH_GROUPS;
        let next = Prefetch {
            base: w.as_ptr().wrapping_add(ahead * rb),
            len: n_rows.saturating_sub(ahead).min(8) * rb,
        };
        let mut kb0 = 0;
        while kb0 < nb {
            let nblk = (nb - kb0).min(KC_BLOCKS);
            for v in f.iter_mut().take(m) {
                *v = _mm256_setzero_ps();
            }
            for b in kb0..kb0 + nblk {
                // SAFETY: block b of every row and of every activation row
                // is in bounds (module preconditions).
                unsafe {
                    next.lines(b * lines * 64, lines * 64);
                    let mut blk = rows;
                    for p in blk.iter_mut() {
                        *p = p.add(b * bbytes);
                    }
                    let mut wq = [_mm256_setzero_si256(); 8];
                    for (q, &p) in wq.iter_mut().zip(&blk) {
                        *q = decode::<F, false>(p);
                    }
                    let dw = halves(&blk, 0);
                    let mw = if has_min(F) {
                        halves(&blk, 2)
                    } else {
                        _mm256_setzero_ps()
                    };
                    for (i, fi) in f.iter_mut().enumerate().take(m) {
                        let y = _mm256_loadu_si256(qs.add(i * k + b * 32) as *const __m256i);
                        let mut p = [_mm256_setzero_si256(); 8];
                        for (pl, &q) in p.iter_mut().zip(&wq) {
                            *pl = dot8::<F, false>(q, y);
                        }
                        let mut s = reduce8(&p);
                        let ab = i * nb + b;
                        if let Some(sh) = sh {
                            s = _mm256_sub_epi32(s, _mm256_set1_epi32(*ais.add(ab) << sh));
                        }
                        let da = _mm256_set1_ps(*ad.add(ab));
                        *fi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, da), *fi);
                        if has_min(F) {
                            *fi = _mm256_fmadd_ps(mw, _mm256_set1_ps(*asum.add(ab)), *fi);
                        }
                    }
                }
            }
            for (t, &v) in tot.iter_mut().zip(&f).take(m) {
                *t = if kb0 == 0 { v } else { _mm256_add_ps(v, *t) };
            }
            kb0 += nblk;
        }
        let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr as i32), idx);
        for (i, t) in tot.iter().enumerate().take(m) {
            // SAFETY: row i, columns r0..r0+nr of the output (contract).
            // (A masked store is microcoded on AMD cores: whole groups
            // take a plain one.)
            unsafe {
                let o = out.ptr.add(i * out.stride + r0);
                if nr == 8 {
                    _mm256_storeu_ps(o, *t);
                } else {
                    _mm256_maskstore_ps(o, mask, *t);
                }
            }
        }
        r0 += nr;
    }
}

/// The GEMM-order GEMV; returns false for other dtypes.
///
/// # Safety
/// The CPU must have AVX2+FMA+F16C; lengths must satisfy the module
/// preconditions (in particular `acts.m < AVX2_GEMM_MIN_M`).
pub(crate) unsafe fn dot_rows(
    dtype: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: OutMat,
) -> bool {
    if acts.m >= AVX2_GEMM_MIN_M {
        return false;
    }
    // SAFETY: per this function's contract.
    unsafe {
        match dtype {
            DType::Q4_0 => run::<Q4_0>(w, n_rows, k, acts, out),
            DType::Q4_1 => run::<Q4_1>(w, n_rows, k, acts, out),
            DType::Q5_0 => run::<Q5_0>(w, n_rows, k, acts, out),
            DType::Q5_1 => run::<Q5_1>(w, n_rows, k, acts, out),
            DType::Q8_0 => run::<Q8_0>(w, n_rows, k, acts, out),
            _ => return false,
        }
    }
    true
}
