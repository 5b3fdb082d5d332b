//! Parity with the CPU backend on the tiny seeded models in tests/fixtures
//! (Llama, Qwen2, Qwen3, Mistral; f32 weights): last-position logits within
//! 1e-3 of their scale, and 32 greedy tokens identical to the CPU backend and
//! to the transformers reference, one sequence at a time (page size 16) and
//! as one batch (page size 1, decode through device graphs). bf16 weights with a
//! bf16 KV cache stay within 5% of the f32 reference logits. The quantized
//! fixtures (FP8 blocks, AWQ, NVFP4) pass the same checks, their weights
//! packed on the device, and W8A8 FP8 stays within 1e-3 of the CPU's.
//! A row's logits are the same bits alone, chunked and
//! inside a batch of 16 (batch invariance).

use crate::common::*;
use anyhow::{Context, Result};
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{Backend, DType, LoadOptions, Registry, SamplingParams};
use arbor_models::{LoadedModel, load_model};
use arbor_quant as _;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;

/// tests/fixtures, or `ARBOR_FIXTURES` (for test binaries run from another checkout).
pub(crate) fn fixture(name: &str) -> PathBuf {
    std::env::var_os("ARBOR_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
        .join(name)
}

fn load(backend: &Arc<dyn Backend>, name: &str, dtype: &str) -> Result<(LoadedModel, Value)> {
    let registry = Registry::builtin()?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant: registry.quant_methods.get(dtype)?(&Default::default())?,
        progress: None,
    };
    let dir = fixture(name);
    let m = load_model(&dir, &registry, &opts)?;
    let text = std::fs::read_to_string(dir.join("reference.json"))?;
    Ok((m, serde_json::from_str(&text)?))
}

pub(crate) fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_u64)
                .map(|x| x as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// The token ids under `key` of every prompt of a reference.
fn per_prompt(r: &Value, key: &str) -> Result<Vec<Vec<u32>>> {
    Ok(r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .map(|p| ids(&p[key]))
        .collect())
}

fn greedy(
    m: &LoadedModel,
    b: &Arc<dyn Backend>,
    prompts: &[Vec<u32>],
    page_size: usize,
) -> Result<Vec<Vec<u32>>> {
    let runner = ModelRunner::new(
        m.model.clone(),
        b.clone(),
        None,
        page_size,
        1024 / page_size,
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

fn last_logits(
    m: &LoadedModel,
    b: &Arc<dyn Backend>,
    prompt: &[u32],
    kv: DType,
) -> Result<Vec<f32>> {
    let runner = ModelRunner::new(m.model.clone(), b.clone(), None, 4, 128, kv)?;
    let pool = runner.new_page_pool();
    let pages = pool.alloc(pool.pages_for(prompt.len()))?;
    let mut got = runner.step(&[SeqStep {
        tokens: prompt,
        prefix_len: 0,
        pages: pages.pages(),
        want_logits: true,
        // A hybrid model's recurrent state slot.
        state_slot: m.model.spec().state.map(|_| 0),
    }])?;
    Ok(got.remove(0))
}

fn check(name: &str) -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let g: Arc<dyn Backend> = g;
    let c = cpu();
    let (mg, r) = load(&g, name, "f32")
        .with_context(|| format!("loading {name} on {}", crate::vendor::NAME))?;
    let (mc, _) = load(&c, name, "f32")?;
    let prompts = per_prompt(&r, "input_ids")?;
    let want = per_prompt(&r, "greedy_ids")?;
    for (i, p) in prompts.iter().enumerate() {
        let lg = last_logits(&mg, &g, p, DType::F32)?;
        let lc = last_logits(&mc, &c, p, DType::F32)?;
        assert_close(&format!("{name} prompt {i} logits"), &lg, &lc, 1e-3);
        let got = greedy(&mg, &g, std::slice::from_ref(p), 16)?;
        let cpu = greedy(&mc, &c, std::slice::from_ref(p), 16)?;
        assert_eq!(
            got,
            cpu,
            "{name} prompt {i}: greedy tokens, {} vs CPU",
            crate::vendor::NAME
        );
        assert_eq!(
            got[0], want[i],
            "{name} prompt {i}: greedy tokens vs transformers"
        );
    }
    let batch = greedy(&mg, &g, &prompts, 1)?;
    assert_eq!(batch, want, "{name}: batched greedy tokens");
    Ok(())
}

/// A hybrid model (Gated DeltaNet recurrent layers with gated attention):
/// the recurrence (the `gated_delta_net` kernel; WGSL on wgpu) and every
/// other operation (partial rotary, the
/// sigmoid output gate, norms over heads, row gathers of the doubled query
/// projection) on the device.
#[test]
fn tiny_qwen3_5_hybrid() -> Result<()> {
    check("tiny-qwen3.5")
}

#[test]
fn tiny_llama() -> Result<()> {
    check("tiny-llama")
}

#[test]
fn tiny_qwen2() -> Result<()> {
    check("tiny-qwen2")
}

#[test]
fn tiny_qwen3() -> Result<()> {
    check("tiny-qwen3")
}

#[test]
fn tiny_mistral() -> Result<()> {
    check("tiny-mistral")
}

/// HF quantized checkpoints (tests/fixtures/quant; DeepSeek-V3's block FP8
/// with latent attention and experts, and GPTQ and NVFP4 experts among
/// them):
/// the weights stay packed
/// on the device and go through the tensor-core GEMM (CUDA sm_80+) or the
/// dequantizing GEMM.
#[test]
fn quantized_checkpoints_match_cpu_and_reference() -> Result<()> {
    for (name, stored) in [
        ("quant/fp8-block", DType::F8_S32),
        ("quant/awq", DType::U4_S32),
        ("quant/gptq8-asym", DType::U8_S32),
        ("quant/nvfp4", DType::F4_S16),
        ("quant/deepseek-v3-fp8-block", DType::F8_S32),
        ("quant/moe-gptq", DType::U4_S32),
        ("quant/moe-nvfp4", DType::F4_S16),
    ] {
        if let Some(g) = gpu() {
            let g: Arc<dyn Backend> = g;
            let (m, _) = load(&g, name, "f32")?;
            assert_eq!(m.model.spec().weight_dtype, stored, "{name}");
        }
        check(name)?;
    }
    Ok(())
}

/// W8A8 FP8 (`--quantization w8a8_fp8` over the compressed-tensors FP8
/// fixtures, with inputs quantized per 32 and with static input scales, the
/// MoE ones' experts sharing their block's, DeepSeek's q_a_proj kv_a's):
/// the device's product (FP8 tensor cores on sm_89+, the E4M3-rounded input
/// elsewhere) against the CPU's, on the prompts whose inputs lie clear of
/// E4M3 rounding midpoints (`closest_tie` of w8a8-reference.json; nearer
/// ones may round the other way on another device): logits within 1e-3 of
/// their scale, greedy tokens identical.
#[test]
fn w8a8_fp8_matches_cpu() -> Result<()> {
    for name in [
        "quant/fp8-dynamic",
        "quant/fp8-static",
        "quant/moe-fp8-static",
        "quant/deepseek-v3-fp8-static",
    ] {
        w8a8_fp8_matches_cpu_on(name)?;
    }
    Ok(())
}

fn w8a8_fp8_matches_cpu_on(name: &str) -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let g: Arc<dyn Backend> = g;
    let c = cpu();
    let registry = Registry::builtin()?;
    let dir = fixture(name);
    let load_on = |b: &Arc<dyn Backend>| -> Result<LoadedModel> {
        let float = registry.quant_methods.get("f32")?(&Default::default())?;
        let init = arbor_engine_core::QuantInit {
            checkpoint: None,
            base: Some(float),
        };
        let opts = LoadOptions {
            backend: b.clone(),
            quant: registry.quant_methods.get("w8a8_fp8")?(&init)?,
            progress: None,
        };
        Ok(load_model(&dir, &registry, &opts)?)
    };
    let (mg, mc) = (load_on(&g)?, load_on(&c)?);
    assert_eq!(mg.model.spec().weight_dtype, DType::F8A8_S32);
    let text = std::fs::read_to_string(dir.join("w8a8-reference.json"))?;
    let r: Value = serde_json::from_str(&text)?;
    let mut compared = 0;
    for (i, p) in r["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .enumerate()
    {
        if p["closest_tie"].as_f64().unwrap_or(0.0) < 1e-6 {
            continue;
        }
        let p = ids(&p["input_ids"]);
        let lg = last_logits(&mg, &g, &p, DType::F32)?;
        let lc = last_logits(&mc, &c, &p, DType::F32)?;
        assert_close(&format!("{name} w8a8 prompt {i} logits"), &lg, &lc, 1e-3);
        let got = greedy(&mg, &g, std::slice::from_ref(&p), 16)?;
        let cpu = greedy(&mc, &c, std::slice::from_ref(&p), 16)?;
        assert_eq!(got, cpu, "{name} w8a8 prompt {i}: greedy tokens vs CPU");
        compared += 1;
    }
    assert!(compared > 0, "{name}: no prompt clear of E4M3 ties");
    Ok(())
}

#[test]
fn bf16_weights_and_kv_stay_close() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let g: Arc<dyn Backend> = g;
    let (m, r) = load(&g, "tiny-llama", "bf16")?;
    let p = ids(&r["prompts"][1]["input_ids"]);
    let want: Vec<f32> = r["prompts"][1]["last_logits"]
        .as_array()
        .context("logits")?
        .iter()
        .filter_map(Value::as_f64)
        .map(|x| x as f32)
        .collect();
    let got = last_logits(&m, &g, &p, DType::BF16)?;
    let (e, s) = max_err(&got, &want);
    println!("bf16 weights + bf16 KV: max abs error {e:.3e} of {s:.3}");
    assert!(e <= 0.05 * s, "bf16: error {e}");
    Ok(())
}

/// Asserts `got` has the bits of `want`, naming the largest difference.
fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    let (e, s) = max_err(got, want);
    let same = got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
    assert!(
        same,
        "{what}: logits differ (max abs difference {e:.3e} of {s:.3})"
    );
}

fn step_of<'a>(tokens: &'a [u32], prefix_len: usize, pages: &'a [u32]) -> SeqStep<'a> {
    SeqStep {
        tokens,
        prefix_len,
        pages,
        want_logits: true,
        state_slot: None,
    }
}

/// Batch invariance, which lossless speculation, caching and chunking need:
/// a sequence's logits are the same bits computed alone, in two chunks, and
/// inside a batch with 15 other sequences (as a prefill among prefills of
/// other lengths, and as a decode among decodes). tiny-llama with f32
/// weights and KV, and with bf16 weights and KV.
#[test]
fn a_rows_logits_do_not_depend_on_the_batch() -> Result<()> {
    let Some(g) = gpu() else { return Ok(()) };
    let g: Arc<dyn Backend> = g;
    for (dtype, kv) in [("f32", DType::F32), ("bf16", DType::BF16)] {
        let (m, r) = load(&g, "tiny-llama", dtype)?;
        let prompts = per_prompt(&r, "input_ids")?;
        let corpus: Vec<u32> = prompts.concat();
        let take = |from: usize, len: usize| -> Vec<u32> {
            (0..len)
                .map(|i| corpus[(from + i) % corpus.len()])
                .collect()
        };
        let runner = ModelRunner::new(m.model.clone(), g.clone(), None, 16, 64, kv)?;
        let pool = runner.new_page_pool();
        let ours = take(0, 40);
        let next = take(40, 1);
        let mine = pool.alloc(pool.pages_for(41))?;
        let seq = |tokens, prefix| step_of(tokens, prefix, mine.pages());
        let what = |case: &str| format!("{} {dtype}: {case}", crate::vendor::NAME);
        // Alone: one prefill, then one decode.
        let alone = runner.step(&[seq(&ours, 0)])?.remove(0);
        let decode_alone = runner.step(&[seq(&next, 40)])?.remove(0);
        // Two chunks.
        runner.step(&[seq(&ours[..13], 0)])?;
        let chunked = runner.step(&[seq(&ours[13..], 13)])?.remove(0);
        same_bits(&what("after a cached prefix of 13"), &chunked, &alone);
        // Among 15 other prefills of 1..=40 tokens, ours at row 6.
        let others: Vec<Vec<u32>> = (0..15)
            .map(|i| take(7 * i + 3, 1 + (11 * i) % 40))
            .collect();
        let pages: Vec<_> = (0..15)
            .map(|_| pool.alloc(pool.pages_for(42)))
            .collect::<arbor_engine_core::Result<_>>()?;
        let mut steps: Vec<SeqStep<'_>> = others
            .iter()
            .zip(&pages)
            .map(|(o, p)| step_of(o, 0, p.pages()))
            .collect();
        steps.insert(6, seq(&ours, 0));
        let batched = runner.step(&steps)?;
        same_bits(&what("a prefill in a batch of 16"), &batched[6], &alone);
        // Ours a decode among 15 other decodes.
        let nexts: Vec<Vec<u32>> = (0..15).map(|i| take(5 * i + 1, 1)).collect();
        let mut steps: Vec<SeqStep<'_>> = nexts
            .iter()
            .zip(&pages)
            .zip(&others)
            .map(|((t, p), o)| step_of(t, o.len(), p.pages()))
            .collect();
        steps.insert(6, seq(&next, 40));
        let batched = runner.step(&steps)?;
        same_bits(
            &what("a decode in a batch of 16"),
            &batched[6],
            &decode_alone,
        );
        drop((mine, pages));
        assert_eq!(pool.free_pages(), pool.total_pages(), "pages leaked");
    }
    Ok(())
}

/// DeepSeek's latent attention at its real head geometry (kv_lora_rank 512,
/// qk_rope_head_dim 64: 576-wide latent heads, one shared by every query
/// head), with and without a query compression, random f32 weights on a
/// small hidden size: a 40-token prefill and three decode steps give the
/// CPU's logits within 1e-3 of their scale. Where the device's attention
/// cannot take heads that wide (AMD's 64 KiB of LDS under the CUDA kernels'
/// prefill tiles), making the model's runner is an error naming the width.
#[test]
fn latent_attention_at_deepseeks_width_matches_cpu() -> Result<()> {
    use arbor_models::decoder::{DEEPSEEK_V2, DecoderArchitecture};
    use arbor_models::random::LatentShape;
    let Some(g) = gpu() else { return Ok(()) };
    let g: Arc<dyn Backend> = g;
    let max = g.attention(None)?.capabilities().max_head_dim;
    let fits = max.is_none_or(|m| m >= 576);
    let c = cpu();
    let registry = Registry::builtin()?;
    for q_lora_rank in [None, Some(48)] {
        let shape = LatentShape {
            hidden: 64,
            heads: 4,
            intermediate: 96,
            layers: 2,
            vocab: 256,
            q_lora_rank,
        };
        let (config, src) = (shape.config(), shape.weights(DType::F32, 3)?);
        let logits = |b: &Arc<dyn Backend>| -> Result<Vec<Vec<f32>>> {
            let opts = LoadOptions {
                backend: b.clone(),
                quant: registry.quant_methods.get("auto")?(&Default::default())?,
                progress: None,
            };
            let m = DecoderArchitecture::new(DEEPSEEK_V2).load_model(&config, &src, &opts)?;
            let runner = ModelRunner::new(Arc::new(m), b.clone(), None, 16, 8, DType::F32)?;
            let pages: Vec<u32> = (0..4).collect();
            let prompt: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 256).collect();
            let mut rows = runner.step(&[step_of(&prompt, 0, &pages)])?;
            for i in 0..3u32 {
                let tok = [(i * 91 + 7) % 256];
                rows.extend(runner.step(&[step_of(&tok, 40 + i as usize, &pages)])?);
            }
            Ok(rows)
        };
        let what = format!("latent heads of 576, q_lora_rank {q_lora_rank:?}");
        if !fits {
            let err = logits(&g)
                .err()
                .context("a model past the attention's widest head")?;
            assert!(
                format!("{err:#}").contains("head_dim 576 wide"),
                "{what}: {err:#}"
            );
            continue;
        }
        let (got, want) = (logits(&g)?, logits(&c)?);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("{what}, step {i}"), a, b, 1e-3);
        }
    }
    Ok(())
}
