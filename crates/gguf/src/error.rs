//! The crate's error type.
//!
//! Every variant names what is wrong and where: the metadata key, the tensor,
//! or the byte offset in the file, so that a user handed a corrupt or
//! unsupported file can tell why it was refused without a debugger.

use std::path::PathBuf;

/// Errors from reading a GGUF file or building its tokenizer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },

    #[error("{0}")]
    UnsupportedVersion(String),

    #[error(
        "GGUF file truncated: {what} at byte offset {offset} needs {needed} bytes but only {available} remain"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },

    #[error(
        "corrupt GGUF file: {what} at byte offset {offset} claims {count} entries, more than the {available} bytes left in the file can hold"
    )]
    CountTooLarge {
        what: String,
        offset: u64,
        count: u64,
        available: u64,
    },

    #[error("corrupt GGUF file: {what} at byte offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },

    #[error("corrupt GGUF file: metadata key '{key}' has unknown value type id {type_id}")]
    UnknownValueType { key: String, type_id: u32 },

    #[error("corrupt GGUF file: metadata key '{key}' nests arrays deeper than {max} levels")]
    NestingTooDeep { key: String, max: usize },

    #[error("corrupt GGUF file: metadata key '{0}' appears more than once")]
    DuplicateKey(String),

    #[error("corrupt GGUF file: tensor '{0}' appears more than once")]
    DuplicateTensor(String),

    #[error("GGUF metadata key '{key}' has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    #[error("GGUF metadata key '{key}' has value {value}, which does not fit in {target}")]
    OutOfRange {
        key: String,
        value: String,
        target: &'static str,
    },

    #[error("GGUF metadata key '{0}' is required but absent")]
    MissingKey(String),

    #[error("GGUF metadata key '{key}' is invalid: {reason}")]
    InvalidValue { key: String, reason: String },

    #[error("tensor '{tensor}' has unknown ggml type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },

    #[error(
        "tensor '{tensor}' has ggml type {type_name} (id {type_id}), which Arbor does not support"
    )]
    UnsupportedTensorType {
        tensor: String,
        type_id: u32,
        type_name: &'static str,
    },

    #[error("tensor '{tensor}' is invalid: {reason}")]
    BadTensor { tensor: String, reason: String },

    #[error(
        "tensor '{tensor}' runs past the end of the file: its data spans bytes {start}..{end} but the file has {file_len} bytes"
    )]
    TensorOutOfBounds {
        tensor: String,
        start: u64,
        end: u64,
        file_len: u64,
    },

    #[error("cannot build the tokenizer from GGUF metadata: {0}")]
    Tokenizer(String),
}

impl GgufError {
    pub(crate) fn tokenizer(msg: impl Into<String>) -> Self {
        GgufError::Tokenizer(msg.into())
    }
}

/// Shorthand for this crate's results.
pub type Result<T, E = GgufError> = std::result::Result<T, E>;
