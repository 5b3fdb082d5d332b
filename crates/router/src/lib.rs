//! `arbor router`: one HTTP front for several workers (`arbor serve`, or
//! SGLang servers: the API is the same), SGLang router's flags and
//! behaviour.
//!
//! Routes: `POST /generate`, `/v1/completions`, `/v1/chat/completions` go
//! to the worker the policy chooses ([`policy`]), streamed back without
//! buffering and retried elsewhere while nothing was answered yet
//! ([`proxy`]); `GET /v1/models`, `/v1/models/{id}`, `/get_model_info`,
//! `/get_server_info`, `/health_generate`, and the routes that generate
//! nothing but scores (`/v1/embeddings`, `/encode`, `/v1/score`,
//! `/v1/rerank`, `/tokenize`, `/detokenize`,
//! `/parse_function_call`, `/separate_reasoning`) go to the least loaded worker;
//! `/flush_cache` goes to every worker (and empties the router's trees);
//! `/health` is the router's own (200 while a worker is available);
//! `/metrics` is the router's Prometheus text ([`metrics`]); workers come
//! and go with `POST /add_worker?url=` and `/remove_worker?url=`, and
//! `GET /list_workers` (SGLang's `{"urls": [...]}`) and `/workers` (with
//! load, health and circuit) list them; `GET /get_loads` asks every worker
//! for its own `/get_load` (SGLang's `{"workers": [{"worker", "load"}]}`).
//!
//! Background tasks: health checks every `--health-check-interval-secs`
//! (a worker leaves after `--health-failure-threshold` failed checks and
//! comes back after `--health-success-threshold` passed ones; a refused
//! connection takes it out at once) and tree eviction every
//! `--eviction-interval-secs`.

pub mod config;
pub mod discovery;
pub mod metrics;
pub mod pd;
pub mod policy;
pub mod proxy;
pub mod state;
pub mod text;
pub mod tree;
pub mod worker;

pub use config::{RouterArgs, RouterConfig};
pub use state::RouterState;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use proxy::{Outgoing, error_response, forward};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use worker::{Role, WorkerUrlError, Workers};

/// Errors starting or running the router.
#[derive(Debug, thiserror::Error)]
pub enum RouterError {
    /// A flag's value is invalid.
    #[error("invalid value for {flag}: {message}")]
    Config {
        /// The flag.
        flag: String,
        /// What is wrong.
        message: String,
    },
    /// A worker URL is malformed or repeated.
    #[error("{0}")]
    WorkerUrl(#[from] WorkerUrlError),
    /// A start-up worker did not become healthy in time.
    #[error(
        "worker {url} was not healthy after {waited_secs} s (--worker-startup-timeout-secs): {last_error}"
    )]
    Startup {
        /// The worker.
        url: String,
        /// Seconds waited.
        waited_secs: u64,
        /// Its last health check's error.
        last_error: String,
    },
    /// The HTTP client could not be built.
    #[error("HTTP client: {0}")]
    Client(String),
    /// Socket I/O failed.
    #[error("router I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// One health check of `url`: `Ok` when it answered 2xx in time.
pub async fn check_health(st: &RouterState, url: &str) -> Result<(), String> {
    let r = st
        .client
        .get(format!("{url}{}", st.cfg.health.endpoint))
        .timeout(st.cfg.health.timeout)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if r.status().is_success() {
        Ok(())
    } else {
        Err(format!(
            "{} answered {}",
            st.cfg.health.endpoint,
            r.status()
        ))
    }
}

async fn wait_healthy(st: &RouterState, urls: &[(String, Role)]) -> Result<(), RouterError> {
    let start = Instant::now();
    for (url, _) in urls {
        let url = worker::normalize_url(url)?;
        loop {
            match check_health(st, &url).await {
                Ok(()) => break,
                Err(e) if start.elapsed() >= st.cfg.startup_timeout => {
                    return Err(RouterError::Startup {
                        url: url.clone(),
                        waited_secs: start.elapsed().as_secs(),
                        last_error: e,
                    });
                }
                Err(_) => tokio::time::sleep(st.cfg.startup_check_interval).await,
            }
        }
    }
    Ok(())
}

async fn health_loop(st: Arc<RouterState>) {
    let mut tick = tokio::time::interval(st.cfg.health.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let checks = st.workers.all().into_iter().map(|w| {
            let st = st.clone();
            async move {
                let r = check_health(&st, w.url()).await;
                if let Some(now) = w.record_check(r.is_ok(), &st.cfg.health) {
                    match (now, r) {
                        (true, _) => tracing::warn!("worker {} is healthy again", w.url()),
                        (false, Err(e)) => tracing::warn!("worker {} is unhealthy: {e}", w.url()),
                        (false, Ok(())) => {}
                    }
                }
            }
        });
        futures_util::future::join_all(checks).await;
    }
}

async fn eviction_loop(st: Arc<RouterState>) {
    let mut tick = tokio::time::interval(st.cfg.eviction_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        for w in st.workers.all() {
            let removed = w.tree().evict_to(st.cfg.max_tree_size);
            if removed > 0 {
                tracing::debug!("evicted {removed} characters from {}'s tree", w.url());
            }
        }
    }
}

fn outgoing(method: Method, uri: &Uri, headers: HeaderMap, body: Bytes) -> Outgoing {
    Outgoing {
        method,
        path_and_query: uri
            .path_and_query()
            .map_or_else(|| uri.path().to_string(), |p| p.to_string()),
        headers,
        body,
    }
}

async fn generation(
    State(st): State<Arc<RouterState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    st.metrics.request(&path);
    let json: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            st.metrics.failure(metrics::FailureKind::BadRequest);
            return error_response(
                StatusCode::BAD_REQUEST,
                format!("the request body is not JSON: {e}"),
            );
        }
    };
    let text = text::routing_text(&path, &json);
    let out = outgoing(Method::POST, &uri, headers, body);
    if st.cfg.pd.is_some() {
        return pd::generate(&st, &text, out).await;
    }
    forward(&st, Role::Regular, Some(&text), out, None).await
}

async fn any_worker(
    State(st): State<Arc<RouterState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    st.metrics.request(uri.path());
    // Model and server information: from a worker that generates.
    let role = if st.cfg.pd.is_some() {
        Role::Decode
    } else {
        Role::Regular
    };
    forward(&st, role, None, outgoing(method, &uri, headers, body), None).await
}

async fn health(State(st): State<Arc<RouterState>>) -> Response {
    let all = st.workers.all();
    let up = all.iter().filter(|w| w.available()).count();
    let body = json!({"status": if up > 0 { "ok" } else { "unavailable" }, "workers": all.len(), "available_workers": up});
    let code = if up > 0 {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, axum::Json(body)).into_response()
}

async fn metrics_text(State(st): State<Arc<RouterState>>) -> Response {
    let text = st.metrics.render(&st.workers.all());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn flush_cache(
    State(st): State<Arc<RouterState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    st.metrics.request(uri.path());
    let results = proxy::broadcast(&st, outgoing(method, &uri, headers, body)).await;
    for w in st.workers.all() {
        w.tree().clear();
    }
    let ok = results
        .iter()
        .all(|(_, r)| matches!(r, Ok(s) if (200..300).contains(s)));
    let workers: Vec<Value> = results
        .into_iter()
        .map(|(url, r)| match r {
            Ok(s) => json!({"url": url, "status": s}),
            Err(e) => json!({"url": url, "error": e}),
        })
        .collect();
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::BAD_GATEWAY
    };
    (code, axum::Json(json!({"success": ok, "workers": workers}))).into_response()
}

fn missing_url() -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        "missing query parameter url (…?url=http://HOST:PORT)",
    )
}

async fn add_worker(
    State(st): State<Arc<RouterState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(url) = q.get("url") else {
        return missing_url();
    };
    let url = match worker::normalize_url(url) {
        Ok(u) => u,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, e.to_string()),
    };
    let role = match (
        q.get("worker_type").map(String::as_str),
        st.cfg.pd.is_some(),
    ) {
        (None | Some("regular"), false) => Role::Regular,
        (Some("prefill"), true) => Role::Prefill,
        (Some("decode"), true) => Role::Decode,
        (t, pd) => {
            let want = if pd {
                "prefill or decode"
            } else {
                "regular (or none)"
            };
            return error_response(
                StatusCode::BAD_REQUEST,
                format!("worker_type {t:?}: this router takes {want}"),
            );
        }
    };
    if let Err(e) = check_health(&st, &url).await {
        return error_response(
            StatusCode::BAD_REQUEST,
            format!("worker {url} is not healthy: {e}"),
        );
    }
    let peer = match pd::check_role(&st, &url, role).await {
        Ok(p) => p,
        Err(e) => return error_response(StatusCode::BAD_REQUEST, e),
    };
    match st.workers.add_with(&url, role, peer) {
        Ok(w) => {
            tracing::warn!("added worker {}", w.url());
            (
                StatusCode::OK,
                axum::Json(
                    json!({"success": true, "message": format!("added worker {}", w.url())}),
                ),
            )
                .into_response()
        }
        Err(e) => error_response(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn remove_worker(
    State(st): State<Arc<RouterState>>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let Some(url) = q.get("url") else {
        return missing_url();
    };
    match st.workers.remove(url) {
        Ok(w) => {
            tracing::warn!(
                "removed worker {} ({} requests still in flight finish there)",
                w.url(),
                w.load()
            );
            (
                StatusCode::OK,
                axum::Json(
                    json!({"success": true, "message": format!("removed worker {}", w.url())}),
                ),
            )
                .into_response()
        }
        Err(e @ WorkerUrlError::Unknown(_)) => error_response(StatusCode::NOT_FOUND, e.to_string()),
        Err(e) => error_response(StatusCode::BAD_REQUEST, e.to_string()),
    }
}

async fn list_workers(State(st): State<Arc<RouterState>>) -> Response {
    let urls: Vec<String> = st
        .workers
        .all()
        .iter()
        .map(|w| w.url().to_string())
        .collect();
    axum::Json(json!({"urls": urls})).into_response()
}

async fn workers(State(st): State<Arc<RouterState>>) -> Response {
    let list: Vec<Value> = st
        .workers
        .all()
        .iter()
        .map(|w| {
            json!({
                "url": w.url(),
                "role": w.role().name(),
                "healthy": w.healthy(),
                "load": w.load(),
                "processed": w.processed(),
                "circuit": format!("{:?}", w.breaker().circuit()).to_lowercase(),
                "tree_chars": w.tree().size(),
            })
        })
        .collect();
    axum::Json(json!({"policy": st.cfg.policy.name(), "workers": list})).into_response()
}

/// `GET /get_loads` (SGLang's router): every worker with the load its own
/// `/get_load` reports (-1 when it did not answer); PD workers also say
/// their role.
async fn get_loads(State(st): State<Arc<RouterState>>) -> Response {
    st.metrics.request("/get_loads");
    let pd = st.cfg.pd.is_some();
    let list: Vec<Value> = proxy::loads(&st)
        .await
        .into_iter()
        .map(|(w, load)| {
            let mut v = json!({"worker": w.url(), "load": load});
            if pd {
                v["worker_type"] = json!(w.role().name());
            }
            v
        })
        .collect();
    axum::Json(json!({"workers": list})).into_response()
}

async fn not_found(uri: Uri) -> Response {
    error_response(StatusCode::NOT_FOUND, format!("no route {}", uri.path()))
}

/// The router's routes over `st`.
pub fn app(st: Arc<RouterState>) -> Router {
    let limit = st.cfg.max_payload_size;
    Router::new()
        .route("/generate", post(generation))
        .route("/v1/completions", post(generation))
        .route("/v1/chat/completions", post(generation))
        // Routes that generate nothing go to any worker as they are.
        .route("/v1/embeddings", post(any_worker))
        .route("/encode", post(any_worker))
        .route("/v1/score", post(any_worker))
        .route("/v1/rerank", post(any_worker))
        .route("/tokenize", post(any_worker))
        .route("/v1/tokenize", post(any_worker))
        .route("/detokenize", post(any_worker))
        .route("/v1/detokenize", post(any_worker))
        .route("/parse_function_call", post(any_worker))
        .route("/separate_reasoning", post(any_worker))
        .route("/v1/models", get(any_worker))
        .route("/v1/models/{id}", get(any_worker))
        .route("/get_model_info", get(any_worker))
        .route("/model_info", get(any_worker))
        .route("/get_server_info", get(any_worker))
        .route("/server_info", get(any_worker))
        .route("/health_generate", get(any_worker))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .route("/flush_cache", post(flush_cache).get(flush_cache))
        .route("/add_worker", post(add_worker))
        .route("/remove_worker", post(remove_worker))
        .route("/list_workers", get(list_workers))
        .route("/workers", get(workers))
        .route("/get_loads", get(get_loads))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(limit))
        .with_state(st)
}

/// Resolves on Ctrl-C or (on Unix) SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

fn summary(st: &RouterState, addr: std::net::SocketAddr) {
    let c = &st.cfg;
    println!("arbor router");
    let workers = match &c.pd {
        Some(pd) => format!(
            "prefill/decode disaggregation: prefill {} ({}), decode {} ({})",
            pd.prefill.join(", "),
            pd.prefill_policy.name(),
            pd.decode.join(", "),
            pd.decode_policy.name()
        ),
        None if c.worker_urls.is_empty() => "none yet (POST /add_worker?url=...)".to_string(),
        None => c.worker_urls.join(", "),
    };
    println!("  workers:    {workers}");
    let policy = match c.policy {
        policy::PolicyKind::CacheAware => format!(
            "cache_aware (cache threshold {}, balance abs {} rel {}, tree {} chars evicted every {} s, load bound {})",
            c.cache_aware.cache_threshold,
            c.cache_aware.balance_abs_threshold,
            c.cache_aware.balance_rel_threshold,
            c.max_tree_size,
            c.eviction_interval.as_secs(),
            c.cache_aware
                .max_load_factor
                .map_or("off".to_string(), |f| format!("{f}x the mean")),
        ),
        p => p.name().to_string(),
    };
    println!("  policy:     {policy}");
    println!(
        "  faults:     health {} every {} s (out after {}, back after {}), retries {}, circuit breaker {}",
        c.health.endpoint,
        c.health.interval.as_secs(),
        c.health.failure_threshold,
        c.health.success_threshold,
        c.retry.max_retries,
        if c.breaker.disabled {
            "off".to_string()
        } else {
            format!(
                "opens after {} failures for {} s",
                c.breaker.failure_threshold,
                c.breaker.timeout.as_secs()
            )
        }
    );
    println!("listening on http://{addr}");
}

/// Runs the router until Ctrl-C or SIGTERM.
pub fn run(args: RouterArgs) -> Result<(), RouterError> {
    let cfg = RouterConfig::from_args(args)?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut defaults = HeaderMap::new();
    if let Some(key) = &cfg.api_key {
        let mut v = header::HeaderValue::from_str(&format!("Bearer {key}")).map_err(|e| {
            RouterError::Config {
                flag: "--api-key".into(),
                message: e.to_string(),
            }
        })?;
        v.set_sensitive(true);
        defaults.insert(header::AUTHORIZATION, v);
    }
    let client = reqwest::Client::builder()
        .default_headers(defaults)
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .pool_idle_timeout(Duration::from_secs(90))
        .build()
        .map_err(|e| RouterError::Client(e.to_string()))?;
    let st = Arc::new(RouterState::new(cfg, client));
    let mut startup: Vec<(String, Role)> = st
        .cfg
        .worker_urls
        .iter()
        .map(|u| (u.clone(), Role::Regular))
        .collect();
    if let Some(pd) = &st.cfg.pd {
        startup.extend(pd.prefill.iter().map(|u| (u.clone(), Role::Prefill)));
        startup.extend(pd.decode.iter().map(|u| (u.clone(), Role::Decode)));
    }
    // Refuse malformed and repeated URLs before contacting anyone.
    let checked = Workers::new(st.cfg.breaker);
    for (url, _) in &startup {
        checked.add(url)?;
    }
    let kube = match &st.cfg.discovery {
        Some(d) => Some(
            discovery::KubeApi::new(d).map_err(|message| RouterError::Config {
                flag: "--service-discovery".into(),
                message,
            })?,
        ),
        None => None,
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("arbor-router")
        .enable_all()
        .build()?;
    rt.block_on(async {
        wait_healthy(&st, &startup).await?;
        for (url, role) in &startup {
            let peer =
                pd::check_role(&st, url, *role)
                    .await
                    .map_err(|message| RouterError::Config {
                        flag: match role {
                            Role::Regular => "--worker-urls".into(),
                            r => format!("--{}", r.name()),
                        },
                        message,
                    })?;
            st.workers.add_with(url, *role, peer)?;
        }
        let listener = tokio::net::TcpListener::bind((st.cfg.host.as_str(), st.cfg.port)).await?;
        if let Some((host, port)) = &st.cfg.prometheus {
            let metrics = tokio::net::TcpListener::bind((host.as_str(), *port)).await?;
            println!("metrics on http://{}/metrics", metrics.local_addr()?);
            let app = Router::new()
                .route("/metrics", get(metrics_text))
                .fallback(not_found)
                .with_state(st.clone());
            tokio::spawn(async move {
                if let Err(e) = axum::serve(metrics, app).await {
                    tracing::error!("the metrics listener stopped: {e}");
                }
            });
        }
        summary(&st, listener.local_addr()?);
        tokio::spawn(health_loop(st.clone()));
        tokio::spawn(eviction_loop(st.clone()));
        if let (Some(d), Some(api)) = (st.cfg.discovery.clone(), kube) {
            tokio::spawn(discovery::run(st.clone(), d, api));
        }
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(listener, app(st.clone()))
            .with_graceful_shutdown(shutdown_signal())
            .await?;
        Ok::<_, RouterError>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(2));
    Ok(())
}
