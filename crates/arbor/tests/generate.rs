//! `arbor generate` end to end: the binary streams the greedy continuation
//! that Hugging Face transformers wrote into each tiny fixture's
//! `reference.json` (an independent implementation) with the default KV
//! cache (f16 on the CPU), then prints the token counts and prefill/decode
//! speeds; bad arguments get a clear error.
//! Speed is printed, never asserted.

mod common;

use anyhow::{Context, Result};
use common::*;
use serde_json::Value;
use std::process::Command;

/// Text without U+FFFD: transformers decodes a broken UTF-8 sequence to
/// replacement characters, while Arbor's streaming detokenizer never emits
/// one mid-sequence; the rest of the text must agree exactly.
fn clean(s: &str) -> String {
    s.chars().filter(|&c| c != '\u{fffd}').collect()
}

#[test]
fn generate_streams_the_transformers_greedy_continuation() -> Result<()> {
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3"] {
        let dir = fixture(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/reference.json"))?)?;
        let max_new = reference["max_new_tokens"]
            .as_u64()
            .context("max_new_tokens")?;
        let p = &reference["prompts"][0];
        let prompt = p["text"].as_str().context("text")?;
        let out = Command::new(BIN)
            .args([
                "generate",
                "--model-path",
                &dir,
                "--threads",
                "1",
                "--ignore-eos",
            ])
            .args(["--max-new-tokens", &max_new.to_string(), "--prompt", prompt])
            .output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{name}: {stderr}");
        let want = p["greedy_text"].as_str().context("greedy_text")?;
        assert_eq!(clean(&stdout), clean(want), "{name}: streamed text");
        let ids = p["input_ids"].as_array().context("input_ids")?.len();
        assert!(
            stderr.contains(&format!(
                "prompt tokens: {ids}, generated tokens: {max_new}"
            )),
            "{name}: {stderr}"
        );
        assert!(
            stderr.contains("prefill:") && stderr.contains("decode:"),
            "{stderr}"
        );
    }
    // Bad input: a missing model folder, and a request past the context.
    let out = Command::new(BIN)
        .args([
            "generate",
            "--model-path",
            "/nonexistent/model",
            "--prompt",
            "x",
        ])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("/nonexistent/model"), "{err}");
    let out = Command::new(BIN)
        .args([
            "generate",
            "--model-path",
            &fixture("tiny-llama"),
            "--prompt",
            "x",
        ])
        .args(["--max-new-tokens", "100000"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("exceed the model's context"), "{err}");
    let out = Command::new(BIN)
        .args([
            "generate",
            "--model-path",
            &fixture("tiny-llama"),
            "--prompt",
            "x",
        ])
        .args(["--kv-cache-dtype", "fp4"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--kv-cache-dtype")
            && err.contains("auto, f32, f16, bf16, fp8_e4m3 or fp8_e5m2"),
        "{err}"
    );
    Ok(())
}
