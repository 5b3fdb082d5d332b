//! `w8a8_fp8` (SGLang's name): FP8 weights that multiply their inputs
//! quantized to E4M3 (W8A8), where the other FP8 methods keep f32 inputs.
//!
//! On a float checkpoint it quantizes every linear but `lm_head` at load as
//! `fp8` does (one scale per output channel); on an FP8 checkpoint (its
//! `quantization_config` names `fp8`, `compressed-tensors`, `modelopt` or
//! `w8a8_fp8`) it loads the layers as the checkpoint's own method does. It
//! then marks each FP8 linear stored as `f8_s32` blocks as `f8a8_s32`: the
//! same bytes, whose product first rounds each run of 32 inputs of a row to
//! E4M3 with the scale `max|x| / 448` (dynamic, finer than SGLang's one
//! scale per token). Where the checkpoint calibrated a static activation
//! scale (`input_scale`: compressed-tensors with static input activations,
//! `fp8` with `activation_scheme: static`, ModelOpt FP8), the inputs are
//! rounded with it instead, `e4m3(x · (1/s)) · s` saturating at ±448, as
//! vLLM and SGLang run such checkpoints on FP8 hardware
//! ([`QuantMethod::input_scale`]; the model gives the layers of one input
//! the largest of their scales, as those engines' fused projections do).
//! FP8 tensor cores
//! (sm_89+) multiply those codes directly; every other device multiplies
//! the rounded values, so all of them compute the same product. Layers the
//! inner method leaves in float, or FP8 ones whose layout does not fit
//! blocks of 32 and are dequantized to f32, keep their product (with a
//! warning when their inputs are not whole runs of 32, as a tensor-parallel
//! share of a small model's MLP can be); a layer it
//! stores in another quantized format (an NVFP4 or INT4 checkpoint) is an
//! error naming the tensor.

use super::common::static_input_scale;
use super::fp8::Fp8Method;
use crate::DType;
use arbor_engine_core::{
    BackendCapabilities, CoreError, HostTensor, LinearSpec, QuantInit, QuantMethod, Result,
    WeightSource,
};
use std::sync::Arc;

/// The `w8a8_fp8` method over the method that loads the weights.
pub struct W8a8Fp8 {
    weights: Arc<dyn QuantMethod>,
}

impl W8a8Fp8 {
    /// `init`'s checkpoint is loaded as `fp8` reads it (SGLang's
    /// `w8a8_fp8` checkpoints hold E4M3 weights with per-channel
    /// `weight_scale`); without one, float weights are quantized at load.
    pub fn new(init: &QuantInit) -> Result<Self> {
        Ok(Self {
            weights: Arc::new(Fp8Method::new(init)?),
        })
    }
}

impl QuantMethod for W8a8Fp8 {
    fn name(&self) -> &str {
        "w8a8_fp8"
    }

    fn prepare<'a>(&self, t: HostTensor<'a>, caps: &BackendCapabilities) -> Result<HostTensor<'a>> {
        self.weights.prepare(t, caps)
    }

    fn load_linear<'a>(
        &self,
        src: &'a dyn WeightSource,
        spec: &LinearSpec<'_>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>> {
        let mut t = self.weights.load_linear(src, spec, caps)?;
        if t.dtype.is_scaled_block() && t.dtype != DType::F8_S32 {
            return Err(CoreError::load(format!(
                "{}: '{}.weight' is stored as {} by the checkpoint's method; \
                 w8a8_fp8 applies to FP8 weights",
                src.describe(),
                spec.prefix,
                t.dtype
            )));
        }
        if t.dtype == DType::F8_S32 {
            if !caps.weight_dtypes.contains(&DType::F8A8_S32) {
                return Err(CoreError::unsupported(format!(
                    "{}: '{}.weight': this device has no W8A8 FP8 product (f8a8_s32)",
                    src.describe(),
                    spec.prefix
                )));
            }
            t.dtype = DType::F8A8_S32;
        } else if t.dtype.is_float() && !spec.in_features.is_multiple_of(32) {
            tracing::warn!(
                "w8a8_fp8: '{}' keeps f32 inputs: its {} inputs are not whole runs of 32 \
                 (with --tp-size, each rank's share)",
                spec.prefix,
                spec.in_features
            );
        }
        Ok(t)
    }

    fn input_scale(&self, src: &dyn WeightSource, spec: &LinearSpec<'_>) -> Result<Option<f32>> {
        static_input_scale(src, spec.prefix)
    }

    fn over_checkpoint(&self, checkpoint: Arc<dyn QuantMethod>) -> Option<Arc<dyn QuantMethod>> {
        let fp8 = ["fp8", "compressed-tensors", "modelopt", "w8a8_fp8"];
        fp8.contains(&checkpoint.name()).then(|| {
            Arc::new(W8a8Fp8 {
                weights: checkpoint,
            }) as Arc<dyn QuantMethod>
        })
    }
}
