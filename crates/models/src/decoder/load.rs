//! Loading a decoder from a checkpoint: the embedding table, each layer's
//! attention (grouped-query or latent) and feed-forward (dense or routed
//! experts), the final norm, the LM head (the tied table, or this rank's
//! vocabulary rows) and the RoPE frequencies, then the [`ModelSpec`] the
//! engine sizes the KV cache from.
//!
//! Every tensor is checked against the shape the config implies, and the
//! progress count (`Loader`) covers every tensor named here, so the bar
//! reaches its end exactly when loading does.

use super::{ArchFlags, Attn, DecoderModel, Ffn, Layer, Linear, Mha, TpRank};
use crate::config::DecoderConfig;
use crate::kv_scales;
use crate::loader::Loader;
use crate::mla::MlaAttn;
use crate::moe::{MoeBlock, MoeConfig, MoeParallel};
use crate::shard::ShardedSource;
use arbor_engine_core::{
    CoreError, DType, KvScales, LoadOptions, ModelSpec, Result, Tensor, WeightSource,
};

impl Loader<'_> {
    fn linear(&mut self, name: &str, out: usize, inp: usize, bias: Bias) -> Result<Linear> {
        let (t, input_scale) = self.linear_weight(name, out, inp)?;
        self.static_input_scales += usize::from(input_scale.is_some());
        let w = self.upload(t)?;
        let bname = format!("{name}.bias");
        let b = match bias {
            Bias::Required => Some(self.vector_req(&bname, out)?),
            Bias::Optional => self.vector(&bname, out)?,
        };
        Ok(Linear { w, b, input_scale })
    }
}

/// Gives the layers that take one input (Q/K/V, gate/up) the largest of
/// their static input scales, as vLLM and SGLang do for the fused
/// projection they load them into (`input_scale.max()`): one rounding of
/// the input serves them all. Layers without one keep none.
pub(crate) fn share_input_scale(layers: &mut [&mut Linear]) {
    let max = layers.iter().filter_map(|l| l.input_scale).reduce(f32::max);
    for l in layers.iter_mut() {
        if l.input_scale.is_some() {
            l.input_scale = max;
        }
    }
}

/// Whether a projection's bias must be in the checkpoint or may be.
#[derive(Clone, Copy)]
enum Bias {
    Required,
    Optional,
}

impl Bias {
    fn required_if(required: bool) -> Self {
        if required {
            Bias::Required
        } else {
            Bias::Optional
        }
    }
}

/// What one layer's loading needs besides the loader: the config, the
/// architecture's flags, each projection's bias rule and the MoE settings.
struct LayerLoad<'a> {
    cfg: &'a DecoderConfig,
    moe: Option<&'a MoeConfig>,
    flags: ArchFlags,
    moe_parallel: Option<MoeParallel>,
    qkv_bias: Bias,
    o_bias: Bias,
    mlp_bias: Bias,
}

impl LayerLoad<'_> {
    /// Layer `i`: its norms, attention and feed-forward.
    fn layer(&self, l: &mut Loader, i: usize) -> Result<Layer> {
        let cfg = self.cfg;
        let (h, inter) = (cfg.hidden_size, cfg.intermediate_size);
        let p = format!("model.layers.{i}");
        Ok(Layer {
            input_norm: l.vector_req(&format!("{p}.input_layernorm.weight"), h)?,
            attn: match &cfg.mla {
                Some(m) => Attn::Mla(MlaAttn::load(l, cfg, m, i, cfg.num_attention_heads)?),
                None => Attn::Mha(self.mha(l, &p)?),
            },
            post_norm: l.vector_req(&format!("{p}.post_attention_layernorm.weight"), h)?,
            ffn: match self.moe {
                Some(m) if m.is_sparse(i) => {
                    Ffn::Moe(MoeBlock::load(l, m, i, h, self.moe_parallel.clone())?)
                }
                _ => {
                    let mut gate =
                        l.linear(&format!("{p}.mlp.gate_proj"), inter, h, self.mlp_bias)?;
                    let mut up = l.linear(&format!("{p}.mlp.up_proj"), inter, h, self.mlp_bias)?;
                    share_input_scale(&mut [&mut gate, &mut up]);
                    Ffn::Dense {
                        gate,
                        up,
                        down: l.linear(&format!("{p}.mlp.down_proj"), h, inter, self.mlp_bias)?,
                    }
                }
            },
        })
    }

    /// Grouped-query attention of the layer named `p`, with the
    /// checkpoint's KV cache scales when it declares an FP8 cache.
    fn mha(&self, l: &mut Loader, p: &str) -> Result<Mha> {
        let cfg = self.cfg;
        let h = cfg.hidden_size;
        let (nh, nkv, hd) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let qkv = self.qkv_bias;
        let mut q = l.linear(&format!("{p}.self_attn.q_proj"), nh * hd, h, qkv)?;
        let mut k = l.linear(&format!("{p}.self_attn.k_proj"), nkv * hd, h, qkv)?;
        let mut v = l.linear(&format!("{p}.self_attn.v_proj"), nkv * hd, h, qkv)?;
        share_input_scale(&mut [&mut q, &mut k, &mut v]);
        let o = l.linear(&format!("{p}.self_attn.o_proj"), h, nh * hd, self.o_bias)?;
        let mut norm = |name: &str| -> Result<Option<Tensor>> {
            if self.flags.qk_norm {
                Ok(Some(
                    l.vector_req(&format!("{p}.self_attn.{name}.weight"), hd)?,
                ))
            } else {
                Ok(None)
            }
        };
        let (q_norm, k_norm) = (norm("q_norm")?, norm("k_norm")?);
        Ok(Mha {
            q,
            k,
            v,
            o,
            q_norm,
            k_norm,
            kv_scales: kv_scales::layer_scales(
                l.src,
                &format!("{p}.self_attn"),
                cfg.kv_cache_dtype.is_some(),
            )?
            .unwrap_or(KvScales::ONE),
        })
    }
}

/// The tensors a model of `cfg` loads: the embedding table, the final norm
/// and the LM head, and each layer's attention and feed-forward tensors.
fn tensor_count(cfg: &DecoderConfig, moe: Option<&MoeConfig>, flags: ArchFlags) -> usize {
    let attn_tensors = match &cfg.mla {
        Some(m) => m.tensors_per_layer() + 2,
        None => 6 + if flags.qk_norm { 2 } else { 0 },
    };
    let layers = (0..cfg.num_hidden_layers)
        .map(|i| {
            attn_tensors
                + match moe {
                    Some(m) if m.is_sparse(i) => m.tensors_per_layer(),
                    _ => 3,
                }
        })
        .sum::<usize>();
    3 + layers
}

/// The RoPE inverse frequencies of `cfg`, divided by the per-frequency
/// factors that GGUF Llama 3 files carry as `rope_freqs.weight`.
fn rope_inv_freq(cfg: &DecoderConfig, src: &dyn WeightSource) -> Result<Vec<f32>> {
    let mut freqs = cfg.inv_freq();
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
    Ok(freqs)
}

/// The KV element type the checkpoint declares, whose scales the layers
/// loaded; latent attention caches one latent row per token and reads no
/// checkpoint KV scales.
fn checkpoint_kv_dtype(cfg: &DecoderConfig, src: &dyn WeightSource) -> Option<DType> {
    match (&cfg.mla, cfg.kv_cache_dtype) {
        (Some(_), Some(d)) => {
            tracing::warn!(
                "{}: the checkpoint declares a {d} KV cache; its scales are not used with latent attention",
                src.describe()
            );
            None
        }
        (_, d) => d,
    }
}

impl DecoderModel {
    /// Loads a model of `cfg` from `src` as rank `tp` of a tensor-parallel
    /// group (`None`: the whole model); `table`: whether the input embedding
    /// table loads (a model run from input embeddings reads it only when its
    /// LM head is that table).
    pub(super) fn load_inner(
        cfg: DecoderConfig,
        moe: Option<&MoeConfig>,
        flags: ArchFlags,
        src: &dyn WeightSource,
        opts: &LoadOptions,
        tp: Option<(TpRank, &ShardedSource<'_>)>,
        table: bool,
    ) -> Result<Self> {
        let (tp, shard) = match tp {
            Some((rank, shard)) => (Some(rank), Some(shard)),
            None => (None, None),
        };
        let h = cfg.hidden_size;
        if cfg.mla.is_none() && cfg.rope_scaling.attention_factor() != 1.0 {
            return Err(CoreError::unsupported(format!(
                "{}: YaRN with an attention factor of {} outside latent attention",
                src.describe(),
                cfg.rope_scaling.attention_factor()
            )));
        }
        let mut l = Loader::new(src, opts, tensor_count(&cfg, moe, flags)).with_shard(shard);
        let head_is_table = cfg.tie_word_embeddings || src.tensor("lm_head.weight")?.is_none();
        let embed = if table || head_is_table {
            Some(l.weight("model.embed_tokens.weight", &[cfg.vocab_size, h])?)
        } else {
            l.tick();
            None
        };
        let layer_load = LayerLoad {
            cfg: &cfg,
            moe,
            flags,
            moe_parallel: tp.as_ref().map(|t| MoeParallel {
                comm: t.comm.clone(),
                sharding: t.experts,
            }),
            qkv_bias: Bias::required_if(flags.qkv_bias || cfg.attention_bias),
            o_bias: Bias::required_if(cfg.attention_bias),
            mlp_bias: Bias::required_if(cfg.mlp_bias),
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| layer_load.layer(&mut l, i))
            .collect::<Result<Vec<_>>>()?;
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
        let freqs = rope_inv_freq(&cfg, src)?;
        let inv_freq = opts.backend.upload_f32(&[freqs.len()], &freqs)?;
        let table_dtype = embed.as_ref().map_or(lm_head.dtype(), Tensor::dtype);
        let weight_dtype = layers.first().map_or(table_dtype, |l| match &l.attn {
            Attn::Mha(m) => m.q.w.dtype(),
            Attn::Mla(m) => m.weight_dtype(),
        });
        // The KV cache's geometry: one latent "head" with latent attention.
        let (kv_heads, kv_dim) = match &cfg.mla {
            Some(m) => (1, m.kv_head_dim()),
            None => (cfg.num_key_value_heads, cfg.head_dim),
        };
        let spec = ModelSpec {
            architecture: cfg.architecture.clone(),
            num_layers: cfg.num_hidden_layers,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: kv_heads,
            head_dim: kv_dim,
            hidden_size: h,
            intermediate_size: cfg.intermediate_size,
            vocab_size: cfg.vocab_size,
            max_position_embeddings: cfg.max_position_embeddings,
            sliding_window: cfg.sliding_window,
            weight_dtype,
            weight_bytes: l.bytes,
            quantization: l.quantization_label(),
            checkpoint_kv_dtype: checkpoint_kv_dtype(&cfg, src),
            kv_values_in_keys: cfg.mla.is_some(),
            state: None,
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
}
