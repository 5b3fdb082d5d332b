//! Every kernel of the wgpu backend against the CPU backend on seeded random
//! inputs. Tolerances are relative to the largest magnitude of the CPU result:
//! 1e-6 for copies and lookups (exact formulas), 1e-5 for norms and
//! elementwise ops, 1e-4 for rotary embedding (positions up to 5000, where f32
//! angle arguments differ in the last bits) and float matmuls, 2e-4 for
//! quantized matmuls (identical integer block dots; only the float
//! accumulation order differs). Skips with the reason printed when no wgpu
//! adapter exists.
#![allow(clippy::unwrap_used)]

mod common;

use arbor_engine_core::{Backend, DType, LinearRef, RopeStyle, Tensor};
use common::*;

#[test]
fn memory_roundtrips() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(1);
    let v = rng.vec(1000, 3.0);
    let t = upload_f32(&*g, &[10, 100], &v);
    assert_eq!(download_f32(&*g, &t), v);
    // A view in the middle of the buffer.
    let row = t.narrow(3, 2).unwrap();
    assert_eq!(download_f32(&*g, &row), v[300..500].to_vec());
    let w = rng.vec(200, 1.0);
    let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    g.write(&row, &bytes).unwrap();
    let all = download_f32(&*g, &t);
    assert_eq!(&all[300..500], &w[..]);
    assert_eq!(&all[..300], &v[..300]);
    // Copies, including within one buffer.
    let dst = g.alloc(DType::F32, &[200]).unwrap();
    g.copy(&row, &dst).unwrap();
    assert_eq!(download_f32(&*g, &dst), w);
    g.copy(&t.narrow(0, 2).unwrap(), &t.narrow(8, 2).unwrap())
        .unwrap();
    assert_eq!(&download_f32(&*g, &t)[800..1000], &v[..200]);
    // Freed buffers come back zero-filled.
    drop((t, row, dst));
    for _ in 0..3 {
        let z = g.alloc(DType::F32, &[10, 100]).unwrap();
        assert!(download_f32(&*g, &z).iter().all(|&x| x == 0.0));
        g.write(&z, &vec![7u8; 4000]).unwrap();
    }
    // Odd-sized f16 tensors round-trip; tensors of another device are refused.
    let h = host(DType::F16, &[3], &[1.0, 2.0, 3.0]);
    let ht = g.upload(&h).unwrap();
    let mut back = vec![0u8; 6];
    g.download(&ht, &mut back).unwrap();
    assert_eq!(back, h.data.to_vec());
    let c = upload_f32(&*cpu(), &[4], &[1.0; 4]);
    assert!(g.download(&c, &mut [0u8; 16]).is_err());
    g.synchronize().unwrap();
}

#[test]
fn embedding_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(2);
    let (vocab, dim) = (50, 96);
    let table = rng.vec(vocab * dim, 2.0);
    let ids: Vec<u32> = (0..13).map(|_| rng.below(vocab) as u32).collect();
    for dt in [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
    ] {
        let h = host(dt, &[vocab, dim], &table);
        let run = |b: &dyn Backend| {
            let t = b.upload(&h).unwrap();
            let i = upload_u32(b, &[ids.len()], &ids);
            let o = b.alloc(DType::F32, &[ids.len(), dim]).unwrap();
            b.embedding(&t, &i, &o).unwrap();
            download_f32(b, &o)
        };
        assert_close(&format!("embedding {dt}"), &run(&*g), &run(&*c), 1e-6);
    }
}

#[test]
fn norms_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(3);
    for (rows, dim) in [(1, 64), (7, 576), (3, 1000)] {
        let x = rng.vec(rows * dim, 2.0);
        let r = rng.vec(rows * dim, 2.0);
        let w = rng.vec(dim, 1.0);
        let run = |b: &dyn Backend| {
            let xt = upload_f32(b, &[rows, dim], &x);
            let rt = upload_f32(b, &[rows, dim], &r);
            let wt = upload_f32(b, &[dim], &w);
            let o = b.alloc(DType::F32, &[rows, dim]).unwrap();
            b.rms_norm(&xt, &wt, 1e-5, &o).unwrap();
            let plain = download_f32(b, &o);
            b.add_rms_norm(&rt, &xt, &wt, 1e-6, &o).unwrap();
            let fused = download_f32(b, &o);
            let res = download_f32(b, &rt);
            b.rms_norm(&xt, &wt, 1e-5, &xt).unwrap();
            (plain, fused, res, download_f32(b, &xt))
        };
        let (a, b) = (run(&*g), run(&*c));
        assert_close(&format!("rms_norm {rows}x{dim}"), &a.0, &b.0, 1e-5);
        assert_close(&format!("add_rms_norm {rows}x{dim}"), &a.1, &b.1, 1e-5);
        assert_close(&format!("residual {rows}x{dim}"), &a.2, &b.2, 1e-6);
        assert_close(&format!("in-place rms_norm {rows}x{dim}"), &a.3, &b.3, 1e-5);
    }
}

#[test]
fn rope_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(4);
    let (tokens, heads, hd) = (9, 3, 64);
    for (style, rotary) in [
        (RopeStyle::Neox, 64),
        (RopeStyle::Interleaved, 64),
        (RopeStyle::Neox, 32),
    ] {
        let x = rng.vec(tokens * heads * hd, 1.0);
        let pos: Vec<u32> = (0..tokens).map(|_| rng.below(5000) as u32).collect();
        let freqs: Vec<f32> = (0..rotary / 2)
            .map(|i| 10000f32.powf(-2.0 * i as f32 / rotary as f32))
            .collect();
        let run = |b: &dyn Backend| {
            let xt = upload_f32(b, &[tokens, heads * hd], &x);
            let pt = upload_u32(b, &[pos.len()], &pos);
            let ft = upload_f32(b, &[freqs.len()], &freqs);
            b.rope(&xt, &pt, &ft, hd, style).unwrap();
            download_f32(b, &xt)
        };
        assert_close(
            &format!("rope {style:?} {rotary}"),
            &run(&*g),
            &run(&*c),
            1e-4,
        );
    }
}

#[test]
fn elementwise_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(5);
    let (m, d) = (5, 1536);
    let a = rng.vec(m * d, 6.0);
    let bb = rng.vec(m * d, 2.0);
    let rows = [4u32, 0, 0, 2];
    let run = |b: &dyn Backend| {
        let at = upload_f32(b, &[m, d], &a);
        let bt = upload_f32(b, &[m, d], &bb);
        let o = b.alloc(DType::F32, &[m, d]).unwrap();
        b.silu_mul(&at, &bt, &o).unwrap();
        let s = download_f32(b, &o);
        b.add_assign(&o, &at).unwrap();
        let add = download_f32(b, &o);
        let rt = upload_u32(b, &[rows.len()], &rows);
        let gt = b.alloc(DType::F32, &[rows.len(), d]).unwrap();
        b.gather_rows(&at, &rt, &gt).unwrap();
        (s, add, download_f32(b, &gt))
    };
    let (x, y) = (run(&*g), run(&*c));
    assert_close("silu_mul", &x.0, &y.0, 1e-5);
    assert_close("add_assign", &x.1, &y.1, 1e-6);
    assert_close("gather_rows", &x.2, &y.2, 0.0);
}

fn linear_case(
    g: &dyn Backend,
    c: &dyn Backend,
    dt: DType,
    m: usize,
    n: usize,
    k: usize,
    seed: u64,
) {
    let mut rng = Rng::new(seed);
    let x = rng.vec(m * k, 1.0);
    let w = rng.vec(n * k, 0.5);
    let bias = rng.vec(n, 1.0);
    let h = host(dt, &[n, k], &w);
    let run = |b: &dyn Backend, with_bias: bool| {
        let xt = upload_f32(b, &[m, k], &x);
        let wt = b.upload(&h).unwrap();
        let bt = upload_f32(b, &[n], &bias);
        let o = b.alloc(DType::F32, &[m, n]).unwrap();
        b.linear(&xt, &wt, with_bias.then_some(&bt), &o).unwrap();
        download_f32(b, &o)
    };
    // On CPUs with AMX the CPU multiplies bf16 weights with bf16-rounded
    // activations (2^-9 relative each); the device keeps them f32.
    let amx = arbor_quant::detected_level() >= arbor_quant::SimdLevel::Amx;
    let tol = match dt {
        DType::BF16 if amx => 1e-2,
        _ if dt.is_quantized() => 2e-4,
        _ => 1e-4,
    };
    for with_bias in [false, true] {
        assert_close(
            &format!("linear {dt} m={m} n={n} k={k} bias={with_bias}"),
            &run(g, with_bias),
            &run(c, with_bias),
            tol,
        );
    }
}

#[test]
fn float_linear_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for (i, (m, n, k)) in [
            (1, 70, 64),
            (3, 33, 100),
            (8, 128, 96),
            (17, 65, 64),
            (40, 24, 30),
        ]
        .into_iter()
        .enumerate()
        {
            linear_case(&*g, &*c, dt, m, n, k, 10 + i as u64);
        }
    }
}

#[test]
fn quantized_linear_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for dt in [DType::Q8_0, DType::Q4_0, DType::Q4_1] {
        for (i, (m, n, k)) in [
            (1, 70, 64),
            (2, 33, 96),
            (8, 128, 576),
            (9, 65, 160),
            (33, 24, 32),
        ]
        .into_iter()
        .enumerate()
        {
            linear_case(&*g, &*c, dt, m, n, k, 20 + i as u64);
        }
    }
}

/// The scaled blocks of HF quantized checkpoints (FP8, W8A8 FP8, INT4,
/// NVFP4), built by arbor-quant's reference quantizers, against the CPU
/// backend's kernels.
#[test]
fn scaled_linear_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let dtypes = [
        DType::F8_S32,
        DType::F8A8_S32,
        DType::U4_S32,
        DType::U8_S32,
        DType::F4_S16,
    ];
    for dt in dtypes {
        for (i, (m, n, k)) in [(1, 70, 64), (2, 33, 96), (8, 128, 576), (9, 65, 160)]
            .into_iter()
            .enumerate()
        {
            linear_case(&*g, &*c, dt, m, n, k, 40 + i as u64);
        }
    }
}

/// Weight views that start inside a buffer, at offsets that are not word-aligned
/// (Q4_0 rows of 18 bytes, f16 rows of 2 bytes).
#[test]
fn narrowed_weights_match_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(7);
    for (dt, k) in [(DType::Q4_0, 32), (DType::Q8_0, 32), (DType::F16, 6)] {
        let (m, n) = (3, 9);
        let x = rng.vec(m * k, 1.0);
        let h = host(dt, &[n + 1, k], &rng.vec((n + 1) * k, 0.5));
        let run = |b: &dyn Backend| {
            let xt = upload_f32(b, &[m, k], &x);
            let wt = b.upload(&h).unwrap().narrow(1, n).unwrap();
            let o = b.alloc(DType::F32, &[m, n]).unwrap();
            b.linear(&xt, &wt, None, &o).unwrap();
            download_f32(b, &o)
        };
        assert_close(&format!("narrowed {dt}"), &run(&*g), &run(&*c), 2e-4);
    }
}

#[test]
fn linear_many_shares_the_input() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    let mut rng = Rng::new(6);
    let (m, k) = (4, 128);
    let x = rng.vec(m * k, 1.0);
    let specs = [(DType::Q4_1, 96), (DType::Q8_0, 32), (DType::F16, 40)];
    let ws: Vec<_> = specs
        .iter()
        .map(|&(dt, n)| host(dt, &[n, k], &rng.vec(n * k, 0.5)))
        .collect();
    let run = |b: &dyn Backend| {
        let xt = upload_f32(b, &[m, k], &x);
        let wt: Vec<Tensor> = ws.iter().map(|h| b.upload(h).unwrap()).collect();
        // All outputs in one buffer, as a fused QKV region would be.
        let total: usize = specs.iter().map(|s| s.1).sum();
        let big = b.alloc(DType::F32, &[total * m]).unwrap();
        let mut outs = Vec::new();
        let mut at = 0;
        for &(_, n) in &specs {
            outs.push(big.narrow(at * m, n * m).unwrap().reshape(&[m, n]).unwrap());
            at += n;
        }
        let layers: Vec<LinearRef<'_>> = wt
            .iter()
            .zip(&outs)
            .map(|(w, out)| LinearRef::new(w, None, out))
            .collect();
        b.linear_many(&xt, &layers).unwrap();
        outs.iter().map(|o| download_f32(b, o)).collect::<Vec<_>>()
    };
    for (i, (x, y)) in run(&*g).iter().zip(run(&*c)).enumerate() {
        assert_close(&format!("linear_many output {i}"), x, &y, 2e-4);
    }
}

#[test]
fn bad_calls_are_errors() {
    let Some(g) = gpu() else { return };
    let x = g.alloc(DType::F32, &[2, 64]).unwrap();
    let w = g.alloc(DType::F32, &[8, 32]).unwrap();
    let o = g.alloc(DType::F32, &[2, 8]).unwrap();
    assert!(g.linear(&x, &w, None, &o).is_err(), "k mismatch");
    let q5 = g.alloc(DType::Q5_0, &[8, 64]).unwrap();
    assert!(g.linear(&x, &q5, None, &o).is_err(), "unsupported dtype");
    assert!(g.silu_mul(&x, &x, &x).is_err(), "overlap");
    assert!(g.write(&x, &[0u8; 4]).is_err(), "short write");
    g.synchronize().unwrap();
}
