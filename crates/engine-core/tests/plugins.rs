//! Dynamic plugins end to end: the example plugins in plugins/ are built by
//! this test (cargo, separate target dir), loaded through the C ABI into a
//! registry, and used by a real radix cache and a real engine on the tiny
//! Llama fixture. A plugin compiled from C with the wrong ABI version, a
//! missing path, and a panicking plugin are refused or isolated.

#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, FinishKind, GenerateRequest};
use arbor_engine_core::plugin::load_plugin;
use arbor_engine_core::registry::Origin;
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, CacheNamespace, DType, LoadOptions, PagePool, PrefixCacheOptions, Registry,
    SamplingParams, SeqRng,
};
use arbor_kv_radix as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Builds the example plugins once and returns the folder holding them.
fn plugin_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let target = root().join("target").join("plugin-tests");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let status = Command::new(cargo)
            .args([
                "build",
                "-p",
                "arbor-plugin-banned-words",
                "-p",
                "arbor-plugin-size-aware-eviction",
                "-p",
                "arbor-plugin-typical-sampler",
            ])
            .env("CARGO_TARGET_DIR", &target)
            .current_dir(root())
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the example plugins failed");
        target.join("debug")
    })
}

fn lib(name: &str) -> PathBuf {
    plugin_dir().join(format!(
        "{}{name}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ))
}

#[test]
fn plugins_register_next_to_builtins() -> Result<()> {
    let mut r = Registry::builtin()?;
    let info = load_plugin(
        &lib("arbor_plugin_size_aware_eviction"),
        &serde_json::Value::Null,
        &mut r,
    )?;
    assert_eq!(info.name, "size-aware-eviction");
    assert_eq!(info.eviction_policies, vec!["size-aware"]);
    let listed = r
        .listing()
        .into_iter()
        .find(|(_, n, _, _)| n == "size-aware")
        .context("listed")?;
    assert!(matches!(listed.3, Origin::Plugin(ref p) if p.contains("size_aware")));
    // Loading it twice is refused: the names are taken.
    let e = load_plugin(
        &lib("arbor_plugin_size_aware_eviction"),
        &serde_json::Value::Null,
        &mut r,
    )
    .unwrap_err();
    assert!(e.to_string().contains("duplicate"), "{e}");
    Ok(())
}

#[test]
fn size_aware_policy_changes_the_eviction_order() -> Result<()> {
    let mut r = Registry::builtin()?;
    load_plugin(
        &lib("arbor_plugin_size_aware_eviction"),
        &serde_json::Value::Null,
        &mut r,
    )?;
    let ns = CacheNamespace::default();
    let long: Vec<u32> = (1000..1064).collect(); // 64 tokens
    let short: Vec<u32> = (2000..2004).collect(); // 4 tokens, inserted first (oldest)
    let mut evicted = Vec::new();
    for policy in ["lru", "size-aware"] {
        let pool = PagePool::new(128, 1);
        let p = r.eviction_policies.get(policy)?()?;
        let mut cache = r.prefix_caches.get("radix")?(&PrefixCacheOptions {
            page_size: 1,
            policy: p,
        })?;
        cache.insert(&ns, &short, pool.alloc(4)?, 0)?;
        cache.insert(&ns, &long, pool.alloc(64)?, 0)?;
        cache.match_prefix(&ns, &long);
        cache.evict(4);
        evicted.push(if cache.peek_prefix(&ns, &long) == 0 {
            "long"
        } else {
            "short"
        });
        cache.flush();
        assert_eq!(pool.free_pages(), 128);
    }
    assert_eq!(
        evicted,
        vec!["short", "long"],
        "LRU evicts the old short prefix, size-aware the big one"
    );
    Ok(())
}

#[test]
fn wrong_abi_and_missing_paths_are_refused() -> Result<()> {
    let mut r = Registry::builtin()?;
    let e = load_plugin(
        Path::new("/nonexistent/libnothing.so"),
        &serde_json::Value::Null,
        &mut r,
    )
    .unwrap_err();
    assert!(e.to_string().contains("no such file"), "{e}");

    // A plugin written in C that claims ABI version 999.
    let dir = tempfile::tempdir()?;
    let c = dir.path().join("bad.c");
    std::fs::write(
        &c,
        "struct p { unsigned int abi; const char *name, *version; void *t[8]; };\n\
         static struct p desc = { 999, \"bad\", \"0\", {0} };\n\
         const struct p *arbor_plugin_entry(void) { return &desc; }\n",
    )?;
    let so = dir
        .path()
        .join(format!("libbad{}", std::env::consts::DLL_SUFFIX));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    match Command::new(&cc)
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .status()
    {
        Ok(s) if s.success() => {
            let e = load_plugin(&so, &serde_json::Value::Null, &mut r).unwrap_err();
            let msg = e.to_string();
            assert!(
                msg.contains("version 999") && msg.contains("version 1"),
                "{msg}"
            );
        }
        _ => eprintln!("skipping the C plugin check: no C compiler ({cc})"),
    }
    // Not a plugin at all.
    let e = load_plugin(&dir.path().join("bad.c"), &serde_json::Value::Null, &mut r).unwrap_err();
    assert!(e.to_string().contains("cannot load"), "{e}");
    Ok(())
}

fn engine(registry: &Registry, processors: &[&str]) -> Result<Engine> {
    engine_with(registry, processors, "standard")
}

fn engine_with(registry: &Registry, processors: &[&str], sampler: &str) -> Result<Engine> {
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let m = arbor_models::load_model(&root().join("tests/fixtures/tiny-llama"), registry, &opts)?;
    let runner = ModelRunner::new(m.model.clone(), backend, None, 16, 64, DType::F32)?;
    let policy = registry.eviction_policies.get("lru")?()?;
    let cache = registry.prefix_caches.get("radix")?(&PrefixCacheOptions {
        page_size: 16,
        policy,
    })?;
    let processors = processors
        .iter()
        .map(|n| {
            registry
                .logits_processors
                .get(n)
                .map(|f| f(&serde_json::Value::Null))
        })
        .collect::<Result<Result<Vec<_>, _>, _>>()??;
    Ok(Engine::new(
        EngineConfig::default(),
        EngineParts::local(
            runner,
            cache,
            registry.samplers.get(sampler)?()?,
            processors,
            m.tokenizer.clone(),
            vec![],
        ),
    )?)
}

fn run(e: &Engine, prompt: &[u32]) -> Result<(Vec<u32>, FinishKind, Option<String>)> {
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(24)
    };
    run_with(e, prompt, params)
}

fn run_with(
    e: &Engine,
    prompt: &[u32],
    params: SamplingParams,
) -> Result<(Vec<u32>, FinishKind, Option<String>)> {
    let chunks = e
        .submit(GenerateRequest::new(prompt.to_vec(), params))?
        .collect_blocking();
    let f = chunks
        .last()
        .and_then(|c| c.finish.clone())
        .context("finish")?;
    Ok((
        chunks.iter().flat_map(|c| c.token_ids.clone()).collect(),
        f.kind,
        f.message,
    ))
}

#[test]
fn banned_words_never_appear_and_a_panic_fails_only_its_request() -> Result<()> {
    let prompt: Vec<u32> = vec![10, 52, 7, 99, 130, 41, 77];
    let plain = Registry::builtin()?;
    let (free, _, _) = run(&engine(&plain, &["penalties"])?, &prompt)?;
    let banned: Vec<u32> = free.iter().copied().take(3).collect();

    let mut r = Registry::builtin()?;
    let config = serde_json::json!({"token_ids": banned, "panic_on_prompt_token": 5});
    let info = load_plugin(&lib("arbor_plugin_banned_words"), &config, &mut r)?;
    assert_eq!(info.logits_processors, vec!["banned_words"]);
    let e = engine(&r, &["penalties", "banned_words"])?;
    let (out, kind, _) = run(&e, &prompt)?;
    assert_eq!(kind, FinishKind::Length);
    assert_eq!(out.len(), 24);
    assert!(
        out.iter().all(|t| !banned.contains(t)),
        "banned {banned:?} in {out:?}"
    );
    assert_ne!(out, free);

    // The plugin panics on prompts containing token 5: that request fails, others go on.
    let bad = e.submit(GenerateRequest::new(
        vec![3, 5, 8],
        SamplingParams::greedy(8),
    ))?;
    let good = e.submit(GenerateRequest::new(
        prompt.clone(),
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(24)
        },
    ))?;
    let bad = bad.collect_blocking();
    let f = bad
        .last()
        .and_then(|c| c.finish.clone())
        .context("finish")?;
    assert_eq!(f.kind, FinishKind::Abort);
    assert!(f.message.unwrap_or_default().contains("panicked"));
    let good: Vec<u32> = good
        .collect_blocking()
        .iter()
        .flat_map(|c| c.token_ids.clone())
        .collect();
    assert_eq!(good, out);
    assert!(e.flush_cache()?);
    Ok(())
}

/// A sampler from a plugin (locally typical sampling) drives a real engine:
/// on hand-made logits it picks the token an independent calculation says is
/// the most typical; at temperature 0 the engine's output equals the built-in
/// greedy sampler's; at temperature 1 with `typical_p = 0` the output is the
/// same whatever the seed (one candidate per step), and with `typical_p = 1`
/// the same seed gives the same tokens.
#[test]
fn a_plugin_sampler_drives_the_engine() -> Result<()> {
    let mut r = Registry::builtin()?;
    let info = load_plugin(
        &lib("arbor_plugin_typical_sampler"),
        &serde_json::json!({"typical_p": 0.0}),
        &mut r,
    )?;
    assert_eq!(info.samplers, vec!["typical"]);
    let listed = r.listing();
    assert!(listed.iter().any(|(_, n, _, _)| n == "standard"));
    assert!(
        listed
            .iter()
            .any(|(_, n, _, o)| n == "typical" && matches!(o, Origin::Plugin(_)))
    );

    // p = [0.1, 0.2, 0.3, 0.4]: the token whose surprisal is nearest the entropy.
    let probs = [0.1f64, 0.2, 0.3, 0.4];
    let h: f64 = probs.iter().map(|p| -p * p.ln()).sum();
    let expect = (0..4)
        .min_by(|&a, &b| {
            (-probs[a].ln() - h)
                .abs()
                .total_cmp(&(-probs[b].ln() - h).abs())
        })
        .unwrap() as u32;
    let sampler = r.samplers.get("typical")?()?;
    let params = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::greedy(1)
    };
    for seed in 0..8 {
        let mut logits: Vec<f32> = probs.iter().map(|p| p.ln() as f32).collect();
        let mut rng = SeqRng::new(seed);
        assert_eq!(sampler.sample(&mut logits, &params, &mut rng)?, expect);
    }

    let prompt: Vec<u32> = vec![10, 52, 7, 99, 130, 41, 77];
    let greedy = run(&engine(&Registry::builtin()?, &[])?, &prompt)?.0;
    let e = engine_with(&r, &[], "typical")?;
    assert_eq!(run(&e, &prompt)?.0, greedy, "temperature 0 is greedy");
    let hot = |seed| SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ignore_eos: true,
        ..SamplingParams::greedy(24)
    };
    let a = run_with(&e, &prompt, hot(1))?.0;
    let b = run_with(&e, &prompt, hot(2))?.0;
    assert_eq!(a.len(), 24);
    assert_eq!(a, b, "typical_p = 0 leaves one candidate per step");
    assert!(e.flush_cache()?);

    let mut r1 = Registry::builtin()?;
    load_plugin(
        &lib("arbor_plugin_typical_sampler"),
        &serde_json::json!({"typical_p": 1.0}),
        &mut r1,
    )?;
    let e = engine_with(&r1, &[], "typical")?;
    let x = run_with(&e, &prompt, hot(5))?.0;
    let y = run_with(&e, &prompt, hot(5))?.0;
    let z = run_with(&e, &prompt, hot(6))?.0;
    assert_eq!(x, y, "same seed, same tokens");
    assert_ne!(x, greedy, "typical_p = 1 samples the whole distribution");
    assert_ne!(x, z, "another seed, other tokens");
    assert!(e.flush_cache()?);
    Ok(())
}
