//! The 32-element formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1.
//!
//! Layouts (ggml `block_*`, all little-endian):
//! - Q4_0 (18 B): `d: f16, qs[16]`; x = d * (nibble - 8); element j in the low
//!   nibble of `qs[j]`, element j+16 in the high nibble.
//! - Q4_1 (20 B): `d: f16, m: f16, qs[16]`; x = d * nibble + m.
//! - Q5_0 (22 B): `d: f16, qh: u32, qs[16]`; fifth bit of element j is bit j of `qh`;
//!   x = d * (q - 16).
//! - Q5_1 (24 B): `d: f16, m: f16, qh: u32, qs[16]`; x = d * q + m.
//! - Q8_0 (34 B): `d: f16, qs[32]: i8`; x = d * q.
//! - Q8_1 (36 B): `d: f16, s: f16, qs[32]: i8`; x = d * q, s = d * sum(q).

use super::{rd_f16, wr_f16};
use crate::DType;

/// Decodes the integer quants of one block into `q` and returns `(d, m)`
/// (`m` is 0 for the symmetric formats). The value of element j is
/// `d * q[j] + m` for every format.
#[inline(always)]
pub fn block_ints(dtype: DType, b: &[u8], q: &mut [i8; 32]) -> (f32, f32) {
    match dtype {
        DType::Q4_0 => {
            for j in 0..16 {
                q[j] = (b[2 + j] & 0x0F) as i8 - 8;
                q[j + 16] = (b[2 + j] >> 4) as i8 - 8;
            }
            (rd_f16(b, 0), 0.0)
        }
        DType::Q4_1 => {
            for j in 0..16 {
                q[j] = (b[4 + j] & 0x0F) as i8;
                q[j + 16] = (b[4 + j] >> 4) as i8;
            }
            (rd_f16(b, 0), rd_f16(b, 2))
        }
        DType::Q5_0 | DType::Q5_1 => {
            let (qh_off, qs_off) = if dtype == DType::Q5_0 { (2, 6) } else { (4, 8) };
            let qh = u32::from_le_bytes([b[qh_off], b[qh_off + 1], b[qh_off + 2], b[qh_off + 3]]);
            let off = if dtype == DType::Q5_0 { 16 } else { 0 };
            for j in 0..16 {
                let h0 = (((qh >> j) << 4) & 0x10) as u8;
                let h1 = ((qh >> (j + 12)) & 0x10) as u8;
                q[j] = (((b[qs_off + j] & 0x0F) | h0) as i8) - off;
                q[j + 16] = (((b[qs_off + j] >> 4) | h1) as i8) - off;
            }
            let m = if dtype == DType::Q5_1 {
                rd_f16(b, 2)
            } else {
                0.0
            };
            (rd_f16(b, 0), m)
        }
        DType::Q8_0 | DType::Q8_1 => {
            let qs_off = if dtype == DType::Q8_0 { 2 } else { 4 };
            for j in 0..32 {
                q[j] = b[qs_off + j] as i8;
            }
            (rd_f16(b, 0), 0.0)
        }
        _ => (0.0, 0.0),
    }
}

/// Dequantizes one block with ggml's float operations.
pub fn dequantize_block(dtype: DType, b: &[u8], y: &mut [f32]) {
    let mut q = [0i8; 32];
    let (d, m) = block_ints(dtype, b, &mut q);
    match dtype {
        DType::Q4_1 | DType::Q5_1 => {
            for (o, &v) in y.iter_mut().zip(q.iter()) {
                *o = v as f32 * d + m;
            }
        }
        _ => {
            for (o, &v) in y.iter_mut().zip(q.iter()) {
                *o = v as f32 * d;
            }
        }
    }
}

fn amax_max(x: &[f32]) -> (f32, f32) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's `(int8_t)(float)` followed by the caller's clamp; saturating in Rust.
#[inline(always)]
fn trunc_i8(v: f32) -> i8 {
    v as i8
}

/// Quantizes one block of 32 values as ggml's `quantize_row_*_ref`.
pub fn quantize_block(dtype: DType, x: &[f32], y: &mut [u8]) {
    match dtype {
        DType::Q4_0 => {
            let (_, max) = amax_max(x);
            let d = max / -8.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            wr_f16(y, 0, d);
            for j in 0..16 {
                let x0 = x[j] * id;
                let x1 = x[16 + j] * id;
                let xi0 = (trunc_i8(x0 + 8.5) as u8).min(15);
                let xi1 = (trunc_i8(x1 + 8.5) as u8).min(15);
                y[2 + j] = xi0 | (xi1 << 4);
            }
        }
        DType::Q4_1 => {
            let (min, max) = min_max(x);
            let d = (max - min) / 15.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            wr_f16(y, 0, d);
            wr_f16(y, 2, min);
            for j in 0..16 {
                let x0 = (x[j] - min) * id;
                let x1 = (x[16 + j] - min) * id;
                let xi0 = (trunc_i8(x0 + 0.5) as u8).min(15);
                let xi1 = (trunc_i8(x1 + 0.5) as u8).min(15);
                y[4 + j] = xi0 | (xi1 << 4);
            }
        }
        DType::Q5_0 => {
            let (_, max) = amax_max(x);
            let d = max / -16.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            wr_f16(y, 0, d);
            let mut qh = 0u32;
            for j in 0..16 {
                let x0 = x[j] * id;
                let x1 = x[16 + j] * id;
                let xi0 = (trunc_i8(x0 + 16.5) as u8).min(31);
                let xi1 = (trunc_i8(x1 + 16.5) as u8).min(31);
                y[6 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
                qh |= (((xi0 & 0x10) >> 4) as u32) << j;
                qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
            }
            y[2..6].copy_from_slice(&qh.to_le_bytes());
        }
        DType::Q5_1 => {
            let (min, max) = min_max(x);
            let d = (max - min) / 31.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            wr_f16(y, 0, d);
            wr_f16(y, 2, min);
            let mut qh = 0u32;
            for j in 0..16 {
                let x0 = (x[j] - min) * id;
                let x1 = (x[16 + j] - min) * id;
                // C: (uint8_t)(x + 0.5f); values are 0..=31 for finite input.
                let xi0 = (x0 + 0.5) as u8;
                let xi1 = (x1 + 0.5) as u8;
                y[8 + j] = (xi0 & 0x0F) | ((xi1 & 0x0F) << 4);
                qh |= (((xi0 & 0x10) >> 4) as u32) << j;
                qh |= (((xi1 & 0x10) >> 4) as u32) << (j + 16);
            }
            y[4..8].copy_from_slice(&qh.to_le_bytes());
        }
        DType::Q8_0 | DType::Q8_1 => {
            let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d != 0.0 { 1.0 / d } else { 0.0 };
            wr_f16(y, 0, d);
            let off = if dtype == DType::Q8_0 { 2 } else { 4 };
            let mut sum = 0i32;
            for j in 0..32 {
                let q = (x[j] * id).round() as i8;
                y[off + j] = q as u8;
                sum += q as i32;
            }
            if dtype == DType::Q8_1 {
                wr_f16(y, 2, sum as f32 * d);
            }
        }
        _ => {}
    }
}

/// Scalar dot of one weight row (whole blocks of `dtype`) with activation
/// row quants `qs` (len k), scales `d` and sums `s` (one per block), following
/// ggml's `ggml_vec_dot_*_generic`.
pub fn dot_row(dtype: DType, w: &[u8], qs: &[i8], d: &[f32], s: &[f32]) -> f32 {
    let bb = dtype.block_bytes();
    let mut q = [0i8; 32];
    let mut sumf = 0.0f32;
    for (b, blk) in w.chunks_exact(bb).enumerate() {
        let (dx, mx) = block_ints(dtype, blk, &mut q);
        let y = &qs[b * 32..b * 32 + 32];
        let mut sumi = 0i32;
        for j in 0..32 {
            sumi += q[j] as i32 * y[j] as i32;
        }
        let dy = d[b];
        sumf += match dtype {
            DType::Q4_0 => sumi as f32 * dx * dy,
            DType::Q4_1 | DType::Q5_1 => (dx * dy) * sumi as f32 + mx * s[b],
            DType::Q5_0 => (dx * dy) * sumi as f32,
            _ => sumi as f32 * (dx * dy),
        };
    }
    sumf
}
