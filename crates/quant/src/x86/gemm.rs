//! AVX-512 VNNI and AVX2 kernels of the tiled GEMM (`crate::gemm` describes
//! the panel layout and the numerics).
//!
//! Driver ([`gemm`]): for each panel of 32 weight rows and each chunk of at
//! most `KC_BLOCKS` blocks, pack the panel (AVX-512: 16 rows at a time with
//! 128-bit inserts and an in-lane 4x4 dword transpose; AVX2: 8 rows at a
//! time in `x86::pack_avx2`), then run the micro-kernel over the activation rows in tiles of
//! `MR` rows. The first chunk stores its results, later chunks add to them.
//!
//! Micro-kernels: VNNI keeps a `4 x 32` tile (`MR` x two 16-lane vectors) of
//! i32 block sums and f32 accumulators in registers; per block and step,
//! two weight vectors and `MR` broadcast activation words give `2*MR`
//! `vpdpbusd`. AVX2 (`x86::tile_avx2`) works on one 16-row half of the panel
//! (two 8-lane vectors) for 4 (5-bit formats: 2) rows with `vpmaddubsw`.
//!
//! Preconditions (checked in `lib.rs`): `w` holds `n_rows` rows of `nb`
//! blocks; the activations hold `m` rows of `nb` blocks in the natural layout
//! (`PreparedActs::qs`) with scales, sums and (Q8_1) `s`; the output view is
//! valid for `m` rows of `n_rows` columns.

use super::pack_avx2::pack_avx2;
use super::tile_avx2;
use crate::acts::PreparedActs;
use crate::gemm::{
    KC_BLOCKS, NR, OutMat, Panel, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QB, bias_shift, block_bytes,
    fmt_of, has_min, pack_portable,
};
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

/// Raw views of the activations at block `kb0` of the current chunk: row
/// `i`'s quants of chunk block `b` at `qs + i*k + b*32`, its scale, `s` and
/// quant sum at `d/s/isum + i*nb + b`.
#[derive(Clone, Copy)]
pub(super) struct Acts {
    pub qs: *const i8,
    pub d: *const f32,
    pub s: *const f32,
    pub isum: *const i32,
    pub k: usize,
    pub nb: usize,
}

impl Acts {
    /// The view at activation row `i0`.
    ///
    /// # Safety
    /// Row `i0` must exist.
    #[inline(always)]
    pub(super) unsafe fn row(self, i0: usize) -> Self {
        // SAFETY: per the contract.
        unsafe {
            Self {
                qs: self.qs.add(i0 * self.k),
                d: self.d.add(i0 * self.nb),
                s: self.s.add(i0 * self.nb),
                isum: self.isum.add(i0 * self.nb),
                ..self
            }
        }
    }
}

/// Dword `s` (bytes `off + 4s..off + 4s + 4`) of the 16 rows, `s` in 0..4,
/// in natural row order: `Z_j` holds rows `j, j+4, j+8, j+12` in its 128-bit
/// lanes, then a 4x4 dword transpose within lanes.
///
/// A function rather than a closure: a closure is compiled on its own,
/// without its caller's target features, and its intrinsics become calls
/// unless the optimizer happens to inline it (a build where it did not ran
/// the 16-row GEMM 2.7x and batch-1 decode 4x slower).
///
/// # Safety
/// AVX-512 F is enabled in the caller; 16 bytes at `off` of every row are
/// readable.
#[inline(always)]
unsafe fn transpose16(rows: &[*const u8; 16], off: usize) -> [__m512i; 4] {
    // SAFETY: per the contract.
    unsafe {
        let mut z = [_mm512_setzero_si512(); 4];
        for (j, zj) in z.iter_mut().enumerate() {
            let ld = |l: usize| rows[l].add(off) as *const __m128i;
            let v = _mm512_castsi128_si512(_mm_loadu_si128(ld(j)));
            let v = _mm512_inserti32x4::<1>(v, _mm_loadu_si128(ld(j + 4)));
            let v = _mm512_inserti32x4::<2>(v, _mm_loadu_si128(ld(j + 8)));
            *zj = _mm512_inserti32x4::<3>(v, _mm_loadu_si128(ld(j + 12)));
        }
        let t0 = _mm512_unpacklo_epi32(z[0], z[1]);
        let t1 = _mm512_unpackhi_epi32(z[0], z[1]);
        let t2 = _mm512_unpacklo_epi32(z[2], z[3]);
        let t3 = _mm512_unpackhi_epi32(z[2], z[3]);
        [
            _mm512_unpacklo_epi64(t0, t2),
            _mm512_unpackhi_epi64(t0, t2),
            _mm512_unpacklo_epi64(t1, t3),
            _mm512_unpackhi_epi64(t1, t3),
        ]
    }
}

/// Packs one block of 16 rows with AVX-512 (row l's block at `src + l*rb`;
/// `hidx` holds the byte offsets `l*rb` as i32): quants at `q` (8 steps,
/// stride 128 bytes), scales and mins at `d`/`m` (`m` only for formats with a
/// min).
/// Also prefetches the 16 lines at `pf + l*rb` (the next panel's rows).
#[inline(always)]
unsafe fn pack16_avx512<const F: u8>(
    src: *const u8,
    rb: usize,
    hidx: __m512i,
    pf: *const u8,
    q: *mut u8,
    d: *mut f32,
    m: *mut f32,
) {
    // SAFETY: the 16 blocks at src + l*rb are readable; q/d/m are writable
    // for one block of one 16-row group. Prefetches never fault (the
    // addresses are computed with wrapping arithmetic).
    unsafe {
        for l in 0..16 {
            _mm_prefetch::<_MM_HINT_T1>(pf.wrapping_add(l * rb) as *const i8);
        }
        let rows: [*const u8; 16] = std::array::from_fn(|l| src.add(l * rb));
        let st = |s: usize| q.add(s * 128) as *mut __m512i;
        if F == Q8_0 {
            let x = _mm512_set1_epi8(-128);
            for h in 0..2 {
                let sv = transpose16(&rows, 2 + 16 * h);
                for (j, v) in sv.into_iter().enumerate() {
                    _mm512_store_si512(st(4 * h + j), _mm512_xor_si512(v, x));
                }
            }
        } else {
            let qo = match F {
                Q4_0 => 2,
                Q4_1 => 4,
                Q5_0 => 6,
                _ => 8,
            };
            let sv = transpose16(&rows, qo);
            let lo4 = _mm512_set1_epi8(0x0F);
            let mut steps = [_mm512_setzero_si512(); 8];
            for (j, v) in sv.into_iter().enumerate() {
                steps[j] = _mm512_and_si512(v, lo4);
                steps[j + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), lo4);
            }
            if F == Q5_0 || F == Q5_1 {
                let ho = if F == Q5_0 { 2 } else { 4 };
                let mut qh = [0u32; 16];
                for (l, v) in qh.iter_mut().enumerate() {
                    *v = (rows[l].add(ho) as *const u32).read_unaligned();
                }
                let qhv = _mm512_loadu_si512(qh.as_ptr() as *const __m512i);
                let bit16 = _mm512_set1_epi8(0x10);
                // Byte offsets of the dwords within each 128-bit lane.
                let lane_base = _mm512_set4_epi32(0x0C0C_0C0C, 0x0808_0808, 0x0404_0404, 0);
                for (s, v) in steps.iter_mut().enumerate() {
                    // Every byte of a row's dword takes byte s/2 of its qh;
                    // byte t then tests bit 4*(s%2) + t (element 4s + t).
                    let idx = _mm512_add_epi8(_mm512_set1_epi8((s / 2) as i8), lane_base);
                    let b = _mm512_shuffle_epi8(qhv, idx);
                    let sh = 4 * (s % 2) as u32;
                    let bits = _mm512_set1_epi32(i32::from_le_bytes([
                        1 << sh,
                        1 << (sh + 1),
                        1 << (sh + 2),
                        1 << (sh + 3),
                    ]));
                    let k = _mm512_test_epi8_mask(b, bits);
                    *v = _mm512_or_si512(*v, _mm512_maskz_mov_epi8(k, bit16));
                }
            }
            for (s, v) in steps.into_iter().enumerate() {
                _mm512_store_si512(st(s), v);
            }
        }
        // The 16 block headers (d, and m for Q4_1/Q5_1) in one gather.
        let hdr = _mm512_i32gather_epi32::<1>(hidx, src as *const i32);
        _mm512_storeu_ps(d, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(hdr)));
        if has_min(F) {
            let mv = _mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(hdr));
            _mm512_storeu_ps(m, _mm512_cvtph_ps(mv));
        }
    }
}

/// Packs a full panel (`NR` rows) with AVX-512 (see [`pack_portable`] for
/// the contract) and prefetches the same blocks of the rows at `next`
/// (any address: prefetches do not fault).
#[inline(always)]
unsafe fn pack_avx512<const F: u8>(
    w: &[u8],
    rb: usize,
    kb0: usize,
    nblk: usize,
    next: *const u8,
    p: *mut Panel,
) {
    let bb = block_bytes(F);
    // SAFETY: w holds NR rows of rb bytes whose blocks kb0..kb0+nblk are
    // read (the caller checked w's length); the panel is writable.
    unsafe {
        let pq = std::ptr::addr_of_mut!((*p).q) as *mut u8;
        let pd = std::ptr::addr_of_mut!((*p).d) as *mut f32;
        let pm = std::ptr::addr_of_mut!((*p).m) as *mut f32;
        // 15 * rb fits in i32 (checked by the caller).
        let hidx = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
            _mm512_set1_epi32(rb as i32),
        );
        for g in 0..2 {
            let src = w.as_ptr().add(16 * g * rb + kb0 * bb);
            let pf = next.wrapping_add(16 * g * rb);
            for b in 0..nblk {
                pack16_avx512::<F>(
                    src.add(b * bb),
                    rb,
                    hidx,
                    pf.wrapping_add(b * bb),
                    pq.add(b * QB + g * 64),
                    pd.add(b * NR + 16 * g),
                    pm.add(b * NR + 16 * g),
                );
            }
        }
    }
}

/// One `MR x 32` tile with AVX-512 VNNI over `nblk` packed blocks.
#[inline(always)]
unsafe fn tile512<const F: u8, const MR: usize>(
    p: *const Panel,
    nblk: usize,
    a: Acts,
    out: OutMat,
    ncols: usize,
    add: bool,
) {
    // SAFETY: the panel holds nblk packed blocks; the activations hold MR rows
    // of nblk blocks from `a`; out holds MR rows of ncols columns.
    unsafe {
        let pq = std::ptr::addr_of!((*p).q) as *const u8;
        let pd = std::ptr::addr_of!((*p).d) as *const f32;
        let pm = std::ptr::addr_of!((*p).m) as *const f32;
        let mut f = [[_mm512_setzero_ps(); 2]; MR];
        for b in 0..nblk {
            let mut acc = [[_mm512_setzero_si512(); 2]; MR];
            if let Some(sh) = bias_shift(F, true) {
                for (r, ar) in acc.iter_mut().enumerate() {
                    let v = _mm512_set1_epi32(-(*a.isum.add(r * a.nb + b) << sh));
                    *ar = [v, v];
                }
            }
            let q = pq.add(b * QB);
            for s in 0..8 {
                let w0 = _mm512_load_si512(q.add(s * 128) as *const __m512i);
                let w1 = _mm512_load_si512(q.add(s * 128 + 64) as *const __m512i);
                for (r, ar) in acc.iter_mut().enumerate() {
                    let y = (a.qs.add(r * a.k + b * 32 + 4 * s) as *const i32).read_unaligned();
                    let av = _mm512_set1_epi32(y);
                    ar[0] = _mm512_dpbusd_epi32(ar[0], w0, av);
                    ar[1] = _mm512_dpbusd_epi32(ar[1], w1, av);
                }
            }
            let dw0 = _mm512_load_ps(pd.add(b * NR));
            let dw1 = _mm512_load_ps(pd.add(b * NR + 16));
            for (r, fr) in f.iter_mut().enumerate() {
                let da = _mm512_set1_ps(*a.d.add(r * a.nb + b));
                fr[0] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(dw0, da), fr[0]);
                fr[1] =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(dw1, da), fr[1]);
            }
            if has_min(F) {
                let mw0 = _mm512_load_ps(pm.add(b * NR));
                let mw1 = _mm512_load_ps(pm.add(b * NR + 16));
                for (r, fr) in f.iter_mut().enumerate() {
                    let sa = _mm512_set1_ps(*a.s.add(r * a.nb + b));
                    fr[0] = _mm512_fmadd_ps(mw0, sa, fr[0]);
                    fr[1] = _mm512_fmadd_ps(mw1, sa, fr[1]);
                }
            }
        }
        for (r, fr) in f.iter().enumerate() {
            for (c, v) in fr.iter().enumerate() {
                let lanes = ncols.saturating_sub(16 * c).min(16);
                if lanes == 0 {
                    continue;
                }
                let mask: __mmask16 = if lanes == 16 {
                    0xFFFF
                } else {
                    (1u16 << lanes) - 1
                };
                let o = out.ptr.add(r * out.stride + 16 * c);
                let v = if add {
                    _mm512_add_ps(*v, _mm512_maskz_loadu_ps(mask, o))
                } else {
                    *v
                };
                _mm512_mask_storeu_ps(o, mask, v);
            }
        }
    }
}

/// Largest row size for which the AVX-512 packer's i32 gather offsets
/// (`15 * rb`) cannot overflow.
const GATHER_MAX_RB: usize = (i32::MAX / 16) as usize;

/// Rows of activations per VNNI tile.
const MR512: usize = 4;

/// The driver at one level for one format.
#[inline(always)]
unsafe fn run<const F: u8, const VNNI: bool>(
    w: &[u8],
    n_rows: usize,
    m: usize,
    a: Acts,
    out: OutMat,
) {
    let bb = block_bytes(F);
    let nb = a.nb;
    let rb = nb * bb;
    let mut panel = MaybeUninit::<Panel>::uninit();
    let p = panel.as_mut_ptr();
    let mut r0 = 0;
    while r0 < n_rows {
        let rows = (n_rows - r0).min(NR);
        let wp = &w[r0 * rb..(r0 + rows) * rb];
        let mut kb0 = 0;
        while kb0 < nb {
            let nblk = (nb - kb0).min(KC_BLOCKS);
            let add = kb0 > 0;
            // SAFETY: wp holds `rows` whole rows of nb blocks; the panel is
            // written before it is read; activation rows and output rows
            // stay below m; columns below r0 + rows <= n_rows.
            unsafe {
                let ac = Acts {
                    qs: a.qs.add(kb0 * 32),
                    d: a.d.add(kb0),
                    s: a.s.add(kb0),
                    isum: a.isum.add(kb0),
                    ..a
                };
                let o = OutMat {
                    ptr: out.ptr.add(r0),
                    stride: out.stride,
                };
                // The next unit: the same rows' next chunk, or the next
                // panel's first chunk (its packer prefetches it).
                let next = if kb0 + nblk < nb {
                    wp.as_ptr().wrapping_add((kb0 + nblk) * bb)
                } else {
                    wp.as_ptr().wrapping_add(2 * NR * rb)
                };
                if VNNI {
                    if rows == NR && rb <= GATHER_MAX_RB {
                        pack_avx512::<F>(wp, rb, kb0, nblk, next, p);
                    } else {
                        pack_portable(F, true, wp, rb, rows, kb0, nblk, p);
                    }
                    let mut i0 = 0;
                    while i0 + MR512 <= m {
                        tile512::<F, MR512>(p, nblk, ac.row(i0), o.starting_at(i0), rows, add);
                        i0 += MR512;
                    }
                    match m - i0 {
                        1 => tile512::<F, 1>(p, nblk, ac.row(i0), o.starting_at(i0), rows, add),
                        2 => tile512::<F, 2>(p, nblk, ac.row(i0), o.starting_at(i0), rows, add),
                        3 => tile512::<F, 3>(p, nblk, ac.row(i0), o.starting_at(i0), rows, add),
                        _ => {}
                    }
                } else {
                    pack_avx2::<F>(wp, rb, rows, kb0, nblk, next, p);
                    for g in 0..rows.div_ceil(16) {
                        let og = OutMat {
                            ptr: o.ptr.add(16 * g),
                            stride: o.stride,
                        };
                        let cols = rows - 16 * g;
                        tile_avx2::rows::<F>(p, g, nblk, ac, og, m, cols, add);
                    }
                }
            }
            kb0 += nblk;
        }
        r0 += rows;
    }
}

macro_rules! entry {
    ($name:ident, $vnni:expr, $feat:literal) => {
        #[target_feature(enable = $feat)]
        unsafe fn $name<const F: u8>(w: &[u8], n_rows: usize, m: usize, a: Acts, out: OutMat) {
            // SAFETY: features enabled by this function; bounds per caller.
            unsafe { run::<F, $vnni>(w, n_rows, m, a, out) }
        }
    };
}

entry!(run_avx2, false, "avx2,fma,f16c");
entry!(
    run_avx512,
    true,
    "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni"
);

type RunFn = unsafe fn(&[u8], usize, usize, Acts, OutMat);

/// Tiled GEMM of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights; returns false for other dtypes.
///
/// # Safety
/// The CPU must have AVX2+FMA+F16C, plus AVX-512 F/BW/VL/DQ/VNNI when
/// `avx512`; lengths must satisfy the module preconditions and `out` must be
/// valid for writes of `acts.m` rows of `n_rows` columns that nothing else
/// accesses during the call.
pub(crate) unsafe fn gemm(
    avx512: bool,
    dtype: crate::DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: OutMat,
) -> bool {
    let Some(f) = fmt_of(dtype) else {
        return false;
    };
    let run: RunFn = match (avx512, f) {
        (true, Q4_0) => run_avx512::<Q4_0>,
        (true, Q4_1) => run_avx512::<Q4_1>,
        (true, Q5_0) => run_avx512::<Q5_0>,
        (true, Q5_1) => run_avx512::<Q5_1>,
        (true, _) => run_avx512::<Q8_0>,
        (false, Q4_0) => run_avx2::<Q4_0>,
        (false, Q4_1) => run_avx2::<Q4_1>,
        (false, Q5_0) => run_avx2::<Q5_0>,
        (false, Q5_1) => run_avx2::<Q5_1>,
        (false, _) => run_avx2::<Q8_0>,
    };
    let a = Acts {
        qs: acts.qs.as_ptr(),
        d: acts.d.as_ptr(),
        s: acts.s.as_ptr(),
        isum: acts.isum.as_ptr(),
        k,
        nb: k / 32,
    };
    // SAFETY: per this function's contract.
    unsafe { run(w, n_rows, acts.m, a, out) };
    true
}
