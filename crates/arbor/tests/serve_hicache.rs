//! `arbor serve --enable-hierarchical-cache` end to end on the tiny Llama
//! with a device pool too small for its documents: a prefix evicted from
//! the device comes back from the host tier (`cached_tokens`,
//! `meta_info.cached_tokens_details`, Prometheus `hicache_*`), answers equal
//! those of a server without any cache, a restarted server finds the
//! prefixes in its file store, `/flush_cache?storage=true` clears it, bad
//! flags are refused naming the flag, and no KV page leaks.

mod common;

use anyhow::Result;
use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Documents of about 150 tokens, each asked twice with different endings.
fn prompts() -> Vec<String> {
    let words = [
        "river", "stone", "maple", "copper", "lantern", "harbor", "violet", "ember",
    ];
    let mut docs = Vec::new();
    for d in 0..4 {
        let body: Vec<&str> = (0..25)
            .map(|i| words[(i * (d + 3) + d) % words.len()])
            .collect();
        docs.push(format!("document {d}: {}", body.join(" ")));
    }
    let mut out = Vec::new();
    for q in ["first question", "second question"] {
        for d in &docs {
            out.push(format!("{d} {q}"));
        }
    }
    out
}

async fn ask(c: &reqwest::Client, s: &Server, p: &str) -> Result<(String, Value)> {
    let v = post_ok(
        c,
        &s.url("/generate"),
        &json!({"text": p, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}),
    )
    .await?;
    Ok((
        v["text"].as_str().unwrap_or_default().to_string(),
        meta(&v).clone(),
    ))
}

/// Waits until a metric reaches `at_least`.
async fn wait_metric(c: &reqwest::Client, s: &Server, name: &str, at_least: f64) -> Result<f64> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (_, m) = get(c, &s.url("/metrics"), None).await?;
        let v = metric(&m, name).unwrap_or(0.0);
        if v >= at_least {
            return Ok(v);
        }
        anyhow::ensure!(Instant::now() < deadline, "{name} stayed at {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The answers of a server without any cache, per prompt.
async fn uncached_answers(c: &reqwest::Client) -> Result<Vec<String>> {
    let plain = Server::tiny(&["--disable-radix-cache"])?;
    let mut want = Vec::new();
    for p in prompts() {
        want.push(ask(c, &plain, &p).await?.0);
    }
    Ok(want)
}

/// Asks the first four prompts, checks each answer against `want` (`what`
/// names the case), and returns the tokens that came from the storage tier.
async fn storage_hits(c: &reqwest::Client, s: &Server, want: &[String], what: &str) -> Result<u64> {
    let mut stored = 0;
    for (p, w) in prompts().iter().zip(want).take(4) {
        let (got, m) = ask(c, s, p).await?;
        assert_eq!(&got, w, "{what}: {m}");
        stored += m["cached_tokens_details"]["storage"].as_u64().unwrap_or(0);
    }
    Ok(stored)
}

/// `arbor serve` arguments of the tiny Llama with a 320-token device pool,
/// HiCache and a file store configured by `store` (JSON), then `extra`.
fn store_args(store: &str, extra: &[&str]) -> Vec<String> {
    let model = fixture("tiny-llama");
    let mut args: Vec<String> = [
        "--model-path",
        &model,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--enable-metrics",
        "--max-total-tokens",
        "320",
        "--enable-hierarchical-cache",
        "--hicache-ratio",
        "8",
        "--hicache-storage-backend",
        "file",
        "--hicache-storage-backend-extra-config",
        store,
        "--hicache-storage-prefetch-policy",
        "wait_complete",
    ]
    .map(str::to_string)
    .to_vec();
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

fn start(args: &[String]) -> Result<Server> {
    Server::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

#[tokio::test]
async fn evicted_prefixes_return_from_host_and_from_storage_after_a_restart() -> Result<()> {
    let c = client();
    let want = uncached_answers(&c).await?;
    let dir = tempfile::tempdir()?;
    let extra = json!({"dir": dir.path(), "prefetch_threshold": 16}).to_string();
    let args = store_args(&extra, &["--threads", "1"]);
    let s = start(&args)?;
    // The CPU's host tier is heap memory (GPUs pin theirs).
    assert!(s.log_contains("(heap memory)"), "{}", s.logs());
    let mut host = 0;
    for (p, w) in prompts().iter().zip(&want) {
        let (got, m) = ask(&c, &s, p).await?;
        assert_eq!(&got, w, "answer changed with HiCache: {m}");
        host += m["cached_tokens_details"]["host"].as_u64().unwrap_or(0);
    }
    assert!(host > 0, "no prompt came back from the host tier");
    wait_metric(&c, &s, "arbor:hicache_host_hit_tokens_total", 1.0).await?;
    let written = wait_metric(&c, &s, "arbor:hicache_storage_write_pages_total", 8.0).await?;
    assert_no_leak(&c, &s, "arbor", None).await?;
    let (_, m) = get(&c, &s.url("/metrics"), None).await?;
    assert_eq!(
        metric(&m, "arbor:hicache_host_tokens"),
        Some(0.0),
        "flush keeps host KV"
    );
    drop(s);

    // A restart: the store still has the pages.
    let s = start(&args)?;
    let stored = storage_hits(&c, &s, &want, "answer changed after a restart").await?;
    assert!(
        stored > 0,
        "nothing came from the store after a restart ({written} pages written)"
    );
    let r = c.post(s.url("/flush_cache?storage=maybe")).send().await?;
    assert_eq!(r.status().as_u16(), 400);
    let r = c.post(s.url("/flush_cache?storage=true")).send().await?;
    assert_eq!(r.status().as_u16(), 200);
    assert_no_leak(&c, &s, "arbor", None).await?;
    Ok(())
}

#[test]
fn bad_hicache_flags_are_refused() -> Result<()> {
    for (args, needle) in [
        (
            vec![
                "--enable-hierarchical-cache",
                "--hicache-write-policy",
                "later",
            ],
            "--hicache-write-policy",
        ),
        (
            vec![
                "--enable-hierarchical-cache",
                "--hicache-storage-backend",
                "s3",
            ],
            "--hicache-storage-backend",
        ),
        (
            vec!["--enable-hierarchical-cache", "--hicache-ratio=0"],
            "--hicache-ratio",
        ),
        (
            vec![
                "--enable-hierarchical-cache",
                "--hicache-storage-backend",
                "file",
                "--hicache-storage-backend-extra-config",
                "{\"directory\": \"/tmp\"}",
            ],
            "directory",
        ),
        (
            vec!["--enable-hierarchical-cache", "--disable-radix-cache"],
            "--disable-radix-cache",
        ),
    ] {
        assert_serve_refuses(&args, needle)?;
    }
    Ok(())
}

/// The stored pages of a tensor-parallel group are in the single-engine
/// layout (every rank's heads interleaved per slot): a `--tp-size 2` server
/// reads back what a single-rank server stored, and the other way round,
/// with the answers of a server without any cache.
#[tokio::test]
async fn tensor_parallel_and_single_rank_servers_share_stored_pages() -> Result<()> {
    let c = client();
    let want = uncached_answers(&c).await?;
    let args = |store: &str, tp: &str| store_args(store, &["--threads", "2", "--tp-size", tp]);
    for (writer, reader) in [("2", "1"), ("1", "2")] {
        let dir = tempfile::tempdir()?;
        let extra = json!({"dir": dir.path(), "prefetch_threshold": 16}).to_string();
        let s = start(&args(&extra, writer))?;
        let mut host = 0;
        for (p, w) in prompts().iter().zip(&want) {
            let (got, m) = ask(&c, &s, p).await?;
            assert_eq!(&got, w, "tp {writer}: answer changed with HiCache: {m}");
            host += m["cached_tokens_details"]["host"].as_u64().unwrap_or(0);
        }
        assert!(
            host > 0,
            "tp {writer}: no prompt came back from the host tier"
        );
        wait_metric(&c, &s, "arbor:hicache_storage_write_pages_total", 8.0).await?;
        assert_no_leak(&c, &s, "arbor", None).await?;
        drop(s);
        let s = start(&args(&extra, reader))?;
        let what = format!("tp {reader} reading tp {writer}'s store");
        let stored = storage_hits(&c, &s, &want, &what).await?;
        assert!(
            stored > 0,
            "tp {reader} found nothing in tp {writer}'s store"
        );
        assert_no_leak(&c, &s, "arbor", None).await?;
    }
    Ok(())
}
