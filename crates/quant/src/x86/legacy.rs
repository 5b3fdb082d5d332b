//! AVX2 and AVX-512 VNNI dot products of the 32-element formats (Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0) with Q8_0/Q8_1 activations.
//!
//! These row kernels back only `dot_rows_gemv_with` (tests and benchmarks):
//! their per-element summation order (blocks in 8 lanes, then a horizontal
//! sum) differs from the tiled GEMM's, so `dot_rows` uses the GEMM (or
//! `x86::gemv`, which reproduces its order) at every `m` instead.
//!
//! Scheme: a weight row is processed in groups of 8 blocks, unpacked once
//! and multiplied with every activation row (`vpdpbusd` with VNNI,
//! `vpmaddubsw`+`vpmaddwd` on AVX2). In a full group, blocks j and j+4 are
//! unpacked together (`decode_pair`: first 16 quants of both in one vector,
//! last 16 in another) and the activations are stored in the matching order
//! (`PreparedActs::qs_pair`), so each pair gives one vector whose lanes 0..4
//! and 4..8 hold the two blocks' partial sums, and three `vphaddd` turn the
//! four pair vectors into one vector of the 8 block sums in order. That
//! vector is corrected for the format's offset (-8, -16, or -128 for the
//! unsigned re-biasing of Q8_0 with VNNI), converted to f32 and multiplied by
//! the 8 block scales `d_w * d_y` at once (8 scalar f16 loads and one
//! `vcvtph2ps`, faster than `vpgatherdd` on Zen 4); Q4_1/Q5_1 add
//! `m_w * s_y` per block. A partial last group
//! of 4..7 blocks uses the same steps with masked loads (`group`); 1..3
//! remaining blocks go block by block (`single`). Integer sums per block are
//! exact, so results differ from the scalar reference only in the order of
//! f32 additions.
//!
//! Preconditions (checked in `lib.rs`): `w` holds `n_rows` rows of `nb`
//! blocks; activations hold `m` rows of `nb` blocks (quants, scales, sums);
//! the output indices are in bounds.

use crate::DType;
use crate::acts::PreparedActs;
use crate::gemm::OutMat;
use std::arch::x86_64::*;

pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q5_1: u8 = 3;
pub(super) const Q8_0: u8 = 4;

/// Bytes per block of a format code.
pub(super) const fn bb(f: u8) -> usize {
    match f {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    }
}

/// True for the formats with a min (`x = d*q + m`).
const fn has_min(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

/// The value subtracted from each unpacked quant (as a shift: 8 = 1<<3, ...).
const fn offset_shift<const VNNI: bool>(f: u8) -> i32 {
    match f {
        Q4_0 => 3,
        Q5_0 => 4,
        Q8_0 if VNNI => 7,
        _ => -1,
    }
}

/// Unpacks 16 bytes of nibbles to 32 bytes: low nibbles then high nibbles.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes at p.
    unsafe {
        let t = _mm_loadu_si128(p as *const __m128i);
        let v = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(t), _mm_srli_epi16::<4>(t));
        _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
    }
}

/// 0x10 in each byte whose bit is set in the 32-bit little-endian word at p.
#[inline(always)]
unsafe fn high_bits<const VNNI: bool>(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at p.
    unsafe { high_bits_of::<VNNI>((p as *const u32).read_unaligned()) }
}

/// 0x10 in byte j for every set bit j of `qh`.
#[inline(always)]
unsafe fn high_bits_of<const VNNI: bool>(qh: u32) -> __m256i {
    // SAFETY: VNNI implies avx512bw+vl in the caller; AVX2 otherwise.
    unsafe {
        if VNNI {
            _mm256_maskz_mov_epi8(qh, _mm256_set1_epi8(0x10))
        } else {
            let shuf = _mm256_set_epi64x(
                0x0303030303030303,
                0x0202020202020202,
                0x0101010101010101,
                0,
            );
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), shuf);
            let bit_mask = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
            let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit_mask), _mm256_set1_epi64x(-1));
            _mm256_and_si256(set, _mm256_set1_epi8(0x10))
        }
    }
}

/// The 32 quants of the block at p as bytes ready for `dot8`: unsigned for
/// the 4/5-bit formats; for Q8_0 re-biased to unsigned (+128) with VNNI,
/// signed otherwise (AVX2 uses the sign trick in `dot8`).
#[inline(always)]
pub(super) unsafe fn decode<const F: u8, const VNNI: bool>(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the whole block at p is readable.
    unsafe {
        match F {
            Q4_0 => nibbles(p.add(2)),
            Q4_1 => nibbles(p.add(4)),
            Q5_0 => _mm256_or_si256(nibbles(p.add(6)), high_bits::<VNNI>(p.add(2))),
            Q5_1 => _mm256_or_si256(nibbles(p.add(8)), high_bits::<VNNI>(p.add(4))),
            _ => {
                let q = _mm256_loadu_si256(p.add(2) as *const __m256i);
                if VNNI {
                    _mm256_xor_si256(q, _mm256_set1_epi8(-128))
                } else {
                    q
                }
            }
        }
    }
}

/// The 16 bytes at `off` of `pa` and of `pb` in one vector. A function, not a
/// closure inside [`decode_pair`]: closures are compiled without their
/// caller's target features, so their intrinsics could become calls.
///
/// # Safety
/// AVX2 is enabled in the caller; both ranges are readable.
#[inline(always)]
unsafe fn pair_at(pa: *const u8, pb: *const u8, off: usize) -> __m256i {
    // SAFETY: per the contract.
    unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(pa.add(off) as *const __m128i)),
            _mm_loadu_si128(pb.add(off) as *const __m128i),
        )
    }
}

/// Blocks at `pa` and `pb` unpacked as two vectors: `lo` holds the first 16
/// quants of each (`[a 0..16 | b 0..16]`), `hi` the last 16, in the same
/// encoding as [`decode`].
#[inline(always)]
unsafe fn decode_pair<const F: u8, const VNNI: bool>(
    pa: *const u8,
    pb: *const u8,
) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees both whole blocks are readable.
    unsafe {
        if F == Q8_0 {
            let (lo, hi) = (pair_at(pa, pb, 2), pair_at(pa, pb, 18));
            if VNNI {
                let x = _mm256_set1_epi8(-128);
                (_mm256_xor_si256(lo, x), _mm256_xor_si256(hi, x))
            } else {
                (lo, hi)
            }
        } else {
            let qoff = match F {
                Q4_0 => 2,
                Q4_1 => 4,
                Q5_0 => 6,
                _ => 8,
            };
            let v = pair_at(pa, pb, qoff);
            let m = _mm256_set1_epi8(0x0F);
            let mut lo = _mm256_and_si256(v, m);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
            if F == Q5_0 || F == Q5_1 {
                let hoff = if F == Q5_0 { 2 } else { 4 };
                let qa = (pa.add(hoff) as *const u32).read_unaligned();
                let qb = (pb.add(hoff) as *const u32).read_unaligned();
                lo = _mm256_or_si256(lo, high_bits_of::<VNNI>((qa & 0xFFFF) | (qb << 16)));
                hi = _mm256_or_si256(hi, high_bits_of::<VNNI>((qa >> 16) | (qb & 0xFFFF_0000)));
            }
            (lo, hi)
        }
    }
}

/// Dot of a decoded pair with the matching activation halves: lanes 0..4
/// sum to block a's dot, lanes 4..8 to block b's.
#[inline(always)]
unsafe fn dot_pair<const F: u8, const VNNI: bool>(
    lo: __m256i,
    hi: __m256i,
    ylo: __m256i,
    yhi: __m256i,
) -> __m256i {
    // SAFETY: VNNI is true only in functions compiled with avx512vnni+vl.
    unsafe {
        if VNNI {
            _mm256_dpbusd_epi32(
                _mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, ylo),
                hi,
                yhi,
            )
        } else if F == Q8_0 {
            _mm256_add_epi32(dot8::<F, VNNI>(lo, ylo), dot8::<F, VNNI>(hi, yhi))
        } else {
            // i16 pairs <= 2*31*127 each, so their sum fits i16.
            let s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, ylo), _mm256_maddubs_epi16(hi, yhi));
            _mm256_madd_epi16(s, _mm256_set1_epi16(1))
        }
    }
}

/// A full group of 8 blocks (b0..b0+8) in the paired activation layout.
#[inline(always)]
unsafe fn group_full<const F: u8, const VNNI: bool, const M: usize>(
    w: *const u8,
    b0: usize,
    a: &Acts,
    acc: &mut [__m256; M],
    accm: &mut [__m256; M],
) {
    let bbytes = bb(F);
    // SAFETY: blocks b0..b0+8 of this row and of every activation row are in
    // bounds (caller); the activations of a full group are in the paired layout.
    unsafe {
        let mut lo = [_mm256_setzero_si256(); 4];
        let mut hi = [_mm256_setzero_si256(); 4];
        for j in 0..4 {
            (lo[j], hi[j]) = decode_pair::<F, VNNI>(w.add(j * bbytes), w.add((j + 4) * bbytes));
        }
        let h = |b: usize, o: usize| (w.add(b * bbytes + o) as *const i16).read_unaligned();
        let dw = _mm256_cvtph_ps(_mm_setr_epi16(
            h(0, 0),
            h(1, 0),
            h(2, 0),
            h(3, 0),
            h(4, 0),
            h(5, 0),
            h(6, 0),
            h(7, 0),
        ));
        let mw = if has_min(F) {
            _mm256_cvtph_ps(_mm_setr_epi16(
                h(0, 2),
                h(1, 2),
                h(2, 2),
                h(3, 2),
                h(4, 2),
                h(5, 2),
                h(6, 2),
                h(7, 2),
            ))
        } else {
            _mm256_setzero_ps()
        };
        let sh = offset_shift::<VNNI>(F);
        for i in 0..M {
            let y = a.qs.add(i * a.k + b0 * 32);
            let mut v = [_mm256_setzero_si256(); 4];
            for j in 0..4 {
                let ylo = _mm256_loadu_si256(y.add(64 * j) as *const __m256i);
                let yhi = _mm256_loadu_si256(y.add(64 * j + 32) as *const __m256i);
                v[j] = dot_pair::<F, VNNI>(lo[j], hi[j], ylo, yhi);
            }
            // [b0 b1 b2 b3 | b4 b5 b6 b7]
            let mut s =
                _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
            let row = i * a.nb + b0;
            if sh >= 0 {
                let is = _mm256_loadu_si256(a.isum.add(row) as *const __m256i);
                s = _mm256_sub_epi32(s, _mm256_sllv_epi32(is, _mm256_set1_epi32(sh)));
            }
            let dy = _mm256_loadu_ps(a.d.add(row));
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dy), acc[i]);
            if has_min(F) {
                accm[i] = _mm256_fmadd_ps(mw, _mm256_loadu_ps(a.s.add(row)), accm[i]);
            }
        }
    }
}

/// 8 i32 lanes whose sum is Σ w_j * y_j over the block.
#[inline(always)]
pub(super) unsafe fn dot8<const F: u8, const VNNI: bool>(w: __m256i, y: __m256i) -> __m256i {
    // SAFETY: VNNI is true only in functions compiled with avx512vnni+vl.
    unsafe {
        if VNNI {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, y)
        } else {
            let (a, b) = if F == Q8_0 {
                (_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w))
            } else {
                (w, y)
            };
            _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
        }
    }
}

/// Lane b = sum of the 8 lanes of p[b].
#[inline(always)]
pub(super) unsafe fn reduce8(p: &[__m256i; 8]) -> __m256i {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let h01 = _mm256_hadd_epi32(p[0], p[1]);
        let h23 = _mm256_hadd_epi32(p[2], p[3]);
        let h45 = _mm256_hadd_epi32(p[4], p[5]);
        let h67 = _mm256_hadd_epi32(p[6], p[7]);
        let a = _mm256_hadd_epi32(h01, h23);
        let b = _mm256_hadd_epi32(h45, h67);
        let lo = _mm256_permute2x128_si256::<0x20>(a, b);
        let hi = _mm256_permute2x128_si256::<0x31>(a, b);
        _mm256_add_epi32(lo, hi)
    }
}

/// Low 16 bits of each of 8 i32 lanes, packed.
#[inline(always)]
unsafe fn low16<const VNNI: bool>(v: __m256i) -> __m128i {
    // SAFETY: VNNI implies avx512vl+bw in the caller.
    unsafe {
        if VNNI {
            _mm256_cvtepi32_epi16(v)
        } else {
            let masked = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF));
            let packed = _mm256_packus_epi32(masked, masked);
            _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
        }
    }
}

/// Mask vector with the first n of 8 i32 lanes set.
#[inline(always)]
unsafe fn lane_mask(n: usize) -> __m256i {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), idx)
    }
}

/// Raw views of the activations: row i's quants at `qs + i*k` (the paired
/// layout of `PreparedActs::qs_pair`), per-block
/// values at `d/s/isum + i*nb`.
struct Acts {
    qs: *const i8,
    d: *const f32,
    s: *const f32,
    isum: *const i32,
    k: usize,
    nb: usize,
}

/// Processes a partial group: blocks `b0..b0+n` (n < 8) of one weight row
/// starting at `w` (pointing at block b0) for M activation rows, in the
/// natural activation layout (the tail of `PreparedActs::qs_pair`).
#[inline(always)]
unsafe fn group<const F: u8, const VNNI: bool, const M: usize>(
    w: *const u8,
    b0: usize,
    n: usize,
    a: &Acts,
    acc: &mut [__m256; M],
    accm: &mut [__m256; M],
) {
    let bbytes = bb(F);
    // SAFETY: blocks b0..b0+n of this row and of every activation row are in
    // bounds (caller); lanes >= n are neither read (masked loads and gathers,
    // skipped decodes) nor contribute (their sums and scales are zero).
    unsafe {
        let mut wq = [_mm256_setzero_si256(); 8];
        for (b, q) in wq.iter_mut().enumerate() {
            if b < n {
                *q = decode::<F, VNNI>(w.add(b * bbytes));
            }
        }
        let offs = _mm256_mullo_epi32(
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            _mm256_set1_epi32(bbytes as i32),
        );
        let mask = lane_mask(n);
        let g =
            _mm256_mask_i32gather_epi32::<1>(_mm256_setzero_si256(), w as *const i32, offs, mask);
        let dw = _mm256_cvtph_ps(low16::<VNNI>(g));
        let mw = if has_min(F) {
            _mm256_cvtph_ps(low16::<VNNI>(_mm256_srli_epi32::<16>(g)))
        } else {
            _mm256_setzero_ps()
        };
        for i in 0..M {
            let y = a.qs.add(i * a.k + b0 * 32);
            let mut p = [_mm256_setzero_si256(); 8];
            for b in 0..8 {
                if b < n {
                    let yv = _mm256_loadu_si256(y.add(b * 32) as *const __m256i);
                    p[b] = dot8::<F, VNNI>(wq[b], yv);
                }
            }
            let mut s = reduce8(&p);
            let row = i * a.nb + b0;
            let sh = offset_shift::<VNNI>(F);
            if sh >= 0 {
                let is = _mm256_maskload_epi32(a.isum.add(row), mask);
                s = _mm256_sub_epi32(s, _mm256_sllv_epi32(is, _mm256_set1_epi32(sh)));
            }
            let dy = _mm256_maskload_ps(a.d.add(row), mask);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(dw, dy), acc[i]);
            if has_min(F) {
                let sy = _mm256_maskload_ps(a.s.add(row), mask);
                accm[i] = _mm256_fmadd_ps(mw, sy, accm[i]);
            }
        }
    }
}

/// One block (index `b`) of one weight row at `w` for M activation rows,
/// without the 8-block machinery: used for short tails (< 4 blocks), where a
/// padded group would cost nearly as much as a full one. The min term goes to
/// `extra`.
#[inline(always)]
unsafe fn single<const F: u8, const VNNI: bool, const M: usize>(
    w: *const u8,
    b: usize,
    a: &Acts,
    acc: &mut [__m256; M],
    extra: &mut [f32; M],
) {
    // SAFETY: block b of this row and of every activation row is in bounds (caller).
    unsafe {
        let wq = decode::<F, VNNI>(w);
        let dw = half::f16::from_bits((w as *const u16).read_unaligned()).to_f32();
        let sh = offset_shift::<VNNI>(F);
        for i in 0..M {
            let yv = _mm256_loadu_si256(a.qs.add(i * a.k + b * 32) as *const __m256i);
            let mut p = dot8::<F, VNNI>(wq, yv);
            let row = i * a.nb + b;
            if sh >= 0 {
                let corr = *a.isum.add(row) << sh;
                p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(corr)));
            }
            let dy = *a.d.add(row);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * dy), acc[i]);
            if has_min(F) {
                let mw = half::f16::from_bits((w.add(2) as *const u16).read_unaligned()).to_f32();
                extra[i] += mw * *a.s.add(row);
            }
        }
    }
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

#[inline(always)]
unsafe fn rows<const F: u8, const VNNI: bool, const M: usize>(
    w: &[u8],
    n_rows: usize,
    a: &Acts,
    out: OutMat,
) {
    let nb = a.nb;
    let rb = nb * bb(F);
    for r in 0..n_rows {
        // SAFETY: row r spans w[r*rb..(r+1)*rb]; groups stay within it.
        unsafe {
            let wr = w.as_ptr().add(r * rb);
            let mut acc = [_mm256_setzero_ps(); M];
            let mut accm = [_mm256_setzero_ps(); M];
            let mut b0 = 0;
            while b0 + 8 <= nb {
                group_full::<F, VNNI, M>(wr.add(b0 * bb(F)), b0, a, &mut acc, &mut accm);
                b0 += 8;
            }
            let mut extra = [0.0f32; M];
            if nb - b0 >= 4 {
                group::<F, VNNI, M>(wr.add(b0 * bb(F)), b0, nb - b0, a, &mut acc, &mut accm);
            } else {
                for b in b0..nb {
                    single::<F, VNNI, M>(wr.add(b * bb(F)), b, a, &mut acc, &mut extra);
                }
            }
            for i in 0..M {
                let v = if has_min(F) {
                    _mm256_add_ps(acc[i], accm[i])
                } else {
                    acc[i]
                };
                out.set(i, r, hsum(v) + extra[i]);
            }
        }
    }
}

row_entries!();

/// Activation rows per pass over the weights.
const MAXM: usize = 8;

/// Dot products of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights; returns false for other dtypes.
///
/// # Safety
/// The CPU must have AVX2+FMA+F16C, plus AVX-512 F/BW/VL/DQ/VNNI when
/// `avx512`; lengths must satisfy the module preconditions.
#[allow(clippy::too_many_arguments)]
pub unsafe fn dot_rows(
    avx512: bool,
    dtype: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    acts: &PreparedActs,
    out: OutMat,
) -> bool {
    let tab: [RowsFn; MAXM] = match (avx512, dtype) {
        (true, DType::Q4_0) => rows_table!(rows_avx512, Q4_0),
        (true, DType::Q4_1) => rows_table!(rows_avx512, Q4_1),
        (true, DType::Q5_0) => rows_table!(rows_avx512, Q5_0),
        (true, DType::Q5_1) => rows_table!(rows_avx512, Q5_1),
        (true, DType::Q8_0) => rows_table!(rows_avx512, Q8_0),
        (false, DType::Q4_0) => rows_table!(rows_avx2, Q4_0),
        (false, DType::Q4_1) => rows_table!(rows_avx2, Q4_1),
        (false, DType::Q5_0) => rows_table!(rows_avx2, Q5_0),
        (false, DType::Q5_1) => rows_table!(rows_avx2, Q5_1),
        (false, DType::Q8_0) => rows_table!(rows_avx2, Q8_0),
        _ => return false,
    };
    let nb = k / 32;
    let m = acts.m;
    let pairs = acts.pairs();
    let mut i0 = 0;
    while i0 < m {
        let mm = (m - i0).min(MAXM);
        let a = Acts {
            qs: pairs[i0 * k..].as_ptr(),
            d: acts.d[i0 * nb..].as_ptr(),
            s: acts.s[i0 * nb..].as_ptr(),
            isum: acts.isum[i0 * nb..].as_ptr(),
            k,
            nb,
        };
        // SAFETY: features per this function's contract; `a` views rows
        // i0..i0+mm, and rows i0..i0+mm of `out` hold n_rows columns.
        unsafe { tab[mm - 1](w, n_rows, &a, out.starting_at(i0)) };
        i0 += mm;
    }
    true
}
