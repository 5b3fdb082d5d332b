//! Latent attention's throughput and weight bytes on a DeepSeek-V2-Lite-
//! shaped model with random weights: its attention (hidden 2048, 16 heads,
//! kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, no query
//! compression, YaRN as its config) over 4 layers with dense MLPs of 1408
//! (one of its experts' width) and a 4,096-token vocabulary, so that the
//! attention's projections are most of the work. Prints prefill 512 tok/s,
//! decode tok/s at batch 1 and 8 (512 tokens of context each), and the
//! weight bytes, for bf16 weights and for FP8 (the bf16 weights quantized
//! at load).
//!
//! Run: `cargo bench -p arbor-models --bench mla` (ARBOR_BENCH_THREADS,
//! default 2).

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{Backend, DType, LoadOptions, Model, Registry};
use arbor_models::decoder::{DEEPSEEK_V2, DecoderArchitecture};
use arbor_models::random::LatentShape;
use std::sync::Arc;
use std::time::Instant;

const SHAPE: LatentShape = LatentShape {
    hidden: 2048,
    heads: 16,
    intermediate: 1408,
    layers: 4,
    vocab: 4096,
    q_lora_rank: None,
};

fn main() {
    let threads: usize = std::env::var("ARBOR_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let registry = Registry::builtin().expect("registry");
    let json = SHAPE.config();
    println!(
        "DeepSeek-V2-Lite attention, {} layers, {threads} threads",
        SHAPE.layers
    );
    println!("| weights | weight MB | prefill 512 tok/s | decode bs1 tok/s | decode bs8 tok/s |");
    println!("|---|---|---|---|---|");
    for (label, method) in [("bf16", "auto"), ("fp8", "fp8")] {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
        let src = SHAPE.weights(DType::BF16, 1).expect("weights");
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: registry.quant_methods.get(method).expect("method")(&Default::default())
                .expect("quant"),
            progress: None,
        };
        let model = DecoderArchitecture::new(DEEPSEEK_V2)
            .load_model(&json, &src, &opts)
            .expect("model");
        let bytes = model.spec().weight_bytes;
        let runner =
            ModelRunner::new(Arc::new(model), backend, None, 16, 400, DType::F32).expect("runner");
        let pages: Vec<u32> = (0..400).collect();
        let prompt: Vec<u32> = (0..512u32)
            .map(|i| (i * 7919) % SHAPE.vocab as u32)
            .collect();
        // Prefill: best of 3.
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
        // Decode at batch b: each sequence has 512 tokens of context.
        let decode = |b: usize| -> f64 {
            for s in 0..b {
                runner
                    .step(&[SeqStep {
                        tokens: &prompt,
                        prefix_len: 0,
                        pages: &pages[s * 40..s * 40 + 32],
                        want_logits: false,
                    }])
                    .expect("fill");
            }
            let steps = 16;
            let toks = [[5u32]; 8];
            let t = Instant::now();
            for i in 0..steps {
                let seqs: Vec<SeqStep<'_>> = (0..b)
                    .map(|s| SeqStep {
                        tokens: &toks[s],
                        prefix_len: 512 + i,
                        pages: &pages[s * 40..s * 40 + 40],
                        want_logits: true,
                    })
                    .collect();
                runner.step(&seqs).expect("decode");
            }
            (steps * b) as f64 / t.elapsed().as_secs_f64()
        };
        let d1 = decode(1);
        let d8 = decode(8);
        println!(
            "| {label} | {:.0} | {:.0} | {d1:.1} | {d8:.1} |",
            bytes as f64 / 1e6,
            512.0 / prefill,
        );
    }
}
