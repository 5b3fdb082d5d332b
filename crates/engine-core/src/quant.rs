//! Quantization methods: how a linear layer's weights are stored.
//!
//! A [`QuantMethod`] turns a checkpoint tensor into the form the device keeps
//! (keeping it, casting it, or quantizing it). The multiplication itself is
//! the backend's `linear`, which dispatches on the stored dtype; a method may
//! only produce dtypes the backend lists in its capabilities.

use crate::backend::BackendCapabilities;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::HostTensor;

/// Decides the stored form of linear and embedding weights.
pub trait QuantMethod: Send + Sync {
    /// Registered name.
    fn name(&self) -> &str;
    /// Converts a checkpoint tensor into its stored form for a device with `caps`.
    fn prepare<'a>(
        &self,
        tensor: HostTensor<'a>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>>;
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
