//! Arbor's GGUF support: a safe reader and the tokenizer described by a file's metadata.
//!
//! - [`GgufFile`] memory-maps a GGUF (v2 or v3) file and validates its whole
//!   header at open: metadata of all value types (nested arrays included),
//!   tensor infos mapped to engine-core's [`DType`](arbor_engine_core::DType),
//!   alignment, and that every tensor's data lies inside the file. Corrupt
//!   input gives a [`GgufError`] naming the key, tensor or offset; it never
//!   panics, reads out of bounds, or allocates more than the file could hold.
//! - [`load_tokenizer`] builds a `tokenizers::Tokenizer` from
//!   `tokenizer.ggml.*` (models `gpt2` and `llama`) that tokenizes as llama.cpp
//!   does, plus BOS/EOS/stop ids and the chat template.
//! - [`GgufWriter`] writes GGUF files (small test models, fuzzing seeds).
//!
//! Tensors are returned raw (ggml layout, shapes outermost first); turning
//! them into model weights (including llama's Q/K row permutation) is the
//! model code's job.

pub mod error;
pub mod file;
pub mod ggml;
pub mod parse;
pub mod pretok;
mod special;
pub mod tokenizer;
pub mod value;
pub mod writer;

pub use error::{GgufError, Result};
pub use file::GgufFile;
pub use ggml::{GgmlType, ggml_type, ggml_type_id};
pub use parse::{DEFAULT_ALIGNMENT, TensorInfo};
pub use tokenizer::{GgufTokenizer, TokenizerKind, load_tokenizer};
pub use value::{GgufArray, GgufType, GgufValue};
pub use writer::GgufWriter;

use arbor_engine_core::CoreError;
use std::path::PathBuf;

impl From<GgufError> for CoreError {
    fn from(e: GgufError) -> Self {
        match e {
            GgufError::Io { path, source } => CoreError::io(path, source),
            GgufError::UnsupportedTensorType { .. } => CoreError::unsupported(e.to_string()),
            other => CoreError::load(other.to_string()),
        }
    }
}

/// File name of the default model (SmolLM2-135M-Instruct, Q4_1).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the default GGUF model is expected: `$ARBOR_DEFAULT_GGUF` if set,
/// else `$ARBOR_HOME/models/SmolLM2-135M-Instruct.Q4_1.gguf`, with
/// `ARBOR_HOME` defaulting to `~/.cache/arbor`. `None` only when neither
/// variable is set and there is no home directory.
pub fn default_model_path() -> Option<PathBuf> {
    let nonempty = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(p) = nonempty("ARBOR_DEFAULT_GGUF") {
        return Some(PathBuf::from(p));
    }
    let home = match nonempty("ARBOR_HOME") {
        Some(h) => PathBuf::from(h),
        None => PathBuf::from(nonempty("HOME")?)
            .join(".cache")
            .join("arbor"),
    };
    Some(home.join("models").join(DEFAULT_MODEL_FILE))
}
