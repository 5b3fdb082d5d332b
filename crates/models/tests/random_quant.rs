//! Random weights in quantized checkpoint formats (`RandomWeights::quantized`,
//! what benchmarks time the quantized kernels with) are valid checkpoints of
//! those formats: each loads through its format's method (chosen by the
//! `quantization_config` the source gives) into its packed device dtype, and
//! its last-position logits match those of a float model whose weights this
//! test dequantizes itself with the formats' published formulas (AutoAWQ:
//! `(q - z) · s`, nibbles packed in the order 0 2 4 6 1 3 5 7; ModelOpt
//! NVFP4: `e2m1 · e4m3(scale) · scale_2`, the low nibble first), within the
//! f32 products' tolerance. Shapes a format cannot hold are refused naming
//! the layer.

mod quant_common;

use anyhow::{Context, Result};
use arbor_backend_cpu::CpuBackend;
use arbor_engine_core::{
    Backend, DType, HostTensor, LoadOptions, Model, QuantInit, Registry, WeightSource,
};
use arbor_models::config::DecoderConfig;
use arbor_models::decoder::{ArchFlags, DecoderArchitecture};
use arbor_models::random::{RandomQuant, RandomWeights};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

const LLAMA: ArchFlags = ArchFlags {
    qkv_bias: false,
    qk_norm: false,
    moe: None,
    mla: false,
};

fn config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "vocab_size": 512, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false
    })
}

/// The float tensors of `src`, each linear dequantized by the test.
struct Dequantized(HashMap<String, HostTensor<'static>>);

impl WeightSource for Dequantized {
    fn describe(&self) -> String {
        "dequantized random weights".into()
    }
    fn tensor(&self, name: &str) -> arbor_engine_core::Result<Option<HostTensor<'_>>> {
        Ok(self.0.get(name).map(|t| HostTensor {
            dtype: t.dtype,
            shape: t.shape.clone(),
            data: Cow::Borrowed(&t.data),
        }))
    }
}

fn i32s(t: &HostTensor<'_>) -> Vec<u32> {
    t.data
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// E4M3 (bias 7, no infinities) as f32.
fn e4m3(b: u8) -> f32 {
    let (sign, exp, man) = (b >> 7, (b >> 3) & 0xf, b & 7);
    let v = if exp == 0 {
        man as f32 / 8.0 * 2f32.powi(-6)
    } else {
        (1.0 + man as f32 / 8.0) * 2f32.powi(exp as i32 - 7)
    };
    if sign == 1 { -v } else { v }
}

const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// The `[n, k]` values of the linear `prefix` of `src` in format `q`.
fn dequantize(src: &RandomWeights, q: RandomQuant, prefix: &str) -> Result<(Vec<f32>, usize)> {
    let get = |s: &str| {
        src.tensor(&format!("{prefix}.{s}"))?
            .with_context(|| format!("{prefix}.{s} is missing"))
    };
    match q {
        RandomQuant::Awq { group } => {
            let (qw, qz, sc) = (get("qweight")?, get("qzeros")?, get("scales")?);
            let (k, nw) = (qw.shape[0], qw.shape[1]);
            let n = nw * 8;
            let (words, zeros, scales) = (i32s(&qw), i32s(&qz), sc.to_f32_vec()?);
            // AutoAWQ packs outputs 0 2 4 6 1 3 5 7 into nibbles 0..8.
            const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
            let nibble = |w: u32, r: usize| {
                let pos = ORDER.iter().position(|&o| o == r % 8).unwrap_or(0);
                ((w >> (4 * pos)) & 0xf) as f32
            };
            let mut v = vec![0f32; n * k];
            for c in 0..k {
                for r in 0..n {
                    let g = c / group;
                    let q = nibble(words[c * nw + r / 8], r);
                    let z = nibble(zeros[g * nw + r / 8], r);
                    v[r * k + c] = (q - z) * scales[g * n + r];
                }
            }
            Ok((v, k))
        }
        RandomQuant::Nvfp4 => {
            let (w, s, s2) = (get("weight")?, get("weight_scale")?, get("weight_scale_2")?);
            let (n, k) = (w.shape[0], w.shape[1] * 2);
            let global = *s2.to_f32_vec()?.first().context("an empty scalar")?;
            let mut v = vec![0f32; n * k];
            for r in 0..n {
                for c in 0..k {
                    let byte = w.data[r * k / 2 + c / 2];
                    let code = if c % 2 == 0 { byte & 0xf } else { byte >> 4 };
                    let mag = E2M1[(code & 7) as usize];
                    let val = if code & 8 != 0 { -mag } else { mag };
                    v[r * k + c] = val * e4m3(s.data[r * (k / 16) + c / 16]) * global;
                }
            }
            Ok((v, k))
        }
    }
}

/// `src` with every quantized linear dequantized to f32, the rest as is.
fn dequantized(src: &RandomWeights, q: RandomQuant) -> Result<Dequantized> {
    let mut out = HashMap::new();
    let mut linears = Vec::new();
    for (name, _, _) in src.tensors() {
        let prefix = ["qweight", "weight_scale"]
            .iter()
            .find_map(|s| name.strip_suffix(&format!(".{s}")));
        match prefix {
            Some(p) => linears.push(p.to_string()),
            None => {
                if let Some(t) = src.tensor(name)? {
                    out.insert(name.to_string(), t.cast(t.dtype)?);
                }
            }
        }
    }
    for p in linears {
        let (v, k) = dequantize(src, q, &p)?;
        out.insert(
            format!("{p}.weight"),
            HostTensor::from_f32(&[v.len() / k, k], &v),
        );
    }
    Ok(Dequantized(out))
}

/// Last-position logits of a 40-token prompt through `src` loaded under
/// `method` (with `qc` as its checkpoint's `quantization_config`).
fn logits(
    src: &dyn WeightSource,
    method: &str,
    qc: Option<serde_json::Value>,
) -> Result<(Vec<f32>, Arc<dyn Model>)> {
    let registry = Registry::builtin()?;
    let backend: Arc<dyn Backend> = Arc::new(CpuBackend::new(2)?);
    let float = registry.quant_methods.get("f32")?(&Default::default())?;
    let quant = registry.quant_methods.get(method)?(&QuantInit {
        checkpoint: qc,
        base: Some(float),
    })?;
    let opts = LoadOptions {
        backend: backend.clone(),
        quant,
        progress: None,
    };
    let model: Arc<dyn Model> =
        Arc::from(DecoderArchitecture::new(LLAMA).load_model(&config(), src, &opts)?);
    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 512).collect();
    let mut got =
        quant_common::prompts_last_logits(model.clone(), &backend, DType::F32, &[tokens])?;
    Ok((got.swap_remove(0), model))
}

#[test]
fn random_quantized_weights_load_and_match_their_dequantized_values() -> Result<()> {
    let cfg = DecoderConfig::from_json(&config(), "config.json")?;
    for (q, method, dtype) in [
        (RandomQuant::Awq { group: 32 }, "awq", DType::U4_S32),
        (RandomQuant::Nvfp4, "modelopt", DType::F4_S16),
    ] {
        let src = RandomWeights::new(&cfg, LLAMA, DType::BF16, 11)?.quantized(q)?;
        let qc = src.quantization_config().context("a quantization_config")?;
        assert_eq!(qc["quant_method"], method);
        let stored: Vec<DType> = src
            .tensors()
            .filter(|(n, _, _)| n.starts_with("model.layers.0.mlp.up_proj."))
            .map(|(_, _, d)| d)
            .collect();
        assert!(
            !stored.contains(&DType::BF16),
            "{q:?}: up_proj left in float"
        );
        assert!(
            src.tensor("lm_head.weight")?.is_some(),
            "{q:?}: the LM head is float"
        );
        let (got, model) = logits(&src, method, Some(qc))?;
        assert_eq!(model.spec().weight_dtype, dtype, "{q:?}");
        assert_eq!(model.spec().quantization, method, "{q:?}");
        let float = dequantized(&src, q)?;
        let (want, _) = logits(&float, "f32", None)?;
        let max = want.iter().fold(0f32, |a, b| a.max(b.abs()));
        let err = quant_common::max_abs_diff(&got, &want);
        println!("{q:?}: max |logit| {max:.3}, max abs error {err:.2e}; {dtype}");
        assert!(max > 1e-3, "{q:?}: the logits are all zero");
        assert!(err <= 1e-4 * max, "{q:?}: error {err} against {max}");
    }
    Ok(())
}

#[test]
fn shapes_a_format_cannot_hold_are_refused_naming_the_layer() -> Result<()> {
    let mut json = config();
    json["intermediate_size"] = 200.into();
    let cfg = DecoderConfig::from_json(&json, "config.json")?;
    let e = RandomWeights::new(&cfg, LLAMA, DType::BF16, 1)?
        .quantized(RandomQuant::Awq { group: 128 })
        .err()
        .context("AWQ groups of 128 over 200 inputs")?;
    assert!(e.to_string().contains("down_proj"), "{e}");
    let e = RandomWeights::new(&cfg, LLAMA, DType::BF16, 1)?
        .quantized(RandomQuant::Nvfp4)
        .err()
        .context("NVFP4 blocks of 16 over 200 inputs")?;
    assert!(e.to_string().contains("down_proj"), "{e}");
    assert_eq!(
        RandomQuant::from_name("awq"),
        Some(RandomQuant::Awq { group: 128 })
    );
    assert_eq!(RandomQuant::from_name("int3"), None);
    Ok(())
}
