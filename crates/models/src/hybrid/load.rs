//! Loading a hybrid model: each layer's mixer (recurrent or attention) and
//! feed-forward, with every tensor checked against the shape the config
//! implies (errors name the tensor and the checkpoint); the (1 + w) norms
//! are stored as `1 + w` in f32.

use super::{
    AttentionMixer, Ffn, HybridConfig, HybridModel, Layer, LayerKind, Mixer, RecurrentMixer,
};
use crate::decoder::{Linear, share_input_scale};
use crate::loader::Loader;
use crate::moe::MoeBlock;
use arbor_engine_core::{DType, LoadOptions, ModelSpec, Result, Tensor, WeightSource};

impl Loader<'_> {
    /// A linear layer without bias, stored as the quantization method decides.
    fn plain_linear(&mut self, name: &str, out: usize, inp: usize) -> Result<Linear> {
        let (t, input_scale) = self.linear_weight(name, out, inp)?;
        self.static_input_scales += usize::from(input_scale.is_some());
        Ok(Linear {
            w: self.upload(t)?,
            b: None,
            input_scale,
        })
    }

    /// A zero-centred RMSNorm weight `w`, as the `1 + w` it multiplies by (f32).
    fn offset_norm(&mut self, name: &str, len: usize) -> Result<Tensor> {
        let w = self.vector_req(name, len)?;
        let v: Vec<f32> = self.download_f32(&w)?.iter().map(|x| 1.0 + x).collect();
        self.opts.backend.upload_f32(&[len], &v)
    }
}

/// Tensors one layer loads (for load progress).
fn layer_tensors(cfg: &HybridConfig, i: usize) -> usize {
    let mixer = match cfg.layer_types[i] {
        LayerKind::Recurrent => 9,
        LayerKind::Attention => 6,
    };
    let ffn = match &cfg.moe {
        Some(m) if m.is_sparse(i) => m.tensors_per_layer(),
        _ => 3,
    };
    2 + mixer + ffn
}

/// What [`HybridModel::assemble`] takes besides the layers.
struct Parts {
    embed: Option<Tensor>,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Tensor,
}

impl HybridModel {
    /// Loads a model of `cfg` from `src` (named as Qwen3.5's text model).
    pub(super) fn load(
        cfg: HybridConfig,
        src: &dyn WeightSource,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let c = &cfg.base;
        let h = c.hidden_size;
        let n = c.num_hidden_layers;
        let total = 3 + (0..n).map(|i| layer_tensors(&cfg, i)).sum::<usize>();
        let mut l = Loader::new(src, opts, total);
        let embed = l.weight("model.embed_tokens.weight", &[c.vocab_size, h])?;
        let layers = load_layers(&mut l, &cfg)?;
        let norm = l.offset_norm("model.norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings {
            l.tick();
            embed.clone()
        } else {
            l.plain_linear("lm_head", c.vocab_size, h)?.w
        };
        let parts = Parts {
            embed: Some(embed),
            layers,
            norm,
            lm_head,
        };
        Self::assemble(cfg, l, parts, opts)
    }

    /// Loads a one-layer model of `cfg` that runs from input embeddings
    /// (no embedding table), with `lm_head` shared from elsewhere.
    pub(super) fn load_from_embeds(
        cfg: HybridConfig,
        src: &dyn WeightSource,
        opts: &LoadOptions,
        lm_head: Tensor,
    ) -> Result<Self> {
        let n = cfg.base.num_hidden_layers;
        let total = 1 + (0..n).map(|i| layer_tensors(&cfg, i)).sum::<usize>();
        let mut l = Loader::new(src, opts, total);
        let layers = load_layers(&mut l, &cfg)?;
        let norm = l.offset_norm("model.norm.weight", cfg.base.hidden_size)?;
        let parts = Parts {
            embed: None,
            layers,
            norm,
            lm_head,
        };
        Self::assemble(cfg, l, parts, opts)
    }

    fn assemble(
        cfg: HybridConfig,
        l: Loader<'_>,
        parts: Parts,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let c = &cfg.base;
        let freqs = c.inv_freq();
        let inv_freq = opts.backend.upload_f32(&[freqs.len()], &freqs)?;
        let weight_dtype = parts
            .layers
            .iter()
            .find_map(|l| match &l.mixer {
                Mixer::Attention(a) => Some(a.q.w.dtype()),
                Mixer::Recurrent(_) => None,
            })
            .unwrap_or(DType::F32);
        let spec = ModelSpec {
            architecture: c.architecture.clone(),
            num_layers: c.num_hidden_layers,
            num_heads: c.num_attention_heads,
            num_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            max_position_embeddings: c.max_position_embeddings,
            sliding_window: None,
            weight_dtype,
            weight_bytes: l.bytes,
            quantization: l.quantization_label(),
            checkpoint_kv_dtype: c.kv_cache_dtype,
            kv_values_in_keys: false,
            state: (cfg.state.layers > 0).then_some(cfg.state),
        };
        Ok(Self {
            spec,
            cfg,
            backend: opts.backend.clone(),
            embed: parts.embed,
            layers: parts.layers,
            norm: parts.norm,
            lm_head: parts.lm_head,
            inv_freq,
        })
    }
}

/// Every layer of `cfg`, each mixer numbered among its kind (its state or KV).
fn load_layers(l: &mut Loader<'_>, cfg: &HybridConfig) -> Result<Vec<Layer>> {
    let h = cfg.base.hidden_size;
    let (mut recurrent, mut attention) = (0, 0);
    let mut layers = Vec::with_capacity(cfg.layer_types.len());
    for (i, kind) in cfg.layer_types.iter().enumerate() {
        let p = format!("model.layers.{i}");
        let mixer = match kind {
            LayerKind::Recurrent => {
                recurrent += 1;
                Mixer::Recurrent(recurrent_mixer(l, cfg, &p, recurrent - 1)?)
            }
            LayerKind::Attention => {
                attention += 1;
                Mixer::Attention(attention_mixer(l, cfg, &p, attention - 1)?)
            }
        };
        layers.push(Layer {
            input_norm: l.offset_norm(&format!("{p}.input_layernorm.weight"), h)?,
            mixer,
            post_norm: l.offset_norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            ffn: feed_forward(l, cfg, &p, i)?,
        });
    }
    Ok(layers)
}

fn recurrent_mixer(
    l: &mut Loader<'_>,
    cfg: &HybridConfig,
    p: &str,
    state_index: usize,
) -> Result<RecurrentMixer> {
    let (h, s) = (cfg.base.hidden_size, cfg.state);
    let value = s.v_heads * s.v_dim;
    let p = format!("{p}.linear_attn");
    let mut qkv = l.plain_linear(&format!("{p}.in_proj_qkv"), s.conv_channels, h)?;
    let mut z = l.plain_linear(&format!("{p}.in_proj_z"), value, h)?;
    let mut b = l.plain_linear(&format!("{p}.in_proj_b"), s.v_heads, h)?;
    let mut a = l.plain_linear(&format!("{p}.in_proj_a"), s.v_heads, h)?;
    share_input_scale(&mut [&mut qkv, &mut z, &mut b, &mut a]);
    let conv = l
        .f32_matrix(
            &format!("{p}.conv1d.weight"),
            &[s.conv_channels, 1, s.conv_kernel],
        )?
        .reshape(&[s.conv_channels, s.conv_kernel])?;
    Ok(RecurrentMixer {
        qkv,
        z,
        b,
        a,
        conv,
        a_log: l.vector_req(&format!("{p}.A_log"), s.v_heads)?,
        dt_bias: l.vector_req(&format!("{p}.dt_bias"), s.v_heads)?,
        norm: l.vector_req(&format!("{p}.norm.weight"), s.v_dim)?,
        out: l.plain_linear(&format!("{p}.out_proj"), h, value)?,
        state_index,
    })
}

fn attention_mixer(
    l: &mut Loader<'_>,
    cfg: &HybridConfig,
    p: &str,
    kv_index: usize,
) -> Result<AttentionMixer> {
    let c = &cfg.base;
    let (h, nh, nkv, hd) = (
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
    );
    let p = format!("{p}.self_attn");
    let mut q = l.plain_linear(&format!("{p}.q_proj"), 2 * nh * hd, h)?;
    let mut k = l.plain_linear(&format!("{p}.k_proj"), nkv * hd, h)?;
    let mut v = l.plain_linear(&format!("{p}.v_proj"), nkv * hd, h)?;
    share_input_scale(&mut [&mut q, &mut k, &mut v]);
    Ok(AttentionMixer {
        q,
        k,
        v,
        o: l.plain_linear(&format!("{p}.o_proj"), h, nh * hd)?,
        q_norm: l.offset_norm(&format!("{p}.q_norm.weight"), hd)?,
        k_norm: l.offset_norm(&format!("{p}.k_norm.weight"), hd)?,
        kv_index,
    })
}

fn feed_forward(l: &mut Loader<'_>, cfg: &HybridConfig, p: &str, i: usize) -> Result<Ffn> {
    let (h, inter) = (cfg.base.hidden_size, cfg.base.intermediate_size);
    match &cfg.moe {
        Some(m) if m.is_sparse(i) => Ok(Ffn::Moe(MoeBlock::load(l, m, i, h, None)?)),
        _ => {
            let mut gate = l.plain_linear(&format!("{p}.mlp.gate_proj"), inter, h)?;
            let mut up = l.plain_linear(&format!("{p}.mlp.up_proj"), inter, h)?;
            share_input_scale(&mut [&mut gate, &mut up]);
            Ok(Ffn::Dense {
                gate,
                up,
                down: l.plain_linear(&format!("{p}.mlp.down_proj"), h, inter)?,
            })
        }
    }
}
