//! Multi-LoRA throughput on the default model (SmolLM2-135M-Instruct Q4_1),
//! the engine end to end: 16 concurrent requests (64 prompt tokens, 64
//! greedy new tokens each) with no adapter, and with 1, 4 and 8 distinct
//! rank-16 adapters on all seven projections, assigned round robin so every
//! step mixes them. The adapters are seeded random PEFT folders written to a
//! temporary directory and loaded through the real loader. Configurations
//! alternate within each round (base, 1, 4, 8, base, ...); only ratios to
//! the base measured this way mean anything on a shared machine.
//! Benchmark only; nothing asserted.
//!
//! Run: `cargo bench -p arbor-lora --bench adapters`
//! (`ARBOR_BENCH_ROUNDS`, default 2; `ARBOR_BENCH_THREADS`, default 2;
//! `ARBOR_BENCH_RANK`, default 16).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, DType, LoadOptions, LoraAdapter, LoraTarget, PrefixCacheOptions, Registry,
    SamplingParams, SeqRng,
};
use arbor_kv_radix as _;
use arbor_lora::{LoraLimits, LoraRegistry, target_shape};
use arbor_models::load_model;
use safetensors::tensor::{Dtype, TensorView};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

fn env_usize(k: &str, d: usize) -> usize {
    std::env::var(k)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(d)
}

/// Writes a PEFT folder of rank `r` on every projection, seeded.
fn write_adapter(dir: &Path, spec: &arbor_engine_core::ModelSpec, r: usize, seed: u64) {
    std::fs::create_dir_all(dir).expect("dir");
    let cfg = serde_json::json!({
        "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "bias": "none",
        "target_modules": LoraTarget::ALL.iter().map(|t| t.module()).collect::<Vec<_>>(),
    });
    std::fs::write(dir.join("adapter_config.json"), cfg.to_string()).expect("config");
    let mut rng = SeqRng::new(seed);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for layer in 0..spec.num_layers {
        for t in LoraTarget::ALL {
            let (inp, out) = target_shape(spec, t);
            for (f, shape) in [("A", [r, inp]), ("B", [out, r])] {
                let n = shape[0] * shape[1];
                let data: Vec<u8> = (0..n)
                    .flat_map(|_| {
                        let u = (rng.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
                        ((u - 0.5) * 0.02).to_le_bytes()
                    })
                    .collect();
                let name = format!(
                    "base_model.model.model.layers.{layer}.{}.lora_{f}.weight",
                    t.path()
                );
                tensors.push((name, shape.to_vec(), data));
            }
        }
    }
    let views: Vec<(String, TensorView<'_>)> = tensors
        .iter()
        .map(|(n, s, d)| {
            (
                n.clone(),
                TensorView::new(Dtype::F32, s.clone(), d).expect("view"),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("adapter_model.safetensors"))
        .expect("write");
}

fn main() {
    let Some(path) = arbor_models::default_model_path().filter(|p| p.exists()) else {
        eprintln!("skipping: the default model is absent (run `arbor fetch-default`)");
        return;
    };
    let rounds = env_usize("ARBOR_BENCH_ROUNDS", 2);
    let threads = env_usize("ARBOR_BENCH_THREADS", 2);
    let rank = env_usize("ARBOR_BENCH_RANK", 16);
    let registry = Registry::builtin().expect("registry");
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto").expect("auto")(&Default::default())
            .expect("quant"),
        progress: None,
    };
    let m = load_model(&path, &registry, &opts).expect("model");
    let spec = m.model.spec().clone();
    let tmp = tempfile::tempdir().expect("tmp");
    let loras = LoraRegistry::new(backend.clone(), spec.clone(), LoraLimits::default(), None);
    let adapters: Vec<Arc<LoraAdapter>> = (0..8)
        .map(|i| {
            let dir = tmp.path().join(format!("a{i}"));
            write_adapter(&dir, &spec, rank, 100 + i as u64);
            loras.load(&format!("a{i}"), &dir).expect("load")
        })
        .collect();
    println!(
        "default model, {threads} threads, 16 concurrent x (64 in, 64 out), rank {rank}, {:.1} MiB per adapter",
        adapters[0].bytes() as f64 / (1u64 << 20) as f64
    );
    let mut rng = SeqRng::new(7);
    let prompts: Vec<Vec<u32>> = (0..16)
        .map(|_| {
            (0..64)
                .map(|_| (rng.next_u64() % 40000) as u32 + 100)
                .collect()
        })
        .collect();
    let configs = [0usize, 1, 4, 8];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    for _ in 0..rounds {
        for (ci, &k) in configs.iter().enumerate() {
            let runner =
                ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 512, DType::F32)
                    .expect("runner");
            let cache = registry.prefix_caches.get("none").expect("none")(&PrefixCacheOptions {
                page_size: 16,
                policy: registry.eviction_policies.get("lru").expect("lru")().expect("policy"),
            })
            .expect("cache");
            let parts = EngineParts::local(
                runner,
                cache,
                registry.samplers.get("standard").expect("s")().expect("sampler"),
                vec![],
                m.tokenizer.clone(),
                m.tokenizer.eos_token_ids.clone(),
            );
            let e = Engine::new(
                EngineConfig {
                    max_loras_per_batch: 9,
                    ..EngineConfig::default()
                },
                parts,
            )
            .expect("engine");
            let start = Instant::now();
            let streams: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let params = SamplingParams {
                        ignore_eos: true,
                        ..SamplingParams::greedy(64)
                    };
                    let mut r = GenerateRequest::new(p.clone(), params);
                    r.lora = (k > 0).then(|| adapters[i % k].clone());
                    e.submit(r).expect("submit")
                })
                .collect();
            let tokens: usize = streams
                .into_iter()
                .map(|s| {
                    s.collect_blocking()
                        .iter()
                        .map(|c| c.token_ids.len())
                        .sum::<usize>()
                })
                .sum();
            rates[ci].push(tokens as f64 / start.elapsed().as_secs_f64());
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let base = mean(&rates[0]);
    for (ci, &k) in configs.iter().enumerate() {
        let r = mean(&rates[ci]);
        println!(
            "{:>10}: {r:7.1} output tok/s ({:.2}x base) runs {:?}",
            if k == 0 {
                "base".to_string()
            } else {
                format!("{k} adapters")
            },
            r / base,
            rates[ci].iter().map(|x| x.round()).collect::<Vec<_>>()
        );
    }
}
