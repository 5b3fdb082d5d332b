//! Paged attention against the CPU backend on random layouts: decode batches
//! (flash-decoding), prefill over cached prefixes and mixed batches (tiled
//! prefill kernel), GQA group sizes 1 to 8, head dims 64 to 256 (80 too; and
//! latent attention's 576 with one KV head), page
//! sizes 1 to 16, f32/f16/bf16 caches, FP8 (E4M3, E5M2) caches with
//! checkpoint scales, and a sliding window. The new K/V rows
//! must land in the same slots with the same bits, and outputs agree within
//! 2e-4 of their scale (f32 math in another order on both sides; both read
//! K/V rounded to the cache type the same way). Draft trees (branching,
//! deep, random, up to 96 tokens, mixed with chains and decodes; one-token
//! trees in a decode batch) are held to the same bound.

use crate::common::*;
use arbor_engine_core::{
    AttentionParams, Backend, BatchLayout, DType, HostTensor, KvLayer, KvScales, Tensor,
};
use arbor_quant::scaled::{f32_to_e4m3, f32_to_e5m2};
use std::sync::Arc;

struct Case {
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    page_size: usize,
    /// (prefix_len, q_len) per sequence.
    seqs: Vec<(usize, usize)>,
    /// Parents of the new tokens of the sequences that are draft trees
    /// (`q_len` of them), by sequence index; empty: all chains.
    trees: Vec<Option<Vec<i32>>>,
    window: Option<usize>,
    dtype: DType,
}

fn download_any(b: &dyn Backend, t: &arbor_engine_core::Tensor) -> Vec<u8> {
    let mut v = vec![0u8; t.byte_len().unwrap()];
    b.download(t, &mut v).unwrap();
    v
}

/// The scales an FP8 case runs with (keys stored divided by 0.02, values by
/// 4); other caches ignore scales.
const FP8_SCALES: KvScales = KvScales { k: 0.02, v: 4.0 };

/// A cache tensor holding `v` as `dtype` (FP8 encoded as the CPU does).
fn upload_cache(b: &dyn Backend, shape: &[usize], v: &[f32], dtype: DType) -> Tensor {
    let encode = match dtype {
        DType::F8E4M3 => f32_to_e4m3,
        DType::F8E5M2 => f32_to_e5m2,
        _ => return upload_as(b, shape, v, dtype),
    };
    let data: Vec<u8> = v.iter().map(|&x| encode(x)).collect();
    b.upload(&HostTensor {
        dtype,
        shape: shape.to_vec(),
        data: data.into(),
    })
    .unwrap()
}

fn run_case(name: &str, c: &Case, rng: &mut Rng) {
    let Some(g) = gpu() else { return };
    let cpu = cpu();
    let (nh, nkv, hd, ps) = (c.heads, c.kv_heads, c.head_dim, c.page_size);
    let pages_per: Vec<usize> = c.seqs.iter().map(|(p, q)| (p + q).div_ceil(ps)).collect();
    let num_pages = pages_per.iter().sum::<usize>() + 3;
    let mut free: Vec<u32> = (0..num_pages as u32).collect();
    // Shuffle so sequences own scattered pages.
    for i in (1..free.len()).rev() {
        free.swap(i, rng.below(i + 1));
    }
    let mut layout = BatchLayout::new(ps);
    for (i, (&(p, q), &np)) in c.seqs.iter().zip(&pages_per).enumerate() {
        let pages: Vec<u32> = free.drain(..np).collect();
        match c.trees.get(i).and_then(Option::as_ref) {
            Some(parents) => layout.push_tree_seq(p, parents, &pages).unwrap(),
            None => layout.push_seq(p, q, &pages).unwrap(),
        }
    }
    let layout = Arc::new(layout);
    let t = layout.num_tokens();
    let slots = num_pages * ps;
    let q = rng.vec(t * nh * hd, 1.0);
    let k = rng.vec(t * nkv * hd, 1.0);
    let v = rng.vec(t * nkv * hd, 1.0);
    let kc = rng.vec(slots * nkv * hd, 1.0);
    let vc = rng.vec(slots * nkv * hd, 1.0);
    let params = AttentionParams {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        sliding_window: c.window,
        kv_scales: match c.dtype {
            DType::F8E4M3 | DType::F8E5M2 => FP8_SCALES,
            _ => KvScales::ONE,
        },
    };
    let run = |b: &(dyn Backend + 'static)| {
        let att = b.attention(None).unwrap();
        assert!(att.capabilities().tree);
        let batch = att.prepare(layout.clone()).unwrap();
        let kv = KvLayer {
            k: upload_cache(b, &[slots, nkv, hd], &kc, c.dtype),
            v: upload_cache(b, &[slots, nkv, hd], &vc, c.dtype),
        };
        let qt = upload_f32(b, &[t, nh * hd], &q);
        let kt = upload_f32(b, &[t, nkv * hd], &k);
        let vt = upload_f32(b, &[t, nkv * hd], &v);
        let out = b.alloc(DType::F32, &[t, nh * hd]).unwrap();
        att.forward(&batch, &kv, &qt, &kt, &vt, &out, &params)
            .unwrap();
        (
            download_f32(b, &out),
            download_any(b, &kv.k),
            download_any(b, &kv.v),
        )
    };
    let (go, gk, gv) = run(&*g);
    let (co, ck, cv) = run(&*cpu);
    assert!(gk == ck && gv == cv, "{name}: KV cache contents differ");
    assert_close(name, &go, &co, 2e-4);
}

#[test]
fn decode_batches() {
    let mut rng = Rng::new(10);
    for (nh, nkv, hd) in [
        (4, 4, 64),
        (32, 8, 128),
        (8, 1, 128),
        (6, 2, 80),
        (4, 1, 256),
    ] {
        for ps in [1, 16] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let seqs: Vec<(usize, usize)> = (0..5)
                    .map(|i| (if i == 0 { 0 } else { rng.below(300) }, 1))
                    .collect();
                let c = Case {
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                    page_size: ps,
                    seqs,
                    trees: vec![],
                    window: None,
                    dtype,
                };
                run_case(
                    &format!("decode {nh}/{nkv}x{hd} ps{ps} {dtype}"),
                    &c,
                    &mut rng,
                );
            }
        }
    }
}

#[test]
fn long_decode_uses_many_splits() {
    let mut rng = Rng::new(11);
    let c = Case {
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        page_size: 16,
        seqs: vec![(3000, 1)],
        trees: vec![],
        window: None,
        dtype: DType::BF16,
    };
    run_case("decode of one 3001-token sequence", &c, &mut rng);
}

/// Long walks of every kind in one batch (a draft tree, a prefill chunk and
/// a decode after about a thousand cached tokens, at head dims 64 and 256,
/// with and without a window): where a device splits a long walk over
/// several dispatches (wgpu on llvmpipe) the pieces must join exactly.
#[test]
fn long_walks_of_trees_chunks_and_decodes() {
    let mut rng = Rng::new(15);
    let branching = vec![-1, 0, 0, 1, 2, 2, 5, 6, 4];
    for (nh, nkv, hd) in [(4, 2, 64), (4, 1, 256)] {
        for window in [None, Some(700)] {
            let trees = vec![Some(branching.clone()), None, None];
            let c = Case {
                heads: nh,
                kv_heads: nkv,
                head_dim: hd,
                page_size: 16,
                seqs: vec![(1100, branching.len()), (900, 40), (1300, 1)],
                trees,
                window,
                dtype: DType::BF16,
            };
            let name = format!("long walks {nh}/{nkv}x{hd} window {window:?}");
            run_case(&name, &c, &mut rng);
        }
    }
}

#[test]
fn prefill_with_and_without_prefix() {
    let mut rng = Rng::new(12);
    for (nh, nkv, hd) in [(4, 2, 64), (32, 8, 128), (6, 2, 80), (4, 4, 256)] {
        for ps in [4, 16] {
            for dtype in [DType::F32, DType::BF16] {
                let c = Case {
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                    page_size: ps,
                    seqs: vec![(0, 150), (37, 70), (200, 1), (5, 64)],
                    trees: vec![],
                    window: None,
                    dtype,
                };
                run_case(
                    &format!("prefill {nh}/{nkv}x{hd} ps{ps} {dtype}"),
                    &c,
                    &mut rng,
                );
            }
        }
    }
}

/// FP8 caches with checkpoint scales: decode batches, prefill over
/// prefixes, a window and draft trees; the written bytes are the CPU's.
#[test]
fn fp8_caches_with_checkpoint_scales() {
    let mut rng = Rng::new(15);
    for dtype in [DType::F8E4M3, DType::F8E5M2] {
        for (nh, nkv, hd) in [(4, 2, 64), (32, 8, 128), (4, 1, 256)] {
            let decode: Vec<(usize, usize)> = (0..5).map(|i| (40 * i + 3, 1)).collect();
            let prefill = vec![(0, 150), (37, 70), (200, 1)];
            let tree = vec![-1, 0, 0, 1, 2, 2, 5];
            for (what, seqs, trees, window) in [
                ("decode", decode, vec![], None),
                ("prefill", prefill, vec![], Some(33)),
                (
                    "tree",
                    vec![(20, tree.len()), (9, 1)],
                    vec![Some(tree.clone()), None],
                    None,
                ),
            ] {
                let c = Case {
                    heads: nh,
                    kv_heads: nkv,
                    head_dim: hd,
                    page_size: 16,
                    seqs,
                    trees,
                    window,
                    dtype,
                };
                run_case(&format!("{what} {nh}/{nkv}x{hd} {dtype}"), &c, &mut rng);
            }
        }
    }
}

#[test]
fn sliding_window() {
    let mut rng = Rng::new(13);
    for seqs in [vec![(0, 90), (40, 30)], vec![(50, 1), (3, 1), (100, 1)]] {
        let c = Case {
            heads: 8,
            kv_heads: 2,
            head_dim: 64,
            page_size: 4,
            seqs,
            trees: vec![],
            window: Some(17),
            dtype: DType::F16,
        };
        run_case("sliding window 17", &c, &mut rng);
    }
    // bf16 caches with head_dim 64 and 128 (the tensor-core prefill kernel on
    // NVIDIA GPUs): windows shorter and longer than its 64-key tiles.
    for (hd, window) in [(128, 17), (64, 100), (128, 150)] {
        let c = Case {
            heads: 8,
            kv_heads: 2,
            head_dim: hd,
            page_size: 16,
            seqs: vec![(0, 200), (70, 90), (300, 1)],
            trees: vec![],
            window: Some(window),
            dtype: DType::BF16,
        };
        run_case(&format!("sliding window {window} x{hd} bf16"), &c, &mut rng);
    }
}

/// A random draft tree of `n` tokens: each token's parent is any earlier one.
fn random_tree(rng: &mut Rng, n: usize) -> Vec<i32> {
    let mut p = vec![-1];
    p.extend((1..n).map(|j| rng.below(j) as i32));
    p
}

#[test]
fn draft_trees() {
    let mut rng = Rng::new(14);
    // 0 -> {1, 2}; 1 -> 3; 2 -> {4, 5}; 5 -> 6 -> 7; 4 -> 8.
    let branching = vec![-1, 0, 0, 1, 2, 2, 5, 6, 4];
    // Three children of the root, a 36-deep path under the last, side branches.
    let mut deep = vec![-1, 0, 0, 0];
    deep.extend(3..39);
    deep.extend([20, 40, 39]);
    for (nh, nkv, hd) in [(4, 2, 64), (32, 8, 128), (6, 2, 80), (4, 4, 256)] {
        for ps in [4, 16] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                for window in [None, Some(7)] {
                    let trees = vec![
                        None,
                        Some(branching.clone()),
                        None,
                        Some(deep.clone()),
                        Some(random_tree(&mut rng, 96)),
                        Some(vec![-1]),
                        None,
                    ];
                    let prefixes = [37, 20, 200, 5, 66, 3, 0];
                    let seqs = prefixes
                        .iter()
                        .zip(&trees)
                        .zip([70, 0, 1, 0, 0, 0, 150])
                        .map(|((&p, t), q)| (p, t.as_ref().map_or(q, Vec::len)))
                        .collect();
                    let c = Case {
                        heads: nh,
                        kv_heads: nkv,
                        head_dim: hd,
                        page_size: ps,
                        seqs,
                        trees,
                        window,
                        dtype,
                    };
                    let name = format!("trees {nh}/{nkv}x{hd} ps{ps} {dtype} window {window:?}");
                    run_case(&name, &c, &mut rng);
                }
            }
        }
    }
    // One-token trees make a decode batch (the flash-decoding kernels).
    let c = Case {
        heads: 8,
        kv_heads: 2,
        head_dim: 128,
        page_size: 16,
        seqs: vec![(40, 1), (0, 1), (300, 1)],
        trees: vec![Some(vec![-1]), None, Some(vec![-1])],
        window: Some(33),
        dtype: DType::BF16,
    };
    run_case("one-token trees in a decode batch", &c, &mut rng);
}

/// Latent attention's heads (DeepSeek: one 576-wide KV head, the roped key
/// and the latent, shared by every query head): decode batches and prefill
/// over cached prefixes, with bf16 and FP8 caches. A device whose prefill
/// cannot take heads that wide (the CUDA kernels' 16-row tiles need 109 KiB
/// of shared memory, more than AMD's 64 KiB of LDS) says so in its
/// capabilities, and runs the decodes only.
#[test]
fn latent_attention_heads() {
    let Some(g) = gpu() else { return };
    let mut rng = Rng::new(16);
    let b: &dyn Backend = &*g;
    let max = b.attention(None).unwrap().capabilities().max_head_dim;
    for dtype in [DType::BF16, DType::F8E4M3] {
        let decode: Vec<(usize, usize)> = (0..3).map(|i| (50 * i + 7, 1)).collect();
        let mut cases = vec![("decode", decode)];
        if max.is_none_or(|m| m >= 576) {
            cases.push(("prefill", vec![(0, 40), (21, 17), (90, 1)]));
        }
        for (what, seqs) in cases {
            let c = Case {
                heads: 8,
                kv_heads: 1,
                head_dim: 576,
                page_size: 16,
                seqs,
                trees: vec![],
                window: None,
                dtype,
            };
            run_case(&format!("latent {what} 8/1x576 {dtype}"), &c, &mut rng);
        }
    }
}
