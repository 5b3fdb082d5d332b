//! Seeded random weights for any decoder shape, for benchmarks.
//!
//! [`RandomWeights`] answers the same tensor names as a Hugging Face
//! checkpoint of a [`DecoderConfig`], with values drawn from a seeded RNG
//! (linear weights ~ N(0, 0.02²)-like uniform noise, norm weights near 1), so
//! a model of any size can be built without files. Each tensor depends only
//! on its name and the seed.
//!
//! [`RandomWeights::quantized`] stores the linear layers in a quantized
//! checkpoint format instead ([`RandomQuant`]: AutoAWQ INT4, ModelOpt
//! NVFP4), under that format's tensor names and with its
//! `quantization_config`, so the quantized kernels can be timed on any
//! shape; embeddings, the LM head, norms and MoE routers stay float, as in
//! the published checkpoints. The random codes and scales keep every weight
//! within about ±0.04, like the float weights.

use crate::config::DecoderConfig;
use crate::decoder::ArchFlags;
use crate::mla::MlaConfig;
use crate::moe::{MoeConfig, MoeStyle};
use arbor_engine_core::{CoreError, DType, HostTensor, Result, SeqRng, WeightSource};
use std::borrow::Cow;
use std::collections::HashMap;

/// How one random tensor is filled.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fill {
    /// A float weight: uniform in ±0.035, in the source's dtype.
    Weight,
    /// A norm weight: uniform in 1 ± 0.1, in the source's dtype.
    Norm,
    /// Random bytes of this dtype (packed 4-bit codes).
    Bits(DType),
    /// Every byte this value, in this dtype (AWQ zero points 8: `0x88`).
    Bytes(DType, u8),
    /// F16 values uniform in `v` ± 10%.
    F16Near(f32),
    /// E4M3 codes of values in [0.5, 2) (NVFP4 block scales).
    E4m3NearOne,
    /// One f32 value.
    F32(f32),
}

impl Fill {
    /// The dtype a tensor so filled has in a source of float `dtype`.
    fn dtype(self, float: DType) -> DType {
        match self {
            Fill::Weight | Fill::Norm => float,
            Fill::Bits(d) | Fill::Bytes(d, _) => d,
            Fill::F16Near(_) => DType::F16,
            Fill::E4m3NearOne => DType::F8E4M3,
            Fill::F32(_) => DType::F32,
        }
    }
}

/// A quantized checkpoint format for [`RandomWeights::quantized`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RandomQuant {
    /// AutoAWQ's GEMM layout: `qweight` I32 `[k, n/8]`, `qzeros` I32
    /// `[k/group, n/8]` (every zero point 8), `scales` F16 `[k/group, n]`.
    Awq {
        /// Inputs per scale and zero point.
        group: usize,
    },
    /// NVIDIA ModelOpt's NVFP4: `weight` U8 `[n, k/2]` (two E2M1 codes a
    /// byte), `weight_scale` E4M3 `[n, k/16]`, `weight_scale_2` and
    /// `input_scale` f32 scalars; the LM head excluded.
    Nvfp4,
}

impl RandomQuant {
    /// `awq` (group 128, the common export) or `nvfp4`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "awq" => Some(Self::Awq { group: 128 }),
            "nvfp4" => Some(Self::Nvfp4),
            _ => None,
        }
    }

    /// The `quantization_config` of a checkpoint in this format.
    pub fn config(self) -> serde_json::Value {
        match self {
            Self::Awq { group } => serde_json::json!({
                "quant_method": "awq", "bits": 4, "group_size": group,
                "zero_point": true, "version": "gemm"
            }),
            Self::Nvfp4 => serde_json::json!({
                "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                "exclude_modules": ["lm_head"]
            }),
        }
    }

    /// The tensors that replace the float linear weight `prefix.weight`
    /// (`[n, k]`), or an error naming it when its shape does not divide.
    fn tensors(self, prefix: &str, n: usize, k: usize) -> Result<Vec<(String, Vec<usize>, Fill)>> {
        let bad = |what: &str| {
            CoreError::invalid(format!(
                "random {self:?} weights: {prefix}.weight [{n}, {k}]: {what}"
            ))
        };
        let name = |suffix: &str| format!("{prefix}.{suffix}");
        Ok(match self {
            Self::Awq { group } => {
                if !n.is_multiple_of(8) || group == 0 || !k.is_multiple_of(group) {
                    return Err(bad(&format!(
                        "AWQ needs outputs in eights and inputs in groups of {group}"
                    )));
                }
                // (q - 8) · s with s ≈ 0.0047: within about ±0.04.
                vec![
                    (name("qweight"), vec![k, n / 8], Fill::Bits(DType::I32)),
                    (
                        name("qzeros"),
                        vec![k / group, n / 8],
                        Fill::Bytes(DType::I32, 0x88),
                    ),
                    (name("scales"), vec![k / group, n], Fill::F16Near(0.0047)),
                ]
            }
            Self::Nvfp4 => {
                if !k.is_multiple_of(16) {
                    return Err(bad("NVFP4 needs inputs in blocks of 16"));
                }
                // E2M1 (at most 6) · [0.5, 2) · 0.0035: within about ±0.04.
                vec![
                    (name("weight"), vec![n, k / 2], Fill::Bits(DType::U8)),
                    (name("weight_scale"), vec![n, k / 16], Fill::E4m3NearOne),
                    (name("weight_scale_2"), vec![], Fill::F32(0.0035)),
                    (name("input_scale"), vec![], Fill::F32(1.0)),
                ]
            }
        })
    }
}

/// A weight source of random tensors shaped for one config.
pub struct RandomWeights {
    shapes: HashMap<String, (Vec<usize>, Fill)>,
    dtype: DType,
    seed: u64,
    quant: Option<RandomQuant>,
}

impl RandomWeights {
    /// Tensors for `cfg`, stored as `dtype` (f32, f16 or bf16).
    pub fn new(cfg: &DecoderConfig, flags: ArchFlags, dtype: DType, seed: u64) -> Result<Self> {
        if !dtype.is_float() {
            return Err(CoreError::unsupported(format!("random weights in {dtype}")));
        }
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let mut s: HashMap<String, (Vec<usize>, Fill)> = HashMap::new();
        s.insert(
            "model.embed_tokens.weight".into(),
            (vec![cfg.vocab_size, h], Fill::Weight),
        );
        s.insert("model.norm.weight".into(), (vec![h], Fill::Norm));
        if !cfg.tie_word_embeddings {
            s.insert(
                "lm_head.weight".into(),
                (vec![cfg.vocab_size, h], Fill::Weight),
            );
        }
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut lin = |n: &str, o: usize, inp: usize, bias: bool| {
                s.insert(format!("{p}.{n}.weight"), (vec![o, inp], Fill::Weight));
                if bias {
                    s.insert(format!("{p}.{n}.bias"), (vec![o], Fill::Weight));
                }
            };
            let qkv_bias = flags.qkv_bias || cfg.attention_bias;
            lin("self_attn.q_proj", nh * hd, h, qkv_bias);
            lin("self_attn.k_proj", nkv * hd, h, qkv_bias);
            lin("self_attn.v_proj", nkv * hd, h, qkv_bias);
            lin("self_attn.o_proj", h, nh * hd, cfg.attention_bias);
            lin("mlp.gate_proj", i, h, cfg.mlp_bias);
            lin("mlp.up_proj", i, h, cfg.mlp_bias);
            lin("mlp.down_proj", h, i, cfg.mlp_bias);
            s.insert(format!("{p}.input_layernorm.weight"), (vec![h], Fill::Norm));
            s.insert(
                format!("{p}.post_attention_layernorm.weight"),
                (vec![h], Fill::Norm),
            );
            if flags.qk_norm {
                s.insert(
                    format!("{p}.self_attn.q_norm.weight"),
                    (vec![hd], Fill::Norm),
                );
                s.insert(
                    format!("{p}.self_attn.k_norm.weight"),
                    (vec![hd], Fill::Norm),
                );
            }
        }
        Ok(Self {
            shapes: s,
            dtype,
            seed,
            quant: None,
        })
    }

    /// The same, with the sparse layers of `moe` holding a router and
    /// experts (and a shared expert where `moe` has one) instead of the dense
    /// MLP, named as `moe.style` names them.
    pub fn with_moe(mut self, cfg: &DecoderConfig, moe: &MoeConfig) -> Self {
        let (h, ei) = (cfg.hidden_size, moe.expert_intermediate_size);
        for l in (0..cfg.num_hidden_layers).filter(|&l| moe.is_sparse(l)) {
            let p = format!("model.layers.{l}");
            for n in ["gate_proj", "up_proj", "down_proj"] {
                self.shapes.remove(&format!("{p}.mlp.{n}.weight"));
            }
            let (block, names) = match moe.style {
                MoeStyle::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
                _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
            };
            let mut put = |name: String, shape: Vec<usize>| {
                self.shapes.insert(name, (shape, Fill::Weight));
            };
            put(format!("{p}.{block}.gate.weight"), vec![moe.num_experts, h]);
            let mut mlp = |prefix: String, inter: usize| {
                put(format!("{prefix}.{}.weight", names[0]), vec![inter, h]);
                put(format!("{prefix}.{}.weight", names[1]), vec![inter, h]);
                put(format!("{prefix}.{}.weight", names[2]), vec![h, inter]);
            };
            for e in 0..moe.num_experts {
                mlp(format!("{p}.{block}.experts.{e}"), ei);
            }
            match (moe.style, moe.shared_expert_intermediate_size) {
                (MoeStyle::Qwen, Some(si)) => {
                    mlp(format!("{p}.{block}.shared_expert"), si);
                    self.shapes.insert(
                        format!("{p}.{block}.shared_expert_gate.weight"),
                        (vec![1, h], Fill::Weight),
                    );
                }
                (_, Some(si)) => mlp(format!("{p}.{block}.shared_experts"), si),
                (_, None) => {}
            }
            if moe.style == MoeStyle::DeepSeekV3 {
                self.shapes.insert(
                    format!("{p}.{block}.gate.e_score_correction_bias"),
                    (vec![moe.num_experts], Fill::Weight),
                );
            }
        }
        self
    }
}

impl RandomWeights {
    /// The same, with latent attention's tensors (`q_a_proj`,
    /// `q_a_layernorm` and `q_b_proj`, or `q_proj` without a query
    /// compression; `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`,
    /// `o_proj`) instead of Q/K/V/O, named as DeepSeek's checkpoints name
    /// them.
    pub fn with_mla(mut self, cfg: &DecoderConfig, mla: &MlaConfig) -> Self {
        let (h, heads) = (cfg.hidden_size, cfg.num_attention_heads);
        let (nope, rope, lora, vd) = (
            mla.qk_nope_head_dim,
            mla.qk_rope_head_dim,
            mla.kv_lora_rank,
            mla.v_head_dim,
        );
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}.self_attn");
            for n in ["q_proj", "k_proj", "v_proj", "o_proj"] {
                self.shapes.remove(&format!("{p}.{n}.weight"));
                self.shapes.remove(&format!("{p}.{n}.bias"));
            }
            let mut put = |name: &str, shape: Vec<usize>, fill: Fill| {
                self.shapes.insert(format!("{p}.{name}"), (shape, fill));
            };
            match mla.q_lora_rank {
                Some(r) => {
                    put("q_a_proj.weight", vec![r, h], Fill::Weight);
                    put("q_a_layernorm.weight", vec![r], Fill::Norm);
                    put(
                        "q_b_proj.weight",
                        vec![heads * (nope + rope), r],
                        Fill::Weight,
                    );
                }
                None => put(
                    "q_proj.weight",
                    vec![heads * (nope + rope), h],
                    Fill::Weight,
                ),
            }
            put(
                "kv_a_proj_with_mqa.weight",
                vec![lora + rope, h],
                Fill::Weight,
            );
            put("kv_a_layernorm.weight", vec![lora], Fill::Norm);
            put(
                "kv_b_proj.weight",
                vec![heads * (nope + vd), lora],
                Fill::Weight,
            );
            put("o_proj.weight", vec![h, heads * vd], Fill::Weight);
        }
        self
    }
}

impl RandomWeights {
    /// Every tensor's name, shape (a norm's or bias's is one-dimensional, a
    /// scalar scale's empty) and dtype.
    pub fn tensors(&self) -> impl Iterator<Item = (&str, &[usize], DType)> {
        self.shapes
            .iter()
            .map(|(n, (s, f))| (n.as_str(), s.as_slice(), f.dtype(self.dtype)))
    }

    /// The same with every linear layer but the LM head (and MoE routers)
    /// stored in the checkpoint format `q`; errors name a layer whose shape
    /// the format cannot hold. Add [`RandomWeights::quantization_config`]
    /// to the model's config.
    pub fn quantized(mut self, q: RandomQuant) -> Result<Self> {
        let linears: Vec<(String, usize, usize)> = self
            .shapes
            .iter()
            .filter_map(|(name, (shape, fill))| {
                let prefix = name.strip_suffix(".weight")?;
                let float_matrix = *fill == Fill::Weight && shape.len() == 2;
                let router = prefix.ends_with(".gate") || prefix.ends_with("_gate");
                let kept = prefix == "lm_head" || prefix == "model.embed_tokens" || router;
                (float_matrix && !kept).then(|| (prefix.to_string(), shape[0], shape[1]))
            })
            .collect();
        for (prefix, n, k) in linears {
            let parts = q.tensors(&prefix, n, k)?;
            self.shapes.remove(&format!("{prefix}.weight"));
            for (name, shape, fill) in parts {
                self.shapes.insert(name, (shape, fill));
            }
        }
        self.quant = Some(q);
        Ok(self)
    }

    /// The `quantization_config` of [`RandomWeights::quantized`]'s format.
    pub fn quantization_config(&self) -> Option<serde_json::Value> {
        self.quant.map(RandomQuant::config)
    }
}

fn name_hash(name: &str) -> u64 {
    // FNV-1a: stable across runs and platforms.
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl WeightSource for RandomWeights {
    fn describe(&self) -> String {
        match self.quant {
            None => format!("random {} weights (seed {})", self.dtype, self.seed),
            Some(q) => format!("random {q:?} weights (seed {})", self.seed),
        }
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let Some((shape, fill)) = self.shapes.get(name) else {
            return Ok(None);
        };
        let n: usize = shape.iter().product();
        let mut rng = SeqRng::new(self.seed ^ name_hash(name));
        let mut uniform = || rng.next_f32() * 2.0 - 1.0;
        let (dtype, data) = match *fill {
            Fill::Weight | Fill::Norm => {
                let (base, spread) = if *fill == Fill::Norm {
                    (1.0, 0.1)
                } else {
                    (0.0, 0.035)
                };
                let values: Vec<f32> = (0..n).map(|_| base + spread * uniform()).collect();
                let t = HostTensor::from_f32(shape, &values).cast(self.dtype)?;
                (self.dtype, t.data.into_owned())
            }
            Fill::F16Near(v) => {
                let values: Vec<f32> = (0..n).map(|_| v * (1.0 + 0.1 * uniform())).collect();
                let t = HostTensor::from_f32(shape, &values).cast(DType::F16)?;
                (DType::F16, t.data.into_owned())
            }
            Fill::F32(v) => (DType::F32, v.to_le_bytes().repeat(n)),
            Fill::Bytes(d, b) => (d, vec![b; d.bytes_for(n)?]),
            Fill::Bits(d) => {
                let bytes = d.bytes_for(n)?;
                let mut data = Vec::with_capacity(bytes + 8);
                while data.len() < bytes {
                    data.extend_from_slice(&rng.next_u64().to_le_bytes());
                }
                data.truncate(bytes);
                (d, data)
            }
            // E4M3 0x30..=0x3f: exponent 2^-1 or 2^0, any mantissa.
            Fill::E4m3NearOne => (
                DType::F8E4M3,
                (0..n)
                    .map(|_| 0x30 | (rng.next_u64() & 0xf) as u8)
                    .collect(),
            ),
        };
        Ok(Some(HostTensor {
            data: Cow::Owned(data),
            dtype,
            shape: shape.clone(),
        }))
    }
}

/// A DeepSeek-V2 model of dense layers with DeepSeek's latent-attention
/// geometry (kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim and
/// v_head_dim 128: 576-wide latent heads) around the given sizes, for
/// benchmarks and for device tests at that width.
#[derive(Clone, Copy, Debug)]
pub struct LatentShape {
    pub hidden: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub vocab: usize,
    /// `None`: a plain `q_proj` (DeepSeek-V2-Lite); else DeepSeek-V3's compression.
    pub q_lora_rank: Option<usize>,
}

impl LatentShape {
    /// Its `config.json` (YaRN as DeepSeek-V2-Lite's; the MoE keys present,
    /// every layer dense).
    pub fn config(&self) -> serde_json::Value {
        serde_json::json!({
            "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": self.hidden,
            "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.heads,
            "vocab_size": self.vocab, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "tie_word_embeddings": false,
            "q_lora_rank": self.q_lora_rank, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "v_head_dim": 128,
            "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                             "mscale_all_dim": 0.707},
            "n_routed_experts": 64, "num_experts_per_tok": 6, "moe_intermediate_size": 1408,
            "n_shared_experts": 2, "first_k_dense_replace": self.layers, "moe_layer_freq": 1,
            "topk_method": "greedy", "n_group": 1, "topk_group": 1, "norm_topk_prob": false,
            "routed_scaling_factor": 1.0, "scoring_func": "softmax"
        })
    }

    /// Random weights of [`LatentShape::config`], stored as `dtype`.
    pub fn weights(&self, dtype: DType, seed: u64) -> Result<RandomWeights> {
        let config = self.config();
        let cfg = DecoderConfig::from_json(&config, "config.json")?;
        let mla = MlaConfig::from_json(&config, "config.json", false)?;
        Ok(
            RandomWeights::new(&cfg, crate::decoder::DEEPSEEK_V2, dtype, seed)?
                .with_mla(&cfg, &mla),
        )
    }
}
