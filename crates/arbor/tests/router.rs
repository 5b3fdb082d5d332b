//! `arbor router` end to end: real `arbor serve` workers (the tiny Llama)
//! on loopback ports behind a real router process. Which worker served a
//! request is read from the workers' own metrics, not from the router.
//! Worker generation is paused (`/pause_generation` in place) where a test
//! needs requests to be in flight at the same time, so no test depends on
//! timing. Each test ends with every worker's KV pool back to empty.

mod common;

use anyhow::{Context, Result, ensure};
use common::{Server, SseReader, assert_no_leak, client, get, metric, post};
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

fn router(workers: &[&Server], extra: &[&str]) -> Result<Server> {
    let mut args: Vec<String> = vec!["--port".into(), "0".into()];
    if !workers.is_empty() {
        args.push("--worker-urls".into());
        args.extend(workers.iter().map(|w| w.base.clone()));
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    Server::start_command("router", &refs)
}

/// `arbor router --pd-disaggregation` over one prefill and one decode worker, then `extra`.
fn pd_router(prefill: &Server, decode: &Server, extra: &[&str]) -> Result<Server> {
    let mut args = vec![
        "--pd-disaggregation",
        "--prefill",
        &prefill.base,
        "--decode",
        &decode.base,
    ];
    args.extend_from_slice(extra);
    router(&[], &args)
}

fn workers(n: usize) -> Result<Vec<Server>> {
    (0..n).map(|_| Server::tiny(&[])).collect()
}

/// Requests each worker has finished or started (its own counter).
async fn served(c: &reqwest::Client, ws: &[Server]) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for w in ws {
        let (_, m) = get(c, &w.url("/metrics"), None).await?;
        out.push(metric(&m, "arbor:num_requests_total").context("num_requests_total")?);
    }
    Ok(out)
}

fn delta(before: &[f64], after: &[f64]) -> Vec<u64> {
    before
        .iter()
        .zip(after)
        .map(|(b, a)| (a - b) as u64)
        .collect()
}

/// An unlabelled sample of the router's metrics.
fn plain_metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

async fn pause(c: &reqwest::Client, w: &Server) -> Result<()> {
    let (s, v) = post(c, &w.url("/pause_generation"), &json!({"mode": "in_place"})).await?;
    ensure!(s == 200, "pause: {s} {v}");
    Ok(())
}

async fn resume(c: &reqwest::Client, w: &Server) -> Result<()> {
    let (s, v) = post(c, &w.url("/continue_generation"), &json!({})).await?;
    ensure!(s == 200, "continue: {s} {v}");
    Ok(())
}

/// The router's view: each worker's in-flight load, by URL.
async fn loads(c: &reqwest::Client, r: &Server) -> Result<Vec<(String, u64)>> {
    let (_, body) = get(c, &r.url("/workers"), None).await?;
    let v: Value = serde_json::from_str(&body)?;
    Ok(v["workers"]
        .as_array()
        .context("workers")?
        .iter()
        .map(|w| {
            (
                w["url"].as_str().unwrap_or("").to_string(),
                w["load"].as_u64().unwrap_or(0),
            )
        })
        .collect())
}

async fn wait_total_load(c: &reqwest::Client, r: &Server, want: u64) -> Result<Vec<(String, u64)>> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let l = loads(c, r).await?;
        if l.iter().map(|x| x.1).sum::<u64>() == want {
            return Ok(l);
        }
        ensure!(
            Instant::now() < deadline,
            "router load never reached {want}: {l:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Requests waiting in each worker's queue (its own gauge).
async fn queued(c: &reqwest::Client, ws: &[Server]) -> Result<Vec<u64>> {
    let mut out = Vec::new();
    for w in ws {
        let (_, m) = get(c, &w.url("/metrics"), None).await?;
        let q = metric(&m, "arbor:num_queue_reqs").unwrap_or(0.0)
            + metric(&m, "arbor:num_running_reqs").unwrap_or(0.0);
        out.push(q as u64);
    }
    Ok(out)
}

fn prefix(group: usize) -> String {
    let words = ["oak", "elm", "ash", "fir", "yew", "bay"];
    (0..24)
        .map(|i| words[(i * (group + 2) + group) % words.len()])
        .collect::<Vec<_>>()
        .join(" ")
}

fn generate_body(text: &str, n: u32) -> Value {
    json!({"text": text, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": true}})
}

#[tokio::test]
async fn cache_aware_keeps_each_prefix_on_one_worker() -> Result<()> {
    let ws = workers(3)?;
    let r = router(&ws.iter().collect::<Vec<_>>(), &["--policy", "cache_aware"])?;
    let c = client();
    let mut homes = Vec::new();
    for g in 0..3 {
        let before = served(&c, &ws).await?;
        let mut cached = Vec::new();
        for q in 0..4 {
            let (s, v) = post(
                &c,
                &r.url("/generate"),
                &generate_body(&format!("{} question {q}", prefix(g)), 4),
            )
            .await?;
            ensure!(s == 200, "{s} {v}");
            cached.push(v["meta_info"]["cached_tokens"].as_u64().unwrap_or(0));
        }
        let d = delta(&before, &served(&c, &ws).await?);
        let home = d
            .iter()
            .position(|&n| n == 4)
            .with_context(|| format!("group {g} spread: {d:?}"))?;
        ensure!(d.iter().sum::<u64>() == 4, "{d:?}");
        // The worker really reused the prefix.
        ensure!(
            cached[1..].iter().all(|&t| t > 0),
            "no cache hit: {cached:?}"
        );
        homes.push(home);
    }
    // A new prefix goes to the worker with the smallest tree: each its own.
    homes.sort_unstable();
    homes.dedup();
    ensure!(homes.len() == 3, "groups shared workers: {homes:?}");
    // The OpenAI APIs route by their prompt too, and streams pass through.
    let before = served(&c, &ws).await?;
    let body = json!({"prompt": format!("{} question 9", prefix(1)), "max_tokens": 3, "temperature": 0, "stream": true});
    let resp = c.post(r.url("/v1/completions")).json(&body).send().await?;
    let (events, done) = SseReader::new(resp)?.rest().await?;
    ensure!(done && !events.is_empty());
    let d = delta(&before, &served(&c, &ws).await?);
    ensure!(d.iter().sum::<u64>() == 1);
    let (_, m) = get(&c, &r.url("/metrics"), None).await?;
    let hits = metric(&m, "arbor_router_routing_decisions_total").context("decisions")?;
    ensure!(hits > 0.0, "{m}");
    ensure!(m.contains("decision=\"cache_hit\"} 10"), "{m}");
    ensure!(m.contains("decision=\"cache_miss\"} 3"), "{m}");
    let (s, _) = post(&c, &r.url("/flush_cache"), &json!({})).await?;
    ensure!(s == 200);
    for w in &ws {
        assert_no_leak(&c, w, "arbor", None).await?;
    }
    Ok(())
}

/// 12 requests of one hot prefix in flight at once (workers paused).
async fn hot_prefix_loads(c: &reqwest::Client, ws: &[Server], r: &Server) -> Result<Vec<u64>> {
    for w in ws {
        pause(c, w).await?;
    }
    let calls: Vec<_> = (0..12)
        .map(|q| {
            let c = c.clone();
            let url = r.url("/generate");
            let body = generate_body(&format!("{} hot {q}", prefix(4)), 2);
            tokio::spawn(async move { post(&c, &url, &body).await })
        })
        .collect();
    let router_view = wait_total_load(c, r, 12).await?;
    // The workers agree: each holds what the router says it sent.
    let deadline = Instant::now() + Duration::from_secs(30);
    let on_workers = loop {
        let q = queued(c, ws).await?;
        if q.iter().sum::<u64>() == 12 || Instant::now() > deadline {
            break q;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let by_url: Vec<u64> = ws
        .iter()
        .map(|w| {
            router_view
                .iter()
                .find(|(u, _)| *u == w.base)
                .map_or(0, |x| x.1)
        })
        .collect();
    ensure!(
        by_url == on_workers,
        "router {router_view:?} workers {on_workers:?}"
    );
    check_get_loads(c, ws, r, &on_workers).await?;
    for w in ws {
        resume(c, w).await?;
    }
    for h in calls {
        let (s, v) = h.await??;
        ensure!(s == 200, "{s} {v}");
    }
    Ok(on_workers)
}

/// SGLang's load reports while the workers are paused: each worker's own
/// `/get_load` counts the requests it holds (`held`) and their tokens, and
/// the router's `/get_loads` passes each worker's tokens on.
async fn check_get_loads(
    c: &reqwest::Client,
    ws: &[Server],
    r: &Server,
    held: &[u64],
) -> Result<()> {
    let (s, body) = get(c, &r.url("/get_loads"), None).await?;
    ensure!(s == 200, "get_loads: {s} {body}");
    let via_router: Value = serde_json::from_str(&body)?;
    let listed = via_router["workers"].as_array().context("workers")?;
    ensure!(listed.len() == ws.len(), "{via_router}");
    for (w, &n) in ws.iter().zip(held) {
        let (s, own) = get(c, &w.url("/get_load"), None).await?;
        ensure!(s == 200, "get_load: {s} {own}");
        let own: Value = serde_json::from_str(&own)?;
        let rank = &own[0];
        let tokens = rank["num_tokens"].as_i64().context("num_tokens")?;
        ensure!(
            rank["dp_rank"] == 0 && rank["num_reqs"].as_u64() == Some(n),
            "{} holds {n}: {own}",
            w.base
        );
        // Prompts of 26 words or more each, whether queued or admitted;
        // nothing but evictable cache on a worker that holds none.
        let least = if n == 0 { 0 } else { 20 * n as i64 };
        ensure!(tokens >= least && (n > 0 || tokens == 0), "{own}");
        let load = listed
            .iter()
            .find(|x| x["worker"] == w.base.as_str())
            .and_then(|x| x["load"].as_i64());
        ensure!(load == Some(tokens), "router {via_router} worker {own}");
    }
    Ok(())
}

#[tokio::test]
async fn bounded_load_caps_a_hot_prefix() -> Result<()> {
    let ws = workers(3)?;
    let all: Vec<&Server> = ws.iter().collect();
    let c = client();
    // SGLang's cache_aware: 12 in flight are far below the imbalance
    // thresholds, so the prefix's worker takes them all.
    let plain = router(&all, &["--policy", "cache_aware"])?;
    let loads = hot_prefix_loads(&c, &ws, &plain).await?;
    ensure!(loads.iter().max() == Some(&12), "{loads:?}");
    drop(plain);
    // Bounded: at most ⌈1.25 × 12 / 3⌉ = 5 on any worker.
    let bounded = router(
        &all,
        &["--policy", "cache_aware", "--max-load-factor", "1.25"],
    )?;
    let loads = hot_prefix_loads(&c, &ws, &bounded).await?;
    ensure!(loads.iter().all(|&n| (1..=5).contains(&n)), "{loads:?}");
    let (_, m) = get(&c, &bounded.url("/metrics"), None).await?;
    ensure!(m.contains("decision=\"bounded_load\""), "{m}");
    for w in &ws {
        assert_no_leak(&c, w, "arbor", None).await?;
    }
    Ok(())
}

#[tokio::test]
async fn round_robin_power_of_two_and_random_spread_load() -> Result<()> {
    let ws = workers(3)?;
    let all: Vec<&Server> = ws.iter().collect();
    let c = client();
    for policy in ["round_robin", "power_of_two", "random"] {
        let r = router(&all, &["--policy", policy])?;
        let before = served(&c, &ws).await?;
        for q in 0..9 {
            let (s, v) = post(
                &c,
                &r.url("/v1/chat/completions"),
                &json!({
                "messages": [{"role": "user", "content": format!("{} {q}", prefix(0))}],
                "max_tokens": 2, "temperature": 0}),
            )
            .await?;
            ensure!(s == 200, "{policy}: {s} {v}");
        }
        let d = delta(&before, &served(&c, &ws).await?);
        ensure!(d.iter().sum::<u64>() == 9, "{policy}: {d:?}");
        if policy == "round_robin" {
            ensure!(d == [3, 3, 3], "{d:?}");
        } else {
            // Same prefix every time, yet no affinity: with 9 requests the
            // chance that one worker takes all is (1/3)^8 for random and
            // zero for power_of_two (an idle worker beats a busy one only
            // when loads differ; sequential requests see equal loads, so
            // the draw decides).
            ensure!(d.iter().filter(|&&n| n > 0).count() >= 2, "{policy}: {d:?}");
        }
        let (_, m) = get(&c, &r.url("/metrics"), None).await?;
        ensure!(m.contains(&format!("decision=\"{policy}\"}} 9")), "{m}");
    }
    for w in &ws {
        assert_no_leak(&c, w, "arbor", None).await?;
    }
    Ok(())
}

#[tokio::test]
async fn a_killed_worker_loses_no_request_that_had_not_started() -> Result<()> {
    let mut ws = workers(3)?;
    let all: Vec<&Server> = ws.iter().collect();
    let r = router(
        &all,
        &[
            "--policy",
            "round_robin",
            "--health-check-interval-secs",
            "1",
            "--retry-initial-backoff-ms",
            "10",
        ],
    )?;
    let c = client();
    for w in &ws {
        pause(&c, w).await?;
    }
    let calls: Vec<_> = (0..6)
        .map(|q| {
            let c = c.clone();
            let url = r.url("/generate");
            let body = generate_body(&format!("{} kill {q}", prefix(2)), 3);
            tokio::spawn(async move { post(&c, &url, &body).await })
        })
        .collect();
    let l = wait_total_load(&c, &r, 6).await?;
    ensure!(l.iter().all(|x| x.1 == 2), "{l:?}");
    // Worker 1 dies with two requests queued; the others go on.
    ws[1].child.kill()?;
    ws[1].child.wait()?;
    resume(&c, &ws[0]).await?;
    resume(&c, &ws[2]).await?;
    for h in calls {
        let (s, v) = h.await??;
        ensure!(s == 200, "a request was lost: {s} {v}");
        ensure!(v["meta_info"]["completion_tokens"] == 3, "{v}");
    }
    let (_, m) = get(&c, &r.url("/metrics"), None).await?;
    ensure!(
        plain_metric(&m, "arbor_router_retries_total") >= Some(2.0),
        "{m}"
    );
    // Health checks take the dead worker out; traffic goes to the others.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, m) = get(&c, &r.url("/metrics"), None).await?;
        if m.contains(&format!(
            "arbor_router_worker_healthy{{worker=\"{}\"}} 0",
            ws[1].base
        )) {
            break;
        }
        ensure!(Instant::now() < deadline, "worker 1 still healthy: {m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for q in 0..4 {
        let (s, v) = post(
            &c,
            &r.url("/generate"),
            &generate_body(&format!("after {q}"), 2),
        )
        .await?;
        ensure!(s == 200, "{s} {v}");
    }
    // A request that had started streaming gets a clear error when its
    // worker dies: pause the worker mid-stream, then kill it.
    // Both live workers are paused as soon as the first token arrives, so
    // that a fast machine cannot finish the stream before the busy worker
    // is found.
    let body = json!({"text": "stream me", "stream": true, "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": true}});
    let resp = c.post(r.url("/generate")).json(&body).send().await?;
    let mut reader = SseReader::new(resp)?;
    let first = reader.next().await?.context("no first event")?;
    ensure!(first.get("text").is_some(), "{first}");
    tokio::try_join!(pause(&c, &ws[0]), pause(&c, &ws[2]))?;
    let l = loads(&c, &r).await?;
    let busy = l
        .iter()
        .find(|x| x.1 == 1)
        .context("no busy worker")?
        .0
        .clone();
    let victim = ws
        .iter()
        .position(|w| w.base == busy)
        .context("busy worker")?;
    ws[victim].child.kill()?;
    ws[victim].child.wait()?;
    let (rest, done) = reader.rest().await?;
    ensure!(!done, "the stream claimed to be complete");
    let err = rest.last().context("no error event")?;
    let msg = err["error"]["message"].as_str().unwrap_or("");
    ensure!(
        msg.contains("failed mid-response") && msg.contains(&busy),
        "{err}"
    );
    let (_, m) = get(&c, &r.url("/metrics"), None).await?;
    ensure!(
        m.contains("arbor_router_request_failures_total{reason=\"mid_stream\"} 1"),
        "{m}"
    );
    let survivor = (0..3)
        .find(|&i| i != 1 && i != victim)
        .context("survivor")?;
    resume(&c, &ws[survivor]).await?;
    assert_no_leak(&c, &ws[survivor], "arbor", None).await
}

#[tokio::test]
async fn workers_come_and_go_and_bad_input_gets_clear_errors() -> Result<()> {
    let c = client();
    let r = router(&[], &["--policy", "cache_aware"])?;
    let (s, body) = get(&c, &r.url("/health"), None).await?;
    ensure!(s == 503, "{s} {body}");
    let (s, v) = post(&c, &r.url("/generate"), &generate_body("hi", 1)).await?;
    ensure!(
        s == 503
            && v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .contains("no healthy worker"),
        "{s} {v}"
    );
    let w = Server::tiny(&[])?;
    let add = |url: String| {
        let c = c.clone();
        let r = r.url(&format!("/add_worker?url={url}"));
        async move { c.post(r).send().await.map(|x| x.status().as_u16()) }
    };
    ensure!(add(w.base.clone()).await? == 200);
    ensure!(add(w.base.clone()).await? == 400, "a duplicate was added");
    ensure!(
        add("http://127.0.0.1:1".into()).await? == 400,
        "an unreachable worker was added"
    );
    ensure!(add("not-a-url".into()).await? == 400);
    let (s, v) = post(&c, &r.url("/generate"), &generate_body("hi", 2)).await?;
    ensure!(s == 200, "{s} {v}");
    let (s, body) = get(&c, &r.url("/list_workers"), None).await?;
    ensure!(s == 200 && body.contains(&w.base), "{body}");
    let (s, body) = get(&c, &r.url("/v1/models"), None).await?;
    ensure!(s == 200 && body.contains("\"object\""), "{s} {body}");
    // Routes that generate nothing pass through to a worker.
    let (s, v) = post(&c, &r.url("/tokenize"), &json!({"prompt": "hi"})).await?;
    ensure!(s == 200 && v["count"].as_u64() > Some(0), "{s} {v}");
    let (s, v) = post(&c, &r.url("/v1/embeddings"), &json!({"input": "hi"})).await?;
    ensure!(
        s == 400 && v.to_string().contains("--is-embedding"),
        "{s} {v}"
    );
    // Not JSON: 400 from the router itself.
    let resp = c.post(r.url("/generate")).body("{oops").send().await?;
    ensure!(resp.status().as_u16() == 400);
    // The worker's own 400s pass through untouched.
    let (s, v) = post(
        &c,
        &r.url("/generate"),
        &json!({"text": "x", "sampling_params": {"temperature": -1}}),
    )
    .await?;
    ensure!(s == 400 && v["error"]["message"].is_string(), "{s} {v}");
    let remove = |url: String| {
        let c = c.clone();
        let r = r.url(&format!("/remove_worker?url={url}"));
        async move { c.post(r).send().await.map(|x| x.status().as_u16()) }
    };
    ensure!(remove("http://127.0.0.1:1".into()).await? == 404);
    ensure!(remove(w.base.clone()).await? == 200);
    let (s, _) = post(&c, &r.url("/generate"), &generate_body("hi", 1)).await?;
    ensure!(s == 503);
    assert_no_leak(&c, &w, "arbor", None).await?;

    // Start-up errors name the problem.
    let refuse = |args: &[&str], needle: &str| -> Result<()> {
        let out = Command::new(common::BIN)
            .arg("router")
            .args(["--port", "0"])
            .args(args)
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success(), "{args:?} was accepted");
        ensure!(err.contains(needle), "{args:?}: {err}");
        Ok(())
    };
    refuse(
        &[
            "--worker-urls",
            "http://127.0.0.1:1",
            "--worker-startup-timeout-secs",
            "1",
        ],
        "http://127.0.0.1:1 was not healthy",
    )?;
    refuse(
        &["--worker-urls", &w.base, &format!("{}/", w.base)],
        "registered already",
    )?;
    refuse(
        &["--worker-urls", "localhost:8000"],
        "is not http://HOST:PORT",
    )?;
    refuse(&["--policy", "least_busy"], "cache_aware")?;
    refuse(&["--max-load-factor", "0.5"], "--max-load-factor")?;
    Ok(())
}

/// Sends request `q` (`body`) to one worker and through the PD `router`:
/// the same output ids, and the decode worker matched the transferred
/// prompt (all its whole pages, 16 tokens each, came from the prefill
/// worker).
async fn pd_equals_one_worker(
    c: &reqwest::Client,
    single: &Server,
    router: &Server,
    body: &Value,
    q: usize,
) -> Result<()> {
    let (s, want) = post(c, &single.url("/generate"), body).await?;
    ensure!(s == 200, "{want}");
    let (s, got) = post(c, &router.url("/generate"), body).await?;
    ensure!(s == 200, "{got}");
    ensure!(
        got["output_ids"] == want["output_ids"],
        "q {q}: {got} != {want}"
    );
    let prompt = got["meta_info"]["prompt_tokens"].as_u64().unwrap_or(0);
    let cached = got["meta_info"]["cached_tokens"].as_u64().unwrap_or(0);
    ensure!(
        prompt > 16 && cached >= prompt / 16 * 16 - 16 && cached > 0,
        "q {q}: cached {cached} of {prompt}"
    );
    Ok(())
}

/// Both PD workers with two data-parallel replicas: the prefill worker
/// exports each prompt's KV from the replica that computed it, the decode
/// worker imports it into one of its replicas and runs the request there,
/// so the output equals one worker's and the prompt's whole pages count as
/// cached.
#[tokio::test]
async fn pd_disaggregation_with_data_parallel_workers() -> Result<()> {
    let single = Server::tiny(&[])?;
    let prefill = Server::tiny(&["--disaggregation-mode", "prefill", "--dp-size", "2"])?;
    let decode = Server::tiny(&[
        "--disaggregation-mode",
        "decode",
        "--page-size",
        "16",
        "--dp-size",
        "2",
    ])?;
    let r = pd_router(&prefill, &decode, &[])?;
    let c = client();
    for q in 0..6 {
        let body = generate_body(&format!("{} pd dp {q}", prefix(q % 3)), 12);
        pd_equals_one_worker(&c, &single, &r, &body, q).await?;
    }
    let (_, load) = get(&c, &decode.url("/get_load"), None).await?;
    let load: Value = serde_json::from_str(&load)?;
    let served: Vec<u64> = load
        .as_array()
        .context("get_load")?
        .iter()
        .map(|r| r["num_requests_total"].as_u64().unwrap_or(0))
        .collect();
    ensure!(
        served.len() == 2 && served.iter().all(|&n| n > 0),
        "both decode replicas serve: {load}"
    );
    for w in [&single, &prefill, &decode] {
        assert_no_leak(&c, w, "arbor", None).await?;
    }
    Ok(())
}

#[tokio::test]
async fn pd_disaggregation_matches_one_worker_and_survives_a_dead_prefill() -> Result<()> {
    let single = Server::tiny(&[])?;
    let mut prefill = Server::tiny(&["--disaggregation-mode", "prefill"])?;
    let decode = Server::tiny(&["--disaggregation-mode", "decode", "--page-size", "16"])?;
    ensure!(
        decode
            .logs()
            .contains("disaggregation: decode (receives KV over tcp on 127.0.0.1:"),
        "{}",
        decode.logs()
    );
    let r = pd_router(&prefill, &decode, &["--health-check-interval-secs", "1"])?;
    let c = client();
    for q in 0..4 {
        let body = generate_body(&format!("{} pd {q}", prefix(q % 2)), 16);
        pd_equals_one_worker(&c, &single, &r, &body, q).await?;
    }
    // Streams and the OpenAI APIs go through the same path.
    let body = json!({"text": format!("{} pd stream", prefix(3)), "stream": true, "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}});
    let (want, _) = SseReader::new(c.post(single.url("/generate")).json(&body).send().await?)?
        .rest()
        .await?;
    let (got, done) = SseReader::new(c.post(r.url("/generate")).json(&body).send().await?)?
        .rest()
        .await?;
    ensure!(
        done && got.last().map(|v| &v["output_ids"]) == want.last().map(|v| &v["output_ids"]),
        "{got:?} vs {want:?}"
    );
    let chat = json!({"messages": [{"role": "user", "content": prefix(5)}], "max_tokens": 6, "temperature": 0});
    let (s, a) = post(&c, &single.url("/v1/chat/completions"), &chat).await?;
    let (s2, b) = post(&c, &r.url("/v1/chat/completions"), &chat).await?;
    ensure!(
        s == 200 && s2 == 200 && a["choices"][0]["message"] == b["choices"][0]["message"],
        "{a} vs {b}"
    );
    // Seeded sampling too: the decode worker starts from the prefill's
    // sampled first token and skips its draw.
    let body = json!({"text": format!("{} pd sampled", prefix(2)), "sampling_params": {"max_new_tokens": 12, "temperature": 0.9, "top_p": 0.9, "sampling_seed": 11, "ignore_eos": true}});
    let (_, want) = post(&c, &single.url("/generate"), &body).await?;
    let (s, got) = post(&c, &r.url("/generate"), &body).await?;
    ensure!(
        s == 200 && got["output_ids"] == want["output_ids"],
        "{s} {got} vs {want}"
    );
    // The router sent each request to both workers with a bootstrap room
    // (the prefill worker publishes its bootstrap port): the prefill worker
    // deposited the KV and its first token, and the decode worker pulled
    // them and started each of the 7 requests from that token.
    let (_, m) = get(&c, &decode.url("/metrics"), None).await?;
    ensure!(
        metric(&m, "arbor:given_first_tokens_total") == Some(7.0),
        "{m}"
    );
    for w in [&prefill, &decode] {
        let (_, m) = get(&c, &w.url("/metrics"), None).await?;
        ensure!(
            metric(&m, "arbor:kv_transfer_tokens_total") > Some(0.0),
            "{m}"
        );
        ensure!(
            metric(&m, "arbor:kv_transfer_failures_total") == Some(0.0),
            "{m}"
        );
    }
    // Only the decode worker is asked for model information.
    let (s, body) = get(&c, &r.url("/v1/models"), None).await?;
    ensure!(s == 200, "{body}");
    for w in [&single, &prefill, &decode] {
        assert_no_leak(&c, w, "arbor", None).await?;
    }
    // A prefill worker that dies costs time, not requests.
    prefill.child.kill()?;
    prefill.child.wait()?;
    let body = generate_body(&format!("{} after the prefill died", prefix(1)), 8);
    let (_, want) = post(&c, &single.url("/generate"), &body).await?;
    let (s, got) = post(&c, &r.url("/generate"), &body).await?;
    ensure!(
        s == 200 && got["output_ids"] == want["output_ids"],
        "{s} {got}"
    );
    // The prefill request runs beside the decode one (bootstrap rooms): its
    // failure is counted once its retries gave up, after the answer.
    let mut m = String::new();
    for _ in 0..100 {
        m = get(&c, &r.url("/metrics"), None).await?.1;
        if m.contains("arbor_router_request_failures_total{reason=\"prefill\"}") {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    ensure!(
        m.contains("arbor_router_request_failures_total{reason=\"prefill\"} 1"),
        "{m}"
    );
    assert_no_leak(&c, &decode, "arbor", None).await?;

    // Roles are checked: a whole worker is neither a prefill nor a decode
    // worker, and only prefill workers take the peer header.
    let out = Command::new(common::BIN)
        .args([
            "router",
            "--port",
            "0",
            "--pd-disaggregation",
            "--prefill",
            &single.base,
            "--decode",
            &decode.base,
        ])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains("runs --disaggregation-mode null, not prefill"),
        "{err}"
    );
    let resp = c
        .post(single.url("/generate"))
        .header("x-arbor-kv-peer", "127.0.0.1:1")
        .json(&generate_body("x", 1))
        .send()
        .await?;
    let status = resp.status().as_u16();
    let text = resp.text().await?;
    ensure!(
        status == 400 && text.contains("not a prefill worker"),
        "{status} {text}"
    );
    // SGLang's bootstrap fields on a whole worker are refused, naming them.
    let mut body = generate_body("x", 1);
    body["bootstrap_host"] = json!("127.0.0.1");
    body["bootstrap_port"] = json!(1);
    body["bootstrap_room"] = json!(7);
    let (s, e) = post(&c, &single.url("/generate"), &body).await?;
    ensure!(
        s == 400
            && e.to_string()
                .contains("bootstrap_room: this worker is not disaggregated"),
        "{s} {e}"
    );
    body["bootstrap_room"] = json!(-3);
    let (s, e) = post(&c, &decode.url("/generate"), &body).await?;
    ensure!(
        s == 400 && e["error"]["param"] == "bootstrap_room",
        "{s} {e}"
    );
    Ok(())
}

/// A tensor-parallel prefill worker (`--tp-size 2`: its ranks hold half
/// the KV heads each) hands its KV to a single-rank decode worker: the
/// pages travel in the single-engine layout, so greedy output equals a
/// whole worker's and the decode worker reports the prompt's pages cached.
#[tokio::test]
async fn pd_with_a_tensor_parallel_prefill_worker() -> Result<()> {
    let single = Server::tiny(&[])?;
    let prefill = Server::tiny(&["--disaggregation-mode", "prefill", "--tp-size", "2"])?;
    let decode = Server::tiny(&["--disaggregation-mode", "decode", "--page-size", "16"])?;
    let r = pd_router(&prefill, &decode, &[])?;
    let c = client();
    for q in 0..3 {
        let body = generate_body(&format!("{} tp prefill {q}", prefix(q)), 12);
        let (_, want) = post(&c, &single.url("/generate"), &body).await?;
        let (s, got) = post(&c, &r.url("/generate"), &body).await?;
        ensure!(
            s == 200 && got["output_ids"] == want["output_ids"],
            "q {q}: {got} != {want}"
        );
        let prompt = got["meta_info"]["prompt_tokens"].as_u64().unwrap_or(0);
        let cached = got["meta_info"]["cached_tokens"].as_u64().unwrap_or(0);
        ensure!(
            cached > 0 && cached + 16 >= prompt / 16 * 16,
            "cached {cached} of {prompt}"
        );
    }
    let (_, m) = get(&c, &decode.url("/metrics"), None).await?;
    ensure!(
        metric(&m, "arbor:kv_transfer_tokens_total") > Some(0.0)
            && metric(&m, "arbor:kv_transfer_failures_total") == Some(0.0),
        "{m}"
    );
    for w in [&prefill, &decode] {
        assert_no_leak(&c, w, "arbor", None).await?;
    }
    Ok(())
}

/// `--api-key`: the router authorizes itself at workers started with
/// `--api-key` (a router without it gets their 401 back, untouched), in
/// place of whatever a client sent; `--prometheus-port` serves the router's
/// metrics on a listener of their own.
#[tokio::test]
async fn api_key_reaches_the_workers_and_metrics_get_their_own_port() -> Result<()> {
    let c = client();
    let key = "router-secret";
    let w = Server::tiny(&["--api-key", key])?;
    let plain = router(&[&w], &[])?;
    let (s, v) = post(&c, &plain.url("/generate"), &generate_body("hi", 2)).await?;
    ensure!(s == 401, "a router without the key got through: {s} {v}");
    drop(plain);
    let r = router(&[&w], &["--api-key", key, "--prometheus-port", "0"])?;
    let (s, v) = post(&c, &r.url("/generate"), &generate_body("hi", 2)).await?;
    ensure!(s == 200, "{s} {v}");
    // A client's own (wrong) key is replaced by the router's.
    let resp = c
        .post(r.url("/v1/completions"))
        .bearer_auth("the-client-s-key")
        .json(&json!({"model": "tiny-llama", "prompt": "hi", "max_tokens": 2, "temperature": 0}))
        .send()
        .await?;
    ensure!(resp.status().as_u16() == 200, "{}", resp.text().await?);
    let (s, body) = get(&c, &r.url("/v1/models"), None).await?;
    ensure!(s == 200, "{s} {body}");
    // The metrics listener, printed before the serving address.
    let logs = r.logs();
    let metrics_url = logs
        .lines()
        .find_map(|l| l.strip_prefix("metrics on "))
        .context("no metrics listener printed")?
        .trim()
        .to_string();
    let (s, m) = get(&c, &metrics_url, None).await?;
    ensure!(s == 200, "{s} {m}");
    ensure!(
        m.contains("arbor_router_requests_total"),
        "not the router's metrics: {m}"
    );
    let (s, _) = get(&c, &metrics_url.replace("/metrics", "/generate"), None).await?;
    ensure!(
        s == 404,
        "the metrics listener serves more than /metrics: {s}"
    );
    assert_no_leak(&c, &w, "arbor", Some(key)).await
}
