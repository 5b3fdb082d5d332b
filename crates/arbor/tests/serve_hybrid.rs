//! End to end: `arbor serve` on the hybrid fixtures (Qwen3.5 dense and MoE
//! ConditionalGeneration checkpoints, Qwen3-Next) serves transformers'
//! greedy completions over HTTP with all prompts at once, with chunked
//! prefill, and with fewer state slots than requests; a repeated prompt
//! reuses its cached prefix through a recurrent state snapshot (same
//! tokens, `cached_tokens` up to the last page boundary); the start-up summary
//! and /get_server_info show the recurrent state slots; every page and
//! slot is back afterwards; NGRAM speculation and NEXTN (the checkpoint's
//! MTP layer) serve the same tokens. What a hybrid model cannot run with yet
//! (tensor parallelism, EAGLE heads and draft models, HiCache, PD
//! disaggregation, LoRA, a state dtype other than float32) is refused at
//! start, naming it, and so is NEXTN on a checkpoint without MTP layers.

mod common;

use anyhow::{Context, Result};
use common::*;
use serde_json::{Value, json};

/// What a repeated prompt may reuse.
#[derive(Clone, Copy, Debug)]
enum Reuse {
    /// Its prompt up to the last page boundary before its last token.
    Always,
    /// Nothing (no slot for snapshots).
    Off,
    /// That, or nothing when its snapshot was evicted.
    IfKept,
}

async fn serves_reference(model: &str, extra: &[&str], reuse: Reuse) -> Result<()> {
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
        "4096",
        "--kv-cache-dtype",
        "f32",
        "--enable-metrics",
    ];
    args.extend_from_slice(extra);
    let s = Server::start(&args)?;
    assert!(s.log_contains("recurrent state slots"), "{}", s.logs());
    let c = client();
    let reference = reference_json(&path)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    // Every prompt twice, all at once.
    let tokens = json!(32);
    let answers = futures_util::future::join_all(
        prompts
            .iter()
            .chain(prompts)
            .map(|p| generate_greedy(&c, &s, &p["input_ids"], &tokens)),
    )
    .await;
    for (i, (a, p)) in answers
        .into_iter()
        .zip(prompts.iter().chain(prompts))
        .enumerate()
    {
        let r = a?;
        assert_eq!(
            r["output_ids"], p["greedy_ids"],
            "{model} {extra:?} request {i}: {r}"
        );
    }
    // Again, one at a time: each reuses its prompt up to the last page (16
    // tokens) before its last token, restored from a state snapshot, when
    // there are slots for snapshots.
    for (i, p) in prompts.iter().enumerate() {
        let r = generate_greedy(&c, &s, &p["input_ids"], &tokens).await?;
        assert_eq!(
            r["output_ids"], p["greedy_ids"],
            "{model} {extra:?} repeat {i}: {r}"
        );
        let len = p["input_ids"].as_array().map_or(0, Vec::len);
        let cached = meta(&r)["cached_tokens"]
            .as_u64()
            .context("cached_tokens")? as usize;
        let full = (len - 1) / 16 * 16;
        let ok = match reuse {
            Reuse::Always => cached == full,
            Reuse::Off => cached == 0,
            // Few snapshot slots: a prompt's snapshot may have been evicted.
            Reuse::IfKept => cached == full || cached == 0,
        };
        assert!(
            ok,
            "{model} {extra:?}: {cached} cached of a {len}-token prompt ({reuse:?})"
        );
    }
    let info: Value = c
        .get(s.url("/get_server_info"))
        .send()
        .await?
        .json()
        .await?;
    let slots = info["max_mamba_cache_size"]
        .as_u64()
        .context("max_mamba_cache_size")?;
    assert!(slots > 0, "{info}");
    let m = c.get(s.url("/metrics")).send().await?.text().await?;
    assert!(metric(&m, "arbor:mamba_slots_used").is_some(), "{m}");
    assert_no_leak(&c, &s, "arbor", None).await?;
    let m = c.get(s.url("/metrics")).send().await?.text().await?;
    assert_eq!(metric(&m, "arbor:mamba_slots_used"), Some(0.0));
    assert_eq!(
        metric(&m, "arbor:mamba_state_snapshots"),
        Some(0.0),
        "flushed"
    );
    let info: Value = c
        .get(s.url("/get_server_info"))
        .send()
        .await?
        .json()
        .await?;
    assert_eq!(
        info["used_mamba_cache_slots"], 0,
        "state slots leaked: {info}"
    );
    Ok(())
}

#[tokio::test]
async fn hybrid_models_serve_the_reference_completions() -> Result<()> {
    serves_reference("tiny-qwen3.5", &[], Reuse::Always).await?;
    serves_reference(
        "tiny-qwen3.5-moe",
        &["--chunked-prefill-size", "64"],
        Reuse::Always,
    )
    .await?;
    // Three slots for 64 running requests: none left for snapshots.
    serves_reference(
        "tiny-qwen3-next",
        &[
            "--max-mamba-cache-size",
            "3",
            "--chunked-prefill-size",
            "32",
        ],
        Reuse::Off,
    )
    .await?;
    // Two data-parallel replicas, each with its own slots and snapshots.
    serves_reference("tiny-qwen3.5", &["--dp-size", "2"], Reuse::IfKept).await?;
    // NGRAM speculation: rejected drafts leave no trace in the state.
    serves_reference(
        "tiny-qwen3.5",
        &[
            "--speculative-algorithm",
            "NGRAM",
            "--speculative-num-draft-tokens",
            "4",
        ],
        Reuse::Always,
    )
    .await?;
    // NEXTN: the MTP layer of a copy of the checkpoint that has one.
    let mtp = fixture("tiny-qwen3.5-mtp");
    serves_reference(
        "tiny-qwen3.5",
        &[
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-draft-model-path",
            &mtp,
            "--speculative-num-steps",
            "3",
        ],
        Reuse::Always,
    )
    .await?;
    // Snapshots with a few slots: evicted and retaken as requests come.
    serves_reference(
        "tiny-qwen3-next",
        &[
            "--max-running-requests",
            "4",
            "--max-mamba-cache-size",
            "12",
        ],
        Reuse::IfKept,
    )
    .await
}

#[test]
fn what_hybrids_cannot_run_with_yet_is_refused_by_name() -> Result<()> {
    let m = "tiny-qwen3.5";
    assert_model_refuses(
        m,
        &["--tp-size", "2"],
        "splitting recurrent (Gated DeltaNet) layers",
    )?;
    let eagle3 = fixture("eagle3-tiny-llama");
    assert_model_refuses(
        m,
        &[
            "--speculative-algorithm",
            "EAGLE3",
            "--speculative-draft-model-path",
            &eagle3,
        ],
        "only NGRAM and NEXTN (the checkpoint's MTP layer) speculate on recurrent layers",
    )?;
    // tiny-qwen3.5 itself has no MTP layer.
    assert_model_refuses(
        m,
        &["--speculative-algorithm", "NEXTN"],
        "mtp_num_hidden_layers' is absent",
    )?;
    assert_model_refuses(
        m,
        &["--enable-hierarchical-cache"],
        "--enable-hierarchical-cache with Qwen3_5ForConditionalGeneration",
    )?;
    assert_model_refuses(
        m,
        &["--disaggregation-mode", "prefill"],
        "--disaggregation-mode with Qwen3_5ForConditionalGeneration",
    )?;
    assert_model_refuses(
        m,
        &["--enable-lora"],
        "--enable-lora / --lora-paths with Qwen3_5",
    )?;
    assert_model_refuses(m, &["--mamba-ssm-dtype", "bfloat16"], "--mamba-ssm-dtype")?;
    assert_model_refuses(
        m,
        &["--max-mamba-cache-size", "0"],
        "--max-mamba-cache-size",
    )
}

/// `--mamba-full-memory-ratio` sizes the recurrent state slots from the KV
/// cache's memory (SGLang's rule): with a fixed budget of 4096 tokens of
/// tiny-qwen3.5's f32 KV (1 attention layer x K,V x 2 heads x 32 x 4 B =
/// 512 B a token, 2 MiB) and a ratio of 0.5, the slots get 1 MiB: 37 slots
/// of 28,160 B (5 recurrent layers x (384 conv + 1,024 state values) x 4 B),
/// 8 of them for the running requests. Fewer than the running requests
/// would leave none for snapshots.
/// `--max-mamba-cache-size` wins over it; a ratio that is not positive is
/// refused by name.
#[test]
fn the_memory_ratio_sizes_the_state_slots() -> Result<()> {
    let path = fixture("tiny-qwen3.5");
    let base = [
        "--model-path",
        &path,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--max-total-tokens",
        "4096",
        "--kv-cache-dtype",
        "f32",
        "--mamba-full-memory-ratio",
        "0.5",
        "--max-running-requests",
        "8",
    ];
    let s = Server::start(&base)?;
    assert!(
        s.log_contains("37 recurrent state slots (8 running, 29 snapshots)")
            && s.log_contains("1.0 MiB in all"),
        "{}",
        s.logs()
    );
    drop(s);
    let mut told = base.to_vec();
    told.extend(["--max-mamba-cache-size", "9"]);
    let s = Server::start(&told)?;
    assert!(s.log_contains("9 recurrent state slots ("), "{}", s.logs());
    drop(s);
    assert_model_refuses(
        "tiny-qwen3.5",
        &["--mamba-full-memory-ratio", "0"],
        "--mamba-full-memory-ratio must be a positive number",
    )
}
