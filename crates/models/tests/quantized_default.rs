//! The real-weights check of the quantization formats: the default model
//! (SmolLM2-135M-Instruct) as bf16 and as each quantized HF format, written
//! by tools/reference/make_default_quant.py into `$ARBOR_QUANT_DIR`
//! (skipped with a message when it is unset). Over 256 tokens of
//! tools/reference/corpus.txt, teacher-forced, each format's top-1 token at
//! every position is compared with the f32 forward of the bf16 weights; the
//! agreement is printed per format and must reach 90% for FP8 (85% for
//! fp8-static, whose weights have one scale per tensor) and 50% for
//! the 4-bit formats (round-to-nearest INT4 in groups of 64 on a 135M model
//! whose weights were already 4-bit: it lands near 65%). On CPUs with AMX
//! each quantized format runs again under `QuantMatmul::AmxBf16` (bf16
//! weights and activations), with the same floors. W8A8 FP8
//! (`w8a8_fp8`: inputs rounded to E4M3 too), over the FP8 checkpoints (per
//! channel, and per tensor with calibrated static input scales) and on the
//! bf16 weights, must reach 80%. The f32 weights then run
//! with f16, bf16 and FP8 KV caches (80% at least).

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::runner::{ModelRunner, SeqStep};
use arbor_engine_core::{Backend, DType, LoadOptions, QuantMatmul, Registry};
use arbor_models::load_model;
use std::path::Path;
use std::sync::Arc;

const TOKENS: usize = 256;

/// Top-1 of each position `1..tokens.len()` after feeding `tokens[..i]`.
fn teacher_forced(
    dir: &Path,
    dtype: &str,
    tokens: Option<&[u32]>,
    kv: DType,
    matmul: QuantMatmul,
) -> Result<(Vec<u32>, Vec<u32>, String)> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(0)?.with_quant_matmul(matmul));
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get(dtype)?(&Default::default())?,
        progress: None,
    };
    let m =
        load_model(dir, &registry, &opts).with_context(|| format!("loading {}", dir.display()))?;
    let tokens: Vec<u32> = match tokens {
        Some(t) => t.to_vec(),
        None => {
            let text = std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tools/reference/corpus.txt"),
            )?;
            let mut t = m.tokenizer.encode(&text, false)?;
            t.truncate(TOKENS + 1);
            t
        }
    };
    let runner = ModelRunner::new(m.model.clone(), backend, None, 16, 64, kv)?;
    let pool = runner.new_page_pool();
    let pages = pool.alloc(pool.pages_for(tokens.len()))?;
    let mut top = Vec::with_capacity(tokens.len());
    for i in 0..tokens.len() - 1 {
        let out = runner.step(&[SeqStep {
            tokens: &tokens[i..i + 1],
            prefix_len: i,
            pages: pages.pages(),
            want_logits: true,
            state_slot: None,
        }])?;
        let row = &out[0];
        let best = (0..row.len()).fold(0, |b, j| if row[j] > row[b] { j } else { b });
        top.push(best as u32);
    }
    drop(pages);
    assert_eq!(pool.free_pages(), pool.total_pages(), "KV pages leaked");
    let stored = format!(
        "{} ({})",
        m.model.spec().weight_dtype,
        m.model.spec().quantization
    );
    Ok((tokens, top, stored))
}

#[test]
fn quantized_default_model_agrees_with_its_f32_forward() -> Result<()> {
    let Some(root) = std::env::var_os("ARBOR_QUANT_DIR") else {
        println!(
            "skipped: set ARBOR_QUANT_DIR to the folder tools/reference/make_default_quant.py wrote"
        );
        return Ok(());
    };
    let root = Path::new(&root);
    let (tokens, reference, _) = teacher_forced(
        &root.join("bf16"),
        "f32",
        None,
        DType::F32,
        QuantMatmul::F32,
    )?;
    let hits = |top: &[u32]| top.iter().zip(&reference).filter(|(a, b)| a == b).count();
    let next = |top: &[u32]| top.iter().zip(&tokens[1..]).filter(|(a, b)| a == b).count();
    let n = reference.len() as f64;
    println!(
        "f32 forward: next-token top-1 {:.1}%",
        100.0 * next(&reference) as f64 / n
    );
    let mut formats: Vec<_> = std::fs::read_dir(root)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "bf16")
        .collect();
    formats.sort();
    formats.insert(0, "bf16".into());
    let amx = arbor_quant::detected_level() >= arbor_quant::SimdLevel::Amx;
    let matmuls: &[QuantMatmul] = if amx {
        &QuantMatmul::ALL
    } else {
        println!("no AMX-BF16 on this CPU: the amx-bf16 runs are skipped");
        &[QuantMatmul::F32]
    };
    for f in &formats {
        for &mm in matmuls {
            if mm == QuantMatmul::AmxBf16 && f == "bf16" {
                continue;
            }
            let dir = root.join(f);
            let (_, top, stored) = teacher_forced(&dir, "auto", Some(&tokens), DType::F32, mm)?;
            let agree = hits(&top) as f64 / n;
            println!(
                "{f:12} {stored:28} {:8} top-1 agreement with f32 {:.1}%, next-token top-1 {:.1}%",
                mm.name(),
                100.0 * agree,
                100.0 * next(&top) as f64 / n
            );
            // fp8-static's weights have one scale per tensor (llm-compressor's
            // FP8 scheme), coarser than the others' per channel or block.
            let floor = if f == "fp8-static" {
                0.85
            } else if f.starts_with("fp8") || f == "bf16" {
                0.9
            } else {
                0.5
            };
            assert!(
                agree >= floor,
                "{f} {}: agreement {agree:.3} < {floor}",
                mm.name()
            );
        }
    }
    // W8A8 FP8 (`--quantization w8a8_fp8`): over the FP8 checkpoints (the
    // static one's inputs rounded with its calibrated scales), and
    // quantizing the bf16 weights at load.
    for f in ["fp8-dynamic", "fp8-static", "bf16"] {
        let dir = root.join(f);
        if !dir.exists() {
            println!("{f}: not in $ARBOR_QUANT_DIR (an older make_default_quant.py), skipped");
            continue;
        }
        let (_, top, stored) = teacher_forced(
            &dir,
            "w8a8_fp8",
            Some(&tokens),
            DType::F32,
            QuantMatmul::F32,
        )?;
        let agree = hits(&top) as f64 / n;
        println!(
            "{f:12} {stored:28} w8a8     top-1 agreement with f32 {:.1}%, next-token top-1 {:.1}%",
            100.0 * agree,
            100.0 * next(&top) as f64 / n
        );
        assert!(agree >= 0.8, "{f} w8a8_fp8: agreement {agree:.3} < 0.8");
    }
    // KV caches: the bf16 weights with each KV dtype.
    for kv in [DType::F16, DType::BF16, DType::F8E4M3, DType::F8E5M2] {
        let (_, top, _) = teacher_forced(
            &root.join("bf16"),
            "f32",
            Some(&tokens),
            kv,
            QuantMatmul::F32,
        )?;
        let agree = hits(&top) as f64 / n;
        println!(
            "f32 weights, {kv} KV: top-1 agreement with f32 KV {:.1}%",
            100.0 * agree
        );
        assert!(agree >= 0.8, "{kv} KV: agreement {agree:.3}");
    }
    Ok(())
}
