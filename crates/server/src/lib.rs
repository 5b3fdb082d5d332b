//! Arbor's HTTP server over a running [`Engine`].
//!
//! The server never loads models: the caller builds the engine and hands it
//! over with the tokenizer, the chat template and [`ServerOptions`]
//! ([`Server::new`]). Routes:
//!
//! - SGLang's native API: `POST /generate` ([`native`]);
//! - the OpenAI API: `POST /v1/completions`, `POST /v1/chat/completions`,
//!   `POST /v1/responses` (with `GET`/`DELETE /v1/responses/{id}` of the
//!   stored ones), `GET /v1/models` ([`openai`]);
//! - admin: `/health`, `/health_generate`, `/flush_cache`, `/abort_request`,
//!   `/get_model_info`, `/get_server_info`, and `/metrics` ([`admin`],
//!   [`metrics`]);
//! - RL weight refit: `/update_weights_from_disk`, `/pause_generation`,
//!   `/continue_generation`, `/release_memory_occupation`,
//!   `/resume_memory_occupation` ([`refit`]; weight loading needs
//!   [`Server::with_weight_loader`]).
//!
//! With a reasoning parser ([`reasoning`], `ServerOptions::reasoning_parser`)
//! chat answers carry their `<think>` block in `reasoning_content`; the
//! tool-call parser ([`tool_call`], `ServerOptions::tool_call_parser`) reads
//! calls out of answers to requests with tools. SGLang's `/parse_function_call`
//! and `/separate_reasoning` run either on a given text.
//!
//! Every error is OpenAI-style JSON ([`ApiError`]). With an API key every
//! route but `/health` and `/health_generate` needs `Authorization: Bearer`.
//! [`Server::serve`] runs until the shutdown future resolves, then stops
//! accepting connections and new requests, lets in-flight requests finish
//! for `shutdown_timeout`, aborts the rest and returns.

mod admin;
pub mod constraint;
pub mod disagg;
pub mod embeddings;
pub mod error;
mod fields;
mod lora;
pub mod metrics;
mod native;
mod openai;
pub mod params;
mod parse;
pub mod reasoning;
pub mod refit;
pub mod request_log;
mod run;
mod score;
mod sessions;
mod sse;
mod state;
mod tokenize;

pub use arbor_chat_parsers::tool_call;
pub use error::ApiError;
pub use state::ServerOptions;

use arbor_engine_core::engine::Engine;
use arbor_models::{ChatTemplate, TextTokenizer};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use state::AppState;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// An option is invalid; the message names it.
    #[error("invalid server option: {0}")]
    Option(String),
    /// Socket I/O failed.
    #[error("server I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// An HTTP server bound to one engine.
pub struct Server {
    state: Arc<AppState>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Server({:?})", self.state.opts.served_model_name)
    }
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let Some(key) = st.opts.api_key.as_deref() else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    if path.starts_with("/health") || req.method() == axum::http::Method::OPTIONS {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    match given {
        Some(g) if ct_eq(g.as_bytes(), key.as_bytes()) => next.run(req).await,
        _ => {
            let mut r = ApiError::new(
                StatusCode::UNAUTHORIZED,
                "missing or invalid API key (send 'Authorization: Bearer <key>')",
            )
            .into_response();
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            r
        }
    }
}

/// One HTTP route: its path, methods and what it is for.
pub struct RouteInfo {
    /// The path (axum's syntax: `{id}` is a path parameter).
    pub path: &'static str,
    /// The methods it answers.
    pub methods: &'static str,
    /// One line on what it does.
    pub summary: &'static str,
}

struct Route {
    path: &'static str,
    methods: &'static str,
    summary: &'static str,
    handler: MethodRouter<Arc<AppState>>,
}

/// The server's routes: the router is built from this table and the
/// reference page `docs/src/reference/routes.md` is generated from it.
fn routes() -> Vec<Route> {
    let r = |path, methods, summary, handler| Route {
        path,
        methods,
        summary,
        handler,
    };
    vec![
        r(
            "/generate",
            "POST",
            "SGLang's native generation (text or token ids, batches, streaming).",
            post(native::generate),
        ),
        r(
            "/v1/completions",
            "POST",
            "OpenAI completions.",
            post(openai::completions::completions),
        ),
        r(
            "/v1/chat/completions",
            "POST",
            "OpenAI chat completions (chat template, tools, reasoning).",
            post(openai::chat::chat_completions),
        ),
        r(
            "/v1/embeddings",
            "POST",
            "OpenAI embeddings of a model served with --is-embedding.",
            post(embeddings::embeddings),
        ),
        r(
            "/encode",
            "POST",
            "SGLang's native embeddings (text or token ids, one or a list).",
            post(embeddings::encode),
        ),
        r(
            "/v1/responses",
            "POST",
            "OpenAI Responses API (input items, function tools, `text.format`, named stream events).",
            post(openai::responses::create),
        ),
        r(
            "/v1/responses/{id}",
            "GET, DELETE",
            "A stored response (`store: true`, the default; the newest 1,000 are kept), or deletes it.",
            get(openai::responses::retrieve).delete(openai::responses::delete),
        ),
        r(
            "/v1/responses/{id}/input_items",
            "GET",
            "A stored response's input items, a page at a time (`limit`, `order`, `after`).",
            get(openai::responses::input_items),
        ),
        r(
            "/v1/responses/{id}/cancel",
            "POST",
            "Cancels a background response still in progress (`background: true`).",
            post(openai::responses::cancel),
        ),
        r(
            "/open_session",
            "POST",
            "Opens a session (SGLang's session control); answers its id.",
            post(sessions::open_session),
        ),
        r(
            "/close_session",
            "POST",
            "Closes a session: its running requests are aborted, its tree dropped.",
            post(sessions::close_session),
        ),
        r(
            "/v1/score",
            "POST",
            "SGLang's scoring: label tokens' probabilities after query + item.",
            post(score::score),
        ),
        r(
            "/v1/rerank",
            "POST",
            "Documents ranked by Qwen3-Reranker's yes/no answer, best first.",
            post(score::rerank),
        ),
        r(
            "/parse_function_call",
            "POST",
            "Tool calls in a text, by a named tool-call parser (SGLang's shape).",
            post(parse::parse_function_call),
        ),
        r(
            "/separate_reasoning",
            "POST",
            "Reasoning and answer of a text, by a named reasoning parser.",
            post(parse::separate_reasoning),
        ),
        r(
            "/v1/models",
            "GET",
            "The served model and its LoRA adapters.",
            get(openai::models),
        ),
        r(
            "/tokenize",
            "POST",
            "Token ids of a prompt or a list of prompts (SGLang's shape).",
            post(tokenize::tokenize),
        ),
        r(
            "/v1/tokenize",
            "POST",
            "Same as `/tokenize`.",
            post(tokenize::tokenize),
        ),
        r(
            "/detokenize",
            "POST",
            "Text of token ids or of a list of id lists.",
            post(tokenize::detokenize),
        ),
        r(
            "/v1/detokenize",
            "POST",
            "Same as `/detokenize`.",
            post(tokenize::detokenize),
        ),
        r(
            "/v1/models/{id}",
            "GET",
            "One model card.",
            get(openai::model),
        ),
        r(
            "/health",
            "GET",
            "200 while the server accepts requests.",
            get(admin::health),
        ),
        r(
            "/health_generate",
            "GET",
            "200 once a one-token generation succeeds.",
            get(admin::health_generate),
        ),
        r(
            "/flush_cache",
            "GET, POST",
            "Empties the prefix cache (and recurrent state snapshots).",
            post(admin::flush_cache).get(admin::flush_cache),
        ),
        r(
            "/abort_request",
            "POST",
            "Aborts a request by `rid`, or all with `abort_all`.",
            post(admin::abort_request),
        ),
        r(
            "/get_model_info",
            "GET",
            "The model path, architecture and limits.",
            get(admin::model_info),
        ),
        r(
            "/model_info",
            "GET",
            "Alias of `/get_model_info`.",
            get(admin::model_info),
        ),
        r(
            "/get_server_info",
            "GET",
            "The resolved configuration and live engine figures.",
            get(admin::server_info),
        ),
        r(
            "/server_info",
            "GET",
            "Alias of `/get_server_info`.",
            get(admin::server_info),
        ),
        r(
            "/metrics",
            "GET",
            "Prometheus exposition (`--enable-metrics`).",
            get(admin::metrics),
        ),
        r(
            "/get_load",
            "GET",
            "Per-rank load: requests and tokens held.",
            get(admin::get_load),
        ),
        r(
            "/update_weights_from_disk",
            "POST",
            "Reloads the weights from a checkpoint folder (RL refit).",
            post(refit::update_weights_from_disk),
        ),
        r(
            "/load_lora_adapter",
            "POST",
            "Loads a LoRA adapter by name and path.",
            post(lora::load_lora_adapter),
        ),
        r(
            "/unload_lora_adapter",
            "POST",
            "Unloads a LoRA adapter.",
            post(lora::unload_lora_adapter),
        ),
        r(
            "/pause_generation",
            "POST",
            "Pauses scheduling (abort, retract or keep running requests).",
            post(refit::pause_generation),
        ),
        r(
            "/continue_generation",
            "POST",
            "Resumes scheduling after a pause.",
            post(refit::continue_generation),
        ),
        r(
            "/release_memory_occupation",
            "POST",
            "Frees the KV cache (and weights) while paused.",
            post(refit::release_memory_occupation),
        ),
        r(
            "/resume_memory_occupation",
            "POST",
            "Allocates what release freed.",
            post(refit::resume_memory_occupation),
        ),
    ]
}

/// The routes the server answers, in the order it registers them.
pub fn route_table() -> Vec<RouteInfo> {
    routes()
        .into_iter()
        .map(|r| RouteInfo {
            path: r.path,
            methods: r.methods,
            summary: r.summary,
        })
        .collect()
}

async fn not_found(req: Request) -> Response {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path())).into_response()
}

async fn method_not_allowed(req: Request) -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "method {} is not allowed on {}",
            req.method(),
            req.uri().path()
        ),
    )
    .into_response()
}

impl Server {
    /// A server over `engine`; `tokenizer` and `chat_template` must be the engine model's.
    pub fn new(
        engine: Arc<Engine>,
        tokenizer: Arc<TextTokenizer>,
        chat_template: Option<Arc<ChatTemplate>>,
        opts: ServerOptions,
    ) -> Result<Self, ServerError> {
        if !metrics::valid_prefix(&opts.metrics_prefix) {
            return Err(ServerError::Option(format!(
                "metrics prefix '{}' must be letters, digits and underscores, not starting with a digit",
                opts.metrics_prefix
            )));
        }
        if opts.served_model_name.is_empty() {
            return Err(ServerError::Option(
                "served_model_name must not be empty".into(),
            ));
        }
        if opts.max_request_bytes == 0 {
            return Err(ServerError::Option(
                "max_request_bytes must be positive".into(),
            ));
        }
        if opts.api_key.as_deref() == Some("") {
            return Err(ServerError::Option("api_key must not be empty".into()));
        }
        Ok(Self {
            state: Arc::new(AppState::new(engine, tokenizer, chat_template, opts)),
        })
    }

    /// Enables structured output (`json_schema`, `regex`, `ebnf`, `response_format`,
    /// forced tool calls) with grammars compiled through `cache`.
    pub fn with_grammar(mut self, cache: Arc<arbor_engine_core::grammar::GrammarCache>) -> Self {
        if let Some(st) = Arc::get_mut(&mut self.state) {
            st.grammar = Some(cache);
        }
        self
    }

    /// Enables weight updates and memory release/resume with weights loaded by `loader`.
    pub fn with_weight_loader(mut self, loader: Arc<dyn refit::WeightLoader>) -> Self {
        if let Some(st) = Arc::get_mut(&mut self.state) {
            st.loader = Some(loader);
        }
        self
    }

    /// Enables LoRA adapters (`lora_path`, `base:adapter` model names, and
    /// the load/unload endpoints) from `registry`.
    pub fn with_lora(mut self, registry: Arc<arbor_lora::LoraRegistry>) -> Self {
        if let Some(st) = Arc::get_mut(&mut self.state) {
            st.lora = Some(registry);
        }
        self
    }

    /// Makes this a prefill or decode worker of a disaggregated deployment
    /// ([`disagg`]).
    pub fn with_disaggregation(mut self, d: disagg::Disagg) -> Self {
        if let Some(st) = Arc::get_mut(&mut self.state) {
            st.disagg = Some(d);
        }
        self
    }

    /// The routes, ready to serve or to nest in a larger application.
    pub fn router(&self) -> Router {
        let st = self.state.clone();
        routes()
            .into_iter()
            .fold(Router::new(), |r, route| r.route(route.path, route.handler))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(middleware::from_fn_with_state(st.clone(), auth))
            .with_state(st)
    }

    /// Serves on `listener` until `shutdown` resolves, then drains: no new
    /// connections or requests, in-flight requests get `shutdown_timeout` to
    /// finish, the rest are aborted. Returns once every connection closed (or
    /// a few seconds after the abort, whichever comes first).
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServerError> {
        let st = self.state.clone();
        // Expired sessions close while the server runs (the task ends with it).
        let _sweep = AbortOnDrop(tokio::spawn(sessions::sweep(st.clone())));
        let (tx, mut rx) = tokio::sync::watch::channel(false);
        let signal_state = st.clone();
        let signal = async move {
            shutdown.await;
            signal_state.draining.store(true, Ordering::SeqCst);
            let _ = tx.send(true);
        };
        let app = self.router();
        // Streaming sends small writes: without TCP_NODELAY, Nagle plus delayed
        // ACKs hold each token back ~40 ms.
        let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        let server = axum::serve(listener, app).with_graceful_shutdown(signal);
        let server = server.into_future();
        tokio::pin!(server);
        let timeout = st.opts.shutdown_timeout;
        tokio::select! {
            r = &mut server => return r.map_err(ServerError::Io),
            _ = async {
                let _ = rx.wait_for(|v| *v).await;
                tokio::time::sleep(timeout).await;
            } => {}
        }
        let running = st.engine.stats();
        tracing::warn!(
            "shutdown timeout ({} s) reached: aborting {} running and {} queued requests",
            timeout.as_secs_f64(),
            running.num_running_reqs,
            running.num_queue_reqs
        );
        st.engine.abort_all();
        match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
            Ok(r) => r.map_err(ServerError::Io),
            Err(_) => {
                tracing::warn!("connections still open 5 s after aborting; closing anyway");
                Ok(())
            }
        }
    }
}

/// A background task that ends when this is dropped.
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Resolves on Ctrl-C or (on Unix) SIGTERM.
pub async fn shutdown_signal() {
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
