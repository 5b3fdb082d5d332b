//! `arbor serve --speculative-algorithm NGRAM | LAYERSKIP | STANDALONE |
//! EAGLE | EAGLE3 | NEXTN` end to end on the tiny Llama (STANDALONE drafts with
//! tiny-mistral, which shares its vocabulary; EAGLE (with trees) and EAGLE3
//! with the seeded heads of tests/fixtures/eagle-tiny-llama and
//! eagle3-tiny-llama; NEXTN with the MTP layer of
//! tests/fixtures/tiny-llama-mtp): greedy answers equal those of a server without
//! speculation (native and OpenAI routes, streamed and not), `meta_info` reports SGLang's
//! `spec_verify_ct` and `spec_accept_length`, Prometheus shows the draft
//! counters, bad flags are refused naming the flag, and no KV page leaks.

mod common;

use anyhow::Result;
use common::*;
use serde_json::{Value, json};

/// Prompts whose continuation copies from the prompt (n-gram friendly),
/// plus a free-form one.
fn prompts() -> Vec<String> {
    let phrase = "the quick brown fox jumps over the lazy dog and then";
    vec![
        format!("{phrase} {phrase} {phrase} {phrase}"),
        "alpha beta gamma delta alpha beta gamma delta alpha beta gamma".into(),
        "1 2 3 4 5 6 7 8 9 10 1 2 3 4 5 6 7 8 9 10 1 2 3".into(),
        "hello world".into(),
    ]
}

async fn answers(c: &reqwest::Client, s: &Server) -> Result<Vec<(String, Value)>> {
    let mut out = Vec::new();
    for p in prompts() {
        let v = post_ok(
            c,
            &s.url("/generate"),
            &json!({"text": p, "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true}}),
        )
        .await?;
        out.push((
            v["text"].as_str().unwrap_or_default().to_string(),
            meta(&v).clone(),
        ));
        let v = post_ok(
            c,
            &s.url("/v1/completions"),
            &json!({"model": "m", "prompt": p, "max_tokens": 24, "temperature": 0}),
        )
        .await?;
        out.push((
            v["choices"][0]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            Value::Null,
        ));
    }
    // Several at once, streamed.
    let mut handles = Vec::new();
    for p in prompts() {
        let c = c.clone();
        let url = s.url("/generate");
        handles.push(tokio::spawn(async move {
            sse(
                &c,
                &url,
                &json!({"text": p, "stream": true, "sampling_params": {"max_new_tokens": 20, "temperature": 0}}),
            )
            .await
        }));
    }
    for h in handles {
        let events = h.await??;
        let last = events.last().cloned().unwrap_or(Value::Null);
        out.push((
            last["text"].as_str().unwrap_or_default().to_string(),
            Value::Null,
        ));
    }
    Ok(out)
}

#[tokio::test]
async fn ngram_speculation_changes_no_answer() -> Result<()> {
    speculation_changes_no_answer(&["NGRAM", "--speculative-num-draft-tokens", "6"]).await
}

#[tokio::test]
async fn layer_skip_changes_no_answer() -> Result<()> {
    speculation_changes_no_answer(&["LAYERSKIP", "--speculative-draft-layers", "2"]).await
}

#[tokio::test]
async fn standalone_draft_model_changes_no_answer() -> Result<()> {
    let draft = fixture("tiny-mistral");
    speculation_changes_no_answer(&[
        "STANDALONE",
        "--speculative-draft-model-path",
        &draft,
        "--speculative-num-steps",
        "3",
    ])
    .await
}

#[tokio::test]
async fn eagle3_head_changes_no_answer() -> Result<()> {
    let head = fixture("eagle3-tiny-llama");
    speculation_changes_no_answer(&["EAGLE3", "--speculative-draft-model-path", &head]).await
}

#[tokio::test]
async fn eagle_head_changes_no_answer() -> Result<()> {
    let head = fixture("eagle-tiny-llama");
    speculation_changes_no_answer(&[
        "EAGLE",
        "--speculative-draft-model-path",
        &head,
        "--speculative-eagle-topk",
        "2",
    ])
    .await
}

/// The EAGLE head as published heads ship (pytorch_model.bin), and a
/// STANDALONE draft folder of pytorch_model.bin shards.
#[tokio::test]
async fn pytorch_bin_drafters_change_no_answer() -> Result<()> {
    let head = fixture("eagle-tiny-llama-bin");
    speculation_changes_no_answer(&["EAGLE", "--speculative-draft-model-path", &head]).await?;
    let draft = fixture("tiny-llama-bin");
    speculation_changes_no_answer(&["STANDALONE", "--speculative-draft-model-path", &draft]).await
}

#[tokio::test]
async fn nextn_layer_changes_no_answer() -> Result<()> {
    // tiny-llama-mtp holds tiny-llama's weights plus one MTP layer.
    let mtp = fixture("tiny-llama-mtp");
    speculation_changes_no_answer(&["NEXTN", "--speculative-draft-model-path", &mtp]).await
}

/// Answers with `--speculative-algorithm` and `spec` equal those without.
async fn speculation_changes_no_answer(spec: &[&str]) -> Result<()> {
    let c = client();
    let plain = Server::tiny(&["--served-model-name", "m"])?;
    let want = answers(&c, &plain).await?;
    assert_no_leak(&c, &plain, "arbor", None).await?;
    drop(plain);

    let mut args = vec!["--served-model-name", "m", "--speculative-algorithm"];
    args.extend_from_slice(spec);
    let spec = Server::tiny(&args)?;
    let got = answers(&c, &spec).await?;
    for (i, ((w, _), (g, m))) in want.iter().zip(&got).enumerate() {
        assert_eq!(w, g, "answer {i} changed under speculation");
        if !m.is_null() {
            let ct = m["spec_verify_ct"].as_u64().unwrap_or(0);
            let len = m["spec_accept_length"].as_f64().unwrap_or(0.0);
            assert!(ct > 0 && len >= 1.0, "meta_info {m}");
        }
    }
    let (_, metrics) = get(&c, &spec.url("/metrics"), None).await?;
    let drafted = metric(&metrics, "arbor:spec_draft_tokens_total").unwrap_or(0.0);
    let accepted = metric(&metrics, "arbor:spec_accepted_tokens_total").unwrap_or(-1.0);
    assert!(drafted > 0.0 && accepted >= 0.0, "{drafted} {accepted}");
    assert!(metric(&metrics, "arbor:spec_accept_length").is_some());
    assert_no_leak(&c, &spec, "arbor", None).await?;
    Ok(())
}

#[test]
fn bad_speculative_flags_are_refused() -> Result<()> {
    let qwen2 = fixture("tiny-qwen2");
    let mistral = fixture("tiny-mistral");
    for (args, needle) in [
        (
            vec![
                "--speculative-algorithm",
                "NGRAM",
                "--speculative-num-draft-tokens",
                "0",
            ],
            "--speculative-num-draft-tokens",
        ),
        (
            vec![
                "--speculative-algorithm",
                "NGRAM",
                "--speculative-num-draft-tokens",
                "65",
            ],
            "--speculative-num-draft-tokens",
        ),
        (
            vec!["--speculative-algorithm", "EAGLE"],
            "--speculative-draft-model-path",
        ),
        // The target (tiny-llama) has no next-n prediction layer.
        (
            vec!["--speculative-algorithm", "NEXTN"],
            "num_nextn_predict_layers",
        ),
        (
            vec!["--speculative-algorithm", "EAGLE3"],
            "--speculative-draft-model-path",
        ),
        (
            vec![
                "--speculative-algorithm",
                "EAGLE3",
                "--speculative-draft-model-path",
                &mistral,
            ],
            "LlamaForCausalLMEagle3",
        ),
        (
            vec!["--speculative-algorithm", "STANDALONE"],
            "--speculative-draft-model-path",
        ),
        (
            vec![
                "--speculative-algorithm",
                "STANDALONE",
                "--speculative-draft-model-path",
                "/nonexistent/draft",
            ],
            "no such file",
        ),
        (
            vec![
                "--speculative-algorithm",
                "STANDALONE",
                "--speculative-draft-model-path",
                &qwen2,
            ],
            "tokenizer",
        ),
        (
            vec!["--speculative-algorithm", "LAYERSKIP"],
            "--speculative-draft-layers",
        ),
        (
            vec![
                "--speculative-algorithm",
                "LAYERSKIP",
                "--speculative-draft-layers",
                "3",
            ],
            "--speculative-draft-layers",
        ),
        (
            vec![
                "--speculative-algorithm",
                "NGRAM",
                "--speculative-draft-layers",
                "1",
            ],
            "LAYERSKIP only",
        ),
        (
            vec!["--speculative-algorithm", "medusa"],
            "--speculative-algorithm",
        ),
        (
            vec![
                "--speculative-algorithm",
                "NGRAM",
                "--speculative-ngram-match-type",
                "DFS",
            ],
            "--speculative-ngram-match-type",
        ),
    ] {
        assert_serve_refuses(&args, needle)?;
    }
    Ok(())
}

/// NEXTN on a DeepSeek-V3 checkpoint (latent attention, experts, its MTP
/// layer a whole DeepSeek decoder layer), on one device and over two
/// tensor-parallel ranks (the latent cache replicated, the experts split,
/// the MTP layer whole on rank 0 with the LM head gathered there): the
/// served greedy continuations are transformers' for the target
/// (tiny-deepseek-v3's reference.json, the same weights), the drafts are
/// verified, and no KV page leaks.
#[tokio::test]
async fn deepseek_nextn_keeps_the_reference_continuations() -> Result<()> {
    let model = fixture("tiny-deepseek-v3-mtp");
    for tp in ["1", "2"] {
        let s = Server::start(&[
            "--model-path",
            &model,
            "--port",
            "0",
            "--threads",
            "2",
            "--tp-size",
            tp,
            "--max-total-tokens",
            "2048",
            "--kv-cache-dtype",
            "f32",
            "--enable-metrics",
            "--speculative-algorithm",
            "NEXTN",
        ])?;
        let c = client();
        let reference: Value = serde_json::from_str(&std::fs::read_to_string(fixture(
            "tiny-deepseek-v3/reference.json",
        ))?)?;
        for (i, p) in reference["prompts"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let v = post_ok(
                &c,
                &s.url("/generate"),
                &json!({"input_ids": p["input_ids"], "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true}}),
            )
            .await?;
            assert_eq!(
                v["output_ids"], p["greedy_ids"],
                "prompt {i} under NEXTN at --tp-size {tp}"
            );
        }
        let (_, metrics) = get(&c, &s.url("/metrics"), None).await?;
        assert!(metric(&metrics, "arbor:spec_draft_tokens_total").unwrap_or(0.0) > 0.0);
        assert_no_leak(&c, &s, "arbor", None).await?;
    }
    Ok(())
}
