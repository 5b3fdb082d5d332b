//! Seeded random weights for any decoder shape, for benchmarks.
//!
//! [`RandomWeights`] answers the same tensor names as a Hugging Face
//! checkpoint of a [`DecoderConfig`], with values drawn from a seeded RNG
//! (linear weights ~ N(0, 0.02²)-like uniform noise, norm weights near 1), so
//! a model of any size can be built without files. Each tensor depends only
//! on its name and the seed.

use crate::config::DecoderConfig;
use crate::decoder::ArchFlags;
use crate::mla::MlaConfig;
use crate::moe::{MoeConfig, MoeStyle};
use arbor_engine_core::{CoreError, DType, HostTensor, Result, SeqRng, WeightSource};
use std::borrow::Cow;
use std::collections::HashMap;

/// A weight source of random tensors shaped for one config.
pub struct RandomWeights {
    shapes: HashMap<String, (Vec<usize>, bool)>,
    dtype: DType,
    seed: u64,
}

impl RandomWeights {
    /// Tensors for `cfg`, stored as `dtype` (f32, f16 or bf16).
    pub fn new(cfg: &DecoderConfig, flags: ArchFlags, dtype: DType, seed: u64) -> Result<Self> {
        if !dtype.is_float() {
            return Err(CoreError::unsupported(format!("random weights in {dtype}")));
        }
        let (h, hd, i) = (cfg.hidden_size, cfg.head_dim, cfg.intermediate_size);
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let mut s: HashMap<String, (Vec<usize>, bool)> = HashMap::new();
        s.insert(
            "model.embed_tokens.weight".into(),
            (vec![cfg.vocab_size, h], false),
        );
        s.insert("model.norm.weight".into(), (vec![h], true));
        if !cfg.tie_word_embeddings {
            s.insert("lm_head.weight".into(), (vec![cfg.vocab_size, h], false));
        }
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let mut lin = |n: &str, o: usize, inp: usize, bias: bool| {
                s.insert(format!("{p}.{n}.weight"), (vec![o, inp], false));
                if bias {
                    s.insert(format!("{p}.{n}.bias"), (vec![o], false));
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
            s.insert(format!("{p}.input_layernorm.weight"), (vec![h], true));
            s.insert(
                format!("{p}.post_attention_layernorm.weight"),
                (vec![h], true),
            );
            if flags.qk_norm {
                s.insert(format!("{p}.self_attn.q_norm.weight"), (vec![hd], true));
                s.insert(format!("{p}.self_attn.k_norm.weight"), (vec![hd], true));
            }
        }
        Ok(Self {
            shapes: s,
            dtype,
            seed,
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
                self.shapes.insert(name, (shape, false));
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
                        (vec![1, h], false),
                    );
                }
                (_, Some(si)) => mlp(format!("{p}.{block}.shared_experts"), si),
                (_, None) => {}
            }
            if moe.style == MoeStyle::DeepSeekV3 {
                self.shapes.insert(
                    format!("{p}.{block}.gate.e_score_correction_bias"),
                    (vec![moe.num_experts], false),
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
            let mut put = |name: &str, shape: Vec<usize>, is_norm: bool| {
                self.shapes.insert(format!("{p}.{name}"), (shape, is_norm));
            };
            match mla.q_lora_rank {
                Some(r) => {
                    put("q_a_proj.weight", vec![r, h], false);
                    put("q_a_layernorm.weight", vec![r], true);
                    put("q_b_proj.weight", vec![heads * (nope + rope), r], false);
                }
                None => put("q_proj.weight", vec![heads * (nope + rope), h], false),
            }
            put("kv_a_proj_with_mqa.weight", vec![lora + rope, h], false);
            put("kv_a_layernorm.weight", vec![lora], true);
            put("kv_b_proj.weight", vec![heads * (nope + vd), lora], false);
            put("o_proj.weight", vec![h, heads * vd], false);
        }
        self
    }
}

impl RandomWeights {
    /// Every tensor's name and shape (a norm's or bias's is one-dimensional).
    pub fn shapes(&self) -> impl Iterator<Item = (&str, &[usize])> {
        self.shapes
            .iter()
            .map(|(n, (s, _))| (n.as_str(), s.as_slice()))
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
        format!("random {} weights (seed {})", self.dtype, self.seed)
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let Some((shape, is_norm)) = self.shapes.get(name) else {
            return Ok(None);
        };
        let n: usize = shape.iter().product();
        let mut rng = SeqRng::new(self.seed ^ name_hash(name));
        let values: Vec<f32> = (0..n)
            .map(|_| {
                let u = rng.next_f32() * 2.0 - 1.0;
                if *is_norm { 1.0 + 0.1 * u } else { 0.035 * u }
            })
            .collect();
        let t = HostTensor::from_f32(shape, &values);
        Ok(Some(HostTensor {
            data: Cow::Owned(t.cast(self.dtype)?.data.into_owned()),
            dtype: self.dtype,
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
