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

use crate::config::DecoderConfig;
use crate::dp_attention::feed_forward_over_ranks;
use crate::kv_scales;
pub(crate) use crate::loader::Loader;
use crate::mla::{MlaAttn, MlaConfig};
use crate::moe::{MoeBlock, MoeConfig, MoeParallel, MoeStyle};
use crate::shard::{ShardedSource, shard_config};
use arbor_engine_core::comm::Communicator;
use arbor_engine_core::moe::ExpertSharding;
use arbor_engine_core::registry::ArchitectureEntry;
use arbor_engine_core::{
    AttentionSharding, Backend, CoreError, DType, ForwardBatch, ForwardContext, ForwardOutput,
    KvScales, LinearRef, LinearSpec, LoadOptions, Model, ModelArchitecture, ModelSpec, Result,
    ShardSpec, Tensor, WeightSource, inventory,
};
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

struct Linear {
    w: Tensor,
    b: Option<Tensor>,
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

impl Loader<'_> {
    fn linear(&mut self, name: &str, out: usize, inp: usize, bias: Bias) -> Result<Linear> {
        let caps = self.opts.backend.capabilities().clone();
        let spec = LinearSpec {
            prefix: name,
            out_features: out,
            in_features: inp,
        };
        let t = self.opts.quant.load_linear(self.src, &spec, &caps)?;
        let w = self.upload(t)?;
        let bname = format!("{name}.bias");
        let b = match bias {
            Bias::Required => Some(self.vector_req(&bname, out)?),
            Bias::Optional => self.vector(&bname, out)?,
        };
        Ok(Linear { w, b })
    }
}

#[derive(Clone, Copy)]
enum Bias {
    Required,
    Optional,
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
            Some(tp),
            true,
        )
    }

    fn load_inner(
        cfg: DecoderConfig,
        moe: Option<&MoeConfig>,
        flags: ArchFlags,
        src: &dyn WeightSource,
        opts: &LoadOptions,
        tp: Option<TpRank>,
        table: bool,
    ) -> Result<Self> {
        let moe_parallel = tp.as_ref().map(|t| MoeParallel {
            comm: t.comm.clone(),
            sharding: t.experts,
        });
        let h = cfg.hidden_size;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let inter = cfg.intermediate_size;
        let attn_tensors = match &cfg.mla {
            Some(m) => m.tensors_per_layer() + 2,
            None => 6 + if flags.qk_norm { 2 } else { 0 },
        };
        if cfg.mla.is_none() && cfg.rope_scaling.attention_factor() != 1.0 {
            return Err(CoreError::unsupported(format!(
                "{}: YaRN with an attention factor of {} outside latent attention",
                src.describe(),
                cfg.rope_scaling.attention_factor()
            )));
        }
        let total = (0..cfg.num_hidden_layers)
            .map(|i| {
                attn_tensors
                    + match moe {
                        Some(m) if m.is_sparse(i) => m.tensors_per_layer(),
                        _ => 3,
                    }
            })
            .sum::<usize>();
        let mut l = Loader::new(src, opts, 3 + total);
        // A model run from input embeddings reads its table only when its
        // LM head is that table.
        let head_is_table = cfg.tie_word_embeddings || src.tensor("lm_head.weight")?.is_none();
        let embed = if table || head_is_table {
            Some(l.weight("model.embed_tokens.weight", &[cfg.vocab_size, h])?)
        } else {
            l.tick();
            None
        };
        let qkv_bias = if flags.qkv_bias || cfg.attention_bias {
            Bias::Required
        } else {
            Bias::Optional
        };
        let o_bias = if cfg.attention_bias {
            Bias::Required
        } else {
            Bias::Optional
        };
        let mlp_bias = if cfg.mlp_bias {
            Bias::Required
        } else {
            Bias::Optional
        };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Layer {
                input_norm: l.vector_req(&format!("{p}.input_layernorm.weight"), h)?,
                attn: match &cfg.mla {
                    Some(m) => Attn::Mla(MlaAttn::load(&mut l, &cfg, m, i, nh)?),
                    None => Attn::Mha(Mha {
                        q: l.linear(&format!("{p}.self_attn.q_proj"), nh * hd, h, qkv_bias)?,
                        k: l.linear(&format!("{p}.self_attn.k_proj"), nkv * hd, h, qkv_bias)?,
                        v: l.linear(&format!("{p}.self_attn.v_proj"), nkv * hd, h, qkv_bias)?,
                        o: l.linear(&format!("{p}.self_attn.o_proj"), h, nh * hd, o_bias)?,
                        q_norm: if flags.qk_norm {
                            Some(l.vector_req(&format!("{p}.self_attn.q_norm.weight"), hd)?)
                        } else {
                            None
                        },
                        k_norm: if flags.qk_norm {
                            Some(l.vector_req(&format!("{p}.self_attn.k_norm.weight"), hd)?)
                        } else {
                            None
                        },
                        kv_scales: kv_scales::layer_scales(
                            src,
                            &format!("{p}.self_attn"),
                            cfg.kv_cache_dtype.is_some(),
                        )?
                        .unwrap_or(KvScales::ONE),
                    }),
                },
                post_norm: l.vector_req(&format!("{p}.post_attention_layernorm.weight"), h)?,
                ffn: match moe {
                    Some(m) if m.is_sparse(i) => {
                        Ffn::Moe(MoeBlock::load(&mut l, m, i, h, moe_parallel.clone())?)
                    }
                    _ => Ffn::Dense {
                        gate: l.linear(&format!("{p}.mlp.gate_proj"), inter, h, mlp_bias)?,
                        up: l.linear(&format!("{p}.mlp.up_proj"), inter, h, mlp_bias)?,
                        down: l.linear(&format!("{p}.mlp.down_proj"), h, inter, mlp_bias)?,
                    },
                },
            });
        }
        let norm = l.vector_req("model.norm.weight", h)?;
        // A vocab-parallel rank's LM head holds its rows of the vocabulary.
        let (head_rows, head_start) = match &tp {
            Some(t) if t.vocab_parallel => {
                let per = cfg.vocab_size / t.comm.world_size();
                (per, t.comm.rank() * per)
            }
            _ => (cfg.vocab_size, 0),
        };
        let lm_head = match &embed {
            Some(e) if head_is_table => {
                if !cfg.tie_word_embeddings {
                    tracing::warn!("lm_head.weight is absent: using the tied input embeddings");
                }
                l.tick();
                e.narrow(head_start, head_rows)?
            }
            _ => l.linear("lm_head", head_rows, h, Bias::Optional)?.w,
        };
        let mut freqs = cfg.inv_freq();
        // GGUF Llama 3 files carry the scaling as per-frequency divisors.
        if let Some(f) = src.tensor("rope_freqs.weight")? {
            let factors = f.to_f32_vec()?;
            if factors.len() != freqs.len() {
                return Err(CoreError::load(format!(
                    "{}: rope_freqs has {} values for {} frequencies",
                    src.describe(),
                    factors.len(),
                    freqs.len()
                )));
            }
            for (x, d) in freqs.iter_mut().zip(factors) {
                *x /= d;
            }
        }
        let inv_freq = opts.backend.upload_f32(&[freqs.len()], &freqs)?;
        let table_dtype = embed.as_ref().map_or(lm_head.dtype(), Tensor::dtype);
        let weight_dtype = layers.first().map_or(table_dtype, |l| match &l.attn {
            Attn::Mha(m) => m.q.w.dtype(),
            Attn::Mla(_) => table_dtype,
        });
        // Latent attention caches one latent row per token; it reads no
        // checkpoint KV scales.
        let checkpoint_kv_dtype = match (&cfg.mla, cfg.kv_cache_dtype) {
            (Some(_), Some(d)) => {
                tracing::warn!(
                    "{}: the checkpoint declares a {d} KV cache; its scales are not used with latent attention",
                    src.describe()
                );
                None
            }
            (_, d) => d,
        };
        // The KV cache's geometry: one latent "head" with latent attention.
        let (kv_heads, kv_dim) = match &cfg.mla {
            Some(m) => (1, m.kv_head_dim()),
            None => (nkv, hd),
        };
        let spec = ModelSpec {
            architecture: cfg.architecture.clone(),
            num_layers: cfg.num_hidden_layers,
            num_heads: nh,
            num_kv_heads: kv_heads,
            head_dim: kv_dim,
            hidden_size: h,
            intermediate_size: inter,
            vocab_size: cfg.vocab_size,
            max_position_embeddings: cfg.max_position_embeddings,
            sliding_window: cfg.sliding_window,
            weight_dtype,
            weight_bytes: l.bytes,
            quantization: opts.quant.name().to_string(),
            checkpoint_kv_dtype,
            kv_values_in_keys: cfg.mla.is_some(),
        };
        Ok(Self {
            spec,
            tp,
            cfg,
            backend: opts.backend.clone(),
            embed,
            layers,
            norm,
            lm_head,
            inv_freq,
        })
    }

    fn linear(&self, x: &Tensor, l: &Linear, out: &Tensor) -> Result<()> {
        self.backend.linear(x, &l.w, l.b.as_ref(), out)
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
                b.linear_many(
                    x,
                    &[
                        LinearRef {
                            w: &gate.w,
                            bias: gate.b.as_ref(),
                            out: &g,
                        },
                        LinearRef {
                            w: &up.w,
                            bias: up.b.as_ref(),
                            out: &u,
                        },
                    ],
                )?;
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
        self.layers
            .iter()
            .enumerate()
            .filter_map(|(layer, l)| match &l.ffn {
                Ffn::Moe(m) => Some(arbor_engine_core::moe::ExpertLoad {
                    layer,
                    tokens: m.expert_load(),
                }),
                Ffn::Dense { .. } => None,
            })
            .collect()
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
