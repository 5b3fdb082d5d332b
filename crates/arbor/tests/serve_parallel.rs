//! End to end: `arbor serve --tp-size 2` (and `--ep-size 2` for a
//! mixture-of-experts model) on the tiny fixtures serves the greedy
//! completions transformers computed (reference.json) over HTTP, reports
//! the parallelism in /get_server_info and the start-up summary, returns
//! every KV page, and refuses what does not run with it (a tp size that does
//! not divide the heads, an ep size other than 1 or tp, speculative decoding).

mod common;

use anyhow::{Context, Result};
use common::*;
use serde_json::{Value, json};

async fn check(model: &str, extra: &[&str]) -> Result<()> {
    let path = fixture(model);
    let mut args = vec![
        "--model-path",
        &path,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "2",
        "--max-total-tokens",
        "2048",
        "--kv-cache-dtype",
        "f32",
        "--chunked-prefill-size",
        "16",
        "--enable-metrics",
    ];
    args.extend_from_slice(extra);
    let s = Server::start(&args)?;
    assert!(s.log_contains("tensor-parallel 2 ranks"), "{}", s.logs());
    let c = client();
    let info: Value = c
        .get(s.url("/get_server_info"))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(info["tp_size"], 2);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{path}/reference.json"))?)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let bodies: Vec<Value> = prompts
        .iter()
        .map(|p| {
            json!({
                "input_ids": p["input_ids"],
                "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true},
            })
        })
        .collect();
    // All prompts at once: one batch over both ranks.
    let answers = futures_util::future::join_all(
        bodies
            .iter()
            .map(|b| c.post(s.url("/generate")).json(b).send()),
    )
    .await;
    for (i, (a, p)) in answers.into_iter().zip(prompts).enumerate() {
        let r: Value = a?.json().await?;
        assert_eq!(
            r["output_ids"], p["greedy_ids"],
            "{model} {extra:?} prompt {i}"
        );
    }
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn tensor_parallel_serves_the_reference_completions() -> Result<()> {
    check("tiny-qwen3", &["--tp-size", "2"]).await?;
    check("tiny-qwen3-moe", &["--tp-size", "2", "--ep-size", "2"]).await
}

#[test]
fn unsupported_parallel_settings_are_refused() -> Result<()> {
    assert_serve_refuses(&["--tp-size", "3"], "--tp-size 3 does not divide")?;
    assert_serve_refuses(
        &["--tp-size", "2", "--ep-size", "3"],
        "ep_size / --ep-size must be 1 or equal tp_size (2)",
    )?;
    assert_serve_refuses(
        &["--tp-size", "2", "--ep-size", "2"],
        "--ep-size applies to mixture-of-experts models only",
    )?;
    assert_serve_refuses(
        &["--tp-size", "2", "--speculative-algorithm", "NGRAM"],
        "--speculative-algorithm does not run with --tp-size > 1",
    )
}
