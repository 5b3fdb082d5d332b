//! Quantization methods: which tensors a linear layer loads and how its
//! weights are stored.
//!
//! A [`QuantMethod`] is vLLM's linear method split at the device boundary.
//! [`QuantMethod::load_linear`] is its `create_weights` plus
//! `process_weights_after_loading`: it reads the tensors of one linear layer
//! that its format defines (`weight`; or `weight` and `weight_scale`;
//! `qweight`, `qzeros`, `scales`, `g_idx`; ...), checks their names, dtypes
//! and shapes, and returns the layer's weight as one `[out, in]` tensor whose
//! dtype carries any scales in band (`f8_s32`, `u4_s32`, the GGUF blocks, or
//! a float type). Its `apply` is the backend's `linear`, which dispatches on
//! that dtype: the product with a format is declared once, as a dtype in
//! [`BackendCapabilities::weight_dtypes`], and a method may only produce
//! dtypes the device lists there (else it dequantizes to a float type the
//! device has). [`QuantMethod::prepare`] stores the other weight matrices
//! (embeddings, heads a format leaves unquantized).
//!
//! Methods are registered by name (`QuantMethodEntry`) and built from a
//! [`QuantInit`]: the checkpoint's `quantization_config` when it has one,
//! and the float method (`--dtype`) for the tensors the method leaves alone.

use crate::backend::BackendCapabilities;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::{HostTensor, WeightSource};
use std::sync::Arc;

/// One linear layer to load: its tensors are named `{prefix}.<part>`.
#[derive(Clone, Copy, Debug)]
pub struct LinearSpec<'s> {
    /// The layer's name without the tensor part (`model.layers.0.mlp.up_proj`).
    pub prefix: &'s str,
    /// Output features (weight rows).
    pub out_features: usize,
    /// Input features (weight columns).
    pub in_features: usize,
}

/// What a method is built from.
#[derive(Clone, Default)]
pub struct QuantInit {
    /// The checkpoint's `quantization_config` (from `config.json`), when it
    /// has one.
    pub checkpoint: Option<serde_json::Value>,
    /// Stores the tensors the method does not quantize (`--dtype`); `None`
    /// keeps the checkpoint's dtype.
    pub base: Option<Arc<dyn QuantMethod>>,
}

/// Decides which tensors a linear layer loads and the stored form of weights.
pub trait QuantMethod: Send + Sync {
    /// Registered name.
    fn name(&self) -> &str;
    /// True for the float methods (`auto`, `f32`, `f16`, `bf16`): they only
    /// cast, and a quantized checkpoint's own method takes them as its base.
    fn is_float(&self) -> bool {
        false
    }
    /// Converts a checkpoint weight matrix that is not a quantized linear
    /// (an embedding table, an excluded layer) into its stored form.
    fn prepare<'a>(
        &self,
        tensor: HostTensor<'a>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>>;
    /// Loads the weight of the linear layer `spec` from `src` in its stored
    /// form (`[out_features, in_features]`). The default reads
    /// `{prefix}.weight` and stores it with [`QuantMethod::prepare`].
    fn load_linear<'a>(
        &self,
        src: &'a dyn WeightSource,
        spec: &LinearSpec<'_>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>> {
        load_unquantized(src, spec, |t| self.prepare(t, caps))
    }
    /// The static scale of the inputs of the linear layer `spec`, stored by
    /// [`QuantMethod::load_linear`] as a W8A8 FP8 weight
    /// ([`crate::DType::F8A8_S32`]), when the checkpoint calibrated one
    /// (its `input_scale`); `None` (the default) leaves the weight's own
    /// rule, a scale per run of 32 inputs. See
    /// [`crate::LinearRef::input_scale`].
    fn input_scale(&self, src: &dyn WeightSource, spec: &LinearSpec<'_>) -> Result<Option<f32>> {
        let _ = (src, spec);
        Ok(None)
    }
    /// When chosen (`--quantization`) for a checkpoint quantized with
    /// another method, the method that loads it: one that changes how a
    /// checkpoint's weights are multiplied rather than what they are (W8A8
    /// over an FP8 checkpoint) wraps `checkpoint`, the checkpoint's own
    /// method. The default, `None`, makes that choice an error.
    fn over_checkpoint(&self, checkpoint: Arc<dyn QuantMethod>) -> Option<Arc<dyn QuantMethod>> {
        let _ = checkpoint;
        None
    }
}

/// The unquantized form of the linear layer `spec`: `{prefix}.weight`, shape
/// checked, stored by `prepare` (a method's [`QuantMethod::prepare`]). The
/// default of [`QuantMethod::load_linear`], and what quantized formats do for
/// the layers they leave in float.
pub fn load_unquantized<'a>(
    src: &'a dyn WeightSource,
    spec: &LinearSpec<'_>,
    prepare: impl FnOnce(HostTensor<'a>) -> Result<HostTensor<'a>>,
) -> Result<HostTensor<'a>> {
    let name = format!("{}.weight", spec.prefix);
    let t = fetch(src, &name, &[spec.out_features, spec.in_features])?;
    prepare(t).map_err(|e| in_tensor(src, &name, e))
}

/// The tensor `name` of `src`, which must exist, have `shape` and hold the
/// bytes that shape needs; errors name the tensor and the source.
pub fn fetch<'a>(src: &'a dyn WeightSource, name: &str, shape: &[usize]) -> Result<HostTensor<'a>> {
    fetch_opt(src, name, shape)?
        .ok_or_else(|| CoreError::load(format!("{}: tensor '{name}' is missing", src.describe())))
}

/// [`fetch`] for a tensor that may be absent.
pub fn fetch_opt<'a>(
    src: &'a dyn WeightSource,
    name: &str,
    shape: &[usize],
) -> Result<Option<HostTensor<'a>>> {
    let Some(t) = src.tensor(name)? else {
        return Ok(None);
    };
    if t.shape != shape {
        return Err(CoreError::load(format!(
            "{}: tensor '{name}' has shape {:?}, expected {shape:?}",
            src.describe(),
            t.shape
        )));
    }
    t.validate(name)?;
    Ok(Some(t))
}

/// `err` as a load error that names the tensor `name` of `src`.
pub fn in_tensor(src: &dyn WeightSource, name: &str, err: CoreError) -> CoreError {
    CoreError::load(format!("{}: tensor '{name}': {err}", src.describe()))
}

/// Casts float weights to `target`, keeping quantized blocks as they are.
/// Falls back to f32 when the device cannot multiply the target dtype.
pub fn cast_float_weight<'a>(
    tensor: HostTensor<'a>,
    target: Option<DType>,
    caps: &BackendCapabilities,
) -> Result<HostTensor<'a>> {
    let want = match target {
        Some(t) => t,
        None => tensor.dtype,
    };
    if tensor.dtype.is_quantized() {
        if caps.weight_dtypes.contains(&tensor.dtype) {
            return Ok(tensor);
        }
        return Err(CoreError::unsupported(format!(
            "weights of type {} on this device",
            tensor.dtype
        )));
    }
    if !tensor.dtype.is_float() {
        return Err(CoreError::load(format!(
            "has dtype {}; a weight must be f32, f16, bf16 or a quantized type \
             (a quantized checkpoint needs its quantization_config)",
            tensor.dtype
        )));
    }
    let want = if caps.weight_dtypes.contains(&want) {
        want
    } else {
        DType::F32
    };
    if want == tensor.dtype {
        Ok(tensor)
    } else {
        tensor.cast(want)
    }
}
