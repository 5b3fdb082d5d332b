//! HiCache end to end in the engine, on the tiny Llama fixture with a device
//! pool too small for the working set: prefixes evicted from the device come
//! back from the host tier (counted in `cached_tokens` and
//! `cached_tokens_host`), and greedy output is identical, token for token, to
//! an engine without any cache, also on the CUDA host emulator (pinned host
//! pages, loads on the copy stream). Every test ends with the pool empty
//! after a flush, and the flush empties the host tier too.

#[path = "../../engine-core/tests/support/tiny.rs"]
mod tiny;

use anyhow::{Context, Result};
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{Backend, DType, KvTier, PrefixCacheOptions, SamplingParams, SeqRng};
use arbor_kv_hicache::{HiCache, HiCacheConfig, HiCacheOptions, WritePolicy};
use arbor_models::LoadedModel;
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
    engine_with(pages, hicache, storage, model, None)
}

/// [`engine`] with overlap scheduling forced on or off.
fn engine_with(
    pages: usize,
    hicache: Option<HiCacheConfig>,
    storage: Option<Arc<dyn KvTier>>,
    model: &str,
    overlap_schedule: Option<bool>,
) -> Result<Engine> {
    engine_for(
        &shared().model,
        &shared().backend,
        pages,
        hicache,
        storage,
        model,
        overlap_schedule,
    )
}

/// [`engine_with`] on a loaded model of its own, on its backend.
fn engine_for(
    loaded: &LoadedModel,
    backend: &Arc<dyn Backend>,
    pages: usize,
    hicache: Option<HiCacheConfig>,
    storage: Option<Arc<dyn KvTier>>,
    model: &str,
    overlap_schedule: Option<bool>,
) -> Result<Engine> {
    let s = shared();
    let runner = ModelRunner::new(
        loaded.model.clone(),
        backend.clone(),
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
            host_memory: backend.host_memory(),
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
        loaded.tokenizer.clone(),
        loaded.tokenizer.eos_token_ids.clone(),
    );
    let cfg = EngineConfig {
        disable_radix_cache: false,
        overlap_schedule,
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
    let want = cold_answers(&prompts, &params)?;
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

/// The same on the CUDA host emulator (backend-simt, as an sm_90 GPU, its
/// copy stream 2 ms per copy): the host tier in the backend's pinned
/// memory, each step's loads on the copy stream layer by layer beside the
/// forward, copied from the held pages in place, and output identical to
/// the emulated GPU without any cache.
#[test]
fn evicted_prefixes_come_back_from_pinned_memory_on_the_emulated_gpu() -> Result<()> {
    use arbor_backend_simt::{GpuBackend, Profile, SimtDriver};
    let drv = match SimtDriver::open(Profile::Hopper) {
        Ok(d) => d.with_copy_delay(std::time::Duration::from_millis(2)),
        Err(e) => {
            if std::env::var("ARBOR_REQUIRE_CXX").is_ok_and(|v| v == "1") {
                panic!("ARBOR_REQUIRE_CXX=1 but the emulator is unavailable: {e}");
            }
            println!("skipped: {e}");
            return Ok(());
        }
    };
    let gpu = Arc::new(GpuBackend::new(
        Box::new(drv),
        &arbor_engine_core::BackendOptions::default(),
        arbor_backend_simt::ATTENTION,
    ));
    let backend: Arc<dyn Backend> = gpu.clone();
    let s = shared();
    let opts = arbor_engine_core::LoadOptions {
        backend: backend.clone(),
        quant: s.registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let m = arbor_models::load_model(&tiny::fixture(), &s.registry, &opts)?;
    let prompts = documents(4, 100, 11);
    let params = greedy(4);
    let want = cold_answers_on(&m, &backend, &prompts, &params)?;
    let e = engine_for(
        &m,
        &backend,
        12,
        Some(config(WritePolicy::WriteThrough)),
        None,
        "tiny",
        None,
    )?;
    let mut host_hits = 0;
    for (p, w) in prompts.iter().zip(&want) {
        let (got, [_, host, _]) = run(&e, std::slice::from_ref(p), &params)?.remove(0);
        assert_eq!(
            &got, w,
            "output differs from the emulated GPU without cache"
        );
        host_hits += host;
    }
    assert!(host_hits >= 3 * 96, "{host_hits} tokens from the host tier");
    let loads = gpu.load_stats();
    assert!(
        loads.batches > 0 && loads.fallbacks == 0 && loads.in_place_bytes == loads.bytes,
        "loads on the copy stream, in place from the pinned pages: {loads:?}"
    );
    assert_pool_empty(&e);
    Ok(())
}

/// A latent KV cache (DeepSeek-V3's multi-head latent attention: one row
/// per token and layer, the values read from the keys) through the host
/// tier: pages hold K alone, half the bytes of a K-and-V page of that
/// shape, and prefixes evicted from the device come back with the output of
/// an engine without cache.
#[test]
fn latent_kv_pages_come_back_from_host_with_identical_output() -> Result<()> {
    let s = shared();
    let opts = arbor_engine_core::LoadOptions {
        backend: s.backend.clone(),
        quant: s.registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let dir = tiny::fixture().join("../tiny-deepseek-v3");
    let m = arbor_models::load_model(&dir, &s.registry, &opts)?;
    assert!(m.model.spec().kv_values_in_keys);
    let prompts = documents(6, 100, 9);
    let params = greedy(8);
    let cold = engine_for(&m, &s.backend, 256, None, None, "tiny-dsv3", None)?;
    let want: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| run(&cold, std::slice::from_ref(p), &params).map(|mut v| v.remove(0).0))
        .collect::<Result<_>>()?;
    assert_pool_empty(&cold);
    let e = engine_for(
        &m,
        &s.backend,
        12,
        Some(config(WritePolicy::WriteThrough)),
        None,
        "tiny-dsv3",
        None,
    )?;
    let mut host_hits = 0;
    for (p, w) in prompts.iter().zip(&want) {
        let (got, [_, host, _]) = run(&e, std::slice::from_ref(p), &params)?.remove(0);
        assert_eq!(&got, w, "output differs from an engine without cache");
        host_hits += host;
    }
    let st = e.stats();
    assert!(
        host_hits >= 5 * 96,
        "{host_hits} host tokens; {:?}",
        st.tiers
    );
    let spec = m.model.spec();
    let latent_page = spec.num_layers * spec.head_dim * 4 * PAGE;
    assert_eq!(
        st.kv_copy.bytes,
        (st.kv_copy.pages_to_host + st.kv_copy.pages_to_device) * latent_page as u64,
        "host pages of K alone ({latent_page} bytes): {:?}",
        st.kv_copy
    );
    assert_pool_empty(&e);
    Ok(())
}

#[test]
fn concurrent_requests_under_pressure_match_an_uncached_engine() -> Result<()> {
    let prompts = documents(8, 70, 11);
    let params = greedy(12);
    let want = cold_answers(&prompts, &params)?;
    // Overlap scheduling admits (and loads, and demotes) during the forward.
    for overlap in [false, true] {
        let e = engine_with(
            40,
            Some(config(WritePolicy::WriteBack)),
            None,
            "tiny",
            Some(overlap),
        )?;
        for round in 0..3 {
            let got = run(&e, &prompts, &params)?;
            for (i, ((g, _), w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "overlap {overlap}, round {round}, request {i}");
            }
        }
        assert!(e.stats().tiers.host_hit_tokens > 0, "{:?}", e.stats().tiers);
        assert_pool_empty(&e);
    }
    Ok(())
}

fn storage_config() -> HiCacheConfig {
    HiCacheConfig {
        prefetch_policy: arbor_kv_hicache::PrefetchPolicy::WaitComplete,
        prefetch_threshold: PAGE,
        ..config(WritePolicy::WriteThrough)
    }
}

/// Waits until the storage thread wrote at least `pages` pages.
fn wait_written(e: &Engine, pages: u64) -> Result<()> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while e.stats().tiers.storage_write_pages < pages {
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "storage writes stalled: {:?}",
            e.stats().tiers
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Ok(())
}

fn open(config: &str, backend: &str, model: &str) -> Result<Arc<dyn KvTier>> {
    use arbor_kv_hicache::storage::{StorageConfig, open_store};
    let kv = arbor_engine_core::KvSpec {
        num_layers: 3,
        num_kv_heads: 2,
        head_dim: 16,
        page_size: PAGE,
        num_pages: 1,
        dtype: DType::F32,
        values_in_keys: false,
    };
    let sc = StorageConfig::parse(backend, Some(config))?;
    Ok(open_store(
        &sc,
        &arbor_engine_core::TierIdentity::new(model, &kv),
    )?)
}

/// One cold answer per prompt, from an engine without cache.
fn cold_answers(prompts: &[Vec<u32>], params: &SamplingParams) -> Result<Vec<Vec<u32>>> {
    cold_answers_on(&shared().model, &shared().backend, prompts, params)
}

/// [`cold_answers`] of a model loaded on `backend`.
fn cold_answers_on(
    loaded: &LoadedModel,
    backend: &Arc<dyn Backend>,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
) -> Result<Vec<Vec<u32>>> {
    let cold = engine_for(loaded, backend, 256, None, None, "tiny", None)?;
    let want = prompts
        .iter()
        .map(|p| run(&cold, std::slice::from_ref(p), params).map(|mut v| v.remove(0).0))
        .collect::<Result<_>>()?;
    assert_pool_empty(&cold);
    Ok(want)
}

/// Fills a store through one engine, "restarts" (a new engine on the same
/// store) and checks that the prefixes come from storage with identical output.
fn restart_case(backend: &str, config: &str) -> Result<()> {
    let prompts: Vec<Vec<u32>> = documents(4, 100, 21).into_iter().take(4).collect();
    let params = greedy(6);
    let want = cold_answers(&prompts, &params)?;
    {
        let e = engine(
            64,
            Some(storage_config()),
            Some(open(config, backend, "tiny")?),
            "tiny",
        )?;
        for (p, w) in prompts.iter().zip(&want) {
            assert_eq!(&run(&e, std::slice::from_ref(p), &params)?[0].0, w);
        }
        // 4 prompts of 103 tokens and 6 generated: 6 whole pages each.
        wait_written(&e, 4 * 6)?;
        assert_pool_empty(&e);
    }
    let e = engine(
        64,
        Some(storage_config()),
        Some(open(config, backend, "tiny")?),
        "tiny",
    )?;
    for (p, w) in prompts.iter().zip(&want) {
        let (got, [cached, host, stored]) = run(&e, std::slice::from_ref(p), &params)?.remove(0);
        assert_eq!(&got, w, "{backend}: output after a restart differs");
        assert!(
            stored >= 96 && host >= stored && cached >= host,
            "{backend}: {cached} {host} {stored}"
        );
    }
    assert!(e.stats().tiers.storage_hit_tokens >= 4 * 96);
    assert_pool_empty(&e);
    // Another model's identity finds nothing in the same store.
    let other = engine(
        64,
        Some(storage_config()),
        Some(open(config, backend, "tiny-v2")?),
        "tiny-v2",
    )?;
    let (got, [cached, ..]) = run(&other, &prompts[..1], &params)?.remove(0);
    assert_eq!(got, want[0]);
    assert_eq!(
        cached, 0,
        "{backend}: a store written by another model was loaded"
    );
    assert_pool_empty(&other);
    Ok(())
}

#[test]
fn restart_finds_prefixes_in_the_file_store() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = serde_json::json!({ "dir": dir.path() }).to_string();
    restart_case("file", &config)
}

#[test]
fn truncated_page_files_are_skipped_and_removed() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let config = serde_json::json!({ "dir": dir.path() }).to_string();
    let prompts: Vec<Vec<u32>> = documents(2, 100, 5).into_iter().take(2).collect();
    let params = greedy(6);
    let want = cold_answers(&prompts, &params)?;
    {
        let e = engine(
            64,
            Some(storage_config()),
            Some(open(&config, "file", "tiny")?),
            "tiny",
        )?;
        run(&e, &prompts, &params)?;
        wait_written(&e, 2 * 6)?;
    }
    // Truncate every stored page: a crash in the middle of a copy, or a damaged disk.
    let mut truncated = 0;
    for entry in walk(dir.path()) {
        if entry.extension().is_some_and(|x| x == "kv") {
            let f = std::fs::OpenOptions::new().write(true).open(&entry)?;
            f.set_len(100)?;
            truncated += 1;
        }
    }
    assert!(truncated >= 12, "{truncated} page files");
    let e = engine(
        64,
        Some(storage_config()),
        Some(open(&config, "file", "tiny")?),
        "tiny",
    )?;
    for (p, w) in prompts.iter().zip(&want) {
        let (got, [_, _, stored]) = run(&e, std::slice::from_ref(p), &params)?.remove(0);
        assert_eq!(&got, w);
        assert_eq!(stored, 0, "a truncated page was loaded");
    }
    assert!(e.stats().tiers.storage_corrupt > 0, "{:?}", e.stats().tiers);
    assert_pool_empty(&e);
    Ok(())
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[path = "support/redis_server.rs"]
mod redis_server;

#[test]
fn restart_finds_prefixes_in_redis() -> Result<()> {
    let Some(bin) = redis_server::require_server() else {
        return Ok(());
    };
    let server = redis_server::Server::start(bin)?;
    let config = serde_json::json!({ "url": server.url() }).to_string();
    restart_case("redis", &config)
}

#[test]
fn requests_complete_when_redis_dies_mid_run() -> Result<()> {
    let Some(bin) = redis_server::require_server() else {
        return Ok(());
    };
    let mut server = redis_server::Server::start(bin)?;
    let config = serde_json::json!({ "url": server.url(), "timeout": 0.5 }).to_string();
    // Documents seen before the store dies, and new ones after (their
    // lookups and backups meet the dead store).
    let before = documents(3, 100, 33);
    let after = documents(3, 100, 34);
    let params = greedy(6);
    let want_before = cold_answers(&before, &params)?;
    let want_after = cold_answers(&after, &params)?;
    let e = engine(
        24,
        Some(storage_config()),
        Some(open(&config, "redis", "tiny")?),
        "tiny",
    )?;
    let mut got = run(&e, &before, &params)?;
    server.kill();
    got.extend(run(&e, &after, &params)?);
    // And again, concurrently, with the store gone.
    got.extend(run(&e, &before, &params)?);
    let want: Vec<&Vec<u32>> = want_before
        .iter()
        .chain(&want_after)
        .chain(&want_before)
        .collect();
    assert_eq!(got.len(), want.len());
    for (i, ((g, _), w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g, w, "request {i}");
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while e.stats().tiers.storage_errors == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    assert!(e.stats().tiers.storage_errors > 0, "{:?}", e.stats().tiers);
    assert_pool_empty(&e);
    Ok(())
}
