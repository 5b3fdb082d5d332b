//! Quantized HF checkpoints (tests/fixtures/quant, written by
//! tools/reference/make_quant_fixtures.py): each format's checkpoint loads
//! through its `quantization_config`, packs into the expected stored dtype,
//! and matches transformers run on the weights dequantized in numpy with the
//! format's published formula (8-bit GPTQ, from make_gptq8_fixture.py: a
//! float64 numpy forward of the same dequantized weights instead of
//! transformers): last-position logits within 1e-4 × max|logit|
//! and the greedy continuation identical up to the first near-tie (a step
//! whose top-2 margin is under 1e-3). Bad checkpoints fail with errors that
//! name the tensor or the config key. Every run returns its KV pages.

mod quant_common;

use anyhow::{Context, Result};
use arbor_engine_core::runner::{ModelRunner, SamplingSetup, SeqStep, generate_static};
use arbor_engine_core::sampling::StandardSampler;
use arbor_engine_core::{DType, QuantMatmul, SamplingParams};
use quant_common::*;
use serde_json::Value;

#[test]
fn block_fp8_matches_its_dequantized_reference() -> Result<()> {
    check_format("fp8-block", DType::F8_S32)
}

#[test]
fn compressed_tensors_fp8_channel_matches() -> Result<()> {
    check_format("fp8-dynamic", DType::F8_S32)
}

#[test]
fn compressed_tensors_fp8_tensor_with_input_scale_matches() -> Result<()> {
    check_format("fp8-static", DType::F8_S32)
}

#[test]
fn compressed_tensors_w4a16_matches() -> Result<()> {
    check_format("w4a16", DType::U4_S32)
}

#[test]
fn compressed_tensors_w4a16_asymmetric_matches() -> Result<()> {
    check_format("w4a16-asym", DType::U4_S32)
}

/// llm-compressor's act-order layout (`actorder: group`): `weight_g_idx`
/// names each input's group and the scale columns follow it. The fixture
/// re-expresses w4a16's weights that way, so w4a16's reference applies.
#[test]
fn compressed_tensors_w4a16_act_order_matches() -> Result<()> {
    check_format("w4a16-actorder", DType::U4_S32)
}

#[test]
fn awq_matches() -> Result<()> {
    check_format("awq", DType::U4_S32)
}

#[test]
fn gptq_matches() -> Result<()> {
    check_format("gptq", DType::U4_S32)
}

#[test]
fn modelopt_nvfp4_matches() -> Result<()> {
    check_format("nvfp4", DType::F4_S16)
}

/// ModelOpt's older exports: the config in hf_quant_config.json.
#[test]
fn modelopt_config_in_hf_quant_config_json_loads() -> Result<()> {
    let d = edited(
        "nvfp4",
        |c| {
            if let Some(o) = c.as_object_mut() {
                o.remove("quantization_config");
            }
        },
        |_| {},
    )?;
    let hf = serde_json::json!({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
    });
    std::fs::write(d.path().join("hf_quant_config.json"), hf.to_string())?;
    let (m, backend) = load(d.path(), None)?;
    assert_eq!(m.model.spec().weight_dtype, DType::F4_S16);
    assert_eq!(m.model.spec().quantization, "modelopt");
    let reference = reference_at(&fixtures().join("quant/nvfp4/reference.json"))?;
    check_against("nvfp4 (hf_quant_config.json)", &m, &backend, &reference)
}

/// 8-bit GPTQ, symmetric (zero point 128) and with zero points (up to
/// 256 in the original format): packed as `u8_s32`.
#[test]
fn gptq_8bit_matches() -> Result<()> {
    check_format("gptq8", DType::U8_S32)?;
    check_format("gptq8-asym", DType::U8_S32)
}

/// `--cpu-quant-matmul amx-bf16`: each scaled format's weights, rounded to
/// bf16, meet bf16-rounded activations in AMX tiles. Against the same f32
/// references: logits within 5% of max|logit|, the tolerance of bf16
/// weights in parity.rs (bf16 keeps 8 significant bits; the worst format
/// measured 1.9%, 8-bit GPTQ; the others 0.5-1.2%), and greedy tokens
/// identical up to the first step whose reference margin is under 0.3
/// (twice the largest logit error measured, so a flip there is a defect, not
/// rounding). The bit-level contract (these products equal bf16 weights'
/// exactly) is arbor-quant's
/// `amx_bf16_scaled_blocks_multiply_as_their_bf16_dequantization`.
#[test]
fn amx_bf16_matmul_stays_close_to_each_formats_reference() -> Result<()> {
    if arbor_quant::detected_level() < arbor_quant::SimdLevel::Amx {
        println!("skipped: this CPU has no AMX-BF16, so amx-bf16 runs as f32");
        return Ok(());
    }
    let tol = Tolerance {
        logits: 5e-2,
        margin: 0.3,
    };
    for (name, stored) in [
        ("fp8-block", DType::F8_S32),
        ("fp8-dynamic", DType::F8_S32),
        ("awq", DType::U4_S32),
        ("gptq", DType::U4_S32),
        ("w4a16-asym", DType::U4_S32),
        ("gptq8-asym", DType::U8_S32),
        ("nvfp4", DType::F4_S16),
    ] {
        let dir = fixtures().join("quant").join(name);
        let (m, backend) = load_as(&dir, None, QuantMatmul::AmxBf16)?;
        assert_eq!(m.model.spec().weight_dtype, stored, "{name}");
        let reference: Value = reference_at(&dir.join("reference.json"))?;
        check_within(&format!("{name} amx-bf16"), &m, &backend, &reference, tol)?;
    }
    Ok(())
}

/// Act-order groups mix within 32 inputs: the exact f32 dequantization.
#[test]
fn gptq_act_order_matches_through_the_f32_fallback() -> Result<()> {
    check_format("gptq-actorder", DType::F32)
}

#[test]
fn fp8_at_load_matches_per_channel_reference() -> Result<()> {
    let (m, backend) = load(&fixtures().join("tiny-llama"), Some("fp8"))?;
    assert_eq!(m.model.spec().weight_dtype, DType::F8_S32);
    let reference: Value = reference_at(&fixtures().join("quant/fp8-online.json"))?;
    check_against("fp8-online", &m, &backend, &reference)
}

/// `--quantization w8a8_fp8` on a float checkpoint (per-channel E4M3
/// weights, inputs rounded to E4M3 per 32), over a compressed-tensors FP8
/// checkpoint, and over one with static input scales (each input rounded
/// with its layer group's largest scale, some saturating), against the
/// numpy forward of the same arithmetic
/// (tools/reference/make_w8a8_fixture.py): prompts whose inputs all lie
/// clear of E4M3 rounding midpoints within the f32 tolerance, the others
/// within one input's rounding step. The weight-only product of the same
/// weights misses that reference by far more than the f32 tolerance.
#[test]
fn w8a8_fp8_matches_its_reference_and_differs_from_weight_only_fp8() -> Result<()> {
    let online = reference_at(&fixtures().join("quant/w8a8-online.json"))?;
    let ct_dir = fixtures().join("quant/fp8-dynamic");
    let ct = reference_at(&ct_dir.join("w8a8-reference.json"))?;
    let static_dir = fixtures().join("quant/fp8-static");
    let static_ref = reference_at(&static_dir.join("w8a8-reference.json"))?;
    for (name, dir, reference, weight_only) in [
        (
            "w8a8-online",
            fixtures().join("tiny-llama"),
            &online,
            Some("fp8"),
        ),
        ("fp8-dynamic w8a8", ct_dir, &ct, None),
        ("fp8-static w8a8", static_dir, &static_ref, None),
    ] {
        let (m, backend) = load(&dir, Some("w8a8_fp8"))?;
        assert_eq!(m.model.spec().weight_dtype, DType::F8A8_S32, "{name}");
        check_by_tie(name, &m, &backend, reference, true)?;
        let (m8, b8) = load(&dir, weight_only)?;
        assert_eq!(m8.model.spec().weight_dtype, DType::F8_S32, "{name}");
        let plain = last_logits(&m8, &b8, DType::F32, reference)?;
        misses_far(&format!("{name}: weight-only FP8"), &plain, reference)?;
    }
    // Without its input scales the static checkpoint's inputs are rounded
    // per 32, which misses the static reference by far more than the f32
    // tolerance.
    let dynamic = edited(
        "fp8-static",
        |_| {},
        |t| t.retain(|(n, ..)| !n.ends_with(".input_scale")),
    )?;
    let (md, bd) = load(dynamic.path(), Some("w8a8_fp8"))?;
    let got = last_logits(&md, &bd, DType::F32, &static_ref)?;
    misses_far("fp8-static: W8A8 per 32", &got, &static_ref)?;
    // W8A8 applies over FP8 checkpoints only: another method's refuses it,
    // and so does a layer that the methods it does apply over store in
    // another format (ModelOpt NVFP4, compressed-tensors W4A16).
    let e = load_error(&fixtures().join("quant/awq"), Some("w8a8_fp8"));
    assert!(
        e.contains("quantized with 'awq'") && e.contains("w8a8_fp8"),
        "{e}"
    );
    for (name, stored) in [("nvfp4", "f4_s16"), ("w4a16", "u4_s32")] {
        let e = load_error(&fixtures().join("quant").join(name), Some("w8a8_fp8"));
        assert!(
            e.contains(&format!("stored as {stored}")) && e.contains("q_proj.weight"),
            "{name}: {e}"
        );
    }
    Ok(())
}

/// The static input scales apply whichever FP8 method stores them: the
/// fp8-static tensors (E4M3 `weight`, `weight_scale [1]`, `input_scale [1]`)
/// are also vLLM's `fp8` serialization with `activation_scheme: static`
/// and ModelOpt's FP8; declared so, they load under `w8a8_fp8` to the same
/// layers and scales, and give the compressed-tensors load's logits bit
/// for bit.
#[test]
fn static_input_scales_apply_under_every_fp8_method() -> Result<()> {
    let reference = reference_at(&fixtures().join("quant/fp8-static/w8a8-reference.json"))?;
    let (m, b) = load(&fixtures().join("quant/fp8-static"), Some("w8a8_fp8"))?;
    let want = last_logits(&m, &b, DType::F32, &reference)?;
    let summary = "w8a8_fp8, 21 layers with static input scales";
    assert_eq!(m.model.spec().quantization, summary);
    for (method, config) in [
        (
            "fp8",
            serde_json::json!({"quant_method": "fp8", "activation_scheme": "static"}),
        ),
        (
            "modelopt",
            serde_json::json!({"quant_method": "modelopt", "quant_algo": "FP8",
                               "exclude_modules": ["lm_head"]}),
        ),
    ] {
        let dir = edited(
            "fp8-static",
            |cfg| cfg["quantization_config"] = config.clone(),
            |_| {},
        )?;
        let (own, _) = load(dir.path(), None)?;
        assert_eq!(own.model.spec().quantization, method);
        let (m, b) = load(dir.path(), Some("w8a8_fp8"))?;
        assert_eq!(m.model.spec().quantization, summary, "{config}");
        let got = last_logits(&m, &b, DType::F32, &reference)?;
        let bits =
            |v: &[Vec<f32>]| -> Vec<u32> { v.iter().flatten().map(|x| x.to_bits()).collect() };
        assert_eq!(bits(&got), bits(&want), "{config}");
    }
    Ok(())
}

#[test]
fn bad_checkpoints_fail_with_errors_naming_the_tensor_or_key() -> Result<()> {
    let scale = "model.layers.1.mlp.up_proj.weight_scale_inv";
    let d = edited("fp8-block", |_| {}, |t| t.retain(|(n, ..)| n != scale))?;
    let e = load_error(d.path(), None);
    assert!(e.contains(scale) && e.contains("missing"), "{e}");

    let d = edited(
        "awq",
        |c| c["quantization_config"]["quant_method"] = "fancy4".into(),
        |_| {},
    )?;
    let e = load_error(d.path(), None);
    assert!(
        e.contains("fancy4") && e.contains("not supported") && e.contains("awq"),
        "{e}"
    );

    // Group size 48 divides no layer of tiny-llama (64 and 160 inputs).
    let d = edited(
        "gptq",
        |c| c["quantization_config"]["group_size"] = 48.into(),
        |_| {},
    )?;
    let e = load_error(d.path(), None);
    assert!(
        e.contains("group_size 48") && e.contains("model.layers.0.self_attn.q_proj"),
        "{e}"
    );

    let d = edited(
        "awq",
        |c| c["quantization_config"]["bits"] = 3.into(),
        |_| {},
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains("bits must be 4, got 3"), "{e}");
    let d = edited(
        "gptq8",
        |c| c["quantization_config"]["bits"] = 3.into(),
        |_| {},
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains("bits must be 4 or 8, got 3"), "{e}");
    // An 8-bit checkpoint labelled 4-bit: qweight's shape names the layer.
    let d = edited(
        "gptq8",
        |c| c["quantization_config"]["bits"] = 4.into(),
        |_| {},
    )?;
    let e = load_error(d.path(), None);
    assert!(
        e.contains("model.layers.0.self_attn.q_proj.qweight") && e.contains("shape"),
        "{e}"
    );

    // Scales of the wrong shape.
    let s = "model.layers.0.self_attn.k_proj.scales";
    let d = edited(
        "awq",
        |_| {},
        |t| {
            if let Some(x) = t.iter_mut().find(|(n, ..)| n == s) {
                x.2 = vec![x.2[1], x.2[0]];
            }
        },
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains(s) && e.contains("shape"), "{e}");

    // A NaN E4M3 code in a weight.
    let w = "model.layers.2.self_attn.o_proj.weight";
    let d = edited(
        "fp8-dynamic",
        |_| {},
        |t| {
            if let Some(x) = t.iter_mut().find(|(n, ..)| n == w) {
                x.3[5] = 0x7f;
            }
        },
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains(w) && e.contains("NaN"), "{e}");

    // NVFP4 block scales of the wrong dtype.
    let s = "model.layers.0.mlp.down_proj.weight_scale";
    let d = edited(
        "nvfp4",
        |_| {},
        |t| {
            if let Some(x) = t.iter_mut().find(|(n, ..)| n == s) {
                x.1 = safetensors::Dtype::U8;
            }
        },
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains(s) && e.contains("f8_e4m3"), "{e}");

    // An act-order index naming a group the layer does not have.
    let g = "model.layers.1.mlp.down_proj.weight_g_idx";
    let d = edited(
        "w4a16-actorder",
        |_| {},
        |t| {
            if let Some(x) = t.iter_mut().find(|(n, ..)| n == g) {
                x.3[0..4].copy_from_slice(&9i32.to_le_bytes());
            }
        },
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains(g) && e.contains("group 9"), "{e}");

    // A method other than the checkpoint's.
    let e = load_error(&fixtures().join("quant/fp8-block"), Some("awq"));
    assert!(
        e.contains("quantized with 'fp8'") && e.contains("awq"),
        "{e}"
    );
    // A checkpoint method on a float checkpoint.
    let e = load_error(&fixtures().join("tiny-llama"), Some("gptq"));
    assert!(
        e.contains("--quantization gptq") && e.contains("has none"),
        "{e}"
    );
    Ok(())
}

/// FP8 KV caches (scale 1): a quarter of f32's bytes per token, logits near
/// the f32-KV reference (this model's keys and values are small, so E4M3
/// loses about 8% of the largest logit and E5M2, with two mantissa bits,
/// about 15%), and greedy tokens the same whether a prompt runs alone or in
/// a batch.
#[test]
fn fp8_kv_cache_stays_close_and_batch_invariant() -> Result<()> {
    let dir = fixtures().join("tiny-llama");
    let (m, backend) = load(&dir, None)?;
    let reference: Value = reference_at(&dir.join("reference.json"))?;
    let prompts = reference_prompts(&reference)?;
    for (name, kv, tol) in [
        ("fp8_e4m3", DType::F8E4M3, 0.1),
        ("fp8_e5m2", DType::F8E5M2, 0.2),
    ] {
        let choice: arbor_engine_core::KvDtypeChoice = name.parse()?;
        assert_eq!(choice.resolve(backend.as_ref(), None).dtype, kv);
        let runner = ModelRunner::new(m.model.clone(), backend.clone(), None, 16, 64, kv)?;
        let pool = runner.new_page_pool();
        for (i, p) in reference["prompts"]
            .as_array()
            .context("prompts")?
            .iter()
            .enumerate()
        {
            let want = floats(&p["last_logits"]);
            let pages = pool.alloc(pool.pages_for(prompts[i].len()))?;
            let got = runner.step(&[SeqStep {
                tokens: &prompts[i],
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
            println!("{name} KV prompt {i}: max abs logit error {err:.3e} of {max:.3}");
            assert!(err <= tol * max, "{name} prompt {i}: error {err}");
        }
        let params = |n: usize| {
            vec![
                SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(24)
                };
                n
            ]
        };
        let setup = SamplingSetup {
            sampler: &StandardSampler,
            processors: &[],
            eos_token_ids: &[],
        };
        let (batch, _) = generate_static(
            &runner,
            &pool,
            &prompts,
            &params(prompts.len()),
            &setup,
            &mut |_, _| {},
        )?;
        for (i, p) in prompts.iter().enumerate() {
            let (alone, _) = generate_static(
                &runner,
                &pool,
                std::slice::from_ref(p),
                &params(1),
                &setup,
                &mut |_, _| {},
            )?;
            assert_eq!(
                alone[0].tokens, batch[i].tokens,
                "{name} prompt {i}: alone vs batched"
            );
        }
        assert_eq!(
            pool.free_pages(),
            pool.total_pages(),
            "{name}: KV pages leaked"
        );
    }
    let bytes = |d: DType| d.bytes_for(1).map(|b| b as f64);
    assert_eq!(bytes(DType::F32)? / bytes(DType::F8E4M3)?, 4.0);
    Ok(())
}

/// A checkpoint calibrated for an FP8 KV cache (llm-compressor's
/// `kv_cache_scheme`, per-layer `self_attn.k_scale`/`v_scale`; keys and
/// values reach about 2000, beyond E4M3's 448): `auto` chooses FP8 E4M3,
/// the cache stores `fp8(x / scale)` and reads `stored * scale`, and the
/// logits match the numpy forward of that definition
/// (tools/reference/make_kv_scales_fixture.py) with greedy tokens identical,
/// alone and batched. Without the scales the keys saturate and the logits
/// are far off; ModelOpt's spelling of the same scales gives the same bits.
#[test]
fn fp8_kv_cache_uses_the_checkpoint_scales() -> Result<()> {
    let dir = fixtures().join("quant/fp8-kv-scales");
    let reference: Value = reference_at(&dir.join("reference.json"))?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let (m, backend) = load(&dir, None)?;
    assert_eq!(m.model.spec().checkpoint_kv_dtype, Some(DType::F8E4M3));
    let auto = arbor_engine_core::KvDtypeChoice::Auto
        .resolve(backend.as_ref(), m.model.spec().checkpoint_kv_dtype);
    assert_eq!(auto.dtype, DType::F8E4M3);
    assert!(auto.to_string().contains("checkpoint"), "{auto}");

    // An f32 cache stores keys as they are: the model is tiny-llama's.
    let f32_cache = last_logits(&m, &backend, DType::F32, &reference)?;
    let fp8 = last_logits(&m, &backend, DType::F8E4M3, &reference)?;
    for (i, p) in prompts.iter().enumerate() {
        let want_f32 = floats(&p["last_logits_f32"]);
        let want = floats(&p["last_logits"]);
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let e32 = max_abs_diff(&f32_cache[i], &want_f32);
        let e8 = max_abs_diff(&fp8[i], &want);
        println!("prompt {i}: f32 cache error {e32:.2e}, FP8 cache error {e8:.2e} (of {max:.2})");
        assert!(e32 <= 1e-4 * max, "prompt {i}: f32 cache {e32}");
        // One E4M3 step (1/16 relative) on a key rounded differently from
        // numpy's (a different summation order of its projection) moves a
        // logit by far less than 1%.
        assert!(e8 <= 1e-2 * max, "prompt {i}: FP8 cache {e8}");
    }

    // Greedy with the FP8 cache, batched, equals the reference's.
    let runner = ModelRunner::new(
        m.model.clone(),
        backend.clone(),
        None,
        16,
        64,
        DType::F8E4M3,
    )?;
    let pool = runner.new_page_pool();
    let inputs: Vec<Vec<u32>> = prompts.iter().map(|p| ids(&p["input_ids"])).collect();
    let params = vec![
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(24)
        };
        inputs.len()
    ];
    let setup = SamplingSetup {
        sampler: &StandardSampler,
        processors: &[],
        eos_token_ids: &[],
    };
    let (outs, _) = generate_static(&runner, &pool, &inputs, &params, &setup, &mut |_, _| {})?;
    for (i, (o, p)) in outs.iter().zip(prompts).enumerate() {
        assert_eq!(o.tokens, ids(&p["greedy_ids"]), "prompt {i}: greedy tokens");
    }
    assert_eq!(pool.free_pages(), pool.total_pages(), "KV pages leaked");

    // Without the scales (nor the declaration) the keys saturate at 448.
    let bare = edited(
        "fp8-kv-scales",
        |c| {
            if let Some(o) = c.as_object_mut() {
                o.remove("quantization_config");
            }
        },
        |t| t.retain(|(n, ..)| !n.ends_with("_scale")),
    )?;
    let (m_bare, b_bare) = load(bare.path(), None)?;
    assert_eq!(m_bare.model.spec().checkpoint_kv_dtype, None);
    let unscaled = last_logits(&m_bare, &b_bare, DType::F8E4M3, &reference)?;
    for (i, p) in prompts.iter().enumerate() {
        let want = floats(&p["last_logits"]);
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let e = max_abs_diff(&unscaled[i], &want);
        println!("prompt {i}: FP8 cache without the scales: error {e:.2} (of {max:.2})");
        assert!(
            e > 0.1 * max,
            "prompt {i}: the scales made no difference ({e})"
        );
    }

    // ModelOpt's spelling: kv_cache_quant_algo, k_proj.k_scale / v_proj.v_scale of shape [].
    let modelopt = edited(
        "fp8-kv-scales",
        |c| {
            c["quantization_config"] = serde_json::json!({
                "quant_method": "modelopt", "quant_algo": null,
                "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]
            })
        },
        |t| {
            for (n, _, shape, _) in t.iter_mut() {
                if let Some(layer) = n.strip_suffix(".self_attn.k_scale") {
                    *n = format!("{layer}.self_attn.k_proj.k_scale");
                    shape.clear();
                } else if let Some(layer) = n.strip_suffix(".self_attn.v_scale") {
                    *n = format!("{layer}.self_attn.v_proj.v_scale");
                    shape.clear();
                }
            }
        },
    )?;
    let (m_mo, b_mo) = load(modelopt.path(), None)?;
    assert_eq!(m_mo.model.spec().checkpoint_kv_dtype, Some(DType::F8E4M3));
    assert_eq!(last_logits(&m_mo, &b_mo, DType::F8E4M3, &reference)?, fp8);
    Ok(())
}

#[test]
fn bad_kv_cache_scales_fail_naming_the_tensor_or_key() -> Result<()> {
    let v1 = "model.layers.1.self_attn.v_scale";
    let d = edited("fp8-kv-scales", |_| {}, |t| t.retain(|(n, ..)| n != v1))?;
    let e = load_error(d.path(), None);
    assert!(e.contains(v1) && e.contains("missing"), "{e}");

    let d = edited(
        "fp8-kv-scales",
        |_| {},
        |t| t.retain(|(n, ..)| !n.ends_with("_scale")),
    )?;
    let e = load_error(d.path(), None);
    assert!(
        e.contains("model.layers.0.self_attn.k_scale") && e.contains("declares an FP8 KV cache"),
        "{e}"
    );

    let k0 = "model.layers.0.self_attn.k_scale";
    let d = edited(
        "fp8-kv-scales",
        |_| {},
        |t| {
            for (n, _, _, b) in t.iter_mut() {
                if n == k0 {
                    b.copy_from_slice(&0f32.to_le_bytes());
                }
            }
        },
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains(k0) && e.contains("positive"), "{e}");

    let d = edited(
        "fp8-kv-scales",
        |c| c["quantization_config"]["kv_cache_scheme"]["type"] = "int".into(),
        |_| {},
    )?;
    let e = load_error(d.path(), None);
    assert!(e.contains("quantization_config.kv_cache_scheme"), "{e}");
    Ok(())
}
