//! End to end: `arbor serve` on the quantized HF checkpoints of
//! tests/fixtures/quant (FP8 blocks, AWQ, NVFP4), on a float checkpoint
//! with `--quantization fp8` and with W8A8 (`--quantization w8a8_fp8`, also
//! over an FP8 checkpoint), and pre-quantized checkpoints over two
//! tensor-parallel ranks. Each serves greedy completions over HTTP equal
//! to the format's reference (up to its first near-tie), names
//! the method in the start-up summary, refuses a conflicting
//! `--quantization` with a message, and returns every KV page.

mod common;

use anyhow::{Context, Result, ensure};
use common::*;
use serde_json::{Value, json};

fn start(model: &str, extra: &[&str]) -> Result<Server> {
    let mut args = vec![
        "--model-path",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "2048",
        "--kv-cache-dtype",
        "f32",
        "--enable-metrics",
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

async fn check_greedy(
    c: &reqwest::Client,
    s: &Server,
    name: &str,
    reference: &Value,
) -> Result<()> {
    let prompts = reference["prompts"].as_array().map_or(&[][..], |v| v);
    ensure!(!prompts.is_empty(), "{name}: no prompts");
    for (i, p) in prompts.iter().enumerate() {
        let r = generate_greedy(c, s, &p["input_ids"], &json!(32)).await?;
        let got = r["output_ids"].as_array().context("output_ids")?;
        let want = p["greedy_ids"].as_array().context("greedy_ids")?;
        let margins = p["margins"].as_array().context("margins")?;
        let sure = margins
            .iter()
            .position(|m| m.as_f64().unwrap_or(0.0) < 1e-3)
            .unwrap_or(want.len());
        assert_eq!(
            got[..sure],
            want[..sure],
            "{name} prompt {i} (up to step {sure})"
        );
    }
    assert_no_leak(c, s, "arbor", None).await
}

/// Pre-quantized checkpoints (block FP8, AWQ, NVFP4, and DeepSeek-V3's
/// block FP8 with latent attention and experts) serve the completions of
/// their references and return every KV page.
#[tokio::test]
async fn quantized_checkpoints_serve_their_reference_completions() -> Result<()> {
    let c = client();
    for (name, summary) in [
        ("quant/fp8-block", "f8_s32 (fp8)"),
        ("quant/awq", "u4_s32 (awq)"),
        ("quant/nvfp4", "f4_s16 (modelopt)"),
        ("quant/deepseek-v3-fp8-block", "f8_s32 (fp8)"),
    ] {
        let model = fixture(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{model}/reference.json"))?)?;
        let s = start(&model, &["--dtype", "f32"])?;
        assert!(s.log_contains(summary), "{name}: {}", s.logs());
        check_greedy(&c, &s, name, &reference).await?;
    }
    Ok(())
}

#[tokio::test]
async fn quantization_fp8_quantizes_a_float_checkpoint_at_load() -> Result<()> {
    let c = client();
    let model = fixture("tiny-llama");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("quant/fp8-online.json"))?)?;
    let s = start(&model, &["--dtype", "f32", "--quantization", "fp8"])?;
    assert!(s.log_contains("f8_s32 (fp8)"), "{}", s.logs());
    check_greedy(&c, &s, "fp8-online", &reference).await
}

/// `--quantization w8a8_fp8` on a float checkpoint, over a
/// compressed-tensors FP8 one and over ones with static input scales (which
/// the log says it uses; a dense model and a MoE one), alone and over two
/// tensor-parallel ranks:
/// the summary names the W8A8 blocks, and the completions of the prompts
/// whose inputs lie clear of E4M3 rounding midpoints (`closest_tie`, see
/// arbor-models' quantized tests) follow the numpy W8A8 reference.
#[tokio::test]
async fn quantization_w8a8_fp8_serves_its_reference_completions() -> Result<()> {
    let c = client();
    for (model, reference) in [
        ("tiny-llama", "quant/w8a8-online.json"),
        ("quant/fp8-dynamic", "quant/fp8-dynamic/w8a8-reference.json"),
        ("quant/fp8-static", "quant/fp8-static/w8a8-reference.json"),
        (
            "quant/moe-fp8-static",
            "quant/moe-fp8-static/w8a8-reference.json",
        ),
    ] {
        let mut reference: Value =
            serde_json::from_str(&std::fs::read_to_string(fixture(reference))?)?;
        if let Some(ps) = reference["prompts"].as_array_mut() {
            ps.retain(|p| p["closest_tie"].as_f64().unwrap_or(0.0) >= 1e-6);
        }
        let s = start(
            &fixture(model),
            &["--dtype", "f32", "--quantization", "w8a8_fp8"],
        )?;
        let summary = match model {
            "quant/fp8-static" => "f8a8_s32 (w8a8_fp8, 21 layers with static input scales)",
            "quant/moe-fp8-static" => "f8a8_s32 (w8a8_fp8, 60 layers with static input scales)",
            _ => "f8a8_s32 (w8a8_fp8)",
        };
        assert!(s.log_contains(summary), "{model}: {}", s.logs());
        check_greedy(&c, &s, model, &reference).await?;
    }
    // Over two tensor-parallel ranks each rank's share of down_proj has 80
    // inputs, not whole runs of 32: that layer keeps f32 inputs, and says so.
    let s = start(
        &fixture("tiny-llama"),
        &[
            "--dtype",
            "f32",
            "--quantization",
            "w8a8_fp8",
            "--tp-size",
            "2",
        ],
    )?;
    assert!(
        s.log_contains("'model.layers.0.mlp.down_proj' keeps f32 inputs: its 80 inputs"),
        "{}",
        s.logs()
    );
    Ok(())
}

/// A pre-quantized checkpoint over two tensor-parallel ranks
/// (`--tp-size 2`; tp-fp8: compressed-tensors FP8, tp-gptq8: 8-bit GPTQ,
/// each linear splitting into whole blocks of 32 inputs; moe-fp8-static
/// with its experts partitioned, `--ep-size 2`) serves the completions of
/// its numpy reference, and returns every KV page.
#[tokio::test]
async fn pre_quantized_checkpoints_serve_over_two_ranks() -> Result<()> {
    let c = client();
    for (name, summary, ep) in [
        ("quant/tp-fp8", "f8_s32 (compressed-tensors)", "1"),
        ("quant/tp-gptq8", "u8_s32 (gptq)", "1"),
        // Whole experts per rank (their 32 inputs would not split into
        // whole blocks).
        ("quant/moe-fp8-static", "f8_s32 (compressed-tensors)", "2"),
    ] {
        let model = fixture(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{model}/reference.json"))?)?;
        let args = ["--dtype", "f32", "--tp-size", "2", "--ep-size", ep];
        let s = start(&model, &args)?;
        assert!(s.log_contains(summary), "{name}: {}", s.logs());
        check_greedy(&c, &s, name, &reference).await?;
    }
    Ok(())
}

#[test]
fn conflicting_or_unknown_quantization_is_refused() -> Result<()> {
    for (model, flag, needle) in [
        ("quant/awq", "gptq", "quantized with 'awq'"),
        ("tiny-llama", "int3", "--quantization"),
    ] {
        let err = match start(&fixture(model), &["--quantization", flag]) {
            Ok(s) => panic!("{model} with --quantization {flag} started: {}", s.logs()),
            Err(e) => format!("{e:#}"),
        };
        assert!(err.contains(needle), "{model} {flag}: {err}");
    }
    Ok(())
}

/// `--cpu-quant-matmul amx-bf16` (or `[model] cpu_quant_matmul`): the
/// summary says which matmul runs (with the reason on a CPU without AMX,
/// where it is f32), each prompt's greedy completion is the same alone and
/// with all the prompts sent at once (the mode is fixed for the server, so
/// batching changes no bit), completions follow the transformers reference
/// up to its first step with a margin under 0.3 (the bf16 tolerance of
/// arbor-models' `amx_bf16_matmul_stays_close_to_each_formats_reference`),
/// no KV page leaks, and a bad value is refused naming the flag and key.
#[tokio::test]
async fn amx_bf16_matmul_serves_the_same_tokens_alone_and_batched() -> Result<()> {
    let c = client();
    let model = fixture("quant/awq");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{model}/reference.json"))?)?;
    let dir = tempfile::tempdir()?;
    let toml = dir.path().join("arbor.toml");
    std::fs::write(&toml, "[model]\ncpu_quant_matmul = \"amx-bf16\"\n")?;
    let toml = toml.display().to_string();
    for extra in [
        &["--cpu-quant-matmul", "amx-bf16"][..],
        &["--config", &toml][..],
    ] {
        let s = start(&model, extra)?;
        assert!(
            s.log_contains(", quant matmul amx-bf16)")
                || s.log_contains(", quant matmul f32 (amx-bf16 needs AMX-BF16"),
            "{extra:?}: {}",
            s.logs()
        );
        let prompts = reference["prompts"].as_array().context("prompts")?;
        let len = json!(24);
        let mut alone = Vec::new();
        for p in prompts {
            let r = generate_greedy(&c, &s, &p["input_ids"], &len).await?;
            alone.push(r["output_ids"].clone());
        }
        let together = futures_util::future::try_join_all(
            prompts
                .iter()
                .map(|p| generate_greedy(&c, &s, &p["input_ids"], &len)),
        )
        .await?;
        for (i, (r, p)) in together.iter().zip(prompts).enumerate() {
            assert_eq!(r["output_ids"], alone[i], "prompt {i}: batched vs alone");
            let want = p["greedy_ids"].as_array().context("greedy_ids")?;
            let margins = p["margins"].as_array().context("margins")?;
            let sure = margins
                .iter()
                .position(|m| m.as_f64().unwrap_or(0.0) < 0.3)
                .unwrap_or(want.len())
                .min(24);
            let got = r["output_ids"].as_array().context("output_ids")?;
            assert_eq!(got[..sure], want[..sure], "prompt {i} (up to step {sure})");
        }
        assert_no_leak(&c, &s, "arbor", None).await?;
    }
    assert_serve_refuses(&["--cpu-quant-matmul", "fast"], "--cpu-quant-matmul")?;
    assert_serve_refuses(&["--cpu-quant-matmul", "fast"], "must be f32 or amx-bf16")
}
