//! End-to-end tests of RL weight refit on `arbor serve`:
//! `/update_weights_from_disk` under traffic, on one replica, on two
//! data-parallel replicas and on two tensor-parallel ranks (no request
//! fails; afterwards
//! greedy outputs equal a fresh server's on the new weights), bad folders
//! refused with a 400 naming the problem while the old weights keep serving,
//! pause/continue, and release/resume of memory (the process's RSS drops and
//! comes back; outputs after the resume are those from before).
//!
//! The models are written here: tiny Llama folders (the tiny-llama fixture's
//! tokenizer and config, optionally resized) with seeded random f32 weights
//! in one `model.safetensors`, so two folders differ only in their weights.

mod common;

use anyhow::{Context, Result, ensure};
use common::*;
use serde_json::{Value, json};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Shape overrides of the tiny Llama config.
#[derive(Clone, Copy)]
struct Shape {
    hidden: usize,
    intermediate: usize,
    layers: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

const TINY: Shape = Shape {
    hidden: 64,
    intermediate: 160,
    layers: 3,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
};

/// Writes a Llama folder of `shape` with weights drawn from `seed`.
fn write_model(dir: &Path, shape: Shape, seed: u64) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tiny-llama");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    ] {
        std::fs::copy(src.join(f), dir.join(f))?;
    }
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json"))?)?;
    let vocab = cfg["vocab_size"].as_u64().context("vocab_size")? as usize;
    cfg["hidden_size"] = json!(shape.hidden);
    cfg["intermediate_size"] = json!(shape.intermediate);
    cfg["num_hidden_layers"] = json!(shape.layers);
    cfg["num_attention_heads"] = json!(shape.heads);
    cfg["num_key_value_heads"] = json!(shape.kv_heads);
    cfg["head_dim"] = json!(shape.head_dim);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;

    let (h, q, kv) = (
        shape.hidden,
        shape.heads * shape.head_dim,
        shape.kv_heads * shape.head_dim,
    );
    let mut tensors: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, h]),
        ("lm_head.weight".into(), vec![vocab, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    for l in 0..shape.layers {
        let p = format!("model.layers.{l}");
        tensors.extend([
            (format!("{p}.input_layernorm.weight"), vec![h]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
            (
                format!("{p}.mlp.gate_proj.weight"),
                vec![shape.intermediate, h],
            ),
            (
                format!("{p}.mlp.up_proj.weight"),
                vec![shape.intermediate, h],
            ),
            (
                format!("{p}.mlp.down_proj.weight"),
                vec![h, shape.intermediate],
            ),
        ]);
    }
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, dims) in &tensors {
        let bytes = dims.iter().product::<usize>() * 4;
        header.insert(
            name.clone(),
            json!({"dtype": "F32", "shape": dims, "data_offsets": [offset, offset + bytes]}),
        );
        offset += bytes;
    }
    let mut head = serde_json::to_string(&Value::Object(header))?;
    while head.len() % 8 != 0 {
        head.push(' ');
    }
    let mut out = Vec::with_capacity(8 + head.len() + offset);
    out.extend_from_slice(&(head.len() as u64).to_le_bytes());
    out.extend_from_slice(head.as_bytes());
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for (name, dims) in &tensors {
        let n: usize = dims.iter().product();
        let norm = name.ends_with("norm.weight");
        let scale = 1.0 / (dims.last().copied().unwrap_or(1) as f32).sqrt();
        for _ in 0..n {
            // xorshift64*: uniform in [-1, 1).
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let u = (state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40) as f32 / (1u64 << 24) as f32;
            let x = 2.0 * u - 1.0;
            let v = if norm { 1.0 + 0.1 * x } else { 2.0 * scale * x };
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    std::fs::write(dir.join("model.safetensors"), out)?;
    Ok(())
}

fn serve(model: &Path, extra: &[&str]) -> Result<Server> {
    let m = model.display().to_string();
    let mut args = vec![
        "--model-path",
        &m,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "4096",
        "--enable-metrics",
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

const PROMPTS: [&str; 4] = [
    "The quick brown fox jumps over the lazy dog, and then",
    "Once upon a time",
    "Weights change; the cache must not remember them.",
    "1 2 3 4 5 6 7 8",
];

fn greedy_body(prompt: &str, n: usize) -> Value {
    json!({"text": prompt, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": true}})
}

/// Greedy continuations of `PROMPTS` (token ids).
async fn outputs(c: &reqwest::Client, s: &Server) -> Result<Vec<Value>> {
    let mut v = Vec::new();
    for p in PROMPTS {
        let r = post_ok(c, &s.url("/generate"), &greedy_body(p, 12)).await?;
        v.push(r["output_ids"].clone());
    }
    Ok(v)
}

async fn post_json(c: &reqwest::Client, url: &str, body: &Value) -> Result<(u16, Value)> {
    let r = c.post(url).json(body).send().await?;
    let st = r.status().as_u16();
    let text = r.text().await?;
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Ok((st, v))
}

async fn model_info(c: &reqwest::Client, s: &Server) -> Result<Value> {
    let (_, t) = get(c, &s.url("/get_model_info"), None).await?;
    Ok(serde_json::from_str(&t)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refit_under_traffic_then_outputs_equal_a_fresh_server() -> Result<()> {
    refit_under_traffic(&[]).await
}

/// Two data-parallel replicas: each loads its own copy and swaps after its
/// own drain; afterwards both answer as a fresh one-replica server does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn data_parallel_replicas_refit_under_traffic() -> Result<()> {
    refit_under_traffic(&["--dp-size", "2"]).await
}

/// Two tensor-parallel ranks: each loads its own shard of the new weights,
/// and the group swaps all of them between two steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tensor_parallel_ranks_refit_under_traffic() -> Result<()> {
    refit_under_traffic(&["--tp-size", "2"]).await
}

/// Three weight updates on a server started with `server_args`, under
/// traffic of four clients: no request fails, and afterwards the greedy
/// outputs equal a fresh (one-replica) server's on the last weights.
async fn refit_under_traffic(server_args: &[&str]) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (a, b) = (dir.path().join("step-a"), dir.path().join("step-b"));
    write_model(&a, TINY, 1)?;
    write_model(&b, TINY, 2)?;
    let s = serve(&a, server_args)?;
    let c = client();
    let on_a = outputs(&c, &s).await?;
    assert_eq!(model_info(&c, &s).await?["weight_version"], "default");

    // Traffic: greedy requests in a loop, counting failures.
    let stop = Arc::new(AtomicBool::new(false));
    let (done, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (c, url) = (c.clone(), s.url("/generate"));
        let (stop, done, failed) = (stop.clone(), done.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let mut k = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let body = greedy_body(PROMPTS[(i + k) % PROMPTS.len()], 160);
                k += 1;
                let ok = match c.post(&url).json(&body).send().await {
                    Ok(r) if r.status().is_success() => r
                        .json::<Value>()
                        .await
                        .is_ok_and(|v| v["meta_info"]["finish_reason"]["type"] == "length"),
                    _ => false,
                };
                if ok { &done } else { &failed }.fetch_add(1, Ordering::SeqCst);
            }
        }));
    }
    let u = s.url("/update_weights_from_disk");
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    // Drained (default), then asynchronous back to A, then drained to B.
    let steps = [
        (&b, json!({"weight_version": "v1"})),
        (&a, json!({"is_async": true, "weight_version": "v2"})),
        (
            &b,
            json!({"weight_version": "v3", "abort_all_requests": false}),
        ),
    ];
    let mut updates = 0u64;
    for (path, extra) in steps {
        let mut body = json!({"model_path": path.display().to_string()});
        if let (Some(o), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        // An asynchronous swap must find requests running: four clients
        // keep some in flight, but on a loaded machine a swap can fall
        // between two of them, so it is tried again (same weights) a few times.
        let tries = if body["is_async"] == true { 20 } else { 1 };
        let mut paused = 0;
        for _ in 0..tries {
            let (st, v) = post_json(&c, &u, &body).await?;
            ensure!(
                st == 200 && v["success"] == true,
                "refit to {}: {st} {v}",
                path.display()
            );
            println!("refit to {}: {v}", path.display());
            updates += 1;
            paused = v["num_paused_requests"].as_u64().unwrap_or(0);
            if paused > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        if body["is_async"] == true {
            assert!(paused > 0, "no asynchronous swap found a running request");
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        t.await?;
    }
    let (done, failed) = (done.load(Ordering::SeqCst), failed.load(Ordering::SeqCst));
    assert_eq!(
        failed, 0,
        "{failed} requests failed during the refits ({done} succeeded)"
    );
    assert!(done >= 4, "too little traffic: {done}");
    println!("{done} requests during the refits, none failed");

    let info = model_info(&c, &s).await?;
    assert_eq!(info["weight_version"], "v3", "{info}");
    assert_eq!(info["weight_updates"], updates, "{info}");
    assert_eq!(info["model_path"], json!(b.display().to_string()), "{info}");
    let after = outputs(&c, &s).await?;
    let r = post_ok(&c, &s.url("/generate"), &greedy_body(PROMPTS[0], 2)).await?;
    assert_eq!(r["meta_info"]["weight_version"], "v3", "{r}");
    assert_no_leak(&c, &s, "arbor", None).await?;

    let fresh = serve(&b, &[])?;
    let on_b = outputs(&c, &fresh).await?;
    assert_eq!(
        after, on_b,
        "after the refit = a fresh server on the new weights"
    );
    assert_ne!(
        on_a, on_b,
        "the two weight sets must differ for this test to mean anything"
    );
    Ok(())
}

#[tokio::test]
async fn bad_refits_are_refused_and_the_old_weights_kept() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let (a, wide) = (dir.path().join("a"), dir.path().join("wide"));
    write_model(&a, TINY, 1)?;
    write_model(&wide, Shape { hidden: 32, ..TINY }, 3)?;
    let s = serve(&a, &[])?;
    let c = client();
    let before = outputs(&c, &s).await?;
    let u = s.url("/update_weights_from_disk");
    let cases = [
        (json!({"model_path": fixture("tiny-qwen2")}), "architecture"),
        (
            json!({"model_path": wide.display().to_string()}),
            "hidden_size is 32",
        ),
        (
            json!({"model_path": dir.path().join("missing").display().to_string()}),
            "no such file",
        ),
        (json!({}), "model_path"),
        (
            json!({"model_path": a.display().to_string(), "load_format": "dummy"}),
            "load_format",
        ),
        (
            json!({"model_path": a.display().to_string(), "flush_cache": false}),
            "flush_cache",
        ),
        (
            json!({"model_path": a.display().to_string(), "colour": 1}),
            "colour",
        ),
    ];
    for (body, needle) in cases {
        let (st, v) = post_json(&c, &u, &body).await?;
        assert_eq!(st, 400, "{body} -> {v}");
        assert!(
            v.to_string().contains(needle),
            "{body}: expected '{needle}' in {v}"
        );
    }
    let info = model_info(&c, &s).await?;
    assert_eq!(
        (
            info["weight_version"].clone(),
            info["weight_updates"].clone()
        ),
        (json!("default"), json!(0))
    );
    assert_eq!(
        outputs(&c, &s).await?,
        before,
        "the old weights still serve"
    );
    // Bad pause modes and memory tags are refused too.
    let (st, v) = post_json(&c, &s.url("/pause_generation"), &json!({"mode": "nap"})).await?;
    assert!(st == 400 && v.to_string().contains("nap"), "{v}");
    let (st, v) = post_json(
        &c,
        &s.url("/release_memory_occupation"),
        &json!({"tags": ["gpu"]}),
    )
    .await?;
    assert!(st == 400 && v.to_string().contains("gpu"), "{v}");
    let (st, _) = post_json(&c, &s.url("/resume_memory_occupation"), &json!({})).await?;
    assert_eq!(st, 400, "nothing to resume");
    assert_no_leak(&c, &s, "arbor", None).await
}

fn rss_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("VmRSS")?;
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmRSS value")?
        .parse()?;
    Ok(kb * 1024)
}

#[tokio::test]
async fn pause_continue_release_and_resume() -> Result<()> {
    pause_release_resume(&[]).await
}

/// The same on two tensor-parallel ranks: every rank frees its shard and
/// loads it again.
#[tokio::test]
async fn tensor_parallel_ranks_release_and_resume() -> Result<()> {
    pause_release_resume(&["--tp-size", "2"]).await
}

/// Pause (in place and abort), continue, release and resume on a server
/// started with `server_args`.
async fn pause_release_resume(server_args: &[&str]) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let m = dir.path().join("big");
    // Three MLP matrices of 34 MiB each: allocations the C allocator maps
    // on their own and unmaps on free, so freeing them shows in the RSS.
    let big = Shape {
        hidden: 1024,
        intermediate: 8704,
        layers: 1,
        heads: 16,
        kv_heads: 4,
        head_dim: 64,
    };
    write_model(&m, big, 7)?;
    let s = serve(&m, server_args)?;
    let c = client();
    let before = outputs(&c, &s).await?;

    // In-place pause: a running stream waits, memory cannot be released
    // under it, and it finishes after continue.
    let r = c
        .post(s.url("/generate"))
        .json(&json!({"text": "a long one", "stream": true,
                      "sampling_params": {"max_new_tokens": 200, "ignore_eos": true}}))
        .send()
        .await?;
    let mut stream = SseReader::new(r)?;
    ensure!(stream.next().await?.is_some(), "no first chunk");
    let (st, v) = post_json(
        &c,
        &s.url("/pause_generation"),
        &json!({"mode": "in_place"}),
    )
    .await?;
    assert_eq!(st, 200, "{v}");
    let (st, v) = post_json(&c, &s.url("/release_memory_occupation"), &json!({})).await?;
    assert!(st == 400 && v.to_string().contains("running"), "{v}");
    let (st, _) = post_json(&c, &s.url("/continue_generation"), &json!({})).await?;
    assert_eq!(st, 200);
    let rest = stream.rest().await?;
    let last = rest.0.last().context("last chunk")?;
    assert_eq!(last["meta_info"]["completion_tokens"], 200, "{last}");

    // Abort pause: the running stream ends aborted; new requests run after continue.
    let r = c
        .post(s.url("/generate"))
        .json(&json!({"text": "another long one", "stream": true,
                      "sampling_params": {"max_new_tokens": 230, "ignore_eos": true}}))
        .send()
        .await?;
    let mut stream = SseReader::new(r)?;
    ensure!(stream.next().await?.is_some(), "no first chunk");
    let (st, _) = post_json(&c, &s.url("/pause_generation"), &json!({})).await?;
    assert_eq!(st, 200);
    let rest = stream.rest().await?;
    let last = rest.0.last().context("last chunk")?;
    assert_eq!(
        last["meta_info"]["finish_reason"]["type"], "abort",
        "{last}"
    );
    post_json(&c, &s.url("/continue_generation"), &json!({})).await?;
    assert_eq!(outputs(&c, &s).await?, before);

    // Release: RSS drops by most of the weights; resume brings them back.
    let pid = s.child.id();
    let rss0 = rss_bytes(pid)?;
    let (st, v) = post_json(&c, &s.url("/release_memory_occupation"), &json!({})).await?;
    assert_eq!(st, 200, "{v}");
    let rss1 = rss_bytes(pid)?;
    assert!(model_info(&c, &s).await?["memory_released"] == true);
    let (st, _) = post_json(&c, &s.url("/release_memory_occupation"), &json!({})).await?;
    assert_eq!(st, 400, "released twice");
    let (st, v) = post_json(&c, &s.url("/resume_memory_occupation"), &json!({})).await?;
    assert_eq!(st, 200, "{v}");
    let rss2 = rss_bytes(pid)?;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!(
        "RSS: {:.1} MiB before release, {:.1} MiB released, {:.1} MiB resumed",
        mib(rss0),
        mib(rss1),
        mib(rss2)
    );
    assert!(rss1 + (80 << 20) < rss0, "release freed too little");
    assert!(
        rss2 > rss1 + (80 << 20),
        "resume did not load the weights again"
    );
    assert_eq!(outputs(&c, &s).await?, before, "outputs after resume");
    assert_no_leak(&c, &s, "arbor", None).await
}
