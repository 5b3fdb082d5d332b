//! End to end: `arbor serve --tp-size 2` (and `--ep-size 2` for a
//! mixture-of-experts model, with the experts' shares all-reduced and with
//! `--moe-a2a-backend all-to-all`) on the tiny fixtures serves the greedy
//! completions transformers computed (reference.json) over HTTP, reports
//! the parallelism in /get_server_info and the start-up summary, counts the
//! tokens routed to each expert in /metrics, returns
//! every KV page, runs every speculative algorithm over the ranks with the
//! reference answers (NGRAM, STANDALONE, LAYERSKIP, and the EAGLE, EAGLE3
//! and NEXTN heads on rank 0; DeepSeek's NEXTN at `--tp-size 2` is in
//! serve_speculative), serves them from `--dp-size 2` replicas (alone and
//! as two tensor-parallel groups) and with `--enable-dp-attention` on the
//! DeepSeek (MLA) fixtures, and refuses what does not run with it
//! (a tp size that does not divide the heads, an ep size other than 1 or
//! tp, a dp size of 0, an unknown load-balance method, LoRA adapters with
//! several replicas).

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
    let a2a = if extra.contains(&"all-to-all") {
        "all-to-all"
    } else {
        "none"
    };
    assert_eq!(info["moe_a2a_backend"], a2a, "{info}");
    let reference = reference_json(&path)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    // All prompts at once: one batch over both ranks.
    let tokens = json!(32);
    let answers = futures_util::future::join_all(
        prompts
            .iter()
            .map(|p| generate_greedy(&c, &s, &p["input_ids"], &tokens)),
    )
    .await;
    for (i, (a, p)) in answers.into_iter().zip(prompts).enumerate() {
        let r = a?;
        assert_eq!(
            r["output_ids"], p["greedy_ids"],
            "{model} {extra:?} prompt {i}"
        );
    }
    if let Some(top_k) = reference["num_experts_per_tok"].as_u64() {
        // Every computed token (the prompt and all but the last generated
        // one) was routed to top_k experts of layer 0.
        let computed: u64 = prompts
            .iter()
            .map(|p| p["input_ids"].as_array().map_or(0, |a| a.len() as u64) + 31)
            .sum();
        let want = (top_k * computed) as f64;
        let mut got = 0.0;
        for _ in 0..50 {
            let text = c.get(s.url("/metrics")).send().await?.text().await?;
            got = text
                .lines()
                .filter(|l| {
                    l.starts_with("arbor:moe_expert_tokens_total{") && l.contains("layer=\"0\"")
                })
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum();
            if got == want {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
        assert_eq!(got, want, "{model}: tokens routed in layer 0");
    }
    assert_no_leak(&c, &s, "arbor", None).await
}

#[tokio::test]
async fn tensor_parallel_serves_the_reference_completions() -> Result<()> {
    check("tiny-qwen3", &["--tp-size", "2"]).await?;
    check("tiny-qwen3-moe", &["--tp-size", "2", "--ep-size", "2"]).await?;
    check(
        "tiny-qwen3-moe",
        &[
            "--tp-size",
            "2",
            "--ep-size",
            "2",
            "--moe-a2a-backend",
            "all-to-all",
        ],
    )
    .await
}

/// `--dp-size 2`: two replicas of the model behind one server (each its own
/// scheduler and KV cache; the second case is two tensor-parallel groups
/// of two ranks, four ranks in all) serve the reference completions, every
/// replica takes requests (`/get_load` has one entry per replica), and every
/// replica's KV pages come back.
#[tokio::test]
async fn data_parallel_replicas_serve_the_reference_completions() -> Result<()> {
    check_data_parallel(
        "tiny-qwen3",
        &["--dp-size", "2"],
        "data-parallel: 2 replicas",
    )
    .await?;
    check_data_parallel(
        "tiny-qwen3-moe",
        &[
            "--dp-size",
            "2",
            "--load-balance-method",
            "shortest_queue",
            "--tp-size",
            "2",
            "--ep-size",
            "2",
        ],
        "data-parallel: 2 replicas",
    )
    .await
}

/// `--enable-dp-attention` on the latent-attention (MLA) models: two ranks,
/// each running attention whole for its own requests with its own latent
/// KV cache, the feed-forward (dense layers, shared and routed experts)
/// split over both and run on both ranks' tokens, serve the reference
/// completions, whether both ranks have requests in a step or one of them
/// only joins the feed-forward with no tokens of its own.
#[tokio::test]
async fn data_parallel_attention_serves_the_reference_completions() -> Result<()> {
    let line = "data-parallel attention: 2 ranks";
    let dpa = ["--dp-size", "2", "--tp-size", "2", "--enable-dp-attention"];
    check_data_parallel("tiny-deepseek-v2", &dpa, line).await?;
    let mut ep = dpa.to_vec();
    ep.extend(["--ep-size", "2", "--load-balance-method", "minimum_tokens"]);
    check_data_parallel("tiny-deepseek-v3", &ep, line).await
}

/// Serves `model` with `extra` (two data-parallel ranks), checks the start-up
/// line, the reference completions all at once and one at a time, that both
/// ranks served, a weight update (refused with data-parallel attention), and
/// that no page leaks.
async fn check_data_parallel(model: &str, extra: &[&str], line: &str) -> Result<()> {
    let path = fixture(model);
    let mut args = vec![
        "--model-path",
        &path,
        "--port",
        "0",
        "--threads",
        "2",
        "--max-total-tokens",
        "1024",
        "--kv-cache-dtype",
        "f32",
        "--enable-metrics",
    ];
    args.extend_from_slice(extra);
    let s = Server::start(&args)?;
    assert!(s.log_contains(line), "{}", s.logs());
    let c = client();
    let info: Value = c
        .get(s.url("/get_server_info"))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(info["dp_size"], 2, "{info}");
    // Each rank holds --max-total-tokens.
    assert_eq!(info["max_total_num_tokens"], 2048, "{info}");
    assert_eq!(info["internal_states"].as_array().map(Vec::len), Some(2));
    let reference = reference_json(&path)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let tokens = json!(32);
    let answers = futures_util::future::join_all(
        prompts
            .iter()
            .map(|p| generate_greedy(&c, &s, &p["input_ids"], &tokens)),
    )
    .await;
    for (i, (a, p)) in answers.into_iter().zip(prompts).enumerate() {
        assert_eq!(a?["output_ids"], p["greedy_ids"], "{model} prompt {i}");
    }
    // One at a time: the other rank is idle (or holds only a cached prefix).
    for (i, p) in prompts.iter().enumerate() {
        let r = generate_greedy(&c, &s, &p["input_ids"], &tokens).await?;
        assert_eq!(
            r["output_ids"], p["greedy_ids"],
            "{model} alone, prompt {i}"
        );
    }
    let load: Value = c.get(s.url("/get_load")).send().await?.json().await?;
    let ranks = load.as_array().context("get_load")?;
    assert_eq!(ranks.len(), 2, "{load}");
    let served: Vec<u64> = ranks
        .iter()
        .map(|r| r["num_requests_total"].as_u64().unwrap_or(0))
        .collect();
    assert_eq!(
        served.iter().sum::<u64>(),
        2 * prompts.len() as u64,
        "{load}"
    );
    assert!(served.iter().all(|&n| n > 0), "{model}: {load}");
    check_pinned_requests(&c, &s, &prompts[0]).await?;
    // A weight update (the same weights again): every replica loads its own
    // copy, a tensor-parallel replica a shard per rank (experts partitioned
    // as at start-up); data-parallel attention ranks refuse it. Either way
    // the server goes on serving the reference completions.
    let r = c
        .post(s.url("/update_weights_from_disk"))
        .json(&json!({"model_path": path}))
        .send()
        .await?;
    let status = r.status();
    let body = r.text().await?;
    if extra.contains(&"--enable-dp-attention") {
        assert_eq!(status, 400, "{body}");
        assert!(
            body.contains("weight updates with --enable-dp-attention"),
            "{body}"
        );
    } else {
        assert_eq!(status, 200, "{body}");
    }
    let again = generate_greedy(&c, &s, &prompts[0]["input_ids"], &tokens).await?;
    assert_eq!(again["output_ids"], prompts[0]["greedy_ids"]);
    assert_no_leak(&c, &s, "arbor", None).await
}

/// Requests received by each data-parallel rank so far (`/get_load`).
async fn served_by_rank(c: &reqwest::Client, s: &Server) -> Result<Vec<u64>> {
    let load: Value = c.get(s.url("/get_load")).send().await?.json().await?;
    Ok(load
        .as_array()
        .context("get_load")?
        .iter()
        .map(|r| r["num_requests_total"].as_u64().unwrap_or(0))
        .collect())
}

/// SGLang's `data_parallel_rank` pins a request to a replica, on the native
/// and the OpenAI APIs, with the reference output; a rank the server does
/// not have is a 400 that names it.
async fn check_pinned_requests(c: &reqwest::Client, s: &Server, prompt: &Value) -> Result<()> {
    let before = served_by_rank(c, s).await?;
    let mut body = json!({
        "input_ids": prompt["input_ids"],
        "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true},
        "data_parallel_rank": 1,
    });
    for _ in 0..3 {
        let r: Value = c
            .post(s.url("/generate"))
            .json(&body)
            .send()
            .await?
            .json()
            .await?;
        assert_eq!(r["output_ids"], prompt["greedy_ids"], "{r}");
    }
    let text = "The capital of France is";
    for (path, input) in [
        ("/v1/completions", json!({"prompt": text})),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": text}]}),
        ),
    ] {
        let mut req = json!({"max_tokens": 4, "temperature": 0, "data_parallel_rank": 0});
        req.as_object_mut()
            .context("an object")?
            .extend(input.as_object().cloned().unwrap_or_default());
        let r = c.post(s.url(path)).json(&req).send().await?;
        assert_eq!(r.status(), 200, "{path}: {}", r.text().await?);
    }
    let after = served_by_rank(c, s).await?;
    assert_eq!(after[0] - before[0], 2, "{before:?} -> {after:?}");
    assert_eq!(after[1] - before[1], 3, "{before:?} -> {after:?}");
    body["data_parallel_rank"] = json!(2);
    let r = c.post(s.url("/generate")).json(&body).send().await?;
    assert_eq!(r.status(), 400);
    let text = r.text().await?;
    assert!(
        text.contains(
            "'data_parallel_rank' 2 is out of range: this engine has 2 data-parallel ranks"
        ),
        "{text}"
    );
    body["data_parallel_rank"] = json!(-1);
    let r = c.post(s.url("/generate")).json(&body).send().await?;
    assert_eq!(r.status(), 400, "{}", r.text().await?);
    Ok(())
}

#[test]
fn unsupported_parallel_settings_are_refused() -> Result<()> {
    assert_serve_refuses(
        &["--tp-size", "3"],
        "[parallel] tp_size / --tp-size: 3 does not divide",
    )?;
    assert_serve_refuses(
        &["--tp-size", "2", "--ep-size", "3"],
        "ep_size / --ep-size must be 1 or equal tp_size (2)",
    )?;
    assert_serve_refuses(
        &["--tp-size", "2", "--ep-size", "2"],
        "--ep-size: applies to mixture-of-experts models only",
    )?;
    assert_serve_refuses(
        &["--tp-size", "2", "--moe-a2a-backend", "all-to-all"],
        "--moe-a2a-backend all-to-all needs ep_size / --ep-size > 1",
    )?;
    assert_serve_refuses(
        &[
            "--tp-size",
            "2",
            "--ep-size",
            "2",
            "--moe-a2a-backend",
            "deepep",
        ],
        "unknown backend 'deepep'",
    )?;
    assert_serve_refuses(
        &["--dp-size", "0"],
        "dp_size / --dp-size must be at least 1",
    )?;
    assert_serve_refuses(
        &["--dp-size", "2", "--load-balance-method", "cache_aware"],
        "unknown load balance method 'cache_aware'",
    )?;
    assert_serve_refuses(
        &["--dp-size", "2", "--enable-dp-attention"],
        "--enable-dp-attention needs dp_size / --dp-size equal to tp_size",
    )?;
    assert_serve_refuses(
        &[
            "--dp-size",
            "2",
            "--tp-size",
            "2",
            "--enable-dp-attention",
            "--speculative-algorithm",
            "NGRAM",
        ],
        "speculative decoding with --enable-dp-attention",
    )
}

/// NGRAM speculation (drafts from the token history) over two ranks: the
/// reference completions, with drafts accepted (fewer verify steps than
/// tokens).
#[tokio::test]
async fn tensor_parallel_runs_ngram_speculation_losslessly() -> Result<()> {
    let (steps, tokens) = speculate_under_tp2(
        "tiny-qwen3",
        &["NGRAM", "--speculative-num-draft-tokens", "4"],
    )
    .await?;
    assert!(
        steps < tokens,
        "no draft accepted: {steps} verify steps for {tokens} tokens"
    );
    Ok(())
}

/// STANDALONE speculation over two ranks: the draft model runs whole on
/// rank 0's device and the group verifies. The draft is tiny-llama itself,
/// unsharded (so most drafts are accepted and verification keeps several
/// tokens a step), then tiny-mistral (the same tokenizer, other weights:
/// most drafts rejected); the greedy answers equal transformers' for
/// tiny-llama either way.
#[tokio::test]
async fn tensor_parallel_runs_a_standalone_draft_model_losslessly() -> Result<()> {
    for (draft, most_steps) in [("tiny-llama", 47), ("tiny-mistral", 96)] {
        let draft = fixture(draft);
        let args = [
            "STANDALONE",
            "--speculative-draft-model-path",
            &draft,
            "--speculative-num-steps",
            "3",
        ];
        let (steps, tokens) = speculate_under_tp2("tiny-llama", &args).await?;
        assert_eq!(tokens, 96);
        assert!(
            steps <= most_steps,
            "{draft}: {steps} verify steps for {tokens} tokens"
        );
    }
    Ok(())
}

/// LAYERSKIP over two ranks: the draft forwards run the target's first two
/// of three layers on both ranks (each over its heads and KV shard). The
/// reference completions, with drafts accepted as on one rank (how many
/// depends on the draft lengths the scheduler's cost model picks from
/// measured step times, so the counts are printed, not compared). The draft
/// logits themselves are compared with one rank's in arbor-models'
/// `tensor_parallel` tests.
#[tokio::test]
async fn tensor_parallel_runs_layerskip_over_every_rank() -> Result<()> {
    let args = [
        "LAYERSKIP",
        "--speculative-draft-layers",
        "2",
        "--speculative-num-steps",
        "3",
    ];
    let (one, tokens) = speculate("tiny-llama", 1, &args).await?;
    let (two, _) = speculate("tiny-llama", 2, &args).await?;
    assert!(one < tokens, "no LAYERSKIP draft accepted on one rank");
    assert!(two < tokens, "no LAYERSKIP draft accepted at --tp-size 2");
    Ok(())
}

/// The draft heads over two ranks: each runs whole on rank 0's device with
/// the target's LM head gathered there over the whole vocabulary, and the
/// group verifies. EAGLE3 and EAGLE (a tree of top-2 children) with the
/// seeded heads, NEXTN with tiny-llama-mtp's MTP layer: the reference
/// completions at `--tp-size` 1 and 2; the verify steps of both printed
/// (the draft lengths follow measured step times, so they are not
/// compared).
#[tokio::test]
async fn tensor_parallel_runs_the_draft_heads_on_rank_zero() -> Result<()> {
    let eagle3 = fixture("eagle3-tiny-llama");
    let eagle = fixture("eagle-tiny-llama");
    let mtp = fixture("tiny-llama-mtp");
    let heads: [&[&str]; 3] = [
        &["EAGLE3", "--speculative-draft-model-path", &eagle3],
        &[
            "EAGLE",
            "--speculative-draft-model-path",
            &eagle,
            "--speculative-eagle-topk",
            "2",
        ],
        &["NEXTN", "--speculative-draft-model-path", &mtp],
    ];
    for args in heads {
        let (one, tokens) = speculate("tiny-llama", 1, args).await?;
        let (two, _) = speculate("tiny-llama", 2, args).await?;
        eprintln!(
            "{}: {one} verify steps on one rank, {two} at --tp-size 2 ({tokens} tokens)",
            args[0]
        );
    }
    Ok(())
}

/// The server drafted tokens (its speculation counters moved).
async fn assert_drafted(c: &reqwest::Client, s: &Server) -> Result<()> {
    let (_, metrics) = get(c, &s.url("/metrics"), None).await?;
    let drafted = metric(&metrics, "arbor:spec_draft_tokens_total").unwrap_or(0.0);
    assert!(drafted > 0.0, "no draft tokens: {metrics}");
    Ok(())
}

/// [`speculate`] at `--tp-size 2`.
async fn speculate_under_tp2(model: &str, algorithm: &[&str]) -> Result<(u64, u64)> {
    speculate(model, 2, algorithm).await
}

/// Serves `model`'s reference prompts (greedy, as many tokens as the
/// reference) at `--tp-size tp` with `--speculative-algorithm` and then
/// `algorithm`; checks the answers against transformers' and that the pool
/// is empty after; returns the verify steps and the tokens.
async fn speculate(model: &str, tp: usize, algorithm: &[&str]) -> Result<(u64, u64)> {
    let path = fixture(model);
    let tp_arg = tp.to_string();
    let mut args = vec![
        "--model-path",
        &path,
        "--port",
        "0",
        "--threads",
        "2",
        "--kv-cache-dtype",
        "f32",
        "--tp-size",
        &tp_arg,
        "--enable-metrics",
        "--speculative-algorithm",
    ];
    args.extend_from_slice(algorithm);
    let s = Server::start(&args)?;
    if tp > 1 {
        assert!(
            s.log_contains(&format!("tensor-parallel {tp} ranks")),
            "{}",
            s.logs()
        );
    }
    let c = client();
    let reference = reference_json(&path)?;
    let (mut steps, mut tokens) = (0, 0);
    for (i, p) in reference["prompts"]
        .as_array()
        .context("prompts")?
        .iter()
        .enumerate()
    {
        let n = p["greedy_ids"].as_array().context("greedy_ids")?.len();
        let r = generate_greedy(&c, &s, &p["input_ids"], &json!(n)).await?;
        assert_eq!(
            r["output_ids"], p["greedy_ids"],
            "{model} {algorithm:?} prompt {i}: {r}"
        );
        steps += r["meta_info"]["spec_verify_ct"]
            .as_u64()
            .context("spec_verify_ct")?;
        tokens += n as u64;
    }
    eprintln!("{model} {algorithm:?} at --tp-size {tp}: {steps} verify steps for {tokens} tokens");
    assert_drafted(&c, &s).await?;
    assert_no_leak(&c, &s, "arbor", None).await?;
    Ok((steps, tokens))
}
