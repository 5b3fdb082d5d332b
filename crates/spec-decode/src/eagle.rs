//! The EAGLE draft head (EAGLE-1 / EAGLE-2 checkpoints: SafeAILab/EAGLE
//! `cnets1.py`, SGLang `LlamaForCausalLMEagle`): loading its checkpoint and
//! running one draft forward.
//!
//! This module owns [`EagleConfig`] (the head's `config.json`, checked
//! against the target it drafts for) and [`EagleHead`] (its weights on a
//! [`Backend`], plus the target's embedding and LM head it shares).
//! Scheduling, acceptance and where the head's KV pages come from belong to
//! the caller ([`HeadDrafter`](crate::HeadDrafter)).
//!
//! The head is a stack of Llama decoder layers (usually one) over
//! `x = fc([embed(id), h])` (width `2 * hidden` in, `hidden` out, with
//! `fc.bias`), where `h` is the target's final *normed* hidden state at the
//! same position (the state its LM head reads: target layer
//! [`EagleHead::target_layer`] = `num_layers`) or the previous draft step's
//! output state. Layer 0 has no `input_layernorm` (EAGLE removes it; SGLang
//! replaces it by the identity); the other layers are plain pre-norm Llama
//! layers. The output state is the last layer's output plus its residual,
//! with **no** final norm: it is trained to predict the target's normed
//! state, so it goes straight into the target's LM head, and the logits
//! cover the target's vocabulary (draft id = target id).
//!
//! Checkpoint: `fc.weight` `[h, 2h]`, `fc.bias` `[h]` (present unless the
//! config's `bias` is false), `layers.{i}.self_attn.{q,k,v,o}_proj.weight`,
//! `layers.{i}.post_attention_layernorm.weight`,
//! `layers.{i}.input_layernorm.weight` (`i > 0`),
//! `layers.{i}.mlp.{gate,up,down}_proj.weight`, optionally
//! `embed_tokens.weight` (a frozen copy of the target's: used only when the
//! target exposes no embedding, since EAGLE's `load_emb` and SGLang's
//! `set_embed_and_head` both take the target's); a `lm_head.weight` is
//! ignored (the target's LM head is used, as SGLang does for EAGLE).
//!
//! Invariants established by [`EagleHead::load`]: every tensor has the shape
//! the config implies (errors name the tensor and the file); the head's
//! hidden size and vocabulary are the target's; `fc`'s weight is split into
//! its embedding and state halves (there is no concat op, so
//! `x = W_e · embed + W_h · h + b`); the LM head (and the embedding when the
//! target exposes one) is the target's `[vocab, hidden]` tensor. A forward
//! uses only [`Backend`] operations and the caller's attention over the
//! layers of a KV cache of [`EagleHead::kv_spec`], so it runs on every
//! backend.

use crate::head_common::{
    Attention, HeadMap, Mlp, SplitLinear, cfg_err, check_architecture, check_batch, check_hidden,
    check_kv, check_plain_llama, check_vocab, kv_spec, lm_logits, read_bool, read_config, same_id,
    select_rows, upload_inv_freq,
};
use arbor_engine_core::{
    Backend, CoreError, DType, ForwardBatch, ForwardContext, KvSpec, Model, ModelSpec, Result,
    Tensor,
};
use arbor_models::DecoderConfig;
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The architecture name an EAGLE head's `config.json` carries.
pub const EAGLE_ARCHITECTURE: &str = "LlamaForCausalLMEagle";

/// An EAGLE head's `config.json`: a Llama config (plus EAGLE's `bias`).
#[derive(Clone, Debug, PartialEq)]
pub struct EagleConfig {
    /// The Llama part (hidden size, heads, rope, layers, ...).
    pub decoder: DecoderConfig,
    /// Whether `fc` carries a bias (the config's `bias`; true when absent,
    /// as in EAGLE's `EaModel` and SGLang).
    pub fc_bias: bool,
}

impl EagleConfig {
    /// Parses the head's `config.json` value; `file` names it in errors.
    pub fn from_json(v: &Value, file: &str) -> Result<Self> {
        let decoder = DecoderConfig::from_json(v, file)?;
        check_architecture(&decoder, file, EAGLE_ARCHITECTURE)?;
        if decoder.num_hidden_layers == 0 {
            return Err(cfg_err(
                file,
                "num_hidden_layers",
                "is 0; an EAGLE head has at least one layer",
            ));
        }
        check_plain_llama(
            v,
            &decoder,
            file,
            "is true; EAGLE heads have no attention or MLP biases",
            "is set; EAGLE heads attend over the whole context",
        )?;
        let fc_bias = read_bool(v, file, "bias", true)?;
        Ok(Self { decoder, fc_bias })
    }

    /// Checks that the head fits `target`: its hidden size (the width of the
    /// target state it reads and of the LM head it feeds) and vocabulary.
    pub fn check_target(&self, target: &ModelSpec, file: &str) -> Result<()> {
        if self.decoder.hidden_size != target.hidden_size {
            return Err(cfg_err(
                file,
                "hidden_size",
                format!(
                    "is {}, but the target's hidden_size is {} (an EAGLE head reads the target's final hidden state and feeds its LM head)",
                    self.decoder.hidden_size, target.hidden_size
                ),
            ));
        }
        check_vocab(&self.decoder, target, file)
    }
}

/// What one draft forward returns, at the batch's `logits_rows`.
#[derive(Clone, Debug)]
pub struct EagleOutput {
    /// f32 `[rows, vocab_size]` logits over the target's vocabulary.
    pub logits: Tensor,
    /// f32 `[rows, hidden_size]`: the output state (last layer's output plus
    /// residual, un-normed), the next draft step's `h`.
    pub state: Tensor,
}

/// One decoder layer of the head.
struct Layer {
    /// `None` for layer 0 (EAGLE has no input norm there).
    input_norm: Option<Tensor>,
    attn: Attention,
    post_norm: Tensor,
    mlp: Mlp,
}

/// A loaded EAGLE draft head.
pub struct EagleHead {
    cfg: EagleConfig,
    backend: Arc<dyn Backend>,
    target_layer: usize,
    embed: Tensor,
    fc: SplitLinear,
    fc_bias: Option<Tensor>,
    layers: Vec<Layer>,
    lm_head: Tensor,
    inv_freq: Tensor,
}

impl std::fmt::Debug for EagleHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "EagleHead(hidden {}, {} layers, vocab {}, target layer {})",
            self.cfg.decoder.hidden_size,
            self.layers.len(),
            self.cfg.decoder.vocab_size,
            self.target_layer
        )
    }
}

impl EagleHead {
    /// Loads the head in `dir` (`config.json`, `model.safetensors` or `pytorch_model.bin`) for
    /// `target`, whose LM head and input embedding it uses (the
    /// checkpoint's `embed_tokens.weight` only when the target exposes no
    /// embedding).
    pub fn load(dir: &Path, target: &dyn Model, backend: Arc<dyn Backend>) -> Result<Self> {
        Self::load_sharing(
            dir,
            target.spec(),
            target.input_embedding(),
            target.lm_head(),
            backend,
        )
    }

    /// As [`load`](Self::load) for a target of shape `spec` whose input
    /// embedding and LM head (over the whole vocabulary, on `backend`'s
    /// device) are `target_embed` and `target_head`: a tensor-parallel
    /// target's, gathered on rank 0 (`TpRunners::whole_lm_head`).
    pub fn load_sharing(
        dir: &Path,
        spec: &ModelSpec,
        target_embed: Option<Tensor>,
        target_head: Option<Tensor>,
        backend: Arc<dyn Backend>,
    ) -> Result<Self> {
        let (v, file) = read_config(dir)?;
        let cfg = EagleConfig::from_json(&v, &file)?;
        cfg.check_target(spec, &file)?;

        let map = HeadMap::open(dir)?;
        let src = map.file()?;
        let c = &cfg.decoder;
        let (h, inter, vocab) = (c.hidden_size, c.intermediate_size, c.vocab_size);
        let b = &*backend;
        let from_target = |what: &str, t: Option<Tensor>| -> Result<Tensor> {
            let t = t.ok_or_else(|| {
                CoreError::Config(format!(
                    "{}: the EAGLE head uses the target's {what}, but the target model exposes none",
                    src.path.display()
                ))
            })?;
            if t.shape() != [vocab, h] {
                return Err(CoreError::Config(format!(
                    "{}: the target's {what} is {:?}, expected [{vocab}, {h}] (vocab_size, hidden_size)",
                    src.path.display(),
                    t.shape()
                )));
            }
            Ok(t)
        };

        // The target's embedding when it exposes one (EAGLE's `load_emb`,
        // SGLang's `set_embed_and_head`), else the checkpoint's copy.
        let own_embed = src.view_shaped("embed_tokens.weight", &[vocab, h])?;
        let embed = match (target_embed, own_embed) {
            (Some(e), _) => from_target("input embedding", Some(e))?,
            (None, Some(t)) => src.upload(b, "embed_tokens.weight", &t)?,
            (None, None) => from_target(
                "input embedding (the head has no 'embed_tokens.weight')",
                None,
            )?,
        };
        let lm_head = from_target("LM head", target_head)?;
        let fc = src.split(b, "fc.weight", h, h)?;
        let fc_bias = if cfg.fc_bias {
            Some(src.vector(b, "fc.bias", h)?)
        } else {
            None
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("layers.{i}");
            let input_norm = if i == 0 {
                None
            } else {
                Some(src.vector(b, &format!("{p}.input_layernorm.weight"), h)?)
            };
            layers.push(Layer {
                input_norm,
                attn: Attention::load(&src, b, &format!("{p}.self_attn"), c)?,
                post_norm: src.vector(b, &format!("{p}.post_attention_layernorm.weight"), h)?,
                mlp: Mlp::load(&src, b, &format!("{p}.mlp"), h, inter)?,
            });
        }

        let inv_freq = upload_inv_freq(b, c)?;
        Ok(Self {
            target_layer: spec.num_layers,
            cfg,
            backend: backend.clone(),
            embed,
            fc,
            fc_bias,
            layers,
            lm_head,
            inv_freq,
        })
    }

    /// The parsed configuration.
    pub fn config(&self) -> &EagleConfig {
        &self.cfg
    }

    /// Hidden size of the head (the target's; width of `h` and of the state).
    pub fn hidden_size(&self) -> usize {
        self.cfg.decoder.hidden_size
    }

    /// Rows of the logits: the target's vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.cfg.decoder.vocab_size
    }

    /// The target hidden state the head reads, as a
    /// [`ForwardBatch::hidden_layers`] index: `num_layers`, the final normed state.
    pub fn target_layer(&self) -> usize {
        self.target_layer
    }

    /// The head's KV cache shape: one layer per decoder layer.
    pub fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec {
        kv_spec(
            &self.cfg.decoder,
            self.layers.len(),
            page_size,
            num_pages,
            dtype,
        )
    }

    /// One draft forward over `batch`'s new tokens. `hidden` is f32 `[t,
    /// hidden]`: the target's final normed states or the previous output
    /// states, one per token. K and V are written into layers `0..n` of
    /// `ctx.kv`; logits and the output state come back at `batch.logits_rows`.
    pub fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<EagleOutput> {
        let c = &self.cfg.decoder;
        check_batch(batch, c.vocab_size, "EAGLE")?;
        let b = &*self.backend;
        let t = batch.input_ids.len();
        let h = c.hidden_size;
        check_hidden(hidden, t, h, "EAGLE")?;
        check_kv(ctx, c, self.layers.len(), "EAGLE")?;
        let ids = b.upload_u32(&[t], &batch.input_ids)?;
        let pos = b.upload_u32(&[t], &batch.positions)?;
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let eps = c.rms_norm_eps;

        // resid = fc([embed(ids), hidden]) = W_e · embed + W_h · hidden + bias.
        let e = f32t(&[t, h])?;
        b.embedding(&self.embed, &ids, &e)?;
        let resid = f32t(&[t, h])?;
        b.linear(&e, &self.fc.embed, self.fc_bias.as_ref(), &resid)?;
        b.linear(hidden, &self.fc.hidden, None, &e)?;
        b.add_assign(&resid, &e)?;

        let normed = f32t(&[t, h])?;
        let proj = f32t(&[t, h])?;
        for (i, layer) in self.layers.iter().enumerate() {
            // Layer 0 attends over resid itself; later layers over the
            // input norm that the previous layer's last add wrote to `normed`.
            let a_in = if i == 0 { &resid } else { &normed };
            layer
                .attn
                .forward(b, ctx, i, c, &self.inv_freq, &pos, a_in, &proj)?;
            // resid += attn; normed = post_attention_layernorm(resid).
            b.add_rms_norm(&resid, &proj, &layer.post_norm, eps, &normed)?;
            layer.mlp.forward(b, &normed, &proj)?;
            // resid += mlp (and normed = the next layer's input norm).
            match self.layers.get(i + 1).and_then(|l| l.input_norm.as_ref()) {
                Some(w) => b.add_rms_norm(&resid, &proj, w, eps, &normed)?,
                None => b.add_assign(&resid, &proj)?,
            }
        }

        // No final norm: the state goes straight into the target's LM head.
        let state = select_rows(b, resid, &batch.logits_rows)?;
        let logits = lm_logits(b, &state, &self.lm_head, c.vocab_size)?;
        Ok(EagleOutput { logits, state })
    }

    /// The target id of a draft id (the same id: the head's logits cover the
    /// target's vocabulary).
    pub fn target_id(&self, draft_id: u32) -> Result<u32> {
        same_id(draft_id, self.cfg.decoder.vocab_size)
    }
}
