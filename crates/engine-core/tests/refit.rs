//! Weight refit and memory control of the engine on the tiny Llama fixture:
//! a drained and an asynchronous weight update with requests in flight (all
//! finish; afterwards greedy outputs equal a fresh engine's on the new
//! weights, the prefix cache never serving KV of the old ones), a model of
//! another architecture refused with the old weights kept, and pause,
//! release and resume. The new weights are the fixture loaded in bf16 (the
//! same shape, other values). Every test ends with the KV pool free.

#![allow(clippy::unwrap_used)]

use anyhow::Result;
use arbor_engine_core::engine::refit::{PauseMode, RefitOptions};
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{DType, LoadOptions, Model, PrefixCacheOptions};
use arbor_kv_radix as _;
use std::sync::Arc;

#[path = "support/tiny.rs"]
mod tiny;
use tiny::{SlowSteps, assert_pool_empty, greedy, prompts, shared};

fn load(path: &std::path::Path, quant: &str) -> Result<Arc<dyn Model>> {
    let s = shared();
    let opts = LoadOptions {
        backend: s.backend.clone(),
        quant: s.registry.quant_methods.get(quant)?(&Default::default())?,
        progress: None,
    };
    Ok(arbor_models::load_model(path, &s.registry, &opts)?.model)
}

fn engine(model: Arc<dyn Model>) -> Result<Engine> {
    Ok(Engine::new(EngineConfig::default(), parts(model)?)?)
}

/// One rank's parts: its runner over `model`, a radix cache, [`SlowSteps`].
fn parts(model: Arc<dyn Model>) -> Result<EngineParts> {
    let s = shared();
    let runner = ModelRunner::new(model, s.backend.clone(), None, 16, 64, DType::F32)?;
    let policy = s.registry.eviction_policies.get("lru")?()?;
    let cache = s.registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: 16,
        policy,
    })?;
    let parts = EngineParts::local(
        runner,
        cache,
        s.registry.samplers.get("standard")?()?,
        vec![Arc::new(SlowSteps(&[IN_FLIGHT_TOKENS]))],
        s.model.tokenizer.clone(),
        s.model.tokenizer.eos_token_ids.clone(),
    );
    Ok(parts)
}

/// Greedy outputs of `ps`, one request at a time (each a prefix-cache hit
/// the second time round).
fn outputs(e: &Engine, ps: &[Vec<u32>]) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for p in ps {
        let chunks = e
            .submit(GenerateRequest::new(p.clone(), greedy(12)))?
            .collect_blocking();
        out.push(chunks.iter().flat_map(|c| c.token_ids.clone()).collect());
    }
    Ok(out)
}

/// Tokens of the requests in flight during an update (slowed by
/// [`SlowSteps`], so that they are still decoding when it arrives).
const IN_FLIGHT_TOKENS: usize = 40;

#[test]
fn drained_and_async_refits_under_load_match_a_fresh_engine() -> Result<()> {
    let ps = prompts(6, 11);
    let old = shared().model.model.clone();
    let new = load(&tiny::fixture(), "bf16")?;
    let want_new = outputs(&engine(new.clone())?, &ps)?;
    let want_old = outputs(&engine(old.clone())?, &ps)?;
    assert_ne!(want_new, want_old, "bf16 weights must change some output");

    for drain in [true, false] {
        let e = engine(old.clone())?;
        // Cache the prompts under the old weights.
        assert_eq!(outputs(&e, &ps)?, want_old);
        let mut streams: Vec<_> = ps
            .iter()
            .map(|p| e.submit(GenerateRequest::new(p.clone(), greedy(IN_FLIGHT_TOKENS))))
            .collect::<Result<_, _>>()?;
        // Every request is decoding when the update arrives.
        for s in &mut streams {
            assert!(s.blocking_next().is_some_and(|c| c.finish.is_none()));
        }
        let report = e.update_weights(
            vec![vec![new.clone()]],
            RefitOptions {
                drain,
                keep_pause: false,
            },
        )?;
        assert_eq!(report.version, 1);
        if drain {
            assert_eq!(report.running_at_swap, 0, "drained first");
        } else {
            assert!(report.running_at_swap > 0, "swapped under running requests");
        }
        for s in streams {
            let f = s.collect_blocking().last().and_then(|c| c.finish.clone());
            assert_eq!(f.map(|f| f.kind), Some(FinishKind::Length), "drain {drain}");
        }
        assert_eq!(
            outputs(&e, &ps)?,
            want_new,
            "drain {drain}: new weights, no stale KV"
        );
        assert_pool_empty(&e);
    }
    Ok(())
}

#[test]
fn data_parallel_ranks_each_install_their_own_copy() -> Result<()> {
    let ps = prompts(6, 13);
    let old = shared().model.model.clone();
    let want_new = outputs(&engine(load(&tiny::fixture(), "bf16")?)?, &ps)?;
    let e = Engine::data_parallel(
        EngineConfig::default(),
        vec![parts(old.clone())?, parts(load(&tiny::fixture(), "auto")?)?],
        arbor_engine_core::engine::LoadBalance::RoundRobin,
    )?;
    assert_ne!(outputs(&e, &ps)?, want_new);
    // One model for two ranks is refused, and nothing changes.
    let new = || load(&tiny::fixture(), "bf16");
    let err = e
        .update_weights(vec![vec![new()?]], RefitOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("1 models for 2 data-parallel ranks"), "{err}");
    // Two models for a rank of one device is refused by its executor.
    let err = e
        .update_weights(
            vec![vec![new()?, new()?], vec![new()?, new()?]],
            RefitOptions::default(),
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("2 models for an executor of one rank"),
        "{err}"
    );
    let report = e.update_weights(vec![vec![new()?], vec![new()?]], RefitOptions::default())?;
    assert_eq!(report.version, 1, "every rank is at version 1");
    // Round robin puts every other request on each rank: both serve the
    // new weights.
    assert_eq!(outputs(&e, &ps)?, want_new);
    assert!(e.rank_stats().iter().all(|r| r.num_requests_total > 0));
    // Released weights come back the same way.
    e.release_memory(true, true)?;
    assert!(e.resume_memory(Some(vec![vec![new()?]])).is_err());
    e.resume_memory(Some(vec![vec![new()?], vec![new()?]]))?;
    assert_eq!(outputs(&e, &ps)?, want_new);
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn another_architecture_is_refused_and_the_old_weights_kept() -> Result<()> {
    let ps = prompts(3, 5);
    let e = engine(shared().model.model.clone())?;
    let before = outputs(&e, &ps)?;
    let qwen = tiny::fixture().join("../tiny-qwen2");
    let err = e
        .update_weights(vec![vec![load(&qwen, "auto")?]], RefitOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("architecture"), "{err}");
    assert_eq!(outputs(&e, &ps)?, before);
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn pause_release_and_resume() -> Result<()> {
    let ps = prompts(3, 9);
    let model = shared().model.model.clone();
    let e = engine(model.clone())?;
    let before = outputs(&e, &ps)?;
    // Paused: a request submitted now waits in the queue; continue runs it.
    assert_eq!(e.pause_generation(PauseMode::InPlace)?, 0);
    let s = e.submit(GenerateRequest::new(ps[0].clone(), greedy(12)))?;
    assert!(e.continue_generation().is_ok());
    let got: Vec<u32> = s
        .collect_blocking()
        .iter()
        .flat_map(|c| c.token_ids.clone())
        .collect();
    assert_eq!(got, before[0]);

    e.release_memory(true, true)?;
    assert!(
        e.release_memory(true, true).is_ok(),
        "releasing again is harmless"
    );
    assert!(
        e.continue_generation().is_err(),
        "released: resume, not continue"
    );
    assert!(e.resume_memory(None).is_err(), "the weights were released");
    let waiting = e.submit(GenerateRequest::new(ps[1].clone(), greedy(12)))?;
    e.resume_memory(Some(vec![vec![model]]))?;
    let got: Vec<u32> = waiting
        .collect_blocking()
        .iter()
        .flat_map(|c| c.token_ids.clone())
        .collect();
    assert_eq!(
        got, before[1],
        "the request queued while released runs after the resume"
    );
    assert_eq!(outputs(&e, &ps)?, before);
    assert_pool_empty(&e);
    Ok(())
}
