//! One benchmark request against a server, timed like SGLang's
//! `bench_serving` request functions.
//!
//! Backends: `arbor` and `sglang` speak SGLang's native `POST /generate`
//! (cumulative `text` and `meta_info` in every SSE chunk); `openai` speaks
//! `POST /v1/completions`; `openai-chat` speaks `POST /v1/chat/completions`.
//!
//! Timing rules (SGLang's): the clock starts just before the request is sent;
//! TTFT is the arrival of the first chunk carrying text; on the native API,
//! a later chunk that brings `k` new tokens (by `meta_info.completion_tokens`)
//! adds `k` inter-token latencies of `gap / k` and a chunk bringing none is
//! ignored; on the OpenAI APIs each chunk with text adds one gap; the
//! latency is the arrival of the last chunk (`[DONE]` included); without
//! streaming TTFT equals the latency. The output length is the server's
//! `completion_tokens` when it reports one, else the requested length.
//! Invariant: a request is a success exactly when the server answered 200
//! and the stream parsed without an error event.

use crate::dataset::Prompt;
use crate::sse::{SseEvent, SseParser};
use serde::Serialize;
use serde_json::{Map, Value, json};
use std::time::Instant;

/// The API a benchmark speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApiBackend {
    /// Arbor's native `/generate` (SGLang's API).
    Arbor,
    /// SGLang's native `/generate`.
    Sglang,
    /// OpenAI `/v1/completions` (vLLM, SGLang, llama.cpp, Arbor).
    Openai,
    /// OpenAI `/v1/chat/completions`.
    OpenaiChat,
}

impl ApiBackend {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Self::Arbor | Self::Sglang => "/generate",
            Self::Openai => "/v1/completions",
            Self::OpenaiChat => "/v1/chat/completions",
        }
    }

    /// Whether it is SGLang's native API.
    pub fn is_native(self) -> bool {
        matches!(self, Self::Arbor | Self::Sglang)
    }

    /// The name printed in the result block.
    pub fn name(self) -> &'static str {
        match self {
            Self::Arbor => "arbor",
            Self::Sglang => "sglang",
            Self::Openai => "openai",
            Self::OpenaiChat => "openai-chat",
        }
    }
}

/// What every request of a run shares.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// The API.
    pub backend: ApiBackend,
    /// Full URL of the generation endpoint.
    pub api_url: String,
    /// Model name for the OpenAI APIs.
    pub model: String,
    /// Stream the answer.
    pub stream: bool,
    /// Ask the server to ignore EOS (so outputs have the requested length).
    pub ignore_eos: bool,
    /// Extra fields merged into every request body.
    pub extra_body: Map<String, Value>,
    /// `Authorization` header value, if any.
    pub authorization: Option<String>,
}

/// The measurements of one request (one JSONL record of `--output-file`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct RequestOutput {
    /// Position in the data set.
    pub index: usize,
    /// Whether it completed.
    pub success: bool,
    /// Why it failed.
    pub error: String,
    /// Prompt length in client tokens.
    pub prompt_len: usize,
    /// Generated tokens (server's count, else the requested length).
    pub output_len: usize,
    /// Prompt tokens as counted by the server, when reported.
    pub server_prompt_tokens: Option<usize>,
    /// Prompt tokens served from the server's prefix cache, when reported.
    pub cached_tokens: Option<usize>,
    /// The server's finish reason, when reported.
    pub finish_reason: Option<String>,
    /// Seconds from the benchmark start to sending.
    pub start_time: f64,
    /// Seconds to the first token.
    pub ttft: f64,
    /// Seconds to the end.
    pub latency: f64,
    /// Inter-token latencies in seconds.
    pub itl: Vec<f64>,
    /// The generated text.
    pub generated_text: String,
}

/// The request body for `prompt` and `output_len`.
pub fn request_body(cfg: &ClientConfig, prompt: &Prompt, output_len: usize) -> Value {
    let mut body = match cfg.backend {
        ApiBackend::Arbor | ApiBackend::Sglang => {
            let (key, p) = match prompt {
                Prompt::Text(t) => ("text", json!(t)),
                Prompt::Ids(ids) => ("input_ids", json!(ids)),
            };
            json!({
                key: p,
                "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": cfg.ignore_eos},
                "stream": cfg.stream,
                "lora_path": null,
                "return_logprob": false,
                "logprob_start_len": -1,
            })
        }
        ApiBackend::Openai => {
            let p = match prompt {
                Prompt::Text(t) => json!(t),
                Prompt::Ids(ids) => json!(ids),
            };
            json!({
                "model": cfg.model, "prompt": p, "temperature": 0.0, "best_of": 1,
                "max_tokens": output_len, "stream": cfg.stream, "ignore_eos": cfg.ignore_eos,
            })
        }
        ApiBackend::OpenaiChat => {
            let content = match prompt {
                Prompt::Text(t) => t.clone(),
                // Validated away by the caller; keep the request well-formed anyway.
                Prompt::Ids(ids) => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(" "),
            };
            json!({
                "model": cfg.model, "messages": [{"role": "user", "content": content}],
                "temperature": 0.0, "max_completion_tokens": output_len, "max_tokens": output_len,
                "stream": cfg.stream, "ignore_eos": cfg.ignore_eos,
            })
        }
    };
    if let Some(obj) = body.as_object_mut() {
        if cfg.stream && !cfg.backend.is_native() {
            obj.insert("stream_options".into(), json!({"include_usage": true}));
        }
        for (k, v) in &cfg.extra_body {
            obj.insert(k.clone(), v.clone());
        }
    }
    body
}

fn as_count(v: Option<&Value>) -> Option<usize> {
    v.and_then(Value::as_u64).map(|n| n as usize)
}

fn reason_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        // SGLang's meta_info.finish_reason is {"type": "length", ...}.
        Value::Object(o) => o.get("type").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// Turns the stream's events into measurements; times are seconds since send.
#[derive(Debug)]
pub struct StreamState {
    backend: ApiBackend,
    /// The measurements so far.
    pub out: RequestOutput,
    got_first: bool,
    most_recent: f64,
    last_output_len: usize,
}

impl StreamState {
    /// A state for a request of `output_len` tokens.
    pub fn new(backend: ApiBackend, prompt_len: usize, output_len: usize) -> Self {
        Self {
            backend,
            out: RequestOutput {
                prompt_len,
                output_len,
                success: true,
                ..Default::default()
            },
            got_first: false,
            most_recent: 0.0,
            last_output_len: 0,
        }
    }

    /// Marks the request failed (the first error wins).
    pub fn fail(&mut self, msg: impl Into<String>) {
        if self.out.success {
            self.out.success = false;
            self.out.error = msg.into();
        }
    }

    /// Handles one SSE event arriving at `now`.
    pub fn on_sse(&mut self, ev: SseEvent, now: f64) {
        self.out.latency = now;
        let SseEvent::Data(d) = ev else { return };
        match serde_json::from_str::<Value>(&d) {
            Ok(v) => self.on_json(&v, now),
            Err(e) => {
                // Non-conforming servers put several `data:` lines in one event.
                let lines: Vec<&str> = d.lines().filter(|l| !l.trim().is_empty()).collect();
                if lines.len() > 1 {
                    for l in lines {
                        let l = l.trim().strip_prefix("data:").map_or(l, str::trim);
                        if l == "[DONE]" {
                            continue;
                        }
                        match serde_json::from_str::<Value>(l) {
                            Ok(v) => self.on_json(&v, now),
                            Err(e) => {
                                return self.fail(format!("invalid JSON in the stream: {e}: {l}"));
                            }
                        }
                    }
                } else {
                    self.fail(format!("invalid JSON in the stream: {e}: {d}"));
                }
            }
        }
    }

    /// Handles one JSON chunk (or a whole non-streamed answer) arriving at `now`.
    pub fn on_json(&mut self, v: &Value, now: f64) {
        self.out.latency = now;
        if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
            let msg = err
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| err.to_string(), str::to_string);
            return self.fail(msg);
        }
        if self.backend.is_native() {
            self.on_native(v, now);
        } else {
            self.on_openai(v, now);
        }
    }

    fn on_native(&mut self, v: &Value, now: f64) {
        let meta = v.get("meta_info");
        if let Some(m) = meta {
            self.out.server_prompt_tokens =
                as_count(m.get("prompt_tokens")).or(self.out.server_prompt_tokens);
            self.out.cached_tokens = as_count(m.get("cached_tokens")).or(self.out.cached_tokens);
            if let Some(r) = m.get("finish_reason").and_then(reason_text) {
                self.out.finish_reason = Some(r);
            }
        }
        let Some(text) = v
            .get("text")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
        else {
            return;
        };
        self.out.generated_text = text.to_string();
        let output_len = meta
            .and_then(|m| as_count(m.get("completion_tokens")))
            .unwrap_or(self.out.output_len);
        self.out.output_len = output_len;
        if !self.got_first {
            self.got_first = true;
            self.out.ttft = now;
        } else {
            let new = output_len.saturating_sub(self.last_output_len);
            if new == 0 {
                return;
            }
            let gap = (now - self.most_recent) / new as f64;
            self.out.itl.extend(std::iter::repeat_n(gap, new));
        }
        self.most_recent = now;
        self.last_output_len = output_len;
    }

    fn on_openai(&mut self, v: &Value, now: f64) {
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            self.out.output_len =
                as_count(u.get("completion_tokens")).unwrap_or(self.out.output_len);
            self.out.server_prompt_tokens =
                as_count(u.get("prompt_tokens")).or(self.out.server_prompt_tokens);
            let cached = u
                .get("prompt_tokens_details")
                .and_then(|d| as_count(d.get("cached_tokens")));
            self.out.cached_tokens = cached.or(self.out.cached_tokens);
        }
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return;
        };
        if let Some(r) = choice.get("finish_reason").and_then(reason_text) {
            self.out.finish_reason = Some(r);
        }
        let text = match self.backend {
            ApiBackend::OpenaiChat => choice
                .get("delta")
                .or_else(|| choice.get("message"))
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str),
            _ => choice.get("text").and_then(Value::as_str),
        };
        let Some(text) = text.filter(|t| !t.is_empty()) else {
            return;
        };
        if !self.got_first {
            self.got_first = true;
            self.out.ttft = now;
        } else {
            self.out.itl.push(now - self.most_recent);
        }
        self.most_recent = now;
        self.out.generated_text.push_str(text);
    }

    /// Ends the request. Without streaming, TTFT is the latency; a stream that
    /// never carried text keeps TTFT 0 and still counts as a success (SGLang's rule).
    pub fn finish(mut self, stream: bool) -> RequestOutput {
        if !stream && self.out.success {
            self.out.ttft = self.out.latency;
        }
        self.out
    }
}

/// Times a request is sent again after its connection was lost before any
/// byte of an answer came back.
const SEND_RETRIES: usize = 2;

/// Whether `e` means the connection failed before the server answered
/// anything: it could not be opened, or a pooled keep-alive connection the
/// server had just closed was reset or shut before a response head arrived
/// (cpp-httplib's llama-server closes connections after a few requests or an
/// idle timeout, racing the client's reuse). Such a request was never
/// answered, and a server that closes a connection does so without reading
/// what was written after its last response, so it is sent again on a fresh
/// connection. Timeouts and failures after the response began are not retried.
pub fn connection_lost_before_response(e: &reqwest::Error) -> bool {
    if e.is_timeout() || e.is_status() || e.is_body() || e.is_decode() {
        return false;
    }
    if e.is_connect() {
        return true;
    }
    let mut src: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(s) = src {
        if let Some(h) = s.downcast_ref::<hyper::Error>()
            && (h.is_incomplete_message() || h.is_canceled() || h.is_closed())
        {
            return true;
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>()
            && matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        {
            return true;
        }
        src = s.source();
    }
    false
}

/// A client that opens a new connection for every request.
fn fresh_client() -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .timeout(std::time::Duration::from_secs(6 * 3600))
        .build()
}

/// `e` with its causes ("error sending request: connection closed ...").
fn error_chain(e: &reqwest::Error) -> String {
    let mut msg = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        let t = s.to_string();
        if !msg.contains(&t) {
            msg.push_str(": ");
            msg.push_str(&t);
        }
        src = s.source();
    }
    msg
}

/// Sends one request and measures it. `t_bench` is the benchmark's start
/// (for `start_time`); network and HTTP errors become a failed output. A
/// request whose connection was lost before any answer byte (see
/// [`connection_lost_before_response`]) is sent again on a fresh connection,
/// up to twice; its times still count from the first send.
pub async fn send_request(
    client: &reqwest::Client,
    cfg: &ClientConfig,
    prompt: &Prompt,
    prompt_len: usize,
    output_len: usize,
    t_bench: Instant,
) -> RequestOutput {
    let body = request_body(cfg, prompt, output_len);
    let mut state = StreamState::new(cfg.backend, prompt_len, output_len);
    let st = Instant::now();
    state.out.start_time = st.duration_since(t_bench).as_secs_f64();
    let send = |c: &reqwest::Client| {
        let mut req = c.post(&cfg.api_url).json(&body);
        if let Some(a) = &cfg.authorization {
            req = req.header(reqwest::header::AUTHORIZATION, a);
        }
        req.send()
    };
    let mut attempt = send(client).await;
    for _ in 0..SEND_RETRIES {
        let Err(e) = &attempt else { break };
        if !connection_lost_before_response(e) {
            break;
        }
        let Ok(fresh) = fresh_client() else { break };
        attempt = send(&fresh).await;
    }
    let mut resp = match attempt {
        Ok(r) => r,
        Err(e) => {
            state.fail(format!("request failed: {}", error_chain(&e)));
            return state.finish(cfg.stream);
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        state.fail(format!("{status}: {text}"));
        return state.finish(cfg.stream);
    }
    if !cfg.stream {
        match resp.bytes().await {
            Ok(b) => {
                let now = st.elapsed().as_secs_f64();
                match serde_json::from_slice::<Value>(&b) {
                    Ok(v) => state.on_json(&v, now),
                    Err(e) => state.fail(format!("invalid JSON answer: {e}")),
                }
            }
            Err(e) => state.fail(format!("reading the answer: {e}")),
        }
        return state.finish(false);
    }
    let mut parser = SseParser::new();
    loop {
        match resp.chunk().await {
            Ok(Some(chunk)) => {
                let now = st.elapsed().as_secs_f64();
                for ev in parser.push(&chunk) {
                    state.on_sse(ev, now);
                }
            }
            Ok(None) => break,
            Err(e) => {
                state.fail(format!("reading the stream: {e}"));
                break;
            }
        }
    }
    if let Some(ev) = parser.finish() {
        let now = st.elapsed().as_secs_f64();
        state.on_sse(ev, now);
    }
    state.finish(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn native(text: &str, n: usize) -> SseEvent {
        SseEvent::Data(json!({"text": text, "meta_info": {"completion_tokens": n, "prompt_tokens": 10, "cached_tokens": 4}}).to_string())
    }

    #[test]
    fn native_stream_spreads_gaps_over_new_tokens() {
        let mut s = StreamState::new(ApiBackend::Sglang, 10, 99);
        s.on_sse(native("a", 1), 0.1);
        s.on_sse(native("ab", 3), 0.3); // two tokens in 0.2 s
        s.on_sse(native("ab", 3), 0.35); // no new token: ignored
        s.on_sse(native("abc", 4), 0.45);
        s.on_sse(SseEvent::Done, 0.5);
        let o = s.finish(true);
        assert!(o.success);
        assert_eq!(o.ttft, 0.1);
        assert_eq!(o.itl.len(), 3);
        assert!((o.itl[0] - 0.1).abs() < 1e-12 && (o.itl[1] - 0.1).abs() < 1e-12);
        assert!((o.itl[2] - 0.15).abs() < 1e-12);
        assert_eq!(
            (o.output_len, o.latency, o.generated_text.as_str()),
            (4, 0.5, "abc")
        );
        assert_eq!(
            (o.server_prompt_tokens, o.cached_tokens),
            (Some(10), Some(4))
        );
    }

    #[test]
    fn openai_chat_stream_with_usage_chunk() {
        let mut s = StreamState::new(ApiBackend::OpenaiChat, 5, 50);
        let delta = |c: &str| {
            SseEvent::Data(
                json!({"choices": [{"delta": {"content": c}, "finish_reason": null}]}).to_string(),
            )
        };
        s.on_sse(
            SseEvent::Data(json!({"choices": [{"delta": {"role": "assistant"}}]}).to_string()),
            0.05,
        );
        s.on_sse(delta("Hel"), 0.2);
        s.on_sse(delta("lo"), 0.25);
        s.on_sse(
            SseEvent::Data(
                json!({"choices": [{"delta": {}, "finish_reason": "length"}]}).to_string(),
            ),
            0.26,
        );
        s.on_sse(
            SseEvent::Data(json!({"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}}}).to_string()),
            0.27,
        );
        s.on_sse(SseEvent::Done, 0.3);
        let o = s.finish(true);
        assert!(o.success, "{}", o.error);
        assert_eq!((o.ttft, o.latency, o.output_len), (0.2, 0.3, 2));
        assert_eq!(o.itl.len(), 1);
        assert_eq!(o.generated_text, "Hello");
        assert_eq!(
            (
                o.server_prompt_tokens,
                o.cached_tokens,
                o.finish_reason.as_deref()
            ),
            (Some(12), Some(8), Some("length"))
        );
    }

    #[test]
    fn completions_error_events_and_bad_json() {
        let mut s = StreamState::new(ApiBackend::Openai, 5, 7);
        s.on_sse(
            SseEvent::Data(json!({"choices": [{"text": "x"}]}).to_string()),
            0.1,
        );
        s.on_sse(SseEvent::Data("data: {\"choices\": [{\"text\": \"y\"}]}\ndata: {\"choices\": [{\"text\": \"z\"}]}".into()), 0.2);
        let o = s.finish(true);
        assert!(o.success);
        assert_eq!(
            (o.generated_text.as_str(), o.itl.len(), o.output_len),
            ("xyz", 2, 7)
        );

        let mut s = StreamState::new(ApiBackend::Sglang, 5, 7);
        s.on_sse(
            SseEvent::Data(json!({"error": {"message": "boom"}}).to_string()),
            0.1,
        );
        assert_eq!(s.finish(true).error, "boom");
        let mut s = StreamState::new(ApiBackend::Sglang, 5, 7);
        s.on_sse(SseEvent::Data("{not json".into()), 0.1);
        assert!(!s.finish(true).success);
    }

    #[test]
    fn non_streamed_answers() {
        let mut s = StreamState::new(ApiBackend::Arbor, 5, 7);
        s.on_json(&json!({"text": "done", "meta_info": {"completion_tokens": 3, "finish_reason": {"type": "length"}}}), 0.8);
        let o = s.finish(false);
        assert_eq!(
            (o.ttft, o.latency, o.output_len, o.finish_reason.as_deref()),
            (0.8, 0.8, 3, Some("length"))
        );
        let mut s = StreamState::new(ApiBackend::OpenaiChat, 5, 7);
        s.on_json(&json!({"choices": [{"message": {"content": "hi"}}], "usage": {"completion_tokens": 1}}), 0.4);
        let o = s.finish(false);
        assert_eq!(
            (o.generated_text.as_str(), o.output_len, o.ttft),
            ("hi", 1, 0.4)
        );
    }

    #[test]
    fn request_bodies_follow_each_api() {
        let mut cfg = ClientConfig {
            backend: ApiBackend::Sglang,
            api_url: String::new(),
            model: "m".into(),
            stream: true,
            ignore_eos: true,
            extra_body: Map::new(),
            authorization: None,
        };
        let b = request_body(&cfg, &Prompt::Ids(vec![1, 2]), 8);
        assert_eq!(b["input_ids"], json!([1, 2]));
        assert_eq!(b["sampling_params"]["max_new_tokens"], 8);
        assert!(b.get("stream_options").is_none());
        cfg.backend = ApiBackend::OpenaiChat;
        cfg.extra_body.insert("top_k".into(), json!(5));
        let b = request_body(&cfg, &Prompt::Text("hi".into()), 8);
        assert_eq!(b["messages"][0]["content"], "hi");
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["top_k"], 5);
        cfg.backend = ApiBackend::Openai;
        cfg.stream = false;
        let b = request_body(&cfg, &Prompt::Text("hi".into()), 8);
        assert_eq!(
            (b["prompt"].as_str(), b["max_tokens"].as_u64()),
            (Some("hi"), Some(8))
        );
        assert!(b.get("stream_options").is_none());
    }
}
