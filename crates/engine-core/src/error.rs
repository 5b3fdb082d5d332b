//! Error type shared by engine-core's interfaces.
//!
//! Every fallible core operation returns [`CoreError`]. Variants are grouped by
//! the kind of failure so that callers (the HTTP server, the CLI) can map them
//! to an HTTP status or an exit code without parsing messages. A request
//! parameter at fault is named by [`Param`] in
//! [`CoreError::InvalidParam`], never only in the message text: the server
//! renames it into the API that was called (`max_new_tokens` is
//! `max_tokens` on `/v1`) without reading the message.

use thiserror::Error;

/// Errors raised by the core and by the implementations of its traits.
#[derive(Debug, Error)]
pub enum CoreError {
    /// A request parameter is out of range or inconsistent with another.
    /// `reason` completes a sentence that starts with the parameter's name.
    #[error("{param} {reason}")]
    InvalidParam { param: Param, reason: String },
    /// The caller asked for something invalid (bad shape, bad parameter).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A configuration value is wrong; the message names the key.
    #[error("configuration error: {0}")]
    Config(String),
    /// An engine setting is out of range: `key` is its configuration name
    /// (`num_draft_tokens`); the binary adds where it was given (its TOML
    /// section and flag). `reason` completes a sentence that starts with it.
    #[error("{key} {reason}")]
    InvalidSetting { key: &'static str, reason: String },
    /// A named implementation (backend, policy, architecture...) is not registered.
    #[error("no {kind} named '{name}' is registered (available: {available})")]
    NotRegistered {
        kind: &'static str,
        name: String,
        available: String,
    },
    /// Two registrations share one name.
    #[error("duplicate {kind} registration '{name}'")]
    DuplicateRegistration { kind: &'static str, name: String },
    /// The device ran out of memory or the KV pool is exhausted.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// The operation is not supported by this implementation (e.g. a dtype a kernel lacks).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A model or tokenizer file is missing or malformed; the message names the file and key.
    #[error("model load error: {0}")]
    ModelLoad(String),
    /// A device call failed.
    #[error("device error: {0}")]
    Device(String),
    /// An I/O error with the path it concerns.
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// A plugin failed (including a panic caught at the plugin boundary).
    #[error("plugin error: {0}")]
    Plugin(String),
    /// An internal invariant was broken; this is a bug.
    #[error("internal error: {0}")]
    Internal(String),
}

/// The request parameters the engine validates, by their engine names
/// ([`crate::SamplingParams`]' fields and [`crate::engine::GenerateRequest`]'s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Param {
    /// The prompt's token ids.
    InputIds,
    MaxNewTokens,
    MinNewTokens,
    Temperature,
    TopP,
    TopK,
    MinP,
    RepetitionPenalty,
    FrequencyPenalty,
    PresencePenalty,
    LogitBias,
    Stop,
    StopRegex,
    StopTokenIds,
    N,
    TopLogprobsNum,
    LogprobStartLen,
    Rid,
    DataParallelRank,
    FirstToken,
    /// The LoRA adapter a request runs with.
    Lora,
}

impl Param {
    /// Every parameter, for tables keyed by it.
    pub const ALL: [Param; 21] = [
        Param::InputIds,
        Param::MaxNewTokens,
        Param::MinNewTokens,
        Param::Temperature,
        Param::TopP,
        Param::TopK,
        Param::MinP,
        Param::RepetitionPenalty,
        Param::FrequencyPenalty,
        Param::PresencePenalty,
        Param::LogitBias,
        Param::Stop,
        Param::StopRegex,
        Param::StopTokenIds,
        Param::N,
        Param::TopLogprobsNum,
        Param::LogprobStartLen,
        Param::Rid,
        Param::DataParallelRank,
        Param::FirstToken,
        Param::Lora,
    ];

    /// The engine's name (SGLang's native name).
    pub fn name(self) -> &'static str {
        match self {
            Param::InputIds => "input_ids",
            Param::MaxNewTokens => "max_new_tokens",
            Param::MinNewTokens => "min_new_tokens",
            Param::Temperature => "temperature",
            Param::TopP => "top_p",
            Param::TopK => "top_k",
            Param::MinP => "min_p",
            Param::RepetitionPenalty => "repetition_penalty",
            Param::FrequencyPenalty => "frequency_penalty",
            Param::PresencePenalty => "presence_penalty",
            Param::LogitBias => "logit_bias",
            Param::Stop => "stop",
            Param::StopRegex => "stop_regex",
            Param::StopTokenIds => "stop_token_ids",
            Param::N => "n",
            Param::TopLogprobsNum => "top_logprobs_num",
            Param::LogprobStartLen => "logprob_start_len",
            Param::Rid => "rid",
            Param::DataParallelRank => "data_parallel_rank",
            Param::FirstToken => "first_token",
            Param::Lora => "lora_path",
        }
    }
}

impl std::fmt::Display for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Result alias for core operations.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;

impl CoreError {
    /// Shorthand for [`CoreError::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        CoreError::InvalidArgument(msg.into())
    }
    /// Shorthand for [`CoreError::InvalidParam`].
    pub fn param(param: Param, reason: impl Into<String>) -> Self {
        CoreError::InvalidParam {
            param,
            reason: reason.into(),
        }
    }
    /// Shorthand for [`CoreError::ModelLoad`].
    pub fn load(msg: impl Into<String>) -> Self {
        CoreError::ModelLoad(msg.into())
    }
    /// Shorthand for [`CoreError::Unsupported`].
    pub fn unsupported(msg: impl Into<String>) -> Self {
        CoreError::Unsupported(msg.into())
    }
    /// Wraps an I/O error with the path it concerns.
    pub fn io(path: impl AsRef<std::path::Path>, source: std::io::Error) -> Self {
        CoreError::Io {
            path: path.as_ref().display().to_string(),
            source,
        }
    }
}
