//! Scheduler-only cost per iteration: 256 requests decoding at once through the
//! real engine (admission, page accounting, radix cache, sampling, detokenizing,
//! streaming), with a zero-cost model stand-in (constant logits over a small
//! vocabulary) so only the scheduler's own work is timed. Benchmark only.
//!
//! Two detokenizers: a trivial one (a letter per id) and a real byte-level
//! BPE tokenizer (the tiny-llama fixture's `tokenizer.json`, through the
//! `tokenizers` crate), where decoding on the scheduler thread would cost
//! what it costs in serving.
//!
//! Run: `cargo bench -p arbor-engine-core --bench scheduler` (`ARBOR_BENCH_STEPS`:
//! tokens per request, default 200, at most about 400 (the KV pool holds 256
//! requests of 100 + 400 tokens); `ARBOR_BENCH_REPEAT`: runs per
//! configuration, default 3, whose median is printed; `ARBOR_BENCH_ONLY`:
//! comma-separated words a run must all match among its readers
//! (`blocking`, `async`), running count (`64`, `256`) and decoder
//! (`letters`, `tokenizer`), e.g. `blocking,256,letters`).
//!
//! Besides the wall-clock iteration (the goal's figure), each run prints the
//! scheduler thread's own time on a CPU per iteration, from Linux's
//! `/proc/self/task/*/schedstat` (prompts' prefill steps included): the
//! figure that a host busy with other work (the readers, other tenants)
//! disturbs least.

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, DType, ForwardBatch, ForwardContext, ForwardOutput, Model, ModelSpec,
    PrefixCacheOptions, Registry, Result, SamplingParams, TokenDecoder,
};
use arbor_kv_radix as _;
use arbor_models::TextTokenizer;
use std::path::Path;
use std::sync::Arc;

const VOCAB: usize = 64;

/// Returns constant logits without computing anything: rows of one zero
/// tensor allocated up front (allocating and zeroing the logits each step
/// would be the stand-in's cost, not the scheduler's).
struct NullModel {
    spec: ModelSpec,
    backend: Arc<dyn Backend>,
    zeros: arbor_engine_core::Tensor,
}

impl Model for NullModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn forward(&self, batch: &ForwardBatch, _ctx: &ForwardContext<'_>) -> Result<ForwardOutput> {
        // Zero logits: every row's argmax is token 0.
        let rows = batch.logits_rows.len();
        let logits = if rows <= self.zeros.rows() {
            self.zeros.narrow(0, rows)?
        } else {
            self.backend.alloc(DType::F32, &[rows, VOCAB])?
        };
        Ok(ForwardOutput {
            logits,
            hidden: Vec::new(),
        })
    }
}

struct Letters;
impl TokenDecoder for Letters {
    fn decode(&self, ids: &[u32], _: bool) -> Result<String> {
        Ok(ids
            .iter()
            .map(|&i| (b'a' + (i % 26) as u8) as char)
            .collect())
    }
}

fn main() {
    let registry = Registry::builtin().expect("registry");
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).expect("cpu"));
    let spec = ModelSpec {
        architecture: "null".into(),
        num_layers: 1,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 2,
        hidden_size: 2,
        intermediate_size: 2,
        vocab_size: VOCAB,
        max_position_embeddings: 1 << 16,
        sliding_window: None,
        weight_dtype: DType::F32,
        weight_bytes: 0,
        quantization: "f32".into(),
        checkpoint_kv_dtype: None,
        kv_values_in_keys: false,
        state: None,
    };
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture.join("config.json")).expect("fixture config"),
    )
    .expect("config json");
    let bpe: Arc<dyn TokenDecoder> =
        Arc::new(TextTokenizer::from_dir(&fixture, &config).expect("fixture tokenizer"));
    let letters: Arc<dyn TokenDecoder> = Arc::new(Letters);
    // (running, decoder, readers): blocking readers take the streams one
    // after another (so most chunks merge unread); async readers are one
    // task per stream on a tokio runtime, as the HTTP server reads them
    // (every chunk wakes its task).
    let runs = [
        (64usize, "letters", &letters, Readers::Blocking),
        (256, "letters", &letters, Readers::Blocking),
        (256, "tokenizer", &bpe, Readers::Blocking),
        (256, "letters", &letters, Readers::Async),
    ];
    let steps: usize = std::env::var("ARBOR_BENCH_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200);
    let repeat: usize = std::env::var("ARBOR_BENCH_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let only = std::env::var("ARBOR_BENCH_ONLY").unwrap_or_default();
    for (running, decoder_name, decoder, readers) in runs {
        let kind = match readers {
            Readers::Blocking => "blocking",
            Readers::Async => "async",
        };
        let tags = [kind, decoder_name, &running.to_string()];
        if !only
            .split(',')
            .filter(|w| !w.is_empty())
            .all(|w| tags.contains(&w))
        {
            continue;
        }
        let decoder_name = match readers {
            Readers::Blocking => decoder_name.to_string(),
            Readers::Async => format!("{decoder_name}, async readers"),
        };
        let mut decode_us = Vec::with_capacity(repeat);
        for _ in 0..repeat {
            let (iters, first, last, on_cpu) =
                run_once(&registry, &backend, &spec, decoder, running, steps, readers);
            let decode_iters = steps - 1;
            let us = (last - first) / decode_iters as f64 * 1e6;
            println!(
                "{running} running decodes, {decoder_name}: {iters} iterations in {:.3} s: {:.0} µs per iteration ({:.2} µs per request-step); decode only: {us:.0} µs per iteration over {decode_iters}",
                last,
                last / iters as f64 * 1e6,
                last / (iters as f64 * running as f64) * 1e6,
            );
            if let Some(ns) = on_cpu {
                println!(
                    "{running} running decodes, {decoder_name}: scheduler thread on a CPU {:.0} µs per iteration",
                    ns as f64 / iters as f64 / 1e3
                );
            }
            decode_us.push(us);
        }
        decode_us.sort_by(f64::total_cmp);
        println!(
            "{running} running decodes, {decoder_name}: median decode-only iteration {:.0} µs (best {:.0}) over {repeat} runs",
            decode_us[repeat / 2],
            decode_us[0]
        );
    }
}

/// How the streams are read.
#[derive(Clone, Copy)]
enum Readers {
    /// One thread reads the streams one after another.
    Blocking,
    /// One tokio task per stream (two worker threads).
    Async,
}

/// One engine run: `running` requests of `steps` tokens each; returns the
/// iterations, by the scheduler's clock when every request had its first
/// token and when the last one ended (seconds), and the nanoseconds the
/// scheduler thread ran on a CPU meanwhile (`None` where Linux's schedstat
/// is not readable).
fn run_once(
    registry: &Registry,
    backend: &Arc<dyn Backend>,
    spec: &ModelSpec,
    decoder: &Arc<dyn TokenDecoder>,
    running: usize,
    steps: usize,
    readers: Readers,
) -> (u64, f64, f64, Option<u64>) {
    let model = Arc::new(NullModel {
        spec: spec.clone(),
        backend: backend.clone(),
        zeros: backend.alloc(DType::F32, &[1024, VOCAB]).expect("logits"),
    });
    let runner =
        ModelRunner::new(model, backend.clone(), None, 16, 8192, DType::F32).expect("runner");
    let policy = registry.eviction_policies.get("lru").expect("lru")().expect("policy");
    let cache = registry.prefix_caches.get("radix").expect("radix")(&PrefixCacheOptions {
        page_size: 16,
        policy,
    })
    .expect("cache");
    let parts = EngineParts::local(
        runner,
        cache,
        registry.samplers.get("standard").expect("s")().expect("sampler"),
        vec![],
        decoder.clone(),
        vec![],
    );
    let cfg = EngineConfig {
        max_running_requests: running,
        ..Default::default()
    };
    let engine = Engine::new(cfg, parts).expect("engine");
    let params = SamplingParams {
        ignore_eos: true,
        ..SamplingParams::greedy(steps)
    };
    let streams: Vec<_> = (0..running)
        .map(|i| {
            let prompt: Vec<u32> = (0..100).map(|j| ((i * 7 + j) % VOCAB) as u32).collect();
            engine
                .submit(GenerateRequest::new(prompt, params.clone()))
                .expect("submit")
        })
        .collect();
    let it0 = engine.stats().iterations;
    let cpu0 = scheduler_cpu_ns();
    // Timed by the scheduler's clock (the chunks' meta), not the
    // reader's, which may lag (it makes the text of most requests).
    // Steady state: from when every request has its first token (the
    // prompts are admitted and prefilled) to when the last one ends;
    // every request gets a token per iteration then.
    let metas: Vec<arbor_engine_core::engine::OutputMeta> = match readers {
        Readers::Blocking => streams
            .into_iter()
            .map(|s| {
                let chunks = s.collect_blocking();
                chunks.last().expect("a final chunk").meta.clone()
            })
            .collect(),
        Readers::Async => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .build()
                .expect("runtime");
            rt.block_on(async {
                let tasks: Vec<_> = streams
                    .into_iter()
                    .map(|mut s| {
                        tokio::spawn(async move {
                            let mut meta = None;
                            while let Some(c) = s.next().await {
                                meta = Some(c.meta);
                            }
                            meta.expect("a final chunk")
                        })
                    })
                    .collect();
                let mut metas = Vec::with_capacity(tasks.len());
                for t in tasks {
                    metas.push(t.await.expect("reader task"));
                }
                metas
            })
        }
    };
    let (mut first, mut last) = (0f64, 0f64);
    for meta in &metas {
        first = first.max(meta.ttft.unwrap_or(0.0));
        last = last.max(meta.elapsed);
    }
    let on_cpu = scheduler_cpu_ns()
        .zip(cpu0)
        .map(|(b, a)| b.saturating_sub(a));
    (engine.stats().iterations - it0, first, last, on_cpu)
}

/// Nanoseconds the newest `arbor-scheduler` thread of this process has run
/// on a CPU (the first field of its `schedstat`); `None` off Linux or when
/// schedstat is not readable.
fn scheduler_cpu_ns() -> Option<u64> {
    let mut newest: Option<(u64, u64)> = None;
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim() != "arbor-scheduler" {
            continue;
        }
        let Ok(tid) = entry.file_name().to_string_lossy().parse::<u64>() else {
            continue;
        };
        let ran = std::fs::read_to_string(entry.path().join("schedstat"))
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(ns) = ran
            && newest.is_none_or(|(t, _)| tid > t)
        {
            newest = Some((tid, ns));
        }
    }
    newest.map(|(_, ns)| ns)
}
