//! HiCache end to end in the engine, on the tiny Llama fixture with a device
//! pool too small for the working set: prefixes evicted from the device come
//! back from the host tier (counted in `cached_tokens` and
//! `cached_tokens_host`), and greedy output is identical, token for token, to
//! an engine without any cache. Every test ends with the pool empty after a
//! flush, and the flush empties the host tier too.

#[path = "../../engine-core/tests/support/tiny.rs"]
mod tiny;

use anyhow::{Context, Result};
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{DType, KvTier, PrefixCacheOptions, SamplingParams, SeqRng};
use arbor_kv_hicache::{HiCache, HiCacheConfig, HiCacheOptions, WritePolicy};
use std::sync::Arc;
use tiny::{assert_pool_empty, greedy, shared};

const PAGE: usize = 16;

/// An engine on the tiny model with `pages` device pages; HiCache when `hicache`.
fn engine(
    pages: usize,
    hicache: Option<HiCacheConfig>,
    storage: Option<Arc<dyn KvTier>>,
    model: &str,
) -> Result<Engine> {
    let s = shared();
    let runner = ModelRunner::new(
        s.model.model.clone(),
        s.backend.clone(),
        None,
        PAGE,
        pages,
        DType::F32,
    )?;
    let policy = s.registry.eviction_policies.get("lru")?()?;
    let cache: Box<dyn arbor_engine_core::PrefixCache> = match hicache {
        Some(config) => Box::new(HiCache::new(HiCacheOptions {
            kv: *runner.kv_spec(),
            policy,
            model: model.into(),
            config,
            storage,
        })?),
        None => s.registry.prefix_caches.get("none")?(&PrefixCacheOptions {
            page_size: PAGE,
            policy,
        })?,
    };
    let parts = EngineParts::local(
        runner,
        cache,
        s.registry.samplers.get("standard")?()?,
        Vec::new(),
        s.model.tokenizer.clone(),
        s.model.tokenizer.eos_token_ids.clone(),
    );
    let cfg = EngineConfig {
        disable_radix_cache: false,
        ..EngineConfig::default()
    };
    Ok(Engine::new(cfg, parts)?)
}

/// Runs the requests concurrently; per request its tokens and (cached, from host, from storage).
fn run(
    e: &Engine,
    prompts: &[Vec<u32>],
    p: &SamplingParams,
) -> Result<Vec<(Vec<u32>, [usize; 3])>> {
    let streams: Vec<_> = prompts
        .iter()
        .map(|x| e.submit(GenerateRequest::new(x.clone(), p.clone())))
        .collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for s in streams {
        let chunks = s.collect_blocking();
        let last = chunks.last().context("a chunk")?;
        let f = last.finish.clone().context("finished")?;
        assert_ne!(f.kind, FinishKind::Abort, "{f:?}");
        let m = &last.meta;
        out.push((
            chunks.iter().flat_map(|c| c.token_ids.clone()).collect(),
            [
                m.cached_tokens,
                m.cached_tokens_host,
                m.cached_tokens_storage,
            ],
        ));
    }
    Ok(out)
}

/// `n` documents of `len` tokens, each asked two questions (shared prefix, distinct tails).
fn documents(n: usize, len: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = SeqRng::new(seed);
    let docs: Vec<Vec<u32>> = (0..n)
        .map(|_| (0..len).map(|_| (rng.next_u64() % 497) as u32).collect())
        .collect();
    let mut out = Vec::new();
    for q in 0..2u32 {
        for d in &docs {
            let mut p = d.clone();
            p.extend([490 + q, 491, 492 + q]);
            out.push(p);
        }
    }
    out
}

fn config(policy: WritePolicy) -> HiCacheConfig {
    HiCacheConfig {
        ratio: 8.0,
        write_policy: policy,
        ..HiCacheConfig::default()
    }
}

#[test]
fn evicted_prefixes_come_back_from_host_with_identical_output() -> Result<()> {
    // 12 pages (192 tokens) of device KV; 6 documents of 100 tokens.
    let prompts = documents(6, 100, 7);
    let params = greedy(8);
    let cold = engine(256, None, None, "tiny")?;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&cold, std::slice::from_ref(p), &params).map(|mut v| v.remove(0).0))
        .collect::<Result<_>>()?;
    assert_pool_empty(&cold);
    for policy in [
        WritePolicy::WriteThrough,
        WritePolicy::WriteThroughSelective,
        WritePolicy::WriteBack,
    ] {
        let e = engine(12, Some(config(policy)), None, "tiny")?;
        let mut host_hits = 0;
        for (p, w) in prompts.iter().zip(&want) {
            let (got, [cached, host, _]) = run(&e, std::slice::from_ref(p), &params)?.remove(0);
            assert_eq!(
                &got, w,
                "{policy:?}: output differs from an engine without cache"
            );
            assert!(host <= cached);
            host_hits += host;
        }
        let st = e.stats();
        assert!(
            host_hits >= 5 * 96,
            "{policy:?}: second questions should load their document from the host \
             ({host_hits} tokens; {:?})",
            st.tiers
        );
        assert!(st.kv_copy.pages_to_device > 0 && st.kv_copy.pages_to_host > 0);
        assert!(st.tiers.host_tokens > 0);
        assert_pool_empty(&e);
        // The flush empties the host tier too.
        assert_eq!(e.stats().tiers.host_tokens, 0, "{:?}", e.stats().tiers);
    }
    Ok(())
}

#[test]
fn concurrent_requests_under_pressure_match_an_uncached_engine() -> Result<()> {
    let prompts = documents(8, 70, 11);
    let params = greedy(12);
    let cold = engine(256, None, None, "tiny")?;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&cold, std::slice::from_ref(p), &params).map(|mut v| v.remove(0).0))
        .collect::<Result<_>>()?;
    let e = engine(40, Some(config(WritePolicy::WriteBack)), None, "tiny")?;
    for round in 0..3 {
        let got = run(&e, &prompts, &params)?;
        for (i, ((g, _), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g, w, "round {round}, request {i}");
        }
    }
    assert!(e.stats().tiers.host_hit_tokens > 0, "{:?}", e.stats().tiers);
    assert_pool_empty(&e);
    assert_pool_empty(&cold);
    Ok(())
}
