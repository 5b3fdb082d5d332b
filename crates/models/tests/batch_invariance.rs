//! Batch invariance of whole models on the CPU backend: a sequence's logits
//! are bit-identical however the step that computes them is shaped — one
//! prefill, two chunks (a cached prefix), token-by-token decode, or inside a
//! batch with 15 other sequences (prefills and decodes of other lengths) —
//! and a draft-tree token's logits equal the same token's in a chain of only
//! its ancestors. Checked on the tiny fixture models (tests/fixtures, the
//! mixture-of-experts ones included: routing is per token) with
//! f32, bf16, Q4_1 and Q8_0 weights (and FP8, INT4 and NVFP4 under
//! `QuantMatmul::AmxBf16`), and on the default model
//! (SmolLM2-135M-Instruct Q4_1 GGUF; skipped with a message when absent),
//! where 16 concurrent greedy requests also give the tokens each gives alone.

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{
    Backend, BackendCapabilities, BatchLayout, DType, ForwardBatch, ForwardContext, HostTensor,
    KvCache, KvSpec, LoadOptions, Model, QuantMatmul, QuantMethod, Registry,
};
use arbor_models::load_model;
use std::borrow::Cow;
use std::path::PathBuf;
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
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}

/// Quantizes every weight matrix whose rows are whole 32-element blocks to
/// `target` (the rest stays f32), as a GGUF file would store them.
struct Quantize(DType);

impl QuantMethod for Quantize {
    fn name(&self) -> &str {
        "test-quantize"
    }
    fn prepare<'a>(
        &self,
        tensor: HostTensor<'a>,
        _caps: &BackendCapabilities,
    ) -> arbor_engine_core::Result<HostTensor<'a>> {
        let x = tensor.to_f32_vec()?;
        let k = tensor.shape.last().copied().unwrap_or(0);
        if tensor.shape.len() != 2 || !k.is_multiple_of(self.0.block_size()) {
            return tensor.cast(DType::F32);
        }
        let mut data = vec![0u8; arbor_quant::row_bytes(self.0, x.len()).expect("blocks")];
        arbor_quant::quantize(self.0, &x, &mut data).expect("quantize");
        Ok(HostTensor {
            dtype: self.0,
            shape: tensor.shape.clone(),
            data: Cow::Owned(data),
        })
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn load_fixture(name: &str, quant: &str) -> Result<(Arc<dyn Model>, Arc<dyn Backend>)> {
    load_fixture_as(name, quant, QuantMatmul::F32)
}

/// [`load_fixture`] on a CPU backend multiplying the scaled formats as
/// `matmul` says; `quant` may also name a scaled format (`u4_s32`,
/// `f4_s16`), which every linear weight is quantized to at load.
fn load_fixture_as(
    name: &str,
    quant: &str,
    matmul: QuantMatmul,
) -> Result<(Arc<dyn Model>, Arc<dyn Backend>)> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?.with_quant_matmul(matmul));
    let quant: Arc<dyn QuantMethod> = match quant {
        "q4_1" => Arc::new(Quantize(DType::Q4_1)),
        "q8_0" => Arc::new(Quantize(DType::Q8_0)),
        "u4_s32" => Arc::new(Quantize(DType::U4_S32)),
        "f4_s16" => Arc::new(Quantize(DType::F4_S16)),
        other => registry.quant_methods.get(other)?(&Default::default())?,
    };
    let opts = LoadOptions {
        backend: backend.clone(),
        quant,
        progress: None,
    };
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name);
    Ok((load_model(&dir, &registry, &opts)?.model, backend))
}

/// The chain checks through `ModelRunner::step`: the logits of position `p`
/// of one sequence of `len` tokens, computed as a decode, in one prefill, in
/// two chunks and inside batches with 15 other sequences, are the same bits.
fn check_chains(
    what: &str,
    model: &Arc<dyn Model>,
    backend: &Arc<dyn Backend>,
    kv_dtype: DType,
    len: usize,
    seed: u64,
) -> Result<()> {
    let vocab = model.spec().vocab_size;
    let page_size = 4;
    let runner = ModelRunner::new(
        model.clone(),
        backend.clone(),
        None,
        page_size,
        4 * 16 * len.div_ceil(page_size),
        kv_dtype,
    )?;
    let pool = runner.new_page_pool();
    let mut rng = Rng(seed);
    let seq = rng.tokens(len, vocab);
    let ours = pool.alloc(pool.pages_for(len))?;
    let step = |tokens: &[u32], prefix: usize| -> Result<Vec<f32>> {
        let mut l = runner.step(&[SeqStep {
            tokens,
            prefix_len: prefix,
            pages: ours.pages(),
            want_logits: true,
            state_slot: None,
        }])?;
        l.pop().context("logits")
    };
    // Reference: token by token.
    let mut want = Vec::with_capacity(len);
    for p in 0..len {
        want.push(bits(&step(&seq[p..p + 1], p)?));
    }
    let same = |got: &[f32], p: usize, how: &str| {
        assert_eq!(
            bits(got),
            want[p],
            "{what}: logits of position {p} {how} differ from its decode"
        );
    };
    // One prefill, and prefills of shorter prefixes.
    same(&step(&seq, 0)?, len - 1, "in one prefill");
    for p in [0, 1, len / 3, len - 2] {
        same(&step(&seq[..=p], 0)?, p, "in a shorter prefill");
    }
    // Two chunks (a cached prefix), at several splits.
    for cut in [1, 13.min(len - 1), len - 1] {
        same(&step(&seq[..cut], 0)?, cut - 1, "in a first chunk");
        same(&step(&seq[cut..], cut)?, len - 1, "after a cached prefix");
    }
    // In batches with 15 other sequences.
    let others: Vec<Vec<u32>> = (0..15).map(|_| rng.tokens(len, vocab)).collect();
    let pages: Vec<_> = (0..15)
        .map(|_| pool.alloc(pool.pages_for(len)))
        .collect::<arbor_engine_core::Result<_>>()?;
    // (a) ours a decode among prefills of other lengths;
    // (b) ours a chunk among decodes and chunks of the others;
    // (c) ours a prefill among everything.
    let mut filled = [0usize; 15];
    for (case, (ours_from, ours_to)) in [(len - 1, len), (len / 2, len), (0, len)]
        .into_iter()
        .enumerate()
    {
        let mut steps: Vec<SeqStep<'_>> = Vec::new();
        for (i, o) in others.iter().enumerate() {
            // Each other sequence continues from where it is by 1..len tokens.
            let from = filled[i].min(len - 1);
            let to = if case == 1 && i % 2 == 0 {
                from + 1
            } else {
                from + 1 + rng.below(len - from)
            };
            filled[i] = to;
            steps.push(SeqStep {
                tokens: &o[from..to],
                prefix_len: from,
                pages: pages[i].pages(),
                want_logits: i % 3 != 0,
                state_slot: None,
            });
        }
        let at = rng.below(16);
        steps.insert(
            at,
            SeqStep {
                tokens: &seq[ours_from..ours_to],
                prefix_len: ours_from,
                pages: ours.pages(),
                want_logits: true,
                state_slot: None,
            },
        );
        let logits = runner.step(&steps)?;
        let row = steps[..at].iter().filter(|s| s.want_logits).count();
        same(
            &logits[row],
            len - 1,
            &format!("in a batch of 16 (case {case})"),
        );
    }
    Ok(())
}

/// The tree check through `Model::forward`: after a cached prefix, a draft
/// tree's tokens (positions prefix + depth) have the logits of the same
/// tokens computed as a chain of only their ancestors.
fn check_tree(
    what: &str,
    model: &Arc<dyn Model>,
    backend: &Arc<dyn Backend>,
    kv_dtype: DType,
    prefix_len: usize,
    seed: u64,
) -> Result<()> {
    let s = model.spec();
    let page_size = 4;
    let kv = KvCache::allocate(
        &**backend,
        KvSpec {
            num_layers: s.num_layers,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            page_size,
            num_pages: 64,
            dtype: kv_dtype,
            values_in_keys: false,
        },
    )?;
    let attention = backend.attention(None)?;
    assert!(
        attention.capabilities().tree,
        "the CPU attention runs trees"
    );
    // One sequence per call: (prefix, tokens, positions, parents) -> every row's logits.
    let forward = |prefix: usize,
                   tokens: &[u32],
                   positions: Vec<u32>,
                   parents: Option<&[i32]>,
                   pages: &[u32]|
     -> Result<Vec<Vec<f32>>> {
        let mut layout = BatchLayout::new(page_size);
        match parents {
            Some(p) => layout.push_tree_seq(prefix, p, pages)?,
            None => layout.push_seq(prefix, tokens.len(), pages)?,
        }
        let layout = Arc::new(layout);
        let attention_batch = attention.prepare(layout.clone())?;
        let batch = ForwardBatch {
            input_ids: tokens.to_vec(),
            positions,
            layout,
            logits_rows: (0..tokens.len() as u32).collect(),
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let ctx = ForwardContext {
            kv: &kv,
            attention: &*attention,
            attention_batch: &attention_batch,
        };
        let l = backend.download_f32(&model.forward(&batch, &ctx)?.logits)?;
        Ok(l.chunks_exact(s.vocab_size).map(<[f32]>::to_vec).collect())
    };
    let mut rng = Rng(seed);
    let prefix = rng.tokens(prefix_len, s.vocab_size);
    // root 0; 1, 2 under 0; 3, 4 under 1; 5 under 2; 6 under 3; 7 under 6.
    let parents = [-1, 0, 0, 1, 1, 2, 3, 6];
    let draft = rng.tokens(parents.len(), s.vocab_size);
    let mut depth = vec![0u32; parents.len()];
    for j in 1..parents.len() {
        depth[j] = depth[parents[j] as usize] + 1;
    }
    let tree_pages: Vec<u32> = (0..8).collect();
    let chain_pages: Vec<u32> = (8..16).collect();
    let pre_pos = |n: usize| (0..n as u32).collect::<Vec<_>>();
    if prefix_len > 0 {
        forward(0, &prefix, pre_pos(prefix_len), None, &tree_pages)?;
    }
    let positions = depth.iter().map(|d| prefix_len as u32 + d).collect();
    let tree = forward(prefix_len, &draft, positions, Some(&parents), &tree_pages)?;
    for j in 0..parents.len() {
        let mut path = vec![j];
        while parents[path[path.len() - 1]] >= 0 {
            path.push(parents[path[path.len() - 1]] as usize);
        }
        path.reverse();
        if prefix_len > 0 {
            forward(0, &prefix, pre_pos(prefix_len), None, &chain_pages)?;
        }
        let toks: Vec<u32> = path.iter().map(|&a| draft[a]).collect();
        let pos = (prefix_len as u32..(prefix_len + path.len()) as u32).collect();
        let chain = forward(prefix_len, &toks, pos, None, &chain_pages)?;
        for (i, &a) in path.iter().enumerate() {
            assert_eq!(
                bits(&tree[a]),
                bits(&chain[i]),
                "{what}: tree token {a} (prefix {prefix_len}) differs from its ancestor chain"
            );
        }
    }
    Ok(())
}

#[test]
fn tiny_models_are_batch_invariant() -> Result<()> {
    let cases = [
        ("tiny-llama", "f32", DType::F32),
        ("tiny-llama", "bf16", DType::F16),
        ("tiny-llama", "q4_1", DType::F16),
        ("tiny-llama", "q8_0", DType::F32),
        ("tiny-qwen2", "f32", DType::F32),
        ("tiny-qwen3", "q4_1", DType::F32),
        ("tiny-mistral", "f32", DType::BF16),
        ("tiny-qwen3-moe", "f32", DType::F32),
        ("tiny-qwen2-moe", "q8_0", DType::F32),
        ("tiny-mixtral", "bf16", DType::F16),
        ("tiny-deepseek-v2", "f32", DType::F32),
        ("tiny-deepseek-v3", "bf16", DType::F32),
        // Latent attention's projections in FP8 (quantized at load), its
        // per-head up-projections float.
        ("tiny-deepseek-v3", "fp8", DType::F16),
    ];
    for (i, (name, quant, kv)) in cases.into_iter().enumerate() {
        let what = format!("{name} ({quant} weights, {kv} KV)");
        let (model, backend) = load_fixture(name, quant).with_context(|| what.clone())?;
        check_chains(&what, &model, &backend, kv, 40, 100 + i as u64)?;
        for prefix in [0, 9] {
            check_tree(&what, &model, &backend, kv, prefix, 200 + i as u64)?;
        }
        println!("{what}: bit-identical");
    }
    Ok(())
}

/// `QuantMatmul::AmxBf16` (bf16 panels in AMX tiles) keeps every
/// position's logits bit-identical whatever the batch, like the f32
/// products: FP8 (per channel, at load), INT4 and NVFP4 weights, dense and
/// MoE. Without AMX the backend runs them as f32 (the same checks).
#[test]
fn amx_bf16_quantized_models_are_batch_invariant() -> Result<()> {
    if arbor_quant::detected_level() < arbor_quant::SimdLevel::Amx {
        println!("no AMX-BF16 on this CPU: amx-bf16 runs as f32 here");
    }
    let cases = [
        ("tiny-llama", "fp8", DType::F16),
        ("tiny-qwen3", "u4_s32", DType::F32),
        ("tiny-mixtral", "f4_s16", DType::BF16),
    ];
    for (i, (name, quant, kv)) in cases.into_iter().enumerate() {
        let what = format!("{name} ({quant} weights, amx-bf16, {kv} KV)");
        let (model, backend) =
            load_fixture_as(name, quant, QuantMatmul::AmxBf16).with_context(|| what.clone())?;
        check_chains(&what, &model, &backend, kv, 40, 300 + i as u64)?;
        check_tree(&what, &model, &backend, kv, 9, 400 + i as u64)?;
        println!("{what}: bit-identical");
    }
    Ok(())
}

#[test]
fn default_model_is_batch_invariant() -> Result<()> {
    let Some(path) = arbor_gguf::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto")?(&Default::default())?,
        progress: None,
    };
    let model = load_model(&path, &registry, &opts)?.model;
    check_chains("SmolLM2-135M Q4_1", &model, &backend, DType::F16, 24, 7)?;
    check_tree("SmolLM2-135M Q4_1", &model, &backend, DType::F16, 11, 8)?;
    Ok(())
}

#[test]
fn default_model_greedy_is_the_same_alone_and_in_a_batch_of_16() -> Result<()> {
    use arbor_engine_core::SamplingParams;
    use arbor_engine_core::runner::{SamplingSetup, generate_static};
    use arbor_engine_core::sampling::StandardSampler;
    let Some(path) = arbor_gguf::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto")?(&Default::default())?,
        progress: None,
    };
    let m = load_model(&path, &registry, &opts)?;
    let runner = ModelRunner::new(m.model.clone(), backend, None, 16, 256, DType::F16)?;
    let pool = runner.new_page_pool();
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let mut rng = Rng(99);
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|i| {
            let mut p = m
                .tokenizer
                .encode(&format!("Question {i}: what is"), true)?;
            p.extend(rng.tokens(1 + i, 40000).iter().map(|t| t + 200));
            Ok(p)
        })
        .collect::<Result<_>>()?;
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(16)
        };
        16
    ];
    let (batched, _) = generate_static(&runner, &pool, &prompts, &params, &setup, &mut |_, _| {})?;
    for (i, p) in prompts.iter().enumerate() {
        let (alone, _) = generate_static(
            &runner,
            &pool,
            std::slice::from_ref(p),
            &params[..1],
            &setup,
            &mut |_, _| {},
        )?;
        assert_eq!(
            alone[0].tokens, batched[i].tokens,
            "request {i}: greedy tokens alone differ from the batch of 16"
        );
    }
    Ok(())
}
