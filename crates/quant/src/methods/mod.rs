//! Quantization methods for HF checkpoints, registered by name: `fp8`
//! (serialized FP8 per tensor, per channel or in 128×128 blocks, and FP8
//! quantization of float checkpoints at load), `compressed-tensors`
//! (llm-compressor's `float-quantized` FP8 and `pack-quantized` INT4, act-order
//! `weight_g_idx` included),
//! `awq` (AutoAWQ GEMM), `gptq` (GPTQ and GPTQModel, act-order included),
//! `modelopt` (NVIDIA ModelOpt NVFP4 and FP8) and `w8a8_fp8` (W8A8: FP8
//! weights, loaded or quantized as above, whose inputs are quantized to E4M3).
//!
//! Each method reads the tensors its format defines for a linear layer,
//! checks their dtypes and shapes (errors name the tensor), and packs the
//! weight into an in-band block dtype the device multiplies: `f8_s32` for
//! FP8 and `u4_s32` for INT4, one scale (and zero point) per 32 inputs of a
//! row, and `f4_s16` for NVFP4 (one scale per 16). The conversion is exact: every element of the stored weight
//! dequantizes to the value the format's published formula gives
//! (`e4m3 × scale`; `(q − zero) × scale`). Where a layout cannot be put in
//! blocks of 32 exactly (a GPTQ act-order `g_idx` that mixes groups within 32
//! inputs, scales that f16 cannot hold) or the device lacks the block dtype,
//! the weight is dequantized to f32 with the same formula instead.
//!
//! Activations stay f32 on every path but `w8a8_fp8`'s (a weight-only
//! product, as vLLM's Marlin kernels run FP8 checkpoints on GPUs without
//! FP8 units): static `input_scale` tensors are checked (positive and
//! finite when present) but not applied. `w8a8_fp8` (also over an FP8
//! checkpoint: `--quantization w8a8_fp8`) stores FP8 layers as `f8a8_s32`,
//! whose inputs are rounded to E4M3 before the product: with the
//! checkpoint's static `input_scale` where it has one, else per run of 32.

mod common;
mod compressed;
mod fp8;
mod int4;
mod modelopt;
mod w8a8;

pub use common::ScaleMap;

use arbor_engine_core::registry::QuantMethodEntry;
use arbor_engine_core::{QuantInit, QuantMethod, Result, inventory};
use std::sync::Arc;

fn fp8(init: &QuantInit) -> Result<Arc<dyn QuantMethod>> {
    Ok(Arc::new(fp8::Fp8Method::new(init)?))
}
fn compressed_tensors(init: &QuantInit) -> Result<Arc<dyn QuantMethod>> {
    Ok(Arc::new(compressed::CompressedTensors::new(init)?))
}
fn awq(init: &QuantInit) -> Result<Arc<dyn QuantMethod>> {
    Ok(Arc::new(int4::Awq::new(init)?))
}
fn modelopt(init: &QuantInit) -> Result<Arc<dyn QuantMethod>> {
    Ok(Arc::new(modelopt::ModelOpt::new(init)?))
}
fn gptq(init: &QuantInit) -> Result<Arc<dyn QuantMethod>> {
    Ok(Arc::new(int4::Gptq::new(init)?))
}
fn w8a8_fp8(init: &QuantInit) -> Result<Arc<dyn QuantMethod>> {
    Ok(Arc::new(w8a8::W8a8Fp8::new(init)?))
}

inventory::submit! {
    QuantMethodEntry { name: "fp8", about: "FP8 E4M3 weights (per tensor, per channel or 128x128 blocks); quantizes float checkpoints at load", create: fp8 }
}
inventory::submit! {
    QuantMethodEntry { name: "compressed-tensors", about: "llm-compressor checkpoints: float-quantized FP8, pack-quantized INT4 (symmetric or with zero points, act-order weight_g_idx)", create: compressed_tensors }
}
inventory::submit! {
    QuantMethodEntry { name: "awq", about: "AutoAWQ INT4 (GEMM layout, zero points, any group size)", create: awq }
}
inventory::submit! {
    QuantMethodEntry { name: "modelopt", about: "NVIDIA ModelOpt checkpoints: NVFP4 (E2M1, E4M3 scales per 16, global scale), FP8", create: modelopt }
}
inventory::submit! {
    QuantMethodEntry { name: "gptq", about: "GPTQ / GPTQModel INT4 and INT8 (v1 and v2 zero points, act-order g_idx)", create: gptq }
}
inventory::submit! {
    QuantMethodEntry { name: "w8a8_fp8", about: "W8A8 FP8: FP8 weights (quantized at load, or an FP8 checkpoint's) times inputs quantized to E4M3 (per 32, or with the checkpoint's static input scales)", create: w8a8_fp8 }
}
