//! The AVX2 micro-kernel of the tiled GEMM (`crate::gemm` describes the
//! panel layout and the numerics; `x86::gemm` drives it).
//!
//! One call of [`tile`] computes an `MR x 16` tile: `MR` activation rows
//! (4, or 2 for the 5-bit formats, see [`rows`]) against one 16-row half `g`
//! of a packed panel (two 8-lane vectors), over `nblk` blocks. Per block and step `s` (4 quants), two aligned weight loads serve
//! all `MR` rows; each row broadcasts its 4-byte activation word and adds two
//! `vpmaddubsw` products to i16 sums, which are widened to i32 with
//! `vpmaddwd` by ones after `group` steps (4-bit quants: 8 steps,
//! 8 * 2 * 15 * 127 < 2^15; 5-bit: 4; Q8_0, via the `vpsignb` trick, 1).
//!
//! Scheduling. After every step an empty `asm!` takes the i16 sums through
//! registers. It emits no instruction; it keeps LLVM from reassociating the
//! integer sums across steps and hoisting every step's loads at once, which
//! made it spill weight vectors and accumulators to the stack (the previous
//! kernel ran at about a third of `vpmaddubsw`'s peak on Zen 2, this one
//! at about half). The
//! integer sums are exact, so grouping never changes a result.
//!
//! Numerics (unchanged from the kernel this replaces, and reproduced by
//! `x86::gemv`): per output element and block, `f = fma(f32(sum), d_w * d_a,
//! f)`, then for formats with a min `f = fma(m_w, s_a, f)`; `f` starts at 0
//! for each chunk, and the first chunk stores while later chunks add to the
//! output.

use super::gemm::Acts;
use crate::gemm::{NR, OutMat, Panel, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QB, bias_shift, has_min};
use std::arch::asm;
use std::arch::x86_64::*;

/// All `m` activation rows against half `g` of the panel, in tiles of 4
/// rows (2 for the 5-bit formats, whose i16 and i32 sums both stay live over
/// 4 steps and would not fit the 16 registers at 4 rows); see [`tile`] for
/// the arguments.
///
/// # Safety
/// As [`tile`], for `m` activation and output rows.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows<const F: u8>(
    p: *const Panel,
    g: usize,
    nblk: usize,
    a: Acts,
    out: OutMat,
    m: usize,
    ncols: usize,
    add: bool,
) {
    // SAFETY: per this function's contract.
    unsafe {
        if F == Q5_0 || F == Q5_1 {
            rows_by::<F, 2>(p, g, nblk, a, out, m, ncols, add)
        } else {
            rows_by::<F, 4>(p, g, nblk, a, out, m, ncols, add)
        }
    }
}

/// [`rows`] in tiles of `MR` rows (at most 4), then one tile of the rest.
///
/// # Safety
/// As [`rows`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn rows_by<const F: u8, const MR: usize>(
    p: *const Panel,
    g: usize,
    nblk: usize,
    a: Acts,
    out: OutMat,
    m: usize,
    ncols: usize,
    add: bool,
) {
    // SAFETY: every tile's rows are below m.
    unsafe {
        let mut i0 = 0;
        while i0 + MR <= m {
            tile::<F, MR>(p, g, nblk, a.row(i0), out.starting_at(i0), ncols, add);
            i0 += MR;
        }
        let (a, o) = (a.row(i0), out.starting_at(i0));
        match m - i0 {
            1 => tile::<F, 1>(p, g, nblk, a, o, ncols, add),
            2 => tile::<F, 2>(p, g, nblk, a, o, ncols, add),
            3 => tile::<F, 3>(p, g, nblk, a, o, ncols, add),
            _ => {}
        }
    }
}

/// Steps whose `vpmaddubsw` products are summed in i16 before widening.
const fn group(f: u8) -> usize {
    match f {
        Q4_0 | Q4_1 => 8,
        Q8_0 => 1,
        _ => 4,
    }
}

/// Passes the tile's i16 sums through registers (no instruction): a
/// scheduling fence, see the module documentation.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn fence<const MR: usize>(h: &mut [[__m256i; 2]; MR]) {
    for hr in h.iter_mut() {
        for v in hr.iter_mut() {
            // SAFETY: an empty template; the operand stays in its register.
            unsafe {
                asm!(
                    "/* {0} */",
                    inout(ymm_reg) * v,
                    options(pure, nomem, nostack, preserves_flags)
                )
            };
        }
    }
}

/// One `MR x 16` tile (half `g` of the panel) over `nblk` packed blocks:
/// stores its results to `out` (columns `< ncols`), or adds them when `add`.
///
/// # Safety
/// The CPU must have AVX2+FMA; the panel holds `nblk` packed blocks; the
/// activations hold `MR` rows of `nblk` blocks from `a`; `out` points at
/// column `16*g` of the panel and holds `MR` rows of `ncols` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tile<const F: u8, const MR: usize>(
    p: *const Panel,
    g: usize,
    nblk: usize,
    a: Acts,
    out: OutMat,
    ncols: usize,
    add: bool,
) {
    // SAFETY: per the contract; every offset stays within the panel's
    // `nblk` blocks, the activation rows and the output rows.
    unsafe {
        let pq = (std::ptr::addr_of!((*p).q) as *const u8).add(g * 64);
        let pd = (std::ptr::addr_of!((*p).d) as *const f32).add(g * 16);
        let pm = (std::ptr::addr_of!((*p).m) as *const f32).add(g * 16);
        let ones = _mm256_set1_epi16(1);
        let mut f = [[_mm256_setzero_ps(); 2]; MR];
        for b in 0..nblk {
            let mut acc = [[_mm256_setzero_si256(); 2]; MR];
            if let Some(sh) = bias_shift(F, false) {
                for (r, ar) in acc.iter_mut().enumerate() {
                    let v = _mm256_set1_epi32(-(*a.isum.add(r * a.nb + b) << sh));
                    *ar = [v, v];
                }
            }
            let q = pq.add(b * QB);
            let y = |r: usize, s: usize| {
                _mm256_set1_epi32(
                    (a.qs.add(r * a.k + b * 32 + 4 * s) as *const i32).read_unaligned(),
                )
            };
            let mut s0 = 0;
            while s0 < 8 {
                let mut h = [[_mm256_setzero_si256(); 2]; MR];
                for s in s0..s0 + group(F) {
                    let w = [
                        _mm256_load_si256(q.add(s * 128) as *const __m256i),
                        _mm256_load_si256(q.add(s * 128 + 32) as *const __m256i),
                    ];
                    if F == Q8_0 {
                        // |w| (0..=128 as u8) times sign(w) * a: the pair sums
                        // stay within i16 for one step.
                        let wa = [_mm256_sign_epi8(w[0], w[0]), _mm256_sign_epi8(w[1], w[1])];
                        for (r, hr) in h.iter_mut().enumerate() {
                            let av = y(r, s);
                            for c in 0..2 {
                                hr[c] = _mm256_maddubs_epi16(wa[c], _mm256_sign_epi8(av, w[c]));
                            }
                        }
                    } else {
                        for (r, hr) in h.iter_mut().enumerate() {
                            let av = y(r, s);
                            for c in 0..2 {
                                hr[c] = _mm256_add_epi16(hr[c], _mm256_maddubs_epi16(w[c], av));
                            }
                        }
                    }
                    fence(&mut h);
                }
                for (ar, hr) in acc.iter_mut().zip(&h) {
                    for c in 0..2 {
                        ar[c] = _mm256_add_epi32(ar[c], _mm256_madd_epi16(hr[c], ones));
                    }
                }
                s0 += group(F);
            }
            let dw = [
                _mm256_loadu_ps(pd.add(b * NR)),
                _mm256_loadu_ps(pd.add(b * NR + 8)),
            ];
            for (r, fr) in f.iter_mut().enumerate() {
                let da = _mm256_set1_ps(*a.d.add(r * a.nb + b));
                for c in 0..2 {
                    let sc = _mm256_mul_ps(dw[c], da);
                    fr[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r][c]), sc, fr[c]);
                }
            }
            if has_min(F) {
                let mw = [
                    _mm256_loadu_ps(pm.add(b * NR)),
                    _mm256_loadu_ps(pm.add(b * NR + 8)),
                ];
                for (r, fr) in f.iter_mut().enumerate() {
                    let sa = _mm256_set1_ps(*a.s.add(r * a.nb + b));
                    for c in 0..2 {
                        fr[c] = _mm256_fmadd_ps(mw[c], sa, fr[c]);
                    }
                }
            }
        }
        store(&f, out, ncols, add);
    }
}

/// Writes (or, when `add`, adds) an `MR x 16` tile to `out`, columns
/// `< ncols` only: whole vectors with plain loads and stores (a masked
/// store of 8 lanes is microcoded and slow on AMD cores), the partial
/// vector masked.
///
/// # Safety
/// AVX2; `out` holds `MR` rows of `ncols` columns.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn store<const MR: usize>(f: &[[__m256; 2]; MR], out: OutMat, ncols: usize, add: bool) {
    let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    // SAFETY: per the contract, only columns below ncols are touched.
    unsafe {
        for (r, fr) in f.iter().enumerate() {
            for (c, v) in fr.iter().enumerate() {
                let lanes = ncols.saturating_sub(8 * c).min(8);
                let o = out.ptr.add(r * out.stride + 8 * c);
                if lanes == 8 {
                    let v = if add {
                        _mm256_add_ps(*v, _mm256_loadu_ps(o))
                    } else {
                        *v
                    };
                    _mm256_storeu_ps(o, v);
                } else if lanes > 0 {
                    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(lanes as i32), idx);
                    let v = if add {
                        _mm256_add_ps(*v, _mm256_maskload_ps(o, mask))
                    } else {
                        *v
                    };
                    _mm256_maskstore_ps(o, mask, v);
                }
            }
        }
    }
}
