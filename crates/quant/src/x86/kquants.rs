//! AVX2 and AVX-512 VNNI dot products of the K formats (Q2_K..Q6_K) with Q8_K
//! activations.
//!
//! Scheme: each 256-element super-block is unpacked once into eight vectors
//! of 32 unsigned bytes (elements 32c..32c+31, in the activations' order),
//! eight matching i16 scale vectors (one scale per 16 or 32 elements) and a
//! vector of 16 per-group correction coefficients. For every activation row,
//! `vpmaddubsw` forms pairwise i16 products, `vpdpwssd` (VNNI) or
//! `vpmaddwd`+add (AVX2) applies the sub-block scales and accumulates in i32;
//! the correction (offsets of Q3_K/Q6_K, mins of Q2_K/Q4_K/Q5_K) is one
//! `vpmaddwd` of the weight coefficients with the activations' `bsums`. One
//! f32 FMA per super-block applies `d_w * d_y`. All integer sums are exact
//! (bounds in the comments), so results differ from the scalar reference only
//! in the order of f32 additions.
//!
//! Preconditions (checked in `lib.rs`): `w` holds `n_rows` rows of `nb`
//! super-blocks; activations hold `m` rows of `nb` Q8_K blocks.

use crate::DType;
use crate::acts::PreparedActs;
use crate::gemm::OutMat;
use std::arch::x86_64::*;

pub(super) const Q2K: u8 = 0;
pub(super) const Q3K: u8 = 1;
pub(super) const Q4K: u8 = 2;
pub(super) const Q5K: u8 = 3;
pub(super) const Q6K: u8 = 4;

pub(super) const fn bb(f: u8) -> usize {
    match f {
        Q2K => 84,
        Q3K => 110,
        Q4K => 144,
        Q5K => 176,
        _ => 210,
    }
}

/// Formats whose correction is a min (`- dmin * m * bsum`) rather than an offset.
const fn has_min(f: u8) -> bool {
    f == Q2K || f == Q4K || f == Q5K
}

#[inline(always)]
unsafe fn rd_f16(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees two readable bytes.
    half::f16::from_bits(unsafe { (p as *const u16).read_unaligned() }).to_f32()
}

/// `vpshufb` masks selecting i16 word 2c in the low lane and 2c+1 in the high lane.
static SCALE_MASKS: [[u8; 32]; 4] = {
    let mut m = [[0u8; 32]; 4];
    let mut c = 0;
    while c < 4 {
        let mut j = 0;
        while j < 16 {
            m[c][j] = (4 * c + (j & 1)) as u8;
            m[c][16 + j] = (4 * c + 2 + (j & 1)) as u8;
            j += 1;
        }
        c += 1;
    }
    m
};

/// Scale vectors for sixteen 16-element groups held as i16 in `s16`:
/// chunk c gets `[s[2c] x8 | s[2c+1] x8]`.
#[inline(always)]
unsafe fn scales16(s16: __m256i, scv: &mut [__m256i; 8]) {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let lo = _mm256_permute2x128_si256::<0x00>(s16, s16);
        let hi = _mm256_permute2x128_si256::<0x11>(s16, s16);
        for c in 0..4 {
            // Low lane: word 2c, high lane: word 2c+1 (shuffles act per lane).
            let mask = _mm256_loadu_si256(SCALE_MASKS[c].as_ptr() as *const __m256i);
            scv[c] = _mm256_shuffle_epi8(lo, mask);
            scv[c + 4] = _mm256_shuffle_epi8(hi, mask);
        }
    }
}

/// The 32 bytes at p.
#[inline(always)]
unsafe fn ld(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

/// Q4_K/Q5_K scales and mins (ggml's `utmp` unpacking of the 12 bytes at p):
/// returns 8 scales then 8 mins as bytes.
#[inline(always)]
unsafe fn k4_scales_mins(p: *const u8) -> __m128i {
    // SAFETY: the caller guarantees 12 readable bytes.
    unsafe {
        let u0 = (p as *const u32).read_unaligned();
        let u1 = (p.add(4) as *const u32).read_unaligned();
        let u2 = (p.add(8) as *const u32).read_unaligned();
        const KM1: u32 = 0x3f3f3f3f;
        const KM2: u32 = 0x0f0f0f0f;
        const KM3: u32 = 0x03030303;
        let t3 = ((u2 >> 4) & KM2) | (((u1 >> 6) & KM3) << 4);
        let t2 = u1 & KM1;
        let t1 = (u2 & KM2) | (((u0 >> 6) & KM3) << 4);
        let t0 = u0 & KM1;
        // scales = t0,t1 (bytes 0..8), mins = t2,t3 (bytes 8..16)
        _mm_setr_epi32(t0 as i32, t1 as i32, t2 as i32, t3 as i32)
    }
}

/// Decoded super-block.
pub(super) struct KDec {
    pub(super) wq: [__m256i; 8],
    pub(super) scv: [__m256i; 8],
    /// Per-16-group coefficients multiplied with the activations' bsums.
    pub(super) coef: __m256i,
    pub(super) d: f32,
    pub(super) dmin: f32,
}

#[inline(always)]
pub(super) unsafe fn decode<const F: u8>(b: *const u8, o: &mut KDec) {
    // SAFETY: the whole super-block at b is readable (caller).
    unsafe {
        let m0f = _mm256_set1_epi8(0x0F);
        match F {
            Q2K => {
                let sb = _mm_loadu_si128(b as *const __m128i);
                let sc = _mm256_cvtepu8_epi16(_mm_and_si128(sb, _mm_set1_epi8(0x0F)));
                let mn = _mm256_cvtepu8_epi16(_mm_and_si128(
                    _mm_srli_epi16::<4>(sb),
                    _mm_set1_epi8(0x0F),
                ));
                scales16(sc, &mut o.scv);
                o.coef = mn;
                let m3 = _mm256_set1_epi8(3);
                for n in 0..2 {
                    let q = ld(b.add(16 + 32 * n));
                    o.wq[4 * n] = _mm256_and_si256(q, m3);
                    o.wq[4 * n + 1] = _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3);
                    o.wq[4 * n + 2] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3);
                    o.wq[4 * n + 3] = _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3);
                }
                o.d = rd_f16(b.add(80));
                o.dmin = rd_f16(b.add(82));
            }
            Q3K => {
                // Sixteen 6-bit scales (ggml's aux unpacking), minus 32.
                let p = b.add(96);
                let a0 = (p as *const u32).read_unaligned();
                let a1 = (p.add(4) as *const u32).read_unaligned();
                let tmp = (p.add(8) as *const u32).read_unaligned();
                const KM1: u32 = 0x03030303;
                const KM2: u32 = 0x0f0f0f0f;
                let s2 = ((a0 >> 4) & KM2) | (((tmp >> 4) & KM1) << 4);
                let s3 = ((a1 >> 4) & KM2) | (((tmp >> 6) & KM1) << 4);
                let s0 = (a0 & KM2) | ((tmp & KM1) << 4);
                let s1 = (a1 & KM2) | (((tmp >> 2) & KM1) << 4);
                let s8 = _mm_setr_epi32(s0 as i32, s1 as i32, s2 as i32, s3 as i32);
                let s16 = _mm256_sub_epi16(_mm256_cvtepu8_epi16(s8), _mm256_set1_epi16(32));
                scales16(s16, &mut o.scv);
                o.coef = _mm256_slli_epi16::<2>(s16);
                let m3 = _mm256_set1_epi8(3);
                let hm = ld(b);
                for n in 0..2 {
                    let q = ld(b.add(32 + 32 * n));
                    for j in 0..4 {
                        let low = match j {
                            0 => _mm256_and_si256(q, m3),
                            1 => _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3),
                            2 => _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3),
                            _ => _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3),
                        };
                        // High bit c = 4n + j of hmask[l] adds 4 (unsigned 0..7).
                        let bit = _mm256_set1_epi8(1i8 << (4 * n + j) as u32);
                        let set = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
                        o.wq[4 * n + j] =
                            _mm256_or_si256(low, _mm256_and_si256(set, _mm256_set1_epi8(4)));
                    }
                }
                o.d = rd_f16(b.add(108));
                o.dmin = 0.0;
            }
            Q4K | Q5K => {
                let sm = k4_scales_mins(b.add(4));
                let s16 = _mm256_cvtepu8_epi16(sm); // [sc0..sc7, m0..m7]
                let sc128 = _mm256_castsi256_si128(s16);
                let mn128 = _mm256_extracti128_si256::<1>(s16);
                // Sub-block c (32 elements) uses scale c for all 32 elements.
                let mut sc = [0i16; 8];
                _mm_storeu_si128(sc.as_mut_ptr() as *mut __m128i, sc128);
                for c in 0..8 {
                    o.scv[c] = _mm256_set1_epi16(sc[c]);
                }
                // bsums are per 16 elements: min c covers groups 2c and 2c+1.
                o.coef = _mm256_set_m128i(
                    _mm_unpackhi_epi16(mn128, mn128),
                    _mm_unpacklo_epi16(mn128, mn128),
                );
                let qs = if F == Q4K { b.add(16) } else { b.add(48) };
                for c in 0..4 {
                    let q = ld(qs.add(32 * c));
                    o.wq[2 * c] = _mm256_and_si256(q, m0f);
                    o.wq[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m0f);
                }
                if F == Q5K {
                    let qh = ld(b.add(16));
                    let b10 = _mm256_set1_epi8(0x10);
                    o.wq[0] =
                        _mm256_or_si256(o.wq[0], _mm256_and_si256(_mm256_slli_epi16::<4>(qh), b10));
                    o.wq[1] =
                        _mm256_or_si256(o.wq[1], _mm256_and_si256(_mm256_slli_epi16::<3>(qh), b10));
                    o.wq[2] =
                        _mm256_or_si256(o.wq[2], _mm256_and_si256(_mm256_slli_epi16::<2>(qh), b10));
                    o.wq[3] =
                        _mm256_or_si256(o.wq[3], _mm256_and_si256(_mm256_slli_epi16::<1>(qh), b10));
                    o.wq[4] = _mm256_or_si256(o.wq[4], _mm256_and_si256(qh, b10));
                    o.wq[5] =
                        _mm256_or_si256(o.wq[5], _mm256_and_si256(_mm256_srli_epi16::<1>(qh), b10));
                    o.wq[6] =
                        _mm256_or_si256(o.wq[6], _mm256_and_si256(_mm256_srli_epi16::<2>(qh), b10));
                    o.wq[7] =
                        _mm256_or_si256(o.wq[7], _mm256_and_si256(_mm256_srli_epi16::<3>(qh), b10));
                }
                o.d = rd_f16(b);
                o.dmin = rd_f16(b.add(2));
            }
            _ => {
                // Q6_K: signed scales, offset 32 folded into the correction.
                let s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192) as *const __m128i));
                scales16(s16, &mut o.scv);
                o.coef = _mm256_slli_epi16::<5>(s16);
                let m3 = _mm256_set1_epi8(3);
                for n in 0..2 {
                    let ql0 = ld(b.add(64 * n));
                    let ql1 = ld(b.add(64 * n + 32));
                    let qh = ld(b.add(128 + 32 * n));
                    let h0 = _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m3));
                    let h1 =
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m3));
                    let h2 =
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m3));
                    let h3 =
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m3));
                    o.wq[4 * n] = _mm256_or_si256(_mm256_and_si256(ql0, m0f), h0);
                    o.wq[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(ql1, m0f), h1);
                    o.wq[4 * n + 2] =
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m0f), h2);
                    o.wq[4 * n + 3] =
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m0f), h3);
                }
                o.d = rd_f16(b.add(208));
                o.dmin = 0.0;
            }
        }
    }
}

/// Raw views of Q8_K activations: row i's quants at `qs + i*k`, scales at
/// `d + i*nb`, bsums at `bsums + i*nb*16`.
struct Acts {
    qs: *const i8,
    d: *const f32,
    bsums: *const i16,
    k: usize,
    nb: usize,
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
    let z = KDec {
        // SAFETY (of the zero vectors): AVX is enabled in every caller.
        wq: [unsafe { _mm256_setzero_si256() }; 8],
        scv: [unsafe { _mm256_setzero_si256() }; 8],
        coef: unsafe { _mm256_setzero_si256() },
        d: 0.0,
        dmin: 0.0,
    };
    let mut dec = z;
    for r in 0..n_rows {
        // SAFETY: row r spans w[r*rb..(r+1)*rb]; activation rows hold nb
        // Q8_K blocks each (caller).
        unsafe {
            let wr = w.as_ptr().add(r * rb);
            let mut acc = [_mm256_setzero_ps(); M];
            for sb in 0..nb {
                decode::<F>(wr.add(sb * bb(F)), &mut dec);
                for i in 0..M {
                    let y = a.qs.add(i * a.k + sb * 256) as *const u8;
                    let mut isum = _mm256_setzero_si256();
                    for c in 0..8 {
                        // |pair| <= 2*63*127 fits i16; the scaled sums stay far below 2^31.
                        let p16 = _mm256_maddubs_epi16(dec.wq[c], ld(y.add(32 * c)));
                        isum = if VNNI {
                            _mm256_dpwssd_epi32(isum, p16, dec.scv[c])
                        } else {
                            _mm256_add_epi32(isum, _mm256_madd_epi16(p16, dec.scv[c]))
                        };
                    }
                    let bs = ld(a.bsums.add((i * nb + sb) * 16) as *const u8);
                    let corr = _mm256_madd_epi16(bs, dec.coef);
                    let dy = *a.d.add(i * nb + sb);
                    if has_min(F) {
                        acc[i] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(isum),
                            _mm256_set1_ps(dec.d * dy),
                            acc[i],
                        );
                        acc[i] = _mm256_fnmadd_ps(
                            _mm256_cvtepi32_ps(corr),
                            _mm256_set1_ps(dec.dmin * dy),
                            acc[i],
                        );
                    } else {
                        acc[i] = _mm256_fmadd_ps(
                            _mm256_cvtepi32_ps(_mm256_sub_epi32(isum, corr)),
                            _mm256_set1_ps(dec.d * dy),
                            acc[i],
                        );
                    }
                }
            }
            for i in 0..M {
                out.set(i, r, hsum(acc[i]));
            }
        }
    }
}

row_entries!();

const MAXM: usize = 8;

/// Dot products of Q2_K..Q6_K weights; returns false for other dtypes.
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
        (true, DType::Q2_K) => rows_table!(rows_avx512, Q2K),
        (true, DType::Q3_K) => rows_table!(rows_avx512, Q3K),
        (true, DType::Q4_K) => rows_table!(rows_avx512, Q4K),
        (true, DType::Q5_K) => rows_table!(rows_avx512, Q5K),
        (true, DType::Q6_K) => rows_table!(rows_avx512, Q6K),
        (false, DType::Q2_K) => rows_table!(rows_avx2, Q2K),
        (false, DType::Q3_K) => rows_table!(rows_avx2, Q3K),
        (false, DType::Q4_K) => rows_table!(rows_avx2, Q4K),
        (false, DType::Q5_K) => rows_table!(rows_avx2, Q5K),
        (false, DType::Q6_K) => rows_table!(rows_avx2, Q6K),
        _ => return false,
    };
    let nb = k / 256;
    let m = acts.m;
    let mut i0 = 0;
    while i0 < m {
        let mm = (m - i0).min(MAXM);
        let a = Acts {
            qs: acts.qs[i0 * k..].as_ptr(),
            d: acts.d[i0 * nb..].as_ptr(),
            bsums: acts.bsums[i0 * nb * 16..].as_ptr(),
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
