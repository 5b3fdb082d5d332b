//! N-gram speculation on the default model (SmolLM2-135M-Instruct Q4_1), the
//! engine end to end: batch-1 greedy decode speed on copy-heavy chat prompts
//! (rewrite a function with one variable renamed, copy a paragraph, repeat
//! a JSON document) with and without speculation, and the output rate of 16
//! concurrent free-form prompts (the first user turns of ShareGPT
//! conversations from `../shared/data`) with adaptive speculation against
//! none. Engines alternate A B A B within one run; only ratios measured this
//! way mean anything on a shared machine. Benchmark only; nothing asserted.
//!
//! Run: `cargo bench -p arbor-spec-decode --bench default_model`
//! (`ARBOR_BENCH_ROUNDS`, default 3; `ARBOR_BENCH_THREADS`, default 2).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::speculative::SpeculativeConfig;
use arbor_engine_core::{
    Backend, DType, LoadOptions, PrefixCacheOptions, Registry, SamplingParams,
};
use arbor_kv_radix as _;
use arbor_models::{LoadedModel, load_model};
use arbor_spec_decode as _;

#[path = "../../engine-core/tests/support/chat.rs"]
mod chat;
use chat::{chat, copy_prompts};
use std::io::Read;
use std::sync::Arc;
use std::time::Instant;

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

fn engine(
    m: &LoadedModel,
    b: &Arc<dyn Backend>,
    r: &Registry,
    spec: Option<SpeculativeConfig>,
) -> Engine {
    let runner =
        ModelRunner::new(m.model.clone(), b.clone(), None, 16, 2048, DType::F32).expect("runner");
    let cache = r.prefix_caches.get("radix").expect("radix")(&PrefixCacheOptions {
        page_size: 16,
        policy: r.eviction_policies.get("lru").expect("lru")().expect("policy"),
    })
    .expect("cache");
    let mut parts = EngineParts::local(
        runner,
        cache,
        r.samplers.get("standard").expect("s")().expect("sampler"),
        vec![],
        m.tokenizer.clone(),
        m.tokenizer.eos_token_ids.clone(),
    );
    if let Some(sc) = &spec {
        parts.speculator =
            Some(r.speculators.get("ngram").expect("ngram")(sc).expect("speculator"));
    }
    let cfg = EngineConfig {
        speculative: spec,
        ..Default::default()
    };
    Engine::new(cfg, parts).expect("engine")
}

/// First human turns of ShareGPT conversations, 40..400 characters long.
fn sharegpt(n: usize) -> Vec<String> {
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
fn run(e: &Engine, prompts: &[Vec<u32>], max_new: usize) -> (usize, f64, f64, f64, Vec<Vec<u32>>) {
    let t0 = Instant::now();
    let streams: Vec<_> = prompts
        .iter()
        .map(|p| {
            e.submit(GenerateRequest::new(
                p.clone(),
                SamplingParams::greedy(max_new),
            ))
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

fn main() {
    let Some(path) = arbor_gguf::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return;
    };
    let rounds = env_usize("ARBOR_BENCH_ROUNDS", 3);
    let threads = env_usize("ARBOR_BENCH_THREADS", 2);
    let registry = Registry::builtin().expect("registry");
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto").expect("auto")().expect("quant"),
        progress: None,
    };
    let m = load_model(&path, &registry, &opts).expect("model");
    let off = engine(&m, &backend, &registry, None);
    let spec = |adaptive| SpeculativeConfig {
        adaptive,
        ..SpeculativeConfig::default()
    };
    let on = engine(&m, &backend, &registry, Some(spec(false)));
    let adaptive = engine(&m, &backend, &registry, Some(spec(true)));

    println!("== batch 1, greedy, copy-heavy chat prompts, 128 new tokens, {threads} threads");
    let copies: Vec<Vec<u32>> = copy_prompts()
        .iter()
        .map(|p| chat(&m, p).expect("chat prompt"))
        .collect();
    let mut rate = [Vec::new(), Vec::new(), Vec::new()];
    let mut accept = [0.0f64; 3];
    let mut same = true;
    for round in 0..rounds {
        for p in &copies {
            let mut outs = Vec::new();
            for (i, e) in [&off, &on, &adaptive].iter().enumerate() {
                let _ = e.flush_cache();
                let (t, d, _, a, o) = run(e, std::slice::from_ref(p), 128);
                rate[i].push(t.saturating_sub(1) as f64 / d.max(1e-9));
                accept[i] += a / (rounds * copies.len()) as f64;
                outs.push(o);
            }
            same &= outs[0] == outs[1] && outs[0] == outs[2];
        }
        eprintln!("round {} done", round + 1);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let names = ["plain", "ngram", "ngram adaptive"];
    for i in 0..3 {
        println!(
            "{:>15}: decode {:.1} tok/s (mean of {} runs), mean accept length {:.2}, {:.2}x plain",
            names[i],
            mean(&rate[i]),
            rate[i].len(),
            accept[i],
            mean(&rate[i]) / mean(&rate[0])
        );
    }
    println!("outputs identical: {same}");

    let free: Vec<Vec<u32>> = sharegpt(16)
        .iter()
        .map(|p| chat(&m, p).expect("chat prompt"))
        .collect();
    if free.len() < 16 {
        return;
    }
    println!("== 16 concurrent free-form prompts (ShareGPT), 64 new tokens");
    let mut out_rate = [Vec::new(), Vec::new()];
    let mut same = true;
    for _ in 0..rounds {
        let mut outs = Vec::new();
        for (i, e) in [&off, &adaptive].iter().enumerate() {
            let _ = e.flush_cache();
            let (t, _, wall, _, o) = run(e, &free, 64);
            out_rate[i].push(t as f64 / wall);
            outs.push(o);
        }
        same &= outs[0] == outs[1];
    }
    let st = adaptive.stats();
    println!(
        "plain {:.1} output tok/s; ngram adaptive {:.1} ({:.2}x); adaptive skipped {} of {} proposed draft tokens; outputs identical: {same}",
        mean(&out_rate[0]),
        mean(&out_rate[1]),
        mean(&out_rate[1]) / mean(&out_rate[0]),
        st.spec_draft_tokens_skipped_total,
        st.spec_draft_tokens_skipped_total + st.spec_draft_tokens_total
    );
}
