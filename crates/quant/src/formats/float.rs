//! Float weight formats: F32, F16 and BF16 (little-endian, one element per "block").
//!
//! Conversions: f16 via `half` (round to nearest even, as ggml's
//! `GGML_FP32_TO_FP16`); bf16 as ggml's `GGML_FP32_TO_BF16` (round to nearest
//! even, NaN kept quiet). The scalar dot converts weights to f32 and
//! accumulates in eight f32 lanes (the order the compiler can vectorize),
//! which keeps it within the crate's float contract (1e-5 relative to an f64
//! dot of the same values).

use crate::DType;

/// Reads element `i` of a float row as f32.
#[inline(always)]
pub fn load(dtype: DType, w: &[u8], i: usize) -> f32 {
    match dtype {
        DType::F32 => f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        DType::F16 => half::f16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32(),
        DType::BF16 => f32::from_bits((u16::from_le_bytes([w[2 * i], w[2 * i + 1]]) as u32) << 16),
        _ => 0.0,
    }
}

/// ggml's `ggml_compute_fp32_to_bf16`.
#[inline(always)]
pub fn f32_to_bf16(v: f32) -> u16 {
    let u = v.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        // NaN: keep it quiet.
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

/// Converts f32 values to `dtype` bytes.
pub fn quantize(dtype: DType, x: &[f32], y: &mut [u8]) {
    match dtype {
        DType::F32 => {
            for (o, v) in y.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::F16 => {
            for (o, v) in y.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&half::f16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        DType::BF16 => {
            for (o, v) in y.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f32_to_bf16(*v).to_le_bytes());
            }
        }
        _ => {}
    }
}

/// Converts `dtype` bytes to f32.
pub fn dequantize(dtype: DType, w: &[u8], y: &mut [f32]) {
    for (i, o) in y.iter_mut().enumerate() {
        *o = load(dtype, w, i);
    }
}

/// Scalar dot of a float weight row with an f32 activation row.
pub fn dot_row(dtype: DType, w: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let k = x.len();
    let main = k - k % 8;
    let mut i = 0;
    while i < main {
        for l in 0..8 {
            acc[l] += load(dtype, w, i + l) * x[i + l];
        }
        i += 8;
    }
    let mut tail = 0.0f32;
    for j in main..k {
        tail += load(dtype, w, j) * x[j];
    }
    let s0 = (acc[0] + acc[4]) + (acc[1] + acc[5]);
    let s1 = (acc[2] + acc[6]) + (acc[3] + acc[7]);
    s0 + s1 + tail
}
