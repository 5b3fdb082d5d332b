//! Built-in quantization methods for float checkpoints: keep the checkpoint's
//! dtype (`auto`), or cast to `f32`, `f16` or `bf16`. Quantized (GGUF) weights
//! pass through unchanged.

use arbor_engine_core::quant::cast_float_weight;
use arbor_engine_core::registry::QuantMethodEntry;
use arbor_engine_core::{BackendCapabilities, DType, HostTensor, QuantMethod, Result, inventory};
use std::sync::Arc;

/// Stores float weights in `target`, or as the checkpoint has them when `None`.
#[derive(Clone, Copy, Debug)]
pub struct FloatWeights {
    name: &'static str,
    target: Option<DType>,
}

impl FloatWeights {
    /// The method registered as `name`.
    pub const fn new(name: &'static str, target: Option<DType>) -> Self {
        Self { name, target }
    }
}

impl QuantMethod for FloatWeights {
    fn name(&self) -> &str {
        self.name
    }
    fn is_float(&self) -> bool {
        true
    }
    fn prepare<'a>(
        &self,
        tensor: HostTensor<'a>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>> {
        cast_float_weight(tensor, self.target, caps)
    }
}

inventory::submit! {
    QuantMethodEntry { name: "auto", about: "keep the checkpoint's weight dtype", create: |_| Ok(Arc::new(FloatWeights::new("auto", None))) }
}
inventory::submit! {
    QuantMethodEntry { name: "f32", about: "float32 weights", create: |_| Ok(Arc::new(FloatWeights::new("f32", Some(DType::F32)))) }
}
inventory::submit! {
    QuantMethodEntry { name: "f16", about: "float16 weights", create: |_| Ok(Arc::new(FloatWeights::new("f16", Some(DType::F16)))) }
}
inventory::submit! {
    QuantMethodEntry { name: "bf16", about: "bfloat16 weights", create: |_| Ok(Arc::new(FloatWeights::new("bf16", Some(DType::BF16)))) }
}
