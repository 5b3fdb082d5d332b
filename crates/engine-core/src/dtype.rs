//! Element types of tensors, including GGUF's block-quantized formats.
//!
//! A quantized type stores `block_size` logical elements in `block_bytes`
//! bytes; a row of a quantized tensor must hold a whole number of blocks.
//! Byte sizes here are the ggml layouts, so GGUF tensor data is used as is.
//!
//! Besides ggml's, `f8_e4m3` (OCP E4M3FN, one byte, no infinities, NaN at
//! `0x7f`/`0xff`) and `f8_e5m2` (the top byte of an f16) are the elements of
//! FP8 checkpoints and FP8 KV caches, and the two Arbor block types hold a linear's
//! weights with their scales in band, converted at load by the quantization
//! methods of `arbor-quant`: `f8_s32` (32 E4M3 values then their f32 scale,
//! 36 bytes; value = e4m3 × scale) and `u4_s32` (32 unsigned 4-bit values,
//! element `i < 16` in the low nibble of byte `i` and element `16 + i` in its
//! high nibble, then an f16 scale, a u8 zero point and a zero byte,
//! 20 bytes; value = (q − zero) × scale) and `f4_s16` (16 E2M1 values,
//! element `i < 8` in the low nibble of byte `i` and element `8 + i` in its
//! high nibble, then an f32 scale, 12 bytes; value = e2m1 × scale, the scale
//! being NVFP4's E4M3 block scale times its global scale) and `u8_s32` (32
//! unsigned 8-bit values, then an f16 scale and a u16 zero point, 36 bytes;
//! value = (q − zero) × scale: 8-bit GPTQ, whose zero points reach 256).
//! `f8a8_s32` is `f8_s32`'s layout for FP8 weights that multiply their
//! inputs quantized to E4M3 (W8A8): each run of 32 inputs of a row becomes
//! its E4M3 codes of `x × 448 / max|x|` and the scale `max|x| / 448` before
//! the product, as ggml's weight types name the activation type they meet.

use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// The element type of a tensor.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    I32,
    U32,
    U8,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    F8E4M3,
    F8E5M2,
    F8_S32,
    F8A8_S32,
    U4_S32,
    F4_S16,
    U8_S32,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 25] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::U32,
        DType::U8,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q8_0,
        DType::Q8_1,
        DType::Q2_K,
        DType::Q3_K,
        DType::Q4_K,
        DType::Q5_K,
        DType::Q6_K,
        DType::Q8_K,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::F8_S32,
        DType::U4_S32,
        DType::F4_S16,
        DType::U8_S32,
        DType::F8A8_S32,
    ];

    /// Logical elements per storage block (1 for plain types).
    pub const fn block_size(self) -> usize {
        match self {
            DType::F32
            | DType::F16
            | DType::BF16
            | DType::I32
            | DType::U32
            | DType::U8
            | DType::F8E4M3
            | DType::F8E5M2 => 1,
            DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q8_0
            | DType::Q8_1
            | DType::F8_S32
            | DType::F8A8_S32
            | DType::U4_S32
            | DType::U8_S32 => 32,
            DType::F4_S16 => 16,
            DType::Q2_K | DType::Q3_K | DType::Q4_K | DType::Q5_K | DType::Q6_K | DType::Q8_K => {
                256
            }
        }
    }

    /// Bytes per storage block.
    pub const fn block_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::F8E4M3 | DType::F8E5M2 => 1,
            DType::Q4_0 => 18,
            DType::Q4_1 => 20,
            DType::Q5_0 => 22,
            DType::Q5_1 => 24,
            DType::Q8_0 => 34,
            DType::Q8_1 => 36,
            DType::Q2_K => 84,
            DType::Q3_K => 110,
            DType::Q4_K => 144,
            DType::Q5_K => 176,
            DType::Q6_K => 210,
            DType::Q8_K => 292,
            DType::F8_S32 | DType::F8A8_S32 => 36,
            DType::U4_S32 => 20,
            DType::F4_S16 => 12,
            DType::U8_S32 => 36,
        }
    }

    /// True for block-quantized types.
    pub const fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// True for the scaled block formats of HF-quantized checkpoints
    /// (`f8_s32`, `f8a8_s32`, `u4_s32`, `u8_s32`, `f4_s16`: values with an
    /// in-band scale, and a zero point for the integer ones).
    pub const fn is_scaled_block(self) -> bool {
        matches!(
            self,
            DType::F8_S32 | DType::F8A8_S32 | DType::U4_S32 | DType::U8_S32 | DType::F4_S16
        )
    }

    /// The dtype whose stored values this one's are: `f8_s32` for
    /// `f8a8_s32` (the same blocks, which differ only in what their inputs
    /// become), else itself. Dequantizing, splitting and copying go by it.
    pub const fn storage(self) -> DType {
        match self {
            DType::F8A8_S32 => DType::F8_S32,
            other => other,
        }
    }

    /// True for floating-point types usable as activations or KV.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16)
    }

    /// Bytes needed to store `n` elements; errors if `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Result<usize> {
        let bs = self.block_size();
        if !n.is_multiple_of(bs) {
            return Err(CoreError::invalid(format!(
                "{n} elements are not a whole number of {self} blocks of {bs}"
            )));
        }
        Ok(n / bs * self.block_bytes())
    }

    /// The lowercase name used in configs and GGUF listings.
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::U8 => "u8",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q8_0 => "q8_0",
            DType::Q8_1 => "q8_1",
            DType::Q2_K => "q2_k",
            DType::Q3_K => "q3_k",
            DType::Q4_K => "q4_k",
            DType::Q5_K => "q5_k",
            DType::Q6_K => "q6_k",
            DType::Q8_K => "q8_k",
            DType::F8E4M3 => "f8_e4m3",
            DType::F8E5M2 => "f8_e5m2",
            DType::F8_S32 => "f8_s32",
            DType::F8A8_S32 => "f8a8_s32",
            DType::U4_S32 => "u4_s32",
            DType::F4_S16 => "f4_s16",
            DType::U8_S32 => "u8_s32",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.to_ascii_lowercase();
        let alias = match lower.as_str() {
            "float32" | "float" => "f32",
            "float16" | "half" => "f16",
            "bfloat16" => "bf16",
            other => other,
        };
        DType::ALL
            .iter()
            .copied()
            .find(|d| d.name() == alias)
            .ok_or_else(|| CoreError::invalid(format!("unknown dtype '{s}'")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_sizes() {
        assert_eq!("bfloat16".parse::<DType>().unwrap(), DType::BF16);
        assert_eq!("Q4_K".parse::<DType>().unwrap(), DType::Q4_K);
        assert!("q9".parse::<DType>().is_err());
        assert_eq!(DType::Q4_1.bytes_for(64).unwrap(), 40);
        assert!(DType::Q4_1.bytes_for(33).is_err());
        assert_eq!(DType::F16.bytes_for(3).unwrap(), 6);
    }
}
