//! `awq` and `gptq`: 4-bit (and for GPTQ 8-bit) integer weights with a scale
//! and a zero point per group of inputs.
//!
//! AutoAWQ GEMM (`version: "gemm"`, `zero_point: true`): `qweight` I32
//! `[k, n/8]` and `qzeros` I32 `[k/g, n/8]` hold eight outputs per word in
//! AWQ's order (output `8j + i` in bits `4 · [0,4,1,5,2,6,3,7][i]`),
//! `scales` `[k/g, n]`; value = `(q − z) × s`.
//!
//! GPTQ: `qweight` I32 `[k/8, n]` holds eight inputs per word (input `8j + i`
//! in bits `4i`), `qzeros` I32 `[k/g, n/8]` eight outputs per word in order,
//! `scales` `[k/g, n]`, `g_idx` I32 `[k]` the group of each input (act-order
//! checkpoints permute it); value = `(q − z) × s[g_idx]`, where the stored
//! zero is `z − 1` in the original format (`checkpoint_format: "gptq"`, the
//! default) and `z` in GPTQModel's `gptq_v2`. `group_size: -1` is one group.
//!
//! 8-bit GPTQ (`bits: 8`): `qweight` `[k/4, n]` holds four inputs per word
//! (input `4j + i` in bits `8i`), `qzeros` `[k/g, n/4]` four outputs per
//! word; the rest as above.
//!
//! Storage: where each run of 32 inputs shares one scale (exact in f16) and
//! zero, 4-bit weights are packed as `u4_s32` and 8-bit ones as `u8_s32`
//! (a u16 zero: the original format's zeros reach 256), whose kernels
//! dequantize in registers to the same f32 values; otherwise (act-order
//! mixing groups within 32 inputs, f32 scales) the exact f32
//! dequantization. A device without the packed dtype gets the f32 values.

use super::common::{
    Excluded, IntWeight, bad_shape, check_scales, floats, group_index, ints, store_float, string,
    tensor,
};
use arbor_engine_core::quant::load_unquantized;
use arbor_engine_core::{
    BackendCapabilities, CoreError, HostTensor, LinearSpec, QuantInit, QuantMethod, Result,
    WeightSource,
};
use std::sync::Arc;

/// Nibble of output `i % 8` within an AWQ word.
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// The error of a checkpoint method asked to load a checkpoint without a
/// `quantization_config` (chosen by name for a float checkpoint).
pub(super) fn unconfigured(method: &str, src: &dyn WeightSource) -> CoreError {
    CoreError::load(format!(
        "{}: --quantization {method} loads checkpoints quantized with {method} \
         (config.json quantization_config); this one has none (--quantization fp8 quantizes a \
         float checkpoint at load)",
        src.describe()
    ))
}

/// `bits` (`w_bit` in old AWQ configs), checked to be one of `allowed`.
fn bits(qc: &serde_json::Value, allowed: &[u64]) -> Result<u64> {
    match qc
        .get("bits")
        .or_else(|| qc.get("w_bit"))
        .and_then(|v| v.as_u64())
    {
        Some(b) if allowed.contains(&b) => Ok(b),
        other => Err(CoreError::load(format!(
            "bits must be {}, got {}",
            allowed
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" or "),
            other.map_or("nothing".to_string(), |b| b.to_string())
        ))),
    }
}

/// `group_size` (`q_group_size` in old AWQ configs); -1 means all inputs.
fn group_size(qc: &serde_json::Value) -> Result<Option<usize>> {
    let v = qc.get("group_size").or_else(|| qc.get("q_group_size"));
    match v.and_then(|v| v.as_i64()) {
        Some(-1) => Ok(None),
        Some(g) if g > 0 => Ok(Some(g as usize)),
        _ => Err(CoreError::load(format!(
            "group_size must be a positive integer or -1, got {}",
            v.map_or("nothing".to_string(), |v| v.to_string())
        ))),
    }
}

/// The group size of a layer with `k` inputs, checked to divide it.
fn layer_group(src: &dyn WeightSource, prefix: &str, g: Option<usize>, k: usize) -> Result<usize> {
    let g = g.unwrap_or(k);
    if g == 0 || !k.is_multiple_of(g) {
        return Err(CoreError::load(format!(
            "{}: layer '{prefix}': group_size {g} does not divide its {k} inputs",
            src.describe()
        )));
    }
    Ok(g)
}

/// A required I32 tensor of `shape`, as values.
fn packed(src: &dyn WeightSource, name: &str, shape: [usize; 2]) -> Result<Vec<i32>> {
    let t = tensor(src, name)?;
    if t.shape != shape {
        return Err(bad_shape(src, name, &t.shape, &format!("{shape:?}")));
    }
    ints(src, name, &t)
}

/// Scales `[groups, n]` as f32, checked finite and positive.
fn group_scales(src: &dyn WeightSource, name: &str, groups: usize, n: usize) -> Result<Vec<f32>> {
    let t = tensor(src, name)?;
    if t.shape != [groups, n] {
        return Err(bad_shape(src, name, &t.shape, &format!("[{groups}, {n}]")));
    }
    let s = floats(src, name, &t)?;
    check_scales(src, name, &s)?;
    Ok(s)
}

/// Checks that a layer's `what` (outputs, inputs) fill whole packed words of
/// `per` values.
fn whole_words(
    src: &dyn WeightSource,
    prefix: &str,
    what: &str,
    len: usize,
    per: usize,
) -> Result<()> {
    if len.is_multiple_of(per) {
        Ok(())
    } else {
        Err(CoreError::load(format!(
            "{}: layer '{prefix}': {len} {what} are not a multiple of {per} ({per} per packed word)",
            src.describe()
        )))
    }
}

/// True when the layer `p` is excluded, or shipped as a float `weight`
/// without a `qweight` (a layer the quantizer skipped).
fn left_in_float(excluded: &Excluded, src: &dyn WeightSource, p: &str) -> Result<bool> {
    Ok(excluded.contains(p)
        || src.tensor(&format!("{p}.qweight"))?.is_none()
            && src.tensor(&format!("{p}.weight"))?.is_some())
}

/// The `awq` method.
pub struct Awq {
    /// False when built without a checkpoint config (every load fails).
    configured: bool,
    base: Option<Arc<dyn QuantMethod>>,
    group: Option<usize>,
    excluded: Excluded,
}

impl Awq {
    pub fn new(init: &QuantInit) -> Result<Self> {
        let Some(qc) = init.checkpoint.as_ref() else {
            return Ok(Self {
                configured: false,
                base: init.base.clone(),
                group: None,
                excluded: Excluded::default(),
            });
        };
        bits(qc, &[4])?;
        let version = string(Some(qc), "version")
            .unwrap_or("gemm")
            .to_ascii_lowercase();
        if version != "gemm" {
            return Err(CoreError::load(format!(
                "AWQ version \"{version}\" is not supported (supported: gemm)"
            )));
        }
        if !qc
            .get("zero_point")
            .and_then(|v| v.as_bool())
            .unwrap_or(true)
        {
            return Err(CoreError::load(
                "AWQ without zero points (zero_point: false) is not supported",
            ));
        }
        Ok(Self {
            configured: true,
            base: init.base.clone(),
            group: group_size(qc)?,
            excluded: Excluded::parts_of(Some(qc), &["modules_to_not_convert"]),
        })
    }
}

impl QuantMethod for Awq {
    fn name(&self) -> &str {
        "awq"
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
        let (n, k, p) = (spec.out_features, spec.in_features, spec.prefix);
        if !self.configured {
            return Err(unconfigured(self.name(), src));
        }
        if left_in_float(&self.excluded, src, p)? {
            return load_unquantized(src, spec, |t| self.prepare(t, caps));
        }
        whole_words(src, p, "outputs", n, 8)?;
        let g = layer_group(src, p, self.group, k)?;
        let (groups, nw) = (k / g, n / 8);
        let qw = packed(src, &format!("{p}.qweight"), [k, nw])?;
        let qz = packed(src, &format!("{p}.qzeros"), [groups, nw])?;
        let s = group_scales(src, &format!("{p}.scales"), groups, n)?;
        let nib = |word: i32, r: usize| ((word as u32 >> (4 * AWQ_NIBBLE[r % 8])) & 0xf) as u8;
        let q = |r: usize, c: usize| nib(qw[c * nw + r / 8], r);
        let zero = |r: usize, c: usize| u16::from(nib(qz[(c / g) * nw + r / 8], r));
        let scale = |r: usize, c: usize| s[(c / g) * n + r];
        IntWeight {
            n,
            k,
            bits: 4,
            q: &q,
            zero: &zero,
            scale: &scale,
        }
        .store(caps)
    }
}

/// The `gptq` method.
pub struct Gptq {
    /// False when built without a checkpoint config (every load fails).
    configured: bool,
    base: Option<Arc<dyn QuantMethod>>,
    group: Option<usize>,
    /// 4 or 8.
    bits: u64,
    /// Stored zeros are `z − 1` (the original GPTQ format).
    zeros_minus_one: bool,
    excluded: Excluded,
}

impl Gptq {
    pub fn new(init: &QuantInit) -> Result<Self> {
        let Some(qc) = init.checkpoint.as_ref() else {
            return Ok(Self {
                configured: false,
                base: init.base.clone(),
                group: None,
                bits: 4,
                zeros_minus_one: true,
                excluded: Excluded::default(),
            });
        };
        let bits = bits(qc, &[4, 8])?;
        let fmt = string(Some(qc), "checkpoint_format").unwrap_or("gptq");
        let zeros_minus_one = match fmt {
            "gptq" => true,
            "gptq_v2" => false,
            other => {
                return Err(CoreError::load(format!(
                    "checkpoint_format \"{other}\" is not supported (supported: gptq, gptq_v2)"
                )));
            }
        };
        Ok(Self {
            configured: true,
            base: init.base.clone(),
            group: group_size(qc)?,
            bits,
            zeros_minus_one,
            excluded: Excluded::parts_of(Some(qc), &["modules_to_not_convert"]),
        })
    }
}

impl QuantMethod for Gptq {
    fn name(&self) -> &str {
        "gptq"
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
        let (n, k, p) = (spec.out_features, spec.in_features, spec.prefix);
        if !self.configured {
            return Err(unconfigured(self.name(), src));
        }
        if left_in_float(&self.excluded, src, p)? {
            return load_unquantized(src, spec, |t| self.prepare(t, caps));
        }
        // Values per 32-bit word.
        let per = (32 / self.bits) as usize;
        whole_words(src, p, "outputs", n, per)?;
        whole_words(src, p, "inputs", k, per)?;
        let g = layer_group(src, p, self.group, k)?;
        let (groups, nw) = (k / g, n / per);
        let qw = packed(src, &format!("{p}.qweight"), [k / per, n])?;
        let qz = packed(src, &format!("{p}.qzeros"), [groups, nw])?;
        let s = group_scales(src, &format!("{p}.scales"), groups, n)?;
        let gidx: Vec<usize> = group_index(src, &format!("{p}.g_idx"), k, groups)?
            .unwrap_or_else(|| (0..k).map(|c| c / g).collect());
        let add = u16::from(self.zeros_minus_one);
        // 4 or 8 (checked when the config was read).
        let bits = self.bits as u32;
        let mask = (1u32 << bits) - 1;
        let at = |word: i32, i: usize| ((word as u32 >> (bits * i as u32)) & mask) as u8;
        let q = |r: usize, c: usize| at(qw[(c / per) * n + r], c % per);
        let zero = |r: usize, c: usize| u16::from(at(qz[gidx[c] * nw + r / per], r % per)) + add;
        let scale = |r: usize, c: usize| s[gidx[c] * n + r];
        IntWeight {
            n,
            k,
            bits,
            q: &q,
            zero: &zero,
            scale: &scale,
        }
        .store(caps)
    }
}
