//! Constrained decoding through the engine on the tiny Llama fixture with the
//! llguidance backend: output always matches the grammar, invalid grammars are
//! refused, and jump-forward emits the same tokens in fewer forward passes.

#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::grammar::{
    CompiledGrammar, GrammarBackendConfig, GrammarCache, GrammarCacheConfig, GrammarError,
    GrammarMatcher, GrammarOptions, GrammarResult, GrammarSpec, GrammarVocab, JsonWhitespace,
    TokenBitmask, VocabSource,
};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, DType, LoadOptions, PrefixCacheOptions, Registry, SamplingParams,
};
use arbor_grammar as _;
use arbor_kv_radix as _;
use std::path::PathBuf;
use std::sync::Arc;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

struct Setup {
    engine: Engine,
    cache: GrammarCache,
    tokenizer: Arc<arbor_models::TextTokenizer>,
}

fn setup(jump_forward: bool) -> Result<Setup> {
    setup_with(jump_forward, None)
}

fn setup_with(jump_forward: bool, overlap_schedule: Option<bool>) -> Result<Setup> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let m = arbor_models::load_model(&fixture(), &registry, &opts)?;
    let vocab = GrammarVocab {
        source: VocabSource::TokenizerJson(
            std::fs::read_to_string(fixture().join("tokenizer.json"))?.into(),
        ),
        eos_token_ids: m.tokenizer.eos_token_ids.clone(),
        vocab_size: Some(m.model.spec().vocab_size),
    };
    let gb = registry.grammar_backends.get("llguidance")?(&GrammarBackendConfig {
        vocab,
        // Compact JSON (as SGLang's --constrained-json-disable-any-whitespace): a tiny
        // random model would otherwise spend its budget on whitespace.
        options: GrammarOptions {
            json_whitespace: JsonWhitespace::Compact,
            ..Default::default()
        },
    })?;
    let cache = GrammarCache::new(gb, GrammarCacheConfig::default());
    let runner = ModelRunner::new(m.model.clone(), backend, None, 16, 64, DType::F32)?;
    let policy = registry.eviction_policies.get("lru")?()?;
    let pc = registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: 16,
        policy,
    })?;
    let engine = Engine::new(
        EngineConfig {
            enable_jump_forward: jump_forward,
            overlap_schedule,
            ..Default::default()
        },
        EngineParts::local(
            runner,
            pc,
            registry.samplers.get("standard")?()?,
            vec![],
            m.tokenizer.clone(),
            m.tokenizer.eos_token_ids.clone(),
        ),
    )?;
    Ok(Setup {
        engine,
        cache,
        tokenizer: m.tokenizer.clone(),
    })
}

fn run(
    s: &Setup,
    spec: &GrammarSpec,
    prompt: &[u32],
    params: SamplingParams,
) -> Result<(String, Vec<u32>, FinishKind)> {
    let grammar = s.cache.get(spec)?;
    let req = GenerateRequest {
        grammar: Some(grammar),
        ..GenerateRequest::new(prompt.to_vec(), params)
    };
    let chunks = s.engine.submit(req)?.collect_blocking();
    let f = chunks
        .last()
        .and_then(|c| c.finish.clone())
        .context("finish")?;
    assert_ne!(f.kind, FinishKind::Abort, "{f:?}");
    Ok((
        chunks.iter().map(|c| c.text.as_str()).collect(),
        chunks.iter().flat_map(|c| c.token_ids.clone()).collect(),
        f.kind,
    ))
}

const RECORD: &str = r#"\{"name": "[a-z]{1,6}", "age": [1-9][0-9]?\}"#;

#[test]
fn outputs_follow_the_grammar_and_jump_forward_saves_forwards() -> Result<()> {
    let re = regex_lite(RECORD);
    let on = setup(true)?;
    let off = setup(false)?;
    let prompts: Vec<Vec<u32>> = vec![vec![10, 20, 30], vec![5, 99, 7, 44, 2], vec![300, 1]];
    let mut forwards = [0u64; 2];
    for p in &prompts {
        for (i, s) in [&off, &on].iter().enumerate() {
            let before = s.engine.stats().iterations;
            let (text, _, kind) = run(
                s,
                &GrammarSpec::Regex(RECORD.into()),
                p,
                SamplingParams::greedy(48),
            )?;
            forwards[i] += s.engine.stats().iterations - before;
            assert_eq!(kind, FinishKind::Stop, "{text}");
            assert!(re(&text), "{text:?} does not match {RECORD}");
        }
        let a = run(
            &off,
            &GrammarSpec::Regex(RECORD.into()),
            p,
            SamplingParams::greedy(48),
        )?;
        let b = run(
            &on,
            &GrammarSpec::Regex(RECORD.into()),
            p,
            SamplingParams::greedy(48),
        )?;
        assert_eq!(a.1, b.1, "jump-forward changed the tokens");
    }
    let jf = on.engine.stats().jump_forward_tokens_total;
    println!(
        "forward passes: {} without jump-forward, {} with ({jf} tokens jumped)",
        forwards[0], forwards[1]
    );
    assert!(jf > 0 && forwards[1] < forwards[0], "{forwards:?} {jf}");

    // Sampling at temperature 1 still only produces valid records.
    for seed in 0..6 {
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(seed),
            max_new_tokens: 48,
            ..Default::default()
        };
        let (text, _, _) = run(&on, &GrammarSpec::Regex(RECORD.into()), &prompts[0], params)?;
        assert!(re(&text), "{text:?}");
    }
    // A JSON schema: the output parses and has the required fields.
    let schema = r#"{"type":"object","properties":{"ok":{"type":"boolean"},"n":{"type":"integer","minimum":0,"maximum":9}},"required":["ok","n"],"additionalProperties":false}"#;
    let (text, _, _) = run(
        &on,
        &GrammarSpec::JsonSchema(schema.into()),
        &prompts[1],
        SamplingParams::greedy(40),
    )?;
    let v: serde_json::Value = serde_json::from_str(&text).with_context(|| text.clone())?;
    assert!(
        v["ok"].is_boolean() && v["n"].as_u64().is_some_and(|n| n <= 9),
        "{v}"
    );
    assert!(on.engine.flush_cache()?);
    assert_eq!(on.engine.stats().num_used_tokens, 0);
    let _ = &on.tokenizer;
    Ok(())
}

/// Masks filled on a second thread during the forward (overlap) give the
/// same tokens as masks filled after it, for a batch of constrained and free
/// requests decoding together, greedy and sampled; the pool ends empty.
#[test]
fn masks_overlapped_with_the_forward_change_nothing() -> Result<()> {
    let serial = setup_with(true, Some(false))?;
    let overlap = setup_with(true, Some(true))?;
    let schema = r#"{"type":"object","properties":{"id":{"type":"integer"},"tag":{"type":"string","maxLength":5}},"required":["id","tag"]}"#;
    let batch = |s: &Setup| -> Result<Vec<Vec<u32>>> {
        let mut streams = Vec::new();
        for (i, p) in [
            vec![10u32, 20, 30],
            vec![5, 99, 7, 44],
            vec![300, 1],
            vec![8, 8, 8, 8, 8],
        ]
        .into_iter()
        .enumerate()
        {
            let params = SamplingParams {
                temperature: if i % 2 == 0 { 0.0 } else { 1.0 },
                seed: Some(i as u64),
                max_new_tokens: 32,
                ..Default::default()
            };
            let grammar = match i {
                0 => Some(s.cache.get(&GrammarSpec::Regex(RECORD.into()))?),
                1 | 2 => Some(s.cache.get(&GrammarSpec::JsonSchema(schema.into()))?),
                _ => None,
            };
            streams.push(s.engine.submit(GenerateRequest {
                grammar,
                ..GenerateRequest::new(p, params)
            })?);
        }
        Ok(streams
            .into_iter()
            .map(|st| {
                st.collect_blocking()
                    .iter()
                    .flat_map(|c| c.token_ids.clone())
                    .collect()
            })
            .collect())
    };
    let a = batch(&serial)?;
    let b = batch(&overlap)?;
    assert!(a.iter().all(|t| !t.is_empty()), "{a:?}");
    assert_eq!(a, b, "overlapped masks changed the output");
    for s in [&serial, &overlap] {
        assert!(s.engine.flush_cache()?);
        assert_eq!(s.engine.stats().num_used_tokens, 0);
    }
    Ok(())
}

#[test]
fn invalid_grammars_are_refused_before_submission() -> Result<()> {
    let s = setup(true)?;
    let e = s
        .cache
        .get(&GrammarSpec::JsonSchema("{\"type\": \"obj".into()))
        .err()
        .context("refused")?;
    assert!(e.is_client_error(), "{e}");
    let e = s
        .cache
        .get(&GrammarSpec::Regex("(unclosed".into()))
        .err()
        .context("refused")?;
    assert!(e.is_client_error(), "{e}");
    Ok(())
}

/// A tiny full-match checker for the one regex shape used here.
fn regex_lite(_pattern: &str) -> impl Fn(&str) -> bool {
    |t: &str| {
        let Some(rest) = t.strip_prefix("{\"name\": \"") else {
            return false;
        };
        let Some((name, rest)) = rest.split_once("\", \"age\": ") else {
            return false;
        };
        let Some(age) = rest.strip_suffix('}') else {
            return false;
        };
        (1..=6).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_lowercase())
            && (1..=2).contains(&age.len())
            && age.bytes().all(|b| b.is_ascii_digit())
            && !age.starts_with('0')
    }
}

/// A grammar backend that fails on purpose: its matcher allows every token
/// for `ok_steps` masks, then panics in `fill_mask` (or, with `error`,
/// returns an error from `accept`).
struct Faulty {
    ok_steps: usize,
    error: bool,
}

struct FaultyMatcher {
    left: usize,
    error: bool,
}

impl CompiledGrammar for Faulty {
    fn matcher(&self) -> GrammarResult<Box<dyn GrammarMatcher>> {
        Ok(Box::new(FaultyMatcher {
            left: self.ok_steps,
            error: self.error,
        }))
    }
}

impl GrammarMatcher for FaultyMatcher {
    fn fill_mask(&mut self, mask: &mut TokenBitmask) -> GrammarResult<()> {
        if self.left == 0 && !self.error {
            panic!("faulty matcher: fill_mask");
        }
        mask.allow_all();
        Ok(())
    }
    fn accept(&mut self, _token: u32) -> GrammarResult<()> {
        if self.left == 0 {
            return Err(GrammarError::Matcher("faulty matcher: accept".into()));
        }
        self.left -= 1;
        Ok(())
    }
    fn validate_tokens(&mut self, tokens: &[u32]) -> GrammarResult<usize> {
        Ok(tokens.len().min(self.left))
    }
    fn rollback(&mut self, n: usize) -> GrammarResult<()> {
        self.left += n;
        Ok(())
    }
    fn forced_tokens(&mut self) -> GrammarResult<Vec<u32>> {
        Ok(Vec::new())
    }
    fn forced_bytes(&mut self) -> GrammarResult<Vec<u8>> {
        Ok(Vec::new())
    }
    fn can_end(&mut self) -> GrammarResult<bool> {
        Ok(false)
    }
    fn is_terminated(&self) -> bool {
        false
    }
    fn error(&self) -> Option<String> {
        None
    }
}

/// A matcher that panics or errors mid-generation fails only its own
/// request (abort with a message); the requests decoding beside it, one
/// constrained and one free, give the same tokens as alone, with mask
/// overlap on and off, and the pool ends empty.
#[test]
fn a_failing_matcher_fails_only_its_request() -> Result<()> {
    for overlap in [false, true] {
        let s = setup_with(true, Some(overlap))?;
        let good = |p: &[u32]| GenerateRequest {
            grammar: Some(s.cache.get(&GrammarSpec::Regex(RECORD.into())).unwrap()),
            ..GenerateRequest::new(p.to_vec(), SamplingParams::greedy(32))
        };
        let free = |p: &[u32]| {
            GenerateRequest::new(
                p.to_vec(),
                SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(16)
                },
            )
        };
        let tokens = |st: arbor_engine_core::engine::RequestStream| {
            let chunks = st.collect_blocking();
            let f = chunks.last().and_then(|c| c.finish.clone()).unwrap();
            (
                chunks
                    .iter()
                    .flat_map(|c| c.token_ids.clone())
                    .collect::<Vec<u32>>(),
                f,
            )
        };
        let alone_good = tokens(s.engine.submit(good(&[10, 20, 30]))?).0;
        let alone_free = tokens(s.engine.submit(free(&[7, 8, 9, 10]))?).0;
        for error in [false, true] {
            let bad = GenerateRequest {
                grammar: Some(Arc::new(Faulty { ok_steps: 3, error }) as Arc<dyn CompiledGrammar>),
                ..GenerateRequest::new(vec![5, 6, 7], SamplingParams::greedy(32))
            };
            let b = s.engine.submit(bad)?;
            let g = s.engine.submit(good(&[10, 20, 30]))?;
            let f = s.engine.submit(free(&[7, 8, 9, 10]))?;
            let (bt, bf) = tokens(b);
            assert_eq!(
                bf.kind,
                FinishKind::Abort,
                "overlap {overlap}, error {error}"
            );
            let msg = bf.message.unwrap_or_default();
            let expect = if error {
                "faulty matcher: accept"
            } else {
                "panicked"
            };
            assert!(msg.contains(expect), "{msg}");
            assert!(bt.len() <= 4, "{bt:?}");
            assert_eq!(
                tokens(g).0,
                alone_good,
                "overlap {overlap}: constrained neighbour"
            );
            assert_eq!(tokens(f).0, alone_free, "overlap {overlap}: free neighbour");
        }
        assert!(s.engine.flush_cache()?);
        for _ in 0..100 {
            if s.engine.stats().num_used_tokens == 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(s.engine.stats().num_used_tokens, 0);
    }
    Ok(())
}
