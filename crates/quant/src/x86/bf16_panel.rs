//! The `amx-bf16` matmul of the scaled weight blocks (`f8_s32`, `u4_s32`,
//! `u8_s32`, `f4_s16`; [`arbor_engine_core::QuantMatmul::AmxBf16`]): the
//! weights are dequantized to bf16 and meet the packed bf16 activations in
//! AMX tiles (the kernel of bf16 weights). Up to 32 activation rows, each
//! 16 x 32 weight tile is converted into an L1 buffer right before the AMX
//! loads it (`x86::amx::dot_rows_fused`: the conversion of one step
//! overlaps the products of the previous one); beyond that, blocks of
//! [`NB`] weight rows are converted once into a bf16 panel (kept in L2) that
//! every activation tile reuses (`x86::amx::dot_rows`).
//!
//! Owns: the per-thread panel buffer, the per-row value tables and the
//! dequantization into bf16 ([`block_bf16`], used by both paths).
//!
//! Numerics: each weight is its f32 dequantization (the operations of
//! `x86::float`, so the bits of `formats::scaled`) rounded to bf16 by
//! `vcvtne2ps2bf16` (round to nearest even; an f32 subnormal, far below any
//! weight a scale can produce, becomes a signed zero); `u4_s32` rounds its
//! block's 16 possible values once (`vcvtneps2bf16`, the same rounding) and
//! looks each element up with `vpermw`. An output element is then exactly
//! what the bf16 AMX path computes for weights holding those bf16 values,
//! on either path (the same tile products in the same order): it depends
//! only on its weight row and its activation row, never on `m`, the other
//! rows or the panel it falls in.
//!
//! Invariants: `k` is a multiple of 32 (the activations are packed only
//! then) and every buffer is written before it is read.

use super::float::{self, F4S, F8S, U4S, U4Table, U8S};
use super::{Prefetch, amx};
use crate::DType;
use crate::gemm::OutMat;
use std::arch::x86_64::*;

/// Weight rows per panel: 64 rows of `k = 1536` are 192 KiB of bf16.
const NB: usize = 64;
/// Rows of an AMX weight tile: a panel holds at least this many whenever
/// the call does (fewer would be padded by a copy).
const TILE_ROWS: usize = 16;
/// Most activation rows of the fused path (two activation tiles, so every
/// weight tile is converted once); more rows take the panels, which
/// convert each weight once for all of them.
const FUSED_ROWS: usize = 32;

thread_local! {
    /// Dequantized bf16 weight rows, reused across calls.
    static PANEL: std::cell::RefCell<Vec<u16>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A row's `u4_s32` value table, as f32 and as [`u4_bf16_table`] (unused
/// by the other formats).
#[derive(Clone, Copy)]
struct RowTable {
    f32: U4Table,
    bf16: __m512i,
}

impl RowTable {
    #[inline(always)]
    fn empty() -> Self {
        Self {
            f32: U4Table::empty(),
            // SAFETY: AVX-512 F is enabled wherever the kernels run (callers).
            bf16: unsafe { _mm512_setzero_si512() },
        }
    }
}

/// Elements `j..j + 32` (`j` a multiple of 32) of the row at `row` (scaled
/// code `DT`), dequantized and rounded to bf16; `u4_s32` rows look them up
/// in `t`, rebuilt when the block's scale or zero point changes.
#[inline(always)]
unsafe fn block_bf16<const DT: u8>(row: *const u8, j: usize, t: &mut RowTable) -> __m512i {
    // SAFETY: the caller guarantees the row holds elements j..j+32 and
    // enables AVX-512 F/BW/VL/DQ/BF16 and F16C.
    unsafe {
        match DT {
            U4S => {
                let b = row.add(j / 32 * 20);
                if t.f32.update(b) {
                    t.bf16 = u4_bf16_table(&t.f32);
                }
                u4_block_bf16(b, t.bf16)
            }
            F4S => bf16x32([
                float::wload16::<DT>(row, j),
                float::wload16::<DT>(row, j + 16),
            ]),
            _ => bf16x32(float::wload32::<DT>(row, j)),
        }
    }
}

/// Writes rows `r0..r0 + rows` of `w` (scaled code `DT`), dequantized and
/// rounded to bf16, to `dst`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn panel<const DT: u8>(w: &[u8], r0: usize, rows: usize, k: usize, dst: &mut [u16]) {
    let rb = float::row_bytes(DT, k);
    // SAFETY: rows r0..r0+rows of k elements (k % 32 == 0) exist in `w`
    // (caller) and `dst` holds rows * k values; every load stays inside
    // the row's blocks and every store inside its output row.
    unsafe {
        for r in 0..rows {
            let row = w.as_ptr().add((r0 + r) * rb);
            let out = dst.as_mut_ptr().add(r * k);
            let mut table = RowTable::empty();
            let mut j = 0;
            while j < k {
                let h = block_bf16::<DT>(row, j, &mut table);
                _mm512_storeu_si512(out.add(j) as *mut __m512i, h);
                j += 32;
            }
        }
    }
}

/// The weight tiles of [`fused`]: rows of `w` (scaled code `DT`) converted
/// by [`block_bf16`], one value table per row of each group of a pair.
struct Tiles<const DT: u8> {
    w: *const u8,
    row_bytes: usize,
    tables: [RowTable; 2 * TILE_ROWS],
}

impl<const DT: u8> amx::TileSource for Tiles<DT> {
    #[inline(always)]
    unsafe fn fill(&mut self, r0: usize, s: usize, slot: usize, dst: *mut u16) {
        // SAFETY: rows r0..r0+16 and step s exist (the trait's contract);
        // the features are enabled by `fused`, which this inlines into.
        unsafe {
            for r in 0..TILE_ROWS {
                let row = self.w.add((r0 + r) * self.row_bytes);
                let h = block_bf16::<DT>(row, s * 32, &mut self.tables[slot * TILE_ROWS + r]);
                _mm512_store_si512(dst.add(r * 32) as *mut __m512i, h);
            }
        }
    }

    #[inline(always)]
    fn rows(&self, r0: usize, r1: usize) -> Prefetch {
        Prefetch {
            base: self.w.wrapping_add(r0 * self.row_bytes),
            len: (r1 - r0) * self.row_bytes,
        }
    }
}

/// The product for up to 32 activation rows: each weight tile is converted
/// right before the AMX loads it ([`amx::dot_rows_fused`]), the same
/// values as the panels hold, so the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn fused<const DT: u8>(
    w: &[u8],
    n_rows: usize,
    k: usize,
    packed: &[u16],
    m: usize,
    out: OutMat,
) {
    let mut tiles = Tiles::<DT> {
        w: w.as_ptr(),
        row_bytes: float::row_bytes(DT, k),
        tables: [RowTable::empty(); 2 * TILE_ROWS],
    };
    // SAFETY: per `dot_rows`'s contract, with n_rows >= 16 and m <= 32
    // (checked by the caller).
    unsafe { amx::dot_rows_fused(n_rows, k, packed, m, out, &mut tiles) };
}

/// 32 f32 values rounded to bf16, in order.
#[inline(always)]
unsafe fn bf16x32([lo, hi]: [__m512; 2]) -> __m512i {
    // SAFETY: AVX-512 BF16 is enabled in every caller; both types are 512
    // bits of plain data.
    unsafe { std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi, lo)) }
}

/// The table's 16 values rounded to bf16, twice (32 words): `vpermw` reads
/// an index's low 5 bits, so a byte's bit 4 (its high nibble's lowest bit)
/// then picks the same value as without it.
#[inline(always)]
unsafe fn u4_bf16_table(t: &U4Table) -> __m512i {
    // SAFETY: AVX-512 F and BF16 are enabled in every caller; both types
    // are 256 bits of plain data.
    unsafe {
        let h = std::mem::transmute::<__m256bh, __m256i>(_mm512_cvtneps_pbh(t.values()));
        _mm512_broadcast_i64x4(h)
    }
}

/// The 32 elements of the `u4_s32` block at `b` as bf16, looked up in its
/// [`u4_bf16_table`]: byte `i` holds element `i` in its low nibble and
/// element `i + 16` in its high one. The values are the table's, which are
/// `vcvtneps2bf16` of the f32 elements, so the same bits as rounding those.
#[inline(always)]
unsafe fn u4_block_bf16(b: *const u8, table: __m512i) -> __m512i {
    // SAFETY: the 16 quant bytes at `b` are readable (caller) and AVX-512
    // F/BW are enabled.
    unsafe {
        let bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(b as *const __m128i));
        let high = _mm256_srli_epi16::<4>(bytes);
        let idx = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(bytes), high);
        _mm512_permutexvar_epi16(idx, table)
    }
}

/// Rows of the panel that starts `done` rows into a call of `n_rows`: [`NB`],
/// or what is left, leaving no last panel under [`TILE_ROWS`] rows when
/// the call has that many.
fn panel_rows(n_rows: usize, done: usize) -> usize {
    let left = n_rows - done;
    if left <= NB {
        left
    } else if left - NB < TILE_ROWS {
        left - TILE_ROWS
    } else {
        NB
    }
}

/// `out[i][r] = dot(bf16(w row r), packed row i)` for the scaled `dtype`
/// (see the module documentation).
///
/// # Safety
/// The CPU has the `Amx` level (AVX-512 BF16, AMX with the tile
/// permission); `w` holds `n_rows` rows of `k` elements of `dtype` (`k % 32
/// == 0`), `packed` the activations of `m` rows packed by
/// `x86::amx::pack_acts`; `out` holds every `(i, r)` for `i < m`, `r <
/// n_rows`, which no other thread accesses.
pub(crate) unsafe fn dot_rows(
    dtype: DType,
    w: &[u8],
    n_rows: usize,
    k: usize,
    packed: &[u16],
    m: usize,
    out: OutMat,
) {
    let dt = float::code(dtype);
    debug_assert!(float::scaled(dt) && k.is_multiple_of(32));
    // SAFETY: per this function's contract.
    unsafe {
        match dt {
            F8S => product::<F8S>(w, n_rows, k, packed, m, out),
            U4S => product::<U4S>(w, n_rows, k, packed, m, out),
            U8S => product::<U8S>(w, n_rows, k, packed, m, out),
            _ => product::<F4S>(w, n_rows, k, packed, m, out),
        }
    }
}

/// [`dot_rows`] for the scaled code `DT`: the fused path up to
/// [`FUSED_ROWS`] activation rows, else panels of [`NB`] rows.
///
/// # Safety
/// As [`dot_rows`].
unsafe fn product<const DT: u8>(
    w: &[u8],
    n_rows: usize,
    k: usize,
    packed: &[u16],
    m: usize,
    out: OutMat,
) {
    if n_rows >= TILE_ROWS && m <= FUSED_ROWS {
        // SAFETY: per this function's contract, with the fused path's bounds.
        unsafe { fused::<DT>(w, n_rows, k, packed, m, out) };
        return;
    }
    PANEL.with(|p| {
        let mut buf = p.borrow_mut();
        let mut b0 = 0;
        while b0 < n_rows {
            let rows = panel_rows(n_rows, b0);
            buf.resize(rows * k, 0);
            // SAFETY: the features per the contract; rows b0..b0+rows exist.
            unsafe { panel::<DT>(w, b0, rows, k, &mut buf) };
            // SAFETY: the panel holds `rows` rows of k bf16 values.
            let bytes =
                unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, rows * k * 2) };
            let view = OutMat {
                // SAFETY: column b0 is inside every output row (contract).
                ptr: unsafe { out.ptr.add(b0) },
                stride: out.stride,
            };
            // SAFETY: AMX per the contract; the view covers columns
            // b0..b0+rows of the m output rows.
            unsafe { amx::dot_rows(bytes, rows, k, packed, m, view) };
            b0 += rows;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn panels_cover_the_rows_and_none_but_a_small_call_is_under_a_tile() {
        for n in 1..300 {
            let (mut done, mut sizes) = (0, Vec::new());
            while done < n {
                let r = panel_rows(n, done);
                assert!(r > 0 && r <= NB);
                sizes.push(r);
                done += r;
            }
            assert_eq!(done, n);
            if n >= TILE_ROWS {
                assert!(sizes.iter().all(|&r| r >= TILE_ROWS), "{n}: {sizes:?}");
            }
        }
    }
}
