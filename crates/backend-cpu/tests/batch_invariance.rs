//! Batch invariance of the CPU backend's kernels: a row's result is
//! bit-identical however the step around it is shaped.
//!
//! Linear layers: for every weight dtype the backend accepts, row `i` of
//! `x · Wᵀ (+ b)` is the same bits for m = 1, 3, 4, 7, 8, 9, 33, 100 (the
//! other rows random, the row anywhere in the batch), for 1, 2 and 3
//! threads, alone or in a `linear_many` with other layers.
//!
//! Attention: a query's output is the same bits as a decode, inside a
//! prefill, in chunks of different lengths and offsets, and batched with
//! other sequences, with GQA, a sliding window and f32/f16 caches; a draft
//! tree token's output equals the same token's in a chain of only its
//! ancestors.
//!
//! LoRA: a row's adapter delta is the same bits alone, within its segment,
//! or beside other adapters' segments, for 1-3 threads.
#![allow(clippy::unwrap_used)]

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{
    AttentionBackend, AttentionParams, Backend, BatchLayout, DType, HostTensor, KvCache, KvSpec,
    LinearRef, Tensor,
};
use std::borrow::Cow;
use std::sync::Arc;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn normal(&mut self) -> f32 {
        let u1 = ((self.next() >> 40) as f32 / (1u64 << 24) as f32).max(1e-7);
        let u2 = (self.next() >> 40) as f32 / (1u64 << 24) as f32;
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }
    fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal()).collect()
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn backend(threads: usize) -> Arc<dyn Backend> {
    Arc::new(CpuBackend::new(threads).unwrap())
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A weight matrix of `dtype` from random values.
fn weight(b: &(dyn Backend + 'static), rng: &mut Rng, dtype: DType, n: usize, k: usize) -> Tensor {
    let x = rng.normals(n * k);
    let mut data = vec![0u8; arbor_quant::row_bytes(dtype, n * k).unwrap()];
    arbor_quant::quantize(dtype, &x, &mut data).unwrap();
    b.upload(&HostTensor {
        dtype,
        shape: vec![n, k],
        data: Cow::Owned(data),
    })
    .unwrap()
}

/// `x · wᵀ (+ bias)` for the `m` rows in `x`.
fn linear(
    b: &(dyn Backend + 'static),
    x: &[f32],
    m: usize,
    k: usize,
    w: &Tensor,
    bias: Option<&Tensor>,
) -> Vec<f32> {
    let n = w.shape()[0];
    let xt = b.upload_f32(&[m, k], x).unwrap();
    let out = b.alloc(DType::F32, &[m, n]).unwrap();
    b.linear(&xt, w, bias, &out).unwrap();
    b.download_f32(&out).unwrap()
}

#[test]
fn linear_rows_are_bit_identical_for_every_batch() {
    let threads = [backend(2), backend(1), backend(3)];
    let mut rng = Rng(11);
    let dtypes = CpuBackend::new(1)
        .unwrap()
        .capabilities()
        .weight_dtypes
        .clone();
    assert_eq!(dtypes.len(), 18, "every accepted weight dtype is tested");
    for &dtype in &dtypes {
        // Ragged shapes where the format allows them: n not a multiple of
        // any panel, k with a partial last vector (floats) or chunk (Q*_0/1).
        let (n, k) = match dtype.block_size() {
            1 => (70, 333),
            32 => (70, 32 * 27),
            _ => (70, 512),
        };
        let b0 = &*threads[0];
        let w = weight(b0, &mut rng, dtype, n, k);
        let bias = b0.upload_f32(&[n], &rng.normals(n)).unwrap();
        let probe = rng.normals(k);
        let want = bits(&linear(b0, &probe, 1, k, &w, None));
        let want_b = bits(&linear(b0, &probe, 1, k, &w, Some(&bias)));
        for m in [1usize, 3, 4, 7, 8, 9, 33, 100] {
            let mut x = rng.normals(m * k);
            let at = rng.below(m);
            x[at * k..(at + 1) * k].copy_from_slice(&probe);
            let got = linear(b0, &x, m, k, &w, None);
            assert_eq!(
                bits(&got[at * n..(at + 1) * n]),
                want,
                "{dtype}: row {at} of m={m} differs from m=1"
            );
            let got = linear(b0, &x, m, k, &w, Some(&bias));
            assert_eq!(
                bits(&got[at * n..(at + 1) * n]),
                want_b,
                "{dtype} with bias: row {at} of m={m}"
            );
        }
        // Other thread counts (other splits of the weight rows): the same
        // weights uploaded to each backend.
        for b in &threads[1..] {
            let mut data = vec![0u8; w.byte_len().unwrap()];
            b0.download(&w, &mut data).unwrap();
            let wb = b
                .upload(&HostTensor {
                    dtype,
                    shape: vec![n, k],
                    data: Cow::Owned(data),
                })
                .unwrap();
            let m = 9;
            let mut x = rng.normals(m * k);
            x[4 * k..5 * k].copy_from_slice(&probe);
            let got = linear(&**b, &x, m, k, &wb, None);
            assert_eq!(
                bits(&got[4 * n..5 * n]),
                want,
                "{dtype}: another thread count"
            );
        }
    }
}

#[test]
fn linear_many_rows_match_single_layers() {
    let b = backend(2);
    let mut rng = Rng(12);
    let k = 256;
    let layers = [
        (DType::Q4_1, 96),
        (DType::Q8_0, 40),
        (DType::Q4_K, 33),
        (DType::BF16, 50),
    ];
    let ws: Vec<Tensor> = layers
        .iter()
        .map(|&(d, n)| weight(&*b, &mut rng, d, n, k))
        .collect();
    let probe = rng.normals(k);
    for m in [1usize, 5, 40] {
        let mut x = rng.normals(m * k);
        let at = m / 2;
        x[at * k..(at + 1) * k].copy_from_slice(&probe);
        let xt = b.upload_f32(&[m, k], &x).unwrap();
        let outs: Vec<Tensor> = layers
            .iter()
            .map(|&(_, n)| b.alloc(DType::F32, &[m, n]).unwrap())
            .collect();
        let refs: Vec<LinearRef<'_>> = ws
            .iter()
            .zip(&outs)
            .map(|(w, out)| LinearRef::new(w, None, out))
            .collect();
        b.linear_many(&xt, &refs).unwrap();
        for ((w, out), &(d, n)) in ws.iter().zip(&outs).zip(&layers) {
            let got = b.download_f32(out).unwrap();
            let want = linear(&*b, &probe, 1, k, w, None);
            assert_eq!(
                bits(&got[at * n..(at + 1) * n]),
                bits(&want),
                "{d} in linear_many, m={m}"
            );
        }
    }
}

/// W8A8 FP8 layers sharing an input with different static input scales
/// (one of them saturating), one without, and a GGUF layer: each output is
/// the `f8_s32` product of the input rounded with that layer's own rule,
/// for a row alone or in a batch; a static scale on other weights, or one
/// that is not positive, is an error.
#[test]
fn w8a8_layers_round_their_input_with_their_own_static_scale() {
    let b = backend(2);
    let mut rng = Rng(31);
    let k = 192;
    let f8 = weight(&*b, &mut rng, DType::F8_S32, 40, k);
    let mut bytes = vec![0u8; arbor_quant::row_bytes(DType::F8_S32, 40 * k).unwrap()];
    b.download(&f8, &mut bytes).unwrap();
    let w8a8 = b
        .upload(&HostTensor {
            dtype: DType::F8A8_S32,
            shape: vec![40, k],
            data: Cow::Owned(bytes),
        })
        .unwrap();
    let q4 = weight(&*b, &mut rng, DType::Q4_1, 24, k);
    let scales = [Some(0.01f32), Some(0.01), None, Some(0.002)];
    let probe = rng.normals(k);
    for m in [1usize, 6] {
        let mut x = rng.normals(m * k);
        let at = m - 1;
        x[at * k..(at + 1) * k].copy_from_slice(&probe);
        let xt = b.upload_f32(&[m, k], &x).unwrap();
        let outs: Vec<Tensor> = (0..5)
            .map(|i| {
                b.alloc(DType::F32, &[m, if i < 4 { 40 } else { 24 }])
                    .unwrap()
            })
            .collect();
        let mut refs: Vec<LinearRef<'_>> = scales
            .iter()
            .zip(&outs)
            .map(|(&input_scale, out)| LinearRef {
                input_scale,
                ..LinearRef::new(&w8a8, None, out)
            })
            .collect();
        refs.push(LinearRef::new(&q4, None, &outs[4]));
        b.linear_many(&xt, &refs).unwrap();
        for (i, &input_scale) in scales.iter().enumerate() {
            let mut rounded = vec![0.0f32; k];
            arbor_quant::scaled::round_input_e4m3(&probe, input_scale, &mut rounded);
            let want = linear(&*b, &rounded, 1, k, &f8, None);
            let got = b.download_f32(&outs[i]).unwrap();
            assert_eq!(
                bits(&got[at * 40..(at + 1) * 40]),
                bits(&want),
                "layer {i} ({input_scale:?}), m={m}"
            );
        }
        let got = b.download_f32(&outs[4]).unwrap();
        let want = linear(&*b, &probe, 1, k, &q4, None);
        assert_eq!(
            bits(&got[at * 24..(at + 1) * 24]),
            bits(&want),
            "q4_1, m={m}"
        );
    }
    let xt = b.upload_f32(&[1, k], &probe).unwrap();
    let out = b.alloc(DType::F32, &[1, 40]).unwrap();
    let out24 = b.alloc(DType::F32, &[1, 24]).unwrap();
    for (w, o, s) in [
        (&q4, &out24, 0.01f32),
        (&w8a8, &out, 0.0),
        (&w8a8, &out, f32::INFINITY),
    ] {
        let bad = LinearRef {
            input_scale: Some(s),
            ..LinearRef::new(w, None, o)
        };
        let err = b.linear_many(&xt, &[bad]).unwrap_err();
        assert!(
            matches!(err, arbor_engine_core::CoreError::InvalidArgument(_)),
            "{s}: {err}"
        );
    }
}

/// Per-position attention inputs of one sequence.
struct Seq {
    q: Vec<Vec<f32>>,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Seq {
    fn random(rng: &mut Rng, len: usize, p: &AttentionParams) -> Self {
        let (qw, kw) = (p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim);
        Seq {
            q: (0..len).map(|_| rng.normals(qw)).collect(),
            k: (0..len).map(|_| rng.normals(kw)).collect(),
            v: (0..len).map(|_| rng.normals(kw)).collect(),
        }
    }
}

/// An attention fixture: a one-layer KV cache and the CPU attention.
struct Att {
    b: Arc<dyn Backend>,
    attn: Arc<dyn AttentionBackend>,
    kv: KvCache,
    p: AttentionParams,
    page_size: usize,
}

/// One sequence's part of a step: its inputs, which positions of them are
/// new, its cached prefix and pages, and (for a tree) the parents.
struct Part<'a> {
    seq: &'a Seq,
    /// Indices into `seq` of the new tokens, in order.
    idx: Vec<usize>,
    prefix: usize,
    pages: &'a [u32],
    parents: Option<Vec<i32>>,
}

impl Att {
    fn new(threads: usize, p: AttentionParams, page_size: usize, dtype: DType) -> Self {
        let b = backend(threads);
        let spec = KvSpec {
            num_layers: 1,
            num_kv_heads: p.num_kv_heads,
            head_dim: p.head_dim,
            page_size,
            num_pages: 4096 / page_size,
            dtype,
            values_in_keys: false,
        };
        let kv = KvCache::allocate(&*b, spec).unwrap();
        let attn = b.attention(None).unwrap();
        Att {
            b,
            attn,
            kv,
            p,
            page_size,
        }
    }

    /// Runs one step; returns each part's output rows.
    fn step(&self, parts: &[Part<'_>]) -> Vec<Vec<Vec<f32>>> {
        let mut layout = BatchLayout::new(self.page_size);
        let (mut q, mut k, mut v) = (Vec::new(), Vec::new(), Vec::new());
        for pt in parts {
            match &pt.parents {
                Some(par) => layout.push_tree_seq(pt.prefix, par, pt.pages).unwrap(),
                None => layout.push_seq(pt.prefix, pt.idx.len(), pt.pages).unwrap(),
            }
            for &i in &pt.idx {
                q.extend_from_slice(&pt.seq.q[i]);
                k.extend_from_slice(&pt.seq.k[i]);
                v.extend_from_slice(&pt.seq.v[i]);
            }
        }
        let t = layout.num_tokens();
        let (qw, kw) = (
            self.p.num_heads * self.p.head_dim,
            self.p.num_kv_heads * self.p.head_dim,
        );
        let b = &*self.b;
        let qt = b.upload_f32(&[t, qw], &q).unwrap();
        let kt = b.upload_f32(&[t, kw], &k).unwrap();
        let vt = b.upload_f32(&[t, kw], &v).unwrap();
        let out = b.alloc(DType::F32, &[t, qw]).unwrap();
        let batch = self.attn.prepare(Arc::new(layout)).unwrap();
        self.attn
            .forward(
                &batch,
                self.kv.layer(0).unwrap(),
                &qt,
                &kt,
                &vt,
                &out,
                &self.p,
            )
            .unwrap();
        let o = b.download_f32(&out).unwrap();
        let mut rows = o.chunks_exact(qw).map(<[f32]>::to_vec);
        parts
            .iter()
            .map(|pt| (0..pt.idx.len()).map(|_| rows.next().unwrap()).collect())
            .collect()
    }
}

fn chain<'a>(seq: &'a Seq, range: std::ops::Range<usize>, pages: &'a [u32]) -> Part<'a> {
    Part {
        seq,
        prefix: range.start,
        idx: range.collect(),
        pages,
        parents: None,
    }
}

fn configs() -> Vec<(AttentionParams, usize, DType, usize)> {
    let p = |nh, nkv, hd: usize, w| AttentionParams {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: hd,
        scale: 1.0 / (hd as f32).sqrt(),
        sliding_window: w,
        kv_scales: arbor_engine_core::KvScales::ONE,
    };
    // (params, page size, KV dtype, threads)
    vec![
        (p(4, 2, 16, None), 4, DType::F32, 2),
        (p(9, 3, 64, None), 16, DType::F16, 2),
        (p(6, 2, 64, Some(11)), 8, DType::F32, 3),
        (p(3, 3, 20, Some(40)), 16, DType::BF16, 1),
        (p(8, 1, 128, Some(70)), 32, DType::F32, 2),
        // A window shorter than a tree's depth: ancestors fall out of it.
        (p(4, 2, 32, Some(3)), 4, DType::F32, 2),
    ]
}

#[test]
fn attention_rows_are_bit_identical_for_every_step_shape() {
    let mut rng = Rng(21);
    for (p, ps, dtype, threads) in configs() {
        let what = format!("{p:?} pages of {ps}, {dtype} cache");
        let len = 150;
        let seq = Seq::random(&mut rng, len, &p);
        let others: Vec<Seq> = (0..15).map(|_| Seq::random(&mut rng, 90, &p)).collect();
        let att = Att::new(threads, p, ps, dtype);
        let npages = 4096 / ps;
        // Pages: ours scattered, the others' from the rest of the cache.
        let mut all: Vec<u32> = (0..npages as u32).collect();
        for i in (1..all.len()).rev() {
            all.swap(i, rng.below(i + 1));
        }
        let need = len.div_ceil(ps);
        let (ours, rest) = all.split_at(need);
        let per_other = 90usize.div_ceil(ps);

        // Reference: token by token (decode steps).
        let mut want = Vec::new();
        for t in 0..len {
            want.push(att.step(&[chain(&seq, t..t + 1, ours)])[0][0].clone());
        }
        let check = |got: &[Vec<f32>], from: usize, how: &str| {
            for (i, row) in got.iter().enumerate() {
                assert_eq!(
                    bits(row),
                    bits(&want[from + i]),
                    "{what}: position {} {how} differs from its decode",
                    from + i
                );
            }
        };
        // One prefill of everything.
        check(
            &att.step(&[chain(&seq, 0..len, ours)])[0],
            0,
            "in one prefill",
        );
        // Chunks of different lengths and offsets.
        for cuts in [
            vec![1, 17, 18, 64, 100, 149],
            vec![63, 64, 65, 130],
            vec![5, 77],
        ] {
            let mut bounds = vec![0];
            bounds.extend(cuts);
            bounds.push(len);
            for w in bounds.windows(2) {
                check(
                    &att.step(&[chain(&seq, w[0]..w[1], ours)])[0],
                    w[0],
                    "in a chunk",
                );
            }
        }
        // Batched with 15 other sequences (prefills and decodes of other
        // lengths), ours a chunk in the middle of the batch.
        let mut parts = Vec::new();
        for (i, o) in others.iter().enumerate() {
            let pg = &rest[i * per_other..(i + 1) * per_other];
            let l = 1 + rng.below(89);
            parts.push(chain(o, 0..l, pg));
        }
        parts.insert(7, chain(&seq, 0..40, ours));
        check(&att.step(&parts)[7], 0, "in a batch");
        let mut parts = Vec::new();
        for (i, o) in others.iter().enumerate() {
            let pg = &rest[i * per_other..(i + 1) * per_other];
            // Decode or continue the others' sequences from where they are.
            let l = 1 + rng.below(89);
            parts.push(chain(o, l - 1..l + rng.below(90 - l) + 1, pg));
        }
        parts.insert(3, chain(&seq, 40..41, ours));
        check(&att.step(&parts)[3], 40, "as a batched decode");
        parts.truncate(0);
        parts.push(chain(&seq, 41..len, ours));
        for (i, o) in others.iter().enumerate().take(4) {
            let pg = &rest[i * per_other..(i + 1) * per_other];
            parts.push(chain(o, 0..90, pg));
        }
        check(&att.step(&parts)[0], 41, "in a batched prefill");
    }
}

#[test]
fn tree_tokens_match_their_ancestor_chains() {
    let mut rng = Rng(31);
    // root 0; 1, 2 children of 0; 3, 4 of 1; 5 of 2; 6 of 3; 7, 8 of 5; 9 of 6.
    let parents = vec![-1, 0, 0, 1, 1, 2, 3, 5, 5, 6];
    let depth = |mut j: usize| {
        let mut d = 0;
        while parents[j] >= 0 {
            j = parents[j] as usize;
            d += 1;
        }
        d
    };
    for (p, ps, dtype, threads) in configs() {
        let what = format!("{p:?} pages of {ps}, {dtype} cache");
        for prefix in [0usize, 1, 37] {
            let att = Att::new(threads, p, ps, dtype);
            // The prefix and the tree tokens' inputs.
            let seq = Seq::random(&mut rng, prefix + parents.len(), &p);
            let pages: Vec<u32> = (0..(prefix + parents.len()).div_ceil(ps) as u32).collect();
            if prefix > 0 {
                att.step(&[chain(&seq, 0..prefix, &pages)]);
            }
            let tree = Part {
                seq: &seq,
                idx: (prefix..prefix + parents.len()).collect(),
                prefix,
                pages: &pages,
                parents: Some(parents.clone()),
            };
            let got = att.step(&[tree]).remove(0);
            for j in 0..parents.len() {
                // The chain of j's ancestors, in its own pages after a copy
                // of the same prefix.
                let mut path = vec![j];
                while parents[*path.last().unwrap()] >= 0 {
                    path.push(parents[*path.last().unwrap()] as usize);
                }
                path.reverse();
                assert_eq!(path.len(), depth(j) + 1);
                let mut cs = Seq {
                    q: seq.q[..prefix].to_vec(),
                    k: seq.k[..prefix].to_vec(),
                    v: seq.v[..prefix].to_vec(),
                };
                for &a in &path {
                    cs.q.push(seq.q[prefix + a].clone());
                    cs.k.push(seq.k[prefix + a].clone());
                    cs.v.push(seq.v[prefix + a].clone());
                }
                let base = (prefix + parents.len()).div_ceil(ps) as u32 + 1;
                let cp: Vec<u32> =
                    (base..base + (prefix + path.len()).div_ceil(ps) as u32).collect();
                if prefix > 0 {
                    att.step(&[chain(&cs, 0..prefix, &cp)]);
                }
                let rows = att
                    .step(&[chain(&cs, prefix..prefix + path.len(), &cp)])
                    .remove(0);
                for (i, &a) in path.iter().enumerate() {
                    assert_eq!(
                        bits(&got[a]),
                        bits(&rows[i]),
                        "{what}, prefix {prefix}: tree token {a} vs its chain (on the path of {j})"
                    );
                }
            }
        }
    }
}

/// LoRA (`lora_add`): a row's delta is the same bits alone, among other rows
/// of its adapter, or in a step with two other adapters, for 1-3 threads;
/// and it equals an f64 reference of `(x Aᵀ) Bᵀ`.
#[test]
fn lora_rows_are_batch_invariant() {
    use arbor_engine_core::LoraRows;
    // Large enough that one row of rank 16 splits its columns across threads.
    let (inp, outd, t) = (1024, 3072, 12);
    let mut rng = Rng(11);
    let x = rng.normals(t * inp);
    let base = rng.normals(t * outd);
    // (rank, A, B); Bᵀ is made when uploading.
    let factors: Vec<(usize, Vec<f32>, Vec<f32>)> = [4usize, 8, 16]
        .iter()
        .map(|&r| (r, rng.normals(r * inp), rng.normals(outd * r)))
        .collect();
    // Rows 0..4 adapter 0, 4..9 adapter 1, 9..12 adapter 2.
    let segs = [0..4, 4..9, 9..12];
    let reference: Vec<f32> = (0..t)
        .flat_map(|row| {
            let s = segs.iter().position(|s| s.contains(&row)).unwrap();
            let (r, a, bm) = &factors[s];
            let xr = &x[row * inp..(row + 1) * inp];
            let sh: Vec<f64> = (0..*r)
                .map(|k| (0..inp).map(|i| a[k * inp + i] as f64 * xr[i] as f64).sum())
                .collect();
            (0..outd)
                .map(|j| {
                    base[row * outd + j]
                        + (0..*r).map(|k| bm[j * r + k] as f64 * sh[k]).sum::<f64>() as f32
                })
                .collect::<Vec<_>>()
        })
        .collect();
    let run = |threads: usize, rows: std::ops::Range<usize>, which: &[usize]| -> Vec<f32> {
        let b = backend(threads);
        let n = rows.len();
        let xt = b
            .upload_f32(&[n, inp], &x[rows.start * inp..rows.end * inp])
            .unwrap();
        let ot = b
            .upload_f32(&[n, outd], &base[rows.start * outd..rows.end * outd])
            .unwrap();
        let up: Vec<(Tensor, Tensor, Tensor)> = factors
            .iter()
            .map(|(r, a, bm)| {
                let mut bt = vec![0f32; bm.len()];
                for j in 0..outd {
                    for k in 0..*r {
                        bt[k * outd + j] = bm[j * r + k];
                    }
                }
                (
                    b.upload_f32(&[*r, inp], a).unwrap(),
                    b.upload_f32(&[outd, *r], bm).unwrap(),
                    b.upload_f32(&[*r, outd], &bt).unwrap(),
                )
            })
            .collect();
        let entries: Vec<LoraRows<'_>> = which
            .iter()
            .filter_map(|&s| {
                let lo = segs[s].start.max(rows.start);
                let hi = segs[s].end.min(rows.end);
                (lo < hi).then(|| LoraRows {
                    rows: lo - rows.start..hi - rows.start,
                    a: &up[s].0,
                    b: &up[s].1,
                    bt: &up[s].2,
                })
            })
            .collect();
        b.lora_add(&xt, &ot, &entries).unwrap();
        b.download_f32(&ot).unwrap()
    };
    let all = run(2, 0..t, &[0, 1, 2]);
    let worst = all
        .iter()
        .zip(&reference)
        .fold(0f32, |m, (a, r)| m.max((a - r).abs() / (1.0 + r.abs())));
    // f32 sums of 1024 products against f64 ones.
    assert!(worst < 2e-4, "against the f64 reference: {worst}");
    for threads in 1..=3 {
        for row in 0..t {
            let alone = run(threads, row..row + 1, &[0, 1, 2]);
            assert_eq!(
                bits(&alone),
                bits(&all[row * outd..(row + 1) * outd]),
                "row {row}, {threads} threads"
            );
        }
        let seg1 = run(threads, 4..9, &[1]);
        assert_eq!(
            bits(&seg1),
            bits(&all[4 * outd..9 * outd]),
            "{threads} threads"
        );
    }
}

/// `bf16(v)` as `vcvtne2ps2bf16` rounds (to nearest even; the weights here
/// have no f32 subnormals), as the bytes of a bf16 weight.
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_bits().to_le_bytes())
        .collect()
}

/// A backend created with `--cpu-quant-matmul amx-bf16` multiplies the
/// scaled block formats exactly as bf16 weights holding their bf16-rounded
/// dequantization (row for row, bit for bit, at every `m` and thread
/// count, alone or in a `linear_many` that shares the bf16 activations with
/// a bf16 layer), which is not what the default f32 products give. Without
/// AMX the backend reports and runs `QuantMatmul::F32`.
#[test]
fn amx_bf16_linear_equals_the_linear_of_bf16_rounded_weights() {
    use arbor_engine_core::QuantMatmul;
    let amx = arbor_quant::detected_level() >= arbor_quant::SimdLevel::Amx;
    let make = |threads: usize| {
        let b = CpuBackend::new(threads)
            .unwrap()
            .with_quant_matmul(QuantMatmul::AmxBf16);
        let want = if amx {
            QuantMatmul::AmxBf16
        } else {
            QuantMatmul::F32
        };
        assert_eq!(b.quant_matmul(), want);
        Arc::new(b) as Arc<dyn Backend>
    };
    if !amx {
        println!("no AMX-BF16 on this CPU: amx-bf16 falls back to f32 (checked)");
        return;
    }
    let (exact, amx2, amx3) = (backend(2), make(2), make(3));
    let mut rng = Rng(21);
    let (n, k) = (70, 32 * 12);
    for dtype in [DType::F8_S32, DType::U4_S32, DType::U8_S32, DType::F4_S16] {
        let vals = rng.normals(n * k);
        let mut data = vec![0u8; arbor_quant::row_bytes(dtype, n * k).unwrap()];
        arbor_quant::quantize(dtype, &vals, &mut data).unwrap();
        let mut deq = vec![0.0f32; n * k];
        arbor_quant::dequantize(dtype, &data, &mut deq).unwrap();
        let host = |dtype, data: &[u8]| HostTensor {
            dtype,
            shape: vec![n, k],
            data: Cow::Owned(data.to_vec()),
        };
        let rounded = bf16_bytes(&deq);
        for m in [1usize, 9, 33] {
            let x = rng.normals(m * k);
            let mut outs = Vec::new();
            for b in [&amx2, &amx3] {
                let w = b.upload(&host(dtype, &data)).unwrap();
                let wb = b.upload(&host(DType::BF16, &rounded)).unwrap();
                let got = linear(&**b, &x, m, k, &w, None);
                assert_eq!(
                    bits(&got),
                    bits(&linear(&**b, &x, m, k, &wb, None)),
                    "{dtype} m={m}"
                );
                // Both layers in one call share the bf16 activations.
                let xt = b.upload_f32(&[m, k], &x).unwrap();
                let (o1, o2) = (
                    b.alloc(DType::F32, &[m, n]).unwrap(),
                    b.alloc(DType::F32, &[m, n]).unwrap(),
                );
                b.linear_many(
                    &xt,
                    &[
                        LinearRef::new(&wb, None, &o1),
                        LinearRef::new(&w, None, &o2),
                    ],
                )
                .unwrap();
                assert_eq!(
                    bits(&b.download_f32(&o2).unwrap()),
                    bits(&got),
                    "{dtype} m={m} many"
                );
                assert_eq!(
                    bits(&b.download_f32(&o1).unwrap()),
                    bits(&got),
                    "{dtype} m={m} bf16"
                );
                outs.push(got);
            }
            assert_eq!(
                bits(&outs[0]),
                bits(&outs[1]),
                "{dtype} m={m}: 2 and 3 threads"
            );
            let w = exact.upload(&host(dtype, &data)).unwrap();
            assert_ne!(
                bits(&linear(&*exact, &x, m, k, &w, None)),
                bits(&outs[0]),
                "{dtype} m={m}: amx-bf16 computed the f32 products"
            );
        }
    }
}
