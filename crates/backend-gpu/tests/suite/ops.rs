//! Every elementwise and row-wise operation, and linear layers, against the
//! CPU backend on seeded random inputs. Tolerances: 1e-5 of the output scale
//! for f32 math (embedding, copies and gathers must be exact); linear layers
//! 1e-4 with f32 weights (cuBLAS f32 GEMM, another summation order) and 1e-2
//! with f16/bf16 weights (activations rounded to the weight type on the GPU,
//! kept in f32 on the CPU).

use crate::common::*;
use arbor_engine_core::{Backend, DType, LinearRef, RopeStyle};

#[test]
fn embedding_and_gather_are_exact() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(1);
    let (vocab, dim) = (301, 72);
    let table = rng.vec(vocab * dim, 1.0);
    let ids: Vec<u32> = (0..37).map(|_| rng.below(vocab) as u32).collect();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        let run = |b: &dyn Backend| {
            let t = upload_as(b, &[vocab, dim], &table, dt);
            let i = upload_u32(b, &[ids.len()], &ids);
            let o = b.alloc(DType::F32, &[ids.len(), dim]).unwrap();
            b.embedding(&t, &i, &o).unwrap();
            let rows = upload_u32(b, &[5], &[3, 0, 36, 3, 17]);
            let sel = b.alloc(DType::F32, &[5, dim]).unwrap();
            b.gather_rows(&o, &rows, &sel).unwrap();
            (download_f32(b, &o), download_f32(b, &sel))
        };
        assert_eq!(run(&*g), run(&*c), "embedding/gather of {dt} rows");
    }
}

#[test]
fn norms_match() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(2);
    for (rows, dim) in [(1, 4096), (7, 72), (33, 1000), (3, 16)] {
        let x = rng.vec(rows * dim, 2.0);
        let r = rng.vec(rows * dim, 2.0);
        let w = rng.vec(dim, 1.0);
        let run = |b: &dyn Backend| {
            let xt = upload_f32(b, &[rows, dim], &x);
            let wt = upload_f32(b, &[dim], &w);
            let o = b.alloc(DType::F32, &[rows, dim]).unwrap();
            b.rms_norm(&xt, &wt, 1e-5, &o).unwrap();
            b.rms_norm(&xt, &wt, 1e-6, &xt).unwrap(); // in place
            let rt = upload_f32(b, &[rows, dim], &r);
            let o2 = b.alloc(DType::F32, &[rows, dim]).unwrap();
            b.add_rms_norm(&rt, &o, &wt, 1e-5, &o2).unwrap();
            [o, xt, rt, o2].map(|t| download_f32(b, &t))
        };
        let (gv, cv) = (run(&*g), run(&*c));
        for (i, (a, b)) in gv.iter().zip(&cv).enumerate() {
            assert_close(&format!("norm {i} of {rows}x{dim}"), a, b, 1e-5);
        }
    }
}

#[test]
fn rope_both_styles_and_partial_rotary() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(3);
    for (style, head_dim, half) in [
        (RopeStyle::Neox, 128, 64),
        (RopeStyle::Interleaved, 64, 32),
        (RopeStyle::Neox, 64, 16),
        (RopeStyle::Interleaved, 80, 20),
    ] {
        let (tokens, heads) = (9, 3);
        let x = rng.vec(tokens * heads * head_dim, 1.0);
        let pos: Vec<u32> = (0..tokens).map(|_| rng.below(5000) as u32).collect();
        let freqs: Vec<f32> = (0..half)
            .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / (2 * half) as f32))
            .collect();
        let run = |b: &dyn Backend| {
            let xt = upload_f32(b, &[tokens, heads * head_dim], &x);
            let p = upload_u32(b, &[tokens], &pos);
            let f = upload_f32(b, &[half], &freqs);
            b.rope(&xt, &p, &f, head_dim, style).unwrap();
            download_f32(b, &xt)
        };
        assert_close(
            &format!("rope {style:?} {head_dim}/{half}"),
            &run(&*g),
            &run(&*c),
            1e-4,
        );
    }
}

#[test]
fn silu_mul_add_assign_copy() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(4);
    let (rows, dim) = (5, 1234);
    let a = rng.vec(rows * dim, 6.0);
    let u = rng.vec(rows * dim, 2.0);
    let run = |b: &dyn Backend| {
        let at = upload_f32(b, &[rows, dim], &a);
        let ut = upload_f32(b, &[rows, dim], &u);
        let o = b.alloc(DType::F32, &[rows, dim]).unwrap();
        b.silu_mul(&at, &ut, &o).unwrap();
        b.add_assign(&at, &ut).unwrap();
        let cp = b.alloc(DType::F32, &[rows, dim]).unwrap();
        b.copy(&o, &cp).unwrap();
        [o, at, cp].map(|t| download_f32(b, &t))
    };
    let (gv, cv) = (run(&*g), run(&*c));
    assert_close("silu_mul", &gv[0], &cv[0], 1e-5);
    assert_eq!(gv[1], cv[1], "add_assign");
    assert_eq!(gv[2], gv[0], "copy");
}

#[test]
fn linear_layers_match() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(5);
    for (m, k, n) in [(1, 256, 384), (5, 200, 96), (70, 512, 1000)] {
        let x = rng.vec(m * k, 1.0);
        let w1 = rng.vec(n * k, 0.05);
        let w2 = rng.vec(n / 2 * k, 0.05);
        let bias = rng.vec(n, 0.5);
        for (dt, tol) in [(DType::F32, 1e-4), (DType::F16, 1e-2), (DType::BF16, 1e-2)] {
            let run = |b: &dyn Backend| {
                let xt = upload_f32(b, &[m, k], &x);
                let a = upload_as(b, &[n, k], &w1, dt);
                let bb = upload_as(b, &[n / 2, k], &w2, dt);
                let bt = upload_f32(b, &[n], &bias);
                let o1 = b.alloc(DType::F32, &[m, n]).unwrap();
                let o2 = b.alloc(DType::F32, &[m, n / 2]).unwrap();
                b.linear_many(
                    &xt,
                    &[
                        LinearRef::new(&a, Some(&bt), &o1),
                        LinearRef::new(&bb, None, &o2),
                    ],
                )
                .unwrap();
                let o3 = b.alloc(DType::F32, &[m, n]).unwrap();
                b.linear(&xt, &a, None, &o3).unwrap();
                [o1, o2, o3].map(|t| download_f32(b, &t))
            };
            let (gv, cv) = (run(&*g), run(&*c));
            for (i, (a, b)) in gv.iter().zip(&cv).enumerate() {
                assert_close(&format!("linear {i} {dt} {m}x{k}x{n}"), a, b, tol);
            }
        }
    }
}

/// Per-head products (one strided-batched GEMM on the device) and column
/// blocks joined side by side, against the CPU: f32 weights within 1e-4,
/// bf16 within 1e-2 (the input rounded to bf16 on the device); joined
/// columns exact.
#[test]
fn linear_heads_and_concat_cols_match() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(13);
    for (t, heads, a, k) in [(1, 4, 192, 576), (7, 3, 40, 24), (33, 2, 64, 16)] {
        let x = rng.vec(t * heads * a, 1.0);
        let w = rng.vec(heads * k * a, 0.05);
        for (dt, tol) in [(DType::F32, 1e-4), (DType::BF16, 1e-2)] {
            let run = |b: &dyn Backend| {
                let xt = upload_f32(b, &[t, heads * a], &x);
                let wt = upload_as(b, &[heads * k, a], &w, dt);
                let o = b.alloc(DType::F32, &[t, heads * k]).unwrap();
                b.linear_heads(&xt, &wt, heads, &o).unwrap();
                download_f32(b, &o)
            };
            let what = format!("{heads} heads {dt} {t}x{a}x{k}");
            assert_close(&what, &run(&*g), &run(&*c), tol);
        }
    }
    let (rows, widths) = (5, [64, 512, 8]);
    let parts: Vec<Vec<f32>> = widths.iter().map(|w| rng.vec(rows * w, 1.0)).collect();
    let run = |b: &dyn Backend| {
        let ts: Vec<_> = widths
            .iter()
            .zip(&parts)
            .map(|(&w, p)| upload_f32(b, &[rows, w], p))
            .collect();
        let o = b.alloc(DType::F32, &[rows, widths.iter().sum()]).unwrap();
        b.concat_cols(&ts.iter().collect::<Vec<_>>(), &o).unwrap();
        download_f32(b, &o)
    };
    assert_eq!(run(&*g), run(&*c), "joined columns");
}

/// W8A8 FP8 layers of one input with different static input scales (one
/// saturating inputs beyond 0.9), and one without, against the CPU.
#[test]
fn w8a8_static_input_scales_match() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(12);
    let (m, n, k) = (5, 48, 160);
    let x = rng.vec(m * k, 1.0);
    let w = rng.vec(n * k, 0.5);
    let mut bytes = vec![0u8; arbor_quant::row_bytes(DType::F8_S32, n * k).unwrap()];
    arbor_quant::quantize(DType::F8_S32, &w, &mut bytes).unwrap();
    let host = arbor_engine_core::HostTensor {
        dtype: DType::F8A8_S32,
        shape: vec![n, k],
        data: bytes.into(),
    };
    let scales = [Some(0.01f32), None, Some(0.002), Some(0.01)];
    let run = |b: &dyn Backend| {
        let xt = upload_f32(b, &[m, k], &x);
        let wt = b.upload(&host).unwrap();
        let outs: Vec<_> = scales
            .iter()
            .map(|_| b.alloc(DType::F32, &[m, n]).unwrap())
            .collect();
        let layers: Vec<LinearRef<'_>> = scales
            .iter()
            .zip(&outs)
            .map(|(&input_scale, out)| LinearRef {
                input_scale,
                ..LinearRef::new(&wt, None, out)
            })
            .collect();
        b.linear_many(&xt, &layers).unwrap();
        outs.iter().map(|o| download_f32(b, o)).collect::<Vec<_>>()
    };
    let (gv, cv) = (run(&*g), run(&*c));
    for (i, (a, b)) in gv.iter().zip(&cv).enumerate() {
        assert_close(&format!("w8a8 {:?}", scales[i]), a, b, 1e-4);
    }
    assert_ne!(cv[0], cv[1], "a static scale changes the product");
}

#[test]
fn invalid_calls_are_errors() {
    let Some(g) = gpu() else { return };
    let a = g.alloc(DType::F32, &[4, 8]).unwrap();
    let b = g.alloc(DType::F32, &[4, 9]).unwrap();
    let w = g.alloc(DType::F32, &[8]).unwrap();
    assert!(g.silu_mul(&a, &b, &a).is_err());
    assert!(g.rms_norm(&a, &w, 1e-5, &b).is_err());
    assert!(g.add_assign(&a, &a).is_err(), "overlapping output");
    let cpu_t = cpu().alloc(DType::F32, &[4, 8]).unwrap();
    assert!(
        g.add_assign(&a, &cpu_t).is_err(),
        "tensor of another device"
    );
    let mut small = [0u8; 3];
    assert!(g.download(&a, &mut small).is_err());
}
