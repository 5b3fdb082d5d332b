//! Lossless serving on the default model (SmolLM2-135M-Instruct Q4_1, a
//! real trained model): greedy tokens must not depend on how the step is
//! shaped. 16 concurrent requests against the same requests alone, a cached
//! prompt against the same prompt cold, and n-gram speculation on
//! copy-heavy chat prompts against plain decoding must all give identical
//! tokens. This holds only because the CPU kernels are batch-invariant (a
//! position's logits are bit-identical whatever else shares the step).
//! Skips with a message when the model is absent (`arbor fetch-default`).

#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{
    Backend, DType, LoadOptions, PrefixCacheOptions, Registry, SamplingParams,
};
use arbor_kv_radix as _;
use arbor_models::{LoadedModel, load_model};
use arbor_spec_decode as _;

#[path = "support/chat.rs"]
mod chat;
#[path = "support/tiny.rs"]
mod tiny;
use chat::copy_prompts;
use std::sync::{Arc, OnceLock};
use tiny::assert_pool_empty;

struct Shared {
    model: LoadedModel,
    backend: Arc<dyn Backend>,
    registry: Registry,
}

fn shared() -> Option<&'static Shared> {
    static S: OnceLock<Option<Shared>> = OnceLock::new();
    S.get_or_init(|| {
        let path = arbor_gguf::default_model_path().filter(|p| p.exists())?;
        let registry = Registry::builtin().expect("registry");
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2).expect("cpu"));
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: registry.quant_methods.get("auto").expect("auto")(&Default::default())
                .expect("quant"),
            progress: None,
        };
        let model = load_model(&path, &registry, &opts).expect("the default model loads");
        Some(Shared {
            model,
            backend,
            registry,
        })
    })
    .as_ref()
}

fn engine(s: &Shared, cfg: EngineConfig) -> Result<Engine> {
    engine_with_draft(s, cfg, None)
}

/// An engine whose speculator (when configured) may draft with `draft`.
fn engine_with_draft(
    s: &Shared,
    cfg: EngineConfig,
    draft: Option<std::sync::Arc<dyn arbor_engine_core::Model>>,
) -> Result<Engine> {
    let runner = std::sync::Arc::new(ModelRunner::new(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        16,
        512,
        DType::F32,
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
        s.model.tokenizer.eos_token_ids.clone(),
    );
    if let Some(sc) = &cfg.speculative {
        let inputs = arbor_engine_core::SpeculatorInputs {
            target: runner,
            target_group: None,
            draft_model: draft,
            draft_path: None,
        };
        parts.speculator = Some(s.registry.speculators.get(&sc.algorithm)?(sc, &inputs)?);
    }
    Ok(Engine::new(cfg, parts)?)
}

fn run(e: &Engine, prompts: &[Vec<u32>], max_new: usize) -> Result<Vec<Vec<u32>>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.submit(GenerateRequest::new(
                p.clone(),
                SamplingParams::greedy(max_new),
            ))
        })
        .collect::<Result<_, _>>()?;
    streams
        .into_iter()
        .map(|st| {
            let chunks = st.collect_blocking();
            let f = chunks
                .last()
                .and_then(|c| c.finish.clone())
                .context("finish")?;
            anyhow::ensure!(f.kind != FinishKind::Abort, "{f:?}");
            Ok(chunks.iter().flat_map(|c| c.token_ids.clone()).collect())
        })
        .collect()
}

const QUESTIONS: [&str; 16] = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "What does a compiler do?",
    "Give me a synonym for happy.",
    "Why is the sky blue?",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
    "What language is spoken in Brazil?",
    "Explain photosynthesis briefly.",
    "What is the boiling point of water?",
    "Suggest a name for a goldfish.",
    "What is a prime number?",
    "Who wrote Romeo and Juliet?",
    "List two uses of copper.",
];

#[test]
fn batch_of_16_equals_alone_and_cached_equals_cold() -> Result<()> {
    let Some(s) = shared() else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let prompts: Vec<Vec<u32>> = QUESTIONS
        .iter()
        .map(|q| chat::chat(&s.model, q))
        .collect::<Result<_, _>>()?;
    let e = engine(s, EngineConfig::default())?;
    let mut alone = Vec::new();
    for p in &prompts {
        alone.extend(run(&e, std::slice::from_ref(p), 32)?);
        // Cold every time: nothing cached between the requests.
        assert_pool_empty(&e);
    }
    let batched = run(&e, &prompts, 32)?;
    let differ: Vec<usize> = (0..16).filter(|&i| batched[i] != alone[i]).collect();
    assert!(
        differ.is_empty(),
        "batch of 16 differs from alone in {differ:?}"
    );
    // Every prompt's system prefix (and whole prompt) is cached now.
    let cached = run(&e, &prompts, 32)?;
    assert!(e.stats().cached_tokens_total > 0);
    let differ: Vec<usize> = (0..16).filter(|&i| cached[i] != alone[i]).collect();
    assert!(differ.is_empty(), "cached differs from cold in {differ:?}");
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn ngram_speculation_on_copy_heavy_prompts_is_lossless() -> Result<()> {
    let Some(s) = shared() else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let prompts: Vec<Vec<u32>> = copy_prompts()
        .iter()
        .map(|q| chat::chat(&s.model, q))
        .collect::<Result<_, _>>()?;
    let plain = engine(s, EngineConfig::default())?;
    let mut want = Vec::new();
    for p in &prompts {
        want.extend(run(&plain, std::slice::from_ref(p), 96)?);
        assert_pool_empty(&plain);
    }
    for adaptive in [false, true] {
        let cfg = EngineConfig {
            speculative: Some(SpeculativeConfig {
                adaptive,
                ..SpeculativeConfig::default()
            }),
            ..Default::default()
        };
        let e = engine(s, cfg)?;
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(
                &run(&e, std::slice::from_ref(p), 96)?[0],
                w,
                "alone, adaptive {adaptive}"
            );
        }
        assert_eq!(run(&e, &prompts, 96)?, want, "batched, adaptive {adaptive}");
        let st = e.stats();
        eprintln!(
            "adaptive {adaptive}: {} of {} drafts accepted over {} verify steps",
            st.spec_accepted_tokens_total, st.spec_draft_tokens_total, st.spec_verify_ct_total
        );
        assert!(st.spec_accepted_tokens_total > 0);
        assert_pool_empty(&e);
    }
    Ok(())
}

#[test]
fn layer_skip_and_standalone_on_copy_heavy_prompts_are_lossless() -> Result<()> {
    let Some(s) = shared() else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return Ok(());
    };
    let prompts: Vec<Vec<u32>> = copy_prompts()
        .iter()
        .map(|q| chat::chat(&s.model, q))
        .collect::<Result<_, _>>()?;
    let plain = engine(s, EngineConfig::default())?;
    let want = run(&plain, &prompts, 64)?;
    assert_pool_empty(&plain);
    // The default model as its own STANDALONE draft: with batch-invariant
    // kernels its drafts are the target's own greedy tokens, so every one is
    // accepted; a draft computed from stale KV or a shape-dependent logit
    // would be rejected.
    for (algorithm, layers, draft) in [
        ("layerskip", Some(8), None),
        ("standalone", None, Some(s.model.model.clone())),
    ] {
        let self_draft = draft.is_some();
        let cfg = EngineConfig {
            speculative: Some(SpeculativeConfig {
                algorithm: algorithm.into(),
                adaptive: false,
                draft_layers: layers,
                ..SpeculativeConfig::default()
            }),
            ..Default::default()
        };
        let e = engine_with_draft(s, cfg, draft)?;
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(
                &run(&e, std::slice::from_ref(p), 64)?[0],
                w,
                "{algorithm} alone"
            );
        }
        assert_eq!(
            run(&e, &prompts, 64)?,
            want,
            "{algorithm} batched and cached"
        );
        let st = e.stats();
        eprintln!(
            "{algorithm}: {} of {} drafts accepted over {} verify steps",
            st.spec_accepted_tokens_total, st.spec_draft_tokens_total, st.spec_verify_ct_total
        );
        assert!(st.spec_draft_tokens_total > 0);
        if self_draft {
            assert_eq!(st.spec_accepted_tokens_total, st.spec_draft_tokens_total);
        }
        assert_pool_empty(&e);
    }
    Ok(())
}
