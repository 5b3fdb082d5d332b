//! Hidden states out of `Model::forward` (for EAGLE/MTP drafters), checked
//! from the checkpoint itself: on the tiny Llama, the residual stream after
//! the last layer, RMS-normed with `model.norm.weight` and multiplied by
//! `lm_head.weight` on the host (a numpy-style f32 forward of the published
//! definition), must give the model's logits; the final normed state asked
//! for directly must equal the host-normed one; an earlier layer's state
//! must differ from the last; a layer past the model is refused.
#![allow(clippy::unwrap_used)]

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::ModelRunner;
use arbor_engine_core::{Backend, BatchLayout, DType, ForwardBatch, LoadOptions, Registry};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama")
}

/// An f32 tensor of the checkpoint by name, from whichever shard holds it.
fn tensor(name: &str) -> Result<Vec<f32>> {
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        let bytes = std::fs::read(fixture().join(shard))?;
        let st = safetensors::SafeTensors::deserialize(&bytes)?;
        if let Ok(t) = st.tensor(name) {
            anyhow::ensure!(t.dtype() == safetensors::Dtype::F32, "{name} is not f32");
            return Ok(t
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect());
        }
    }
    anyhow::bail!("{name} is in no shard")
}

#[test]
fn final_hidden_state_gives_the_logits() -> Result<()> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get("f32")?(&Default::default())?,
        progress: None,
    };
    let m = arbor_models::load_model(&fixture(), &registry, &opts)?;
    let spec = m.model.spec().clone();
    let (h, vocab, layers) = (spec.hidden_size, spec.vocab_size, spec.num_layers);
    let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 8, DType::F32)?;
    let ids: Vec<u32> = vec![5, 77, 123, 9, 300, 41, 2];
    let mut layout = BatchLayout::new(16);
    layout.push_seq(0, ids.len(), &[0])?;
    let batch = ForwardBatch {
        positions: (0..ids.len() as u32).collect(),
        input_ids: ids.clone(),
        layout: Arc::new(layout),
        logits_rows: vec![2, 6],
        hidden_layers: vec![layers - 1, layers, 0],
        lora: Vec::new(),
        exit_after: None,
        hidden_at_every_row: false,
    };
    let out = runner.forward(&batch)?;
    let logits = backend.download_f32(&out.logits)?;
    let hidden: Vec<Vec<f32>> = out
        .hidden
        .iter()
        .map(|t| backend.download_f32(t))
        .collect::<Result<_, _>>()?;
    assert_eq!(hidden.len(), 3);
    let norm = tensor("model.norm.weight")?;
    let head = tensor("lm_head.weight")?;
    let eps = 1e-5f32;
    for r in 0..2 {
        let x = &hidden[0][r * h..(r + 1) * h];
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / h as f32 + eps).sqrt();
        let normed: Vec<f32> = x.iter().zip(&norm).map(|(v, w)| v / rms * w).collect();
        let direct = &hidden[1][r * h..(r + 1) * h];
        let scale = normed.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in normed.iter().zip(direct) {
            assert!(
                (a - b).abs() <= 1e-5 * scale.max(1.0),
                "normed state {a} vs {b}"
            );
        }
        let row = &logits[r * vocab..(r + 1) * vocab];
        let lmax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (t, &got) in row.iter().enumerate() {
            let want: f32 = normed
                .iter()
                .zip(&head[t * h..(t + 1) * h])
                .map(|(a, b)| a * b)
                .sum();
            assert!(
                (want - got).abs() <= 1e-4 * lmax.max(1.0),
                "logit {t}: {want} vs {got}"
            );
        }
        let first = &hidden[2][r * h..(r + 1) * h];
        assert!(
            first.iter().zip(x).any(|(a, b)| a != b),
            "layer 0 equals the last layer"
        );
    }
    let bad = ForwardBatch {
        hidden_layers: vec![layers + 1],
        ..batch
    };
    let err = runner.forward(&bad).err().context("refused")?;
    assert!(err.to_string().contains("layer"), "{err}");
    Ok(())
}
