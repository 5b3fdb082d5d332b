//! The AVX2 panel packer of the tiled GEMM: the panel `crate::gemm`
//! describes, in its AVX2 (non-VNNI) encoding, byte for byte what
//! `pack_portable` writes, 8 rows at a time.
//!
//! Per block and group of 8 rows: the 16 quant bytes of rows `j` and `j + 4`
//! share a 256-bit register (one row per 128-bit lane); a 4x4 dword
//! transpose within the lanes then gives, for each dword `s`, rows 0..8's
//! dword `s` in row order: the 32 bytes the panel stores for those rows at
//! step `s` (4-bit formats: the low nibbles are steps 0..4 and the high
//! nibbles steps 4..8; Q8_0: the two 16-byte halves are steps 0..4 and
//! 4..8). The fifth bit of Q5_0/Q5_1 comes from each row's `qh` word by a
//! byte shuffle and a bit test. The 8 block headers (f16 `d`, and `m`) are
//! widened with F16C, which converts exactly, as `half` does.
//!
//! Groups of 8 rows that a partial panel does not fill completely go through
//! `pack_row` (the portable code), so rows past the end are zeros as there.

use crate::gemm::{NR, Panel, Q4_0, Q4_1, Q5_0, Q8_0, QB, block_bytes, has_min, pack_row};
use std::arch::x86_64::*;

/// Quant byte offset within a block.
const fn quant_offset(f: u8) -> usize {
    match f {
        Q4_0 => 2,
        Q4_1 => 4,
        Q5_0 => 6,
        Q8_0 => 2,
        _ => 8,
    }
}

/// The 4x4 dword transpose within 128-bit lanes: `z[j]` holds rows `j` and
/// `j + 4` in its lanes; result `s` holds dword `s` of rows 0..8 in order.
#[target_feature(enable = "avx2")]
#[inline]
fn transpose(z: [__m256i; 4]) -> [__m256i; 4] {
    let t0 = _mm256_unpacklo_epi32(z[0], z[1]);
    let t1 = _mm256_unpackhi_epi32(z[0], z[1]);
    let t2 = _mm256_unpacklo_epi32(z[2], z[3]);
    let t3 = _mm256_unpackhi_epi32(z[2], z[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// Packs one block of 8 rows (row `l`'s block at `src + l*rb`): the 8
/// steps of 32 bytes at `q + s*128`, scales at `d`, mins (zeros for formats
/// without one) at `m`. Also prefetches the lines at `pf + l*rb` (the same
/// block of the next unit's rows), so that streaming weights from memory
/// overlaps the multiplication of this panel.
///
/// # Safety
/// AVX2 and F16C; the 8 blocks are readable; `q`, `d` and `m` are writable
/// at those offsets (`q` 32-byte aligned). `pf` may be any address
/// (prefetches do not fault; it is offset with wrapping arithmetic).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn pack8<const F: u8>(
    src: *const u8,
    rb: usize,
    pf: *const u8,
    q: *mut u8,
    d: *mut f32,
    m: *mut f32,
) {
    // SAFETY: per the contract.
    unsafe {
        for l in 0..8 {
            _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(l * rb) as *const i8);
        }
        let row = |l: usize| src.add(l * rb);
        let lanes = |off: usize| -> [__m256i; 4] {
            std::array::from_fn(|j| {
                _mm256_loadu2_m128i(
                    row(j + 4).add(off) as *const __m128i,
                    row(j).add(off) as *const __m128i,
                )
            })
        };
        let st = |s: usize, v: __m256i| _mm256_store_si256(q.add(s * 128) as *mut __m256i, v);
        if F == Q8_0 {
            for h in 0..2 {
                for (j, v) in transpose(lanes(2 + 16 * h)).into_iter().enumerate() {
                    st(4 * h + j, v);
                }
            }
        } else {
            let sv = transpose(lanes(quant_offset(F)));
            let lo4 = _mm256_set1_epi8(0x0F);
            let mut steps = [_mm256_setzero_si256(); 8];
            for (j, v) in sv.into_iter().enumerate() {
                steps[j] = _mm256_and_si256(v, lo4);
                steps[j + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), lo4);
            }
            if F != Q4_0 && F != Q4_1 {
                let ho = if F == Q5_0 { 2 } else { 4 };
                let qh: [i32; 8] =
                    std::array::from_fn(|l| (row(l).add(ho) as *const i32).read_unaligned());
                let qhv = _mm256_loadu_si256(qh.as_ptr() as *const __m256i);
                let bit16 = _mm256_set1_epi8(0x10);
                // Byte offsets of the dwords within each 128-bit lane.
                let lane_base = _mm256_setr_epi32(
                    0,
                    0x0404_0404,
                    0x0808_0808,
                    0x0C0C_0C0C,
                    0,
                    0x0404_0404,
                    0x0808_0808,
                    0x0C0C_0C0C,
                );
                for (s, v) in steps.iter_mut().enumerate() {
                    // Every byte of a row's dword takes byte s/2 of its qh;
                    // byte t then tests bit 4*(s%2) + t (element 4s + t).
                    let idx = _mm256_add_epi8(_mm256_set1_epi8((s / 2) as i8), lane_base);
                    let b = _mm256_shuffle_epi8(qhv, idx);
                    let sh = 4 * (s % 2) as u32;
                    let bits = _mm256_set1_epi32(i32::from_le_bytes([
                        1 << sh,
                        1 << (sh + 1),
                        1 << (sh + 2),
                        1 << (sh + 3),
                    ]));
                    let set = _mm256_cmpeq_epi8(_mm256_and_si256(b, bits), bits);
                    *v = _mm256_or_si256(*v, _mm256_and_si256(set, bit16));
                }
            }
            for (s, v) in steps.into_iter().enumerate() {
                st(s, v);
            }
        }
        // The 8 headers: d in the low and m in the high half of each dword;
        // one in-lane shuffle and a cross-lane permute put the 8 d's in the
        // low 128 bits and the 8 m's in the high ones.
        let hdr: [i32; 8] = std::array::from_fn(|l| (row(l) as *const i32).read_unaligned());
        let hv = _mm256_loadu_si256(hdr.as_ptr() as *const __m256i);
        let split = _mm256_setr_epi8(
            0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15, 0, 1, 4, 5, 8, 9, 12, 13, 2, 3,
            6, 7, 10, 11, 14, 15,
        );
        let dm = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(hv, split));
        _mm256_storeu_ps(d, _mm256_cvtph_ps(_mm256_castsi256_si128(dm)));
        let mv = if has_min(F) {
            _mm256_cvtph_ps(_mm256_extracti128_si256::<1>(dm))
        } else {
            _mm256_setzero_ps()
        };
        _mm256_storeu_ps(m, mv);
    }
}

/// Packs blocks `kb0..kb0+nblk` of the first `rows` rows of `w` into `p`
/// in the AVX2 encoding, exactly as `pack_portable(F, false, ..)` does, and
/// prefetches the same extent of the rows at `next` (the next unit of the
/// walk; any address, as prefetches do not fault).
///
/// # Safety
/// AVX2 and F16C; the contract of `pack_portable`, and `w` holds `rows`
/// rows of `rb` bytes.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
pub(crate) unsafe fn pack_avx2<const F: u8>(
    w: &[u8],
    rb: usize,
    rows: usize,
    kb0: usize,
    nblk: usize,
    next: *const u8,
    p: *mut Panel,
) {
    let bb = block_bytes(F);
    // SAFETY: SIMD groups read only rows < rows (w holds them, blocks
    // kb0..kb0+nblk); every panel offset is below its array's length
    // because nblk <= KC_BLOCKS and group rows < NR.
    unsafe {
        let pq = std::ptr::addr_of_mut!((*p).q) as *mut u8;
        let pd = std::ptr::addr_of_mut!((*p).d) as *mut f32;
        let pm = std::ptr::addr_of_mut!((*p).m) as *mut f32;
        for j in 0..NR / 8 {
            if 8 * j + 8 > rows {
                for row in 8 * j..8 * j + 8 {
                    pack_row(F, false, w, rb, row, rows, kb0, nblk, p);
                }
                continue;
            }
            let src = w.as_ptr().add(8 * j * rb + kb0 * bb);
            let pf = next.wrapping_add(8 * j * rb);
            for b in 0..nblk {
                pack8::<F>(
                    src.add(b * bb),
                    rb,
                    pf.wrapping_add(b * bb),
                    pq.add(b * QB + 32 * j),
                    pd.add(b * NR + 8 * j),
                    pm.add(b * NR + 8 * j),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::{KC_BLOCKS, Q5_1, pack_portable};
    use std::mem::MaybeUninit;

    /// The bytes of the first `nblk` blocks of every panel array.
    fn packed(p: &Panel, nblk: usize) -> Vec<u8> {
        let mut v = p.q[..nblk * QB].to_vec();
        for x in p.d[..nblk * NR].iter().chain(&p.m[..nblk * NR]) {
            v.extend_from_slice(&x.to_bits().to_le_bytes());
        }
        v
    }

    /// A panel of garbage, so that unwritten bytes cannot match by chance.
    fn dirty() -> Box<Panel> {
        let mut p = Box::new(MaybeUninit::<Panel>::uninit());
        // SAFETY: every byte pattern is a valid Panel (bytes and f32s).
        unsafe {
            std::ptr::write_bytes(p.as_mut_ptr(), 0xA5, 1);
            Box::from_raw(Box::into_raw(p) as *mut Panel)
        }
    }

    #[test]
    fn avx2_packer_matches_the_portable_one_byte_for_byte() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
            println!("skipping: no AVX2/F16C");
            return;
        }
        let mut seed = 0x1234_5678_9abc_def0u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for f in [Q4_0, Q4_1, Q5_0, Q5_1, Q8_0] {
            let bb = block_bytes(f);
            let nb = 2 * KC_BLOCKS + 3;
            let rb = nb * bb;
            // Random bytes: every quant pattern and f16 header, including
            // subnormals, infinities and NaNs.
            let w: Vec<u8> = (0..NR * rb).map(|_| next() as u8).collect();
            for rows in [NR, 31, 24, 17, 16, 9, 8, 5, 1] {
                for (kb0, nblk) in [
                    (0, KC_BLOCKS),
                    (KC_BLOCKS, KC_BLOCKS),
                    (0, 1),
                    (5, 7),
                    (48, 3),
                ] {
                    let wr = &w[..rows * rb];
                    let (mut a, mut b) = (dirty(), dirty());
                    // SAFETY: the panels are writable; every row holds
                    // blocks kb0..kb0+nblk <= nb; AVX2/F16C checked above.
                    unsafe {
                        pack_portable(f, false, wr, rb, rows, kb0, nblk, &mut *a);
                        match f {
                            Q4_0 => {
                                pack_avx2::<Q4_0>(wr, rb, rows, kb0, nblk, wr.as_ptr(), &mut *b)
                            }
                            Q4_1 => {
                                pack_avx2::<Q4_1>(wr, rb, rows, kb0, nblk, wr.as_ptr(), &mut *b)
                            }
                            Q5_0 => {
                                pack_avx2::<Q5_0>(wr, rb, rows, kb0, nblk, wr.as_ptr(), &mut *b)
                            }
                            Q5_1 => {
                                pack_avx2::<Q5_1>(wr, rb, rows, kb0, nblk, wr.as_ptr(), &mut *b)
                            }
                            _ => pack_avx2::<Q8_0>(wr, rb, rows, kb0, nblk, wr.as_ptr(), &mut *b),
                        }
                    }
                    assert!(
                        packed(&a, nblk) == packed(&b, nblk),
                        "format {f}, rows {rows}, kb0 {kb0}, nblk {nblk}"
                    );
                }
            }
        }
    }
}
