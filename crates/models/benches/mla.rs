//! Latent attention's throughput and weight bytes on a DeepSeek-V2-Lite-
//! shaped model with random weights: its attention (hidden 2048, 16 heads,
//! kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, no query
//! compression, YaRN as its config) over 4 layers with dense MLPs of 1408
//! (one of its experts' width) and a 4,096-token vocabulary, so that the
//! attention's projections are most of the work. Prints prefill 512 tok/s,
//! decode tok/s at batch 1 and 8 (512 tokens of context each), and the
//! weight bytes, for bf16 weights, for FP8 (the bf16 weights quantized
//! at load), and for random AutoAWQ INT4 and ModelOpt NVFP4 checkpoints of
//! the same shape (`RandomWeights::quantized`).
//!
//! Run: `cargo bench -p arbor-models --bench mla` (ARBOR_BENCH_THREADS,
//! default 2).

mod common;

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{Backend, DType, LoadOptions, Model, QuantInit, Registry};
use arbor_models::decoder::{DEEPSEEK_V2, DecoderArchitecture};
use arbor_models::random::{LatentShape, RandomQuant};
use std::sync::Arc;

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
    let formats = [
        ("bf16", "auto", None),
        ("fp8", "fp8", None),
        ("awq", "awq", Some(RandomQuant::Awq { group: 128 })),
        ("nvfp4", "modelopt", Some(RandomQuant::Nvfp4)),
    ];
    for (label, method, format) in formats {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
        let mut src = SHAPE.weights(DType::BF16, 1).expect("weights");
        let mut json = json.clone();
        if let Some(q) = format {
            src = src.quantized(q).expect("quantized weights");
            json["quantization_config"] = q.config();
        }
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: registry.quant_methods.get(method).expect("method")(&QuantInit {
                checkpoint: json.get("quantization_config").cloned(),
                base: None,
            })
            .expect("quant"),
            progress: None,
        };
        let model = DecoderArchitecture::new(DEEPSEEK_V2)
            .load_model(&json, &src, &opts)
            .expect("model");
        let bytes = model.spec().weight_bytes;
        let common::Throughput {
            prefill,
            decode_bs1: d1,
            decode_bs8: d8,
        } = common::measure(model, backend, SHAPE.vocab as u32);
        println!(
            "| {label} | {:.0} | {:.0} | {d1:.1} | {d8:.1} |",
            bytes as f64 / 1e6,
            prefill,
        );
    }
}
