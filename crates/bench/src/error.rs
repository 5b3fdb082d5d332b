//! The error type of `arbor-bench`.
//!
//! Every fallible function of the crate returns [`BenchError`]. Variants say
//! what kind of thing failed (a file, a data set's content, an argument, the
//! server, the model) so that the CLI prints a message naming the culprit.

use std::path::{Path, PathBuf};
use thiserror::Error;

/// Errors of the benchmarks and the workload profiler.
#[derive(Debug, Error)]
pub enum BenchError {
    /// A file could not be read or written.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A data set or log has content that cannot be used; the message says where.
    #[error("{path}: {message}")]
    Data { path: PathBuf, message: String },
    /// A command-line value is wrong or values contradict each other.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A tokenizer could not be loaded or failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The server could not be reached or answered in an unexpected way.
    #[error("server: {0}")]
    Server(String),
    /// Every warmup request failed: the benchmark would measure nothing.
    #[error("warmup failed - check the benchmark arguments; first error: {0}")]
    WarmupFailed(String),
    /// Loading or running the model failed (one-batch).
    #[error(transparent)]
    Core(#[from] arbor_engine_core::CoreError),
}

impl BenchError {
    /// An I/O error about `path`.
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        Self::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Unusable content in the file at `path`.
    pub fn data(path: &Path, message: impl Into<String>) -> Self {
        Self::Data {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    /// A wrong command-line value.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::InvalidArgument(message.into())
    }
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, BenchError>;
