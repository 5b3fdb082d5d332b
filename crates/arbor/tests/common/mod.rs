//! Helpers of the `arbor serve` end-to-end tests: start the real binary on a
//! free loopback port (`--port 0`; the address is read from its stdout), talk
//! to it with reqwest, read SSE streams, read Prometheus metrics, and check
//! that no KV token stays in use. Each test binary uses a subset.

#![allow(dead_code)]

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_arbor");

pub fn fixture(name: &str) -> String {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

/// A running `arbor serve`; killed on drop.
pub struct Server {
    pub child: Child,
    pub base: String,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

pub fn drain(
    r: impl Read + Send + 'static,
    sink: Arc<Mutex<String>>,
    tx: Option<mpsc::Sender<String>>,
) {
    std::thread::spawn(move || {
        for line in BufReader::new(r).lines().map_while(Result::ok) {
            if let Ok(mut s) = sink.lock() {
                s.push_str(&line);
                s.push('\n');
            }
            if let Some(tx) = &tx {
                let _ = tx.send(line);
            }
        }
    });
}

impl Server {
    pub fn start(args: &[&str]) -> Result<Self> {
        Self::start_command("serve", args)
    }

    /// Starts `arbor SUBCOMMAND ARGS` (`serve` or `router`): both print
    /// `listening on http://ADDR` once ready.
    pub fn start_command(subcommand: &str, args: &[&str]) -> Result<Self> {
        Self::start_with_env(subcommand, args, &[])
    }

    /// [`Server::start_command`] with extra environment variables.
    pub fn start_with_env(subcommand: &str, args: &[&str], env: &[(&str, &str)]) -> Result<Self> {
        let mut child = Command::new(BIN)
            .arg(subcommand)
            .args(args)
            .env("ARBOR_LOG", "warn")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .context("starting arbor serve")?;
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = mpsc::channel();
        drain(
            child.stdout.take().context("stdout")?,
            stdout.clone(),
            Some(tx),
        );
        drain(child.stderr.take().context("stderr")?, stderr.clone(), None);
        let deadline = Instant::now() + Duration::from_secs(180);
        let base = loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    if let Some(addr) = line.strip_prefix("listening on ") {
                        break addr.trim().to_string();
                    }
                }
                Err(_) => {
                    let _ = child.kill();
                    let _ = child.wait();
                    // The process is gone; its stderr reader may still be
                    // copying the last lines.
                    let settle = Instant::now() + Duration::from_secs(2);
                    while Instant::now() < settle
                        && stderr.lock().map(|s| s.is_empty()).unwrap_or(false)
                    {
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    bail!(
                        "arbor {subcommand} did not start: stdout {:?} stderr {:?}",
                        stdout.lock().map(|s| s.clone()).unwrap_or_default(),
                        stderr.lock().map(|s| s.clone()).unwrap_or_default()
                    );
                }
            }
        };
        Ok(Self {
            child,
            base,
            stdout,
            stderr,
        })
    }

    /// The tiny Llama on a free port with a small KV cache and metrics on.
    pub fn tiny(extra: &[&str]) -> Result<Self> {
        Self::small(&fixture("tiny-llama"), extra)
    }

    /// The model at `model` as [`Server::tiny`] serves the tiny Llama.
    pub fn small(model: &str, extra: &[&str]) -> Result<Self> {
        let mut args = vec![
            "--model-path",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--threads",
            "1",
            "--max-total-tokens",
            "8192",
            "--enable-metrics",
        ];
        args.extend_from_slice(extra);
        Self::start(&args)
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn sigterm(&self) -> Result<()> {
        let st = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()?;
        ensure!(st.success(), "kill -TERM failed");
        Ok(())
    }

    pub fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(s) = self.child.try_wait()? {
                return Ok(s);
            }
            if Instant::now() > deadline {
                bail!("arbor serve did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits (a little) until the output holds `needle`: the reader threads may lag the exit.
    pub fn log_contains(&self, needle: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if self.logs().contains(needle) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn logs(&self) -> String {
        format!(
            "stdout:\n{}\nstderr:\n{}",
            self.stdout.lock().map(|s| s.clone()).unwrap_or_default(),
            self.stderr.lock().map(|s| s.clone()).unwrap_or_default()
        )
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn client() -> reqwest::Client {
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .expect("http client")
}

/// POSTs raw bytes; returns the status and the body as JSON (or as a JSON string).
pub async fn post_raw(
    c: &reqwest::Client,
    url: &str,
    body: impl Into<reqwest::Body>,
    auth: Option<&str>,
) -> Result<(u16, Value)> {
    let mut rq = c
        .post(url)
        .header("content-type", "application/json")
        .body(body);
    if let Some(k) = auth {
        rq = rq.bearer_auth(k);
    }
    let r = rq.send().await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    Ok((
        status,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

pub async fn post(c: &reqwest::Client, url: &str, body: &Value) -> Result<(u16, Value)> {
    post_raw(c, url, body.to_string(), None).await
}

/// POSTs and expects 200.
pub async fn post_ok(c: &reqwest::Client, url: &str, body: &Value) -> Result<Value> {
    let (s, v) = post(c, url, body).await?;
    ensure!(s == 200, "{url} answered {s}: {v}");
    Ok(v)
}

pub async fn get(c: &reqwest::Client, url: &str, auth: Option<&str>) -> Result<(u16, String)> {
    let mut rq = c.get(url);
    if let Some(k) = auth {
        rq = rq.bearer_auth(k);
    }
    let r = rq.send().await?;
    Ok((r.status().as_u16(), r.text().await?))
}

/// An SSE response read event by event (bytes are buffered, so UTF-8 and
/// events split across HTTP chunks are reassembled).
pub struct SseReader {
    resp: reqwest::Response,
    buf: Vec<u8>,
    done: bool,
}

impl SseReader {
    pub fn new(resp: reqwest::Response) -> Result<Self> {
        ensure!(resp.status().as_u16() == 200, "status {}", resp.status());
        let ct = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        ensure!(ct.starts_with("text/event-stream"), "content-type {ct}");
        Ok(Self {
            resp,
            buf: Vec::new(),
            done: false,
        })
    }

    /// The next `data:` payload; `None` after `[DONE]` or at the end of the body.
    pub async fn next(&mut self) -> Result<Option<Value>> {
        loop {
            if let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = self.buf.drain(..end + 2).collect();
                let event = String::from_utf8(event)?;
                let data = event
                    .trim_end()
                    .strip_prefix("data: ")
                    .context("SSE event without 'data: '")?;
                if data == "[DONE]" {
                    self.done = true;
                    return Ok(None);
                }
                return Ok(Some(
                    serde_json::from_str(data).with_context(|| format!("bad JSON {data}"))?,
                ));
            }
            match self.resp.chunk().await? {
                Some(b) => self.buf.extend_from_slice(&b),
                None => return Ok(None),
            }
        }
    }

    /// Every remaining payload; the flag says whether `[DONE]` ended the stream.
    pub async fn rest(mut self) -> Result<(Vec<Value>, bool)> {
        let mut out = Vec::new();
        while let Some(v) = self.next().await? {
            out.push(v);
        }
        if self.done {
            ensure!(
                self.resp.chunk().await?.is_none() && self.buf.is_empty(),
                "data after [DONE]"
            );
        }
        Ok((out, self.done))
    }
}

pub async fn sse_events(resp: reqwest::Response) -> Result<(Vec<Value>, bool)> {
    SseReader::new(resp)?.rest().await
}

pub async fn sse(c: &reqwest::Client, url: &str, body: &Value) -> Result<Vec<Value>> {
    let r = c.post(url).json(body).send().await?;
    let (events, done) = sse_events(r).await?;
    ensure!(done, "stream ended without [DONE]");
    Ok(events)
}

/// One sample of a Prometheus metric (first matching line).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Waits until idle, flushes the cache and checks that no KV token is in use.
pub async fn assert_no_leak(
    c: &reqwest::Client,
    s: &Server,
    prefix: &str,
    auth: Option<&str>,
) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut rq = c.post(s.url("/flush_cache"));
        if let Some(k) = auth {
            rq = rq.bearer_auth(k);
        }
        if rq.send().await?.status().as_u16() == 200 {
            let (_, m) = get(c, &s.url("/metrics"), auth).await?;
            let used = metric(&m, &format!("{prefix}:num_used_tokens"));
            let running = metric(&m, &format!("{prefix}:num_running_reqs"));
            // Flushed: nothing cached either, so every page is back in the pool.
            let cached = metric(&m, &format!("{prefix}:evictable_tokens"));
            if used == Some(0.0) && running == Some(0.0) && cached == Some(0.0) {
                return Ok(());
            }
        }
        ensure!(
            Instant::now() < deadline,
            "KV tokens still in use after requests ended"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `arbor serve` on the tiny Llama with `args` must exit with an error that contains `needle`.
pub fn assert_serve_refuses(args: &[&str], needle: &str) -> Result<()> {
    assert_model_refuses("tiny-llama", args, needle)
}

/// `arbor serve` on the fixture `name` with `args` must exit with an error that contains `needle`.
pub fn assert_model_refuses(name: &str, args: &[&str], needle: &str) -> Result<()> {
    let model = fixture(name);
    let mut child = Command::new(BIN)
        .args([
            "serve",
            "--model-path",
            &model,
            "--port",
            "0",
            "--max-total-tokens",
            "1024",
        ])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    // A refusal comes at start-up; a server still running is an acceptance
    // (stopped here rather than left serving for ever).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while child.try_wait()?.is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output()?;
            anyhow::bail!(
                "{args:?} was accepted (still serving after 120 s): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "{args:?} was accepted");
    ensure!(err.contains(needle), "{args:?}: {err}");
    Ok(())
}

/// A fixture's `reference.json` (prompts with transformers' greedy ids).
pub fn reference_json(dir: &str) -> Result<Value> {
    let path = format!("{dir}/reference.json");
    let text = std::fs::read_to_string(&path).with_context(|| path.clone())?;
    serde_json::from_str(&text).with_context(|| path)
}

/// `/generate` of `input_ids`, greedy and ignoring EOS, for `max_new_tokens`
/// tokens: the response.
pub async fn generate_greedy(
    c: &reqwest::Client,
    s: &Server,
    input_ids: &Value,
    max_new_tokens: &Value,
) -> Result<Value> {
    let body = serde_json::json!({
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": true},
    });
    Ok(c.post(s.url("/generate"))
        .json(&body)
        .send()
        .await?
        .json()
        .await?)
}

pub fn meta(v: &Value) -> &Value {
    &v["meta_info"]
}

/// `log_softmax(logits)`.
pub fn log_softmax(logits: &[f64]) -> Vec<f64> {
    let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
    logits.iter().map(|l| l - lse).collect()
}

/// The numbers of a JSON list.
pub fn f64s(v: &Value) -> Vec<f64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_f64).collect())
        .unwrap_or_default()
}
