//! Batch invariance of `dot_rows` at every SIMD level: an activation row's
//! outputs are bit-identical whatever the number of activation rows `m`,
//! whatever the other rows hold, wherever the row sits in the batch, and
//! however the weight rows are split between calls (as the CPU backend's
//! threads split them).
#![allow(clippy::unwrap_used)]

use arbor_quant::{
    DType, PreparedActs, QuantError, QuantMatmul, SimdLevel, dot_rows_with, quantize, row_bytes,
};

const DOT: [DType; 18] = arbor_quant::DOT_WEIGHT_DTYPES;

mod common;
use common::Rng;

fn weights(rng: &mut Rng, dtype: DType, n: usize, k: usize) -> Vec<u8> {
    let x = rng.normals(n * k);
    let mut w = vec![0u8; row_bytes(dtype, n * k).unwrap()];
    quantize(dtype, &x, &mut w).unwrap();
    w
}

/// `x · wᵀ` with `dot_rows_with` at `level`, the weight rows split at `cuts`.
#[allow(clippy::too_many_arguments)]
fn product(
    level: SimdLevel,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    cuts: &[usize],
) -> Vec<f32> {
    product_as((QuantMatmul::F32, None), level, dtype, w, n, k, x, m, cuts)
}

/// [`product`] with the activations prepared for `matmul`, with a W8A8
/// weight's static input scale if any.
#[allow(clippy::too_many_arguments)]
fn product_as(
    (matmul, input_scale): (QuantMatmul, Option<f32>),
    level: SimdLevel,
    dtype: DType,
    w: &[u8],
    n: usize,
    k: usize,
    x: &[f32],
    m: usize,
    cuts: &[usize],
) -> Vec<f32> {
    let mut acts = PreparedActs::new();
    drop(
        acts.prepare_split_as(dtype, matmul, input_scale, x, m, k)
            .unwrap(),
    );
    let rb = row_bytes(dtype, k).unwrap();
    let mut out = vec![f32::NAN; m * n];
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(n);
    for p in bounds.windows(2) {
        let (r0, r1) = (p[0], p[1]);
        if r0 == r1 {
            continue;
        }
        // Columns r0..r1 of every row: a strided view starting at r0.
        let mut part = vec![0.0f32; (m - 1) * n + (r1 - r0)];
        dot_rows_with(
            level,
            dtype,
            &w[r0 * rb..r1 * rb],
            r1 - r0,
            k,
            &acts,
            &mut part,
            n,
        )
        .unwrap();
        for i in 0..m {
            out[i * n + r0..i * n + r1].copy_from_slice(&part[i * n..i * n + r1 - r0]);
        }
    }
    out
}

#[test]
fn rows_are_bit_identical_for_every_batch_shape() {
    let mut rng = Rng(2024);
    for dtype in DOT {
        // A k with a partial last vector / chunk where the format allows,
        // and for the float formats also whole 32-element steps (AMX tiles).
        let ks: &[usize] = match dtype.block_size() {
            1 => &[1000, 576],
            32 => &[32 * 29],
            _ => &[256 * 3],
        };
        for &k in ks {
            rows_keep_their_bits(&mut rng, QuantMatmul::F32, dtype, k);
            if dtype.is_scaled_block() {
                rows_keep_their_bits(&mut rng, QuantMatmul::AmxBf16, dtype, k);
            }
        }
    }
}

/// One case of [`rows_are_bit_identical_for_every_batch_shape`].
fn rows_keep_their_bits(rng: &mut Rng, matmul: QuantMatmul, dtype: DType, k: usize) {
    let n = 77;
    let w = weights(rng, dtype, n, k);
    let probe = rng.normals(k);
    for level in SimdLevel::available() {
        let single = product_as((matmul, None), level, dtype, &w, n, k, &probe, 1, &[]);
        for m in [1usize, 2, 3, 4, 5, 7, 8, 9, 16, 31, 32, 33, 100] {
            let mut x = rng.normals(m * k);
            let at = rng.below(m);
            x[at * k..(at + 1) * k].copy_from_slice(&probe);
            let cuts = [rng.below(n / 2), n / 2 + rng.below(n / 2)];
            let got = product_as((matmul, None), level, dtype, &w, n, k, &x, m, &cuts);
            for r in 0..n {
                assert_eq!(
                    got[at * n + r].to_bits(),
                    single[r].to_bits(),
                    "{dtype} {matmul:?} {level:?}: m={m}, row {at}, column {r}: {} vs m=1 {}",
                    got[at * n + r],
                    single[r]
                );
            }
        }
    }
}

/// Gives each run of `group` consecutive `u4_s32` blocks the bytes `params`
/// of its first block: 16..19 its scale and zero point, as a checkpoint's
/// groups of 64 or 128 inputs do (the kernels then reuse the first block's
/// value table); 16..18 the scale only, 18..19 the zero only (blocks whose
/// table must still be rebuilt).
fn share_u4_params(w: &mut [u8], group: usize, params: std::ops::Range<usize>) {
    for run in w.chunks_mut(20 * group) {
        let (first, rest) = run.split_at_mut(20);
        for block in rest.chunks_exact_mut(20) {
            block[params.clone()].copy_from_slice(&first[params.clone()]);
        }
    }
}

/// The scaled block formats dequantize in registers to exactly their
/// scalar dequantization, so their products equal the f32 kernel's on the
/// dequantized weights bit for bit, at every level and every `m` (a
/// checkpoint stored packed computes what its f32 dequantization would).
/// `u4_s32` also runs with parameters shared by 2 and 4 consecutive blocks,
/// and with only the scale or only the zero point shared.
#[test]
fn scaled_blocks_multiply_as_their_f32_dequantization() {
    let mut rng = Rng(7);
    for (dtype, group, params) in [
        (DType::F8_S32, 1, 0..0),
        (DType::U4_S32, 1, 0..0),
        (DType::U4_S32, 2, 16..19),
        (DType::U4_S32, 4, 16..19),
        (DType::U4_S32, 4, 16..18),
        (DType::U4_S32, 4, 18..19),
        (DType::U8_S32, 1, 0..0),
        (DType::F4_S16, 1, 0..0),
    ] {
        let (n, k) = (45, 32 * 12);
        let mut w = weights(&mut rng, dtype, n, k);
        if group > 1 {
            share_u4_params(&mut w, group, params.clone());
        }
        let mut wf = vec![0.0f32; n * k];
        arbor_quant::dequantize(dtype, &w, &mut wf).unwrap();
        let wb: Vec<u8> = wf.iter().flat_map(|v| v.to_le_bytes()).collect();
        for level in SimdLevel::available() {
            for m in [1usize, 2, 5, 8, 13, 40] {
                let x = rng.normals(m * k);
                let packed = product(level, dtype, &w, n, k, &x, m, &[n / 3]);
                let float = product(level, DType::F32, &wb, n, k, &x, m, &[]);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&packed),
                    bits(&float),
                    "{dtype} (bytes {params:?} shared by {group} blocks) {level:?}: m={m}"
                );
            }
        }
    }
}

/// W8A8 FP8 (`f8a8_s32`) is `f8_s32`'s product with the inputs rounded to
/// E4M3 (`scaled::round_input_e4m3`: per run of 32, or with a static scale
/// that saturates some of them), bit for bit, at every level, for every
/// `m`, under either `QuantMatmul` (AMX's bf16 inputs do not apply to it);
/// without the rounding, or with the other scale, the outputs differ.
#[test]
fn w8a8_fp8_multiplies_the_inputs_rounded_to_e4m3() {
    let mut rng = Rng(8);
    let (n, k) = (37, 32 * 9);
    let w = weights(&mut rng, DType::F8_S32, n, k);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for level in SimdLevel::available() {
        for m in [1usize, 3, 8, 21] {
            let x = rng.normals(m * k);
            let mut outputs = Vec::new();
            // 0.004 saturates the inputs beyond 1.79.
            for input_scale in [None, Some(0.004f32)] {
                let mut rounded = vec![0.0f32; m * k];
                arbor_quant::scaled::round_input_e4m3(&x, input_scale, &mut rounded);
                let want = product(level, DType::F8_S32, &w, n, k, &rounded, m, &[]);
                for matmul in [QuantMatmul::F32, QuantMatmul::AmxBf16] {
                    let got = product_as(
                        (matmul, input_scale),
                        level,
                        DType::F8A8_S32,
                        &w,
                        n,
                        k,
                        &x,
                        m,
                        &[n / 2],
                    );
                    let what = format!("{level:?} {matmul:?} m={m} {input_scale:?}");
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
                outputs.push(bits(&want));
            }
            assert_ne!(outputs[0], outputs[1], "{level:?} m={m}");
            let unrounded = product(level, DType::F8_S32, &w, n, k, &x, m, &[]);
            assert_ne!(bits(&unrounded), outputs[0], "{level:?} m={m}");
        }
    }
}

/// A static input scale is refused for weights whose inputs are not
/// rounded to E4M3, and when it is not finite and positive.
#[test]
fn a_static_input_scale_needs_w8a8_weights_and_a_positive_value() {
    let x = vec![0.5f32; 64];
    let mut acts = PreparedActs::new();
    for (dtype, scale) in [
        (DType::F8_S32, 0.01f32),
        (DType::Q4_0, 0.01),
        (DType::F8A8_S32, 0.0),
        (DType::F8A8_S32, f32::NAN),
        (DType::F8A8_S32, -1.0),
    ] {
        let got = acts.prepare_split_as(dtype, QuantMatmul::F32, Some(scale), &x, 2, 32);
        assert!(
            matches!(got, Err(QuantError::InputScale(_))),
            "{dtype} {scale}"
        );
    }
    assert!(
        acts.prepare_split_as(DType::F8A8_S32, QuantMatmul::F32, Some(0.01), &x, 2, 32)
            .is_ok()
    );
}

/// `bf16(v)` as `vcvtne2ps2bf16` rounds: to nearest even, an f32
/// subnormal to a signed zero (the weights here have none).
fn bf16_bits(v: f32) -> u16 {
    if v.is_subnormal() {
        ((v.to_bits() >> 16) & 0x8000) as u16
    } else {
        half::bf16::from_f32(v).to_bits()
    }
}

/// Under `QuantMatmul::AmxBf16` the scaled block formats compute, at the
/// `Amx` level, exactly what bf16 weights holding their bf16-rounded f32
/// dequantization compute (the same AMX kernel, the same packed
/// activations), for every `m` and every split of the weight rows; below
/// that level they compute what `QuantMatmul::F32` does. The row counts
/// leave a last panel of a few rows (77, 150) and of fewer than one tile (9).
#[test]
fn amx_bf16_scaled_blocks_multiply_as_their_bf16_dequantization() {
    if !SimdLevel::available().contains(&SimdLevel::Amx) {
        println!("skipped at the Amx level: this CPU (or OS) does not offer AMX-BF16");
    }
    let mut rng = Rng(11);
    for (dtype, group) in [
        (DType::F8_S32, 1),
        (DType::U4_S32, 1),
        (DType::U4_S32, 4),
        (DType::U8_S32, 1),
        (DType::F4_S16, 1),
    ] {
        for n in [9, 77, 150] {
            let k = 32 * 12;
            let mut w = weights(&mut rng, dtype, n, k);
            if group > 1 {
                share_u4_params(&mut w, group, 16..19);
            }
            let mut wf = vec![0.0f32; n * k];
            arbor_quant::dequantize(dtype, &w, &mut wf).unwrap();
            let wb: Vec<u8> = wf
                .iter()
                .flat_map(|v| bf16_bits(*v).to_le_bytes())
                .collect();
            for level in SimdLevel::available() {
                for m in [1usize, 3, 16, 17, 40] {
                    let x = rng.normals(m * k);
                    let cuts = [n / 3];
                    let got = product_as(
                        (QuantMatmul::AmxBf16, None),
                        level,
                        dtype,
                        &w,
                        n,
                        k,
                        &x,
                        m,
                        &cuts,
                    );
                    let want = if level == SimdLevel::Amx {
                        product(level, DType::BF16, &wb, n, k, &x, m, &[])
                    } else {
                        product(level, dtype, &w, n, k, &x, m, &[])
                    };
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(&got),
                        bits(&want),
                        "{dtype} (groups of {group}) {level:?}: n={n} m={m}"
                    );
                }
            }
        }
    }
}

/// Activations prepared as bf16 are accepted only by bf16 and the scaled
/// block weights; other weights name the type they need.
#[test]
fn bf16_activations_are_refused_by_weights_that_do_not_take_them() {
    let (n, k, m) = (4, 64, 2);
    let x = vec![0.5f32; m * k];
    let mut acts = PreparedActs::new();
    drop(
        acts.prepare_split_as(DType::F8_S32, QuantMatmul::AmxBf16, None, &x, m, k)
            .unwrap(),
    );
    assert_eq!(acts.dtype(), Some(DType::BF16));
    for dtype in [DType::F32, DType::F16, DType::Q4_0, DType::Q4_K] {
        assert_eq!(
            arbor_quant::act_dtype_with(dtype, QuantMatmul::AmxBf16).unwrap(),
            arbor_quant::act_dtype_for(dtype).unwrap()
        );
        let kk = if dtype == DType::Q4_K { 256 } else { k };
        let w = vec![0u8; row_bytes(dtype, n * kk).unwrap()];
        let mut out = vec![0.0f32; m * n];
        let err = arbor_quant::dot_rows(dtype, &w, n, kk, &acts, &mut out, n).unwrap_err();
        assert!(
            matches!(err, arbor_quant::QuantError::ActsMismatch(_)),
            "{dtype}: {err}"
        );
    }
}
