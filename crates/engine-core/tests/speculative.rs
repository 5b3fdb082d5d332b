//! Speculative decoding through the engine on the tiny Llama fixture (a real
//! model, checked against transformers in the models crate).
//!
//! Drafts come from the real speculators of crates/spec-decode (n-gram,
//! layer skip on the target's first layers, and a STANDALONE draft model:
//! tiny-mistral, which shares tiny-llama's vocabulary, or tiny-llama itself,
//! whose drafts must then all be accepted; EAGLE and EAGLE3 heads, chains
//! and trees; an MTP layer) and
//! from an *oracle* test speculator that proposes the known greedy continuation
//! with every fifth token corrupted, so that every step both accepts and
//! rejects drafts. Greedy output must be identical, token for token, to plain
//! decoding: alone, in a batch of 32, chunked, cached, retracted, with n > 1,
//! stop strings and json_schema grammars, with overlap scheduling on and off;
//! sampled output must keep plain sampling's distribution (chi-square). Every
//! test ends with the KV pool empty after a flush.

#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::grammar::{
    GrammarBackendConfig, GrammarCache, GrammarCacheConfig, GrammarOptions, GrammarSpec,
    GrammarVocab, JsonWhitespace, VocabSource,
};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::speculative::{
    Draft, DraftDist, DraftRequest, Drafting, SpeculativeConfig, Speculator, SpeculatorInputs,
};
use arbor_engine_core::{DType, PrefixCacheOptions, SamplingParams, SeqRng, TokenDecoder};
use arbor_engine_core::{LoadOptions, Model};
use arbor_grammar as _;
use arbor_kv_radix as _;
use arbor_spec_decode as _;

#[path = "support/tiny.rs"]
mod tiny;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tiny::{assert_pool_empty, fixture, greedy, prompts, shared};

/// Greedy continuations known in advance, keyed by prompt.
type Answers = Arc<Mutex<HashMap<Vec<u32>, Vec<u32>>>>;

/// Proposes the known continuation of a request's prompt with every fifth
/// position corrupted (a test speculator: it exercises acceptance and
/// rejection at chosen places; the drafts are a function of the sequence
/// only, as verification requires).
struct Oracle {
    answers: Answers,
    seqs: HashMap<u64, Vec<u32>>,
    vocab: u32,
    /// Propose trees: beside each corrupted token, a sibling with the right
    /// token and the next two right tokens under it (so verification accepts
    /// a path that is not the first chain, and its KV must be moved).
    tree: bool,
}

impl Speculator for Oracle {
    fn name(&self) -> &str {
        "oracle"
    }
    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft> {
        let answers = self.answers.lock().unwrap();
        reqs.iter()
            .map(|r| {
                let seq = self.seqs.get(&r.key).cloned().unwrap_or_default();
                let hit = answers
                    .iter()
                    .find(|(p, _)| seq.len() >= p.len() && seq.starts_with(p));
                let Some((p, ans)) = hit else {
                    return Draft::default();
                };
                let done = seq.len() - p.len();
                let corrupt = |i: usize, t: u32| if i % 5 == 3 { (t + 1) % self.vocab } else { t };
                if !(self.tree && r.allow_tree) {
                    let toks = ans
                        .iter()
                        .enumerate()
                        .skip(done)
                        .take(r.max_tokens)
                        .map(|(i, &t)| corrupt(i, t))
                        .collect();
                    return Draft::chain(toks);
                }
                let mut tokens = Vec::new();
                let mut parents: Vec<Option<u32>> = Vec::new();
                let mut last: Option<u32> = None;
                for (i, &t) in ans.iter().enumerate().skip(done) {
                    if tokens.len() + 4 > r.max_tokens {
                        break;
                    }
                    let c = corrupt(i, t);
                    tokens.push(c);
                    parents.push(last);
                    let here = Some(tokens.len() as u32 - 1);
                    if c != t {
                        // The right sibling, then two right tokens under it.
                        tokens.push(t);
                        parents.push(last);
                        let mut under = Some(tokens.len() as u32 - 1);
                        for &u in ans.iter().skip(i + 1).take(2) {
                            tokens.push(u);
                            parents.push(under);
                            under = Some(tokens.len() as u32 - 1);
                        }
                    }
                    last = here;
                }
                Draft {
                    tokens,
                    parents: Some(parents),
                    probs: Vec::new(),
                }
            })
            .collect()
    }
    fn observe(&mut self, key: u64, tokens: &[u32]) {
        self.seqs.entry(key).or_default().extend_from_slice(tokens);
    }
    fn release(&mut self, key: u64) {
        self.seqs.remove(&key);
    }
}

/// Proposes, for a sampled request, a fixed-shape tree drawn from a fixed
/// distribution `q` over the vocabulary (a test speculator for recursive
/// rejection sampling with several children per row): three children of
/// the pending token drawn without replacement, then two under the first.
/// The shape never depends on the draws, as verification requires.
struct DrawnTree {
    q: DraftDist,
}

impl DrawnTree {
    fn new(vocab: u32) -> Self {
        let w: Vec<f32> = (0..vocab).map(|t| 1.0 + (t % 7) as f32).collect();
        let total: f32 = w.iter().sum();
        Self {
            q: w.iter()
                .enumerate()
                .map(|(t, &x)| (x / total, t as u32))
                .collect(),
        }
    }

    /// `k` distinct tokens drawn from `q` without replacement, in order.
    fn draw(&self, k: usize, rng: &mut SeqRng) -> Vec<u32> {
        let mut left: Vec<f32> = self.q.iter().map(|x| x.0).collect();
        let mut out = Vec::new();
        for _ in 0..k {
            let mut r = rng.next_f32() * left.iter().sum::<f32>();
            let mut pick = 0;
            for (i, &w) in left.iter().enumerate() {
                if w > 0.0 {
                    pick = i;
                    r -= w;
                    if r < 0.0 {
                        break;
                    }
                }
            }
            left[pick] = 0.0;
            out.push(self.q[pick].1);
        }
        out
    }
}

impl Speculator for DrawnTree {
    fn name(&self) -> &str {
        "drawn-tree"
    }
    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft> {
        reqs.iter()
            .map(|r| {
                let Some(s) = r.sampling.filter(|_| r.allow_tree) else {
                    return Draft::default();
                };
                let mut rng = SeqRng::new(s.seed);
                let mut tokens = self.draw(3, &mut rng);
                tokens.extend(self.draw(2, &mut rng));
                Draft {
                    tokens,
                    parents: Some(vec![None, None, None, Some(0), Some(0)]),
                    probs: vec![self.q.clone(); 5],
                }
            })
            .collect()
    }
    fn observe(&mut self, _key: u64, _tokens: &[u32]) {}
    fn release(&mut self, _key: u64) {}
    /// Draws from a distribution, as a model drafter does (which is what
    /// gives it the request's sampling parameters and seed).
    fn drafting(&self) -> Drafting {
        Drafting::Model {
            max_tokens: 5,
            tree: true,
        }
    }
}

#[derive(Clone)]
enum Spec {
    Off,
    Oracle(Answers),
    OracleTree(Answers),
    Ngram,
    /// The target's first N layers draft.
    LayerSkip(usize),
    /// A separate draft model.
    Standalone(Arc<dyn Model>),
    /// The EAGLE3 head of tests/fixtures/eagle3-tiny-llama.
    Eagle3,
    /// The MTP layer of tests/fixtures/tiny-llama-mtp (tiny-llama's weights
    /// plus one next-n prediction layer).
    Nextn,
    /// The EAGLE3 head drafting trees (`eagle_topk` 3 over 3 levels, 8 nodes).
    Eagle3Tree,
    /// The EAGLE head of tests/fixtures/eagle-tiny-llama.
    Eagle,
    /// [`DrawnTree`].
    DrawnTree,
}

/// A fixture model loaded on the shared CPU backend (a STANDALONE draft).
fn draft_model(name: &str) -> Result<Arc<dyn Model>> {
    let s = shared();
    let opts = LoadOptions {
        backend: s.backend.clone(),
        quant: s.registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let path = fixture().join("..").join(name);
    Ok(arbor_models::load_model(&path, &s.registry, &opts)?.model)
}

fn speculative(draft_tokens: usize, adaptive: bool) -> SpeculativeConfig {
    SpeculativeConfig {
        num_draft_tokens: draft_tokens,
        adaptive,
        ..SpeculativeConfig::default()
    }
}

fn engine(mut cfg: EngineConfig, num_pages: usize, spec: &Spec) -> Result<Engine> {
    let s = shared();
    let runner = Arc::new(ModelRunner::new(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        16,
        num_pages,
        DType::F32,
    )?);
    let mut inputs = SpeculatorInputs {
        target: runner.clone(),
        target_group: None,
        draft_model: None,
        draft_path: None,
    };
    let cache_name = if cfg.disable_radix_cache {
        "none"
    } else {
        "radix"
    };
    let policy = s.registry.eviction_policies.get("lru")?()?;
    let cache = s.registry.prefix_caches.get(cache_name)?(&PrefixCacheOptions {
        page_size: 16,
        policy,
    })?;
    let mut parts = EngineParts::local(
        runner,
        cache,
        s.registry.samplers.get("standard")?()?,
        vec![s.registry.logits_processors.get("penalties")?(
            &serde_json::Value::Null,
        )?],
        s.model.tokenizer.clone(),
        s.model.tokenizer.eos_token_ids.clone(),
    );
    match spec {
        Spec::Off => cfg.speculative = None,
        Spec::Oracle(answers) | Spec::OracleTree(answers) => {
            cfg.speculative.get_or_insert_with(|| {
                speculative(
                    if matches!(spec, Spec::OracleTree(_)) {
                        12
                    } else {
                        6
                    },
                    false,
                )
            });
            parts.speculator = Some(Box::new(Oracle {
                answers: answers.clone(),
                seqs: HashMap::new(),
                vocab: s.model.model.spec().vocab_size as u32,
                tree: matches!(spec, Spec::OracleTree(_)),
            }));
        }
        Spec::DrawnTree => {
            cfg.speculative.get_or_insert_with(|| speculative(5, false));
            parts.speculator = Some(Box::new(DrawnTree::new(
                s.model.model.spec().vocab_size as u32,
            )));
        }
        Spec::Ngram => {
            let sc = cfg.speculative.get_or_insert_with(|| speculative(8, false));
            parts.speculator = Some(s.registry.speculators.get("ngram")?(sc, &inputs)?);
        }
        Spec::LayerSkip(n) => {
            let sc = cfg.speculative.get_or_insert_with(|| speculative(6, false));
            sc.draft_layers = Some(*n);
            parts.speculator = Some(s.registry.speculators.get("layerskip")?(sc, &inputs)?);
        }
        Spec::Standalone(m) => {
            let sc = cfg.speculative.get_or_insert_with(|| speculative(6, false));
            inputs.draft_model = Some(m.clone());
            parts.speculator = Some(s.registry.speculators.get("standalone")?(sc, &inputs)?);
        }
        Spec::Eagle3 | Spec::Nextn | Spec::Eagle3Tree | Spec::Eagle => {
            let sc = cfg.speculative.get_or_insert_with(|| speculative(6, false));
            if matches!(spec, Spec::Eagle3Tree) {
                sc.eagle_topk = 3;
                sc.num_steps = 3;
                sc.num_draft_tokens = 8;
            }
            let (name, dir) = match spec {
                Spec::Nextn => ("nextn", "tiny-llama-mtp"),
                Spec::Eagle => ("eagle", "eagle-tiny-llama"),
                _ => ("eagle3", "eagle3-tiny-llama"),
            };
            inputs.draft_path = Some(fixture().join("..").join(dir));
            parts.speculator = Some(s.registry.speculators.get(name)?(sc, &inputs)?);
        }
    }
    Ok(Engine::new(cfg, parts)?)
}

/// Prompts that repeat a phrase, so the n-gram table has something to copy.
fn copy_prompts(n: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = SeqRng::new(seed);
    (0..n)
        .map(|_| {
            let phrase: Vec<u32> = (0..6 + rng.next_u64() % 8)
                .map(|_| (rng.next_u64() % 497) as u32)
                .collect();
            let mut p = Vec::new();
            for _ in 0..4 {
                p.extend_from_slice(&phrase);
            }
            p
        })
        .collect()
}

fn run_all(e: &Engine, reqs: Vec<GenerateRequest>) -> Result<Vec<Vec<u32>>> {
    let streams: Vec<_> = reqs
        .into_iter()
        .map(|r| e.submit(r))
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for s in streams {
        let chunks = s.collect_blocking();
        let f = chunks
            .last()
            .and_then(|c| c.finish.clone())
            .context("finished")?;
        assert_ne!(f.kind, FinishKind::Abort, "{f:?}");
        // n > 1: the samples' tokens in index order.
        let mut by_index: Vec<Vec<u32>> = Vec::new();
        for c in &chunks {
            let i = c.index as usize;
            if by_index.len() <= i {
                by_index.resize(i + 1, Vec::new());
            }
            by_index[i].extend_from_slice(&c.token_ids);
        }
        out.extend(by_index);
    }
    Ok(out)
}

fn plain(ps: &[Vec<u32>], params: &SamplingParams) -> Vec<GenerateRequest> {
    ps.iter()
        .map(|p| GenerateRequest::new(p.clone(), params.clone()))
        .collect()
}

/// Greedy outputs one at a time without speculation.
fn reference(ps: &[Vec<u32>], params: &SamplingParams) -> Result<Vec<Vec<u32>>> {
    let e = engine(EngineConfig::default(), 256, &Spec::Off)?;
    let mut out = Vec::new();
    for p in ps {
        out.extend(run_all(&e, plain(std::slice::from_ref(p), params))?);
    }
    assert_pool_empty(&e);
    Ok(out)
}

fn answers(ps: &[Vec<u32>], outs: &[Vec<u32>]) -> Answers {
    Arc::new(Mutex::new(
        ps.iter().cloned().zip(outs.iter().cloned()).collect(),
    ))
}

fn check_all_shapes(
    spec: &Spec,
    ps: &[Vec<u32>],
    want: &[Vec<u32>],
    overlap: bool,
) -> Result<(u64, u64)> {
    let base = EngineConfig {
        overlap_schedule: Some(overlap),
        ..Default::default()
    };
    let p = greedy(24);
    let mut drafted = 0;
    let mut accepted = 0;
    let mut tally = |e: &Engine| {
        let s = e.stats();
        drafted += s.spec_draft_tokens_total;
        accepted += s.spec_accepted_tokens_total;
    };
    // Alone.
    let e = engine(base.clone(), 256, spec)?;
    for (pr, w) in ps.iter().zip(want) {
        assert_eq!(
            &run_all(&e, plain(std::slice::from_ref(pr), &p))?[0],
            w,
            "alone"
        );
    }
    tally(&e);
    assert_pool_empty(&e);
    // Batched, then again with every prompt cached.
    let e = engine(base.clone(), 256, spec)?;
    assert_eq!(run_all(&e, plain(ps, &p))?, want, "batched");
    assert_eq!(run_all(&e, plain(ps, &p))?, want, "cached");
    tally(&e);
    assert_pool_empty(&e);
    // Chunked prefill.
    let cfg = EngineConfig {
        chunked_prefill_size: 16,
        ..base.clone()
    };
    let e = engine(cfg, 256, spec)?;
    assert_eq!(run_all(&e, plain(ps, &p))?, want, "chunked");
    tally(&e);
    assert_pool_empty(&e);
    // A small pool and an optimistic budget: retraction.
    let cfg = EngineConfig {
        schedule_conservativeness: 0.05,
        ..base.clone()
    };
    let e = engine(cfg, 12, spec)?;
    assert_eq!(run_all(&e, plain(&ps[..12], &p))?, want[..12], "retracted");
    assert!(
        e.stats().num_retracted_reqs_total > 0,
        "no retraction happened"
    );
    tally(&e);
    assert_pool_empty(&e);
    Ok((drafted, accepted))
}

#[test]
fn oracle_drafts_keep_greedy_output_identical() -> Result<()> {
    oracle_case(11, Spec::Oracle)
}

#[test]
fn tree_drafts_keep_greedy_output_identical() -> Result<()> {
    oracle_case(17, Spec::OracleTree)
}

/// Every shape with an oracle speculator (chain or tree) over 32 prompts of `seed`.
fn oracle_case(seed: u64, spec: fn(Answers) -> Spec) -> Result<()> {
    let ps = prompts(32, seed);
    let want = reference(&ps, &greedy(24))?;
    for overlap in [false, true] {
        let (drafted, accepted) =
            check_all_shapes(&spec(answers(&ps, &want)), &ps, &want, overlap)?;
        assert!(
            accepted > 0 && accepted < drafted,
            "{accepted} of {drafted}"
        );
    }
    Ok(())
}

#[test]
fn ngram_drafts_keep_greedy_output_identical() -> Result<()> {
    let mut ps = copy_prompts(24, 5);
    ps.extend(prompts(8, 3));
    let want = reference(&ps, &greedy(24))?;
    for overlap in [false, true] {
        let (drafted, accepted) = check_all_shapes(&Spec::Ngram, &ps, &want, overlap)?;
        assert!(drafted > 0, "the n-gram speculator drafted nothing");
        eprintln!("n-gram (overlap {overlap}): {accepted} of {drafted} drafts accepted");
    }
    Ok(())
}

/// Prompts with something to copy and free ones.
fn mixed_prompts() -> Vec<Vec<u32>> {
    let mut ps = copy_prompts(24, 5);
    ps.extend(prompts(8, 3));
    ps
}

#[test]
fn layer_skip_drafts_keep_greedy_output_identical() -> Result<()> {
    let ps = mixed_prompts();
    let want = reference(&ps, &greedy(24))?;
    for (layers, overlap) in [(1, false), (2, true)] {
        let (drafted, accepted) = check_all_shapes(&Spec::LayerSkip(layers), &ps, &want, overlap)?;
        assert!(drafted > 0, "layer skip drafted nothing");
        eprintln!(
            "layer skip {layers} (overlap {overlap}): {accepted} of {drafted} drafts accepted"
        );
    }
    Ok(())
}

#[test]
fn standalone_drafts_keep_greedy_output_identical() -> Result<()> {
    let ps = mixed_prompts();
    let want = reference(&ps, &greedy(24))?;
    // Another model with the same vocabulary: drafts accepted and rejected.
    let (drafted, accepted) = check_all_shapes(
        &Spec::Standalone(draft_model("tiny-mistral")?),
        &ps,
        &want,
        false,
    )?;
    assert!(drafted > 0, "the draft model drafted nothing");
    eprintln!("standalone tiny-mistral: {accepted} of {drafted} drafts accepted");
    // The target as its own draft: every draft is the target's own greedy
    // token, so every one is accepted, in every shape (cached prefixes and
    // retraction included) only if the draft KV the drafter reuses is right.
    for overlap in [false, true] {
        let (drafted, accepted) = check_all_shapes(
            &Spec::Standalone(shared().model.model.clone()),
            &ps,
            &want,
            overlap,
        )?;
        assert!(drafted > 0);
        assert_eq!(
            accepted, drafted,
            "self-drafts rejected (overlap {overlap})"
        );
    }
    Ok(())
}

#[test]
fn eagle_eagle3_and_nextn_drafts_keep_greedy_output_identical() -> Result<()> {
    let ps = mixed_prompts();
    let want = reference(&ps, &greedy(24))?;
    for (name, spec, overlap) in [
        ("EAGLE3", Spec::Eagle3, false),
        ("EAGLE3", Spec::Eagle3, true),
        ("NEXTN", Spec::Nextn, false),
        ("NEXTN", Spec::Nextn, true),
        ("EAGLE3 trees", Spec::Eagle3Tree, false),
        ("EAGLE3 trees", Spec::Eagle3Tree, true),
        ("EAGLE", Spec::Eagle, false),
    ] {
        let (drafted, accepted) = check_all_shapes(&spec, &ps, &want, overlap)?;
        assert!(drafted > 0, "{name} drafted nothing");
        eprintln!("{name} (overlap {overlap}): {accepted} of {drafted} drafts accepted");
    }
    Ok(())
}

#[test]
fn n_samples_stop_conditions_and_adaptive() -> Result<()> {
    let ps = copy_prompts(6, 9);
    // Stop strings and token ids from the reference's own output.
    let want = reference(&ps, &greedy(20))?;
    let params = SamplingParams {
        n: 3,
        stop_token_ids: vec![want[0][10]],
        stop: vec![shared().model.tokenizer.decode(&want[1][8..10], true)?],
        ..greedy(20)
    };
    let want_stop = reference(&ps, &params)?;
    for spec in [
        Spec::Oracle(answers(&ps, &want)),
        Spec::Ngram,
        Spec::LayerSkip(2),
        Spec::Eagle3,
    ] {
        for adaptive in [false, true] {
            let cfg = EngineConfig {
                speculative: Some(speculative(6, adaptive)),
                ..Default::default()
            };
            let e = engine(cfg, 256, &spec)?;
            assert_eq!(
                run_all(&e, plain(&ps, &params))?,
                want_stop,
                "n=3 with stops"
            );
            assert_pool_empty(&e);
        }
    }
    Ok(())
}

#[test]
fn json_schema_grammar_with_speculation() -> Result<()> {
    let s = shared();
    let vocab = GrammarVocab {
        source: VocabSource::TokenizerJson(
            std::fs::read_to_string(fixture().join("tokenizer.json"))?.into(),
        ),
        eos_token_ids: s.model.tokenizer.eos_token_ids.clone(),
        vocab_size: Some(s.model.model.spec().vocab_size),
    };
    let gb = s.registry.grammar_backends.get("llguidance")?(&GrammarBackendConfig {
        vocab,
        options: GrammarOptions {
            json_whitespace: JsonWhitespace::Compact,
            ..Default::default()
        },
    })?;
    let cache = GrammarCache::new(gb, GrammarCacheConfig::default());
    let schema = r#"{"type":"object","properties":{"name":{"type":"string","maxLength":8},"n":{"type":"integer"}},"required":["name","n"]}"#;
    let grammar = cache.get(&GrammarSpec::JsonSchema(schema.into()))?;
    let ps = prompts(8, 21);
    let reqs = |ps: &[Vec<u32>]| -> Vec<GenerateRequest> {
        ps.iter()
            .map(|p| GenerateRequest {
                grammar: Some(grammar.clone()),
                ..GenerateRequest::new(p.clone(), SamplingParams::greedy(40))
            })
            .collect()
    };
    let off = engine(EngineConfig::default(), 256, &Spec::Off)?;
    let want = run_all(&off, reqs(&ps))?;
    assert_pool_empty(&off);
    for overlap in [false, true] {
        let cfg = EngineConfig {
            overlap_schedule: Some(overlap),
            ..Default::default()
        };
        let e = engine(cfg, 256, &Spec::Oracle(answers(&ps, &want)))?;
        assert_eq!(run_all(&e, reqs(&ps))?, want, "grammar, overlap {overlap}");
        assert!(e.stats().spec_accepted_tokens_total > 0);
        assert_pool_empty(&e);
    }
    Ok(())
}

/// How often each (token 2, token 3) pair was drawn.
type Counts = HashMap<(u32, u32), usize>;

/// Chi-square statistic's critical value at p = 0.001 (Wilson–Hilferty).
fn chi2_critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.090; // one-sided 0.999 normal quantile
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[test]
fn sampled_tokens_keep_their_distribution() -> Result<()> {
    let prompt = copy_prompts(1, 4).remove(0);
    let want = reference(std::slice::from_ref(&prompt), &greedy(4))?;
    let params = |seed: u64| SamplingParams {
        temperature: 1.3,
        seed: Some(seed),
        ..greedy(5)
    };
    let n = 1200;
    // The counts of (token 2, token 3), and (accepted, drafted) drafts.
    let collect = |spec: &Spec| -> Result<(Counts, (u64, u64))> {
        let e = engine(EngineConfig::default(), 256, spec)?;
        let mut counts = HashMap::new();
        for chunk in (0..n as u64).collect::<Vec<_>>().chunks(64) {
            let reqs = chunk
                .iter()
                .map(|&s| GenerateRequest::new(prompt.clone(), params(s)))
                .collect();
            for out in run_all(&e, reqs)? {
                // Tokens 2 and 3 are drawn by the first verification (of up
                // to four drafts: chains, or trees of several levels).
                *counts.entry((out[1], out[2])).or_default() += 1;
            }
        }
        let st = e.stats();
        assert_pool_empty(&e);
        Ok((
            counts,
            (st.spec_accepted_tokens_total, st.spec_draft_tokens_total),
        ))
    };
    let (a, _) = collect(&Spec::Off)?;
    // The oracle's drafts are a function of the sequence (point masses);
    // model drafters (and the drawn trees) draw theirs from their own
    // distribution and verification runs recursive rejection sampling
    // against it: either way the distribution is plain sampling's.
    let specs = [
        (
            "oracle",
            Spec::Oracle(answers(std::slice::from_ref(&prompt), &want)),
        ),
        ("layer skip", Spec::LayerSkip(2)),
        (
            "standalone (self)",
            Spec::Standalone(shared().model.model.clone()),
        ),
        ("eagle3", Spec::Eagle3),
        ("nextn", Spec::Nextn),
        ("eagle", Spec::Eagle),
        ("eagle3 trees", Spec::Eagle3Tree),
        ("drawn trees", Spec::DrawnTree),
    ];
    for (name, spec) in specs {
        let self_draft = matches!(spec, Spec::Standalone(_));
        let (b, (accepted, drafted)) = collect(&spec)?;
        eprintln!("{name}: {accepted} of {drafted} sampled drafts accepted");
        if matches!(spec, Spec::DrawnTree) {
            // Several children per row, drawn from q: some are accepted.
            assert!(
                drafted > 0 && accepted > 0,
                "{name}: {accepted} of {drafted}"
            );
        }
        if self_draft {
            // Drawn from the target's own distribution: q = p, so every
            // draft is accepted.
            assert!(drafted > 0);
            assert_eq!(accepted, drafted, "{name}");
        }
        let (stat, dof) = chi_square(&a, &b);
        let crit = chi2_critical(dof);
        eprintln!(
            "{name}: chi-square {stat:.1} over {dof} degrees of freedom (critical {crit:.1} at p = 0.001)"
        );
        assert!(
            stat < crit,
            "{name} changed the sampled distribution: {stat} >= {crit}"
        );
    }
    Ok(())
}

/// Two-sample chi-square over the categories seen (rare ones pooled): the
/// statistic and its degrees of freedom.
fn chi_square(a: &Counts, b: &Counts) -> (f64, usize) {
    let mut keys: Vec<_> = a.keys().chain(b.keys()).copied().collect();
    keys.sort();
    keys.dedup();
    let (mut stat, mut dof) = (0.0, 0usize);
    let (mut ra, mut rb) = (0usize, 0usize);
    let cell = |x: usize, y: usize, stat: &mut f64, dof: &mut usize| {
        let e = (x + y) as f64 / 2.0;
        *stat += ((x as f64 - e).powi(2) + (y as f64 - e).powi(2)) / e;
        *dof += 1;
    };
    for k in keys {
        let (x, y) = (
            a.get(&k).copied().unwrap_or(0),
            b.get(&k).copied().unwrap_or(0),
        );
        if x + y >= 20 {
            cell(x, y, &mut stat, &mut dof);
        } else {
            ra += x;
            rb += y;
        }
    }
    if ra + rb > 0 {
        cell(ra, rb, &mut stat, &mut dof);
    }
    (stat, dof.saturating_sub(1).max(1))
}

#[test]
fn bad_speculative_settings_are_refused() -> Result<()> {
    for n in [0usize, 65] {
        let cfg = EngineConfig {
            speculative: Some(speculative(n, true)),
            ..Default::default()
        };
        let err = engine(cfg, 64, &Spec::Ngram).err().context("refused")?;
        // The setting is named; the binary adds its flag.
        assert!(
            err.to_string()
                .contains("num_draft_tokens must be between 1 and 64"),
            "{err}"
        );
    }
    // Configured without a speculator.
    // Model drafters: too many layers, no or a foreign draft model.
    for (spec, flag) in [
        (Spec::LayerSkip(3), "draft_layers must be between 1 and 2"),
        (Spec::LayerSkip(0), "draft_layers must be between 1 and 2"),
        (Spec::Standalone(draft_model("tiny-qwen2")?), "vocabulary"),
    ] {
        let err = engine(EngineConfig::default(), 64, &spec)
            .err()
            .context("refused")?;
        assert!(err.to_string().contains(flag), "{err}");
    }
    let s = shared();
    let runner = Arc::new(ModelRunner::new(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        16,
        64,
        DType::F32,
    )?);
    let standalone = s.registry.speculators.get("standalone")?;
    let inputs = SpeculatorInputs {
        target: runner.clone(),
        target_group: None,
        draft_model: None,
        draft_path: None,
    };
    let err = standalone(&speculative(4, true), &inputs)
        .err()
        .context("refused")?;
    // The setting is named; the binary adds its flag.
    assert!(
        matches!(
            &err,
            arbor_engine_core::CoreError::InvalidSetting {
                key: "draft_model_path",
                ..
            }
        ),
        "{err}"
    );
    let cache = s.registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: 16,
        policy: s.registry.eviction_policies.get("lru")?()?,
    })?;
    let parts = EngineParts::local(
        runner,
        cache,
        s.registry.samplers.get("standard")?()?,
        vec![],
        s.model.tokenizer.clone(),
        vec![],
    );
    let cfg = EngineConfig {
        speculative: Some(speculative(4, true)),
        ..Default::default()
    };
    let err = Engine::new(cfg, parts).err().context("refused")?;
    assert!(err.to_string().contains("no speculator"), "{err}");
    assert!(s.registry.speculators.get("medusa").is_err());
    Ok(())
}

#[path = "support/verify.rs"]
mod verify;

#[path = "support/edits.rs"]
mod edits;

/// Penalties, logit bias, `min_new_tokens` and grammar masks as logit
/// edits on the CPU backend: no row takes the host path, and every token
/// (greedy, seeded draws, verified drafts) is the host path's.
#[test]
fn logit_edits_match_the_host_path_on_the_cpu() -> Result<()> {
    edits::edited_sampling_matches_host(shared().backend.clone(), &fixture(), true)
}

#[test]
fn chain_verification_is_exact_on_the_cpu() -> Result<()> {
    verify::chain_verify_matches_decode(shared().backend.clone(), &fixture())
}

/// Draft-tree verification through a non-first branch on the CPU backend.
#[test]
fn tree_verification_is_exact_on_the_cpu() -> Result<()> {
    verify::tree_verify_matches_decode(shared().backend.clone(), &fixture())
}

/// HiCache's page copies between device and host on the CPU backend.
#[test]
fn tier_copies_are_exact_on_the_cpu() -> Result<()> {
    verify::tier_copies_move_kv_exactly(shared().backend.clone(), &fixture())
}

/// HiCache's load-back in the step that computes on it, on the CPU backend.
#[test]
fn load_back_is_exact_on_the_cpu() -> Result<()> {
    let run =
        verify::load_back_is_exact_in_the_step_that_loads(shared().backend.clone(), &fixture())?;
    // The CPU's host memory is the heap: nothing to pin.
    assert_eq!(run.memory, "heap");
    Ok(())
}

/// A step mixing plain greedy rows, rows with logprobs and rows with a
/// penalty (logprob statistics and logit edits, all where the logits are)
/// gives every request what it gets alone; with and without drafts. (Rows
/// on the host next to rows on the device: `logit_edits_match_the_host_path_on_the_cpu`.)
#[test]
fn mixed_device_and_host_rows_agree() -> Result<()> {
    let ps = prompts(12, 23);
    let req = |i: usize, p: &Vec<u32>| {
        let mut r = GenerateRequest::new(p.clone(), greedy(16));
        match i % 3 {
            1 => {
                r.return_logprob = true;
                r.top_logprobs_num = 2;
            }
            2 => r.params.frequency_penalty = 0.5,
            _ => {}
        }
        r
    };
    let off = engine(EngineConfig::default(), 256, &Spec::Off)?;
    let mut want = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        want.extend(run_all(&off, vec![req(i, p)])?);
    }
    assert_pool_empty(&off);
    let plain_outs: Vec<Vec<u32>> = ps.iter().zip(&want).map(|(_, w)| w.clone()).collect();
    for spec in [Spec::Off, Spec::Oracle(answers(&ps, &plain_outs))] {
        let e = engine(EngineConfig::default(), 256, &spec)?;
        let got = run_all(&e, ps.iter().enumerate().map(|(i, p)| req(i, p)).collect())?;
        assert_eq!(got, want, "mixed batch");
        assert_pool_empty(&e);
    }
    Ok(())
}
