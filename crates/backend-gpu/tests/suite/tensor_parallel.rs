//! Tensor parallelism on the device: two ranks, each a backend instance of
//! its own on the same device (what `--gpu-id-step 0` lays out), each
//! holding its shard of the weights and its KV heads, meeting in the
//! host-staged collectives of engine-core's `LocalGroup` (every all-reduce
//! and gather downloads the ranks' partial tensors, sums them in rank order
//! and writes the result back to every rank). Greedy continuations of
//! tiny-llama (a vocab-parallel LM head: logits gathered) and tiny-qwen3
//! (tied embeddings, q/k norms) equal transformers' (reference.json), with
//! a chunked prefill and decode steps over each rank's paged KV cache.
//! CUDA graphs are off here: a collective's host round trip inside a
//! captured step is not validated yet.

use crate::common::*;
use crate::parity::{fixture, ids};
use anyhow::{Context, Result};
use arbor_engine_core::attention::BatchLayout;
use arbor_engine_core::comm::{Communicator, LocalGroup};
use arbor_engine_core::model::ForwardBatch;
use arbor_engine_core::moe::ExpertSharding;
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, ShardSpec, TpRunners};
use arbor_models::load_model_shard;
use serde_json::Value;
use std::sync::Arc;

/// Tokens per KV page, and pages per rank (enough for a prompt and its continuation).
const PAGE: usize = 16;
const PAGES: usize = 8;
/// Longest prefill chunk: prompts run as several chunks over cached KV.
const CHUNK: usize = 5;

/// Two ranks of `name` on two instances of the device; `None` when it is absent.
fn group(name: &str) -> Result<Option<TpRunners>> {
    let (Some(a), Some(b)) = (gpu_with(true), gpu_with(true)) else {
        return Ok(None);
    };
    let backends: Vec<Arc<dyn Backend>> = vec![a, b];
    let comms: Vec<Arc<dyn Communicator>> = LocalGroup::new(2)?
        .ranks(&backends)?
        .into_iter()
        .map(|c| c as Arc<dyn Communicator>)
        .collect();
    let registry = Registry::builtin()?;
    let mut runners = Vec::new();
    for (b, c) in backends.iter().zip(&comms) {
        let opts = LoadOptions {
            backend: b.clone(),
            quant: registry.quant_methods.get("f32")?(&Default::default())?,
            progress: None,
        };
        let shard = ShardSpec {
            comm: c.clone(),
            experts: ExpertSharding::Split,
            attention: Default::default(),
        };
        let m = load_model_shard(&fixture(name), &registry, &opts, &shard)
            .with_context(|| format!("loading a shard of {name} on {}", crate::vendor::NAME))?;
        let r = ModelRunner::new(m.model.clone(), b.clone(), None, PAGE, PAGES, DType::F32)?;
        runners.push(Arc::new(r));
    }
    Ok(Some(TpRunners::new(runners, comms)?))
}

/// `n` greedy tokens after `prompt`: the prompt in chunks of [`CHUNK`],
/// then one token a step, every forward on both ranks.
fn greedy(g: &TpRunners, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let pages: Vec<u32> = (0..PAGES as u32).collect();
    let mut seq = prompt.to_vec();
    let mut done = 0;
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let end = (done + CHUNK).min(seq.len());
        let mut layout = BatchLayout::new(PAGE);
        layout.push_seq(done, end - done, &pages)?;
        let batch = ForwardBatch {
            input_ids: seq[done..end].to_vec(),
            positions: (done..end).map(|p| p as u32).collect(),
            layout: Arc::new(layout),
            logits_rows: vec![(end - done - 1) as u32],
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let logits = g
            .first()
            .backend()
            .download_f32(&g.forward(&batch)?.logits)?;
        done = end;
        if done == seq.len() {
            let best = logits
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                );
            out.push(best.0 as u32);
            seq.push(best.0 as u32);
        }
    }
    Ok(out)
}

fn check(name: &str) -> Result<()> {
    let Some(g) = group(name)? else { return Ok(()) };
    let text = std::fs::read_to_string(fixture(name).join("reference.json"))?;
    let reference: Value = serde_json::from_str(&text)?;
    for (i, p) in reference["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .enumerate()
    {
        let want = ids(&p["greedy_ids"]);
        let got = greedy(&g, &ids(&p["input_ids"]), want.len())?;
        assert_eq!(
            got,
            want,
            "{name} prompt {i}: greedy tokens over two {} ranks vs transformers",
            crate::vendor::NAME
        );
    }
    Ok(())
}

#[test]
fn two_ranks_on_one_device_continue_tiny_llama_as_transformers() -> Result<()> {
    check("tiny-llama")
}

#[test]
fn two_ranks_on_one_device_continue_tiny_qwen3_as_transformers() -> Result<()> {
    check("tiny-qwen3")
}
