//! `modelopt`: checkpoints exported by NVIDIA ModelOpt (TensorRT Model
//! Optimizer), from `quantization_config` (`quant_method: "modelopt"`) or
//! the older `hf_quant_config.json` (`quantization: {...}`).
//!
//! - `quant_algo: "NVFP4"`: `weight` U8 `[n, k/2]` holds two E2M1 codes per
//!   byte (element `2i` in the low nibble), `weight_scale` E4M3
//!   `[n, k/group_size]` (group 16), `weight_scale_2` the f32 global scale,
//!   `input_scale` the activations' (checked, not applied); value =
//!   `e2m1 × (f32(weight_scale) × weight_scale_2)`, packed as `f4_s16`.
//! - `quant_algo: "FP8"`: E4M3 `weight` with a per-tensor `weight_scale`, as
//!   the `fp8` method stores it.
//! - `quant_algo: null` with a `kv_cache_quant_algo` (a KV-cache-only
//!   calibration): float weights, stored as the base method decides; the
//!   model loader reads the KV scales.
//!
//! `exclude_modules` names layers left in float: `*` matches any text, and
//! a name without one matches as a part of the layer name.

use super::common::{
    Excluded, bad_shape, for_device, scalar, static_input_scale, store_float, string, tensor,
};
use super::fp8::{channel_or_tensor_scales, store_f8};
use crate::DType;
use crate::formats::scaled::{e4m3_is_nan, e4m3_to_f32, write_f4_block};
use arbor_engine_core::quant::{fetch, in_tensor, load_unquantized};
use arbor_engine_core::{
    BackendCapabilities, CoreError, HostTensor, LinearSpec, QuantInit, QuantMethod, Result,
    WeightSource,
};
use std::borrow::Cow;
use std::sync::Arc;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Algo {
    Nvfp4,
    Fp8,
    /// Only the KV cache is calibrated; the weights are float.
    KvOnly,
}

/// The `modelopt` method.
pub struct ModelOpt {
    /// `None` when built without a checkpoint config (every load fails).
    algo: Option<Algo>,
    group: usize,
    base: Option<Arc<dyn QuantMethod>>,
    excluded: Excluded,
}

impl ModelOpt {
    pub fn new(init: &QuantInit) -> Result<Self> {
        let Some(qc) = init.checkpoint.as_ref() else {
            return Ok(Self {
                algo: None,
                group: 16,
                base: init.base.clone(),
                excluded: Excluded::default(),
            });
        };
        // hf_quant_config.json nests the fields under "quantization".
        let q = qc.get("quantization").unwrap_or(qc);
        let algo = match string(Some(q), "quant_algo")
            .map(str::to_ascii_uppercase)
            .as_deref()
        {
            Some("NVFP4") => Algo::Nvfp4,
            Some("FP8") => Algo::Fp8,
            None if q.get("kv_cache_quant_algo").is_some_and(|a| !a.is_null()) => Algo::KvOnly,
            other => {
                return Err(CoreError::load(format!(
                    "quant_algo {} is not supported (supported: NVFP4, FP8)",
                    other.map_or("(missing)".to_string(), |a| format!("\"{a}\""))
                )));
            }
        };
        let group = super::common::uint(Some(q), "group_size", 16)?;
        if algo == Algo::Nvfp4 && group != 16 {
            return Err(CoreError::load(format!(
                "NVFP4 group_size must be 16, got {group}"
            )));
        }
        let mut excluded = Excluded::default();
        for v in q
            .get("exclude_modules")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            let Some(s) = v.as_str() else { continue };
            if s.contains('*') {
                let re = regex::escape(s).replace("\\*", ".*");
                excluded.patterns.push(
                    regex::Regex::new(&format!("^{re}$"))
                        .map_err(|e| CoreError::load(format!("exclude_modules '{s}': {e}")))?,
                );
            } else {
                excluded.parts.push(s.to_string());
            }
        }
        Ok(Self {
            algo: Some(algo),
            group,
            base: init.base.clone(),
            excluded,
        })
    }

    fn load_nvfp4(
        &self,
        src: &dyn WeightSource,
        spec: &LinearSpec<'_>,
        caps: &BackendCapabilities,
    ) -> Result<HostTensor<'static>> {
        let (n, k, p) = (spec.out_features, spec.in_features, spec.prefix);
        if !k.is_multiple_of(self.group) {
            return Err(CoreError::load(format!(
                "{}: layer '{p}': group_size {} does not divide its {k} inputs",
                src.describe(),
                self.group
            )));
        }
        let wname = format!("{p}.weight");
        let w = tensor(src, &wname)?;
        if w.dtype != DType::U8 || w.shape != [n, k / 2] {
            return Err(in_tensor(
                src,
                &wname,
                CoreError::load(format!(
                    "is {} {:?}; NVFP4 weights are u8 [{n}, {}] (two E2M1 codes a byte)",
                    w.dtype,
                    w.shape,
                    k / 2
                )),
            ));
        }
        let sname = format!("{p}.weight_scale");
        let s = tensor(src, &sname)?;
        let groups = k / self.group;
        if s.dtype != DType::F8E4M3 || s.shape != [n, groups] {
            return Err(in_tensor(
                src,
                &sname,
                CoreError::load(format!(
                    "is {} {:?}; NVFP4 block scales are f8_e4m3 [{n}, {groups}]",
                    s.dtype, s.shape
                )),
            ));
        }
        if let Some(i) = s.data.iter().position(|&c| e4m3_is_nan(c)) {
            return Err(in_tensor(
                src,
                &sname,
                CoreError::load(format!("element {i} is an E4M3 NaN")),
            ));
        }
        let gname = format!("{p}.weight_scale_2");
        let g = tensor(src, &gname)?;
        let global = match scalar(src, &gname, &g)? {
            Some(v) if v.is_finite() && v > 0.0 => v,
            Some(v) => {
                return Err(in_tensor(
                    src,
                    &gname,
                    CoreError::load(format!(
                        "holds {v}; the global scale must be finite and positive"
                    )),
                ));
            }
            None => return Err(bad_shape(src, &gname, &g.shape, "[] or [1]")),
        };
        static_input_scale(src, p)?;
        let mut out = vec![0u8; n * groups * 12];
        let mut codes = [0u8; 16];
        for r in 0..n {
            for b in 0..groups {
                let bytes = &w.data[r * k / 2 + b * 8..r * k / 2 + b * 8 + 8];
                for (i, &byte) in bytes.iter().enumerate() {
                    codes[2 * i] = byte & 0x0f;
                    codes[2 * i + 1] = byte >> 4;
                }
                let scale = e4m3_to_f32(s.data[r * groups + b]) * global;
                let o = (r * groups + b) * 12;
                write_f4_block(&codes, scale, &mut out[o..o + 12]);
            }
        }
        for_device(
            HostTensor {
                dtype: DType::F4_S16,
                shape: vec![n, k],
                data: Cow::Owned(out),
            },
            caps,
        )
    }
}

impl QuantMethod for ModelOpt {
    fn name(&self) -> &str {
        "modelopt"
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
        let Some(algo) = self.algo else {
            return Err(super::int4::unconfigured(self.name(), src));
        };
        let (n, k, p) = (spec.out_features, spec.in_features, spec.prefix);
        let name = format!("{p}.weight");
        if self.excluded.contains(p) {
            return load_unquantized(src, spec, |t| self.prepare(t, caps));
        }
        match algo {
            Algo::KvOnly => load_unquantized(src, spec, |t| self.prepare(t, caps)),
            Algo::Nvfp4 => self.load_nvfp4(src, spec, caps),
            Algo::Fp8 => {
                let t = fetch(src, &name, &[n, k])?;
                if t.dtype != DType::F8E4M3 {
                    return Err(in_tensor(
                        src,
                        &name,
                        CoreError::load(format!(
                            "has dtype {}; ModelOpt FP8 weights are f8_e4m3",
                            t.dtype
                        )),
                    ));
                }
                let scales = channel_or_tensor_scales(src, &format!("{p}.weight_scale"), n)?;
                static_input_scale(src, p)?;
                store_f8(src, &name, &t.data, n, k, &scales, caps)
            }
        }
    }
}
