//! Scheduler-only cost per iteration: 256 requests decoding at once through the
//! real engine (admission, page accounting, radix cache, sampling, detokenizing,
//! streaming), with a zero-cost model stand-in (constant logits over a small
//! vocabulary) so only the scheduler's own work is timed. Benchmark only.
//!
//! Run: `cargo bench -p arbor-engine-core --bench scheduler` (`ARBOR_BENCH_STEPS`:
//! tokens per request, default 200; more for a profile).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::engine::{Engine, EngineConfig, EngineParts, GenerateRequest};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, DType, ForwardBatch, ForwardContext, ForwardOutput, Model, ModelSpec,
    PrefixCacheOptions, Registry, Result, SamplingParams, TokenDecoder,
};
use arbor_kv_radix as _;
use std::sync::Arc;
use std::time::Instant;

const VOCAB: usize = 64;

/// Returns constant logits without computing anything.
struct NullModel {
    spec: ModelSpec,
    backend: Arc<dyn Backend>,
}

impl Model for NullModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn forward(&self, batch: &ForwardBatch, _ctx: &ForwardContext<'_>) -> Result<ForwardOutput> {
        // Zero logits (a zero-filled allocation): every row's argmax is token 0.
        let rows = batch.logits_rows.len();
        Ok(ForwardOutput {
            logits: self.backend.alloc(DType::F32, &[rows, VOCAB])?,
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
    };
    for running in [64usize, 256] {
        let model = Arc::new(NullModel {
            spec: spec.clone(),
            backend: backend.clone(),
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
            Arc::new(Letters),
            vec![],
        );
        let cfg = EngineConfig {
            max_running_requests: running,
            ..Default::default()
        };
        let engine = Engine::new(cfg, parts).expect("engine");
        let steps: usize = std::env::var("ARBOR_BENCH_STEPS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(200);
        let params = SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(steps)
        };
        let t0 = Instant::now();
        let mut streams: Vec<_> = (0..running)
            .map(|i| {
                let prompt: Vec<u32> = (0..100).map(|j| ((i * 7 + j) % VOCAB) as u32).collect();
                engine
                    .submit(GenerateRequest::new(prompt, params.clone()))
                    .expect("submit")
            })
            .collect();
        let it0 = engine.stats().iterations;
        // Steady state: from when every request has its first token (the
        // prompts are admitted and prefilled) to the end.
        for s in &mut streams {
            s.blocking_next();
        }
        let (t1, it1) = (Instant::now(), engine.stats().iterations);
        for s in streams {
            s.collect_blocking();
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let iters = engine.stats().iterations - it0;
        let decode = t1.elapsed().as_secs_f64();
        let decode_iters = (engine.stats().iterations - it1).max(1);
        println!(
            "{running} running decodes: {iters} iterations in {:.2} s: {:.0} µs per iteration ({:.2} µs per request-step), {:.0} tokens/s of scheduler throughput; decode only: {:.0} µs per iteration over {decode_iters}",
            elapsed,
            elapsed / iters as f64 * 1e6,
            elapsed / (iters as f64 * running as f64) * 1e6,
            (running * steps) as f64 / elapsed,
            decode / decode_iters as f64 * 1e6,
        );
    }
}
