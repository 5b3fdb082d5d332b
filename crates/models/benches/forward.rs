//! Forward-pass throughput on a SmolLM2-135M-shaped Llama with random weights
//! (issue 2's measurement): prefill tok/s for a 512-token prompt, decode tok/s
//! at batch 1 and 8, for f32, bf16 and f16 weights and for FP8 (the bf16
//! weights quantized at load, one scale per output channel), and batch-1
//! decode against the memory-bandwidth roofline measured in the same run.
//!
//! Run: `cargo bench -p arbor-models --bench forward` (ARBOR_BENCH_THREADS, default 2).

mod common;

use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{Backend, DType, LoadOptions, Registry};
use arbor_models::DecoderConfig;
use arbor_models::decoder::{ArchFlags, DecoderModel};
use arbor_models::random::RandomWeights;
use std::sync::Arc;

fn smollm2_config() -> DecoderConfig {
    let v = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": true
    });
    DecoderConfig::from_json(&v, "smollm2-135m").expect("valid config")
}

fn main() {
    let threads: usize = std::env::var("ARBOR_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let bw = arbor_backend_cpu::bandwidth::read_bandwidth_gbs(1 << 30, 5, threads);
    println!("memory read bandwidth, {threads} threads: {bw:.1} GB/s");
    let registry = Registry::builtin().expect("registry");
    let cfg = smollm2_config();
    println!(
        "| weights | prefill 512 tok/s | decode bs1 tok/s | decode bs8 tok/s | bs1 roofline | bs1 / roofline |"
    );
    println!("|---|---|---|---|---|---|");
    for (label, dtype, method) in [
        ("f32", DType::F32, "auto"),
        ("bf16", DType::BF16, "auto"),
        ("f16", DType::F16, "auto"),
        ("fp8", DType::BF16, "fp8"),
    ] {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
        let src = RandomWeights::new(
            &cfg,
            ArchFlags {
                qkv_bias: false,
                qk_norm: false,
                moe: None,
                mla: false,
            },
            dtype,
            1,
        )
        .expect("weights");
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: registry.quant_methods.get(method).expect("method")(&Default::default())
                .expect("quant"),
            progress: None,
        };
        let model = DecoderModel::load(
            cfg.clone(),
            None,
            ArchFlags {
                qkv_bias: false,
                qk_norm: false,
                moe: None,
                mla: false,
            },
            &src,
            &opts,
        )
        .expect("model");
        let bytes = arbor_engine_core::Model::spec(&model).weight_bytes;
        let common::Throughput {
            prefill,
            decode_bs1: d1,
            decode_bs8: d8,
        } = common::measure(model, backend, 49152);
        let roof = bw * 1e9 / bytes as f64;
        println!(
            "| {label} ({:.0} MB) | {:.0} | {d1:.1} | {d8:.1} | {roof:.1} | {:.0}% |",
            bytes as f64 / 1e6,
            prefill,
            100.0 * d1 / roof
        );
    }
}
