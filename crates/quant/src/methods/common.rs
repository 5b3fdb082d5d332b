//! What the quantization methods share: reading scale and packed tensors,
//! the map from a weight element to its scale, packing into the in-band
//! block dtypes, the f32 fallback, layer exclusion lists and config fields.
//!
//! Invariant: a packed weight always dequantizes element for element to the
//! format's formula; [`ScaleMap::uniform_in_32`] says when a scale layout
//! can be packed that way, and callers fall back to f32 otherwise.

use crate::DType;
use crate::formats::scaled::{e4m3_is_nan, write_f8_block, write_u4_block, write_u8_block};
use arbor_engine_core::quant::{cast_float_weight, in_tensor};
use arbor_engine_core::{
    BackendCapabilities, CoreError, HostTensor, QuantMethod, Result, WeightSource,
};
use std::borrow::Cow;
use std::sync::Arc;

/// Where each element's scale comes from, for a weight of `[n, k]`.
#[derive(Clone, Debug)]
pub enum ScaleMap {
    /// One scale for the whole tensor.
    Tensor(f32),
    /// One scale per output row (`n` values).
    Rows(Vec<f32>),
    /// One scale per `[bn, bk]` block, `ceil(n/bn) × ceil(k/bk)` row-major.
    Blocks {
        s: Vec<f32>,
        bn: usize,
        bk: usize,
        cols: usize,
    },
    /// One scale per row and group of `g` inputs, `n × (k/g)` row-major.
    Groups {
        s: Vec<f32>,
        g: usize,
        groups: usize,
    },
}

impl ScaleMap {
    /// The scale of element `(r, c)`.
    pub fn at(&self, r: usize, c: usize) -> f32 {
        match self {
            ScaleMap::Tensor(s) => *s,
            ScaleMap::Rows(s) => s[r],
            ScaleMap::Blocks { s, bn, bk, cols } => s[(r / bn) * cols + c / bk],
            ScaleMap::Groups { s, g, groups } => s[r * groups + c / g],
        }
    }

    /// True when the scale is constant over every run of 32 inputs.
    pub fn uniform_in_32(&self) -> bool {
        match self {
            ScaleMap::Tensor(_) | ScaleMap::Rows(_) => true,
            ScaleMap::Blocks { bk, .. } => bk.is_multiple_of(32),
            ScaleMap::Groups { g, .. } => g.is_multiple_of(32),
        }
    }

    /// Checks every scale is finite and positive.
    pub fn check(&self, src: &dyn WeightSource, name: &str) -> Result<()> {
        match self {
            ScaleMap::Tensor(s) => check_scales(src, name, std::slice::from_ref(s)),
            ScaleMap::Rows(s) | ScaleMap::Blocks { s, .. } | ScaleMap::Groups { s, .. } => {
                check_scales(src, name, s)
            }
        }
    }
}

/// Checks that every value of the scale tensor `name` is finite and positive.
pub fn check_scales(src: &dyn WeightSource, name: &str, scales: &[f32]) -> Result<()> {
    match scales.iter().find(|v| !(v.is_finite() && **v > 0.0)) {
        Some(v) => Err(in_tensor(
            src,
            name,
            CoreError::load(format!(
                "holds the scale {v}; scales must be finite and positive"
            )),
        )),
        None => Ok(()),
    }
}

/// The values of a float tensor as f32.
pub fn floats(src: &dyn WeightSource, name: &str, t: &HostTensor<'_>) -> Result<Vec<f32>> {
    if !t.dtype.is_float() {
        return Err(in_tensor(
            src,
            name,
            CoreError::load(format!("has dtype {}; expected f32, f16 or bf16", t.dtype)),
        ));
    }
    t.to_f32_vec().map_err(|e| in_tensor(src, name, e))
}

/// The values of an I32 tensor.
pub fn ints(src: &dyn WeightSource, name: &str, t: &HostTensor<'_>) -> Result<Vec<i32>> {
    if t.dtype != DType::I32 {
        return Err(in_tensor(
            src,
            name,
            CoreError::load(format!("has dtype {}; expected i32 (packed int4)", t.dtype)),
        ));
    }
    Ok(t.data
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// A required tensor of any shape.
pub fn tensor<'a>(src: &'a dyn WeightSource, name: &str) -> Result<HostTensor<'a>> {
    let t = src.tensor(name)?.ok_or_else(|| {
        CoreError::load(format!("{}: tensor '{name}' is missing", src.describe()))
    })?;
    t.validate(name)?;
    Ok(t)
}

/// The group of each of `k` inputs from an act-order index tensor (GPTQ's
/// `g_idx`, compressed-tensors' `weight_g_idx`: I32 `[k]`, each in
/// `0..groups`); `None` when the checkpoint has no such tensor.
pub fn group_index(
    src: &dyn WeightSource,
    name: &str,
    k: usize,
    groups: usize,
) -> Result<Option<Vec<usize>>> {
    let Some(t) = src.tensor(name)? else {
        return Ok(None);
    };
    t.validate(name)?;
    if t.shape != [k] {
        return Err(bad_shape(src, name, &t.shape, &format!("[{k}]")));
    }
    let v = ints(src, name, &t)?;
    if let Some(bad) = v.iter().find(|&&x| x < 0 || x as usize >= groups) {
        return Err(in_tensor(
            src,
            name,
            CoreError::load(format!("holds group {bad}; the layer has {groups} groups")),
        ));
    }
    Ok(Some(v.into_iter().map(|x| x as usize).collect()))
}

/// A shape error naming the tensor.
pub fn bad_shape(src: &dyn WeightSource, name: &str, got: &[usize], want: &str) -> CoreError {
    CoreError::load(format!(
        "{}: tensor '{name}' has shape {got:?}, expected {want}",
        src.describe()
    ))
}

/// Packs E4M3 codes `[n, k]` with their scales into `f8_s32`, checking for
/// NaN codes. `scales.uniform_in_32()` must hold and `k % 32 == 0`.
pub fn pack_f8(
    src: &dyn WeightSource,
    name: &str,
    codes: &[u8],
    n: usize,
    k: usize,
    scales: &ScaleMap,
) -> Result<HostTensor<'static>> {
    if let Some(i) = codes.iter().position(|&c| e4m3_is_nan(c)) {
        return Err(in_tensor(
            src,
            name,
            CoreError::load(format!("element {i} is an E4M3 NaN")),
        ));
    }
    let nb = k / 32;
    let mut out = vec![0u8; n * nb * 36];
    for r in 0..n {
        for b in 0..nb {
            let o = (r * nb + b) * 36;
            let c0 = r * k + b * 32;
            write_f8_block(
                &codes[c0..c0 + 32],
                scales.at(r, b * 32),
                &mut out[o..o + 36],
            );
        }
    }
    Ok(HostTensor {
        dtype: DType::F8_S32,
        shape: vec![n, k],
        data: Cow::Owned(out),
    })
}

/// The f32 tensor `[n, k]` of `value(r, c)`.
pub fn dequantized(n: usize, k: usize, value: impl Fn(usize, usize) -> f32) -> HostTensor<'static> {
    let mut v = Vec::with_capacity(n * k * 4);
    for r in 0..n {
        for c in 0..k {
            v.extend_from_slice(&value(r, c).to_le_bytes());
        }
    }
    HostTensor {
        dtype: DType::F32,
        shape: vec![n, k],
        data: Cow::Owned(v),
    }
}

/// Unsigned 4- or 8-bit values of a weight `[n, k]` with per-element zero
/// points and scales given by group of 32 (`zero(r, c)`, `scale(r, c)`).
pub struct IntWeight<'f> {
    pub n: usize,
    pub k: usize,
    /// Bits per value: 4 (`u4_s32`) or 8 (`u8_s32`).
    pub bits: u32,
    /// Value of element `(r, c)`, below `2^bits`.
    pub q: &'f dyn Fn(usize, usize) -> u8,
    /// Zero point of element `(r, c)` (GPTQ's original format adds one, so
    /// it reaches `2^bits`).
    pub zero: &'f dyn Fn(usize, usize) -> u16,
    /// Scale of element `(r, c)` as f32 (from the checkpoint's f16/bf16/f32).
    pub scale: &'f dyn Fn(usize, usize) -> f32,
}

impl IntWeight<'_> {
    /// The f32 dequantization `(q − zero) × scale`, `[n, k]`.
    pub fn to_f32(&self) -> HostTensor<'static> {
        dequantized(self.n, self.k, |r, c| {
            ((self.q)(r, c) as i32 - (self.zero)(r, c) as i32) as f32 * (self.scale)(r, c)
        })
    }

    /// Packs into `u4_s32` or `u8_s32` when every run of 32 inputs shares
    /// one scale and zero, the zeros fit the block and the scales are exact
    /// in f16; `None` otherwise.
    pub fn pack(&self) -> Option<HostTensor<'static>> {
        if !self.k.is_multiple_of(32) || !matches!(self.bits, 4 | 8) {
            return None;
        }
        let (dtype, bb) = if self.bits == 4 {
            (DType::U4_S32, 20)
        } else {
            (DType::U8_S32, 36)
        };
        let nb = self.k / 32;
        let mut out = vec![0u8; self.n * nb * bb];
        let mut q = [0u8; 32];
        for r in 0..self.n {
            for b in 0..nb {
                let c0 = b * 32;
                let (s, z) = ((self.scale)(r, c0), (self.zero)(r, c0));
                let h = half::f16::from_f32(s);
                if h.to_f32() != s {
                    return None;
                }
                for (i, o) in q.iter_mut().enumerate() {
                    let c = c0 + i;
                    if (self.scale)(r, c) != s || (self.zero)(r, c) != z {
                        return None;
                    }
                    *o = (self.q)(r, c);
                }
                let o = (r * nb + b) * bb;
                let block = &mut out[o..o + bb];
                if self.bits == 4 {
                    write_u4_block(&q, h.to_bits(), u8::try_from(z).ok()?, block);
                } else {
                    write_u8_block(&q, h.to_bits(), z, block);
                }
            }
        }
        Some(HostTensor {
            dtype,
            shape: vec![self.n, self.k],
            data: Cow::Owned(out),
        })
    }

    /// Packed for a device that multiplies the packed dtype; dequantized to
    /// f32 (exact) when the packing does not apply or the device lacks it.
    pub fn store(&self, caps: &BackendCapabilities) -> Result<HostTensor<'static>> {
        match self.pack() {
            Some(p) => for_device(p, caps),
            None => Ok(self.to_f32()),
        }
    }
}

/// A packed weight as the device takes it: as is when the device multiplies
/// its dtype, else dequantized to f32 (exact).
pub fn for_device(
    t: HostTensor<'static>,
    caps: &BackendCapabilities,
) -> Result<HostTensor<'static>> {
    if caps.weight_dtypes.contains(&t.dtype) {
        return Ok(t);
    }
    let n: usize = t.shape.iter().product();
    let mut f = vec![0.0f32; n];
    crate::dequantize(t.dtype, &t.data, &mut f).map_err(|e| CoreError::load(e.to_string()))?;
    Ok(HostTensor {
        dtype: DType::F32,
        shape: t.shape,
        data: Cow::Owned(f.iter().flat_map(|v| v.to_le_bytes()).collect()),
    })
}

/// Stores a weight the method leaves unquantized with the base method.
pub fn store_float<'a>(
    base: &Option<Arc<dyn QuantMethod>>,
    t: HostTensor<'a>,
    caps: &BackendCapabilities,
) -> Result<HostTensor<'a>> {
    match base {
        Some(b) => b.prepare(t, caps),
        None => cast_float_weight(t, None, caps),
    }
}

/// Module names a format leaves unquantized.
#[derive(Clone, Debug, Default)]
pub struct Excluded {
    /// Names matched as substrings of the layer name (AWQ, GPTQ, ModelOpt, fp8).
    pub parts: Vec<String>,
    /// compressed-tensors `ignore`: exact names, or `re:` patterns matched
    /// from the start of the name.
    pub exact: Vec<String>,
    pub patterns: Vec<regex::Regex>,
}

impl Excluded {
    /// Substring names from the string arrays under `keys` of `qc`.
    pub fn parts_of(qc: Option<&serde_json::Value>, keys: &[&str]) -> Self {
        let mut parts = Vec::new();
        for key in keys {
            if let Some(a) = qc.and_then(|q| q.get(*key)).and_then(|v| v.as_array()) {
                parts.extend(a.iter().filter_map(|v| v.as_str()).map(str::to_string));
            }
        }
        Self {
            parts,
            ..Self::default()
        }
    }

    /// compressed-tensors' `ignore` list.
    pub fn ignore_list(qc: &serde_json::Value) -> Result<Self> {
        let mut out = Self::default();
        for v in qc
            .get("ignore")
            .and_then(|v| v.as_array())
            .into_iter()
            .flatten()
        {
            let Some(s) = v.as_str() else { continue };
            match s.strip_prefix("re:") {
                Some(p) => out.patterns.push(anchored(p, "ignore")?),
                None => out.exact.push(s.to_string()),
            }
        }
        Ok(out)
    }

    /// True if the layer `prefix` is excluded.
    pub fn contains(&self, prefix: &str) -> bool {
        self.parts.iter().any(|p| prefix.contains(p.as_str()))
            || self.exact.iter().any(|e| e == prefix)
            || self.patterns.iter().any(|r| r.is_match(prefix))
    }
}

/// A `re:` pattern of a compressed-tensors list, matched from the start.
pub fn anchored(p: &str, key: &str) -> Result<regex::Regex> {
    regex::Regex::new(&format!("^(?:{p})"))
        .map_err(|e| CoreError::load(format!("quantization_config.{key}: pattern 're:{p}': {e}")))
}

/// An unsigned integer field of a config object, with a default.
pub fn uint(v: Option<&serde_json::Value>, key: &str, default: usize) -> Result<usize> {
    match v.and_then(|o| o.get(key)) {
        None | Some(serde_json::Value::Null) => Ok(default),
        Some(x) => x.as_u64().map(|u| u as usize).ok_or_else(|| {
            CoreError::load(format!("{key} must be a non-negative integer, got {x}"))
        }),
    }
}

/// A string field of a config object.
pub fn string<'v>(v: Option<&'v serde_json::Value>, key: &str) -> Option<&'v str> {
    v.and_then(|o| o.get(key)).and_then(|x| x.as_str())
}

/// The scalar in a tensor of one element (`[]` or `[1]`).
pub fn scalar(src: &dyn WeightSource, name: &str, t: &HostTensor<'_>) -> Result<Option<f32>> {
    let n: usize = t.shape.iter().product();
    if n != 1 {
        return Ok(None);
    }
    Ok(floats(src, name, t)?.first().copied())
}

/// A layer's optional static activation scale (`{prefix}.input_scale`),
/// checked: one finite positive value when present.
pub fn static_input_scale(src: &dyn WeightSource, prefix: &str) -> Result<Option<f32>> {
    let name = format!("{prefix}.input_scale");
    let Some(t) = src.tensor(&name)? else {
        return Ok(None);
    };
    match scalar(src, &name, &t)? {
        Some(v) if v.is_finite() && v > 0.0 => Ok(Some(v)),
        Some(v) => Err(in_tensor(
            src,
            &name,
            CoreError::load(format!(
                "holds {v}; an input scale must be finite and positive"
            )),
        )),
        None => Err(bad_shape(src, &name, &t.shape, "[] or [1]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Packing keeps every value: the packed blocks dequantize to exactly
    /// `to_f32`, for 4 and 8 bits, with 8-bit zero points up to 256; groups
    /// that differ within 32 inputs do not pack.
    #[test]
    fn packed_blocks_dequantize_to_the_f32_values() {
        let (n, k) = (3, 64);
        for bits in [4u32, 8] {
            let top = (1u32 << bits) - 1;
            let q = |r: usize, c: usize| ((r * 37 + c * 11) as u32 % (top + 1)) as u8;
            let zeros = [0, top as u16 + 1, 1, top as u16 / 2];
            let zero = |r: usize, c: usize| zeros[(r + c / 32) % 4];
            let scale = |r: usize, c: usize| 0.0625 * (1 + r + c / 32) as f32;
            let w = IntWeight {
                n,
                k,
                bits,
                q: &q,
                zero: &zero,
                scale: &scale,
            };
            let want = w.to_f32();
            if bits == 4 {
                // A 4-bit zero of 16 (GPTQ's original format) still fits u8.
                assert!((0..n).any(|r| (0..k).any(|c| zero(r, c) == 16)));
            } else {
                assert!((0..n).any(|r| (0..k).any(|c| zero(r, c) == 256)));
            }
            let packed = w.pack().expect("uniform groups of 32 pack");
            assert_eq!(
                packed.dtype,
                if bits == 4 {
                    DType::U4_S32
                } else {
                    DType::U8_S32
                }
            );
            let mut got = vec![0.0f32; n * k];
            crate::dequantize(packed.dtype, &packed.data, &mut got).expect("dequantize");
            let want: Vec<f32> = want
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert_eq!(got, want, "{bits} bits");
            // A scale change inside a block of 32 leaves the f32 path.
            let ragged = |r: usize, c: usize| scale(r, c) * if c == 5 { 2.0 } else { 1.0 };
            let w = IntWeight {
                scale: &ragged,
                ..w
            };
            assert!(w.pack().is_none());
        }
    }
}
