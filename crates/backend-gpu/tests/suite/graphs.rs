//! Decode graphs (CUDA graphs, HIP graphs): a small random Llama generates the same greedy
//! tokens with graphs on (padded to batch-size buckets) as with graphs off,
//! with last-position logits within 1e-3 of their scale (a padded GEMM may
//! take another cuBLAS kernel); decode steps are captured once per bucket and
//! then replayed; batches of 3 and 4 sequences share the bucket of 4. A
//! DeepSeek-shaped model (latent attention, per-head up-projections)
//! replays its bucket's graph the same way.

use crate::common::*;
use crate::vendor::GpuBackend;
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, SamplingParams};
use arbor_models::config::DecoderConfig;
use arbor_models::decoder::{ArchFlags, DEEPSEEK_V2, DecoderArchitecture, DecoderModel};
use arbor_models::random::{LatentShape, RandomWeights};
use std::sync::Arc;

fn tiny_runner(b: &Arc<GpuBackend>) -> ModelRunner {
    tiny_runner_of(b, false)
}

/// A 2-layer random Llama, or with `mla` a DeepSeek-V2-Lite-shaped model
/// (576-wide latent heads) of the same small hidden size.
fn tiny_runner_of(b: &Arc<GpuBackend>, mla: bool) -> ModelRunner {
    let registry = Registry::builtin().unwrap();
    let backend: Arc<dyn Backend> = b.clone();
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("auto").unwrap()(&Default::default()).unwrap(),
        progress: None,
    };
    if mla {
        let shape = LatentShape {
            hidden: 128,
            heads: 4,
            intermediate: 320,
            layers: 2,
            vocab: 512,
            q_lora_rank: None,
        };
        let weights = shape.weights(DType::BF16, 7).unwrap();
        let model = DecoderArchitecture::new(DEEPSEEK_V2)
            .load_model(&shape.config(), &weights, &opts)
            .unwrap();
        return ModelRunner::new(Arc::new(model), backend, None, 16, 64, DType::BF16).unwrap();
    }
    let cfg = DecoderConfig::from_json(
        &serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 128, "intermediate_size": 320, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0
        }),
        "config.json",
    )
    .unwrap();
    let flags = ArchFlags {
        qkv_bias: false,
        qk_norm: false,
        moe: None,
        mla: false,
    };
    let weights = RandomWeights::new(&cfg, flags, DType::BF16, 7).unwrap();
    let model = DecoderModel::load(cfg, None, flags, &weights, &opts).unwrap();
    ModelRunner::new(Arc::new(model), backend, None, 16, 64, DType::BF16).unwrap()
}

fn greedy(runner: &ModelRunner, prompts: &[Vec<u32>], n: usize) -> Vec<Vec<u32>> {
    let pool = runner.new_page_pool();
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(n)
        };
        prompts.len()
    ];
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let (outs, _) =
        generate_static(runner, &pool, prompts, &params, &setup, &mut |_, _| {}).unwrap();
    assert_eq!(pool.free_pages(), pool.total_pages());
    outs.into_iter().map(|o| o.tokens).collect()
}

/// Greedy tokens of the first `n` prompts for each `n` of `counts` (which
/// end with 3 and 4): the runner with graphs (on `g`) gives the eager
/// runner's, and 4 sequences replay the graph captured for 3 (bucket 4).
fn same_tokens_replaying_bucket_4(
    g: &GpuBackend,
    [graphed, eager]: [&ModelRunner; 2],
    prompts: &[Vec<u32>],
    counts: &[usize],
    tokens: usize,
) {
    let mut captures = Vec::new();
    for &n in counts {
        let got = greedy(graphed, &prompts[..n], tokens);
        let want = greedy(eager, &prompts[..n], tokens);
        assert_eq!(
            got, want,
            "greedy tokens of {n} sequences, graphs on vs off"
        );
        println!("{n} sequences: {:?}", g.graph_stats());
        captures.push(g.graph_stats().captures);
    }
    assert_eq!(
        captures[captures.len() - 1],
        captures[captures.len() - 2],
        "4 sequences should replay the graph captured for 3 (bucket 4)"
    );
}

#[test]
fn graphs_match_eager_decoding() {
    // Own instances: steps of other tests running on the shared device would
    // interleave with these and change the graph counters.
    let Some(g) = gpu_with(false) else { return };
    let Some(e) = gpu_with(true) else { return };
    let (rg, re) = (tiny_runner(&g), tiny_runner(&e));
    let mut rng = Rng::new(20);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..5 + 3 * i).map(|_| rng.below(512) as u32).collect())
        .collect();
    let before = g.graph_stats();
    same_tokens_replaying_bucket_4(&g, [&rg, &re], &prompts, &[1, 3, 4], 24);
    let after = g.graph_stats();
    assert!(
        after.replays > before.replays,
        "no graph was replayed: {after:?}"
    );
    assert_eq!(after.failures, 0, "graph capture failed: {after:?}");
    assert_eq!(e.graph_stats().replays, 0);

    // Logits of one decode step of 3 sequences (padded to 4).
    let pool_g = rg.new_page_pool();
    let pool_e = re.new_page_pool();
    let pages_g: Vec<_> = (0..3).map(|_| pool_g.alloc(2).unwrap()).collect();
    let pages_e: Vec<_> = (0..3).map(|_| pool_e.alloc(2).unwrap()).collect();
    let step = |r: &ModelRunner, pages: &[arbor_engine_core::kv::PageSet]| {
        let pre: Vec<SeqStep<'_>> = (0..3)
            .map(|i| SeqStep {
                tokens: &prompts[i],
                prefix_len: 0,
                pages: pages[i].pages(),
                want_logits: false,
                state_slot: None,
            })
            .collect();
        r.step(&pre).unwrap();
        let toks = [[1u32], [2], [3]];
        let dec: Vec<SeqStep<'_>> = (0..3)
            .map(|i| SeqStep {
                tokens: &toks[i],
                prefix_len: prompts[i].len(),
                pages: pages[i].pages(),
                want_logits: true,
                state_slot: None,
            })
            .collect();
        r.step(&dec).unwrap()
    };
    let (lg, le) = (step(&rg, &pages_g), step(&re, &pages_e));
    for (a, b) in lg.iter().zip(&le) {
        assert_close("decode logits, graph vs eager", a, b, 1e-3);
    }
}

/// Latent attention under graphs: its per-head products and column moves
/// run padded with the rest of the step, so 4 sequences replay the graph
/// captured for 3 (bucket 4), and greedy tokens equal the eager ones.
#[test]
fn latent_attention_replays_its_graphs() {
    let Some(g) = gpu_with(false) else { return };
    let Some(e) = gpu_with(true) else { return };
    let b: &dyn Backend = &*g;
    let max = b.attention(None).unwrap().capabilities().max_head_dim;
    if max.is_some_and(|m| m < 576) {
        println!("skipped: this device's attention takes no 576-wide heads");
        return;
    }
    let (rg, re) = (tiny_runner_of(&g, true), tiny_runner_of(&e, true));
    let mut rng = Rng::new(21);
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|i| (0..5 + 3 * i).map(|_| rng.below(512) as u32).collect())
        .collect();
    same_tokens_replaying_bucket_4(&g, [&rg, &re], &prompts, &[3, 4], 6);
    let stats = g.graph_stats();
    assert!(stats.replays > 0 && stats.failures == 0, "{stats:?}");
}
