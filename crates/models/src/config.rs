//! Parsing of Hugging Face `config.json` for decoder-only transformers.
//!
//! Accepts the spellings of transformers 4.x (`rope_theta`, `rope_scaling`,
//! `torch_dtype`) and 5.x (`rope_parameters`, `dtype`). Every missing or
//! mistyped key is reported with its name and the file it came from.

use arbor_engine_core::{CoreError, DType, Result};
use serde_json::Value;

/// How rotary frequencies are scaled.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3's frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
    /// YaRN (DeepSeek-V2/V3, long-context Qwen): frequencies blended between
    /// interpolated and extrapolated by a ramp over `[beta_slow, beta_fast]`
    /// rotations, and an attention factor on q·k (transformers'
    /// `_compute_yarn_parameters`).
    Yarn {
        factor: f32,
        original_max_position_embeddings: f32,
        beta_fast: f32,
        beta_slow: f32,
        mscale: f32,
        mscale_all_dim: f32,
        /// Given explicitly (`attention_factor`), else derived.
        attention_factor: Option<f32>,
        truncate: bool,
    },
}

/// YaRN's `get_mscale`: `0.1·mscale·ln(scale) + 1` above a scale of 1.
pub fn yarn_mscale(scale: f32, mscale: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The factor RoPE's cos and sin are multiplied by (1 but for YaRN).
    pub fn attention_factor(&self) -> f32 {
        match self {
            RopeScaling::Yarn {
                factor,
                mscale,
                mscale_all_dim,
                attention_factor,
                ..
            } => attention_factor.unwrap_or_else(|| {
                if *mscale != 0.0 && *mscale_all_dim != 0.0 {
                    yarn_mscale(*factor, *mscale) / yarn_mscale(*factor, *mscale_all_dim)
                } else {
                    yarn_mscale(*factor, 1.0)
                }
            }),
            _ => 1.0,
        }
    }
}

/// The shape and options of a Llama-family decoder.
#[derive(Clone, Debug, PartialEq)]
pub struct DecoderConfig {
    /// The `architectures[0]` name.
    pub architecture: String,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Biases on q, k, v and o projections (Llama `attention_bias`).
    pub attention_bias: bool,
    /// Biases on the MLP projections (Llama `mlp_bias`).
    pub mlp_bias: bool,
    pub sliding_window: Option<usize>,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    /// Fraction of each head that is rotated.
    pub partial_rotary_factor: f32,
    /// Checkpoint dtype, when stated.
    pub dtype: Option<DType>,
    /// Multi-head latent attention (DeepSeek-V2/V3), set by those architectures.
    pub mla: Option<crate::mla::MlaConfig>,
    /// The KV cache type `quantization_config` declares per-layer scales
    /// for (FP8 E4M3), when it declares one ([`crate::kv_scales`]).
    pub kv_cache_dtype: Option<DType>,
}

/// Typed reads of a `config.json`'s keys; errors name the key and the file.
pub(crate) struct Keys<'a> {
    pub(crate) v: &'a Value,
    pub(crate) file: &'a str,
}

impl Keys<'_> {
    pub(crate) fn err(&self, key: &str, what: &str) -> CoreError {
        CoreError::load(format!("{}: key '{key}' {what}", self.file))
    }
    pub(crate) fn usize_opt(&self, key: &str) -> Result<Option<usize>> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.err(key, &format!("must be a non-negative integer, found {x}"))
            }),
        }
    }
    pub(crate) fn usize_req(&self, key: &str) -> Result<usize> {
        self.usize_opt(key)?
            .ok_or_else(|| self.err(key, "is missing"))
    }
    pub(crate) fn f32_opt(&self, key: &str) -> Result<Option<f32>> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .map(|n| Some(n as f32))
                .ok_or_else(|| self.err(key, &format!("must be a number, found {x}"))),
        }
    }
    pub(crate) fn bool_opt(&self, key: &str) -> Result<Option<bool>> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(key, &format!("must be true or false, found {x}"))),
        }
    }
}

fn rope_from(obj: &Value, keys: &Keys<'_>, prefix: &str) -> Result<RopeScaling> {
    let kind = obj
        .get("rope_type")
        .or_else(|| obj.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| -> Result<f32> {
        obj.get(k)
            .and_then(Value::as_f64)
            .map(|x| x as f32)
            .ok_or_else(|| keys.err(&format!("{prefix}.{k}"), "is missing or not a number"))
    };
    Ok(match kind {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: num("factor")?,
            low_freq_factor: num("low_freq_factor")?,
            high_freq_factor: num("high_freq_factor")?,
            original_max_position_embeddings: num("original_max_position_embeddings")?,
        },
        "yarn" => {
            let opt = |k: &str| obj.get(k).and_then(Value::as_f64).map(|x| x as f32);
            RopeScaling::Yarn {
                factor: num("factor")?,
                original_max_position_embeddings: num("original_max_position_embeddings")?,
                beta_fast: opt("beta_fast").filter(|&x| x != 0.0).unwrap_or(32.0),
                beta_slow: opt("beta_slow").filter(|&x| x != 0.0).unwrap_or(1.0),
                mscale: opt("mscale").unwrap_or(0.0),
                mscale_all_dim: opt("mscale_all_dim").unwrap_or(0.0),
                attention_factor: opt("attention_factor"),
                truncate: obj.get("truncate").and_then(Value::as_bool).unwrap_or(true),
            }
        }
        other => {
            return Err(keys.err(
                &format!("{prefix}.rope_type"),
                &format!("'{other}' is not supported (supported: default, linear, llama3, yarn)"),
            ));
        }
    })
}

impl DecoderConfig {
    /// Parses a `config.json` value; `file` names it in errors.
    pub fn from_json(v: &Value, file: &str) -> Result<Self> {
        if !v.is_object() {
            return Err(CoreError::load(format!("{file}: not a JSON object")));
        }
        let k = Keys { v, file };
        let architecture = v
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .ok_or_else(|| k.err("architectures", "is missing or empty"))?
            .to_string();
        let hidden_size = k.usize_req("hidden_size")?;
        let num_attention_heads = k.usize_req("num_attention_heads")?;
        if num_attention_heads == 0 || hidden_size == 0 {
            return Err(k.err("num_attention_heads", "and hidden_size must be positive"));
        }
        let num_key_value_heads = k
            .usize_opt("num_key_value_heads")?
            .unwrap_or(num_attention_heads);
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(k.err(
                "num_key_value_heads",
                &format!("({num_key_value_heads}) must divide num_attention_heads ({num_attention_heads})"),
            ));
        }
        let head_dim = k
            .usize_opt("head_dim")?
            .unwrap_or(hidden_size / num_attention_heads);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(k.err(
                "head_dim",
                &format!("({head_dim}) must be a positive even number"),
            ));
        }
        // Rope: 5.x `rope_parameters` holds theta and scaling; 4.x has them at top level.
        let (rope_theta, rope_scaling) = match v.get("rope_parameters") {
            Some(rp @ Value::Object(_)) => {
                let theta = rp
                    .get("rope_theta")
                    .and_then(Value::as_f64)
                    .map(|x| x as f32)
                    .or(k.f32_opt("rope_theta")?)
                    .unwrap_or(10000.0);
                (theta, rope_from(rp, &k, "rope_parameters")?)
            }
            _ => {
                let theta = k.f32_opt("rope_theta")?.unwrap_or(10000.0);
                let scaling = match v.get("rope_scaling") {
                    None | Some(Value::Null) => RopeScaling::None,
                    Some(rs @ Value::Object(_)) => rope_from(rs, &k, "rope_scaling")?,
                    Some(x) => {
                        return Err(k.err("rope_scaling", &format!("must be an object, found {x}")));
                    }
                };
                (theta, scaling)
            }
        };
        let dtype = match v.get("dtype").or_else(|| v.get("torch_dtype")) {
            Some(Value::String(s)) => Some(
                s.parse::<DType>()
                    .map_err(|_| k.err("torch_dtype", &format!("'{s}' is not a known dtype")))?,
            ),
            _ => None,
        };
        // Qwen2 configs carry a window that is off unless use_sliding_window is true.
        let sliding_window = if architecture.starts_with("Qwen")
            && !k.bool_opt("use_sliding_window")?.unwrap_or(false)
        {
            None
        } else {
            k.usize_opt("sliding_window")?
        };
        let intermediate_size = k.usize_req("intermediate_size")?;
        let num_hidden_layers = k.usize_req("num_hidden_layers")?;
        let vocab_size = k.usize_req("vocab_size")?;
        if intermediate_size == 0 || num_hidden_layers == 0 || vocab_size == 0 {
            return Err(k.err(
                "intermediate_size",
                "num_hidden_layers and vocab_size must be positive",
            ));
        }
        Ok(Self {
            architecture,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            vocab_size,
            rms_norm_eps: k.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
            max_position_embeddings: k.usize_opt("max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: k.bool_opt("tie_word_embeddings")?.unwrap_or(false),
            attention_bias: k.bool_opt("attention_bias")?.unwrap_or(false),
            mlp_bias: k.bool_opt("mlp_bias")?.unwrap_or(false),
            sliding_window,
            rope_theta,
            rope_scaling,
            partial_rotary_factor: k.f32_opt("partial_rotary_factor")?.unwrap_or(1.0),
            dtype,
            mla: None,
            kv_cache_dtype: crate::kv_scales::declared_kv_dtype(v, file)?,
        })
    }

    /// Rotated dimensions per head.
    pub fn rotary_dim(&self) -> usize {
        let d = (self.head_dim as f32 * self.partial_rotary_factor) as usize;
        d - d % 2
    }

    /// Rotary inverse frequencies (`rotary_dim / 2` values), computed in f32 as transformers does.
    pub fn inv_freq(&self) -> Vec<f32> {
        let dim = self.rotary_dim();
        let base = self.rope_theta;
        let mut f: Vec<f32> = (0..dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / dim as f32))
            .collect();
        match self.rope_scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => f.iter_mut().for_each(|x| *x /= factor),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wl = old / low_freq_factor;
                let high_wl = old / high_freq_factor;
                for x in f.iter_mut() {
                    let wl = 2.0 * std::f32::consts::PI / *x;
                    let scaled = if wl > low_wl { *x / factor } else { *x };
                    let medium = wl >= high_wl && wl <= low_wl;
                    *x = if medium {
                        let s = (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        (1.0 - s) * scaled / factor + s * scaled
                    } else {
                        scaled
                    };
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: old,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (d, pi) = (dim as f32, std::f32::consts::PI);
                let corr = |rot: f32| d * (old / (rot * 2.0 * pi)).ln() / (2.0 * base.ln());
                let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, high) = (low.max(0.0), high.min(d - 1.0));
                let high = if low == high { high + 0.001 } else { high };
                for (i, x) in f.iter_mut().enumerate() {
                    let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let extrapolation = 1.0 - ramp;
                    let interpolated = *x / factor;
                    *x = interpolated * (1.0 - extrapolation) + *x * extrapolation;
                }
            }
        }
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vocab_size": 100})
    }

    #[test]
    fn both_spellings() {
        let mut a = base();
        a["rope_theta"] = json!(500000.0);
        a["rope_scaling"] = json!({"rope_type": "linear", "factor": 2.0});
        a["torch_dtype"] = json!("bfloat16");
        let ca = DecoderConfig::from_json(&a, "config.json").unwrap();
        let mut b = base();
        b["rope_parameters"] =
            json!({"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0});
        b["dtype"] = json!("bfloat16");
        let cb = DecoderConfig::from_json(&b, "config.json").unwrap();
        assert_eq!(ca, cb);
        assert_eq!(ca.dtype, Some(DType::BF16));
        assert_eq!(ca.head_dim, 16);
    }

    #[test]
    fn errors_name_the_key() {
        let mut a = base();
        a["num_key_value_heads"] = json!(3);
        let e = DecoderConfig::from_json(&a, "x/config.json")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("x/config.json") && e.contains("num_key_value_heads"),
            "{e}"
        );
        let mut a = base();
        a["hidden_size"] = json!("big");
        let e = DecoderConfig::from_json(&a, "config.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_size"), "{e}");
        let mut a = base();
        a.as_object_mut().unwrap().remove("vocab_size");
        let e = DecoderConfig::from_json(&a, "config.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("vocab_size") && e.contains("missing"), "{e}");
        let mut a = base();
        a["rope_scaling"] = json!({"rope_type": "dynamo", "factor": 2.0});
        let e = DecoderConfig::from_json(&a, "config.json")
            .unwrap_err()
            .to_string();
        assert!(e.contains("dynamo"), "{e}");
    }

    #[test]
    fn llama3_scaling_changes_low_frequencies_only() {
        let mut a = base();
        a["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let c = DecoderConfig::from_json(&a, "config.json").unwrap();
        let mut plain = c.clone();
        plain.rope_scaling = RopeScaling::None;
        let (s, p) = (c.inv_freq(), plain.inv_freq());
        assert_eq!(s[0], p[0]);
        assert!((s[7] - p[7] / 8.0).abs() < 1e-9);
    }
}
