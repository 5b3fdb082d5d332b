//! What every handler shares: the engine, the tokenizer and chat template,
//! the options, the metrics, the stored responses and the draining flag.
//!
//! Invariant: once `draining` is set (shutdown began) no new generation is
//! accepted; requests already running keep going until they finish or the
//! shutdown timeout aborts them.

use crate::error::ApiError;
use crate::metrics::Metrics;
use arbor_engine_core::engine::Engine;
use arbor_models::{ChatTemplate, TextTokenizer};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Settings of the HTTP layer.
#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// The model name clients must use (`model` in OpenAI requests) and `/v1/models` lists.
    pub served_model_name: String,
    /// Where the model came from (reported by `/get_model_info`).
    pub model_path: String,
    /// The model's context length in tokens.
    pub context_length: usize,
    /// When set, every route but `/health*` needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Largest accepted request body (larger ones get 413).
    pub max_request_bytes: usize,
    /// How long a shutdown waits for in-flight requests before aborting them.
    pub shutdown_timeout: Duration,
    /// Serve `/metrics`.
    pub enable_metrics: bool,
    /// Metric name prefix (`arbor` gives `arbor:num_running_reqs`).
    pub metrics_prefix: String,
    /// Report cached prompt tokens in OpenAI `usage.prompt_tokens_details`.
    pub enable_cache_report: bool,
    /// Time limit of `/health_generate`.
    pub health_generate_timeout: Duration,
    /// The settings the server was started with, echoed by `/get_server_info`.
    pub server_info: serde_json::Value,
    /// Separates `<think>` reasoning into `reasoning_content` in chat answers.
    pub reasoning_parser: Option<crate::reasoning::ReasoningParser>,
    /// Served for embeddings (`--is-embedding`): how; `None` serves generation.
    pub embedding: Option<crate::embeddings::EmbeddingOptions>,
    /// `--log-requests` at its level; `None` logs nothing.
    pub log_requests: Option<crate::request_log::LogLevel>,
    /// The tool-call format of chat answers with `tool_choice: auto`
    /// (`--tool-call-parser`); `None` reads `qwen25`'s `<tool_call>` blocks.
    pub tool_call_parser: Option<crate::tool_call::ToolCallParser>,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            served_model_name: "default".into(),
            model_path: String::new(),
            context_length: 4096,
            api_key: None,
            max_request_bytes: 32 * 1024 * 1024,
            shutdown_timeout: Duration::from_secs(30),
            enable_metrics: false,
            metrics_prefix: "arbor".into(),
            enable_cache_report: false,
            health_generate_timeout: Duration::from_secs(20),
            server_info: serde_json::Value::Null,
            reasoning_parser: None,
            log_requests: None,
            embedding: None,
            tool_call_parser: None,
        }
    }
}

/// Where the served weights came from (changes with weight updates).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Weights {
    /// The folder or file they were loaded from.
    pub model_path: String,
    /// SGLang's `weight_version` ("default" until an update names one).
    pub version: String,
    /// Weight updates applied.
    pub updates: u64,
    /// Memory released (generation waits for a resume).
    pub released: bool,
    /// The weights are among what was released (resume reloads them).
    pub weights_released: bool,
}

/// Shared handler state.
pub(crate) struct AppState {
    pub engine: Arc<Engine>,
    pub tokenizer: Arc<TextTokenizer>,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub opts: ServerOptions,
    pub metrics: Metrics,
    pub draining: AtomicBool,
    pub started: Instant,
    /// Compiled grammars for structured output, when a grammar backend is configured.
    pub grammar: Option<Arc<arbor_engine_core::grammar::GrammarCache>>,
    /// Requests waiting for their grammar to compile.
    pub grammar_queue: std::sync::atomic::AtomicUsize,
    /// Loads new weights for `/update_weights_from_disk` and resume, when configured.
    pub loader: Option<Arc<dyn crate::refit::WeightLoader>>,
    /// LoRA adapters by name, when LoRA is enabled.
    pub lora: Option<Arc<arbor_lora::LoraRegistry>>,
    /// This worker's part in a disaggregated deployment (prefill: hands
    /// prompts' KV on; decode: pulls it by bootstrap room).
    pub disagg: Option<crate::disagg::Disagg>,
    /// Responses kept for `GET /v1/responses/{id}` and `previous_response_id`.
    pub responses: crate::openai::responses::store::Store,
    /// Open sessions (`/open_session`, `session_params`).
    pub sessions: crate::sessions::Sessions,
    /// The weights served now.
    weights: std::sync::Mutex<Weights>,
    /// Serializes weight updates and memory release/resume.
    pub refit_lock: tokio::sync::Mutex<()>,
    id_base: u64,
    next_id: AtomicU64,
}

impl AppState {
    pub fn new(
        engine: Arc<Engine>,
        tokenizer: Arc<TextTokenizer>,
        chat_template: Option<Arc<ChatTemplate>>,
        opts: ServerOptions,
    ) -> Self {
        let id_base = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let weights = Weights {
            model_path: opts.model_path.clone(),
            version: "default".into(),
            updates: 0,
            released: false,
            weights_released: false,
        };
        Self {
            weights: std::sync::Mutex::new(weights),
            responses: crate::openai::responses::store::Store::new(
                crate::openai::responses::store::CAPACITY,
            ),
            sessions: crate::sessions::Sessions::default(),
            loader: None,
            lora: None,
            disagg: None,
            refit_lock: tokio::sync::Mutex::new(()),
            metrics: Metrics::new(&opts.metrics_prefix, &opts.served_model_name),
            engine,
            tokenizer,
            chat_template,
            opts,
            draining: AtomicBool::new(false),
            started: Instant::now(),
            grammar: None,
            grammar_queue: std::sync::atomic::AtomicUsize::new(0),
            id_base,
            next_id: AtomicU64::new(1),
        }
    }

    /// The weights served now.
    pub fn weights(&self) -> Weights {
        self.weights
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Changes the record of the served weights.
    pub fn set_weights(&self, f: impl FnOnce(&mut Weights)) {
        f(&mut self.weights.lock().unwrap_or_else(|e| e.into_inner()));
    }

    /// A request id unique to this process (32 hex digits).
    pub fn new_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{:016x}", self.id_base, n)
    }

    /// Whether `name` names the served model: its served name, or the path
    /// it was loaded from (what clients that pass `--model PATH` send).
    pub fn serves_model(&self, name: &str) -> bool {
        name == self.opts.served_model_name
            || (!self.opts.model_path.is_empty() && name == self.opts.model_path)
    }

    /// Refuses new work once shutdown began.
    pub fn check_accepting(&self) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            Err(ApiError::unavailable("the server is shutting down"))
        } else {
            Ok(())
        }
    }

    /// Seconds since the Unix epoch (OpenAI `created`).
    pub fn now_unix() -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0)
    }

    /// Tokens one request may hold at most (prompt plus output).
    pub fn max_sequence_tokens(&self) -> usize {
        self.opts.context_length.min(self.engine.capacity_tokens())
    }
}
