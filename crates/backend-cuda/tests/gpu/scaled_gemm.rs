//! The tensor-core GEMM of scaled-block weights (`kernels/gemm.cu`: FP8
//! E4M3, 4-bit and 8-bit integers with zero points, NVFP4's E2M1; sm_80+)
//! against the CPU backend's linear layer (exact dequantization, f32 dots)
//! and the dequantizing GEMM it replaces: 1, 5, 16, 17 and 70 rows, inputs
//! past one 64-wide chunk and partial column tiles, with a bias; within 1e-4
//! of the output scale (the bf16 split keeps about 16 bits of each input).
//! A row's outputs are the same bits alone as in its batch (the 16 x 32 and
//! 64 x 64 tiles), which batch invariance needs. The host emulator test
//! (`backend-gpu/tests/gemm_host.rs`) checks the same kernels' indexing
//! without a GPU; this checks them on the device's tensor cores, and through
//! the backend's launcher on the emulated device (`arbor-backend-simt`).
//!
//! W8A8 FP8 (`f8a8_s32` weights; FP8 tensor cores on sm_89+, the rounded
//! input elsewhere): against the CPU's `f8_s32` linear of the input
//! quantized to E4M3 per 32 inputs on the host
//! (`arbor_quant::scaled::quantize_input_e4m3`, the GPU's codes and scales,
//! times the scales), within 1e-4; rows alone equal rows in the batch.

use crate::common::*;
use crate::vendor::{GpuBackend, kernels};
use arbor_engine_core::{Backend, DType, HostTensor, LinearRef, Tensor};
use arbor_quant::scaled::{e4m3_to_f32, quantize_input_e4m3};

fn upload_scaled(b: &dyn Backend, dtype: DType, n: usize, k: usize, w: &[f32]) -> Tensor {
    let mut data = vec![0u8; arbor_quant::row_bytes(dtype, k).unwrap() * n];
    arbor_quant::quantize(dtype, w, &mut data).unwrap();
    b.upload(&HostTensor {
        dtype,
        shape: vec![n, k],
        data: data.into(),
    })
    .unwrap()
}

fn linear(b: &dyn Backend, x: &[f32], m: usize, w: &Tensor, bias: &[f32]) -> Vec<f32> {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let xt = upload_f32(b, &[m, k], x);
    let bt = upload_f32(b, &[n], bias);
    let out = b.alloc(DType::F32, &[m, n]).unwrap();
    b.linear_many(&xt, &[LinearRef::new(w, Some(&bt), &out)])
        .unwrap();
    download_f32(b, &out)
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Whether `g` is an NVIDIA target of at least `sm`; prints the skip when not.
fn has_sm(g: &GpuBackend, sm: u32, what: &str) -> bool {
    let target = g.kernel_target();
    let ok = kernels::nvidia_sm(target).is_some_and(|v| v >= sm);
    if !ok {
        println!("skipped: {what} needs sm_{sm} or newer, this is {target}");
    }
    ok
}

/// Asserts rows 0, m / 2 and m - 1 of `got` (m x n) have the same bits
/// computed alone.
fn assert_rows_alone(g: &GpuBackend, what: &str, x: &[f32], got: &[f32], w: &Tensor, bias: &[f32]) {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let m = x.len() / k;
    for r in [0, m / 2, m - 1] {
        let alone = linear(g, &x[r * k..(r + 1) * k], 1, w, bias);
        assert!(
            same_bits(&alone, &got[r * n..(r + 1) * n]),
            "{what}: row {r} alone differs from the batch"
        );
    }
}

#[test]
fn scaled_block_gemm_matches_the_cpu_and_the_dequantizing_gemm() {
    // An instance of its own: the switches below must not reach other tests.
    let Some(g) = gpu_with(false) else { return };
    if !has_sm(&g, 80, "the tensor-core GEMM") {
        return;
    }
    let c = cpu();
    let mut rng = Rng::new(11);
    for dtype in [DType::F8_S32, DType::U4_S32, DType::U8_S32, DType::F4_S16] {
        for (m, k, n) in [
            (1, 256, 384),
            (5, 224, 96),
            (16, 512, 200),
            (17, 160, 72),
            (70, 512, 1000),
        ] {
            let x = rng.vec(m * k, 1.0);
            let wf = rng.vec(n * k, 0.05);
            let bias = rng.vec(n, 0.5);
            let (wg, wc) = (
                upload_scaled(&*g, dtype, n, k, &wf),
                upload_scaled(&*c, dtype, n, k, &wf),
            );
            let want = linear(&*c, &x, m, &wc, &bias);
            g.set_tensor_core_linear(false);
            let dequant = linear(&*g, &x, m, &wg, &bias);
            g.set_tensor_core_linear(true);
            let got = linear(&*g, &x, m, &wg, &bias);
            let what = format!("{dtype} {m}x{k}x{n}");
            assert_close(&format!("{what} tensor cores"), &got, &want, 1e-4);
            assert_close(&format!("{what} dequantizing GEMM"), &dequant, &want, 1e-4);
            assert_rows_alone(&g, &what, &x, &got, &wg, &bias);
        }
    }
}

/// W8A8 FP8 weights (`f8a8_s32`): on FP8 tensor cores (sm_89+) and through
/// the rounded-input paths (any device, and with the tensor-core linears
/// off) against the CPU's `f8_s32` linear of the input quantized on the
/// host; rows alone equal rows in the batch.
#[test]
fn w8a8_fp8_gemm_matches_the_cpu_on_the_quantized_input() {
    // An instance of its own: the switch below must not reach other tests.
    let Some(g) = gpu_with(false) else { return };
    let fp8_cores = kernels::nvidia_sm(g.kernel_target()).is_some_and(|v| v >= 89);
    if !fp8_cores {
        println!(
            "FP8 tensor cores need sm_89 or newer, this is {}: the rounded-input paths only",
            g.kernel_target()
        );
    }
    let c = cpu();
    let mut rng = Rng::new(12);
    for (m, k, n) in [
        (1, 256, 384),
        (16, 512, 200),
        (17, 160, 72),
        (70, 512, 1000),
    ] {
        let x = rng.vec(m * k, 1.0);
        let wf = rng.vec(n * k, 0.05);
        let bias = rng.vec(n, 0.5);
        let (wg, wc) = (
            upload_scaled(&*g, DType::F8A8_S32, n, k, &wf),
            upload_scaled(&*c, DType::F8_S32, n, k, &wf),
        );
        let (codes, scales) = quantize_input_e4m3(&x, None);
        let xq: Vec<f32> = codes
            .iter()
            .enumerate()
            .map(|(i, &q)| e4m3_to_f32(q) * scales[i / 32])
            .collect();
        let want = linear(&*c, &xq, m, &wc, &bias);
        let what = format!("w8a8 {m}x{k}x{n}");
        let got = linear(&*g, &x, m, &wg, &bias);
        assert_rows_alone(&g, &what, &x, &got, &wg, &bias);
        assert_close(&what, &got, &want, 1e-4);
        g.set_tensor_core_linear(false);
        let rounded = linear(&*g, &x, m, &wg, &bias);
        g.set_tensor_core_linear(true);
        assert_close(&format!("{what} dequantizing GEMM"), &rounded, &want, 1e-4);
        // Without the input's rounding the product is off by far more.
        let f8 = upload_scaled(&*g, DType::F8_S32, n, k, &wf);
        let (err, scale) = max_err(&linear(&*g, &x, m, &f8, &bias), &want);
        assert!(
            err > 1e-3 * scale,
            "{what}: f32 inputs within {err} of the W8A8 product"
        );
    }
}
