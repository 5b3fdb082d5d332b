//! Prefill and batch-1 decode speed on the default model (SmolLM2-135M-Instruct
//! Q4_1 GGUF), printed as one JSON line; tools/llamacpp/bench_compare.py runs
//! it alternately with llama.cpp on the same file and prints the ratios.
//!
//! Run: `cargo bench -p arbor-models --bench default_model`
//! (ARBOR_BENCH_THREADS, default 2; ARBOR_DEFAULT_GGUF overrides the file).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{Backend, DType, LoadOptions, Registry};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let Some(path) = arbor_gguf::default_model_path().filter(|p| p.exists()) else {
        println!("skipping: the default model is absent (run `arbor fetch-default`)");
        return;
    };
    let threads: usize = std::env::var("ARBOR_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let registry = Registry::builtin().expect("registry");
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto").expect("auto")().expect("quant"),
        progress: None,
    };
    let m = arbor_models::load_model(&path, &registry, &opts).expect("model");
    let bytes = m.model.spec().weight_bytes;
    let runner =
        ModelRunner::new(m.model.clone(), backend, None, 16, 48, DType::F16).expect("runner");
    let pages: Vec<u32> = (0..48).collect();
    let prompt: Vec<u32> = (0..512u32).map(|i| 200 + (i * 7919) % 40000).collect();
    let mut prefill = f64::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        runner
            .step(&[SeqStep {
                tokens: &prompt,
                prefix_len: 0,
                pages: &pages[..32],
                want_logits: true,
            }])
            .expect("prefill");
        prefill = prefill.min(t.elapsed().as_secs_f64());
    }
    // Decode 128 tokens after a 16-token prompt, best of 3.
    let mut decode = f64::MAX;
    let steps = 128;
    for _ in 0..3 {
        runner
            .step(&[SeqStep {
                tokens: &prompt[..16],
                prefix_len: 0,
                pages: &pages[..16],
                want_logits: true,
            }])
            .expect("prompt");
        let t = Instant::now();
        for i in 0..steps {
            runner
                .step(&[SeqStep {
                    tokens: &prompt[16 + i..17 + i],
                    prefix_len: 16 + i,
                    pages: &pages[..16],
                    want_logits: true,
                }])
                .expect("decode");
        }
        decode = decode.min(t.elapsed().as_secs_f64());
    }
    println!(
        "{{\"engine\": \"arbor\", \"threads\": {threads}, \"prefill_tok_s\": {:.1}, \"decode_tok_s\": {:.1}, \"weight_bytes\": {bytes}}}",
        512.0 / prefill,
        steps as f64 / decode
    );
}
