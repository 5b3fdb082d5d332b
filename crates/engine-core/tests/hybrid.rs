//! Serving a hybrid model (Qwen3.5: Gated DeltaNet recurrent layers with
//! gated attention) through the engine: continuous batching, chunked
//! prefill of several sizes, mixed chunks, more requests than state slots
//! and retraction under a small KV pool all give the greedy tokens
//! transformers gives (tests/fixtures/tiny-qwen3.5/reference.json); a
//! repeated prompt and a second turn reuse their cached prefix up to the
//! deepest recurrent state snapshot (`cached_tokens`) and give the tokens a
//! cold run gives; without snapshot slots nothing is reused; every page,
//! state slot and snapshot is back in its pool after a flush. NGRAM and
//! NEXTN (the checkpoint's MTP layer) speculation give plain decoding's
//! tokens.

#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::runner::{KvGeometry, ModelRunner};
use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{
    Backend, DType, LoadOptions, PrefixCacheOptions, Registry, SamplingParams,
};
use arbor_kv_radix as _;
use arbor_models::{LoadedModel, load_model};
use arbor_spec_decode as _;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

#[path = "support/tiny.rs"]
mod tiny;
use tiny::assert_pool_empty;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-qwen3.5")
}

struct Setup {
    model: LoadedModel,
    backend: Arc<dyn Backend>,
    registry: Registry,
    /// (prompt, transformers' 32 greedy tokens).
    cases: Vec<(Vec<u32>, Vec<u32>)>,
}

fn setup() -> Result<Setup> {
    setup_of(&fixture())
}

/// The fixture in `dir`, loaded f32 on 2 CPU threads, with its reference.
fn setup_of(dir: &std::path::Path) -> Result<Setup> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let model = load_model(dir, &registry, &opts)?;
    let r: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
    let ids = |v: &Value| -> Vec<u32> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_u64)
                    .map(|x| x as u32)
                    .collect()
            })
            .unwrap_or_default()
    };
    let cases = r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| (ids(&p["input_ids"]), ids(&p["greedy_ids"])))
        .collect();
    Ok(Setup {
        model,
        backend,
        registry,
        cases,
    })
}

fn engine(s: &Setup, cfg: EngineConfig, num_pages: usize, slots: usize) -> Result<Engine> {
    engine_with_draft(s, cfg, num_pages, slots, None)
}

/// [`engine`] whose speculator reads `draft_path` (NEXTN: the checkpoint
/// with the MTP layer).
fn engine_with_draft(
    s: &Setup,
    cfg: EngineConfig,
    num_pages: usize,
    slots: usize,
    draft_path: Option<PathBuf>,
) -> Result<Engine> {
    let runner = Arc::new(ModelRunner::with_state_slots(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        KvGeometry {
            page_size: 16,
            num_pages,
            kv_dtype: DType::F32,
            state_slots: slots,
        },
    )?);
    let cache = s.registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: 16,
        policy: s.registry.eviction_policies.get("lru")?()?,
    })?;
    let mut parts = EngineParts::local(
        runner.clone(),
        cache,
        s.registry.samplers.get("standard")?()?,
        vec![],
        s.model.tokenizer.clone(),
        vec![],
    );
    if let Some(sc) = &cfg.speculative {
        let inputs = arbor_engine_core::SpeculatorInputs {
            target: runner,
            target_group: None,
            draft_model: None,
            draft_path,
        };
        parts.speculator = Some(s.registry.speculators.get(&sc.algorithm)?(sc, &inputs)?);
    }
    Ok(Engine::new(cfg, parts)?)
}

/// Greedy tokens and cached-token counts of `prompts`, all submitted at once.
fn run(e: &Engine, prompts: &[Vec<u32>]) -> Result<Vec<(Vec<u32>, usize)>> {
    run_n(e, prompts, 32)
}

fn run_n(e: &Engine, prompts: &[Vec<u32>], max_new: usize) -> Result<Vec<(Vec<u32>, usize)>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            let params = SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(max_new)
            };
            e.submit(GenerateRequest::new(p.clone(), params))
        })
        .collect::<Result<_, _>>()?;
    streams
        .into_iter()
        .map(|st| {
            let chunks = st.collect_blocking();
            let last = chunks.last().context("no output")?;
            let f = last.finish.clone().context("finish")?;
            anyhow::ensure!(f.kind != FinishKind::Abort, "{f:?}");
            let cached = last.meta.cached_tokens;
            Ok((
                chunks.iter().flat_map(|c| c.token_ids.clone()).collect(),
                cached,
            ))
        })
        .collect()
}

#[test]
fn hybrid_serving_gives_transformers_tokens_however_steps_are_shaped() -> Result<()> {
    let s = setup()?;
    // 16 requests over the reference prompts (4 to 404 tokens), 8 slots.
    let batch: Vec<usize> = (0..16).map(|i| (i * 3) % s.cases.len()).collect();
    let prompts: Vec<Vec<u32>> = batch.iter().map(|&i| s.cases[i].0.clone()).collect();
    // 8 running requests; 40 more slots for snapshots of cached prefixes,
    // or none (prefix reuse off).
    // The last case admits the next batch while the forward runs (overlap
    // scheduling, as on asynchronous devices).
    for (chunk, mixed, slots, overlap) in [
        (-1, false, 48, false),
        (16, false, 48, false),
        (64, true, 8, false),
        (100, true, 48, false),
        (32, false, 48, true),
    ] {
        let cfg = EngineConfig {
            chunked_prefill_size: chunk,
            enable_mixed_chunk: mixed,
            max_running_requests: 8,
            overlap_schedule: Some(overlap),
            ..EngineConfig::default()
        };
        let e = engine(&s, cfg, 1024, slots)?;
        let case = format!("chunk {chunk}, mixed {mixed}, {slots} slots, overlap {overlap}");
        for (i, (tokens, _)) in run(&e, &prompts)?.into_iter().enumerate() {
            let want = &s.cases[batch[i]].1;
            assert_eq!(&tokens, want, "{case}: request {i}");
        }
        // The same prompts again: each reuses its prompt up to the last page
        // boundary before its last token (restored from a snapshot), and
        // gives the same tokens.
        let again = run(&e, &prompts[..4])?;
        for (i, (tokens, cached)) in again.into_iter().enumerate() {
            let (prompt, want) = &s.cases[batch[i]];
            assert_eq!(&tokens, want, "{case}: repeat {i}");
            let expected = if slots > 8 {
                (prompt.len() - 1) / 16 * 16
            } else {
                0
            };
            assert_eq!(
                cached,
                expected,
                "{case}: cached tokens of a {}-token prompt",
                prompt.len()
            );
        }
        // A second turn: the first turn's prompt and answer and more tokens
        // reuse the state snapshot taken while the answer was decoded.
        let (prompt, answer) = &s.cases[2];
        let mut turn = prompt.clone();
        turn.extend_from_slice(answer);
        turn.extend_from_slice(&s.cases[1].0);
        let cold = {
            let fresh = engine(&s, EngineConfig::default(), 1024, 8)?;
            run(&fresh, std::slice::from_ref(&turn))?.remove(0).0
        };
        let (warm, cached) = run(&e, std::slice::from_ref(&turn))?.remove(0);
        assert_eq!(warm, cold, "{case}: second turn warm vs cold");
        if slots > 8 {
            // The answer's last page boundary: prompt 61 + 32 tokens, 92 computed.
            assert_eq!(cached, 80, "{case}: second turn cached tokens");
        }
        assert_pool_empty(&e);
        let stats = e.stats();
        if overlap {
            assert!(
                stats.overlap_admitted_total > 0,
                "{case}: nothing admitted beside a forward"
            );
        }
        assert_eq!(stats.max_state_slots, 8);
        assert_eq!(stats.state_snapshots, 0, "flushed with the cache");
    }
    Ok(())
}

#[test]
fn retraction_under_a_small_pool_restarts_the_state() -> Result<()> {
    let s = setup()?;
    // 24 pages of 16 tokens: eight ~60-token requests decoding 32 tokens
    // each do not fit at once, so some are retracted and recomputed.
    let prompts: Vec<Vec<u32>> = (0..8).map(|_| s.cases[2].0.clone()).collect();
    // Admission that reserves almost nothing for the tokens to come.
    let cfg = EngineConfig {
        max_running_requests: 8,
        schedule_conservativeness: 0.01,
        ..EngineConfig::default()
    };
    let e = engine(&s, cfg, 24, 16)?;
    for (i, (tokens, _)) in run(&e, &prompts)?.into_iter().enumerate() {
        assert_eq!(tokens, s.cases[2].1, "request {i}");
    }
    let stats = e.stats();
    assert!(
        stats.num_retracted_reqs_total > 0,
        "the pool was meant to force retraction: {stats:?}"
    );
    assert_pool_empty(&e);
    Ok(())
}

/// NGRAM speculation on a hybrid model: the state at each draft token is
/// kept in a slot and the accepted one restored, so rejected drafts leave
/// no trace: tokens equal plain decoding's, alone and batched, with drafts
/// accepted; pages, slots and snapshots end empty.
#[test]
fn ngram_speculation_is_lossless_on_hybrids() -> Result<()> {
    let s = setup()?;
    // Prompts that repeat themselves, so n-gram drafts get accepted.
    let prompts: Vec<Vec<u32>> = s
        .cases
        .iter()
        .take(3)
        .map(|(p, g)| {
            let mut v = p.clone();
            v.extend_from_slice(g);
            v.extend_from_slice(p);
            v
        })
        .collect();
    let plain = engine(&s, EngineConfig::default(), 1024, 8)?;
    let want: Vec<Vec<u32>> = run_n(&plain, &prompts, 64)?
        .into_iter()
        .map(|x| x.0)
        .collect();
    for adaptive in [false, true] {
        let cfg = EngineConfig {
            speculative: Some(SpeculativeConfig {
                adaptive,
                ..SpeculativeConfig::default()
            }),
            max_running_requests: 4,
            ..EngineConfig::default()
        };
        let e = engine(&s, cfg, 1024, 40)?;
        for (p, w) in prompts.iter().zip(&want) {
            let got = run_n(&e, std::slice::from_ref(p), 64)?.remove(0).0;
            assert_eq!(&got, w, "alone, adaptive {adaptive}");
        }
        let batched: Vec<Vec<u32>> = run_n(&e, &prompts, 64)?.into_iter().map(|x| x.0).collect();
        assert_eq!(batched, want, "batched, adaptive {adaptive}");
        let st = e.stats();
        eprintln!(
            "adaptive {adaptive}: {} of {} drafts accepted over {} verify steps",
            st.spec_accepted_tokens_total, st.spec_draft_tokens_total, st.spec_verify_ct_total
        );
        assert!(
            st.spec_accepted_tokens_total > 0,
            "no draft accepted: {st:?}"
        );
        assert!(
            st.spec_accepted_tokens_total < st.spec_draft_tokens_total,
            "no draft rejected: the rollback was not exercised"
        );
        assert_pool_empty(&e);
    }
    Ok(())
}

/// NEXTN on a hybrid model (the MTP layer of tests/fixtures/tiny-qwen3.5-mtp,
/// which has tiny-qwen3.5's weights, and of tiny-qwen3-next-mtp, a MoE one):
/// drafts from the layer over the target's captured final states, verified
/// with a state slot per draft token, give plain decoding's tokens alone and
/// batched, with cached prefixes and chunked prefill; pages, slots and
/// snapshots end empty.
#[test]
fn nextn_speculation_is_lossless_on_hybrids() -> Result<()> {
    for name in ["tiny-qwen3.5", "tiny-qwen3-next"] {
        let dir = fixture().with_file_name(name);
        nextn_is_lossless(&setup_of(&dir)?, dir.with_file_name(format!("{name}-mtp")))?;
    }
    Ok(())
}

fn nextn_is_lossless(s: &Setup, mtp: PathBuf) -> Result<()> {
    let prompts: Vec<Vec<u32>> = s.cases.iter().map(|(p, _)| p.clone()).collect();
    let plain = engine(s, EngineConfig::default(), 1024, 8)?;
    let want: Vec<Vec<u32>> = run_n(&plain, &prompts, 48)?
        .into_iter()
        .map(|x| x.0)
        .collect();
    for chunk in [-1, 16] {
        let cfg = EngineConfig {
            speculative: Some(SpeculativeConfig {
                algorithm: "nextn".into(),
                num_steps: 3,
                num_draft_tokens: 4,
                // Draft at every step, however few drafts are accepted.
                adaptive: false,
                ..SpeculativeConfig::default()
            }),
            max_running_requests: 4,
            chunked_prefill_size: chunk,
            ..EngineConfig::default()
        };
        let e = engine_with_draft(s, cfg, 1024, 40, Some(mtp.clone()))?;
        for (p, w) in prompts.iter().zip(&want) {
            let got = run_n(&e, std::slice::from_ref(p), 48)?.remove(0).0;
            assert_eq!(&got, w, "alone, chunk {chunk}");
        }
        // Again at once: the prompts' prefixes now come from snapshots.
        let batched = run_n(&e, &prompts, 48)?;
        let cached: usize = batched.iter().map(|x| x.1).sum();
        let batched: Vec<Vec<u32>> = batched.into_iter().map(|x| x.0).collect();
        assert_eq!(batched, want, "batched, chunk {chunk}");
        assert!(cached > 0, "no prefix reused");
        let st = e.stats();
        eprintln!(
            "chunk {chunk}: {} of {} drafts accepted over {} verify steps; {cached} tokens cached",
            st.spec_accepted_tokens_total, st.spec_draft_tokens_total, st.spec_verify_ct_total
        );
        assert!(st.spec_draft_tokens_total > 0, "nothing drafted: {st:?}");
        assert_pool_empty(&e);
    }
    Ok(())
}
