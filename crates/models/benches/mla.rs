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
use arbor_models::DecoderConfig;
use arbor_models::decoder::{DEEPSEEK_V2, DecoderArchitecture};
use arbor_models::mla::MlaConfig;
use arbor_models::random::RandomWeights;
use std::sync::Arc;
use std::time::Instant;

const LAYERS: usize = 4;
const VOCAB: usize = 4096;

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
        "intermediate_size": 1408, "num_hidden_layers": LAYERS, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": VOCAB, "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "q_lora_rank": null, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
        "n_shared_experts": 2, "first_k_dense_replace": LAYERS, "moe_layer_freq": 1,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": false,
        "routed_scaling_factor": 1.0, "scoring_func": "softmax"
    })
}

fn main() {
    let threads: usize = std::env::var("ARBOR_BENCH_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let registry = Registry::builtin().expect("registry");
    let json = config();
    let cfg = DecoderConfig::from_json(&json, "config.json").expect("config");
    let mla = MlaConfig::from_json(&json, "config.json", false).expect("mla config");
    println!("DeepSeek-V2-Lite attention, {LAYERS} layers, {threads} threads");
    println!("| weights | weight MB | prefill 512 tok/s | decode bs1 tok/s | decode bs8 tok/s |");
    println!("|---|---|---|---|---|");
    for (label, method) in [("bf16", "auto"), ("fp8", "fp8")] {
        let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(threads).expect("cpu"));
        let src = RandomWeights::new(&cfg, DEEPSEEK_V2, DType::BF16, 1)
            .expect("weights")
            .with_mla(&cfg, &mla);
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
        let prompt: Vec<u32> = (0..512u32).map(|i| (i * 7919) % VOCAB as u32).collect();
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
