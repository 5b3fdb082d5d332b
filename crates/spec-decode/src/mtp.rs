//! The MTP / NEXTN draft head (SGLang's `--speculative-algorithm NEXTN`):
//! the next-n prediction layer shipped in the target's own checkpoint
//! (DeepSeek-V3 layout, `num_nextn_predict_layers` in its `config.json`).
//!
//! This module owns [`MtpHead`]: loading the layer from the target's folder
//! and running one draft forward. Scheduling, acceptance and where its KV
//! pages come from belong to [`HeadDrafter`](crate::HeadDrafter).
//!
//! The layer's tensors live at `model.layers.{L}.` with `L` the target's
//! `num_hidden_layers`: `enorm`, `hnorm`, `eh_proj` (`[h, 2h]`), one Llama
//! decoder layer (`input_layernorm`, `self_attn.{q,k,v,o}_proj`,
//! `post_attention_layernorm`, `mlp.{gate,up,down}_proj`; rope, eps and
//! geometry from the target's config) and `shared_head.norm`;
//! `shared_head.head` and `embed_tokens` are optional and default to the
//! target's `lm_head.weight` (its embedding when tied) and
//! `model.embed_tokens.weight` from the same checkpoint. A forward at
//! position `p` takes the token at `p + 1` and a state of position `p`
//! (the target's final hidden state after its final norm, or the head's
//! previous output state), as vLLM's `DeepSeekMultiTokenPredictorLayer`:
//!
//! ```text
//! e = embed(id), zeroed where p == 0      (vLLM masks position 0; SGLang does not)
//! x = eh_proj([enorm(e), hnorm(h)])       state = layer(x) (pre-norm residual output)
//! logits = shared_head.head(shared_head.norm(state))      over the full vocabulary
//! ```
//!
//! With several next-n layers only the first (`L`) is used, for every step
//! (as SGLang, which supports one).
//!
//! For a DeepSeek-V2/V3 target the layer is a DeepSeek decoder layer
//! (latent attention, routed and shared experts, with the target's MLA and
//! MoE config): it runs as a one-layer `DecoderModel` over the checkpoint
//! with `model.layers.0.*` read from `model.layers.{L}.*`, its final norm
//! `shared_head.norm` and its LM head `shared_head.head` (else the
//! target's), fed `x` as its input embeddings; its KV cache is one latent
//! layer. That model reads no embedding table of its own (it runs from
//! `x`); `embed` above is the head's one table (the layer's `embed_tokens`,
//! else the target's).
//!
//! For a Qwen3.5 / Qwen3-Next target (a hybrid model; SGLang's
//! `Qwen3_5ForCausalLMMTP`) the layer lives at `mtp.*` and the config key is
//! `mtp_num_hidden_layers` (in `text_config` for the ConditionalGeneration
//! checkpoints): `mtp.pre_fc_norm_embedding` and `mtp.pre_fc_norm_hidden`
//! ((1 + w) norms) stand for `enorm` and `hnorm`, `mtp.fc` for `eh_proj`
//! (the same `[embedding, state]` column order), position 0 is not masked
//! (as SGLang), and the block is a one-layer gated-attention hybrid model
//! (`mtp.layers.0.*`, final norm `mtp.norm`, the target's LM head) whose
//! output state is its final normed state, fed to the next draft step.
//!
//! The decoder-layer pieces, config reading and the checks it shares with
//! the EAGLE heads live in `head_common`.
//!
//! Invariants established by [`MtpHead::load`]: `num_nextn_predict_layers`
//! is at least 1; the config's geometry is the target's; every tensor has
//! the shape that geometry implies (errors name the tensor and the folder);
//! `eh_proj` is split into its embedding and state column halves (there is
//! no concat op, so `x = W_e · enorm(e) + W_h · hnorm(h)`). A forward uses
//! only [`Backend`] operations and the caller's attention over layer 0 of a
//! KV cache of [`MtpHead::kv_spec`], so it runs on every backend; its state
//! width is the target's hidden size, so target states and its own states
//! are fed the same way.

use crate::head::{DraftHead, HeadOutput};
use crate::head_common::{
    Attention, Mlp, SplitLinear, Weights, cfg_err, check_batch, check_hidden, check_kv,
    check_plain_llama, kv_spec, lm_logits, read_config, same_id, select_rows, upload_inv_freq,
    upload_weight,
};
use arbor_engine_core::{
    Backend, CoreError, DType, ForwardBatch, ForwardContext, HostTensor, KvSpec, LoadOptions,
    ModelSpec, Result, Tensor, WeightSource,
};
use arbor_models::DecoderConfig;
use arbor_models::decoder::{DEEPSEEK_V2, DEEPSEEK_V3, DecoderArchitecture, DecoderModel};
use arbor_models::hybrid::{HybridConfig, HybridModel, MTP_LAYERS_KEY, hybrid_config};
use arbor_models::quant_methods::FloatWeights;
use arbor_models::safetensors_source::SafetensorsSource;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The config key that gives the number of next-n prediction layers.
pub const NEXTN_LAYERS_KEY: &str = "num_nextn_predict_layers";

/// A loaded MTP (next-n prediction) layer.
pub struct MtpHead {
    cfg: DecoderConfig,
    /// Its layer index in the checkpoint (the target's layer count; 0 for
    /// a hybrid checkpoint's `mtp.layers.0`).
    layer: usize,
    /// Whether the embeddings at position 0 are zeroed (vLLM's DeepSeek MTP;
    /// not for the hybrid layer, as SGLang).
    mask_first_position: bool,
    /// The target's layer count: the index of its final normed state.
    target_num_layers: usize,
    backend: Arc<dyn Backend>,
    embed: Tensor,
    enorm: Tensor,
    hnorm: Tensor,
    eh_proj: SplitLinear,
    block: Block,
}

/// The decoder layer and shared head after `eh_proj`.
enum Block {
    /// A Llama decoder layer, `shared_head.norm` and the LM head.
    Llama {
        input_norm: Tensor,
        attn: Attention,
        post_norm: Tensor,
        mlp: Mlp,
        head_norm: Tensor,
        head: Tensor,
        inv_freq: Tensor,
    },
    /// A DeepSeek decoder layer as a one-layer model (see the module doc).
    Decoder(DecoderModel),
    /// A hybrid checkpoint's gated-attention MTP layer as a one-layer model.
    Hybrid(HybridModel),
}

/// The checkpoint as the one-layer model of a DeepSeek MTP layer reads it.
struct LayerSource<'a> {
    st: &'a SafetensorsSource,
    layer: usize,
}

impl WeightSource for LayerSource<'_> {
    fn describe(&self) -> String {
        format!("{} (MTP layer {})", self.st.describe(), self.layer)
    }

    fn tensor(&self, name: &str) -> Result<Option<HostTensor<'_>>> {
        let own = |s: &str| format!("model.layers.{}.{s}", self.layer);
        let mapped = match name {
            "model.norm.weight" => own("shared_head.norm.weight"),
            "lm_head.weight" | "model.embed_tokens.weight" => {
                let local = if name == "lm_head.weight" {
                    own("shared_head.head.weight")
                } else {
                    own("embed_tokens.weight")
                };
                match self.st.tensor(&local)? {
                    Some(t) => return Ok(Some(t)),
                    None => name.to_string(),
                }
            }
            _ => match name.strip_prefix("model.layers.0.") {
                Some(rest) => own(rest),
                None => return Ok(None),
            },
        };
        self.st.tensor(&mapped)
    }
}

impl std::fmt::Debug for MtpHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MtpHead(layer {}, hidden {}, vocab {})",
            self.layer, self.cfg.hidden_size, self.cfg.vocab_size
        )
    }
}

/// The checkpoint's tensors, with errors that name the tensor and the folder.
struct Source<'a> {
    st: SafetensorsSource,
    dir: &'a Path,
    /// The config key that says the checkpoint has MTP layers.
    key: &'static str,
}

impl Source<'_> {
    fn err(&self, name: &str, what: impl std::fmt::Display) -> CoreError {
        CoreError::load(format!("{}: tensor '{name}' {what}", self.dir.display()))
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<Option<HostTensor<'_>>> {
        let Some(t) = self.st.tensor(name)? else {
            return Ok(None);
        };
        if t.shape != shape {
            return Err(self.err(name, format!("has shape {:?}, expected {shape:?}", t.shape)));
        }
        Ok(Some(t))
    }

    fn required(&self, name: &str, shape: &[usize]) -> Result<HostTensor<'_>> {
        self.get(name, shape)?.ok_or_else(|| {
            self.err(
                name,
                format!("is missing (the MTP layer needs it; {} is set)", self.key),
            )
        })
    }

    /// A zero-centred norm weight `w` as the `1 + w` it multiplies by (f32).
    fn offset_vector(&self, b: &dyn Backend, name: &str, len: usize) -> Result<Tensor> {
        let w = self.required(name, &[len])?;
        let v: Vec<f32> = w
            .to_f32_vec()
            .map_err(|e| self.err(name, e))?
            .iter()
            .map(|x| 1.0 + x)
            .collect();
        b.upload_f32(&[len], &v)
    }

    /// The first of `names` present (each of `shape`), uploaded as a weight.
    fn first_of(&self, b: &dyn Backend, names: &[&str], shape: &[usize]) -> Result<Option<Tensor>> {
        for name in names {
            if let Some(t) = self.get(name, shape)? {
                return upload_weight(b, &t, name).map(Some);
            }
        }
        Ok(None)
    }
}

impl Weights for Source<'_> {
    fn weight(&self, b: &dyn Backend, name: &str, shape: &[usize]) -> Result<Tensor> {
        upload_weight(b, &self.required(name, shape)?, name)
    }

    fn vector(&self, b: &dyn Backend, name: &str, len: usize) -> Result<Tensor> {
        let f = self
            .required(name, &[len])?
            .cast(DType::F32)
            .map_err(|e| self.err(name, e))?;
        b.upload(&f)
    }
}

impl MtpHead {
    /// Loads the first next-n layer of the checkpoint in `dir` (its
    /// `config.json` and safetensors, sharded with an index or one file),
    /// which must be `target`'s.
    pub fn load(dir: &Path, target: &ModelSpec, backend: Arc<dyn Backend>) -> Result<Self> {
        Self::load_sharing(dir, target, None, None, backend)
    }

    /// As [`load`](Self::load), but the target's own embedding and LM head
    /// (on the device) stand in for the layer's absent `embed_tokens` and
    /// `shared_head.head`, instead of second copies read from the checkpoint.
    pub fn load_sharing(
        dir: &Path,
        target: &ModelSpec,
        target_embed: Option<Tensor>,
        target_head: Option<Tensor>,
        backend: Arc<dyn Backend>,
    ) -> Result<Self> {
        let (v, file) = read_config(dir)?;
        if let Some(hybrid) = hybrid_config(&v)? {
            let tables = (target_embed, target_head);
            return Self::load_hybrid(dir, (&v, &file), hybrid, target, tables, backend);
        }
        let n_mtp = match v.get(NEXTN_LAYERS_KEY) {
            None | Some(Value::Null) => {
                return Err(cfg_err(
                    &file,
                    NEXTN_LAYERS_KEY,
                    "is absent: the checkpoint has no next-n prediction (MTP) layers for NEXTN",
                ));
            }
            Some(x) => x.as_u64().ok_or_else(|| {
                cfg_err(
                    &file,
                    NEXTN_LAYERS_KEY,
                    format!("must be a non-negative integer, found {x}"),
                )
            })?,
        };
        if n_mtp == 0 {
            return Err(cfg_err(
                &file,
                NEXTN_LAYERS_KEY,
                "is 0: the checkpoint has no next-n prediction (MTP) layers for NEXTN",
            ));
        }
        let cfg = DecoderConfig::from_json(&v, &file)?;
        let deepseek = match cfg.architecture.as_str() {
            "DeepseekV2ForCausalLM" => Some(DEEPSEEK_V2),
            "DeepseekV3ForCausalLM" => Some(DEEPSEEK_V3),
            _ => None,
        };
        Self::check_target(&cfg, target, &file, deepseek.is_none())?;
        if deepseek.is_none() {
            check_plain_llama(
                &v,
                &cfg,
                &file,
                "is true; MTP layers with attention or MLP biases are not supported",
                "is set; the MTP layer attends over the whole context",
            )?;
        }

        let src = Source {
            st: SafetensorsSource::open(dir)?,
            dir,
            key: NEXTN_LAYERS_KEY,
        };
        let b = &*backend;
        let c = &cfg;
        let (h, inter, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let layer = c.num_hidden_layers;
        let p = format!("model.layers.{layer}.");
        let name = |s: &str| format!("{p}{s}");

        let own_embed = name("embed_tokens.weight");
        let embed = match src.first_of(b, &[&own_embed], &[vocab, h])? {
            Some(t) => Some(t),
            None => target_embed.filter(|t| t.shape() == [vocab, h]),
        };
        let embed = match embed {
            Some(t) => Some(t),
            None => src.first_of(b, &["model.embed_tokens.weight"], &[vocab, h])?,
        }
        .ok_or_else(|| {
            src.err(
                "model.embed_tokens.weight",
                format!("is missing (and so is '{own_embed}')"),
            )
        })?;
        let own_head = name("shared_head.head.weight");
        let head = match src.first_of(b, &[&own_head], &[vocab, h])? {
            Some(t) => Some(t),
            None => target_head.filter(|t| t.shape() == [vocab, h]),
        };
        let head = match head {
            Some(t) => Some(t),
            None => src.first_of(b, &["lm_head.weight"], &[vocab, h])?,
        };
        let head = match head {
            Some(t) => t,
            None if c.tie_word_embeddings => embed.clone(),
            None => {
                return Err(src.err(
                    "lm_head.weight",
                    format!("is missing (and so is '{own_head}')"),
                ));
            }
        };
        let enorm = src.vector(b, &name("enorm.weight"), h)?;
        let hnorm = src.vector(b, &name("hnorm.weight"), h)?;
        let eh_name = name("eh_proj.weight");
        let eh_proj = SplitLinear::upload(b, &src.required(&eh_name, &[h, 2 * h])?, &eh_name, h)?;
        let block = match deepseek {
            Some(flags) => Block::Decoder(Self::load_decoder(&v, &src, layer, flags, &backend)?),
            None => Block::Llama {
                input_norm: src.vector(b, &name("input_layernorm.weight"), h)?,
                attn: Attention::load(&src, b, &name("self_attn"), c)?,
                post_norm: src.vector(b, &name("post_attention_layernorm.weight"), h)?,
                mlp: Mlp::load(&src, b, &name("mlp"), h, inter)?,
                head_norm: src.vector(b, &name("shared_head.norm.weight"), h)?,
                head,
                inv_freq: upload_inv_freq(b, c)?,
            },
        };
        Ok(Self {
            layer,
            mask_first_position: true,
            target_num_layers: target.num_layers,
            backend: backend.clone(),
            embed,
            enorm,
            hnorm,
            eh_proj,
            block,
            cfg,
        })
    }

    /// The MTP layer of a hybrid (Qwen3.5 / Qwen3-Next) checkpoint: see the
    /// module doc. `tables` are the target's embedding and LM head when
    /// shared.
    fn load_hybrid(
        dir: &Path,
        (v, file): (&Value, &str),
        hybrid: HybridConfig,
        target: &ModelSpec,
        tables: (Option<Tensor>, Option<Tensor>),
        backend: Arc<dyn Backend>,
    ) -> Result<Self> {
        let text = v.get("text_config").unwrap_or(v);
        let absent =
            "is absent: the checkpoint has no multi-token prediction (MTP) layers for NEXTN";
        let n_mtp = match text.get(MTP_LAYERS_KEY).or_else(|| v.get(MTP_LAYERS_KEY)) {
            None | Some(Value::Null) => return Err(cfg_err(file, MTP_LAYERS_KEY, absent)),
            Some(x) => x.as_u64().ok_or_else(|| {
                cfg_err(
                    file,
                    MTP_LAYERS_KEY,
                    format!("must be a non-negative integer, found {x}"),
                )
            })?,
        };
        if n_mtp == 0 {
            return Err(cfg_err(
                file,
                MTP_LAYERS_KEY,
                "is 0: the checkpoint has no MTP layers for NEXTN",
            ));
        }
        let cfg = hybrid.base.clone();
        Self::check_target(&cfg, target, file, true)?;
        let src = Source {
            st: SafetensorsSource::open(dir)?,
            dir,
            key: MTP_LAYERS_KEY,
        };
        let b = &*backend;
        let (h, vocab) = (cfg.hidden_size, cfg.vocab_size);
        let embed_names = [
            "model.language_model.embed_tokens.weight",
            "model.embed_tokens.weight",
        ];
        let embed = match tables.0.filter(|t| t.shape() == [vocab, h]) {
            Some(t) => t,
            None => src
                .first_of(b, &embed_names, &[vocab, h])?
                .ok_or_else(|| src.err("model.embed_tokens.weight", "is missing"))?,
        };
        let head = match tables.1.filter(|t| t.shape() == [vocab, h]) {
            Some(t) => t,
            None => match src.first_of(b, &["lm_head.weight"], &[vocab, h])? {
                Some(t) => t,
                None if cfg.tie_word_embeddings => embed.clone(),
                None => return Err(src.err("lm_head.weight", "is missing")),
            },
        };
        let enorm = src.offset_vector(b, "mtp.pre_fc_norm_embedding.weight", h)?;
        let hnorm = src.offset_vector(b, "mtp.pre_fc_norm_hidden.weight", h)?;
        let fc = "mtp.fc.weight";
        let eh_proj = SplitLinear::upload(b, &src.required(fc, &[h, 2 * h])?, fc, h)?;
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: Arc::new(FloatWeights::new("auto", None)),
            progress: None,
        };
        let model = arbor_models::hybrid::load_mtp_layer(&hybrid, &src.st, &opts, head)?;
        Ok(Self {
            layer: 0,
            mask_first_position: false,
            target_num_layers: target.num_layers,
            backend: backend.clone(),
            embed,
            enorm,
            hnorm,
            eh_proj,
            block: Block::Hybrid(model),
            cfg,
        })
    }

    /// The one-layer model of a DeepSeek MTP layer: the target's config with
    /// one layer (sparse when layer `layer` of the target would be).
    fn load_decoder(
        v: &Value,
        src: &Source<'_>,
        layer: usize,
        flags: arbor_models::decoder::ArchFlags,
        backend: &Arc<dyn Backend>,
    ) -> Result<DecoderModel> {
        let mut one = v.clone();
        let first_dense = v
            .get("first_k_dense_replace")
            .and_then(Value::as_u64)
            .unwrap_or(0) as usize;
        if let Some(o) = one.as_object_mut() {
            o.insert("num_hidden_layers".into(), 1.into());
            o.insert(
                "first_k_dense_replace".into(),
                usize::from(layer < first_dense).into(),
            );
        }
        let opts = LoadOptions {
            backend: backend.clone(),
            quant: Arc::new(FloatWeights::new("auto", None)),
            progress: None,
        };
        let ls = LayerSource { st: &src.st, layer };
        DecoderArchitecture::new(flags)
            .load_from_embeds(&one, &ls, &opts)
            // Name tensors as the checkpoint does, not as the one-layer model reads them.
            .map_err(|e| match e {
                CoreError::ModelLoad(m) => CoreError::ModelLoad(
                    m.replace("'model.layers.0.", &format!("'model.layers.{layer}.")),
                ),
                other => other,
            })
    }

    /// Checks that the checkpoint's config describes `target` (its attention
    /// geometry too with `heads`: latent attention's KV geometry is not the
    /// config's).
    fn check_target(c: &DecoderConfig, target: &ModelSpec, file: &str, heads: bool) -> Result<()> {
        let fields = [
            ("num_hidden_layers", c.num_hidden_layers, target.num_layers),
            ("hidden_size", c.hidden_size, target.hidden_size),
            ("vocab_size", c.vocab_size, target.vocab_size),
            (
                "num_attention_heads",
                c.num_attention_heads,
                target.num_heads,
            ),
            (
                "num_key_value_heads",
                c.num_key_value_heads,
                target.num_kv_heads,
            ),
            ("head_dim", c.head_dim, target.head_dim),
        ];
        let checked = if heads { &fields[..] } else { &fields[..3] };
        for &(key, ours, theirs) in checked {
            if ours != theirs {
                return Err(cfg_err(
                    file,
                    key,
                    format!(
                        "is {ours}, but the target's is {theirs}: NEXTN reads the MTP layers of the target's own checkpoint"
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The checkpoint layer index it runs (`model.layers.{L}`).
    pub fn layer(&self) -> usize {
        self.layer
    }

    /// The target's config, which the layer shares.
    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    /// The head's KV cache shape: one layer.
    pub fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec {
        let one_layer = |s: &ModelSpec| KvSpec {
            num_layers: 1,
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            page_size,
            num_pages,
            dtype,
            values_in_keys: s.kv_values_in_keys,
        };
        match &self.block {
            Block::Llama { .. } => kv_spec(&self.cfg, 1, page_size, num_pages, dtype),
            Block::Decoder(m) => one_layer(arbor_engine_core::Model::spec(m)),
            Block::Hybrid(m) => one_layer(arbor_engine_core::Model::spec(m)),
        }
    }

    /// One draft forward over `batch`'s new tokens with `hidden` f32 `[t,
    /// hidden]` (target final states or previous output states). K and V
    /// go into layer 0 of `ctx.kv`; logits (full vocabulary) and the output
    /// state come back at `batch.logits_rows`.
    pub fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<HeadOutput> {
        let c = &self.cfg;
        check_batch(batch, c.vocab_size, "MTP")?;
        let b = &*self.backend;
        let t = batch.input_ids.len();
        let h = c.hidden_size;
        check_hidden(hidden, t, h, "MTP")?;
        if let Block::Llama { .. } = &self.block {
            check_kv(ctx, c, 1, "MTP")?;
        }
        let ids = b.upload_u32(&[t], &batch.input_ids)?;
        let pos = b.upload_u32(&[t], &batch.positions)?;
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let eps = c.rms_norm_eps;

        // e = embed(ids) with the rows at position 0 zeroed (vLLM's
        // `inputs_embeds[positions == 0] = 0`): embed into the first t rows
        // of a zeroed [t + 1, h] and gather those rows from row t.
        let e = f32t(&[t, h])?;
        if self.mask_first_position && batch.positions.contains(&0) {
            let padded = f32t(&[t + 1, h])?;
            b.embedding(&self.embed, &ids, &padded.narrow(0, t)?)?;
            let rows: Vec<u32> = batch
                .positions
                .iter()
                .enumerate()
                .map(|(i, &p)| if p == 0 { t as u32 } else { i as u32 })
                .collect();
            b.gather_rows(&padded, &b.upload_u32(&[t], &rows)?, &e)?;
        } else {
            b.embedding(&self.embed, &ids, &e)?;
        }
        // x = eh_proj([enorm(e), hnorm(h)]) as two half linears (enorm(0) = 0).
        b.rms_norm(&e, &self.enorm, eps, &e)?;
        let hn = f32t(&[t, h])?;
        b.rms_norm(hidden, &self.hnorm, eps, &hn)?;
        let x = f32t(&[t, h])?;
        let x2 = f32t(&[t, h])?;
        b.linear(&e, &self.eh_proj.embed, None, &x)?;
        b.linear(&hn, &self.eh_proj.hidden, None, &x2)?;
        b.add_assign(&x, &x2)?;

        let (input_norm, attn, post_norm, mlp, head_norm, head, inv_freq) = match &self.block {
            Block::Llama {
                input_norm,
                attn,
                post_norm,
                mlp,
                head_norm,
                head,
                inv_freq,
            } => (input_norm, attn, post_norm, mlp, head_norm, head, inv_freq),
            // The layer's state is its final normed state (SGLang feeds
            // the MTP model's output, after `mtp.norm`, to the next step).
            Block::Hybrid(m) => {
                return layer_output(batch, 1, |b| m.forward_from_embeds(b, &x, ctx));
            }
            // The layer's state is the residual stream after its one layer.
            Block::Decoder(m) => {
                return layer_output(batch, 0, |b| m.forward_from_embeds(b, &x, ctx));
            }
        };
        // The decoder layer; `x` is the residual stream.
        let n = f32t(&[t, h])?;
        b.rms_norm(&x, input_norm, eps, &n)?;
        let proj = f32t(&[t, h])?;
        attn.forward(b, ctx, 0, c, inv_freq, &pos, &n, &proj)?;
        // x += attn; n = post_attention_layernorm(x).
        b.add_rms_norm(&x, &proj, post_norm, eps, &n)?;
        mlp.forward(b, &n, &proj)?;
        // state = x += mlp; n = shared_head.norm(state).
        b.add_rms_norm(&x, &proj, head_norm, eps, &n)?;

        let state = select_rows(b, x, &batch.logits_rows)?;
        let normed = select_rows(b, n, &batch.logits_rows)?;
        let logits = lm_logits(b, &normed, head, c.vocab_size)?;
        Ok(HeadOutput { logits, state })
    }
}

/// The output of one MTP layer's model run on `batch` (through `run`), with
/// the hidden state after layer index `state_layer` as the head's state.
fn layer_output(
    batch: &ForwardBatch,
    state_layer: usize,
    run: impl FnOnce(&ForwardBatch) -> Result<arbor_engine_core::model::ForwardOutput>,
) -> Result<HeadOutput> {
    let inner = ForwardBatch {
        hidden_layers: vec![state_layer],
        hidden_at_every_row: false,
        exit_after: None,
        ..batch.clone()
    };
    let mut out = run(&inner)?;
    let state = out
        .hidden
        .pop()
        .ok_or_else(|| CoreError::Internal("the MTP layer returned no state".into()))?;
    Ok(HeadOutput {
        logits: out.logits,
        state,
    })
}

impl DraftHead for MtpHead {
    fn name(&self) -> &'static str {
        "nextn"
    }
    fn hidden_size(&self) -> usize {
        self.cfg.hidden_size
    }
    fn target_layers(&self) -> Vec<usize> {
        // The target's final state after its final norm.
        vec![self.target_num_layers]
    }
    fn feature_width(&self) -> usize {
        self.cfg.hidden_size
    }
    fn max_position_embeddings(&self) -> usize {
        self.cfg.max_position_embeddings
    }
    fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec {
        MtpHead::kv_spec(self, page_size, num_pages, dtype)
    }
    fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<HeadOutput> {
        MtpHead::forward(self, batch, hidden, ctx)
    }
    fn target_id(&self, draft_id: u32) -> Result<u32> {
        same_id(draft_id, self.cfg.vocab_size)
    }
}
