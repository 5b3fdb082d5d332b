//! Hybrid decoders: Qwen3.5 (dense and MoE, text and the text half of the
//! ConditionalGeneration checkpoints) and Qwen3-Next, which interleave Gated
//! DeltaNet recurrent layers ("linear_attention") with gated full-attention
//! layers ("full_attention") as `layer_types` says.
//!
//! A recurrent layer keeps a state slot per sequence
//! ([`arbor_engine_core::state`]), not KV pages: the model declares its
//! [`StateSpec`] in its [`ModelSpec`], the KV cache holds pages for the
//! attention layers only, and each forward reads the batch's slots from its
//! layout ([`arbor_engine_core::BatchLayout::state_slots`]).
//!
//! What differs from the Llama family: (1 + w) RMSNorms (the weights are
//! stored offset by one and loaded as `1 + w`), a doubled `q_proj` per head
//! (query, then a sigmoid gate on the attention output), per-head q/k norms,
//! partial rotary embeddings (`partial_rotary_factor`; Qwen3.5's interleaved
//! M-RoPE is plain RoPE for text, every axis having the same position), and
//! the recurrent layers' convolution, gated delta rule and gated RMSNorm.
//! Hidden states of any layer can be captured (`ForwardBatch::hidden_layers`,
//! for the NEXTN drafter). The checkpoint's MTP layer loads as a one-layer
//! model of this type ([`load_mtp_layer`]).
//! Not supported yet, refused with an error that names it: tensor
//! parallelism, LoRA adapters and early exit.

mod forward;
mod load;
mod mtp;
mod source;

pub use mtp::{MTP_LAYERS_KEY, hybrid_config, load_mtp_layer};

use crate::config::DecoderConfig;
use crate::decoder::Linear;
use crate::moe::{MoeBlock, MoeConfig, MoeStyle};
use arbor_engine_core::registry::ArchitectureEntry;
use arbor_engine_core::state::StateSpec;
use arbor_engine_core::{
    Backend, CoreError, ForwardBatch, ForwardContext, ForwardOutput, LoadOptions, Model,
    ModelArchitecture, ModelSpec, Result, Tensor, WeightSource, inventory,
};
use serde_json::Value;
use std::sync::Arc;

/// How a checkpoint of the architecture names and packs its tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HybridFlavor {
    /// Qwen3.5 text-only (`model.layers.*`, split projections).
    Qwen35Text,
    /// Qwen3.5 ConditionalGeneration (`model.language_model.*`, a vision
    /// tower under `model.visual.*` that text serving does not load).
    Qwen35Multimodal,
    /// Qwen3-Next (`model.layers.*`, fused `in_proj_qkvz` / `in_proj_ba`).
    Qwen3Next,
}

/// A layer's token mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`).
    Recurrent,
    /// Gated full attention (`full_attention`).
    Attention,
}

/// The parsed config of a hybrid model.
#[derive(Clone, Debug)]
pub struct HybridConfig {
    /// The attention layers' and the MLPs' shape (the Llama-family keys).
    pub base: DecoderConfig,
    /// Each layer's mixer.
    pub layer_types: Vec<LayerKind>,
    /// The recurrent state's shape.
    pub state: StateSpec,
    /// The routed experts, for the MoE variants.
    pub moe: Option<MoeConfig>,
}

impl HybridConfig {
    /// Parses `config.json` (the text config of a ConditionalGeneration
    /// checkpoint: its `text_config`, with the top-level `architectures`).
    pub fn from_json(v: &Value, flavor: HybridFlavor, sparse: bool) -> Result<Self> {
        let file = "config.json";
        let mut text = match (flavor, v.get("text_config")) {
            (HybridFlavor::Qwen35Multimodal, Some(t @ Value::Object(_))) => t.clone(),
            (HybridFlavor::Qwen35Multimodal, _) => {
                return Err(CoreError::load(format!(
                    "{file}: key 'text_config' is missing (a ConditionalGeneration checkpoint)"
                )));
            }
            _ => v.clone(),
        };
        let obj = text
            .as_object_mut()
            .ok_or_else(|| CoreError::load(format!("{file}: not a JSON object")))?;
        if let Some(a) = v.get("architectures") {
            obj.insert("architectures".into(), a.clone());
        }
        // Qwen3.5 keeps the rotary fraction among the rope parameters.
        let partial = v_f64(obj.get("rope_parameters"), "partial_rotary_factor")
            .or_else(|| obj.get("partial_rotary_factor").and_then(Value::as_f64))
            .unwrap_or(0.25);
        obj.insert("partial_rotary_factor".into(), partial.into());
        if sparse {
            // Qwen3.5-MoE always renormalizes its top-k; its config says nothing.
            obj.entry("norm_topk_prob").or_insert(Value::Bool(true));
            if !obj.contains_key("intermediate_size")
                && let Some(m) = obj.get("moe_intermediate_size").cloned()
            {
                obj.insert("intermediate_size".into(), m);
            }
        }
        let base = DecoderConfig::from_json(&text, file)?;
        let k = crate::config::Keys { v: &text, file };
        let layer_types = layer_types(&text, &k, base.num_hidden_layers)?;
        let recurrent = layer_types
            .iter()
            .filter(|t| **t == LayerKind::Recurrent)
            .count();
        let k_heads = k.usize_req("linear_num_key_heads")?;
        let v_heads = k.usize_req("linear_num_value_heads")?;
        let k_dim = k.usize_req("linear_key_head_dim")?;
        let v_dim = k.usize_req("linear_value_head_dim")?;
        let state = StateSpec {
            layers: recurrent,
            conv_channels: 2 * k_heads * k_dim + v_heads * v_dim,
            conv_kernel: k.usize_opt("linear_conv_kernel_dim")?.unwrap_or(4),
            k_heads,
            v_heads,
            k_dim,
            v_dim,
        };
        if recurrent == 0 || k_heads == 0 || !v_heads.is_multiple_of(k_heads) {
            return Err(k.err(
                "linear_num_value_heads",
                &format!(
                    "({v_heads}) must be a multiple of linear_num_key_heads ({k_heads}), \
                     with at least one linear_attention layer"
                ),
            ));
        }
        state.validate()?;
        let moe = if sparse {
            Some(MoeConfig::from_json(
                &text,
                file,
                MoeStyle::Qwen,
                base.num_hidden_layers,
            )?)
        } else {
            None
        };
        Ok(Self {
            base,
            layer_types,
            state,
            moe,
        })
    }
}

fn v_f64(v: Option<&Value>, key: &str) -> Option<f64> {
    v.and_then(|o| o.get(key)).and_then(Value::as_f64)
}

/// `layer_types`, or Qwen3.5's default: every `full_attention_interval`-th
/// layer attention (4 by default), the others recurrent.
fn layer_types(v: &Value, k: &crate::config::Keys<'_>, n: usize) -> Result<Vec<LayerKind>> {
    match v.get("layer_types") {
        Some(Value::Array(a)) => {
            if a.len() != n {
                return Err(k.err(
                    "layer_types",
                    &format!("has {} entries for {n} layers", a.len()),
                ));
            }
            a.iter()
                .map(|t| match t.as_str() {
                    Some("linear_attention") => Ok(LayerKind::Recurrent),
                    Some("full_attention") => Ok(LayerKind::Attention),
                    _ => Err(k.err(
                        "layer_types",
                        &format!(
                            "entry {t} is not a layer type this build knows \
                             (linear_attention, full_attention)"
                        ),
                    )),
                })
                .collect()
        }
        None | Some(Value::Null) => {
            let every = k.usize_opt("full_attention_interval")?.unwrap_or(4).max(1);
            Ok((0..n)
                .map(|i| {
                    if (i + 1) % every == 0 {
                        LayerKind::Attention
                    } else {
                        LayerKind::Recurrent
                    }
                })
                .collect())
        }
        Some(x) => Err(k.err("layer_types", &format!("must be a list, found {x}"))),
    }
}

/// A Gated DeltaNet layer.
struct RecurrentMixer {
    /// `[conv_channels, hidden]`: queries, keys and values before the convolution.
    qkv: Linear,
    /// `[v_heads * v_dim, hidden]`: the output gate.
    z: Linear,
    /// `[v_heads, hidden]`: the update strength.
    b: Linear,
    /// `[v_heads, hidden]`: the decay's input.
    a: Linear,
    /// `[conv_channels, conv_kernel]` f32.
    conv: Tensor,
    /// `[v_heads]` f32.
    a_log: Tensor,
    /// `[v_heads]` f32.
    dt_bias: Tensor,
    /// `[v_dim]` f32: the gated RMSNorm's weight (not offset).
    norm: Tensor,
    /// `[hidden, v_heads * v_dim]`.
    out: Linear,
    /// This layer's index among the recurrent layers (its state).
    state_index: usize,
}

/// A gated full-attention layer.
struct AttentionMixer {
    /// `[heads * 2 * head_dim, hidden]`: per head the query, then its gate.
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    /// (1 + w) norms over one head.
    q_norm: Tensor,
    k_norm: Tensor,
    /// This layer's index among the attention layers (its KV).
    kv_index: usize,
}

enum Mixer {
    Recurrent(RecurrentMixer),
    Attention(AttentionMixer),
}

enum Ffn {
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    Moe(MoeBlock),
}

struct Layer {
    /// (1 + w).
    input_norm: Tensor,
    mixer: Mixer,
    /// (1 + w).
    post_norm: Tensor,
    ffn: Ffn,
}

/// A loaded hybrid model.
pub struct HybridModel {
    spec: ModelSpec,
    cfg: HybridConfig,
    backend: Arc<dyn Backend>,
    /// `None` for a model that runs from input embeddings (an MTP layer).
    embed: Option<Tensor>,
    layers: Vec<Layer>,
    /// (1 + w).
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Tensor,
}

impl Model for HybridModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    fn forward(&self, batch: &ForwardBatch, ctx: &ForwardContext<'_>) -> Result<ForwardOutput> {
        self.run(batch, ctx)
    }
    fn input_embedding(&self) -> Option<Tensor> {
        self.embed.clone()
    }
    fn lm_head(&self) -> Option<Tensor> {
        Some(self.lm_head.clone())
    }
    fn final_norm(&self) -> Option<Tensor> {
        Some(self.norm.clone())
    }
    fn expert_load(&self) -> Vec<arbor_engine_core::moe::ExpertLoad> {
        crate::moe::expert_loads(self.layers.iter().map(|l| match &l.ffn {
            Ffn::Moe(m) => Some(m),
            Ffn::Dense { .. } => None,
        }))
    }
}

/// Builds a [`HybridModel`] for one registered architecture name.
pub struct HybridArchitecture {
    flavor: HybridFlavor,
    sparse: bool,
}

impl ModelArchitecture for HybridArchitecture {
    fn load(
        &self,
        config: &Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
    ) -> Result<Box<dyn Model>> {
        let cfg = HybridConfig::from_json(config, self.flavor, self.sparse)?;
        let st = cfg.state;
        let fused = source::FusedProjections {
            inner: weights,
            geometry: source::FusedGeometry {
                k_heads: st.k_heads,
                k_dim: st.k_dim,
                group: st.group(),
                v_dim: st.v_dim,
            },
        };
        let text = source::LanguageModelSource { inner: weights };
        let src: &dyn WeightSource = match self.flavor {
            HybridFlavor::Qwen35Text => weights,
            HybridFlavor::Qwen35Multimodal => &text,
            HybridFlavor::Qwen3Next => &fused,
        };
        Ok(Box::new(HybridModel::load(cfg, src, options)?))
    }

    fn load_shard(
        &self,
        _config: &Value,
        _weights: &dyn WeightSource,
        _options: &LoadOptions,
        _shard: &arbor_engine_core::ShardSpec,
    ) -> Result<Box<dyn Model>> {
        Err(CoreError::unsupported(
            "tensor parallelism for a hybrid model: splitting recurrent (Gated DeltaNet) layers \
             over ranks",
        ))
    }
}

/// The registered architectures: name, checkpoint flavor, and whether the
/// feed-forward is a mixture of experts.
const ARCHITECTURES: [(&str, HybridFlavor, bool); 5] = [
    ("Qwen3_5ForCausalLM", HybridFlavor::Qwen35Text, false),
    (
        "Qwen3_5ForConditionalGeneration",
        HybridFlavor::Qwen35Multimodal,
        false,
    ),
    ("Qwen3_5MoeForCausalLM", HybridFlavor::Qwen35Text, true),
    (
        "Qwen3_5MoeForConditionalGeneration",
        HybridFlavor::Qwen35Multimodal,
        true,
    ),
    ("Qwen3NextForCausalLM", HybridFlavor::Qwen3Next, true),
];

impl HybridArchitecture {
    /// The architecture registered as `name`, if it is a hybrid one.
    pub(crate) fn named(name: &str) -> Option<Self> {
        ARCHITECTURES
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|&(_, flavor, sparse)| Self { flavor, sparse })
    }

    /// Entry `i` of [`ARCHITECTURES`], for its registration.
    fn entry(i: usize) -> Box<dyn ModelArchitecture> {
        let (_, flavor, sparse) = ARCHITECTURES[i];
        Box::new(Self { flavor, sparse })
    }
}

inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3_5ForCausalLM",
        about: "Qwen3.5 text decoders (Gated DeltaNet recurrent layers with gated attention)",
        create: || HybridArchitecture::entry(0),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3_5ForConditionalGeneration",
        about: "Qwen3.5/3.6 checkpoints: the language model (vision not loaded)",
        create: || HybridArchitecture::entry(1),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3_5MoeForCausalLM",
        about: "Qwen3.5 mixture-of-experts text decoders (hybrid, routed and shared experts)",
        create: || HybridArchitecture::entry(2),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3_5MoeForConditionalGeneration",
        about: "Qwen3.5/3.6 mixture-of-experts checkpoints: the language model (vision not loaded)",
        create: || HybridArchitecture::entry(3),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3NextForCausalLM",
        about: "Qwen3-Next (hybrid, fused in_proj_qkvz/in_proj_ba, routed and shared experts)",
        create: || HybridArchitecture::entry(4),
    }
}
