//! AVX2 and AVX-512 dot products of float weights (F32, F16, BF16) and of
//! the scaled weight blocks (`f8_s32`, `u4_s32`, `u8_s32`, `f4_s16`) with f32 activations, for
//! any number of activation rows, batch-invariant.
//!
//! Numerics (the contract that makes an output independent of `m`, of the
//! other rows and of how the caller splits the weight rows): every output
//! element `(i, r)` is computed by the same instruction sequence whatever the
//! tile it falls in. One vector accumulator (16 lanes with AVX-512, 8 with
//! AVX2) starts at zero; for each full vector `j` of `k`, in order,
//! `acc = fma(w[r][j..], x[i][j..], acc)`; a partial last vector is loaded
//! with the missing lanes zeroed and multiplied the same way; then a fixed
//! horizontal reduction (`hsum512`: halves, quarters, pairs; `hsum256`
//! likewise) gives the value. The weights are converted to f32 exactly (f16
//! through `vcvtph2ps`, bf16 by a 16-bit shift), so converting in registers
//! or ahead of time would not change a bit. The scaled blocks are
//! dequantized in registers with the operations of `formats::scaled` (E4M3
//! through its f16 bit pattern times `scale * 256`; `(q - zero) * scale`,
//! which AVX-512 computes once for each of the 16 nibble values of a block
//! (or of a run of blocks with the same scale and zero) and looks up;
//! E2M1 by table lookup times the scale), so each weight vector equals
//! the scalar dequantization bit for bit; their rows are whole blocks (of
//! 32, or 16 for `f4_s16`), so they never take the partial-vector path.
//! At the `Amx` level bf16 weights whose `k` is not a multiple of 32 (AMX
//! tiles take the others, `x86::amx`) instead meet bf16-rounded
//! activations in `vdpbf16ps` ([`dot_rows_bf16`]): one accumulator per
//! element, 32 elements (16 lane pairs) per step, each lane adding its pair's
//! two exact products, the same fixed reduction; again one instruction
//! sequence per element whatever the tile.
//!
//! Tiling (speed only): tiles of `MR` activation rows by `NR` weight rows
//! keep `MR * NR` accumulators in registers, so each loaded weight vector is
//! used `MR` times and each activation vector `NR` times. Weight rows are
//! walked in blocks of [`NB`] (kept in L2) with the activation rows in the
//! inner loop. Ragged edges repeat the last row's pointer and drop the
//! duplicate results, so no tile shape changes any element's arithmetic.
//! When one tile covers every activation row (decode: each weight is read
//! once), the next tile's weight rows (adjacent in memory) are prefetched
//! while a tile runs, spread over its steps: the hardware prefetchers follow
//! `NR` interleaved row streams poorly. Prefetching changes no arithmetic.
//!
//! Preconditions (checked by `lib.rs` before any call): `w` holds `n_rows`
//! rows of `k` elements, `x` holds `m` rows of `k` f32, and the output view
//! holds `m` rows of `n_rows` columns.

use super::Prefetch;
use crate::DType;
use crate::formats::scaled::E2M1;
use crate::gemm::OutMat;
use std::arch::x86_64::*;

const F32: u8 = 0;
const F16: u8 = 1;
const BF16: u8 = 2;
pub(super) const F8S: u8 = 3;
pub(super) const U4S: u8 = 4;
pub(super) const F4S: u8 = 5;
pub(super) const U8S: u8 = 6;

/// Weight rows per block of the driver (the block is re-read from L2 for
/// every tile of activation rows).
const NB: usize = 64;

pub(super) fn code(dtype: DType) -> u8 {
    match dtype {
        DType::F16 => F16,
        DType::BF16 => BF16,
        DType::F8_S32 => F8S,
        DType::U4_S32 => U4S,
        DType::F4_S16 => F4S,
        DType::U8_S32 => U8S,
        _ => F32,
    }
}

/// Element size in bytes for a float dtype code.
const fn esize(dt: u8) -> usize {
    if dt == F32 { 4 } else { 2 }
}

/// Bytes of a row of `k` elements for a dtype code.
pub(super) const fn row_bytes(dt: u8, k: usize) -> usize {
    match dt {
        F8S => k / 32 * 36,
        U4S => k / 32 * 20,
        U8S => k / 32 * 36,
        F4S => k / 16 * 12,
        _ => k * esize(dt),
    }
}

/// The E4M3 bytes of `v` (16-bit lanes) as f16 bits of value/256: the byte
/// shifted left by 7 puts the exponent and mantissa in place and the sign
/// at bit 14, and adding that bit to itself carries it to bit 15 (the
/// bits of `(b & 0x80) << 8 | (b & 0x7f) << 7`, in three operations).
///
/// # Safety
/// The caller enables AVX-512 BW (a `target_feature` function).
#[inline(always)]
pub unsafe fn e4m3_f16_512(v: __m512i) -> __m512i {
    // SAFETY: AVX-512 BW is enabled in every caller.
    unsafe {
        let t = _mm512_slli_epi16::<7>(v);
        _mm512_add_epi16(t, _mm512_and_si512(t, _mm512_set1_epi16(0x4000)))
    }
}

/// [`e4m3_f16_512`] on 16 lanes.
///
/// # Safety
/// The caller enables AVX2.
#[inline(always)]
pub unsafe fn e4m3_f16_256(v: __m256i) -> __m256i {
    // SAFETY: AVX2 is enabled in every caller.
    unsafe {
        let t = _mm256_slli_epi16::<7>(v);
        _mm256_add_epi16(t, _mm256_and_si256(t, _mm256_set1_epi16(0x4000)))
    }
}

/// [`e4m3_f16_512`] on 8 lanes.
///
/// # Safety
/// The caller runs on x86-64 (SSE2).
#[inline(always)]
pub unsafe fn e4m3_f16_128(v: __m128i) -> __m128i {
    // SAFETY: SSE2 is enabled in every caller.
    unsafe {
        let t = _mm_slli_epi16::<7>(v);
        _mm_add_epi16(t, _mm_and_si128(t, _mm_set1_epi16(0x4000)))
    }
}

/// The f16 at `p` as f32, through F16C.
#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: two bytes are readable at `p` (caller) and F16C is enabled.
    unsafe {
        let bits = (p as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }
}

/// The scale and zero point of the `u4_s32` or `u8_s32` block at `b`.
#[inline(always)]
unsafe fn int_block_params<const DT: u8>(b: *const u8) -> (f32, i32) {
    // SAFETY: the caller guarantees the block at `b` is readable.
    unsafe {
        if DT == U4S {
            (f16_at(b.add(16)), *b.add(18) as i32)
        } else {
            let z = (b.add(34) as *const u16).read_unaligned();
            (f16_at(b.add(32)), z as i32)
        }
    }
}

/// Elements `jj..jj + 8` (`jj` a multiple of 8 below 32) of the `u4_s32` or
/// `u8_s32` block at `b`, with its scale `s` and zero `z` broadcast:
/// `f32(q - z) * s`.
#[inline(always)]
unsafe fn int_block_vec8<const DT: u8>(b: *const u8, jj: usize, s: __m256, z: __m256i) -> __m256 {
    // SAFETY: the caller guarantees the block at `b` is readable and AVX2
    // is enabled.
    unsafe {
        let q = if DT == U4S {
            let raw = _mm_loadl_epi64(b.add(jj % 16) as *const __m128i);
            if jj < 16 {
                _mm_and_si128(raw, _mm_set1_epi8(0x0f))
            } else {
                _mm_and_si128(_mm_srli_epi16::<4>(raw), _mm_set1_epi8(0x0f))
            }
        } else {
            _mm_loadl_epi64(b.add(jj) as *const __m128i)
        };
        let q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), z);
        _mm256_mul_ps(_mm256_cvtepi32_ps(q), s)
    }
}

/// Elements `j..j + 16` of the row at `row` (`j` a multiple of 16) as f32.
#[inline(always)]
pub(super) unsafe fn wload16<const DT: u8>(row: *const u8, j: usize) -> __m512 {
    // SAFETY: the caller guarantees the row holds more than j + 15 elements
    // and AVX-512 F/BW/VL + F16C are enabled.
    unsafe {
        match DT {
            U8S => {
                let b = row.add(j / 32 * 36);
                let (s, z) = int_block_params::<U8S>(b);
                let raw = _mm_loadu_si128(b.add(j % 32) as *const __m128i);
                let q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(raw), _mm512_set1_epi32(z));
                _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s))
            }
            F8S => {
                let b = row.add(j / 32 * 36);
                let s = _mm512_set1_ps((b.add(32) as *const f32).read_unaligned() * 256.0);
                let q = _mm256_cvtepu8_epi16(_mm_loadu_si128(b.add(j % 32) as *const __m128i));
                _mm512_mul_ps(_mm512_cvtph_ps(e4m3_f16_256(q)), s)
            }
            U4S => {
                let b = row.add(j / 32 * 20);
                let s = f16_at(b.add(16));
                let z = _mm512_set1_epi32(*b.add(18) as i32);
                let raw = _mm_loadu_si128(b as *const __m128i);
                let nib = if j.is_multiple_of(32) {
                    _mm_and_si128(raw, _mm_set1_epi8(0x0f))
                } else {
                    _mm_and_si128(_mm_srli_epi16::<4>(raw), _mm_set1_epi8(0x0f))
                };
                let q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(nib), z);
                _mm512_mul_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(s))
            }
            F4S => {
                let b = row.add(j / 16 * 12);
                let s = _mm512_set1_ps((b.add(8) as *const f32).read_unaligned());
                // The permutation reads only an index's low 4 bits: the
                // code, in either half, without masking.
                let raw = _mm_loadl_epi64(b as *const __m128i);
                let hi = _mm_srli_epi16::<4>(raw);
                let codes = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(raw, hi));
                let table = _mm512_loadu_ps(E2M1.as_ptr());
                _mm512_mul_ps(_mm512_permutexvar_ps(codes, table), s)
            }
            _ => load16::<DT>(row.add(j * esize(DT))),
        }
    }
}

/// Elements `j..j + 32` (one whole block, `j` a multiple of 32) of an
/// `f8_s32`, `u4_s32` or `u8_s32` row, as [`wload16`] computes them.
#[inline(always)]
pub(super) unsafe fn wload32<const DT: u8>(row: *const u8, j: usize) -> [__m512; 2] {
    // SAFETY: the caller guarantees the row holds the block and AVX-512
    // F/BW/VL + F16C are enabled.
    unsafe {
        if DT == U8S {
            [wload16::<DT>(row, j), wload16::<DT>(row, j + 16)]
        } else if DT == F8S {
            let b = row.add(j / 32 * 36);
            let s = _mm512_set1_ps((b.add(32) as *const f32).read_unaligned() * 256.0);
            let q = _mm512_cvtepu8_epi16(_mm256_loadu_si256(b as *const __m256i));
            let h = e4m3_f16_512(q);
            [
                _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), s),
                _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(h)), s),
            ]
        } else {
            let mut t = U4Table::empty();
            u4_block(row.add(j / 32 * 20), &mut t)
        }
    }
}

/// The 16 values a `u4_s32` block can hold, `f32(q - z) * s` for q in
/// 0..16 (the operations of the per-element form, so the same bits), and
/// the block parameters they were built from: a group of 64 or 128 inputs
/// (AWQ, GPTQ) spans 2 or 4 blocks of one row with the same scale and zero,
/// which then build the table once.
#[derive(Clone, Copy)]
pub(super) struct U4Table {
    /// The block's scale bits and zero point (`u32::MAX`: none yet).
    key: u32,
    values: __m512,
}

impl U4Table {
    /// A table that no block's parameters match (the zero byte above a
    /// block's 24 parameter bits never equals u32::MAX's).
    #[inline(always)]
    pub(super) fn empty() -> Self {
        Self {
            key: u32::MAX,
            // SAFETY: AVX-512 F is enabled wherever the kernels run (callers).
            values: unsafe { _mm512_setzero_ps() },
        }
    }

    /// Makes the table hold the values of the `u4_s32` block at `b`;
    /// true if it had to be rebuilt (the block's scale or zero point
    /// differs from the ones it held).
    ///
    /// # Safety
    /// The 20-byte block at `b` is readable and AVX-512 F + F16C are enabled.
    #[inline(always)]
    pub(super) unsafe fn update(&mut self, b: *const u8) -> bool {
        // SAFETY: per this function's contract.
        unsafe {
            let key = (b.add(16) as *const u32).read_unaligned() & 0x00ff_ffff;
            if key == self.key {
                return false;
            }
            let s = _mm512_set1_ps(f16_at(b.add(16)));
            let z = _mm512_set1_epi32(*b.add(18) as i32);
            let iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            self.values = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(iota, z)), s);
            self.key = key;
            true
        }
    }

    /// The 16 values.
    #[inline(always)]
    pub(super) fn values(&self) -> __m512 {
        self.values
    }
}

/// The 32 elements of the `u4_s32` block at `b`, each looked up by its
/// nibble in `t` (rebuilt when the block's scale or zero differs from the
/// one `t` holds): the permutation reads only an index's low 4 bits, so
/// neither half needs masking.
#[inline(always)]
pub(super) unsafe fn u4_block(b: *const u8, t: &mut U4Table) -> [__m512; 2] {
    // SAFETY: the caller guarantees the 20-byte block at `b` is readable
    // and AVX-512 F/BW/VL + F16C are enabled.
    unsafe {
        t.update(b);
        let raw = _mm_loadu_si128(b as *const __m128i);
        let lo = _mm512_cvtepu8_epi32(raw);
        let hi = _mm512_cvtepu8_epi32(_mm_srli_epi16::<4>(raw));
        [
            _mm512_permutexvar_ps(lo, t.values),
            _mm512_permutexvar_ps(hi, t.values),
        ]
    }
}

/// Elements `j..j + 8` of the row at `row` (`j` a multiple of 8) as f32.
#[inline(always)]
unsafe fn wload8<const DT: u8>(row: *const u8, j: usize) -> __m256 {
    // SAFETY: the caller guarantees the row holds more than j + 7 elements
    // and AVX2 + F16C are enabled.
    unsafe {
        match DT {
            U4S | U8S => {
                let b = row.add(j / 32 * row_bytes(DT, 32));
                let (s, z) = int_block_params::<DT>(b);
                int_block_vec8::<DT>(b, j % 32, _mm256_set1_ps(s), _mm256_set1_epi32(z))
            }
            F8S => {
                let b = row.add(j / 32 * 36);
                let s = _mm256_set1_ps((b.add(32) as *const f32).read_unaligned() * 256.0);
                let q = _mm_cvtepu8_epi16(_mm_loadl_epi64(b.add(j % 32) as *const __m128i));
                _mm256_mul_ps(_mm256_cvtph_ps(e4m3_f16_128(q)), s)
            }
            F4S => {
                let b = row.add(j / 16 * 12);
                let s = _mm256_set1_ps((b.add(8) as *const f32).read_unaligned());
                // The code is each lane's low 4 bits (the bits above are
                // the neighbouring code's, read by neither step below).
                let raw = _mm_loadl_epi64(b as *const __m128i);
                let nib = if j.is_multiple_of(16) {
                    raw
                } else {
                    _mm_srli_epi16::<4>(raw)
                };
                let codes = _mm256_cvtepu8_epi32(nib);
                // Magnitude from the 8-entry table (the low 3 bits), then the
                // sign bit (code bit 3).
                let mag = _mm256_permutevar8x32_ps(_mm256_loadu_ps(E2M1.as_ptr()), codes);
                let sign = _mm256_slli_epi32::<28>(_mm256_and_si256(codes, _mm256_set1_epi32(8)));
                _mm256_mul_ps(_mm256_xor_ps(mag, _mm256_castsi256_ps(sign)), s)
            }
            _ => load8::<DT>(row.add(j * esize(DT))),
        }
    }
}

// ---------------------------------------------------------------- AVX-512

/// Activation rows per AVX-512 tile (at most).
const MR512: usize = 6;
/// Weight rows per AVX-512 tile.
const NR512: usize = 4;

#[inline(always)]
unsafe fn load16<const DT: u8>(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees 16 elements are readable at `p` and
    // AVX-512F is enabled.
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

#[inline(always)]
unsafe fn load16_masked<const DT: u8>(p: *const u8, mask: u16) -> __m512 {
    // SAFETY: masked-off lanes are not accessed (AVX-512 fault suppression)
    // and read as zero; the caller guarantees the unmasked elements are
    // readable and AVX-512 F/BW/VL are enabled.
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

/// The fixed horizontal sum of an AVX-512 accumulator.
#[inline(always)]
unsafe fn hsum512(v: __m512) -> f32 {
    // SAFETY: AVX-512F is enabled in every caller.
    unsafe {
        let h = _mm256_add_ps(
            _mm512_castps512_ps256(v),
            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))),
        );
        hsum256(h)
    }
}

/// One `MR x NR` tile: activation rows at `x[i]`, weight rows at `w[r]`
/// (`k` elements each); returns the dots.
#[inline(always)]
unsafe fn tile512<const DT: u8, const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const f32; MR],
    k: usize,
    next: Prefetch,
) -> [[f32; NR]; MR] {
    let es = esize(DT);
    let per_step = next.per_step(k / 16);
    // SAFETY: every row holds k elements (caller); loads stay below k.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut j = 0;
        if DT == F8S || DT == U4S || DT == U8S {
            // Whole 32-element blocks, their scale (and zero) loaded once;
            // each accumulator takes the two halves in order, as below.
            let mut u4_tables = [U4Table::empty(); NR];
            while j + 32 <= k {
                next.lines((j >> 4) * per_step, 2 * per_step);
                let mut wv = [[_mm512_setzero_ps(); 2]; NR];
                if DT == U4S {
                    for ((v, &wr), t) in wv.iter_mut().zip(&w).zip(&mut u4_tables) {
                        *v = u4_block(wr.add(j / 32 * 20), t);
                    }
                } else {
                    for (v, &wr) in wv.iter_mut().zip(&w) {
                        *v = wload32::<DT>(wr, j);
                    }
                }
                for (a, &xr) in acc.iter_mut().zip(&x) {
                    let x0 = _mm512_loadu_ps(xr.add(j));
                    let x1 = _mm512_loadu_ps(xr.add(j + 16));
                    for (ar, wr) in a.iter_mut().zip(&wv) {
                        *ar = _mm512_fmadd_ps(wr[0], x0, *ar);
                        *ar = _mm512_fmadd_ps(wr[1], x1, *ar);
                    }
                }
                j += 32;
            }
        }
        while j + 16 <= k {
            next.lines((j >> 4) * per_step, per_step);
            let mut wv = [_mm512_setzero_ps(); NR];
            for (v, &wr) in wv.iter_mut().zip(&w) {
                *v = wload16::<DT>(wr, j);
            }
            for (a, &xr) in acc.iter_mut().zip(&x) {
                let xv = _mm512_loadu_ps(xr.add(j));
                for (ar, &wr) in a.iter_mut().zip(&wv) {
                    *ar = _mm512_fmadd_ps(wr, xv, *ar);
                }
            }
            j += 16;
        }
        if j < k {
            let mask: u16 = ((1u32 << (k - j)) - 1) as u16;
            let mut wv = [_mm512_setzero_ps(); NR];
            for (v, &wr) in wv.iter_mut().zip(&w) {
                *v = load16_masked::<DT>(wr.add(j * es), mask);
            }
            for (a, &xr) in acc.iter_mut().zip(&x) {
                let xv = _mm512_maskz_loadu_ps(mask, xr.add(j));
                for (ar, &wr) in a.iter_mut().zip(&wv) {
                    *ar = _mm512_fmadd_ps(wr, xv, *ar);
                }
            }
        }
        let mut res = [[0.0f32; NR]; MR];
        for (ri, ai) in res.iter_mut().zip(&acc) {
            for (o, a) in ri.iter_mut().zip(ai) {
                *o = hsum512(*a);
            }
        }
        res
    }
}

// ---------------------------------------------------------------- AVX2

/// Activation rows per AVX2 tile (at most).
const MR256: usize = 4;
/// Weight rows per AVX2 tile.
const NR256: usize = 3;

#[inline(always)]
unsafe fn load8<const DT: u8>(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees 8 elements are readable at `p` and AVX2
    // + F16C are enabled.
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

/// The first `n < 8` elements at `p`, the other lanes zero.
#[inline(always)]
unsafe fn load8_partial<const DT: u8>(p: *const u8, n: usize) -> __m256 {
    let mut buf = [0u8; 32];
    // SAFETY: n elements are readable at p (caller); buf holds 8 of any size.
    unsafe {
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), n * esize(DT));
        load8::<DT>(buf.as_ptr())
    }
}

/// The fixed horizontal sum of an 8-lane accumulator.
#[inline(always)]
unsafe fn hsum256(v: __m256) -> f32 {
    // SAFETY: AVX is enabled in every caller.
    unsafe {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}

/// One `MR x NR` tile with AVX2 (see [`tile512`]).
#[inline(always)]
unsafe fn tile256<const DT: u8, const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const f32; MR],
    k: usize,
    next: Prefetch,
) -> [[f32; NR]; MR] {
    let es = esize(DT);
    let per_step = next.per_step(k / 8);
    // SAFETY: every row holds k elements (caller); loads stay below k.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); NR]; MR];
        let mut j = 0;
        if DT == U4S || DT == U8S {
            // Whole 32-element blocks: each row's scale and zero point are
            // loaded once per block, then its four vectors dequantize as
            // `wload8` does and take their turns in order, as below.
            let bb = row_bytes(DT, 32);
            while j + 32 <= k {
                next.lines((j >> 3) * per_step, 4 * per_step);
                let mut params = [(_mm256_setzero_ps(), _mm256_setzero_si256()); NR];
                for (p, &wr) in params.iter_mut().zip(&w) {
                    let (s, z) = int_block_params::<DT>(wr.add(j / 32 * bb));
                    *p = (_mm256_set1_ps(s), _mm256_set1_epi32(z));
                }
                for part in 0..4 {
                    let mut wv = [_mm256_setzero_ps(); NR];
                    for ((v, &wr), &(s, z)) in wv.iter_mut().zip(&w).zip(&params) {
                        *v = int_block_vec8::<DT>(wr.add(j / 32 * bb), 8 * part, s, z);
                    }
                    for (a, &xr) in acc.iter_mut().zip(&x) {
                        let xv = _mm256_loadu_ps(xr.add(j + 8 * part));
                        for (ar, &wr) in a.iter_mut().zip(&wv) {
                            *ar = _mm256_fmadd_ps(wr, xv, *ar);
                        }
                    }
                }
                j += 32;
            }
        }
        while j + 8 <= k {
            next.lines((j >> 3) * per_step, per_step);
            let mut wv = [_mm256_setzero_ps(); NR];
            for (v, &wr) in wv.iter_mut().zip(&w) {
                *v = wload8::<DT>(wr, j);
            }
            for (a, &xr) in acc.iter_mut().zip(&x) {
                let xv = _mm256_loadu_ps(xr.add(j));
                for (ar, &wr) in a.iter_mut().zip(&wv) {
                    *ar = _mm256_fmadd_ps(wr, xv, *ar);
                }
            }
            j += 8;
        }
        if j < k {
            let n = k - j;
            let mut wv = [_mm256_setzero_ps(); NR];
            for (v, &wr) in wv.iter_mut().zip(&w) {
                *v = load8_partial::<DT>(wr.add(j * es), n);
            }
            for (a, &xr) in acc.iter_mut().zip(&x) {
                let xv = load8_partial::<F32>(xr.add(j) as *const u8, n);
                for (ar, &wr) in a.iter_mut().zip(&wv) {
                    *ar = _mm256_fmadd_ps(wr, xv, *ar);
                }
            }
        }
        let mut res = [[0.0f32; NR]; MR];
        for (ri, ai) in res.iter_mut().zip(&acc) {
            for (o, a) in ri.iter_mut().zip(ai) {
                *o = hsum256(*a);
            }
        }
        res
    }
}

// ---------------------------------------------------------------- AVX-512 BF16

/// The bits of a vector as 32 bf16 values.
#[inline(always)]
unsafe fn as_bf16x32(v: __m512i) -> __m512bh {
    // SAFETY: both types are 512 bits of plain data.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
}

/// One `MR x NR` tile of bf16 weight rows with bf16 activation rows: per 32
/// elements one `vdpbf16ps` per (activation row, weight row), which adds
/// the two exact products of each lane's pair to its f32 accumulator; a
/// partial last vector is loaded with the missing elements zeroed; then
/// `hsum512`. The same sequence for every element whatever the tile.
#[inline(always)]
unsafe fn tile_dpbf16<const DT: u8, const MR: usize, const NR: usize>(
    w: [*const u8; NR],
    x: [*const u16; MR],
    k: usize,
    next: Prefetch,
) -> [[f32; NR]; MR] {
    let per_step = next.per_step(k / 32);
    // SAFETY: every row holds k elements (caller); loads stay below k (the
    // partial vector's masked-off elements are not accessed).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); NR]; MR];
        let mut j = 0;
        while j + 32 <= k {
            next.lines((j >> 5) * per_step, per_step);
            let mut wv = [_mm512_setzero_si512(); NR];
            for (v, &wr) in wv.iter_mut().zip(&w) {
                *v = _mm512_loadu_si512(wr.add(2 * j) as *const __m512i);
            }
            for (a, &xr) in acc.iter_mut().zip(&x) {
                let xv = as_bf16x32(_mm512_loadu_si512(xr.add(j) as *const __m512i));
                for (ar, &wr) in a.iter_mut().zip(&wv) {
                    *ar = _mm512_dpbf16_ps(*ar, as_bf16x32(wr), xv);
                }
            }
            j += 32;
        }
        if j < k {
            let mask: u32 = (1u32 << (k - j)) - 1;
            let mut wv = [_mm512_setzero_si512(); NR];
            for (v, &wr) in wv.iter_mut().zip(&w) {
                *v = _mm512_maskz_loadu_epi16(mask, wr.add(2 * j) as *const i16);
            }
            for (a, &xr) in acc.iter_mut().zip(&x) {
                let xv = as_bf16x32(_mm512_maskz_loadu_epi16(mask, xr.add(j) as *const i16));
                for (ar, &wr) in a.iter_mut().zip(&wv) {
                    *ar = _mm512_dpbf16_ps(*ar, as_bf16x32(wr), xv);
                }
            }
        }
        let mut res = [[0.0f32; NR]; MR];
        for (ri, ai) in res.iter_mut().zip(&acc) {
            for (o, a) in ri.iter_mut().zip(ai) {
                *o = hsum512(*a);
            }
        }
        res
    }
}

// ---------------------------------------------------------------- driver

/// Runs the tiles of one level over the whole output: blocks of [`NB`]
/// weight rows, tiles of at most `$mr` activation rows within, `$nr` weight
/// rows innermost; `$run!(n)` runs a tile of `n` activation rows.
macro_rules! drive {
    ($w:expr, $n_rows:expr, $k:expr, $x:expr, $m:expr, $out:expr, $tile:ident, $mrmax:expr, $nr:expr, [$($mr:literal),*]) => {{
        const NR: usize = $nr;
        let (n_rows, k, m, out) = ($n_rows, $k, $m, $out);
        let rb = row_bytes(DT, k);
        let wp: *const u8 = $w.as_ptr();
        let xp = $x.as_ptr();
        let mut b0 = 0;
        while b0 < n_rows {
            let b1 = (b0 + NB).min(n_rows);
            let mut i0 = 0;
            while i0 < m {
                let mr = (m - i0).min($mrmax);
                let mut r0 = b0;
                while r0 < b1 {
                    let nr = (b1 - r0).min(NR);
                    // Only when this pass over the weights is the only one.
                    let ahead = r0 + nr;
                    let next = Prefetch {
                        base: wp.wrapping_add(ahead * rb),
                        len: if m <= $mrmax {
                            n_rows.saturating_sub(ahead).min(NR) * rb
                        } else {
                            0
                        },
                    };
                    // SAFETY: rows r0..r0+nr of w and i0..i0+mr of x exist (a
                    // ragged edge repeats the last one); the output view
                    // holds every (i, r) written (caller).
                    unsafe {
                        let mut wr = [wp; NR];
                        for (r, p) in wr.iter_mut().enumerate() {
                            *p = wp.add((r0 + r.min(nr - 1)) * rb);
                        }
                        match mr {
                            $($mr => {
                                let mut xr = [xp; $mr];
                                for (i, p) in xr.iter_mut().enumerate() {
                                    *p = xp.add((i0 + i) * k);
                                }
                                let res = $tile::<DT, $mr, NR>(wr, xr, k, next);
                                for (i, row) in res.iter().enumerate() {
                                    for (r, v) in row.iter().enumerate().take(nr) {
                                        out.set(i0 + i, r0 + r, *v);
                                    }
                                }
                            })*
                            _ => unreachable!(),
                        }
                    }
                    r0 += nr;
                }
                i0 += mr;
            }
            b0 = b1;
        }
    }};
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn run512<const DT: u8>(
    w: &[u8],
    n_rows: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: OutMat,
) {
    drive!(
        w,
        n_rows,
        k,
        x,
        m,
        out,
        tile512,
        MR512,
        NR512,
        [1, 2, 3, 4, 5, 6]
    );
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run256<const DT: u8>(
    w: &[u8],
    n_rows: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: OutMat,
) {
    drive!(w, n_rows, k, x, m, out, tile256, MR256, NR256, [1, 2, 3, 4]);
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")]
unsafe fn run_dpbf16(w: &[u8], n_rows: usize, k: usize, x: &[u16], m: usize, out: OutMat) {
    const DT: u8 = BF16;
    drive!(
        w,
        n_rows,
        k,
        x,
        m,
        out,
        tile_dpbf16,
        MR512,
        NR512,
        [1, 2, 3, 4, 5, 6]
    );
}

/// Dot products of bf16 weights with bf16 activations (`x`: `m` rows of
/// `k` bf16 bit patterns), every `m`, batch-invariant (see
/// [`tile_dpbf16`]).
///
/// # Safety
/// The CPU must support AVX-512 F/BW/VL/DQ and BF16; lengths must satisfy
/// the module preconditions (with `x` of `m * k` elements).
pub unsafe fn dot_rows_bf16(w: &[u8], n_rows: usize, k: usize, x: &[u16], m: usize, out: OutMat) {
    // SAFETY: per this function's contract.
    unsafe { run_dpbf16(w, n_rows, k, x, m, out) }
}

/// True for the scaled block codes, which dequantize in registers.
pub(super) const fn scaled(dt: u8) -> bool {
    matches!(dt, F8S | U4S | U8S | F4S)
}

thread_local! {
    /// Dequantized weight rows of the panel path, reused across calls.
    static PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Writes rows `r0..r0 + rows` of `w` (scaled code `DT`), dequantized, to `dst`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn panel512<const DT: u8>(w: &[u8], r0: usize, rows: usize, k: usize, dst: &mut [f32]) {
    let rb = row_bytes(DT, k);
    // SAFETY: rows r0..r0+rows of k elements exist in w (caller); dst holds rows * k.
    unsafe {
        for r in 0..rows {
            let row = w.as_ptr().add((r0 + r) * rb);
            let out = dst.as_mut_ptr().add(r * k);
            let mut j = 0;
            while j < k {
                _mm512_storeu_ps(out.add(j), wload16::<DT>(row, j));
                j += 16;
            }
        }
    }
}

/// [`panel512`] with AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn panel256<const DT: u8>(w: &[u8], r0: usize, rows: usize, k: usize, dst: &mut [f32]) {
    let rb = row_bytes(DT, k);
    // SAFETY: as in panel512.
    unsafe {
        for r in 0..rows {
            let row = w.as_ptr().add((r0 + r) * rb);
            let out = dst.as_mut_ptr().add(r * k);
            let mut j = 0;
            while j < k {
                _mm256_storeu_ps(out.add(j), wload8::<DT>(row, j));
                j += 8;
            }
        }
    }
}

/// The panel path of the scaled formats for more activation rows than one
/// tile holds: blocks of [`NB`] weight rows are dequantized once into f32
/// (the same values the in-register path computes) and multiplied by the
/// f32 kernel, whose per-element sequence is the in-register path's, so the
/// results are bit-identical to it.
///
/// # Safety
/// As [`dot_rows`], with `DT` a scaled code.
unsafe fn run_panels<const DT: u8>(
    avx512: bool,
    w: &[u8],
    n_rows: usize,
    k: usize,
    x: &[f32],
    m: usize,
    out: OutMat,
) {
    PANEL.with(|p| {
        let mut panel = p.borrow_mut();
        let mut b0 = 0;
        while b0 < n_rows {
            let rows = (n_rows - b0).min(NB);
            panel.resize(rows * k, 0.0);
            let bytes: &[u8] = {
                // SAFETY: features per the contract; rows b0..b0+rows exist.
                unsafe {
                    if avx512 {
                        panel512::<DT>(w, b0, rows, k, &mut panel);
                    } else {
                        panel256::<DT>(w, b0, rows, k, &mut panel);
                    }
                    std::slice::from_raw_parts(panel.as_ptr() as *const u8, rows * k * 4)
                }
            };
            let view = OutMat {
                // SAFETY: column b0 is inside every output row (contract).
                ptr: unsafe { out.ptr.add(b0) },
                stride: out.stride,
            };
            // SAFETY: the panel holds `rows` f32 rows of k; the view covers
            // columns b0..b0+rows of the m output rows.
            unsafe {
                if avx512 {
                    run512::<F32>(bytes, rows, k, x, m, view);
                } else {
                    run256::<F32>(bytes, rows, k, x, m, view);
                }
            }
            b0 += rows;
        }
    });
}

/// Dot products of float weights with f32 activations (every `m`).
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
    let tile_rows = if avx512 { MR512 } else { MR256 };
    if scaled(dt) && m > tile_rows {
        // SAFETY: per this function's contract.
        unsafe {
            match dt {
                F8S => run_panels::<F8S>(avx512, w, n_rows, k, x, m, out),
                U4S => run_panels::<U4S>(avx512, w, n_rows, k, x, m, out),
                U8S => run_panels::<U8S>(avx512, w, n_rows, k, x, m, out),
                _ => run_panels::<F4S>(avx512, w, n_rows, k, x, m, out),
            }
        }
        return;
    }
    // SAFETY: features and lengths per this function's contract.
    unsafe {
        match (avx512, dt) {
            (true, F32) => run512::<F32>(w, n_rows, k, x, m, out),
            (true, F16) => run512::<F16>(w, n_rows, k, x, m, out),
            (true, F8S) => run512::<F8S>(w, n_rows, k, x, m, out),
            (true, U4S) => run512::<U4S>(w, n_rows, k, x, m, out),
            (true, U8S) => run512::<U8S>(w, n_rows, k, x, m, out),
            (true, F4S) => run512::<F4S>(w, n_rows, k, x, m, out),
            (true, _) => run512::<BF16>(w, n_rows, k, x, m, out),
            (false, F32) => run256::<F32>(w, n_rows, k, x, m, out),
            (false, F16) => run256::<F16>(w, n_rows, k, x, m, out),
            (false, F8S) => run256::<F8S>(w, n_rows, k, x, m, out),
            (false, U4S) => run256::<U4S>(w, n_rows, k, x, m, out),
            (false, U8S) => run256::<U8S>(w, n_rows, k, x, m, out),
            (false, F4S) => run256::<F4S>(w, n_rows, k, x, m, out),
            (false, _) => run256::<BF16>(w, n_rows, k, x, m, out),
        }
    }
}
