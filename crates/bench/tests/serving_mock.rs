//! End-to-end runs of `bench serving` against a mock server (axum on a free
//! loopback port) that streams realistic SSE on SGLang's native `/generate`
//! and OpenAI's `/v1/completions` and `/v1/chat/completions`. The mock only
//! checks the client; it is not a product. It fakes a prefix cache (cached
//! tokens = the longest common prefix with any earlier prompt, in words or
//! ids) so the cache report has something to show.

use anyhow::Result;
use arbor_bench::serving::ServingArgs;
use arbor_bench::{BenchError, run_serving};
use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::serve::ListenerExt;
use clap::Parser;
use serde_json::{Value, json};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Default)]
struct Mock {
    seen: Mutex<Vec<Vec<String>>>,
    flushes: AtomicUsize,
    requests: AtomicUsize,
}

type Shared = Arc<Mock>;

/// The prompt's "tokens" (words or ids) and the cached prefix length.
fn admit(m: &Mock, prompt: &[String]) -> usize {
    m.requests.fetch_add(1, Ordering::SeqCst);
    let mut seen = m.seen.lock().expect("mock state");
    let cached = seen
        .iter()
        .map(|s| s.iter().zip(prompt).take_while(|(a, b)| a == b).count())
        .max()
        .unwrap_or(0);
    seen.push(prompt.to_vec());
    cached
}

fn words_of(v: &Value) -> Vec<String> {
    match v {
        Value::String(s) => s.split_whitespace().map(str::to_string).collect(),
        Value::Array(a) => a.iter().map(|x| x.to_string()).collect(),
        _ => Vec::new(),
    }
}

/// An SSE body: each event written in two pieces (split mid-event), a short
/// pause between events.
fn sse(events: Vec<String>) -> Response {
    let pieces: Vec<(Bytes, bool)> = events
        .into_iter()
        .flat_map(|e| {
            let bytes = format!("data: {e}\n\n").into_bytes();
            let mid = bytes.len() / 2;
            [
                (Bytes::copy_from_slice(&bytes[..mid]), false),
                (Bytes::copy_from_slice(&bytes[mid..]), true),
            ]
        })
        .collect();
    let stream = futures_util::stream::unfold(pieces.into_iter(), |mut it| async move {
        let (b, pause) = it.next()?;
        if pause {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        Some((Ok::<Bytes, Infallible>(b), it))
    });
    Response::builder()
        .header("content-type", "text/event-stream")
        .body(Body::from_stream(stream))
        .expect("SSE response")
}

async fn generate(State(m): State<Shared>, body: axum::Json<Value>) -> Response {
    let prompt = words_of(
        body.get("text")
            .or_else(|| body.get("input_ids"))
            .unwrap_or(&Value::Null),
    );
    let cached = admit(&m, &prompt);
    let n = body["sampling_params"]["max_new_tokens"]
        .as_u64()
        .unwrap_or(16) as usize;
    let meta = |k: usize, done: bool| {
        json!({"prompt_tokens": prompt.len(), "completion_tokens": k, "cached_tokens": cached,
               "finish_reason": if done { json!({"type": "length", "length": n}) } else { Value::Null },
               "e2e_latency": 0.01})
    };
    if body["stream"] == json!(false) {
        return axum::Json(json!({"text": "tok ".repeat(n), "meta_info": meta(n, true)}))
            .into_response();
    }
    // One token per chunk, the last two together (exercises the ITL spreading).
    let mut events = Vec::new();
    let mut k = 0;
    while k < n {
        k += if n - k == 2 { 2 } else { 1 };
        events.push(json!({"text": "tok ".repeat(k), "meta_info": meta(k, k == n)}).to_string());
    }
    events.push("[DONE]".into());
    sse(events)
}

async fn completions(State(m): State<Shared>, body: axum::Json<Value>, chat: bool) -> Response {
    let prompt_v = if chat {
        body["messages"][0]["content"].clone()
    } else {
        body["prompt"].clone()
    };
    let prompt = words_of(&prompt_v);
    let cached = admit(&m, &prompt);
    let n = body["max_tokens"].as_u64().unwrap_or(16) as usize;
    let usage = json!({"prompt_tokens": prompt.len(), "completion_tokens": n, "total_tokens": prompt.len() + n,
                       "prompt_tokens_details": {"cached_tokens": cached}});
    let choice = |text: &str, fin: Value| {
        if chat {
            json!({"index": 0, "delta": {"content": text}, "finish_reason": fin})
        } else {
            json!({"index": 0, "text": text, "finish_reason": fin})
        }
    };
    if body["stream"] != json!(true) {
        let c = if chat {
            json!({"index": 0, "message": {"role": "assistant", "content": "tok ".repeat(n)}, "finish_reason": "length"})
        } else {
            json!({"index": 0, "text": "tok ".repeat(n), "finish_reason": "length"})
        };
        return axum::Json(json!({"id": "x", "choices": [c], "usage": usage})).into_response();
    }
    let mut events = Vec::new();
    if chat {
        events.push(json!({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}).to_string());
    }
    for _ in 0..n {
        events.push(json!({"choices": [choice("tok ", Value::Null)]}).to_string());
    }
    events.push(json!({"choices": [choice("", json!("length"))]}).to_string());
    if body["stream_options"]["include_usage"] == json!(true) {
        events.push(json!({"choices": [], "usage": usage}).to_string());
    }
    events.push("[DONE]".into());
    sse(events)
}

/// Starts the mock on a free loopback port; returns its base URL and state.
fn start_mock() -> (String, Shared) {
    let state: Shared = Arc::new(Mock::default());
    let app = Router::new()
        .route("/generate", post(generate))
        .route(
            "/v1/completions",
            post(|s: State<Shared>, b: axum::Json<Value>| completions(s, b, false)),
        )
        .route(
            "/v1/chat/completions",
            post(|s: State<Shared>, b: axum::Json<Value>| completions(s, b, true)),
        )
        .route(
            "/v1/models",
            get(|| async { axum::Json(json!({"object": "list", "data": [{"id": "mock-model"}]})) }),
        )
        .route(
            "/flush_cache",
            post(|State(m): State<Shared>| async move {
                m.flushes.fetch_add(1, Ordering::SeqCst);
                m.seen.lock().expect("mock state").clear();
                "ok"
            }),
        )
        .route(
            "/get_server_info",
            get(|| async { axum::Json(json!({"internal_states": [{}]})) }),
        )
        .with_state(state.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("mock runtime");
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("loopback port");
            let port = listener.local_addr().expect("local address").port();
            tx.send(port).expect("port channel");
            // Without TCP_NODELAY, Nagle's algorithm and delayed ACKs hold small
            // SSE writes back by ~40 ms and the measured TTFT shows it.
            let listener = listener.tap_io(|tcp| {
                let _ = tcp.set_nodelay(true);
            });
            axum::serve(listener, app).await.expect("mock server");
        });
    });
    let port = rx.recv().expect("mock server port");
    (format!("http://127.0.0.1:{port}"), state)
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: ServingArgs,
}

fn args(list: &[&str]) -> ServingArgs {
    let mut v = vec!["bench"];
    v.extend_from_slice(list);
    Cli::parse_from(v).args
}

#[test]
fn native_stream_shared_prefix_with_cache_goodput_and_jsonl() -> Result<()> {
    let (url, mock) = start_mock();
    let dir = tempfile::tempdir()?;
    let out = dir.path().join("requests.jsonl");
    let summary = dir.path().join("summary.jsonl");
    let a = args(&[
        "--backend",
        "arbor",
        "--base-url",
        &url,
        "--dataset-name",
        "generated-shared-prefix",
        "--gsp-num-groups",
        "2",
        "--gsp-prompts-per-group",
        "4",
        "--gsp-system-prompt-len",
        "32",
        "--gsp-question-len",
        "8",
        "--gsp-output-len",
        "6",
        "--max-concurrency",
        "2",
        "--warmup-requests",
        "2",
        "--flush-cache",
        "--slo-ttft-ms",
        "60000",
        "--slo-itl-ms",
        "60000",
        "--output-file",
        out.to_str().unwrap(),
        "--output-summary",
        summary.to_str().unwrap(),
        "--disable-tqdm",
    ]);
    let r = run_serving(a)?;
    let m = &r.metrics;
    assert_eq!((m.completed, m.failed), (8, 0));
    assert_eq!(m.total_output, 8 * 6);
    // Words stand in for tokens and the server reported prompt_tokens: 32 + 8 words each.
    assert_eq!(m.total_input, 8 * 40);
    assert_eq!(mock.flushes.load(Ordering::SeqCst), 1);
    assert_eq!(mock.requests.load(Ordering::SeqCst), 2 + 8);
    assert!(m.max_concurrent_requests >= 1 && m.max_concurrent_requests <= 8);
    // Each request: TTFT, then 5 ITLs (one chunk carried two tokens, split in two gaps).
    for o in &r.outputs {
        assert!(o.success, "{}", o.error);
        assert_eq!(o.itl.len(), 5);
        assert!(o.ttft > 0.0 && o.latency >= o.ttft);
        assert_eq!(o.finish_reason.as_deref(), Some("length"));
    }
    // The mock's fake radix cache sees the shared system prompts after the flush.
    let c = m.cache.expect("cache section");
    assert_eq!(c.reporting, 8);
    assert!(c.cached_tokens >= 6 * 32, "{c:?}");
    assert!(c.dataset_sharing_rate.unwrap() > 0.5);
    assert_eq!(m.goodput.unwrap().good_requests, 8);
    for row in [
        "============ Serving Benchmark Result ============",
        "Backend:                                 arbor",
        "Traffic request rate:                    inf",
        "Max request concurrency:                 2",
        "Successful requests:                     8",
        "Total generated tokens:                  48",
        "Total generated tokens (retokenized):    n/a",
        "---------------Inter-Token Latency----------------",
        "Max ITL (ms):",
        "-------------------Prefix Cache-------------------",
        "---------------------Goodput----------------------",
        "Requests meeting SLOs:                   8/8",
    ] {
        assert!(r.block.contains(row), "missing {row:?} in\n{}", r.block);
    }
    let lines: Vec<Value> = std::fs::read_to_string(&out)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    assert_eq!(lines.len(), 8);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["index"], i);
        assert_eq!(l["success"], true);
        assert_eq!(l["output_len"], 6);
        assert_eq!(l["itl"].as_array().unwrap().len(), 5);
        assert!(l["cached_tokens"].is_u64());
    }
    let s: Value = serde_json::from_str(std::fs::read_to_string(&summary)?.trim())?;
    assert_eq!(
        (s["completed"].as_u64(), s["backend"].as_str()),
        (Some(8), Some("arbor"))
    );
    assert!(s["p99_ttft_ms"].is_f64());
    Ok(())
}

#[test]
fn openai_chat_stream_with_poisson_arrivals() -> Result<()> {
    let (url, _mock) = start_mock();
    let a = args(&[
        "--backend",
        "openai-chat",
        "--base-url",
        &url,
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        "6",
        "--random-input-len",
        "16",
        "--random-output-len",
        "5",
        "--random-range-ratio",
        "1",
        "--request-rate",
        "200",
        "--seed",
        "3",
        "--disable-tqdm",
    ]);
    let r = run_serving(a)?;
    assert_eq!(r.metrics.completed, 6);
    assert_eq!(r.header.request_rate, "200.0");
    for o in &r.outputs {
        // Usage came in the final chunk: 5 tokens, 16 prompt words, text streamed as deltas.
        assert_eq!(
            (o.output_len, o.server_prompt_tokens, o.itl.len()),
            (5, Some(16), 4)
        );
        assert_eq!(o.generated_text, "tok ".repeat(5));
    }
    // Poisson arrivals: start times are spread, not all at zero.
    assert!(r.outputs.iter().any(|o| o.start_time > 0.0));
    assert!(
        r.block
            .contains("Backend:                                 openai-chat")
    );
    Ok(())
}

#[test]
fn openai_completions_without_streaming() -> Result<()> {
    let (url, _mock) = start_mock();
    let a = args(&[
        "--backend",
        "openai",
        "--base-url",
        &url,
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        "3",
        "--random-input-len",
        "8",
        "--random-output-len",
        "4",
        "--random-range-ratio",
        "1",
        "--disable-stream",
        "--warmup-requests",
        "0",
        "--disable-tqdm",
        "--model",
        "mock-model",
    ]);
    let r = run_serving(a)?;
    assert_eq!(r.metrics.completed, 3);
    for o in &r.outputs {
        assert_eq!(o.ttft, o.latency);
        assert!(o.itl.is_empty());
        assert_eq!(o.output_len, 4);
    }
    Ok(())
}

#[test]
fn mooncake_trace_replay_and_native_without_stream() -> Result<()> {
    let (url, _mock) = start_mock();
    let dir = tempfile::tempdir()?;
    let trace = dir.path().join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 600, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 100, \"input_length\": 700, \"output_length\": 3, \"hash_ids\": [0, 1]}\n\
         {\"timestamp\": 200, \"input_length\": 100, \"output_length\": 3, \"hash_ids\": [2]}\n",
    )?;
    let a = args(&[
        "--backend",
        "sglang",
        "--base-url",
        &url,
        "--dataset-name",
        "mooncake",
        "--dataset-path",
        trace.to_str().unwrap(),
        "--trace-speed",
        "2",
        "--disable-stream",
        "--cache-report",
        "--disable-tqdm",
    ]);
    let r = run_serving(a)?;
    assert_eq!(r.header.request_rate, "trace");
    assert_eq!(r.metrics.completed, 3);
    let starts: Vec<f64> = r.outputs.iter().map(|o| o.start_time).collect();
    // Sent at 0, 50 and 100 ms (timestamps / 2): never before their time.
    assert!(starts[1] >= 0.045 && starts[2] >= 0.095, "{starts:?}");
    // The second request shares the first's two blocks: 600 of its 700 words were seen.
    assert_eq!(r.outputs[1].cached_tokens, Some(600));
    assert!(
        r.block
            .contains("Traffic request rate:                    trace")
    );
    assert!(r.block.contains("Dataset prefix sharing rate:"));
    Ok(())
}

#[test]
fn unreachable_server_fails_the_warmup() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let a = args(&[
        "--backend",
        "arbor",
        "--port",
        &port.to_string(),
        "--dataset-name",
        "random-ids",
        "--num-prompts",
        "2",
        "--random-input-len",
        "4",
        "--random-output-len",
        "2",
        "--disable-tqdm",
    ]);
    let e = run_serving(a).unwrap_err();
    assert!(matches!(e, BenchError::WarmupFailed(_)), "{e}");
}
