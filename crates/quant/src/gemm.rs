//! Tiled GEMM of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with
//! Q8_0/Q8_1 activations, for any number of activation rows (it is
//! `dot_rows`'s path for these formats at every `m`, decode included): the
//! panel layout, its portable packer, and the output view shared by every
//! kernel.
//!
//! Design. Weights stay in ggml's block layout in memory (so embedding
//! lookups, downloads and the row kernels see the GGUF bytes). The
//! kernels in `x86::gemm` walk the weight rows in panels of [`NR`] = 32 rows
//! and up to [`KC_BLOCKS`] blocks of `k`; each panel is packed once per call
//! into a stack buffer ([`Panel`]) and then multiplied with every activation
//! row, `MR` rows at a time, so the unpacking cost is shared by all `m` rows.
//!
//! Panel layout (`q`, 1024 bytes per block): byte
//! `b*1024 + s*128 + g*64 + l*4 + t` is quant `4s + t` (`s` in 0..8, `t` in
//! 0..4) of block `b` of panel row `16g + l`. One aligned 64-byte load is then
//! the `vpdpbusd` weight operand of step `s` for 16 rows, and the matching
//! activation operand is the 4-byte word at `4s` of the activation block,
//! broadcast. `d[b*32 + row]` and `m[b*32 + row]` hold the block scale and
//! min as f32. Quants are stored unsigned (the raw 4/5-bit values), except
//! Q8_0: `q ^ 0x80` (= q + 128) for VNNI, and signed for AVX2, which uses the
//! `vpsignb` trick. The formats with an offset (Q4_0: 8, Q5_0: 16, Q8_0 with
//! VNNI: 128) are corrected exactly in the integer domain by starting each
//! block's sum at `-(offset * Σ activation quants)` (see [`bias_shift`]).
//! Rows past the end of the weights are packed as zeros (scale 0).
//!
//! Numerics: per (activation row, weight row, block) the integer dot is
//! exact, then `sum * (d_w * d_a)` (+ `m_w * s_a` for Q4_1/Q5_1) accumulates
//! in f32, as ggml's dots do; only the order of f32 additions differs from
//! the scalar reference. That order is fixed per output element and does not
//! depend on `m`, on the row tile (`MR` and its tails) or on the panel an
//! element falls in: for each chunk of [`KC_BLOCKS`] blocks, `f = 0`, then
//! block by block `f = fma(f32(sum), d_w * d_a, f)` (and `f = fma(m_w, s_a,
//! f)`), and the chunk sums are added in order. `x86::gemv` reproduces it
//! exactly without packing (the AVX2 level's small-`m` path).
//!
//! Invariants: [`Panel`] lives on the stack of one call and is written before
//! it is read (only the blocks packed by the current chunk are read).

use crate::DType;

/// Weight rows per packed panel (two 16-lane vectors).
pub(crate) const NR: usize = 32;
/// Most blocks of `k` per packed panel: 24 blocks (768 values) keep the
/// panel (24 KiB of quants) in L1 next to the activation rows.
pub(crate) const KC_BLOCKS: usize = 24;
/// Panel bytes per block.
pub(crate) const QB: usize = 32 * NR;

/// A packed panel (see the module documentation).
#[repr(C, align(64))]
pub(crate) struct Panel {
    pub q: [u8; KC_BLOCKS * QB],
    pub d: [f32; KC_BLOCKS * NR],
    pub m: [f32; KC_BLOCKS * NR],
}

/// Format codes shared with the x86 kernels.
pub(crate) const Q4_0: u8 = 0;
pub(crate) const Q4_1: u8 = 1;
pub(crate) const Q5_0: u8 = 2;
pub(crate) const Q5_1: u8 = 3;
pub(crate) const Q8_0: u8 = 4;

/// The format code of a dtype the tiled path supports.
pub(crate) fn fmt_of(dtype: DType) -> Option<u8> {
    Some(match dtype {
        DType::Q4_0 => Q4_0,
        DType::Q4_1 => Q4_1,
        DType::Q5_0 => Q5_0,
        DType::Q5_1 => Q5_1,
        DType::Q8_0 => Q8_0,
        _ => return None,
    })
}

/// True if the tiled GEMM path handles weights of `dtype` (at the AVX2 and
/// AVX-512 levels; the scalar level always uses the row kernels).
pub fn gemm_supported(dtype: DType) -> bool {
    fmt_of(dtype).is_some()
}

/// Bytes per block of a format code.
pub(crate) const fn block_bytes(f: u8) -> usize {
    match f {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    }
}

/// True for the formats with a min (`x = d*q + m`).
pub(crate) const fn has_min(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

/// Each block's integer sum starts at `-(Σ activation quants << shift)`;
/// `None` for formats stored without an offset.
pub(crate) const fn bias_shift(f: u8, vnni: bool) -> Option<u32> {
    match f {
        Q4_0 => Some(3),
        Q5_0 => Some(4),
        Q8_0 if vnni => Some(7),
        _ => None,
    }
}

/// Unpacks one ggml block to its 32 stored quants (as the panel encodes
/// them) and returns `(d, m)`.
#[inline(always)]
fn unpack_block(f: u8, vnni: bool, b: &[u8], q: &mut [u8; 32]) -> (f32, f32) {
    let h = |o: usize| half::f16::from_bits(u16::from_le_bytes([b[o], b[o + 1]])).to_f32();
    match f {
        Q8_0 => {
            let x = if vnni { 0x80 } else { 0 };
            for (o, &v) in q.iter_mut().zip(&b[2..34]) {
                *o = v ^ x;
            }
            (h(0), 0.0)
        }
        _ => {
            let qo = match f {
                Q4_0 => 2,
                Q4_1 => 4,
                Q5_0 => 6,
                _ => 8,
            };
            for j in 0..16 {
                q[j] = b[qo + j] & 0x0F;
                q[j + 16] = b[qo + j] >> 4;
            }
            if f == Q5_0 || f == Q5_1 {
                let ho = if f == Q5_0 { 2 } else { 4 };
                let qh = u32::from_le_bytes([b[ho], b[ho + 1], b[ho + 2], b[ho + 3]]);
                for (j, v) in q.iter_mut().enumerate() {
                    *v |= (((qh >> j) & 1) << 4) as u8;
                }
            }
            (h(0), if has_min(f) { h(2) } else { 0.0 })
        }
    }
}

/// Packs blocks `kb0..kb0+nblk` of the first `rows` (at most [`NR`]) rows of
/// `w` (rows of `rb` bytes) into `p`; rows `rows..NR` become zeros.
///
/// # Safety
/// `p` must be valid for writes of a whole [`Panel`]; `nblk <= KC_BLOCKS`,
/// and every row `< rows` must hold blocks `kb0..kb0+nblk` (checked with
/// slicing, so a violation panics rather than reading out of bounds).
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_portable(
    f: u8,
    vnni: bool,
    w: &[u8],
    rb: usize,
    rows: usize,
    kb0: usize,
    nblk: usize,
    p: *mut Panel,
) {
    for row in 0..NR {
        // SAFETY: per this function's contract.
        unsafe { pack_row(f, vnni, w, rb, row, rows, kb0, nblk, p) };
    }
}

/// Packs panel row `row` as [`pack_portable`] does (zeros when `row >=
/// rows`); the SIMD packers use it for the rows of a partial panel.
///
/// # Safety
/// As [`pack_portable`]; `row < NR`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn pack_row(
    f: u8,
    vnni: bool,
    w: &[u8],
    rb: usize,
    row: usize,
    rows: usize,
    kb0: usize,
    nblk: usize,
    p: *mut Panel,
) {
    let bb = block_bytes(f);
    let mut q = [0u8; 32];
    // SAFETY: `p` is writable (contract); all offsets are below the array
    // lengths because nblk <= KC_BLOCKS and row < NR.
    unsafe {
        let pq = std::ptr::addr_of_mut!((*p).q) as *mut u8;
        let pd = std::ptr::addr_of_mut!((*p).d) as *mut f32;
        let pm = std::ptr::addr_of_mut!((*p).m) as *mut f32;
        let (g, l) = (row / 16, row % 16);
        for b in 0..nblk {
            let (d, m) = if row < rows {
                let o = row * rb + (kb0 + b) * bb;
                unpack_block(f, vnni, &w[o..o + bb], &mut q)
            } else {
                q = [0; 32];
                (0.0, 0.0)
            };
            for s in 0..8 {
                let dst = pq.add(b * QB + s * 128 + g * 64 + l * 4);
                std::ptr::copy_nonoverlapping(q.as_ptr().add(4 * s), dst, 4);
            }
            *pd.add(b * NR + row) = d;
            *pm.add(b * NR + row) = m;
        }
    }
}

/// A strided f32 output matrix: element `(i, r)` lives at `ptr + i*stride + r`.
/// Built only after the callers checked that every element the kernel
/// writes is in bounds and exclusively theirs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OutMat {
    pub ptr: *mut f32,
    pub stride: usize,
}

impl OutMat {
    /// Writes element `(i, r)`.
    ///
    /// # Safety
    /// `(i, r)` must be inside the matrix the view was built for.
    #[inline(always)]
    pub unsafe fn set(self, i: usize, r: usize, v: f32) {
        // SAFETY: per the contract.
        unsafe { *self.ptr.add(i * self.stride + r) = v }
    }

    /// The view starting at row `i0`.
    ///
    /// # Safety
    /// Row `i0` must be inside the matrix (or one past its last row).
    #[inline(always)]
    pub unsafe fn starting_at(self, i0: usize) -> Self {
        Self {
            // SAFETY: per the contract.
            ptr: unsafe { self.ptr.add(i0 * self.stride) },
            stride: self.stride,
        }
    }
}
