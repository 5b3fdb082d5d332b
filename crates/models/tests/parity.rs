//! Parity with Hugging Face transformers on the tiny seeded models in
//! tests/fixtures (written by tools/reference/make_fixtures.py): tokenization,
//! chat template rendering, last-position logits within 1e-4 × max|logit|,
//! and 32 greedy tokens, one at a time and as one batch.

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, SamplingParams};
use arbor_models::{ChatMessage, LoadedModel, load_model};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(name: &str, dtype: &str) -> Result<(LoadedModel, Value, Arc<dyn Backend>)> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get(dtype)?(&Default::default())?,
        progress: None,
    };
    let dir = fixture(name);
    let m = load_model(&dir, &registry, &opts)?;
    let text = std::fs::read_to_string(dir.join("reference.json"))?;
    Ok((m, serde_json::from_str(&text)?, backend))
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_f64)
                .map(|x| x as f32)
                .collect()
        })
        .unwrap_or_default()
}

fn greedy(
    m: &LoadedModel,
    backend: &Arc<dyn Backend>,
    prompts: &[Vec<u32>],
    page_size: usize,
) -> Result<Vec<Vec<u32>>> {
    let runner = ModelRunner::new(
        m.model.clone(),
        backend.clone(),
        None,
        page_size,
        512 / page_size,
        DType::F32,
    )?;
    let pool = runner.new_page_pool();
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(32)
        };
        prompts.len()
    ];
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let (outs, _) = generate_static(&runner, &pool, prompts, &params, &setup, &mut |_, _| {})?;
    assert_eq!(pool.free_pages(), pool.total_pages(), "pages leaked");
    Ok(outs.into_iter().map(|o| o.tokens).collect())
}

fn check_model(name: &str) -> Result<()> {
    let (m, r, backend) = load(name, "f32").with_context(|| format!("loading {name}"))?;
    let tok = &m.tokenizer;
    let prompts: Vec<Vec<u32>> = r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p["input_ids"]))
        .collect();
    // Tokenization and chat template rendering.
    for p in r["prompts"].as_array().context("prompts")? {
        let text = p["text"].as_str().context("text")?;
        assert_eq!(
            tok.encode(text, true)?,
            ids(&p["input_ids"]),
            "{name}: tokens of {text:?}"
        );
    }
    let chat = &r["chat"];
    let msgs: Vec<ChatMessage> = serde_json::from_value(chat["messages"].clone())?;
    let template = m.chat_template.as_ref().context("chat template")?;
    let rendered = template.render(
        &msgs,
        true,
        tok.bos_token.as_deref(),
        tok.eos_token.as_deref(),
        None,
    )?;
    assert_eq!(
        rendered,
        chat["rendered"].as_str().context("rendered")?,
        "{name}: chat text"
    );
    assert_eq!(
        tok.encode(&rendered, false)?,
        ids(&chat["input_ids"]),
        "{name}: chat ids"
    );

    // Last-position logits of each prompt.
    let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 4, 64, DType::F32)?;
    let pool = runner.new_page_pool();
    for (i, p) in r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .enumerate()
    {
        let want = floats(&p["last_logits"]);
        let pages = pool.alloc(pool.pages_for(prompts[i].len()))?;
        let got = runner.step(&[arbor_engine_core::runner::SeqStep {
            tokens: &prompts[i],
            prefix_len: 0,
            pages: pages.pages(),
            want_logits: true,
            state_slot: None,
        }])?;
        let got = &got[0];
        assert_eq!(got.len(), want.len());
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        println!("{name} prompt {i}: max |logit| {max:.3}, max abs error {err:.2e}");
        assert!(
            err <= 1e-4 * max,
            "{name} prompt {i}: logits error {err} > 1e-4 * {max}"
        );
    }
    assert_eq!(pool.free_pages(), pool.total_pages());

    // Greedy continuations: one at a time, then the three as one batch.
    let want: Vec<Vec<u32>> = r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p["greedy_ids"]))
        .collect();
    for (i, p) in prompts.iter().enumerate() {
        let got = greedy(&m, &backend, std::slice::from_ref(p), 16)?;
        assert_eq!(got[0], want[i], "{name} prompt {i}: greedy continuation");
    }
    let batch = greedy(&m, &backend, &prompts, 1)?;
    assert_eq!(batch, want, "{name}: batched greedy continuation");
    Ok(())
}

#[test]
fn tiny_llama_matches_transformers() -> Result<()> {
    check_model("tiny-llama")
}

#[test]
fn tiny_qwen2_matches_transformers() -> Result<()> {
    check_model("tiny-qwen2")
}

#[test]
fn tiny_qwen3_matches_transformers() -> Result<()> {
    check_model("tiny-qwen3")
}

#[test]
fn tiny_mistral_matches_transformers() -> Result<()> {
    check_model("tiny-mistral")
}

/// Mixture of experts (tools/reference/make_moe_fixtures.py): 3 layers, 8
/// experts top-2 renormalized, layer 1 dense (`mlp_only_layers`), 2 shards.
#[test]
fn tiny_qwen3_moe_matches_transformers() -> Result<()> {
    check_model("tiny-qwen3-moe")
}

/// 8 experts top-4 without renormalization, and a sigmoid-gated shared expert.
#[test]
fn tiny_qwen2_moe_matches_transformers() -> Result<()> {
    check_model("tiny-qwen2-moe")
}

/// 4 experts top-2 (`block_sparse_moe.experts.{e}.w1/w2/w3`).
#[test]
fn tiny_mixtral_matches_transformers() -> Result<()> {
    check_model("tiny-mixtral")
}

/// Latent attention without a query compression, YaRN rope (factor 4 over
/// 64 positions), a dense first layer, group-limited softmax routing and a
/// shared expert.
#[test]
fn tiny_deepseek_v2_matches_transformers() -> Result<()> {
    check_model("tiny-deepseek-v2")
}

/// Latent attention with a query compression (`q_lora_rank`), interleaved
/// rope, sigmoid routing with the correction bias and group limit, top-k
/// renormalized and scaled by 2.5.
#[test]
fn tiny_deepseek_v3_matches_transformers() -> Result<()> {
    check_model("tiny-deepseek-v3")
}

/// tiny-llama as older checkpoints ship it: sharded pytorch_model.bin files
/// written by torch.save (tools/reference/make_torch_bin_fixture.py).
#[test]
fn tiny_llama_from_pytorch_bin_matches_transformers() -> Result<()> {
    check_model("tiny-llama-bin")
}

#[test]
fn half_precision_weights_load_and_stay_close() -> Result<()> {
    for dtype in ["f16", "bf16"] {
        let (m, r, backend) = load("tiny-llama", dtype)?;
        let p = ids(&r["prompts"][1]["input_ids"]);
        let want = floats(&r["prompts"][1]["last_logits"]);
        let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 8, DType::F16)?;
        let pool = runner.new_page_pool();
        let pages = pool.alloc(pool.pages_for(p.len()))?;
        let got = runner.step(&[arbor_engine_core::runner::SeqStep {
            tokens: &p,
            prefix_len: 0,
            pages: pages.pages(),
            want_logits: true,
            state_slot: None,
        }])?;
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = got[0]
            .iter()
            .zip(&want)
            .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
        println!("{dtype} weights + f16 KV: max abs error {err:.3e} of max {max:.3}");
        assert!(err <= 0.05 * max, "{dtype}: error {err}");
        assert_eq!(m.model.spec().weight_dtype.name(), dtype);
    }
    Ok(())
}

/// A model loaded to run from input embeddings (a DeepSeek MTP layer's
/// one-layer model) reads no embedding table: the same weights less the
/// table's bytes, and no input embedding to share.
#[test]
fn a_model_run_from_embeddings_loads_no_embedding_table() -> Result<()> {
    use arbor_models::decoder::{DEEPSEEK_V3, DecoderArchitecture};
    use arbor_models::safetensors_source::SafetensorsSource;
    let (full, _, backend) = load("tiny-deepseek-v3", "auto")?;
    let table = full
        .model
        .input_embedding()
        .context("the whole model has its table")?;
    let dir = fixture("tiny-deepseek-v3");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend,
        quant: registry.quant_methods.get("auto")?(&Default::default())?,
        progress: None,
    };
    let src = SafetensorsSource::open(&dir)?;
    let from_embeds =
        DecoderArchitecture::new(DEEPSEEK_V3).load_from_embeds(&config, &src, &opts)?;
    use arbor_engine_core::Model;
    assert!(from_embeds.input_embedding().is_none());
    let table_bytes = table.dtype().bytes_for(table.numel())?;
    assert_eq!(table.shape(), [512, 64]);
    assert_eq!(
        full.model.spec().weight_bytes - from_embeds.spec().weight_bytes,
        table_bytes as u64
    );
    Ok(())
}
