//! End-to-end tests of `arbor serve`'s operation: admin endpoints, API
//! keys, metrics names and prefix, configuration precedence and errors,
//! graceful SIGTERM, aborts on client disconnect, and the KV cache's dtype
//! (`auto`: f16 on the CPU, which keeps the transformers greedy ids of the
//! tiny fixtures) and size defaults. Speed is never asserted.

mod common;

use anyhow::{Result, ensure};
use common::*;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

#[tokio::test]
async fn admin_auth_metrics_prefix_and_config_precedence() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cfg = dir.path().join("arbor.toml");
    std::fs::write(
        &cfg,
        format!(
            "[model]\nmodel_path = \"{}\"\nserved_model_name = \"tiny\"\nthreads = 1\n\n[server]\nport = 1\napi_key = \"sekret\"\n\n\
             [scheduler]\nmax_running_requests = 3\n\n[cache]\nmax_total_tokens = 2048\n\n[metrics]\nenable_metrics = true\nprefix = \"sglang\"\n",
            fixture("tiny-llama")
        ),
    )?;
    let path = cfg.display().to_string();
    // Flags beat the file: the port, and max_running_requests.
    let s = Server::start(&[
        "--config",
        &path,
        "--port",
        "0",
        "--max-running-requests",
        "5",
    ])?;
    let c = client();
    let key = Some("sekret");
    // Health stays open; everything else needs the key.
    assert_eq!(get(&c, &s.url("/health"), None).await?.0, 200);
    assert_eq!(get(&c, &s.url("/health_generate"), None).await?.0, 200);
    let (st, body) = get(&c, &s.url("/v1/models"), None).await?;
    assert_eq!(st, 401);
    assert!(body.contains("API key"));
    assert_eq!(get(&c, &s.url("/v1/models"), Some("wrong")).await?.0, 401);
    assert_eq!(get(&c, &s.url("/metrics"), None).await?.0, 401);
    let (st, body) = get(&c, &s.url("/v1/models"), key).await?;
    assert_eq!(st, 200);
    assert!(body.contains("\"tiny\""));

    let (st, info) = get(&c, &s.url("/get_server_info"), key).await?;
    assert_eq!(st, 200);
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(
        info["scheduler"]["max_running_requests"], 5,
        "flag wins: {info}"
    );
    assert_eq!(
        info["cache"]["max_total_tokens"], 2048,
        "file wins over default"
    );
    assert_eq!(info["scheduler"]["max_prefill_tokens"], 8192, "default");
    assert_eq!(info["server"]["api_key"], "<redacted>");
    assert!(info["internal_states"][0].is_object());
    let (st, mi) = get(&c, &s.url("/get_model_info"), key).await?;
    assert_eq!(st, 200);
    assert!(mi.contains("tiny-llama"));

    let (st, v) = post_raw(
        &c,
        &s.url("/generate"),
        // Long enough to fill whole KV pages, which the prefix cache keeps.
        json!({"text": "Hi there, this prompt is long enough to fill a few whole KV pages.",
               "sampling_params": {"max_new_tokens": 4, "ignore_eos": true}})
        .to_string(),
        key,
    )
    .await?;
    assert_eq!(st, 200, "{v}");
    let (st, m) = get(&c, &s.url("/metrics"), key).await?;
    assert_eq!(st, 200);
    for name in [
        "num_running_reqs",
        "num_queue_reqs",
        "token_usage",
        "cache_hit_rate",
        "gen_throughput",
        "num_used_tokens",
        "prompt_tokens_total",
        "generation_tokens_total",
        "cached_tokens_total",
        "num_requests_total",
        "num_aborted_requests_total",
        "num_retracted_reqs",
    ] {
        assert!(
            metric(&m, &format!("sglang:{name}")).is_some(),
            "sglang:{name} missing:\n{m}"
        );
    }
    for h in [
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
        "inter_token_latency_seconds",
    ] {
        let n = metric(&m, &format!("sglang:{h}_count")).unwrap_or(0.0);
        assert!(n >= 1.0, "{h} has no observation:\n{m}");
        assert!(m.contains(&format!(
            "sglang:{h}_bucket{{model_name=\"tiny\",le=\"+Inf\"}}"
        )));
    }
    assert!(metric(&m, "sglang:generation_tokens_total") >= Some(4.0));
    // Idle after a request: its KV stays cached for reuse, but no request
    // holds a token (SGLang's num_used_tokens), and the cached part has a gauge.
    assert_eq!(metric(&m, "sglang:num_used_tokens"), Some(0.0), "{m}");
    assert_eq!(metric(&m, "sglang:token_usage"), Some(0.0), "{m}");
    assert!(metric(&m, "sglang:evictable_tokens") > Some(0.0), "{m}");
    let (_, info) = get(&c, &s.url("/get_server_info"), key).await?;
    let info: Value = serde_json::from_str(&info)?;
    let internal = &info["internal_states"][0];
    assert_eq!(internal["num_used_tokens"], 0, "{info}");
    assert_eq!(internal["token_usage"], 0.0, "{info}");
    assert!(internal["evictable_tokens"].as_u64() > Some(0), "{info}");
    assert!(!m.contains("arbor:"));

    // Abort a running request by rid: its stream ends with an abort.
    let body = json!({"text": "Hi", "rid": "long-1", "stream": true,
        "sampling_params": {"max_new_tokens": 240, "ignore_eos": true, "n": 8}});
    let r = c
        .post(s.url("/generate"))
        .bearer_auth("sekret")
        .json(&body)
        .send()
        .await?;
    let mut r = SseReader::new(r)?;
    ensure!(r.next().await?.is_some(), "no first event");
    let (st, _) = post_raw(
        &c,
        &s.url("/abort_request"),
        json!({"rid": "long-1"}).to_string(),
        key,
    )
    .await?;
    assert_eq!(st, 200);
    let (events, done) = r.rest().await?;
    assert!(done);
    let kinds: Vec<&str> = events
        .iter()
        .filter_map(|e| meta(e)["finish_reason"]["type"].as_str())
        .collect();
    assert_eq!(kinds.len(), 8, "{kinds:?}");
    assert!(kinds.contains(&"abort"), "{kinds:?}");
    let (st, _) = post_raw(
        &c,
        &s.url("/abort_request"),
        json!({"abort_all": true}).to_string(),
        key,
    )
    .await?;
    assert_eq!(st, 200);
    assert_no_leak(&c, &s, "sglang", key).await?;
    // GET works for flush too, as SGLang.
    assert_eq!(get(&c, &s.url("/flush_cache"), key).await?.0, 200);
    Ok(())
}

#[test]
fn config_errors_name_the_key_and_help_lists_every_flag() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let run = |toml: &str| -> Result<(bool, String)> {
        let p = dir.path().join("bad.toml");
        std::fs::write(&p, toml)?;
        let out = Command::new(BIN)
            .args(["serve", "--config"])
            .arg(&p)
            .output()?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        ))
    };
    let (ok, err) = run("[scheduler]\nmax_runing_requests = 4\n")?;
    assert!(!ok);
    assert!(
        err.contains("unknown key 'max_runing_requests' in section [scheduler]"),
        "{err}"
    );
    let (ok, err) = run("[speculative]\nalgorithm = \"eagle\"\n")?;
    assert!(
        !ok && err.contains("EAGLE") && err.contains("draft_model_path"),
        "{err}"
    );
    let (ok, err) = run("[speculative]\nalgorithm = \"ngram\"\nnum_draft_tokens = 65\n")?;
    assert!(
        !ok && err.contains("--speculative-num-draft-tokens"),
        "{err}"
    );
    let (ok, err) = run("[speculative]\nalgoritm = \"ngram\"\n")?;
    assert!(
        !ok && err.contains("unknown key 'algoritm' in section [speculative]"),
        "{err}"
    );
    let (ok, err) = run("[server]\nreasoning_parser = \"gpt-5\"\n")?;
    assert!(
        !ok && err.contains("--reasoning-parser") && err.contains("'gpt-5'"),
        "{err}"
    );
    let out = Command::new(BIN)
        .args(["serve", "--print-config", "--reasoning-parser", "r2"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--reasoning-parser") && err.contains("qwen3"),
        "{err}"
    );
    let (ok, err) = run("[server]\nport = \"eighty\"\n")?;
    assert!(!ok && err.contains("[server]"), "{err}");
    let (ok, err) = run("[[plugins]]\npath = \"libfoo.so\"\n")?;
    assert!(
        !ok && err.contains("libfoo.so") && err.contains("no such file"),
        "{err}"
    );
    // The example file is valid and complete.
    let example = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/arbor.toml");
    let out = Command::new(BIN)
        .args(["serve", "--print-config", "--config"])
        .arg(&example)
        .output()?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    for section in [
        "[model]",
        "[server]",
        "[scheduler]",
        "[sampling]",
        "[cache]",
        "[metrics]",
    ] {
        assert!(printed.contains(section), "{printed}");
    }
    let help = Command::new(BIN).args(["serve", "--help"]).output()?;
    let help = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--config",
        "--model-path",
        "--host",
        "--port",
        "--served-model-name",
        "--chunked-prefill-size",
        "--max-running-requests",
        "--max-prefill-tokens",
        "--mem-fraction-static",
        "--max-total-tokens",
        "--page-size",
        "--schedule-policy",
        "--schedule-conservativeness",
        "--radix-eviction-policy",
        "--disable-radix-cache",
        "--enable-mixed-chunk",
        "--enable-metrics",
        "--enable-cache-report",
        "--api-key",
        "--device",
        "--threads",
        "--dtype",
        "--kv-cache-dtype",
        "--reasoning-parser",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    Ok(())
}

#[tokio::test]
async fn sigterm_finishes_in_flight_requests_then_exits_zero() -> Result<()> {
    let mut s = Server::tiny(&["--shutdown-timeout", "60"])?;
    let c = client();
    let body = json!({"text": "Hi", "stream": true, "sampling_params": {"max_new_tokens": 100, "ignore_eos": true, "n": 4}});
    let mut r = SseReader::new(c.post(s.url("/generate")).json(&body).send().await?)?;
    ensure!(r.next().await?.is_some(), "no first event");
    s.sigterm()?;
    let (events, done) = r.rest().await?;
    assert!(done, "{}", s.logs());
    let kinds: Vec<&str> = events
        .iter()
        .filter_map(|e| meta(e)["finish_reason"]["type"].as_str())
        .collect();
    assert!(
        !kinds.is_empty() && kinds.iter().all(|k| *k == "length"),
        "finished, not aborted: {kinds:?}"
    );
    let st = s.wait_exit(Duration::from_secs(30))?;
    assert!(st.success(), "exit {st:?}\n{}", s.logs());
    assert!(s.log_contains("arbor serve: stopped"), "{}", s.logs());
    Ok(())
}

#[tokio::test]
async fn sigterm_aborts_what_outlives_the_timeout() -> Result<()> {
    let mut s = Server::tiny(&["--shutdown-timeout", "0"])?;
    let c = client();
    let body = json!({"text": "Hi", "stream": true, "sampling_params": {"max_new_tokens": 240, "ignore_eos": true, "n": 16}});
    let mut r = SseReader::new(c.post(s.url("/generate")).json(&body).send().await?)?;
    ensure!(r.next().await?.is_some(), "no first event");
    s.sigterm()?;
    let (events, _) = r.rest().await?;
    let kinds: Vec<&str> = events
        .iter()
        .filter_map(|e| meta(e)["finish_reason"]["type"].as_str())
        .collect();
    assert!(kinds.contains(&"abort"), "{kinds:?}");
    let st = s.wait_exit(Duration::from_secs(30))?;
    assert!(st.success(), "exit {st:?}\n{}", s.logs());
    Ok(())
}

#[tokio::test]
async fn client_disconnect_aborts_its_request() -> Result<()> {
    let s = Server::tiny(&[])?;
    let c = client();
    let aborted = |m: &str| metric(m, "arbor:num_aborted_requests_total").unwrap_or(0.0);
    let before = aborted(&get(&c, &s.url("/metrics"), None).await?.1);
    // Each request asks for 128 samples (the most `n` takes) of 240 tokens:
    // about 4 times what the tiny server's 8192 KV tokens hold, so they run in
    // waves of about 33 and take many times longer than the server needs to
    // notice a client that left, however loaded the machine.
    // Streaming: read one event, then hang up.
    let body = json!({"text": "Hi", "stream": true, "sampling_params": {"max_new_tokens": 240, "ignore_eos": true, "n": 128}});
    let mut r = SseReader::new(c.post(s.url("/generate")).json(&body).send().await?)?;
    ensure!(r.next().await?.is_some(), "no first event");
    drop(r);
    // Non-streaming: the client gives up early.
    let quick = reqwest::Client::builder()
        .timeout(Duration::from_millis(150))
        .build()?;
    let body = json!({"text": "Hey", "sampling_params": {"max_new_tokens": 240, "ignore_eos": true, "n": 128}});
    assert!(
        quick
            .post(s.url("/generate"))
            .json(&body)
            .send()
            .await
            .is_err(),
        "should time out"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let m = get(&c, &s.url("/metrics"), None).await?.1;
        let idle = metric(&m, "arbor:num_running_reqs") == Some(0.0)
            && metric(&m, "arbor:num_queue_reqs") == Some(0.0);
        if idle {
            // Most of both requests' samples were aborted, not run to the
            // end (all of them unless some waves finished first).
            assert!(
                aborted(&m) >= before + 128.0,
                "aborted {} (before {before})\n{m}",
                aborted(&m)
            );
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "requests still running after the client left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_no_leak(&c, &s, "arbor", None).await
}

/// `--kv-cache-gb` sizes the KV cache in GiB: the capacity is the whole pages
/// of the model's KV layout that fit (tiny Llama: 3 layers × 2 KV heads × 16
/// dims × K and V, f32 = 768 bytes per token; f16 = 384); `--max-total-tokens`
/// beats it, and a non-positive size is refused naming the key.
#[tokio::test]
async fn kv_cache_size_in_gib() -> Result<()> {
    let model = fixture("tiny-llama");
    let c = client();
    for (dtype, bytes_per_token) in [("f32", 768u64), ("f16", 384)] {
        let s = Server::start(&[
            "--model-path",
            &model,
            "--port",
            "0",
            "--threads",
            "1",
            "--kv-cache-dtype",
            dtype,
            "--kv-cache-gb",
            "0.01",
        ])?;
        let (st, info) = get(&c, &s.url("/get_server_info"), None).await?;
        assert_eq!(st, 200);
        let info: Value = serde_json::from_str(&info)?;
        let bytes = (0.01 * (1u64 << 30) as f64) as u64;
        let expect = bytes / bytes_per_token / 16 * 16;
        assert_eq!(info["max_total_num_tokens"], expect, "{dtype}: {info}");
        assert!(s.log_contains("--kv-cache-gb"), "{}", s.logs());
    }
    let s = Server::start(&[
        "--model-path",
        &model,
        "--port",
        "0",
        "--threads",
        "1",
        "--kv-cache-gb",
        "0.01",
        "--max-total-tokens",
        "1024",
    ])?;
    let (_, info) = get(&c, &s.url("/get_server_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["max_total_num_tokens"], 1024, "tokens beat GiB");

    let out = Command::new(env!("CARGO_BIN_EXE_arbor"))
        .args(["serve", "--model-path", &model, "--kv-cache-gb", "0"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("kv_cache_gb / --kv-cache-gb"), "{err}");
    Ok(())
}

/// `--kv-cache-dtype auto` (the default) is f16 on the CPU: /get_server_info
/// reports the dtype in use and why (`model.kv_cache_dtype` echoes the
/// setting), and the start-up summary prints "f16 (auto: CPU)". `f32` on
/// request (flag or `[model] kv_cache_dtype`) is honoured, and a bad value is
/// refused naming the flag and the key.
#[tokio::test]
async fn kv_cache_dtype_is_f16_on_the_cpu_unless_asked() -> Result<()> {
    let model = fixture("tiny-llama");
    let c = client();
    let base = [
        "--model-path",
        model.as_str(),
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "1024",
    ];
    let dir = tempfile::tempdir()?;
    let toml = dir.path().join("arbor.toml");
    std::fs::write(&toml, "[model]\nkv_cache_dtype = \"f32\"\n")?;
    let toml = toml.display().to_string();
    // (extra args, configured, in use, reason, bytes per token, summary).
    type Case<'a> = (&'a [&'a str], &'a str, &'a str, Value, u64, &'a str);
    let cases: [Case<'_>; 5] = [
        (
            &[],
            "auto",
            "f16",
            json!("auto: CPU"),
            384,
            ", f16 (auto: CPU), ",
        ),
        (
            &["--kv-cache-dtype", "f32"],
            "f32",
            "f32",
            Value::Null,
            768,
            ", f32, ",
        ),
        (
            &["--config", &toml],
            "f32",
            "f32",
            Value::Null,
            768,
            ", f32, ",
        ),
        (
            &["--config", &toml, "--kv-cache-dtype", "bf16"],
            "bf16",
            "bf16",
            Value::Null,
            384,
            ", bf16, ",
        ),
        (
            &["--kv-cache-dtype", "fp8_e4m3"],
            "fp8_e4m3",
            "f8_e4m3",
            Value::Null,
            192,
            ", f8_e4m3, ",
        ),
    ];
    for (extra, configured, dtype, reason, per_token, summary) in cases {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let s = Server::start(&args)?;
        let (st, info) = get(&c, &s.url("/get_server_info"), None).await?;
        assert_eq!(st, 200);
        let info: Value = serde_json::from_str(&info)?;
        assert_eq!(
            info["model"]["kv_cache_dtype"], configured,
            "{extra:?}: {info}"
        );
        assert_eq!(info["kv_cache_dtype"], dtype, "{extra:?}: {info}");
        assert_eq!(info["kv_cache_dtype_reason"], reason, "{extra:?}: {info}");
        assert_eq!(info["max_total_num_tokens"], 1024, "{extra:?}");
        assert_eq!(
            info["kv_cache_bytes"],
            1024 * per_token,
            "{extra:?}: {info}"
        );
        assert!(s.log_contains(summary), "{extra:?}: {}", s.logs());
    }
    assert_serve_refuses(&["--kv-cache-dtype", "fp4"], "--kv-cache-dtype")?;
    assert_serve_refuses(
        &["--kv-cache-dtype", "q4_0"],
        "auto, f32, f16, bf16, fp8_e4m3 or fp8_e5m2",
    )?;
    std::fs::write(
        dir.path().join("bad.toml"),
        "[model]\nkv_cache_dtype = \"f64\"\n",
    )?;
    let bad = dir.path().join("bad.toml").display().to_string();
    assert_serve_refuses(&["--config", &bad], "[model] kv_cache_dtype")?;
    Ok(())
}

/// Without a size the KV cache gets the memory rule with its bounds, and the
/// summary names the bound that applied: with two running requests of the
/// tiny Llama's 256-token context, 512 tokens (`max_running_requests 2 x
/// context 256`), far below the 2 GiB an f16 cache may take on the CPU.
#[tokio::test]
async fn automatic_kv_size_names_the_bound_that_applied() -> Result<()> {
    let model = fixture("tiny-llama");
    let c = client();
    let s = Server::start(&[
        "--model-path",
        &model,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-running-requests",
        "2",
    ])?;
    let (_, info) = get(&c, &s.url("/get_server_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["max_total_num_tokens"], 512, "{info}");
    assert_eq!(info["kv_cache_dtype"], "f16", "{info}");
    assert!(
        s.log_contains("512 tokens (32 pages of 16), f16 (auto: CPU)")
            && s.log_contains("[capped at max_running_requests 2 x context 256 = 512 tokens]"),
        "{}",
        s.logs()
    );
    Ok(())
}

/// The default (f16) KV cache keeps the greedy continuation transformers
/// wrote into each tiny fixture's `reference.json` token for token: every
/// prompt, all `max_new_tokens` ids (the f32 path is held to the same ids by
/// the models crate's parity tests).
#[tokio::test]
async fn default_f16_kv_keeps_the_transformers_greedy_ids() -> Result<()> {
    let c = client();
    for name in ["tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral"] {
        let dir = fixture(name);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(format!("{dir}/reference.json"))?)?;
        let s = Server::start(&[
            "--model-path",
            &dir,
            "--port",
            "0",
            "--threads",
            "1",
            "--max-total-tokens",
            "2048",
        ])?;
        let (_, info) = get(&c, &s.url("/get_server_info"), None).await?;
        let info: Value = serde_json::from_str(&info)?;
        assert_eq!(info["kv_cache_dtype"], "f16", "{name}: {info}");
        let prompts = reference["prompts"].as_array().map_or(&[][..], |v| v);
        ensure!(!prompts.is_empty(), "{name}: no prompts");
        for (i, p) in prompts.iter().enumerate() {
            let r = generate_greedy(&c, &s, &p["input_ids"], &reference["max_new_tokens"]).await?;
            assert_eq!(r["output_ids"], p["greedy_ids"], "{name} prompt {i}");
        }
    }
    Ok(())
}

/// A checkpoint calibrated for an FP8 KV cache (per-layer `k_scale` and
/// `v_scale`) is served with an FP8 E4M3 cache by default, the summary says
/// why, and every prompt's greedy continuation is the numpy reference's
/// (tools/reference/make_kv_scales_fixture.py), concurrently sent.
#[tokio::test]
async fn checkpoint_kv_scales_choose_and_drive_an_fp8_cache() -> Result<()> {
    let dir = fixture("quant/fp8-kv-scales");
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(format!("{dir}/reference.json"))?)?;
    let c = client();
    let s = Server::start(&[
        "--model-path",
        &dir,
        "--port",
        "0",
        "--threads",
        "1",
        "--max-total-tokens",
        "1024",
    ])?;
    let (_, info) = get(&c, &s.url("/get_server_info"), None).await?;
    let info: Value = serde_json::from_str(&info)?;
    assert_eq!(info["kv_cache_dtype"], "f8_e4m3", "{info}");
    assert_eq!(
        info["kv_cache_dtype_reason"], "auto: the checkpoint's KV cache scales",
        "{info}"
    );
    assert!(
        s.log_contains("f8_e4m3 (auto: the checkpoint's KV cache scales)"),
        "{}",
        s.logs()
    );
    let prompts = reference["prompts"].as_array().map_or(&[][..], |v| v);
    ensure!(!prompts.is_empty(), "no prompts");
    let sends = prompts.iter().map(|p| {
        let body = json!({
            "input_ids": p["input_ids"],
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": true},
        });
        let (c, url) = (c.clone(), s.url("/generate"));
        async move { c.post(url).json(&body).send().await?.json::<Value>().await }
    });
    for (i, (r, p)) in futures_util::future::join_all(sends)
        .await
        .into_iter()
        .zip(prompts)
        .enumerate()
    {
        assert_eq!(r?["output_ids"], p["greedy_ids"], "prompt {i}");
    }
    Ok(())
}
