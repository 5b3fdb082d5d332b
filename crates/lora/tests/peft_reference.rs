//! LoRA adapters against PEFT: the tiny adapters of tests/fixtures/lora
//! (written by tools/reference/make_lora_fixtures.py with peft +
//! transformers) give last-position logits within 1e-4 × max|logit| of
//! `PeftModel` and its 32 greedy tokens; a batch mixing the base model and
//! three adapters (also under `max_loras_per_batch` 2, and through the
//! radix cache) gives each request the tokens it gets alone; the prefix
//! cache never shares KV across adapters; bad adapters are refused with
//! errors naming the problem. Every engine test ends with the KV pool free.

#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, BatchLayout, DType, ForwardBatch, LoadOptions, LoraAdapter, LoraSegment,
    PrefixCacheOptions, Registry,
};
use arbor_kv_radix as _;
use arbor_lora::{LoraError, LoraLimits, LoraRegistry, load_adapter};
use arbor_models::{LoadedModel, load_model};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

#[path = "support/device.rs"]
mod device;
use device::{fixtures, ids};

#[path = "../../engine-core/tests/support/tiny.rs"]
mod tiny;
use tiny::{assert_pool_empty, greedy};

struct Base {
    model: LoadedModel,
    backend: Arc<dyn Backend>,
    registry: Registry,
}

fn base(name: &str) -> Result<Base> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let model = load_model(&fixtures().join(name), &registry, &opts)?;
    Ok(Base {
        model,
        backend,
        registry,
    })
}

fn adapter(b: &Base, name: &str) -> Result<Arc<LoraAdapter>> {
    Ok(Arc::new(load_adapter(
        name,
        &fixtures().join("lora").join(name),
        b.model.model.spec(),
        &*b.backend,
        &LoraLimits::default(),
    )?))
}

fn reference(name: &str) -> Result<Value> {
    let text = std::fs::read_to_string(fixtures().join("lora").join(name).join("reference.json"))?;
    Ok(serde_json::from_str(&text)?)
}

fn engine(b: &Base, page_size: usize, max_loras: usize) -> Result<Engine> {
    let runner = ModelRunner::new(
        b.model.model.clone(),
        b.backend.clone(),
        None,
        page_size,
        1024 / page_size,
        DType::F32,
    )?;
    let policy = b.registry.eviction_policies.get("lru")?()?;
    let cache = b.registry.prefix_caches.get("radix")?(&PrefixCacheOptions { page_size, policy })?;
    let parts = EngineParts::local(
        runner,
        cache,
        b.registry.samplers.get("standard")?()?,
        Vec::new(),
        b.model.tokenizer.clone(),
        b.model.tokenizer.eos_token_ids.clone(),
    );
    let cfg = EngineConfig {
        max_loras_per_batch: max_loras,
        ..EngineConfig::default()
    };
    Ok(Engine::new(cfg, parts)?)
}

fn request(prompt: &[u32], lora: Option<&Arc<LoraAdapter>>, n: usize) -> GenerateRequest {
    GenerateRequest {
        lora: lora.cloned(),
        ..GenerateRequest::new(prompt.to_vec(), greedy(n))
    }
}

/// Last-position logits of `prompt` with `lora` applied to all its rows.
fn last_logits(b: &Base, prompt: &[u32], lora: &Arc<LoraAdapter>) -> Result<Vec<f32>> {
    let runner = ModelRunner::new(
        b.model.model.clone(),
        b.backend.clone(),
        None,
        16,
        8,
        DType::F32,
    )?;
    let mut layout = BatchLayout::new(16);
    let pages: Vec<u32> = (0..prompt.len().div_ceil(16) as u32).collect();
    layout.push_seq(0, prompt.len(), &pages)?;
    let batch = ForwardBatch {
        input_ids: prompt.to_vec(),
        positions: (0..prompt.len() as u32).collect(),
        layout: Arc::new(layout),
        logits_rows: vec![prompt.len() as u32 - 1],
        hidden_layers: Vec::new(),
        lora: vec![LoraSegment {
            adapter: lora.clone(),
            rows: 0..prompt.len(),
        }],
        exit_after: None,
        hidden_at_every_row: false,
    };
    Ok(b.backend.download_f32(&runner.forward(&batch)?.logits)?)
}

#[test]
fn adapters_match_peft() -> Result<()> {
    for (base_name, name) in [
        ("tiny-llama", "tiny-llama-attn"),
        ("tiny-llama", "tiny-llama-all"),
        ("tiny-llama", "tiny-llama-mlp"),
        ("tiny-qwen2", "tiny-qwen2-attn"),
    ] {
        let b = base(base_name)?;
        let a = adapter(&b, name)?;
        let r = reference(name)?;
        let e = engine(&b, 16, 8)?;
        for p in r["prompts"].as_array().context("prompts")? {
            let prompt = ids(&p["input_ids"]);
            let want: Vec<f32> = p["last_logits"]
                .as_array()
                .context("logits")?
                .iter()
                .filter_map(Value::as_f64)
                .map(|x| x as f32)
                .collect();
            let got = last_logits(&b, &prompt, &a)?;
            let max = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let diff = want
                .iter()
                .zip(&got)
                .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
            assert_eq!(got.len(), want.len());
            assert!(
                diff <= 1e-4 * max,
                "{name}: logits differ by {diff} (max {max})"
            );
            let out: Vec<u32> = e
                .submit(request(&prompt, Some(&a), 32))?
                .collect_blocking()
                .iter()
                .flat_map(|c| c.token_ids.clone())
                .collect();
            assert_eq!(out, ids(&p["greedy_ids"]), "{name}: greedy ids");
            assert_ne!(
                out,
                ids(&p["base_greedy_ids"]),
                "{name}: the adapter changes the output"
            );
        }
        assert_pool_empty(&e);
    }
    Ok(())
}

#[test]
fn mixed_batches_give_each_request_its_own_tokens() -> Result<()> {
    let b = base("tiny-llama")?;
    let names = ["tiny-llama-attn", "tiny-llama-all", "tiny-llama-mlp"];
    let adapters: Vec<Arc<LoraAdapter>> = names
        .iter()
        .map(|n| adapter(&b, n))
        .collect::<Result<_>>()?;
    let refs: Vec<Value> = names.iter().map(|n| reference(n)).collect::<Result<_>>()?;
    // (prompt, adapter index or None, expected ids) for every prompt and variant.
    let mut cases: Vec<(Vec<u32>, Option<usize>, Vec<u32>)> = Vec::new();
    for (i, r) in refs.iter().enumerate() {
        for p in r["prompts"].as_array().context("prompts")? {
            let prompt = ids(&p["input_ids"]);
            cases.push((prompt.clone(), Some(i), ids(&p["greedy_ids"])));
            if i == 0 {
                cases.push((prompt, None, ids(&p["base_greedy_ids"])));
            }
        }
    }
    // Page size 1: the prompts share prefixes across adapters, which the
    // namespaces must keep apart; max_loras 2 makes requests wait their turn.
    for (page_size, max_loras) in [(16, 8), (1, 2), (1, 8)] {
        let e = engine(&b, page_size, max_loras)?;
        for round in 0..2 {
            let streams: Vec<_> = cases
                .iter()
                .map(|(p, a, _)| e.submit(request(p, a.map(|i| &adapters[i]), 32)))
                .collect::<Result<_, _>>()?;
            for ((p, a, want), s) in cases.iter().zip(streams) {
                let chunks = s.collect_blocking();
                let out: Vec<u32> = chunks.iter().flat_map(|c| c.token_ids.clone()).collect();
                assert_eq!(
                    &out, want,
                    "page {page_size}, max_loras {max_loras}, round {round}, adapter {a:?}, prompt {p:?}"
                );
            }
        }
        // The cap held, and steps did mix adapters up to it (base + 3 adapters).
        let mixed = e.stats().lora_max_step_adapters;
        assert_eq!(
            mixed,
            max_loras.min(4),
            "page {page_size}, max_loras {max_loras}"
        );
        assert_pool_empty(&e);
    }
    Ok(())
}

#[test]
fn the_prefix_cache_is_per_adapter() -> Result<()> {
    let b = base("tiny-llama")?;
    let a = adapter(&b, "tiny-llama-attn")?;
    let c = adapter(&b, "tiny-llama-all")?;
    let e = engine(&b, 4, 8)?;
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 + 3) % 490).collect();
    let cached = |lora: Option<&Arc<LoraAdapter>>| -> Result<usize> {
        let chunks = e.submit(request(&prompt, lora, 2))?.collect_blocking();
        let last = chunks.last().context("chunks")?;
        Ok(last.meta.cached_tokens)
    };
    assert_eq!(cached(Some(&a))?, 0);
    assert_eq!(cached(Some(&a))?, 36, "the same adapter reuses its prefix");
    assert_eq!(cached(Some(&c))?, 0, "another adapter does not");
    assert_eq!(cached(None)?, 0, "nor does the base model");
    // The same files loaded again (a new Arc) share the namespace.
    let again = adapter(&b, "tiny-llama-attn")?;
    assert_eq!(cached(Some(&again))?, 36);
    assert_pool_empty(&e);
    Ok(())
}

/// A copy of the adapter `name` in a temporary folder, for editing.
fn copy(name: &str) -> Result<tempfile::TempDir> {
    let dir = tempfile::tempdir()?;
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        std::fs::copy(
            fixtures().join("lora").join(name).join(f),
            dir.path().join(f),
        )?;
    }
    Ok(dir)
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut Value)) -> Result<()> {
    let p = dir.join("adapter_config.json");
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    f(&mut v);
    std::fs::write(&p, serde_json::to_string(&v)?)?;
    Ok(())
}

#[test]
fn bad_adapters_are_refused() -> Result<()> {
    let b = base("tiny-llama")?;
    let spec = b.model.model.spec().clone();
    let registry = LoraRegistry::new(
        b.backend.clone(),
        spec.clone(),
        LoraLimits {
            max_rank: Some(8),
            targets: None,
        },
        Some(2),
    );
    let dir = |n: &str| fixtures().join("lora").join(n);
    let err = |r: arbor_lora::Result<Arc<LoraAdapter>>| {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    };
    // Rank 16 above the maximum of 8.
    let e = registry
        .load("mlp", &dir("tiny-llama-mlp"))
        .err()
        .context("refused")?;
    assert!(
        matches!(
            e,
            LoraError::Limit {
                setting: "max_lora_rank",
                ..
            }
        ),
        "{e}"
    );
    assert!(
        e.to_string().contains("rank 16") && e.to_string().contains("max_lora_rank 8"),
        "{e}"
    );
    // An unknown target module.
    let t = copy("tiny-llama-attn")?;
    edit_config(t.path(), |v| {
        v["target_modules"] = serde_json::json!(["q_proj", "lm_head"])
    })?;
    let e = err(registry.load("bad", t.path()));
    assert!(e.contains("'lm_head'"), "{e}");
    // A missing weights file.
    let t = copy("tiny-llama-attn")?;
    std::fs::remove_file(t.path().join("adapter_model.safetensors"))?;
    let e = registry
        .load("missing", t.path())
        .err()
        .context("refused")?;
    assert!(matches!(e, LoraError::Io { .. }), "{e}");
    assert!(e.to_string().contains("adapter_model.safetensors"), "{e}");
    // A rank in the config that the tensors do not have.
    let t = copy("tiny-llama-attn")?;
    edit_config(t.path(), |v| v["r"] = serde_json::json!(4))?;
    let e = err(registry.load("shape", t.path()));
    assert!(e.contains("expected [4, 64]"), "{e}");
    // A tensor the config's target_modules leaves out.
    let t = copy("tiny-llama-attn")?;
    edit_config(t.path(), |v| {
        v["target_modules"] = serde_json::json!(["q_proj"])
    })?;
    let e = err(registry.load("untargeted", t.path()));
    assert!(e.contains("not in the config's target_modules"), "{e}");
    // DoRA.
    let t = copy("tiny-llama-attn")?;
    edit_config(t.path(), |v| v["use_dora"] = serde_json::json!(true))?;
    let e = err(registry.load("dora", t.path()));
    assert!(e.contains("DoRA"), "{e}");
    // An adapter of a 3-layer model on a 2-layer one.
    let q = base("tiny-qwen2")?;
    let e = load_adapter(
        "x",
        &dir("tiny-llama-attn"),
        q.model.model.spec(),
        &*q.backend,
        &LoraLimits::default(),
    )
    .err()
    .context("refused")?;
    assert!(
        e.to_string().contains("layer 2 of a model with 2 layers"),
        "{e}"
    );
    // Target modules outside the allowed ones.
    let only_attn = LoraRegistry::new(
        b.backend.clone(),
        spec,
        LoraLimits {
            max_rank: None,
            targets: Some(vec![
                arbor_engine_core::LoraTarget::Q,
                arbor_engine_core::LoraTarget::V,
            ]),
        },
        None,
    );
    let e = err(only_attn.load("all", &dir("tiny-llama-all")));
    assert!(e.contains("outside lora_target_modules"), "{e}");
    // Names: taken once, looked up with the loaded ones listed, no ':'.
    registry.load("attn", &dir("tiny-llama-attn"))?;
    assert!(matches!(
        registry.load("attn", &dir("tiny-llama-attn")),
        Err(LoraError::AlreadyLoaded(_))
    ));
    assert!(err(registry.load("a:b", &dir("tiny-llama-attn"))).contains("':'"));
    let e = registry.get("nope").err().context("unknown")?.to_string();
    assert!(e.contains("'nope'") && e.contains("loaded: attn"), "{e}");
    registry.load("all", &dir("tiny-llama-all"))?;
    let e = err(registry.load("third", &dir("tiny-llama-all")));
    assert!(e.contains("(max_loaded_loras 2)"), "{e}");
    // Unloading frees the name; a holder keeps its weights.
    let held = registry.get("attn")?;
    registry.unload("attn")?;
    assert!(registry.get("attn").is_err());
    assert!(matches!(
        registry.unload("attn"),
        Err(LoraError::NotLoaded { .. })
    ));
    assert_eq!(held.name(), "attn");
    registry.load("attn", &dir("tiny-llama-attn"))?;
    // An adapter of another model is refused by the engine.
    let e = engine(&q, 16, 8)?;
    let a = adapter(&b, "tiny-llama-attn")?;
    let refused = e
        .submit(request(&[1, 2, 3], Some(&a), 4))
        .err()
        .context("refused")?;
    assert!(refused.to_string().contains("3 layers"), "{refused}");
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn a_batch_of_segments_matches_peft_on_the_cpu() -> Result<()> {
    device::lora_batch_matches_peft(Arc::new(CpuBackend::new(2)?), 1e-4)
}
