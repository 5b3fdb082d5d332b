//! The scaled weight formats of HF quantized checkpoints, in Arbor's in-band
//! block layouts (see `arbor_engine_core::dtype`): the E4M3 element
//! (`f8_e4m3`), 32 E4M3 values with an f32 scale (`f8_s32`) and 32 unsigned
//! 4-bit values with an f16 scale and a u8 zero point (`u4_s32`), and 32
//! unsigned 8-bit values with an f16 scale and a u16 zero point (`u8_s32`).
//!
//! Numerics: an E4M3 byte is decoded as the f16 with the same sign, exponent
//! and mantissa bits (exact, E4M3 ⊂ f16 up to a factor 2^8) times 256, and an
//! `f8_s32` element as that f16 times `scale * 256` (one rounding, the same
//! as `f32(e4m3) * scale`); the SIMD kernels use exactly these operations, so
//! every level dequantizes bit for bit alike. A `u4_s32` or `u8_s32` element is
//! `f32(q - zero) * f32(scale)` (one rounding), an `f4_s16` element
//! `e2m1 * scale` (one rounding). The NaN codes `0x7f`/`0xff`
//! decode as ±480; loaders reject weights that hold them.
//!
//! The quantizers here are references for tests and for quantizing float
//! checkpoints at load: E4M3 rounds to nearest even and saturates at ±448,
//! E2M1 rounds to nearest (ties to the even code) and saturates at ±6.

/// The E4M3 decoding's bit step on x86-64 vectors of 16-bit lanes (one
/// byte per lane): the f16 bits of `e4m3_to_f32(b) / 256`, in three
/// operations; `vcvtph2ps` and `× 256` finish the decoding exactly, as the
/// `f8_s32` kernels and the CPU backend's FP8 KV reads do.
#[cfg(target_arch = "x86_64")]
pub mod x86 {
    pub use crate::x86::float::{e4m3_f16_128, e4m3_f16_256, e4m3_f16_512};
}

/// Largest finite E4M3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// Bytes of an `f8_s32` block.
pub const F8_BLOCK: usize = 36;
/// Bytes of a `u4_s32` block.
pub const U4_BLOCK: usize = 20;
/// Bytes of an `f4_s16` block.
pub const F4_BLOCK: usize = 12;
/// Bytes of a `u8_s32` block.
pub const U8_BLOCK: usize = 36;

/// The E2M1 values by code (bit 3 the sign).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Dequantizes one block of `f4_s16` (12 bytes) into 16 values.
pub fn dequantize_f4_block(b: &[u8], y: &mut [f32]) {
    let s = rd_f32(b, 8);
    for i in 0..8 {
        y[i] = E2M1[(b[i] & 0x0f) as usize] * s;
        y[i + 8] = E2M1[(b[i] >> 4) as usize] * s;
    }
}

/// Writes an `f4_s16` block of `codes` (16 E2M1 codes, element order) with `scale`.
pub fn write_f4_block(codes: &[u8], scale: f32, y: &mut [u8]) {
    for i in 0..8 {
        y[i] = (codes[i] & 0x0f) | ((codes[i + 8] & 0x0f) << 4);
    }
    y[8..12].copy_from_slice(&scale.to_le_bytes());
}

/// The E2M1 code nearest to `v` (ties to the even code), saturating at ±6.
pub fn f32_to_e2m1(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 8u8 } else { 0 };
    let a = if v.is_nan() { 0.0 } else { v.abs() };
    // Midpoints between the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; at a tie
    // the even code (the one with a zero mantissa bit) wins.
    const MID: [(f32, bool); 7] = [
        (0.25, false),
        (0.75, true),
        (1.25, false),
        (1.75, true),
        (2.5, false),
        (3.5, true),
        (5.0, false),
    ];
    let mut code = 0u8;
    for (m, up_on_tie) in MID {
        if a > m || (a == m && up_on_tie) {
            code += 1;
        }
    }
    sign | code
}

/// Reference quantizer of one `f4_s16` block: scale `amax / 6` (1 for an
/// all-zero block), values rounded to the nearest E2M1.
pub fn quantize_f4_block(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / 6.0
    } else {
        1.0
    };
    let mut codes = [0u8; 16];
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = f32_to_e2m1(v / scale);
    }
    write_f4_block(&codes, scale, y);
}

/// True for the NaN codes of E4M3FN.
#[inline(always)]
pub fn e4m3_is_nan(b: u8) -> bool {
    b & 0x7f == 0x7f
}

/// The f16 bits whose value is `e4m3(b) / 256`.
#[inline(always)]
pub fn e4m3_as_f16_bits(b: u8) -> u16 {
    (((b & 0x80) as u16) << 8) | (((b & 0x7f) as u16) << 7)
}

/// Decodes one E4M3 byte (exact; NaN codes give ±480).
#[inline(always)]
pub fn e4m3_to_f32(b: u8) -> f32 {
    half::f16::from_bits(e4m3_as_f16_bits(b)).to_f32() * 256.0
}

/// Encodes `v` as E4M3: round to nearest even, saturate at ±448, NaN to 0x7f.
pub fn f32_to_e4m3(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    // Subnormals step by 2^-9 below 2^-6; code m (0..=8) is m * 2^-9, and
    // code 8 is the smallest normal, so the rounded count is the code.
    let min_normal = f32::from_bits(0x3c80_0000); // 2^-6
    if a < min_normal {
        let m = (a * 512.0).round_ties_even() as u8;
        return sign | m;
    }
    let e = (a.to_bits() >> 23) as i32 - 127; // -6..=8
    let frac = a / f32::from_bits(((e + 127) as u32) << 23); // [1, 2)
    let mut m = ((frac - 1.0) * 8.0).round_ties_even() as i32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = (((e + 7) as u8) << 3) | m as u8;
    sign | code.min(0x7e)
}

/// W8A8 input quantization: each run of 32 values of `x` becomes the E4M3
/// codes of `v * (448 / max |v|)` (as [`f32_to_e4m3`]) and the scale
/// `max |v| / 448` (a run of zeros: codes 0, scale 0), so a value is about
/// its code times its scale; with a static scale `s`, the codes of
/// `v * (1 / s)` (saturating at ±448) and the scale `s` for every run. The
/// GPU's `quant_act_e4m3` computes the same bytes and scales. A tail of
/// fewer than 32 values is ignored.
pub fn quantize_input_e4m3(x: &[f32], static_scale: Option<f32>) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / 32);
    for run in x.chunks_exact(32) {
        let (inv, scale) = input_run_scales(run, static_scale);
        codes.extend(run.iter().map(|&v| f32_to_e4m3(v * inv)));
        scales.push(scale);
    }
    (codes, scales)
}

/// A run of 32 inputs' multiplier and scale: `448 / max |v|` (0 for a run
/// of zeros) and `max |v| / 448`, or `1 / s` and `s` for a static scale.
fn input_run_scales(run: &[f32], static_scale: Option<f32>) -> (f32, f32) {
    if let Some(s) = static_scale {
        return (1.0 / s, s);
    }
    let amax = run.iter().fold(0f32, |a, v| a.max(v.abs()));
    let inv = if amax > 0.0 { 448.0 / amax } else { 0.0 };
    (inv, amax / 448.0)
}

/// The values [`quantize_input_e4m3`]'s codes and scales stand for, each
/// `e4m3 × scale` in f32 ([`round_e4m3`]; a NaN input stays NaN): what
/// `f8a8_s32` weights multiply. `x.len()` must be
/// a multiple of 32; `out` is overwritten.
pub fn round_input_e4m3(x: &[f32], static_scale: Option<f32>, out: &mut [f32]) {
    for (run, o) in x.chunks_exact(32).zip(out.chunks_exact_mut(32)) {
        let (inv, scale) = input_run_scales(run, static_scale);
        for (y, &v) in o.iter_mut().zip(run) {
            *y = round_e4m3(v * inv) * scale;
        }
    }
}

/// `e4m3_to_f32(f32_to_e4m3(v))` without the codes, by integer rounding
/// (about ten times faster): the E4M3 value nearest to `v` (ties to even),
/// saturating at ±448. NaN stays NaN (its code, 0x7f, is not decoded).
#[inline(always)]
pub fn round_e4m3(v: f32) -> f32 {
    let a = v.abs();
    if a.is_nan() {
        return v;
    }
    let r = if a >= E4M3_MAX {
        E4M3_MAX
    } else if a < f32::from_bits(0x3c80_0000) {
        // Below 2^-6 the values step by 2^-9: a * 512 < 8 rounds to an
        // integer (ties to even) by adding and taking away 2^23.
        const TWO_23: f32 = 8_388_608.0;
        ((a * 512.0 + TWO_23) - TWO_23) * (1.0 / 512.0)
    } else {
        // Three mantissa bits: drop 20, rounding to nearest even (a carry
        // into the exponent is the next binade's first value).
        let b = a.to_bits();
        f32::from_bits((b + 0x7_ffff + ((b >> 20) & 1)) & !0xf_ffff)
    };
    r.copysign(v)
}

/// Decodes one E5M2 byte (exact: the top byte of an f16).
#[inline(always)]
pub fn e5m2_to_f32(b: u8) -> f32 {
    half::f16::from_bits((b as u16) << 8).to_f32()
}

/// Encodes `v` as E5M2: round to nearest even, saturate at ±57344 (the
/// largest finite value), NaN to 0x7e.
pub fn f32_to_e5m2(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7e;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a >= 57344.0 {
        return sign | 0x7b;
    }
    // Subnormals step by 2^-16 below 2^-14; code 4 is the smallest normal.
    let min_normal = f32::from_bits(0x3880_0000); // 2^-14
    if a < min_normal {
        let m = (a * 65536.0).round_ties_even() as u8;
        return sign | m;
    }
    let e = (a.to_bits() >> 23) as i32 - 127; // -14..=15
    let frac = a / f32::from_bits(((e + 127) as u32) << 23);
    let mut m = ((frac - 1.0) * 4.0).round_ties_even() as i32;
    let mut e = e;
    if m == 4 {
        m = 0;
        e += 1;
    }
    let code = (((e + 15) as u8) << 2) | m as u8;
    sign | code.min(0x7b)
}

/// Reads the f32 at `b[off..off + 4]`.
#[inline(always)]
fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Dequantizes one block of `f8_s32` (36 bytes) into 32 values.
pub fn dequantize_f8_block(b: &[u8], y: &mut [f32]) {
    let s = rd_f32(b, 32) * 256.0;
    for (o, &c) in y.iter_mut().zip(&b[..32]) {
        *o = half::f16::from_bits(e4m3_as_f16_bits(c)).to_f32() * s;
    }
}

/// Dequantizes one block of `u4_s32` (20 bytes) into 32 values.
pub fn dequantize_u4_block(b: &[u8], y: &mut [f32]) {
    let s = super::rd_f16(b, 16);
    let z = b[18] as i32;
    for i in 0..16 {
        y[i] = ((b[i] & 0x0f) as i32 - z) as f32 * s;
        y[i + 16] = ((b[i] >> 4) as i32 - z) as f32 * s;
    }
}

/// Dequantizes one block of `u8_s32` (36 bytes) into 32 values.
pub fn dequantize_u8_block(b: &[u8], y: &mut [f32]) {
    let s = super::rd_f16(b, 32);
    let z = u16::from_le_bytes([b[34], b[35]]) as i32;
    for (o, &q) in y.iter_mut().zip(&b[..32]) {
        *o = (q as i32 - z) as f32 * s;
    }
}

/// Writes a `u8_s32` block of `q` (32 values, element order) with the f16
/// `scale` bits and `zero` (GPTQ's original format reaches 256).
pub fn write_u8_block(q: &[u8], scale_f16: u16, zero: u16, y: &mut [u8]) {
    y[..32].copy_from_slice(&q[..32]);
    y[32..34].copy_from_slice(&scale_f16.to_le_bytes());
    y[34..36].copy_from_slice(&zero.to_le_bytes());
}

/// Reference quantizer of one `u8_s32` block, GPTQ's asymmetric min/max
/// rule: `scale = max(max − min, 1e-5) / 255` (rounded to f16), `zero =
/// round(−min / scale)` in 0..=255, `q = clamp(round(x / scale) + zero, 0, 255)`.
pub fn quantize_u8_block(x: &[f32], y: &mut [u8]) {
    let (q, scale, zero) = quantize_asymmetric(x, 255.0);
    write_u8_block(&q, scale.to_bits(), zero as u16, y);
}

/// The asymmetric min/max rule of AutoAWQ and GPTQ over 32 values with
/// `top + 1` levels: `scale = max(max − min, 1e-5) / top` (rounded to f16),
/// `zero = round(−min / scale)` in `0..=top`, `q = clamp(round(x / scale) +
/// zero, 0, top)`; non-finite values count as 0.
fn quantize_asymmetric(x: &[f32], top: f32) -> ([u8; 32], half::f16, f32) {
    let (mut lo, mut hi) = (0.0f32, 0.0f32);
    for &v in x {
        if v.is_finite() {
            lo = lo.min(v);
            hi = hi.max(v);
        }
    }
    let scale = half::f16::from_f32((hi - lo).max(1e-5) / top);
    let s = scale.to_f32().max(f32::MIN_POSITIVE);
    let zero = (-lo / s).round_ties_even().clamp(0.0, top);
    let mut q = [0u8; 32];
    for (o, &v) in q.iter_mut().zip(x) {
        let v = if v.is_finite() { v } else { 0.0 };
        *o = ((v / s).round_ties_even() + zero).clamp(0.0, top) as u8;
    }
    (q, scale, zero)
}

/// Writes an `f8_s32` block of `codes` (32 E4M3 bytes) with `scale`.
pub fn write_f8_block(codes: &[u8], scale: f32, y: &mut [u8]) {
    y[..32].copy_from_slice(&codes[..32]);
    y[32..36].copy_from_slice(&scale.to_le_bytes());
}

/// Writes a `u4_s32` block of `q` (32 values in 0..16, element order) with
/// the f16 `scale` bits and `zero` (any u8: GPTQ's original format reaches 16).
pub fn write_u4_block(q: &[u8], scale_f16: u16, zero: u8, y: &mut [u8]) {
    for i in 0..16 {
        y[i] = (q[i] & 0x0f) | ((q[i + 16] & 0x0f) << 4);
    }
    y[16..18].copy_from_slice(&scale_f16.to_le_bytes());
    y[18] = zero;
    y[19] = 0;
}

/// Reference quantizer of one `f8_s32` block: scale `amax / 448` (1 for an
/// all-zero block), values rounded to nearest even.
pub fn quantize_f8_block(x: &[f32], y: &mut [u8]) {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    };
    let mut codes = [0u8; 32];
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = f32_to_e4m3(v / scale);
    }
    write_f8_block(&codes, scale, y);
}

/// Reference quantizer of one `u4_s32` block, AutoAWQ's asymmetric rule:
/// `scale = max(max − min, 1e-5) / 15` (rounded to f16), `zero =
/// round(−min / scale)` in 0..=15, `q = clamp(round(x / scale) + zero, 0, 15)`.
pub fn quantize_u4_block(x: &[f32], y: &mut [u8]) {
    let (q, scale, zero) = quantize_asymmetric(x, 15.0);
    write_u4_block(&q, scale.to_bits(), zero as u8, y);
}

/// Dequantizes whole blocks of `dtype` (`f8_e4m3`, `f8_e5m2`, `f8_s32`,
/// `f8a8_s32`, `u4_s32`, `u8_s32` or `f4_s16`).
pub fn dequantize(dtype: crate::DType, src: &[u8], dst: &mut [f32]) {
    match dtype.storage() {
        crate::DType::F8E4M3 => {
            for (o, &c) in dst.iter_mut().zip(src) {
                *o = e4m3_to_f32(c);
            }
        }
        crate::DType::F8E5M2 => {
            for (o, &c) in dst.iter_mut().zip(src) {
                *o = e5m2_to_f32(c);
            }
        }
        crate::DType::F8_S32 => {
            for (b, y) in src.chunks_exact(F8_BLOCK).zip(dst.chunks_exact_mut(32)) {
                dequantize_f8_block(b, y);
            }
        }
        crate::DType::F4_S16 => {
            for (b, y) in src.chunks_exact(F4_BLOCK).zip(dst.chunks_exact_mut(16)) {
                dequantize_f4_block(b, y);
            }
        }
        crate::DType::U8_S32 => {
            for (b, y) in src.chunks_exact(U8_BLOCK).zip(dst.chunks_exact_mut(32)) {
                dequantize_u8_block(b, y);
            }
        }
        _ => {
            for (b, y) in src.chunks_exact(U4_BLOCK).zip(dst.chunks_exact_mut(32)) {
                dequantize_u4_block(b, y);
            }
        }
    }
}

/// Quantizes whole blocks of `dtype` with the reference quantizers.
pub fn quantize(dtype: crate::DType, src: &[f32], dst: &mut [u8]) {
    match dtype.storage() {
        crate::DType::F8E4M3 => {
            for (o, &v) in dst.iter_mut().zip(src) {
                *o = f32_to_e4m3(v);
            }
        }
        crate::DType::F8E5M2 => {
            for (o, &v) in dst.iter_mut().zip(src) {
                *o = f32_to_e5m2(v);
            }
        }
        crate::DType::F8_S32 => {
            for (x, y) in src.chunks_exact(32).zip(dst.chunks_exact_mut(F8_BLOCK)) {
                quantize_f8_block(x, y);
            }
        }
        crate::DType::F4_S16 => {
            for (x, y) in src.chunks_exact(16).zip(dst.chunks_exact_mut(F4_BLOCK)) {
                quantize_f4_block(x, y);
            }
        }
        crate::DType::U8_S32 => {
            for (x, y) in src.chunks_exact(32).zip(dst.chunks_exact_mut(U8_BLOCK)) {
                quantize_u8_block(x, y);
            }
        }
        _ => {
            for (x, y) in src.chunks_exact(32).zip(dst.chunks_exact_mut(U4_BLOCK)) {
                quantize_u4_block(x, y);
            }
        }
    }
}

/// Scalar dot of a row of `f8_s32`, `u4_s32`, `u8_s32` or `f4_s16` weights with f32
/// activations: the weights are dequantized block by block and accumulated
/// in eight f32 lanes, as `float::dot_row` does.
pub fn dot_row(dtype: crate::DType, w: &[u8], x: &[f32]) -> f32 {
    let dtype = dtype.storage();
    let (bb, bs) = match dtype {
        crate::DType::F8_S32 => (F8_BLOCK, 32),
        crate::DType::F4_S16 => (F4_BLOCK, 16),
        crate::DType::U8_S32 => (U8_BLOCK, 32),
        _ => (U4_BLOCK, 32),
    };
    let mut acc = [0.0f32; 8];
    let mut buf = [0.0f32; 32];
    for (b, xs) in w.chunks_exact(bb).zip(x.chunks_exact(bs)) {
        match dtype {
            crate::DType::F8_S32 => dequantize_f8_block(b, &mut buf),
            crate::DType::F4_S16 => dequantize_f4_block(b, &mut buf),
            crate::DType::U8_S32 => dequantize_u8_block(b, &mut buf),
            _ => dequantize_u4_block(b, &mut buf),
        }
        for (wv, xv) in buf[..bs].chunks_exact(8).zip(xs.chunks_exact(8)) {
            for l in 0..8 {
                acc[l] += wv[l] * xv[l];
            }
        }
    }
    let s0 = (acc[0] + acc[4]) + (acc[1] + acc[5]);
    let s1 = (acc[2] + acc[6]) + (acc[3] + acc[7]);
    s0 + s1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_quantization_scales_each_run_of_32_to_448() {
        let mut x: Vec<f32> = (0..96).map(|i| (i as f32 - 40.0) * 0.25).collect();
        x[32..64].fill(0.0);
        x.push(1.0); // a tail shorter than 32: ignored
        let (codes, scales) = quantize_input_e4m3(&x, None);
        assert_eq!((codes.len(), scales.len()), (96, 3));
        // Run 0: max |x| = 10 (x[0] = -10) is the code of -448.
        assert_eq!(scales[0], 10.0 / 448.0);
        assert_eq!(codes[0], 0x80 | 0x7e);
        assert_eq!(
            (scales[1], codes[32..64].iter().all(|&c| c == 0)),
            (0.0, true)
        );
        for (i, &c) in codes.iter().enumerate() {
            let back = e4m3_to_f32(c) * scales[i / 32];
            assert!(
                (back - x[i]).abs() <= x[i].abs() / 16.0 + 1e-6,
                "{i}: {back} vs {}",
                x[i]
            );
        }
    }

    #[test]
    fn round_e4m3_is_the_value_of_the_nearest_code() {
        let check = |v: f32| {
            let got = round_e4m3(v);
            if v.is_nan() {
                assert!(got.is_nan(), "{v:e}: {got:e}");
                return;
            }
            let want = e4m3_to_f32(f32_to_e4m3(v));
            assert!(
                got.to_bits() == want.to_bits(),
                "{v:e} ({:#x}): {got:e} vs {want:e}",
                v.to_bits()
            );
        };
        // Every 251st bit pattern of both signs (all exponents, NaN and
        // infinities included), and every code's value and the midpoints
        // around it (ties round to even).
        for bits in (0..=u32::MAX).step_by(251) {
            check(f32::from_bits(bits));
        }
        for c in 0u8..=0x7e {
            let v = e4m3_to_f32(c);
            for x in [v, v.next_up(), v.next_down()] {
                check(x);
                check(-x);
            }
            if c < 0x7e {
                let mid = (v + e4m3_to_f32(c + 1)) / 2.0;
                for x in [mid, mid.next_up(), mid.next_down()] {
                    check(x);
                    check(-x);
                }
            }
        }
    }

    #[test]
    fn rounded_inputs_are_the_codes_times_their_scales() {
        let x: Vec<f32> = (0..128)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        for static_scale in [None, Some(0.0015), Some(0.37)] {
            let (codes, scales) = quantize_input_e4m3(&x, static_scale);
            let mut rounded = vec![f32::NAN; 128];
            round_input_e4m3(&x, static_scale, &mut rounded);
            for (i, &r) in rounded.iter().enumerate() {
                assert_eq!(r, e4m3_to_f32(codes[i]) * scales[i / 32], "{i}");
            }
        }
        // A run's largest magnitude keeps its value: it is the code ±448.
        let mut rounded = vec![f32::NAN; 128];
        round_input_e4m3(&x, None, &mut rounded);
        let top = x[..32].iter().fold(0f32, |a, v| a.max(v.abs()));
        assert!(rounded[..32].iter().any(|v| v.abs() == top));
    }

    /// A static scale `s` is every run's: the codes are those of
    /// `x · (1/s)`, saturating at ±448 (x = ±0.65 with s = 0.0015 is ±433,
    /// within range; ±0.66 is 440 and beyond that 448), and the values
    /// `code · s`.
    #[test]
    fn a_static_input_scale_is_every_runs_and_saturates() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 32.0) * 0.025).collect();
        let s = 0.0015f32;
        let (codes, scales) = quantize_input_e4m3(&x, Some(s));
        assert_eq!(scales, vec![s, s]);
        for (i, (&c, &v)) in codes.iter().zip(&x).enumerate() {
            assert_eq!(c, f32_to_e4m3(v * (1.0 / s)), "{i}");
            if (v * (1.0 / s)).abs() > 464.0 {
                assert_eq!(c & 0x7f, 0x7e, "{i}: {v} saturates at 448");
            }
        }
        let mut rounded = vec![f32::NAN; 64];
        round_input_e4m3(&x, Some(s), &mut rounded);
        assert_eq!(rounded[0], -448.0 * s);
        assert_eq!(rounded[63], 448.0 * s);
        assert_eq!(rounded[32], 0.0);
    }

    #[test]
    fn e4m3_round_trips_every_finite_code() {
        for c in 0u8..=255 {
            if e4m3_is_nan(c) {
                continue;
            }
            let v = e4m3_to_f32(c);
            let back = f32_to_e4m3(v);
            // -0 and +0 both decode to zero.
            if v == 0.0 {
                assert_eq!(back & 0x7f, 0);
            } else {
                assert_eq!(back, c, "code {c:#x} = {v}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(f32_to_e4m3(1000.0), 0x7e);
        assert_eq!(f32_to_e4m3(-1e9), 0xfe);
        // 1.0625 lies halfway between 1.0 (m=0) and 1.125 (m=1): even wins.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
    }

    #[test]
    fn e5m2_round_trips_every_finite_code() {
        for c in 0u8..=255 {
            let v = e5m2_to_f32(c);
            if !v.is_finite() {
                continue;
            }
            let back = f32_to_e5m2(v);
            if v == 0.0 {
                assert_eq!(back & 0x7f, 0);
            } else {
                assert_eq!(back, c, "code {c:#x} = {v}");
            }
        }
        assert_eq!(e5m2_to_f32(0x7b), 57344.0);
        assert_eq!(f32_to_e5m2(1e9), 0x7b);
        // 1.125 lies halfway between 1.0 (m=0) and 1.25 (m=1): even wins.
        assert_eq!(f32_to_e5m2(1.125), 0x3c);
        assert_eq!(f32_to_e5m2(1.375), 0x3e);
        assert_eq!(e5m2_to_f32(0x01), 2f32.powi(-16));
    }

    #[test]
    fn e2m1_rounds_to_nearest_even() {
        for (c, &v) in E2M1.iter().enumerate() {
            let back = f32_to_e2m1(v);
            if v == 0.0 {
                assert_eq!(back & 7, 0);
            } else {
                assert_eq!(back as usize, c, "{v}");
            }
        }
        assert_eq!(E2M1[f32_to_e2m1(0.25) as usize], 0.0);
        assert_eq!(E2M1[f32_to_e2m1(0.75) as usize], 1.0);
        assert_eq!(E2M1[f32_to_e2m1(2.5) as usize], 2.0);
        assert_eq!(E2M1[f32_to_e2m1(5.0) as usize], 4.0);
        assert_eq!(E2M1[f32_to_e2m1(-3.4) as usize], -3.0);
        assert_eq!(E2M1[f32_to_e2m1(100.0) as usize], 6.0);
    }
}
