//! The LoRA check every backend's suite runs (included with `#[path]`): one
//! forward of three sequences — the base model, the `attn` adapter and the
//! `all` adapter of tests/fixtures/lora on the tiny Llama — gives each
//! sequence's last-position logits within `tol` × max|logit| of the PEFT
//! reference (the adapter segments are narrowed views of the batch, so
//! offsets into device buffers are exercised).
#![allow(dead_code)]

use anyhow::{Context, Result, ensure};
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{
    Backend, BatchLayout, DType, ForwardBatch, LoadOptions, LoraSegment, Registry,
};
use arbor_lora::{LoraLimits, load_adapter};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

/// The repository's tests/fixtures.
pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A JSON list of token ids.
pub fn ids(x: &Value) -> Vec<u32> {
    x.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default()
}

fn first_prompt(adapter: &str) -> Result<(Vec<u32>, Vec<f32>, Vec<u32>)> {
    let text =
        std::fs::read_to_string(fixtures().join("lora").join(adapter).join("reference.json"))?;
    let v: Value = serde_json::from_str(&text)?;
    let p = &v["prompts"][0];
    let logits = p["last_logits"]
        .as_array()
        .context("last_logits")?
        .iter()
        .filter_map(Value::as_f64)
        .map(|x| x as f32)
        .collect();
    Ok((ids(&p["input_ids"]), logits, ids(&p["base_greedy_ids"])))
}

/// See the module doc.
pub fn lora_batch_matches_peft(backend: Arc<dyn Backend>, tol: f32) -> Result<()> {
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let model = arbor_models::load_model(&fixtures().join("tiny-llama"), &registry, &opts)?;
    let spec = model.model.spec().clone();
    let load = |name: &str| -> Result<Arc<arbor_engine_core::LoraAdapter>> {
        Ok(Arc::new(load_adapter(
            name,
            &fixtures().join("lora").join(name),
            &spec,
            &*backend,
            &LoraLimits::default(),
        )?))
    };
    let (attn, all) = (load("tiny-llama-attn")?, load("tiny-llama-all")?);
    let (p_attn, want_attn, base_first) = first_prompt("tiny-llama-attn")?;
    let (p_all, want_all, _) = first_prompt("tiny-llama-all")?;
    let runner = ModelRunner::new(
        model.model.clone(),
        backend.clone(),
        None,
        16,
        16,
        DType::F32,
    )?;
    let mut layout = BatchLayout::new(16);
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    let mut rows = Vec::new();
    let mut lora = Vec::new();
    for (i, (p, a)) in [
        (&p_attn, None),
        (&p_attn, Some(&attn)),
        (&p_all, Some(&all)),
    ]
    .into_iter()
    .enumerate()
    {
        let start = ids.len();
        let pages: Vec<u32> = (0..p.len().div_ceil(16) as u32)
            .map(|k| i as u32 * 4 + k)
            .collect();
        layout.push_seq(0, p.len(), &pages)?;
        ids.extend_from_slice(p);
        positions.extend(0..p.len() as u32);
        rows.push((ids.len() - 1) as u32);
        if let Some(a) = a {
            lora.push(LoraSegment {
                adapter: a.clone(),
                rows: start..ids.len(),
            });
        }
    }
    let batch = ForwardBatch {
        input_ids: ids,
        positions,
        layout: Arc::new(layout),
        logits_rows: rows,
        hidden_layers: Vec::new(),
        lora,
        exit_after: None,
        hidden_at_every_row: false,
    };
    let logits = backend.download_f32(&runner.forward(&batch)?.logits)?;
    let vocab = spec.vocab_size;
    let close = |got: &[f32], want: &[f32], what: &str| -> Result<()> {
        let max = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        let diff = got
            .iter()
            .zip(want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        ensure!(
            diff <= tol * max,
            "{what}: logits differ by {diff} (max {max})"
        );
        Ok(())
    };
    close(&logits[vocab..2 * vocab], &want_attn, "attn")?;
    close(&logits[2 * vocab..], &want_all, "all")?;
    // The base row is the model without adapters: its argmax is the base's first greedy token.
    let base = &logits[..vocab];
    let best = arbor_engine_core::sampling::argmax(base);
    ensure!(
        Some(&best) == base_first.first(),
        "base row: argmax {best}, want {base_first:?}"
    );
    Ok(())
}
