//! Scalar reference implementations of every format, one module per family.
//!
//! Owns the byte layouts (exactly ggml's `block_*` structs, little-endian),
//! the reference quantizers (ports of ggml's `quantize_row_*_ref`), the
//! dequantizers (same float operations in the same order as ggml's
//! `dequantize_row_*`, so results are bit-identical) and the scalar dot
//! products (ggml's `ggml_vec_dot_*_generic`: integer sums per block, f32
//! accumulation across blocks). The SIMD kernels are tested against these.
//!
//! Functions here take whole blocks; lengths are validated by the callers in
//! `lib.rs`, and slicing is bounds-checked, so bad lengths can only panic in
//! debug builds of internal bugs, never read out of bounds.

pub mod float;
pub mod kquant_ref;
pub mod kquants;
pub mod legacy;
pub mod scaled;

/// Reads the little-endian f16 at `b[off..off+2]` as f32.
#[inline(always)]
pub fn rd_f16(b: &[u8], off: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Writes `v` rounded to f16 at `b[off..off+2]`.
#[inline(always)]
pub fn wr_f16(b: &mut [u8], off: usize, v: f32) {
    let bits = half::f16::from_f32(v).to_bits().to_le_bytes();
    b[off] = bits[0];
    b[off + 1] = bits[1];
}

/// `v` rounded to the nearest f16 (ties to even) and back.
#[inline(always)]
pub fn f16_round(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

/// ggml's `nearest_int`: round to nearest, ties to even, valid for |x| < 2^22.
/// Out-of-range or non-finite input gives a meaningless value but never panics.
#[inline(always)]
pub fn nearest_int(x: f32) -> i32 {
    let val = x + 12_582_912.0;
    let i = val.to_bits() as i32;
    (i & 0x007f_ffff) - 0x0040_0000
}
