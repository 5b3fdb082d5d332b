//! Errors of loading and naming LoRA adapters, by kind, so that the server
//! maps them to HTTP statuses without reading messages.

use std::path::PathBuf;

/// What went wrong with an adapter.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A file of the adapter cannot be read.
    #[error("LoRA adapter '{name}': cannot read {}: {source}", path.display())]
    Io {
        /// The adapter.
        name: String,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The adapter's files are malformed or do not fit the served model.
    #[error("LoRA adapter '{name}': {msg}")]
    Invalid {
        /// The adapter.
        name: String,
        /// What is wrong, naming the key or tensor.
        msg: String,
    },
    /// The adapter uses a PEFT feature Arbor does not serve.
    #[error("LoRA adapter '{name}': {what} is not supported")]
    Unsupported {
        /// The adapter.
        name: String,
        /// The feature.
        what: String,
    },
    /// The adapter breaks a configured limit (rank, target modules, count).
    #[error("LoRA adapter '{name}': {msg}")]
    Limit {
        /// The adapter.
        name: String,
        /// The setting that sets the limit (`max_lora_rank`,
        /// `lora_target_modules`, `max_loaded_loras`).
        setting: &'static str,
        /// How the adapter breaks it, naming the setting and its value.
        msg: String,
    },
    /// An adapter of this name is loaded already.
    #[error("a LoRA adapter named '{0}' is loaded already")]
    AlreadyLoaded(String),
    /// No adapter of this name is loaded.
    #[error("no LoRA adapter named '{name}' is loaded (loaded: {loaded})")]
    NotLoaded {
        /// The name asked for.
        name: String,
        /// The loaded names, comma-separated (or "none").
        loaded: String,
    },
    /// Putting the factors on the device failed.
    #[error("LoRA adapter '{name}': {source}")]
    Device {
        /// The adapter.
        name: String,
        /// The backend's error.
        source: arbor_engine_core::CoreError,
    },
}

/// Results of this crate.
pub type Result<T> = std::result::Result<T, LoraError>;
