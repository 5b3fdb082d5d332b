//! The 256-element "K" super-block formats: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K.
//!
//! Layouts (ggml `block_*`, little-endian; offsets in bytes):
//! - Q2_K (84): `scales[16]` (low nibble scale, high nibble min, per 16), `qs[64]`
//!   (2 bits), `d: f16` @80, `dmin: f16` @82. x = d*sc*q - dmin*m.
//! - Q3_K (110): `hmask[32]` (high bit, set = no -4), `qs[64]` @32 (low 2 bits),
//!   `scales[12]` @96 (sixteen 6-bit scales, biased by 32), `d: f16` @108.
//! - Q4_K (144): `d` @0, `dmin` @2, `scales[12]` @4 (eight 6-bit scales and
//!   mins, ggml's `get_scale_min_k4`), `qs[128]` @16 (4 bits).
//! - Q5_K (176): as Q4_K plus `qh[32]` @16 (fifth bits), `qs[128]` @48.
//! - Q6_K (210): `ql[128]` (low 4 bits), `qh[64]` @128 (high 2 bits),
//!   `scales[16]: i8` @192, `d: f16` @208. x = d*sc*(q-32).
//! - Q8_K (292): `d: f32`, `qs[256]: i8` @4, `bsums[16]: i16` @260.
//!
//! Element `e` of every format except Q4_K/Q5_K uses scale `e/16`; Q4_K and
//! Q5_K use scale and min `e/32`.

use super::{nearest_int, rd_f16};
use crate::DType;

/// A super-block decoded to integers: element e is
/// `d * sc[g] * q[e] - dmin * mn[g]` with `g = e / group`.
pub struct KBlock {
    pub q: [i8; 256],
    pub sc: [i32; 16],
    pub mn: [i32; 16],
    pub d: f32,
    pub dmin: f32,
    /// 16 or 32 elements per scale.
    pub group: usize,
}

impl KBlock {
    pub fn new() -> Self {
        KBlock {
            q: [0; 256],
            sc: [0; 16],
            mn: [0; 16],
            d: 0.0,
            dmin: 0.0,
            group: 16,
        }
    }
}

impl Default for KBlock {
    fn default() -> Self {
        Self::new()
    }
}

/// ggml's `get_scale_min_k4`.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen Q3_K scales (already minus 32) from the 12 packed bytes.
#[inline(always)]
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let lo = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let hi = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = (lo | (hi << 4)) as i8 - 32;
    }
    out
}

/// Decodes one super-block of `dtype` into `kb`.
pub fn decode(dtype: DType, b: &[u8], kb: &mut KBlock) {
    match dtype {
        DType::Q2_K => {
            kb.group = 16;
            for e in 0..256 {
                let (n, j, l) = (e / 128, (e % 128) / 32, e % 32);
                kb.q[e] = ((b[16 + n * 32 + l] >> (2 * j)) & 3) as i8;
            }
            for g in 0..16 {
                kb.sc[g] = (b[g] & 0xF) as i32;
                kb.mn[g] = (b[g] >> 4) as i32;
            }
            kb.d = rd_f16(b, 80);
            kb.dmin = rd_f16(b, 82);
        }
        DType::Q3_K => {
            kb.group = 16;
            for e in 0..256 {
                let (n, j, l) = (e / 128, (e % 128) / 32, e % 32);
                let low = ((b[32 + n * 32 + l] >> (2 * j)) & 3) as i8;
                let h = b[l] & (1 << (n * 4 + j)) != 0;
                kb.q[e] = low - if h { 0 } else { 4 };
            }
            let sc = q3k_scales(&b[96..108]);
            for g in 0..16 {
                kb.sc[g] = sc[g] as i32;
                kb.mn[g] = 0;
            }
            kb.d = rd_f16(b, 108);
            kb.dmin = 0.0;
        }
        DType::Q4_K | DType::Q5_K => {
            kb.group = 32;
            let qs_off = if dtype == DType::Q4_K { 16 } else { 48 };
            for e in 0..256 {
                let (c, l, high) = (e / 64, e % 32, (e % 64) >= 32);
                let byte = b[qs_off + c * 32 + l];
                let mut q = if high { byte >> 4 } else { byte & 0xF };
                if dtype == DType::Q5_K && b[16 + l] & (1 << (2 * c + high as usize)) != 0 {
                    q += 16;
                }
                kb.q[e] = q as i8;
            }
            for g in 0..8 {
                let (s, m) = scale_min_k4(g, &b[4..16]);
                kb.sc[g] = s as i32;
                kb.mn[g] = m as i32;
            }
            for g in 8..16 {
                kb.sc[g] = 0;
                kb.mn[g] = 0;
            }
            kb.d = rd_f16(b, 0);
            kb.dmin = rd_f16(b, 2);
        }
        DType::Q6_K => {
            kb.group = 16;
            for e in 0..256 {
                let (n, j, l) = (e / 128, (e % 128) / 32, e % 32);
                let qlb = b[n * 64 + l + (j & 1) * 32];
                let low = if j < 2 { qlb & 0xF } else { qlb >> 4 };
                let high = (b[128 + n * 32 + l] >> (2 * j)) & 3;
                kb.q[e] = (low | (high << 4)) as i8 - 32;
            }
            for g in 0..16 {
                kb.sc[g] = b[192 + g] as i8 as i32;
                kb.mn[g] = 0;
            }
            kb.d = rd_f16(b, 208);
            kb.dmin = 0.0;
        }
        DType::Q8_K => {
            kb.group = 16;
            for e in 0..256 {
                kb.q[e] = b[4 + e] as i8;
            }
            for g in 0..16 {
                kb.sc[g] = 1;
                kb.mn[g] = 0;
            }
            kb.d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            kb.dmin = 0.0;
        }
        _ => {}
    }
}

/// Dequantizes one super-block with ggml's float operations.
pub fn dequantize_block(dtype: DType, b: &[u8], y: &mut [f32]) {
    let mut kb = KBlock::new();
    decode(dtype, b, &mut kb);
    let g = kb.group;
    for (e, o) in y.iter_mut().enumerate().take(256) {
        let q = kb.q[e] as f32;
        let s = kb.sc[e / g] as f32;
        *o = match dtype {
            DType::Q2_K | DType::Q4_K | DType::Q5_K => {
                (kb.d * s) * q - kb.dmin * kb.mn[e / g] as f32
            }
            DType::Q3_K | DType::Q6_K => (kb.d * s) * q,
            _ => kb.d * q,
        };
    }
}

/// Scalar dot of one weight row (whole super-blocks) with Q8_K activations:
/// quants `qs`, scales `d` and `bsums` (16 per super-block), as ggml's
/// `ggml_vec_dot_*_q8_K_generic` (integer sums per super-block).
pub fn dot_row(dtype: DType, w: &[u8], qs: &[i8], d: &[f32], bsums: &[i16]) -> f32 {
    let bb = dtype.block_bytes();
    let mut kb = KBlock::new();
    let mut sumf = 0.0f32;
    for (b, blk) in w.chunks_exact(bb).enumerate() {
        decode(dtype, blk, &mut kb);
        let y = &qs[b * 256..b * 256 + 256];
        let bs = &bsums[b * 16..b * 16 + 16];
        let g = kb.group;
        let mut isum = 0i32;
        for (gi, chunk) in y.chunks_exact(g).enumerate() {
            let mut s = 0i32;
            for (l, &yv) in chunk.iter().enumerate() {
                s += kb.q[gi * g + l] as i32 * yv as i32;
            }
            isum += kb.sc[gi] * s;
        }
        let dy = d[b];
        match dtype {
            DType::Q2_K => {
                let msum: i32 = (0..16).map(|j| bs[j] as i32 * kb.mn[j]).sum();
                sumf += (dy * kb.d) * isum as f32 - (dy * kb.dmin) * msum as f32;
            }
            DType::Q4_K | DType::Q5_K => {
                let msum: i32 = (0..8)
                    .map(|j| (bs[2 * j] as i32 + bs[2 * j + 1] as i32) * kb.mn[j])
                    .sum();
                sumf += (kb.d * dy) * isum as f32 - (kb.dmin * dy) * msum as f32;
            }
            _ => sumf += (kb.d * dy) * isum as f32,
        }
    }
    sumf
}

/// ggml's `quantize_row_q8_K_ref` for one super-block; returns `d`.
pub fn quantize_block_q8k(x: &[f32], q: &mut [i8], bsums: &mut [i16]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x.iter().take(256) {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        q.iter_mut().for_each(|v| *v = 0);
        bsums.iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    for (o, &v) in q.iter_mut().zip(x) {
        *o = nearest_int(iscale * v).clamp(-128, 127) as i8;
    }
    for (j, s) in bsums.iter_mut().enumerate().take(16) {
        *s = q[j * 16..j * 16 + 16].iter().map(|&v| v as i16).sum();
    }
    1.0 / iscale
}

/// Writes a Q8_K block (ggml layout) from its parts.
pub fn write_q8k(d: f32, q: &[i8], bsums: &[i16], y: &mut [u8]) {
    y[0..4].copy_from_slice(&d.to_le_bytes());
    for (o, &v) in y[4..260].iter_mut().zip(q) {
        *o = v as u8;
    }
    for (j, s) in bsums.iter().enumerate().take(16) {
        y[260 + 2 * j..262 + 2 * j].copy_from_slice(&s.to_le_bytes());
    }
}
