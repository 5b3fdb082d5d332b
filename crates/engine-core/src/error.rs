//! Error type shared by engine-core's interfaces.
//!
//! Every fallible core operation returns [`CoreError`]. Variants are grouped by
//! the kind of failure so that callers (the HTTP server, the CLI) can map them
//! to an HTTP status or an exit code without parsing messages.

use thiserror::Error;

/// Errors raised by the core and by the implementations of its traits.
#[derive(Debug, Error)]
pub enum CoreError {
    /// The caller asked for something invalid (bad shape, bad parameter).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A configuration value is wrong; the message names the key.
    #[error("configuration error: {0}")]
    Config(String),
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

/// Result alias for core operations.
pub type Result<T, E = CoreError> = std::result::Result<T, E>;

impl CoreError {
    /// Shorthand for [`CoreError::InvalidArgument`].
    pub fn invalid(msg: impl Into<String>) -> Self {
        CoreError::InvalidArgument(msg.into())
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
