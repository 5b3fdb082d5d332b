//! The Llama-family decoder: Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3
//! (per-head q/k RMSNorm), with optional tied embeddings and GQA, and their
//! sparse mixture-of-experts variants (Qwen2-MoE, Qwen3-MoE, Mixtral), whose
//! feed-forward is a [`MoeBlock`] in the sparse layers.
//!
//! One implementation serves the four architectures; an [`ArchFlags`] value
//! per registered name says what differs. The model owns its weights only;
//! the KV cache, batch layout and attention implementation come with each
//! forward call, with the batch's LoRA segments (applied after each of the
//! seven projections). Every tensor is checked against the shape the config implies
//! when loading, and errors name the tensor and the checkpoint.

mod forward;
mod load;

use crate::config::DecoderConfig;
use crate::dp_attention::feed_forward_over_ranks;
pub(crate) use crate::loader::Loader;
use crate::mla::{MlaAttn, MlaConfig};
use crate::moe::{MoeBlock, MoeConfig, MoeStyle};
use crate::shard::{ShardedSource, shard_config};
use arbor_engine_core::comm::Communicator;
use arbor_engine_core::moe::ExpertSharding;
use arbor_engine_core::registry::ArchitectureEntry;
use arbor_engine_core::{
    AttentionSharding, Backend, DType, ForwardBatch, ForwardContext, ForwardOutput, KvScales,
    LinearRef, LoadOptions, Model, ModelArchitecture, ModelSpec, Result, ShardSpec, Tensor,
    WeightSource, inventory,
};
pub(crate) use load::share_input_scale;
use std::sync::Arc;

/// What differs between the architectures this module implements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ArchFlags {
    /// q, k and v projections always carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Sparse MoE feed-forward blocks, named and routed this way.
    pub moe: Option<MoeStyle>,
    /// Multi-head latent attention (DeepSeek-V2/V3).
    pub mla: bool,
}

/// A linear layer's stored weight, its bias, and how its inputs are rounded.
pub(crate) struct Linear {
    pub(crate) w: Tensor,
    pub(crate) b: Option<Tensor>,
    /// The static scale of a W8A8 FP8 weight's inputs (see
    /// [`LinearRef::input_scale`]); shared by the layers of one input.
    pub(crate) input_scale: Option<f32>,
}

impl Linear {
    /// This layer applied to an input into `out`.
    pub(crate) fn to<'a>(&'a self, out: &'a Tensor) -> LinearRef<'a> {
        LinearRef {
            input_scale: self.input_scale,
            ..LinearRef::new(&self.w, self.b.as_ref(), out)
        }
    }
}

struct Layer {
    input_norm: Tensor,
    attn: Attn,
    post_norm: Tensor,
    ffn: Ffn,
}

/// A layer's attention.
enum Attn {
    /// Grouped-query attention over per-head K and V.
    Mha(Mha),
    /// Multi-head latent attention over a latent KV cache.
    Mla(MlaAttn),
}

struct Mha {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    /// The checkpoint's KV cache scales (one when it has none).
    kv_scales: KvScales,
}

/// A layer's feed-forward.
enum Ffn {
    /// SwiGLU MLP.
    Dense {
        gate: Linear,
        up: Linear,
        down: Linear,
    },
    /// Routed experts.
    Moe(MoeBlock),
}

/// This rank's place in a tensor-parallel group.
struct TpRank {
    comm: Arc<dyn Communicator>,
    /// How the ranks share the routed experts.
    experts: ExpertSharding,
    /// The LM head holds this rank's rows of the vocabulary; logits are gathered.
    vocab_parallel: bool,
    /// Data-parallel attention: the attention is whole and runs this rank's
    /// tokens only; each feed-forward runs on every rank's tokens.
    dp_attention: bool,
}

/// A loaded Llama-family decoder (or one tensor-parallel rank's shard of it).
pub struct DecoderModel {
    spec: ModelSpec,
    tp: Option<TpRank>,
    cfg: DecoderConfig,
    backend: Arc<dyn Backend>,
    /// The input embedding table; `None` for a model loaded to run from
    /// input embeddings only ([`DecoderArchitecture::load_from_embeds`]).
    embed: Option<Tensor>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Tensor,
}

impl DecoderModel {
    /// Loads a model of `cfg` from `src`.
    pub fn load(
        cfg: DecoderConfig,
        moe: Option<&MoeConfig>,
        flags: ArchFlags,
        src: &dyn WeightSource,
        opts: &LoadOptions,
    ) -> Result<Self> {
        Self::load_inner(cfg, moe, flags, src, opts, None, true)
    }

    /// Loads rank `shard.comm.rank()`'s shard of a model of `cfg` (the
    /// whole model's shape) from the whole checkpoint `src`.
    pub fn load_shard(
        cfg: DecoderConfig,
        moe: Option<&MoeConfig>,
        flags: ArchFlags,
        src: &dyn WeightSource,
        opts: &LoadOptions,
        shard: &ShardSpec,
    ) -> Result<Self> {
        let (rank, world) = (shard.comm.rank(), shard.comm.world_size());
        let partitioned = shard.experts.partitioned();
        let dp_attention = shard.attention == AttentionSharding::DataParallel;
        let (local, local_moe) = shard_config(&cfg, moe, world, partitioned, dp_attention)?;
        let vocab_parallel = !dp_attention && cfg.vocab_size.is_multiple_of(world);
        let sharded = ShardedSource::new(src, rank, world, vocab_parallel, partitioned)
            .with_whole_attention(dp_attention);
        let tp = TpRank {
            comm: shard.comm.clone(),
            experts: shard.experts,
            vocab_parallel,
            dp_attention,
        };
        Self::load_inner(
            local,
            local_moe.as_ref(),
            flags,
            &sharded,
            opts,
            Some((tp, &sharded)),
            true,
        )
    }

    fn linear(&self, x: &Tensor, l: &Linear, out: &Tensor) -> Result<()> {
        self.backend.linear_many(x, &[l.to(out)])
    }

    /// A forward whose residual stream enters layer 0 as `embeds` (`[tokens,
    /// hidden]` f32) instead of the embeddings of `batch.input_ids` (an MTP
    /// layer's combined embedding and state).
    pub fn forward_from_embeds(
        &self,
        batch: &ForwardBatch,
        embeds: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<ForwardOutput> {
        self.run(batch, ctx, Some(embeds))
    }

    /// A data-parallel-attention rank's forward of no tokens: it joins every
    /// layer's feed-forward over the other ranks' rows.
    fn idle_forward(&self, dp: &TpRank) -> Result<ForwardOutput> {
        let b = &*self.backend;
        let h = self.cfg.hidden_size;
        let none = b.alloc(DType::F32, &[0, h])?;
        for layer in &self.layers {
            feed_forward_over_ranks(b, &*dp.comm, &none, &none, |i, o| {
                self.whole_feed_forward(&layer.ffn, i, o)
            })?;
        }
        Ok(ForwardOutput {
            logits: b.alloc(DType::F32, &[0, self.cfg.vocab_size])?,
            hidden: Vec::new(),
        })
    }

    /// A layer's feed-forward of `x` into `out`, reduced over the ranks
    /// (the whole output on every rank).
    fn whole_feed_forward(&self, ffn: &Ffn, x: &Tensor, out: &Tensor) -> Result<()> {
        let b = &*self.backend;
        match ffn {
            Ffn::Dense { gate, up, down } => {
                let shape = [x.rows(), self.cfg.intermediate_size];
                let g = b.alloc(DType::F32, &shape)?;
                let u = b.alloc(DType::F32, &shape)?;
                b.linear_many(x, &[gate.to(&g), up.to(&u)])?;
                let act = b.alloc(DType::F32, &shape)?;
                b.silu_mul(&g, &u, &act)?;
                self.linear(&act, down, out)?;
                self.reduce(out)
            }
            Ffn::Moe(block) => block.forward(b, x, out),
        }
    }

    /// Sums a row-parallel output over the ranks (nothing on one device).
    fn reduce(&self, partial: &Tensor) -> Result<()> {
        match &self.tp {
            Some(t) => t.comm.all_reduce(partial),
            None => Ok(()),
        }
    }
}

impl Model for DecoderModel {
    fn spec(&self) -> &ModelSpec {
        &self.spec
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

    fn forward(&self, batch: &ForwardBatch, ctx: &ForwardContext<'_>) -> Result<ForwardOutput> {
        self.run(batch, ctx, None)
    }
}

/// Builds a [`DecoderModel`] for one registered architecture name.
pub struct DecoderArchitecture {
    flags: ArchFlags,
}

impl DecoderArchitecture {
    /// The architecture these flags describe.
    pub fn new(flags: ArchFlags) -> Self {
        Self { flags }
    }

    /// Loads a model of this architecture from a `config.json` value, as
    /// the concrete type.
    pub fn load_model(
        &self,
        config: &serde_json::Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
    ) -> Result<DecoderModel> {
        self.load_concrete(config, weights, options, true)
    }

    /// [`Self::load_model`] for a caller that runs the model from input
    /// embeddings only (an MTP layer): the embedding table is not loaded
    /// unless the LM head is that table.
    pub fn load_from_embeds(
        &self,
        config: &serde_json::Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
    ) -> Result<DecoderModel> {
        self.load_concrete(config, weights, options, false)
    }

    /// The whole model from `config`, with its embedding table when `table`.
    fn load_concrete(
        &self,
        config: &serde_json::Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
        table: bool,
    ) -> Result<DecoderModel> {
        let (cfg, moe) = self.config(config)?;
        DecoderModel::load_inner(cfg, moe.as_ref(), self.flags, weights, options, None, table)
    }

    /// The parsed `config.json`, with its MoE keys when the architecture has
    /// experts; with latent attention, its MLA keys and the rotary width as
    /// the head width RoPE reads.
    fn config(&self, config: &serde_json::Value) -> Result<(DecoderConfig, Option<MoeConfig>)> {
        let mut cfg = DecoderConfig::from_json(config, "config.json")?;
        if self.flags.mla {
            let v3 = self.flags.moe == Some(MoeStyle::DeepSeekV3);
            let mla = MlaConfig::from_json(config, "config.json", v3)?;
            cfg.head_dim = mla.qk_rope_head_dim;
            cfg.partial_rotary_factor = 1.0;
            cfg.mla = Some(mla);
        }
        let moe = match self.flags.moe {
            Some(style) => Some(MoeConfig::from_json(
                config,
                "config.json",
                style,
                cfg.num_hidden_layers,
            )?),
            None => None,
        };
        Ok((cfg, moe))
    }
}

impl ModelArchitecture for DecoderArchitecture {
    fn load(
        &self,
        config: &serde_json::Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
    ) -> Result<Box<dyn Model>> {
        Ok(Box::new(self.load_model(config, weights, options)?))
    }

    fn load_shard(
        &self,
        config: &serde_json::Value,
        weights: &dyn WeightSource,
        options: &LoadOptions,
        shard: &ShardSpec,
    ) -> Result<Box<dyn Model>> {
        let (cfg, moe) = self.config(config)?;
        Ok(Box::new(DecoderModel::load_shard(
            cfg,
            moe.as_ref(),
            self.flags,
            weights,
            options,
            shard,
        )?))
    }
}

/// DeepSeek-V2's flags.
pub const DEEPSEEK_V2: ArchFlags = ArchFlags {
    qkv_bias: false,
    qk_norm: false,
    moe: Some(MoeStyle::DeepSeekV2),
    mla: true,
};

/// DeepSeek-V3's flags.
pub const DEEPSEEK_V3: ArchFlags = ArchFlags {
    qkv_bias: false,
    qk_norm: false,
    moe: Some(MoeStyle::DeepSeekV3),
    mla: true,
};

const PLAIN: ArchFlags = ArchFlags {
    qkv_bias: false,
    qk_norm: false,
    moe: None,
    mla: false,
};

inventory::submit! {
    ArchitectureEntry {
        name: "LlamaForCausalLM",
        about: "Llama 1-3 decoders (GQA, Llama-3 rope scaling, tied embeddings)",
        create: || Box::new(DecoderArchitecture { flags: PLAIN }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "MistralForCausalLM",
        about: "Mistral decoders (Llama with a sliding window)",
        create: || Box::new(DecoderArchitecture { flags: PLAIN }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen2ForCausalLM",
        about: "Qwen2/2.5 decoders (q/k/v bias)",
        create: || Box::new(DecoderArchitecture { flags: ArchFlags { qkv_bias: true, qk_norm: false, moe: None, mla: false } }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3ForCausalLM",
        about: "Qwen3 dense decoders (per-head q/k RMSNorm)",
        create: || Box::new(DecoderArchitecture { flags: ArchFlags { qkv_bias: false, qk_norm: true, moe: None, mla: false } }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen3MoeForCausalLM",
        about: "Qwen3 mixture-of-experts decoders (q/k RMSNorm, softmax top-k routing)",
        create: || Box::new(DecoderArchitecture { flags: ArchFlags { qkv_bias: false, qk_norm: true, moe: Some(MoeStyle::Qwen), mla: false } }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "Qwen2MoeForCausalLM",
        about: "Qwen2/1.5 mixture-of-experts decoders (q/k/v bias, a sigmoid-gated shared expert)",
        create: || Box::new(DecoderArchitecture { flags: ArchFlags { qkv_bias: true, qk_norm: false, moe: Some(MoeStyle::Qwen), mla: false } }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "MixtralForCausalLM",
        about: "Mixtral mixture-of-experts decoders (Mistral attention, renormalized top-k routing)",
        create: || Box::new(DecoderArchitecture { flags: ArchFlags { qkv_bias: false, qk_norm: false, moe: Some(MoeStyle::Mixtral), mla: false } }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "DeepseekV2ForCausalLM",
        about: "DeepSeek-V2 (latent attention over a latent KV cache, group-limited softmax experts, shared experts)",
        create: || Box::new(DecoderArchitecture { flags: DEEPSEEK_V2 }),
    }
}
inventory::submit! {
    ArchitectureEntry {
        name: "DeepseekV3ForCausalLM",
        about: "DeepSeek-V3 (latent attention, sigmoid experts with bias-corrected group-limited routing)",
        create: || Box::new(DecoderArchitecture { flags: DEEPSEEK_V3 }),
    }
}
