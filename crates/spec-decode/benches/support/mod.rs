//! Shared pieces of the default-model benchmarks (a module of each bench):
//! the default model on the CPU backend, an engine builder over any
//! registered speculator, a concurrent run that
//! reports decode time and accept length, and ShareGPT's first user turns.
#![allow(dead_code)]

use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{
    Backend, DType, LoadOptions, Model, PrefixCacheOptions, Registry, SamplingParams,
    SpeculatorInputs,
};
use arbor_models::LoadedModel;
use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

/// The default model on a CPU backend of `threads` threads, with the
/// registry; `None` (after saying so) when it was not fetched.
pub fn default_model(threads: usize) -> Option<(LoadedModel, Arc<dyn Backend>, Registry)> {
    let Some(path) = arbor_gguf::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return None;
    };
    let registry = Registry::builtin().expect("registry");
    let backend: Arc<dyn Backend> =
        Arc::new(arbor_backend_cpu::CpuBackend::new(threads).expect("cpu"));
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto").expect("auto")(&Default::default())
            .expect("quant"),
        progress: None,
    };
    let m = arbor_models::load_model(&path, &registry, &opts).expect("model");
    Some((m, backend, registry))
}

pub fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// An engine on `m` with a radix cache of 2,048 f32 KV tokens, speculating
/// with `spec` (its `algorithm` names the speculator) over `draft` when given.
pub fn engine(
    m: &LoadedModel,
    b: &Arc<dyn Backend>,
    r: &Registry,
    spec: Option<SpeculativeConfig>,
    draft: Option<Arc<dyn Model>>,
) -> Engine {
    let runner = Arc::new(
        ModelRunner::new(m.model.clone(), b.clone(), None, 16, 2048, DType::F32).expect("runner"),
    );
    let cache = r.prefix_caches.get("radix").expect("radix")(&PrefixCacheOptions {
        page_size: 16,
        policy: r.eviction_policies.get("lru").expect("lru")().expect("policy"),
    })
    .expect("cache");
    let mut parts = EngineParts::local(
        runner.clone(),
        cache,
        r.samplers.get("standard").expect("s")().expect("sampler"),
        vec![],
        m.tokenizer.clone(),
        m.tokenizer.eos_token_ids.clone(),
    );
    if let Some(sc) = &spec {
        let inputs = SpeculatorInputs {
            target: runner,
            target_group: None,
            draft_model: draft,
            draft_path: None,
        };
        let create = r.speculators.get(&sc.algorithm).expect("speculator");
        parts.speculator = Some(create(sc, &inputs).expect("speculator"));
    }
    let cfg = EngineConfig {
        speculative: spec,
        ..Default::default()
    };
    Engine::new(cfg, parts).expect("engine")
}

/// First human turns of ShareGPT conversations, 40..400 characters long.
pub fn sharegpt(n: usize) -> Vec<String> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/data/traces/sharegpt/ShareGPT_V3_first2500.json.gz");
    let Ok(f) = std::fs::File::open(&path) else {
        eprintln!("{} is absent: free-form prompts skipped", path.display());
        return Vec::new();
    };
    let mut text = String::new();
    flate2::read::GzDecoder::new(f)
        .read_to_string(&mut text)
        .expect("gzip");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["conversations"][0]["value"].as_str())
        .filter(|s| (40..400).contains(&s.len()))
        .take(n)
        .map(str::to_string)
        .collect()
}

/// Runs prompts concurrently; returns (completion tokens, decode seconds
/// summed over requests, wall seconds, mean accept length, tokens).
pub fn run(
    e: &Engine,
    prompts: &[Vec<u32>],
    max_new: usize,
) -> (usize, f64, f64, f64, Vec<Vec<u32>>) {
    run_with(e, prompts, &SamplingParams::greedy(max_new))
}

/// [`run`] under `params` (every request alike).
pub fn run_with(
    e: &Engine,
    prompts: &[Vec<u32>],
    params: &SamplingParams,
) -> (usize, f64, f64, f64, Vec<Vec<u32>>) {
    let t0 = Instant::now();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.submit(GenerateRequest::new(p.clone(), params.clone()))
                .expect("submit")
        })
        .collect();
    let (mut toks, mut decode, mut acc, mut n_acc) = (0, 0.0, 0.0, 0);
    let mut outs = Vec::new();
    for s in streams {
        let chunks = s.collect_blocking();
        let last = chunks.last().expect("chunk");
        let m = &last.meta;
        toks += m.completion_tokens;
        decode += m.elapsed - m.ttft.unwrap_or(m.elapsed);
        if let Some(l) = m.spec_accept_length() {
            acc += l;
            n_acc += 1;
        }
        outs.push(chunks.iter().flat_map(|c| c.token_ids.clone()).collect());
    }
    let wall = t0.elapsed().as_secs_f64();
    (
        toks,
        decode,
        wall,
        if n_acc > 0 { acc / n_acc as f64 } else { 0.0 },
        outs,
    )
}
