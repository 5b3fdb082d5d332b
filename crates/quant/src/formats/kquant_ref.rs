//! Reference quantizers of the K formats: ports of ggml's
//! `quantize_row_q{2,3,4,5,6}_K_ref` (no importance matrix) and their helpers
//! (`make_qx_quants`, `make_q3_quants`, `make_qkx2_quants`), with the same
//! float operations in the same order, so quantized bytes match ggml's.
//!
//! Each function quantizes one super-block of 256 values into `y`
//! (`block_bytes` of the format). Non-finite input yields meaningless but
//! in-range bytes and never panics.

use super::kquants::{quantize_block_q8k, scale_min_k4, write_q8k};
use super::{nearest_int, rd_f16, wr_f16};
use crate::DType;

const GROUP_MAX_EPS: f32 = 1e-15;

/// `make_qx_quants` with `rmse_type == 1` and no weights (the only use in the refs).
fn make_qx_quants(n: usize, nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in &x[..n] {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = (l + nmax) as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for i in 0..n {
            let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
            let w = x[i] * x[i];
            sumlx += w * x[i] * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for i in 0..n {
                let l = nearest_int(iscale * x[i]);
                l_out[i] = (nmax + l.clamp(-nmax, nmax - 1)) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// `make_q3_quants` with `do_rmse == true`.
fn make_q3_quants(n: usize, nmax: i32, x: &[f32], l_out: &mut [i8]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in &x[..n] {
        let ax = v.abs();
        if ax > amax {
            amax = ax;
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out[..n].iter_mut().for_each(|v| *v = 0);
        return 0.0;
    }
    let iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * x[i]).clamp(-nmax, nmax - 1);
        l_out[i] = l as i8;
        let w = x[i] * x[i];
        sumlx += w * x[i] * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    for _itry in 0..5 {
        let mut n_changed = 0;
        for i in 0..n {
            let w = x[i] * x[i];
            let li = l_out[i] as i32;
            let mut slx = sumlx - w * x[i] * li as f32;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * li as f32 * li as f32;
                let new_l = nearest_int(x[i] * sl2 / slx).clamp(-nmax, nmax - 1);
                if new_l != li {
                    slx += w * x[i] * new_l as f32;
                    sl2 += w * new_l as f32 * new_l as f32;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        l_out[i] = new_l as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        n_changed += 1;
                    }
                }
            }
        }
        if n_changed == 0 {
            break;
        }
    }
    for v in l_out[..n].iter_mut() {
        *v += nmax as i8;
    }
    if suml2 > 0.0 { sumlx / suml2 } else { 0.0 }
}

/// `make_qkx2_quants`; returns the scale and writes `-min` to `the_min`.
#[allow(clippy::too_many_arguments)]
fn make_qkx2_quants(
    n: usize,
    nmax: i32,
    x: &[f32],
    weights: &[f32],
    l_out: &mut [u8],
    the_min: &mut f32,
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> f32 {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out[..n].iter_mut().for_each(|v| *v = 0);
        *the_min = -min;
        return 0.0;
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let mut diff = scale * l as f32 + min - x[i];
        diff = if use_mad { diff.abs() } else { diff * diff };
        best_error += weights[i] * diff;
    }
    if nstep < 1 {
        *the_min = -min;
        return scale;
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let d = sum_w * sum_l2 - sum_l * sum_l;
        if d > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / d;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / d;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let mut diff = this_scale * laux[i] as f32 + this_min - x[i];
                diff = if use_mad { diff.abs() } else { diff * diff };
                cur_error += weights[i] * diff;
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    scale
}

fn pack_2bit(l: &[u8], qs: &mut [u8]) {
    for j in (0..256).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] =
                l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
}

fn quantize_q2_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0u8; 256];
    let mut laux = [0u8; 16];
    let mut weights = [0f32; 16];
    let mut mins = [0f32; 16];
    let mut scales = [0f32; 16];
    let q4scale = 15.0f32;
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..16 {
        for i in 0..16 {
            weights[i] = x[16 * j + i].abs();
        }
        scales[j] = make_qkx2_quants(
            16,
            3,
            &x[16 * j..16 * j + 16],
            &weights,
            &mut l[16 * j..16 * j + 16],
            &mut mins[j],
            &mut laux,
            -0.5,
            0.1,
            15,
            true,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    if max_scale > 0.0 {
        let iscale = q4scale / max_scale;
        for j in 0..16 {
            y[j] = nearest_int(iscale * scales[j]) as u8;
        }
        wr_f16(y, 80, max_scale / q4scale);
    } else {
        y[..16].iter_mut().for_each(|v| *v = 0);
        wr_f16(y, 80, 0.0);
    }
    if max_min > 0.0 {
        let iscale = q4scale / max_min;
        for j in 0..16 {
            let lv = nearest_int(iscale * mins[j]);
            y[j] |= (lv << 4) as u8;
        }
        wr_f16(y, 82, max_min / q4scale);
    } else {
        wr_f16(y, 82, 0.0);
    }
    let dd = rd_f16(y, 80);
    let dmin = rd_f16(y, 82);
    for j in 0..16 {
        let d = dd * (y[j] & 0xF) as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin * (y[j] >> 4) as f32;
        for ii in 0..16 {
            let lv = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3);
            l[16 * j + ii] = lv as u8;
        }
    }
    pack_2bit(&l, &mut y[16..80]);
}

fn quantize_q3_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    let mut max_scale = 0.0f32;
    let mut amax = 0.0f32;
    for j in 0..16 {
        scales[j] = make_q3_quants(16, 4, &x[16 * j..16 * j + 16], &mut l[16 * j..16 * j + 16]);
        let scale = scales[j].abs();
        if scale > amax {
            amax = scale;
            max_scale = scales[j];
        }
    }
    y[96..108].iter_mut().for_each(|v| *v = 0);
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for j in 0..16 {
            let lv = nearest_int(iscale * scales[j]) as i8;
            let lv = (lv.clamp(-32, 31) + 32) as u8;
            if j < 8 {
                y[96 + j] = lv & 0xF;
            } else {
                y[96 + j - 8] |= (lv & 0xF) << 4;
            }
            let hi = lv >> 4;
            y[96 + 8 + j % 4] |= hi << (2 * (j / 4));
        }
        wr_f16(y, 108, 1.0 / iscale);
    } else {
        wr_f16(y, 108, 0.0);
    }
    let dall = rd_f16(y, 108);
    let sc = super::kquants::q3k_scales(&y[96..108]);
    for j in 0..16 {
        let d = dall * sc[j] as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let lv = nearest_int(x[16 * j + ii] / d).clamp(-4, 3);
            l[16 * j + ii] = (lv + 4) as i8;
        }
    }
    y[..32].iter_mut().for_each(|v| *v = 0);
    let mut m = 0usize;
    let mut hm = 1u8;
    for j in 0..256 {
        if l[j] > 3 {
            y[m] |= hm;
            l[j] -= 4;
        }
        m += 1;
        if m == 32 {
            m = 0;
            hm = hm.wrapping_shl(1);
        }
    }
    let lu: Vec<u8> = l.iter().map(|&v| v as u8).collect();
    pack_2bit(&lu, &mut y[32..96]);
}

/// Shared by Q4_K and Q5_K: returns the 0..=nmax levels.
fn quantize_q45_k(x: &[f32], y: &mut [u8], nmax: i32, rmin: f32, nstep: i32) -> [u8; 256] {
    let mut l = [0u8; 256];
    let mut laux = [0u8; 32];
    let mut weights = [0f32; 32];
    let mut mins = [0f32; 8];
    let mut scales = [0f32; 8];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        let xb = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in xb {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for i in 0..32 {
            weights[i] = av_x + xb[i].abs();
        }
        scales[j] = make_qkx2_quants(
            32,
            nmax,
            xb,
            &weights,
            &mut l[32 * j..32 * j + 32],
            &mut mins[j],
            &mut laux,
            rmin,
            0.1,
            nstep,
            false,
        );
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let sc = &mut y[4..16];
    for j in 0..8 {
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            sc[j - 4] |= (ls >> 4) << 6;
            sc[j] |= (lm >> 4) << 6;
        }
    }
    wr_f16(y, 0, max_scale / 63.0);
    wr_f16(y, 2, max_min / 63.0);
    let dd = rd_f16(y, 0);
    let dmin = rd_f16(y, 2);
    for j in 0..8 {
        let (s, m) = scale_min_k4(j, &y[4..16]);
        let d = dd * s as f32;
        if d == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for ii in 0..32 {
            let lv = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, nmax);
            l[32 * j + ii] = lv as u8;
        }
    }
    l
}

fn quantize_q4_k(x: &[f32], y: &mut [u8]) {
    let l = quantize_q45_k(x, y, 15, -1.0, 20);
    for (c, j) in (0..256).step_by(64).enumerate() {
        for i in 0..32 {
            y[16 + c * 32 + i] = l[j + i] | (l[j + i + 32] << 4);
        }
    }
}

fn quantize_q5_k(x: &[f32], y: &mut [u8]) {
    let l = quantize_q45_k(x, y, 31, -0.5, 15);
    y[16..48].iter_mut().for_each(|v| *v = 0);
    let (mut m1, mut m2) = (1u8, 2u8);
    for (c, n) in (0..256).step_by(64).enumerate() {
        for j in 0..32 {
            let mut l1 = l[n + j];
            if l1 > 15 {
                l1 -= 16;
                y[16 + j] |= m1;
            }
            let mut l2 = l[n + j + 32];
            if l2 > 15 {
                l2 -= 16;
                y[16 + j] |= m2;
            }
            y[48 + c * 32 + j] = l1 | (l2 << 4);
        }
        m1 = m1.wrapping_shl(2);
        m2 = m2.wrapping_shl(2);
    }
}

fn quantize_q6_k(x: &[f32], y: &mut [u8]) {
    let mut l = [0i8; 256];
    let mut scales = [0f32; 16];
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    for ib in 0..16 {
        let scale = make_qx_quants(
            16,
            32,
            &x[16 * ib..16 * ib + 16],
            &mut l[16 * ib..16 * ib + 16],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    if max_abs_scale < GROUP_MAX_EPS {
        y[..210].iter_mut().for_each(|v| *v = 0);
        return;
    }
    let iscale = -128.0 / max_scale;
    wr_f16(y, 208, 1.0 / iscale);
    for ib in 0..16 {
        y[192 + ib] = nearest_int(iscale * scales[ib]).min(127) as i8 as u8;
    }
    let dd = rd_f16(y, 208);
    for j in 0..16 {
        let d = dd * (y[192 + j] as i8) as f32;
        if d == 0.0 {
            continue;
        }
        for ii in 0..16 {
            let lv = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
            l[16 * j + ii] = (lv + 32) as i8;
        }
    }
    for (h, j) in (0..256).step_by(128).enumerate() {
        for i in 0..32 {
            let q1 = l[j + i] as u8 & 0xF;
            let q2 = l[j + i + 32] as u8 & 0xF;
            let q3 = l[j + i + 64] as u8 & 0xF;
            let q4 = l[j + i + 96] as u8 & 0xF;
            y[h * 64 + i] = q1 | (q3 << 4);
            y[h * 64 + i + 32] = q2 | (q4 << 4);
            y[128 + h * 32 + i] = ((l[j + i] as u8) >> 4)
                | (((l[j + i + 32] as u8) >> 4) << 2)
                | (((l[j + i + 64] as u8) >> 4) << 4)
                | (((l[j + i + 96] as u8) >> 4) << 6);
        }
    }
}

/// Quantizes one super-block of 256 values into `y` (ggml's `_ref` quantizers).
pub fn quantize_block(dtype: DType, x: &[f32], y: &mut [u8]) {
    match dtype {
        DType::Q2_K => quantize_q2_k(x, y),
        DType::Q3_K => quantize_q3_k(x, y),
        DType::Q4_K => quantize_q4_k(x, y),
        DType::Q5_K => quantize_q5_k(x, y),
        DType::Q6_K => quantize_q6_k(x, y),
        DType::Q8_K => {
            let mut q = [0i8; 256];
            let mut bs = [0i16; 16];
            let d = quantize_block_q8k(x, &mut q, &mut bs);
            write_q8k(d, &q, &bs, y);
        }
        _ => {}
    }
}
