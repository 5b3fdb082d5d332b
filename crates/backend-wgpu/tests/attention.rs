//! Paged attention of the wgpu backend against the CPU backend: prefill of
//! several sequences, a prefill continuing over a cached prefix mixed with a
//! decode, then decodes; GQA; f32, f16 and bf16 caches; a sliding window.
//! Outputs agree within 1e-4 of the largest magnitude (online vs two-pass
//! softmax, different summation order); the caches written agree exactly
//! (both round to nearest even).
//!
//! Draft trees: batches mixing chains (a prefill over a cached prefix, a
//! decode) and trees (branching, deep, more than 32 tokens) agree with the
//! CPU the same way, and every tree token's output has the bits of the same
//! token computed on wgpu in a chain of only its ancestors.
#![allow(clippy::unwrap_used)]

mod common;

use arbor_engine_core::{
    AttentionParams, Backend, BatchLayout, DType, KvCache, KvLayer, KvScales, KvSpec,
    TREE_MASK_TOKENS,
};
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
        values_in_keys: false,
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
    let one = KvScales::ONE;
    // Checkpoint scales: keys stored as fp8(k / 0.004) (some saturate at
    // 448), values as fp8(v / 0.75).
    let scaled = KvScales { k: 0.004, v: 0.75 };
    for (dtype, hd, window, kv_scales) in [
        (DType::F32, 64, None, one),
        (DType::F16, 64, None, one),
        (DType::BF16, 32, None, one),
        (DType::F16, 16, Some(4), one),
        // Scales apply to FP8 caches only.
        (DType::F16, 32, None, scaled),
        // FP8 caches: the WGSL encoders must give the CPU's bytes exactly.
        (DType::F8E4M3, 64, None, one),
        (DType::F8E5M2, 16, Some(4), one),
        (DType::F8E4M3, 32, None, scaled),
        (DType::F8E5M2, 16, Some(4), scaled),
    ] {
        let params = AttentionParams {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            sliding_window: window,
            kv_scales,
        };
        let (go, gc) = run(&*g, dtype, &params, &steps(), 7);
        let (co, cc) = run(&*c, dtype, &params, &steps(), 7);
        for (i, (a, b)) in go.iter().zip(&co).enumerate() {
            assert_close(
                &format!("attention {dtype} hd {hd} window {window:?} {kv_scales:?} step {i}"),
                a,
                b,
                1e-4,
            );
        }
        assert_close(&format!("KV cache {dtype} {kv_scales:?}"), &gc, &cc, 0.0);
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
        values_in_keys: false,
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
        kv_scales: KvScales::ONE,
    };
    let err = attn
        .forward(&batch, kv.layer(0).unwrap(), &q, &k, &v, &o, &p)
        .unwrap_err();
    assert!(err.to_string().contains("outside"), "{err}");
}

/// A sequence of a tree test batch: its cached prefix and, for a tree, the
/// parents of its new tokens (`None`: a chain of `q_len` tokens).
struct TreeSeq {
    prefix: usize,
    q_len: usize,
    parents: Option<Vec<i32>>,
}

fn tree_seqs() -> Vec<TreeSeq> {
    let chain = |prefix, q_len| TreeSeq {
        prefix,
        q_len,
        parents: None,
    };
    let tree = |prefix, parents: Vec<i32>| TreeSeq {
        prefix,
        q_len: parents.len(),
        parents: Some(parents),
    };
    // 0 -> {1, 2}; 1 -> 3; 2 -> {4, 5}; 5 -> 6 -> 7; 4 -> 8: the longest path
    // goes through a later child.
    let branching = vec![-1, 0, 0, 1, 2, 2, 5, 6, 4];
    // A root with three children, then a 36-deep path under the last one
    // with a side branch: masks over more than one word.
    let mut deep = vec![-1, 0, 0, 0];
    deep.extend(3..39);
    deep.extend([20, 40, 39]);
    vec![
        chain(6, 5),
        tree(5, branching),
        chain(9, 1),
        tree(0, vec![-1, 0, 1, 1]),
        tree(11, deep),
        tree(3, vec![-1]),
    ]
}

/// The device inputs of one attention call.
struct Inputs {
    layout: BatchLayout,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
}

/// Runs attention on `b` over a cache holding `kc`, `vc` (pages of 4);
/// returns the output and the cache contents after it as f32.
fn attend(
    b: &dyn Backend,
    dtype: DType,
    params: &AttentionParams,
    (kc, vc): (&[f32], &[f32]),
    x: &Inputs,
) -> (Vec<f32>, Vec<f32>) {
    let (qw, kw) = (
        params.num_heads * params.head_dim,
        params.num_kv_heads * params.head_dim,
    );
    let slots = kc.len() / kw;
    let shape = [slots, params.num_kv_heads, params.head_dim];
    let kv = KvLayer {
        k: b.upload(&host(dtype, &shape, kc)).unwrap(),
        v: b.upload(&host(dtype, &shape, vc)).unwrap(),
    };
    let attn = b.attention(None).unwrap();
    assert!(attn.capabilities().tree);
    let t = x.layout.num_tokens();
    let batch = attn.prepare(Arc::new(x.layout.clone())).unwrap();
    let q = upload_f32(b, &[t, qw], &x.q);
    let k = upload_f32(b, &[t, kw], &x.k);
    let v = upload_f32(b, &[t, kw], &x.v);
    let o = b.alloc(DType::F32, &[t, qw]).unwrap();
    attn.forward(&batch, &kv, &q, &k, &v, &o, params).unwrap();
    let mut cache = Vec::new();
    for c in [&kv.k, &kv.v] {
        let mut bytes = vec![0u8; c.byte_len().unwrap()];
        b.download(c, &mut bytes).unwrap();
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
    (download_f32(b, &o), cache)
}

#[test]
fn draft_trees_match_cpu_and_their_chains() {
    let Some(g) = gpu() else { return };
    let c = cpu();
    for (dtype, nh, nkv, hd, window) in [
        (DType::F32, 4, 2, 64, None),
        (DType::F16, 8, 2, 32, Some(5)),
        (DType::BF16, 4, 1, 16, Some(13)),
        (DType::F32, 2, 2, 16, Some(3)),
    ] {
        let params = AttentionParams {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            sliding_window: window,
            kv_scales: KvScales::ONE,
        };
        let (qw, kw) = (nh * hd, nkv * hd);
        let mut rng = Rng::new(hd as u64 + nh as u64);
        let seqs = tree_seqs();
        let need: Vec<usize> = seqs
            .iter()
            .map(|s| (s.prefix + s.q_len).div_ceil(4))
            .collect();
        let mut free: Vec<u32> = (0..need.iter().sum::<usize>() as u32 + 2).collect();
        for i in (1..free.len()).rev() {
            free.swap(i, rng.below(i + 1));
        }
        let slots = free.len() * 4;
        let mut layout = BatchLayout::new(4);
        let mut pages = Vec::new();
        for (s, &n) in seqs.iter().zip(&need) {
            let p: Vec<u32> = free.drain(..n).collect();
            match &s.parents {
                Some(par) => layout.push_tree_seq(s.prefix, par, &p).unwrap(),
                None => layout.push_seq(s.prefix, s.q_len, &p).unwrap(),
            }
            pages.push(p);
        }
        let t = layout.num_tokens();
        let kc = rng.vec(slots * kw, 1.5);
        let vc = rng.vec(slots * kw, 1.0);
        let x = Inputs {
            layout,
            q: rng.vec(t * qw, 1.5),
            k: rng.vec(t * kw, 1.5),
            v: rng.vec(t * kw, 1.0),
        };
        let case = format!("{dtype} {nh}/{nkv}x{hd} window {window:?}");
        let (go, gc) = attend(&*g, dtype, &params, (&kc, &vc), &x);
        let (co, cc) = attend(&*c, dtype, &params, (&kc, &vc), &x);
        assert_close(&format!("tree batch {case}"), &go, &co, 1e-4);
        assert_close(&format!("KV cache {case}"), &gc, &cc, 0.0);
        // Each tree token alone, in a chain of its ancestors (root first)
        // over the same prefix and pages: the same bits.
        for (s, (seq, p)) in x.layout.seqs.iter().zip(seqs.iter().zip(&pages)) {
            let Some(par) = &seq.parents else { continue };
            for j in 0..par.len() {
                let mut path = vec![j];
                while par[*path.last().unwrap()] >= 0 {
                    path.push(par[*path.last().unwrap()] as usize);
                }
                path.reverse();
                let mut chain = BatchLayout::new(4);
                chain.push_seq(seq.prefix, path.len(), p).unwrap();
                let rows = |v: &[f32], w: usize| -> Vec<f32> {
                    path.iter()
                        .flat_map(|&a| v[(s.q_start + a) * w..(s.q_start + a + 1) * w].to_vec())
                        .collect()
                };
                let cx = Inputs {
                    layout: chain,
                    q: rows(&x.q, qw),
                    k: rows(&x.k, kw),
                    v: rows(&x.v, kw),
                };
                let (o, _) = attend(&*g, dtype, &params, (&kc, &vc), &cx);
                let want = &o[(path.len() - 1) * qw..];
                let got = &go[(s.q_start + j) * qw..(s.q_start + j + 1) * qw];
                let same = got
                    .iter()
                    .zip(want)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{case}: tree token {j} (prefix {}) differs from its chain",
                    seq.prefix
                );
            }
        }
    }
}

#[test]
fn oversized_trees_are_refused() {
    let Some(g) = gpu() else { return };
    let attn = g.attention(None).unwrap();
    let mut layout = BatchLayout::new(4);
    let parents: Vec<i32> = (-1..TREE_MASK_TOKENS as i32).collect();
    let pages: Vec<u32> = (0..parents.len().div_ceil(4) as u32).collect();
    layout.push_tree_seq(0, &parents, &pages).unwrap();
    let err = attn.prepare(Arc::new(layout)).unwrap_err();
    assert!(err.to_string().contains("draft tree of 97 tokens"), "{err}");
}
