//! `fp8`: FP8 E4M3 linear weights.
//!
//! With a checkpoint `quantization_config` (`quant_method: "fp8"`): the
//! AutoFP8 layout (`weight` E4M3 with a per-tensor or per-channel
//! `weight_scale`, `activation_scheme` `dynamic` or `static` with an
//! `input_scale`) and the block layout of DeepSeek-V3 and Qwen3-FP8
//! (`weight_block_size: [bn, bk]`, `weight_scale_inv` of `ceil(n/bn) ×
//! ceil(k/bk)` f32, multiplied in despite its name). Layers under
//! `ignored_layers` / `modules_to_not_convert`, and float weights, are
//! stored as the base method says.
//!
//! Without one (`--quantization fp8` on a float checkpoint), each linear
//! layer but `lm_head` is quantized at load with one scale per output
//! channel, `amax / 448`, rounding to nearest even.

use super::common::{
    Excluded, ScaleMap, bad_shape, floats, for_device, pack_f8, scalar, static_input_scale,
    store_float, string, tensor,
};
use crate::DType;
use crate::formats::scaled::{E4M3_MAX, e4m3_to_f32, f32_to_e4m3};
use arbor_engine_core::quant::{fetch, in_tensor, load_unquantized};
use arbor_engine_core::{
    BackendCapabilities, CoreError, HostTensor, LinearSpec, QuantInit, QuantMethod, Result,
    WeightSource,
};
use std::borrow::Cow;
use std::sync::Arc;

/// The `fp8` method.
pub struct Fp8Method {
    base: Option<Arc<dyn QuantMethod>>,
    /// The checkpoint holds FP8 weights (it has a quantization_config).
    serialized: bool,
    /// `weight_block_size`, when the scales are per block.
    block: Option<(usize, usize)>,
    excluded: Excluded,
}

impl Fp8Method {
    pub fn new(init: &QuantInit) -> Result<Self> {
        let Some(qc) = init.checkpoint.as_ref() else {
            return Ok(Self {
                base: init.base.clone(),
                serialized: false,
                block: None,
                excluded: Excluded {
                    exact: vec!["lm_head".into()],
                    ..Excluded::default()
                },
            });
        };
        if let Some(s) = string(Some(qc), "activation_scheme")
            && !matches!(s, "dynamic" | "static")
        {
            return Err(CoreError::load(format!(
                "activation_scheme must be \"dynamic\" or \"static\", got \"{s}\""
            )));
        }
        if let Some(f) = string(Some(qc), "fmt")
            && f != "e4m3"
        {
            return Err(CoreError::load(format!(
                "fmt \"{f}\" is not supported (fp8 checkpoints are e4m3)"
            )));
        }
        let block = match qc.get("weight_block_size") {
            None | Some(serde_json::Value::Null) => None,
            Some(v) => {
                let dims: Option<Vec<usize>> = v.as_array().map(|a| {
                    a.iter()
                        .filter_map(|x| x.as_u64().map(|u| u as usize))
                        .collect()
                });
                match dims.as_deref() {
                    Some([bn, bk]) if *bn > 0 && *bk > 0 => Some((*bn, *bk)),
                    _ => {
                        return Err(CoreError::load(format!(
                            "weight_block_size must be two positive integers, got {v}"
                        )));
                    }
                }
            }
        };
        Ok(Self {
            base: init.base.clone(),
            serialized: true,
            block,
            excluded: Excluded::parts_of(Some(qc), &["ignored_layers", "modules_to_not_convert"]),
        })
    }

    /// The scales of a serialized FP8 weight `prefix.weight` of `[n, k]`.
    fn scales(&self, src: &dyn WeightSource, prefix: &str, n: usize, k: usize) -> Result<ScaleMap> {
        if let Some((bn, bk)) = self.block {
            let name = format!("{prefix}.weight_scale_inv");
            let t = tensor(src, &name)?;
            let want = [n.div_ceil(bn), k.div_ceil(bk)];
            if t.shape != want {
                return Err(bad_shape(
                    src,
                    &name,
                    &t.shape,
                    &format!("{want:?} (weight_block_size [{bn}, {bk}])"),
                ));
            }
            let map = ScaleMap::Blocks {
                s: floats(src, &name, &t)?,
                bn,
                bk,
                cols: want[1],
            };
            map.check(src, &name)?;
            return Ok(map);
        }
        let name = format!("{prefix}.weight_scale");
        channel_or_tensor_scales(src, &name, n)
    }
}

/// A per-tensor (`[]`, `[1]`) or per-channel (`[n]`, `[n, 1]`) scale tensor.
pub fn channel_or_tensor_scales(src: &dyn WeightSource, name: &str, n: usize) -> Result<ScaleMap> {
    let t = tensor(src, name)?;
    let map = if let Some(s) = scalar(src, name, &t)? {
        ScaleMap::Tensor(s)
    } else if t.shape == [n] || t.shape == [n, 1] {
        ScaleMap::Rows(floats(src, name, &t)?)
    } else {
        return Err(bad_shape(
            src,
            name,
            &t.shape,
            &format!("[], [1], [{n}] or [{n}, 1]"),
        ));
    };
    map.check(src, name)?;
    Ok(map)
}

/// An FP8 weight `[n, k]` with `scales`, stored for the device: packed as
/// `f8_s32` when the layout allows, else dequantized to f32 (exact).
pub fn store_f8(
    src: &dyn WeightSource,
    name: &str,
    codes: &[u8],
    n: usize,
    k: usize,
    scales: &ScaleMap,
    caps: &BackendCapabilities,
) -> Result<HostTensor<'static>> {
    if k.is_multiple_of(32) && scales.uniform_in_32() {
        return for_device(pack_f8(src, name, codes, n, k, scales)?, caps);
    }
    let mut v = Vec::with_capacity(n * k * 4);
    for r in 0..n {
        for c in 0..k {
            let x = e4m3_to_f32(codes[r * k + c]) * scales.at(r, c);
            v.extend_from_slice(&x.to_le_bytes());
        }
    }
    Ok(HostTensor {
        dtype: DType::F32,
        shape: vec![n, k],
        data: Cow::Owned(v),
    })
}

/// Quantizes a float weight `[n, k]` to E4M3 with one scale per row.
pub fn quantize_rows(
    src: &dyn WeightSource,
    name: &str,
    t: &HostTensor<'_>,
    caps: &BackendCapabilities,
) -> Result<HostTensor<'static>> {
    let (n, k) = (t.shape[0], t.shape[1]);
    let x = floats(src, name, t)?;
    let mut scales = Vec::with_capacity(n);
    let mut codes = vec![0u8; n * k];
    for (r, (row, out)) in x
        .chunks_exact(k.max(1))
        .zip(codes.chunks_exact_mut(k.max(1)))
        .enumerate()
    {
        let amax = row.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        if !amax.is_finite() {
            return Err(in_tensor(
                src,
                name,
                CoreError::load(format!("row {r} holds a non-finite value")),
            ));
        }
        let s = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
        for (o, &v) in out.iter_mut().zip(row) {
            *o = f32_to_e4m3(v / s);
        }
        scales.push(s);
    }
    store_f8(src, name, &codes, n, k, &ScaleMap::Rows(scales), caps)
}

impl QuantMethod for Fp8Method {
    fn name(&self) -> &str {
        "fp8"
    }

    fn prepare<'a>(&self, t: HostTensor<'a>, caps: &BackendCapabilities) -> Result<HostTensor<'a>> {
        store_float(&self.base, t, caps)
    }

    fn load_linear<'a>(
        &self,
        src: &'a dyn WeightSource,
        spec: &LinearSpec<'_>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'a>> {
        let (n, k) = (spec.out_features, spec.in_features);
        if self.excluded.contains(spec.prefix) {
            return load_unquantized(src, spec, |t| self.prepare(t, caps));
        }
        let name = format!("{}.weight", spec.prefix);
        let t = fetch(src, &name, &[n, k])?;
        match t.dtype {
            DType::F8E4M3 => {
                let scales = self.scales(src, spec.prefix, n, k)?;
                static_input_scale(src, spec.prefix)?;
                store_f8(src, &name, &t.data, n, k, &scales, caps)
            }
            d if d.is_float() && self.serialized => {
                self.prepare(t, caps).map_err(|e| in_tensor(src, &name, e))
            }
            d if d.is_float() => quantize_rows(src, &name, &t, caps),
            d => Err(in_tensor(
                src,
                &name,
                CoreError::load(format!(
                    "has dtype {d}; fp8 loads f8_e4m3 weights or quantizes float ones"
                )),
            )),
        }
    }
}
