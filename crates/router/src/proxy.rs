//! Forwarding a request to a worker: choose, send, retry, stream back.
//!
//! A request is retried on another worker (with exponential backoff and
//! jitter) when the attempt failed before any of its response reached the
//! client: a connection error, or a 408, 429 or 5xx status. After the
//! response started it is never retried: the body streams through chunk by
//! chunk as the worker writes it (no buffering), and if the worker fails
//! mid-stream an SSE response ends with one `data: {"error": ...}` frame
//! (other bodies end with a transport error), so the client always learns
//! that its answer is incomplete. The worker's load guard lives inside the
//! streamed body: load counts until the last byte went out.

use crate::metrics::FailureKind;
use crate::state::RouterState;
use crate::worker::{LoadGuard, Role, Worker};
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;

/// An error answered by the router itself (OpenAI-style JSON, like the
/// workers' own errors).
pub fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    let kind = match status {
        StatusCode::NOT_FOUND => "not_found_error",
        StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
        s if s.is_client_error() => "invalid_request_error",
        _ => "server_error",
    };
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": status.as_u16()}});
    (status, axum::Json(body)).into_response()
}

fn hop_by_hop(name: &HeaderName) -> bool {
    matches!(
        name.as_str(),
        "connection"
            | "keep-alive"
            | "proxy-connection"
            | "transfer-encoding"
            | "te"
            | "trailer"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

fn retryable(status: reqwest::StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 429 | 500 | 502 | 503 | 504)
}

/// The request as received, to send to a worker.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// GET or POST.
    pub method: Method,
    /// Path and query.
    pub path_and_query: String,
    /// Client headers (hop-by-hop ones are dropped when sending).
    pub headers: HeaderMap,
    /// The body, sent again on a retry.
    pub body: Bytes,
}

/// `out` addressed to the worker at `base`: the client's headers but the
/// hop-by-hop ones (and its `Authorization` when the router has an API key:
/// the client's default headers carry the router's own), the body for a
/// POST, the request time limit.
fn request_to(st: &RouterState, base: &str, out: &Outgoing) -> reqwest::RequestBuilder {
    let mut rq = st
        .client
        .request(out.method.clone(), format!("{base}{}", out.path_and_query))
        .timeout(st.cfg.request_timeout);
    let own_key = st.cfg.api_key.is_some();
    for (k, v) in &out.headers {
        let replaced = own_key && k == header::AUTHORIZATION;
        if !hop_by_hop(k) && !replaced {
            rq = rq.header(k, v);
        }
    }
    if out.method == Method::POST {
        rq = rq.body(out.body.clone());
    }
    rq
}

enum Attempt {
    Answered(Response),
    Failed(String),
}

async fn attempt(st: &Arc<RouterState>, guard: LoadGuard, out: &Outgoing, last: bool) -> Attempt {
    let w = guard.worker().clone();
    let rq = request_to(st, w.url(), out);
    st.metrics.sent(w.url());
    let resp = match rq.send().await {
        Ok(r) => r,
        Err(e) => {
            w.breaker().record(false);
            if e.is_connect() && w.mark_unhealthy() {
                tracing::warn!("worker {} refused a connection: marked unhealthy", w.url());
            }
            return Attempt::Failed(format!("{}: {e}", w.url()));
        }
    };
    let status = resp.status();
    if retryable(status) && !last {
        w.breaker().record(false);
        let body = resp.text().await.unwrap_or_default();
        return Attempt::Failed(format!("{} answered {status}: {}", w.url(), body.trim()));
    }
    w.breaker().record(!status.is_server_error());
    w.count_processed();
    Attempt::Answered(stream_back(st.clone(), guard, resp))
}

fn stream_back(st: Arc<RouterState>, guard: LoadGuard, resp: reqwest::Response) -> Response {
    let mut b = Response::builder().status(resp.status().as_u16());
    for (k, v) in resp.headers() {
        if !hop_by_hop(k) {
            b = b.header(k, v);
        }
    }
    let sse = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    struct Pass<S> {
        inner: S,
        guard: Option<LoadGuard>,
        st: Arc<RouterState>,
        sse: bool,
    }
    let pass = Pass {
        inner: resp.bytes_stream(),
        guard: Some(guard),
        st,
        sse,
    };
    let body = futures_util::stream::unfold(pass, |mut p| async move {
        p.guard.as_ref()?;
        match p.inner.next().await {
            Some(Ok(bytes)) => Some((Ok(bytes), p)),
            Some(Err(e)) => {
                let w: Arc<Worker> = p.guard.take()?.worker().clone();
                w.breaker().record(false);
                p.st.metrics.failure(FailureKind::MidStream);
                let message = format!("worker {} failed mid-response: {e}", w.url());
                tracing::warn!("{message}");
                if p.sse {
                    let frame = json!({"error": {"message": message, "type": "server_error", "param": null, "code": 502}});
                    Some((Ok(Bytes::from(format!("data: {frame}\n\n"))), p))
                } else {
                    Some((Err(std::io::Error::other(message)), p))
                }
            }
            None => None,
        }
    });
    b.body(Body::from_stream(body)).unwrap_or_else(|e| {
        error_response(StatusCode::BAD_GATEWAY, format!("bad worker response: {e}"))
    })
}

/// Sends `out` to a worker of `role` chosen by `text` (see
/// [`RouterState::pick`]; `first`: the worker of the first attempt, chosen
/// already), retrying as the module doc says.
pub async fn forward(
    st: &Arc<RouterState>,
    role: Role,
    text: Option<&[char]>,
    out: Outgoing,
    mut first: Option<LoadGuard>,
) -> Response {
    let mut tried: Vec<Arc<Worker>> = Vec::new();
    let mut errors: Vec<String> = Vec::new();
    let max = st.cfg.retry.max_retries;
    for n in 0..=max {
        let Some(guard) = first.take().or_else(|| st.pick(role, text, &tried)) else {
            if errors.is_empty() {
                st.metrics.failure(FailureKind::NoWorker);
                return error_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no healthy worker is available",
                );
            }
            break;
        };
        tried.push(guard.worker().clone());
        match attempt(st, guard, &out, n == max).await {
            Attempt::Answered(r) => return r,
            Attempt::Failed(e) => {
                tracing::info!("attempt {} of {} failed: {e}", n + 1, max + 1);
                errors.push(e);
            }
        }
        if n < max {
            st.metrics.retry();
            tokio::time::sleep(st.cfg.retry.backoff(n, st.unit())).await;
        }
    }
    st.metrics.failure(FailureKind::Upstream);
    error_response(
        StatusCode::BAD_GATEWAY,
        format!(
            "every attempt failed ({}): {}",
            errors.len(),
            errors.join("; ")
        ),
    )
}

/// Sends `out` to every worker at once; returns each URL with its status
/// (or the error).
pub async fn broadcast(st: &Arc<RouterState>, out: Outgoing) -> Vec<(String, Result<u16, String>)> {
    let calls = st.workers.all().into_iter().map(|w| {
        let st = st.clone();
        let out = out.clone();
        async move {
            let r = match request_to(&st, w.url(), &out).send().await {
                Ok(r) => Ok(r.status().as_u16()),
                Err(e) => Err(e.to_string()),
            };
            (w.url().to_string(), r)
        }
    });
    futures_util::future::join_all(calls).await
}

/// A worker's load as SGLang's `/get_load` reports it: the tokens of its
/// data-parallel ranks summed (`[{"num_tokens": ..}, ..]`), or an older
/// server's `{"load": n}`; `None` for anything else.
pub fn parse_load(v: &Value) -> Option<i64> {
    match v {
        Value::Array(ranks) => ranks
            .iter()
            .map(|r| r.get("num_tokens").and_then(Value::as_i64))
            .sum(),
        Value::Object(o) => o.get("load").and_then(Value::as_i64),
        _ => None,
    }
}

/// Every worker's `/get_load`, asked at once (each within the health-check
/// time limit); -1 for a worker that did not answer with a load.
pub async fn loads(st: &Arc<RouterState>) -> Vec<(Arc<Worker>, i64)> {
    let calls = st.workers.all().into_iter().map(|w| {
        let st = st.clone();
        async move {
            let rq = st
                .client
                .get(format!("{}/get_load", w.url()))
                .timeout(st.cfg.health.timeout);
            let load = match rq.send().await {
                Ok(r) if r.status().is_success() => r.json::<Value>().await.ok(),
                _ => None,
            };
            let load = load.as_ref().and_then(parse_load).unwrap_or(-1);
            (w, load)
        }
    });
    futures_util::future::join_all(calls).await
}

#[cfg(test)]
mod tests {
    use super::{loads, parse_load};
    use crate::config::testing::default_state;
    use serde_json::json;
    use std::sync::Arc;

    #[tokio::test]
    async fn a_worker_that_does_not_answer_has_load_minus_one() {
        let st = Arc::new(default_state());
        // A port nothing listens on any more.
        let dead = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a port");
        st.workers.add(&format!("http://{dead}")).expect("a worker");
        let got = loads(&st).await;
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].1, -1);
    }

    #[test]
    fn loads_parse_from_both_shapes_of_get_load() {
        let ranks = json!([{"dp_rank": 0, "num_reqs": 3, "num_tokens": 120},
                           {"dp_rank": 1, "num_reqs": 1, "num_tokens": 30}]);
        assert_eq!(parse_load(&ranks), Some(150));
        assert_eq!(parse_load(&json!({"load": 7})), Some(7));
        assert_eq!(parse_load(&json!([{"dp_rank": 0}])), None);
        assert_eq!(parse_load(&json!("busy")), None);
    }
}
