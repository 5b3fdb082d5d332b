//! Paged attention of the wgpu backend against the CPU backend: prefill of
//! several sequences, a prefill continuing over a cached prefix mixed with a
//! decode, then decodes; GQA; f32, f16 and bf16 caches; a sliding window.
//! Outputs agree within 1e-4 of the largest magnitude (online vs two-pass
//! softmax, different summation order); the caches written agree exactly
//! (both round to nearest even).
#![allow(clippy::unwrap_used)]

mod common;

use arbor_engine_core::{AttentionParams, Backend, BatchLayout, DType, KvCache, KvSpec};
use common::*;
use std::sync::Arc;

struct Step {
    /// (prefix_len, q_len, pages) per sequence.
    seqs: Vec<(usize, usize, Vec<u32>)>,
}

fn run(
    b: &dyn Backend,
    dtype: DType,
    params: &AttentionParams,
    steps: &[Step],
    seed: u64,
) -> (Vec<Vec<f32>>, Vec<f32>) {
    let spec = KvSpec {
        num_layers: 1,
        num_kv_heads: params.num_kv_heads,
        head_dim: params.head_dim,
        page_size: 4,
        num_pages: 16,
        dtype,
    };
    let kv = KvCache::allocate(b, spec).unwrap();
    let attn = b.create_attention(b.capabilities().attention[0]).unwrap();
    let mut rng = Rng::new(seed);
    let (qw, kw) = (
        params.num_heads * params.head_dim,
        params.num_kv_heads * params.head_dim,
    );
    let mut outs = Vec::new();
    for s in steps {
        let mut layout = BatchLayout::new(4);
        for (prefix, q_len, pages) in &s.seqs {
            layout.push_seq(*prefix, *q_len, pages).unwrap();
        }
        let t = layout.num_tokens();
        let batch = attn.prepare(Arc::new(layout)).unwrap();
        let q = upload_f32(b, &[t, qw], &rng.vec(t * qw, 1.5));
        let k = upload_f32(b, &[t, kw], &rng.vec(t * kw, 1.5));
        let v = upload_f32(b, &[t, kw], &rng.vec(t * kw, 1.0));
        let o = b.alloc(DType::F32, &[t, qw]).unwrap();
        attn.forward(&batch, kv.layer(0).unwrap(), &q, &k, &v, &o, params)
            .unwrap();
        outs.push(download_f32(b, &o));
    }
    let layer = kv.layer(0).unwrap();
    let mut cache = Vec::new();
    for c in [&layer.k, &layer.v] {
        let mut bytes = vec![0u8; c.byte_len().unwrap()];
        b.download(c, &mut bytes).unwrap();
        if matches!(dtype, DType::F8E4M3 | DType::F8E5M2) {
            let mut f = vec![0.0f32; c.numel()];
            arbor_quant::dequantize(dtype, &bytes, &mut f).unwrap();
            cache.extend(f);
            continue;
        }
        cache.extend(
            arbor_engine_core::HostTensor {
                dtype,
                shape: vec![c.numel()],
                data: bytes.into(),
            }
            .to_f32_vec()
            .unwrap(),
        );
    }
    (outs, cache)
}

fn steps() -> Vec<Step> {
    vec![
        Step {
            seqs: vec![(0, 7, vec![3, 9]), (0, 5, vec![0, 5])],
        },
        Step {
            seqs: vec![(7, 3, vec![3, 9, 12]), (5, 1, vec![0, 5])],
        },
        Step {
            seqs: vec![(6, 1, vec![0, 5]), (10, 1, vec![3, 9, 12])],
        },
        Step {
            seqs: vec![(0, 1, vec![7])],
        },
    ]
}

#[test]
fn paged_attention_matches_cpu() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for (dtype, hd, window) in [
        (DType::F32, 64, None),
        (DType::F16, 64, None),
        (DType::BF16, 32, None),
        (DType::F16, 16, Some(4)),
        // FP8 caches: the WGSL encoders must give the CPU's bytes exactly.
        (DType::F8E4M3, 64, None),
        (DType::F8E5M2, 16, Some(4)),
    ] {
        let params = AttentionParams {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            sliding_window: window,
        };
        let (go, gc) = run(&*g, dtype, &params, &steps(), 7);
        let (co, cc) = run(&*c, dtype, &params, &steps(), 7);
        for (i, (a, b)) in go.iter().zip(&co).enumerate() {
            assert_close(
                &format!("attention {dtype} hd {hd} window {window:?} step {i}"),
                a,
                b,
                1e-4,
            );
        }
        assert_close(&format!("KV cache {dtype}"), &gc, &cc, 0.0);
    }
}

#[test]
fn bad_layouts_are_errors() {
    let Some(g) = gpu() else { return };
    let spec = KvSpec {
        num_layers: 1,
        num_kv_heads: 1,
        head_dim: 8,
        page_size: 4,
        num_pages: 2,
        dtype: DType::F32,
    };
    let kv = KvCache::allocate(&*g, spec).unwrap();
    let attn = g.attention(None).unwrap();
    let mut layout = BatchLayout::new(4);
    layout.push_seq(0, 2, &[5]).unwrap();
    let batch = attn.prepare(Arc::new(layout)).unwrap();
    let q = g.alloc(DType::F32, &[2, 8]).unwrap();
    let k = g.alloc(DType::F32, &[2, 8]).unwrap();
    let v = g.alloc(DType::F32, &[2, 8]).unwrap();
    let o = g.alloc(DType::F32, &[2, 8]).unwrap();
    let p = AttentionParams {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 8,
        scale: 1.0,
        sliding_window: None,
    };
    let err = attn
        .forward(&batch, kv.layer(0).unwrap(), &q, &k, &v, &o, &p)
        .unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
}
