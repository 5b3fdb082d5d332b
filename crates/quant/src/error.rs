//! Errors of the quant crate.
//!
//! Every public entry point validates its inputs (dtypes, lengths, strides)
//! before any kernel runs and reports problems as a [`QuantError`]; kernels
//! themselves never fail.

use crate::DType;
use thiserror::Error;

/// Errors raised by quantization, dequantization and dot products.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum QuantError {
    /// The dtype has no implementation for the requested operation.
    #[error("{op} is not supported for dtype {dtype}")]
    Unsupported { op: &'static str, dtype: DType },
    /// A row length is not a whole number of blocks of the dtype.
    #[error("{k} elements are not a whole number of {dtype} blocks of {block}")]
    NotBlockMultiple {
        dtype: DType,
        k: usize,
        block: usize,
    },
    /// A buffer has the wrong length.
    #[error("{what}: expected {expected} {unit}, got {got}")]
    BadLength {
        what: &'static str,
        expected: usize,
        got: usize,
        unit: &'static str,
    },
    /// Prepared activations do not fit the weights they are used with.
    #[error("activations mismatch: {0}")]
    ActsMismatch(String),
    /// A size computation overflowed `usize`.
    #[error("size overflow computing {0}")]
    Overflow(&'static str),
    /// The requested SIMD level is not available on this CPU.
    #[error("SIMD level {0:?} is not available on this CPU")]
    LevelUnavailable(crate::SimdLevel),
    /// A static input scale that is not finite and positive, or given for
    /// weights whose inputs are not rounded to E4M3.
    #[error("static input scale: {0}")]
    InputScale(String),
    /// An output stride smaller than the number of rows would overlap outputs.
    #[error("output stride {stride} is smaller than the {n_rows} rows written per activation row")]
    BadStride { stride: usize, n_rows: usize },
}

impl From<QuantError> for arbor_engine_core::CoreError {
    fn from(e: QuantError) -> Self {
        match e {
            QuantError::Unsupported { .. } | QuantError::LevelUnavailable(_) => {
                arbor_engine_core::CoreError::Unsupported(e.to_string())
            }
            QuantError::Overflow(_) => arbor_engine_core::CoreError::Internal(e.to_string()),
            _ => arbor_engine_core::CoreError::InvalidArgument(e.to_string()),
        }
    }
}
