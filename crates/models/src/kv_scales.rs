//! A checkpoint's FP8 KV cache calibration: whether its `quantization_config`
//! declares an FP8 KV cache, and each attention layer's `k_scale` and
//! `v_scale` tensors.
//!
//! Declarations read (the ones vLLM and SGLang read):
//! - compressed-tensors (llm-compressor): `kv_cache_scheme` with
//!   `num_bits: 8`, `type: "float"`, `strategy: "tensor"`, not `dynamic`;
//! - ModelOpt: `kv_cache_quant_algo: "FP8"` (in `config.json`, or under
//!   `quantization` in the older `hf_quant_config.json`).
//!
//! Tensor names, per layer prefix `model.layers.{i}.self_attn`, first found
//! wins: `{p}.k_scale`/`{p}.v_scale` (llm-compressor),
//! `{p}.k_proj.k_scale`/`{p}.v_proj.v_scale` (ModelOpt),
//! `{p}.k_proj.output_scale`/`{p}.v_proj.output_scale` (older
//! llm-compressor), `{p}.kv_scale` (one scale for both, older exports). Each
//! is one positive finite number (shape `[]` or `[1]`).
//!
//! Invariant: a checkpoint that declares an FP8 KV cache has both scales in
//! every layer, else loading fails naming the first missing tensor; scales
//! found without a declaration are used too (vLLM does).

use crate::config::Keys;
use arbor_engine_core::{CoreError, DType, KvScales, Result, WeightSource};
use serde_json::Value;

/// The KV element type `config`'s `quantization_config` declares scales
/// for: FP8 E4M3, or `None` when it declares no KV cache quantization.
/// Anything else declared (INT8, FP4, per-head or dynamic scales) is an
/// error naming the key.
pub fn declared_kv_dtype(config: &Value, file: &str) -> Result<Option<DType>> {
    let Some(qc) = config.get("quantization_config").filter(|q| !q.is_null()) else {
        return Ok(None);
    };
    let unsupported = |key: &str, what: String| {
        CoreError::unsupported(format!(
            "{file}: quantization_config.{key} {what}; Arbor reads per-tensor FP8 (E4M3) KV cache scales"
        ))
    };
    // ModelOpt's hf_quant_config.json nests it under `quantization`.
    let algo = qc
        .get("kv_cache_quant_algo")
        .or_else(|| qc.get("quantization")?.get("kv_cache_quant_algo"));
    if let Some(algo) = algo.filter(|a| !a.is_null()) {
        return match algo.as_str() {
            Some(a) if a.eq_ignore_ascii_case("fp8") => Ok(Some(DType::F8E4M3)),
            _ => Err(unsupported("kv_cache_quant_algo", format!("is {algo}"))),
        };
    }
    let Some(scheme) = qc.get("kv_cache_scheme").filter(|s| !s.is_null()) else {
        return Ok(None);
    };
    let s = Keys { v: scheme, file };
    let bits = s.usize_opt("num_bits")?;
    let kind = scheme.get("type").and_then(Value::as_str);
    if bits != Some(8) || kind != Some("float") {
        return Err(unsupported(
            "kv_cache_scheme",
            format!(
                "is {}-bit '{}'",
                bits.map_or("?".into(), |b| b.to_string()),
                kind.unwrap_or("?")
            ),
        ));
    }
    match scheme.get("strategy").and_then(Value::as_str) {
        None | Some("tensor") => {}
        Some(other) => {
            return Err(unsupported(
                "kv_cache_scheme.strategy",
                format!("is '{other}'"),
            ));
        }
    }
    if s.bool_opt("dynamic")?.unwrap_or(false) {
        return Err(unsupported("kv_cache_scheme.dynamic", "is true".into()));
    }
    Ok(Some(DType::F8E4M3))
}

/// One scalar scale tensor, when present; an error names it when it is
/// not one positive finite number.
fn scalar(src: &dyn WeightSource, name: &str) -> Result<Option<f32>> {
    let Some(t) = src.tensor(name)? else {
        return Ok(None);
    };
    let bad = |what: String| CoreError::load(format!("{}: tensor '{name}' {what}", src.describe()));
    if t.shape.iter().product::<usize>() != 1 {
        return Err(bad(format!(
            "has shape {:?}; a KV cache scale is one number",
            t.shape
        )));
    }
    t.validate(name)?;
    let v = t.to_f32_vec()?[0];
    if !(v.is_finite() && v > 0.0) {
        return Err(bad(format!("is {v}; a KV cache scale is positive")));
    }
    Ok(Some(v))
}

/// The KV cache scales of the attention at `prefix` (`model.layers.{i}.self_attn`):
/// `None` when the checkpoint has none for it and `required` is false.
pub(crate) fn layer_scales(
    src: &dyn WeightSource,
    prefix: &str,
    required: bool,
) -> Result<Option<KvScales>> {
    let pairs = [
        ("k_scale", "v_scale"),
        ("k_proj.k_scale", "v_proj.v_scale"),
        ("k_proj.output_scale", "v_proj.output_scale"),
    ];
    for (k_name, v_name) in pairs {
        let k_name = format!("{prefix}.{k_name}");
        let v_name = format!("{prefix}.{v_name}");
        match (scalar(src, &k_name)?, scalar(src, &v_name)?) {
            (Some(k), Some(v)) => return Ok(Some(KvScales { k, v })),
            (None, None) => {}
            (Some(_), None) => return Err(missing(src, &v_name)),
            (None, Some(_)) => return Err(missing(src, &k_name)),
        }
    }
    if let Some(s) = scalar(src, &format!("{prefix}.kv_scale"))? {
        return Ok(Some(KvScales { k: s, v: s }));
    }
    if required {
        return Err(CoreError::load(format!(
            "{}: tensor '{prefix}.k_scale' is missing: quantization_config declares an FP8 KV cache, \
             so every layer needs its k_scale and v_scale",
            src.describe()
        )));
    }
    Ok(None)
}

fn missing(src: &dyn WeightSource, name: &str) -> CoreError {
    CoreError::load(format!(
        "{}: tensor '{name}' is missing (its layer has the other KV cache scale)",
        src.describe()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn declared(qc: Value) -> Result<Option<DType>> {
        declared_kv_dtype(&json!({ "quantization_config": qc }), "config.json")
    }

    #[test]
    fn declarations_of_both_formats_are_read() {
        let scheme = json!({"num_bits": 8, "type": "float", "strategy": "tensor",
                            "dynamic": false, "symmetric": true});
        assert_eq!(
            declared(json!({"quant_method": "compressed-tensors", "kv_cache_scheme": scheme}))
                .unwrap(),
            Some(DType::F8E4M3)
        );
        assert_eq!(
            declared(json!({"quant_method": "modelopt", "kv_cache_quant_algo": "FP8"})).unwrap(),
            Some(DType::F8E4M3)
        );
        for none in [
            json!({"quant_method": "modelopt", "kv_cache_quant_algo": null}),
            json!({"quant_method": "compressed-tensors", "kv_cache_scheme": null}),
            json!({"quant_method": "awq"}),
        ] {
            assert_eq!(declared(none).unwrap(), None);
        }
        assert_eq!(declared_kv_dtype(&json!({}), "c").unwrap(), None);
    }

    #[test]
    fn other_kv_schemes_are_refused_naming_the_key() {
        for (qc, key) in [
            (
                json!({"kv_cache_quant_algo": "NVFP4"}),
                "quantization_config.kv_cache_quant_algo",
            ),
            (
                json!({"kv_cache_scheme": {"num_bits": 8, "type": "int"}}),
                "quantization_config.kv_cache_scheme",
            ),
            (
                json!({"kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "head"}}),
                "quantization_config.kv_cache_scheme.strategy",
            ),
            (
                json!({"kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": true}}),
                "quantization_config.kv_cache_scheme.dynamic",
            ),
        ] {
            let e = declared(qc).unwrap_err().to_string();
            assert!(e.contains(key) && e.contains("config.json"), "{e}");
        }
    }
}
