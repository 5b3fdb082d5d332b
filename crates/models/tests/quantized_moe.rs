//! A mixture-of-experts FP8 checkpoint with static input scales
//! (tests/fixtures/quant/moe-fp8-static, written by
//! tools/reference/make_moe_quant_fixtures.py: tiny-qwen3-moe as
//! llm-compressor writes an FP8 MoE checkpoint, every attention, dense and
//! expert linear E4M3 per tensor with a calibrated `input_scale`, the
//! routers float), against the numpy float64 Qwen3-MoE forward of the same
//! weights: served as stored (weight-only FP8), and under
//! `--quantization w8a8_fp8`, where every expert of a block rounds its
//! gate/up input with the largest of the block's gate/up scales and its
//! down input with the largest down scale, as vLLM's FP8 MoE methods do.
//! Tolerances and the split of prompts by E4M3 ties are quantized.rs's.
//!
//! Also, from the same script, experts in block FP8 (with a W8A8
//! reference too), GPTQ, AWQ and NVFP4 (quant/moe-fp8-block, moe-gptq,
//! moe-awq, moe-nvfp4, against the numpy forward) and DeepSeek-V3's own
//! FP8 layout (quant/deepseek-v3-fp8-block: 128 × 128 blocks with
//! `weight_scale_inv` on every decoder linear) and as llm-compressor's FP8
//! with static input scales (quant/deepseek-v3-fp8-static) against
//! transformers run on the weights dequantized with the format's formula.

mod quant_common;

use anyhow::Result;
use arbor_engine_core::DType;
use quant_common::*;

const FIXTURE: &str = "moe-fp8-static";

#[test]
fn moe_fp8_checkpoint_matches_its_reference() -> Result<()> {
    check_format(FIXTURE, DType::F8_S32)
}

/// Experts in the formats of the published Qwen3-MoE quantizations (block
/// FP8, GPTQ, AWQ, ModelOpt NVFP4) stay packed and give the numpy forward
/// of their dequantized weights.
#[test]
fn moe_weight_only_checkpoints_match_their_references() -> Result<()> {
    for (name, stored) in [
        ("moe-fp8-block", DType::F8_S32),
        ("moe-gptq", DType::U4_S32),
        ("moe-awq", DType::U4_S32),
        ("moe-nvfp4", DType::F4_S16),
    ] {
        check_format(name, stored)?;
    }
    Ok(())
}

/// Latent attention's kv_b_proj is dequantized with the format's formula
/// into float per-head up-projections; its other projections, the dense
/// MLP, the experts and the shared expert keep their FP8 blocks (the tiny
/// q_b_proj's 24 inputs, not whole runs of 32, are dequantized). The float model those weights were
/// quantized from misses the reference by far more than the tolerance, and
/// a projection without its block scales is an error naming the tensor.
#[test]
fn deepseek_v3_block_fp8_matches_its_reference() -> Result<()> {
    let name = "deepseek-v3-fp8-block";
    check_format(name, DType::F8_S32)?;
    let reference = reference_at(&fixtures().join("quant").join(name).join("reference.json"))?;
    let (float, b) = load(&fixtures().join("tiny-deepseek-v3"), None)?;
    let got = last_logits(&float, &b, DType::F32, &reference)?;
    misses_far("the float model", &got, &reference)?;
    let scale = "model.layers.0.self_attn.kv_b_proj.weight_scale_inv";
    let dir = edited(name, |_| {}, |t| t.retain(|(n, ..)| n != scale))?;
    let e = load_error(dir.path(), None);
    assert!(e.contains(scale) && e.contains("missing"), "{e}");
    Ok(())
}

/// Under `w8a8_fp8` the experts round their inputs with their block's
/// merged static scales: the tie-clear prompts match the reference within
/// the f32 tolerance, the others within one input's rounding step, and
/// the weight-only product and the dynamic per-32 rounding (the checkpoint
/// without its scales) both miss it by far more.
#[test]
fn w8a8_experts_round_with_their_blocks_static_scales() -> Result<()> {
    // 3 layers × Q/K/V/O and 2 × 8 experts × 3 (the dense MLP is float).
    let summary = "w8a8_fp8, 60 layers with static input scales";
    let reference = check_w8a8(FIXTURE, summary, true)?;
    let dynamic = edited(
        FIXTURE,
        |_| {},
        |t| t.retain(|(n, ..)| !n.ends_with(".input_scale")),
    )?;
    let (md, bd) = load(dynamic.path(), Some("w8a8_fp8"))?;
    assert_eq!(md.model.spec().quantization, "w8a8_fp8");
    let got = last_logits(&md, &bd, DType::F32, &reference)?;
    misses_far("W8A8 per 32", &got, &reference)
}

/// Under `w8a8_fp8` the block-FP8 experts (Qwen3-30B-A3B-FP8's layout)
/// round their inputs per 32 as every W8A8 linear does, and follow the
/// numpy forward of that rounding. None of its prompts keeps every input
/// clear of E4M3 ties over 32 greedy steps, so they are checked within one
/// flipped input's rounding step (the CPU's error is printed: in practice
/// the f32 tolerance).
#[test]
fn w8a8_block_fp8_experts_round_their_inputs_per_32() -> Result<()> {
    check_w8a8("moe-fp8-block", "w8a8_fp8", false)?;
    Ok(())
}

/// DeepSeek-V3's block FP8 under `w8a8_fp8`: the products that keep FP8
/// weights (latent attention's q_a, kv_a and o projections, the dense MLP,
/// the experts and the shared expert) round their inputs per 32, kv_b's
/// per-head up-projections stay float, as in vLLM's decode; against
/// transformers with the same rounding hooked in
/// (make_moe_quant_fixtures.py's `w8a8_reference`).
#[test]
fn w8a8_over_deepseek_v3_block_fp8_matches_its_reference() -> Result<()> {
    check_w8a8("deepseek-v3-fp8-block", "w8a8_fp8", true)?;
    Ok(())
}

/// DeepSeek-V3 as an llm-compressor FP8 checkpoint with static input
/// scales: weight-only, and under `w8a8_fp8` with the scales merged as
/// vLLM fuses the layers (q_a_proj with kv_a_proj_with_mqa, gate with up,
/// the block's experts; o_proj alone), against transformers with that rounding hooked in
/// (make_moe_quant_fixtures.py's `deepseek_static_reference`). q_a_proj
/// rounds with kv_a_proj_with_mqa's larger scale: lowering it to q_a's own
/// moves the logits.
#[test]
fn static_scales_over_deepseek_v3_match_their_reference() -> Result<()> {
    let name = "deepseek-v3-fp8-static";
    check_format(name, DType::F8_S32)?;
    // 3 × (q_a_proj, kv_a_proj_with_mqa, o_proj), the dense MLP, 2 layers ×
    // (8 experts + the shared one) × 3; not the tiny q_b_proj (24 inputs).
    let summary = "w8a8_fp8, 66 layers with static input scales";
    let reference = check_w8a8(name, summary, true)?;
    let logits = |dir: &std::path::Path| w8a8_logit_bits(dir, &reference);
    let want = logits(&fixtures().join("quant").join(name))?;
    let lowered = edited(
        name,
        |_| {},
        |t| {
            let scale = |t: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)], n: &str| {
                t.iter().find(|(m, ..)| m == n).map(|(.., b)| b.clone())
            };
            let q_a = scale(t, "model.layers.0.self_attn.q_a_proj.input_scale");
            for (n, _, _, b) in t.iter_mut() {
                if n == "model.layers.0.self_attn.kv_a_proj_with_mqa.input_scale" {
                    *b = q_a.clone().unwrap_or_default();
                }
            }
        },
    )?;
    assert_ne!(logits(lowered.path())?, want, "q_a_proj's own scale");
    Ok(())
}

/// Loads fixture `name` under `w8a8_fp8` (its summary `summary`) and
/// checks it against its w8a8-reference.json ([`check_by_tie`]); the
/// weight-only product misses the reference far. Returns the reference.
fn check_w8a8(name: &str, summary: &str, some_far: bool) -> Result<serde_json::Value> {
    let dir = fixtures().join("quant").join(name);
    let reference = reference_at(&dir.join("w8a8-reference.json"))?;
    let (m, backend) = load(&dir, Some("w8a8_fp8"))?;
    assert_eq!(m.model.spec().weight_dtype, DType::F8A8_S32, "{name}");
    assert_eq!(m.model.spec().quantization, summary, "{name}");
    check_by_tie(name, &m, &backend, &reference, some_far)?;
    let (plain, plain_backend) = load(&dir, None)?;
    let got = last_logits(&plain, &plain_backend, DType::F32, &reference)?;
    misses_far(&format!("{name}: weight-only FP8"), &got, &reference)?;
    Ok(reference)
}

/// The block's scales are the maxima over all its experts: a checkpoint
/// whose every expert already stores those maxima gives the same logits
/// bit for bit, and raising one expert's up_proj scale above the block's
/// maximum changes the rounding of every expert, so the logits move.
#[test]
fn a_blocks_experts_share_the_largest_of_their_scales() -> Result<()> {
    let reference = reference_at(
        &fixtures()
            .join("quant")
            .join(FIXTURE)
            .join("w8a8-reference.json"),
    )?;
    let logits = |dir: &std::path::Path| w8a8_logit_bits(dir, &reference);
    let want = logits(&fixtures().join("quant").join(FIXTURE))?;
    let merged = edited(
        FIXTURE,
        |_| {},
        |t| {
            // The block maxima per (layer, gate/up or down) of the experts'.
            let key = |n: &str| -> Option<(String, bool)> {
                let (block, rest) = n.split_once(".experts.")?;
                let down = rest.ends_with("down_proj.input_scale");
                let gate_up = rest.ends_with("gate_proj.input_scale")
                    || rest.ends_with("up_proj.input_scale");
                (down || gate_up).then(|| (block.to_string(), down))
            };
            let value = |b: &[u8]| f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            let mut max = std::collections::HashMap::new();
            for (n, _, _, b) in t.iter() {
                if let Some(k) = key(n) {
                    let m = max.entry(k).or_insert(0f32);
                    *m = m.max(value(b));
                }
            }
            for (n, _, _, b) in t.iter_mut() {
                if let Some(k) = key(n) {
                    *b = max[&k].to_le_bytes().to_vec();
                }
            }
        },
    )?;
    assert_eq!(logits(merged.path())?, want, "experts storing the maxima");
    let raised = edited(
        FIXTURE,
        |_| {},
        |t| {
            for (n, _, _, b) in t.iter_mut() {
                if n == "model.layers.0.mlp.experts.7.up_proj.input_scale" {
                    let s = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                    *b = (4.0 * s).to_le_bytes().to_vec();
                }
            }
        },
    )?;
    assert_ne!(logits(raised.path())?, want, "one expert's larger scale");
    Ok(())
}

/// The bits of the last-position logits of `reference`'s prompts from the
/// checkpoint `dir` under `w8a8_fp8`.
fn w8a8_logit_bits(dir: &std::path::Path, reference: &serde_json::Value) -> Result<Vec<u32>> {
    let (m, b) = load(dir, Some("w8a8_fp8"))?;
    let got = last_logits(&m, &b, DType::F32, reference)?;
    Ok(got.iter().flatten().map(|x| x.to_bits()).collect())
}
