//! The EAGLE3 draft head (SpecForge / SGLang `LlamaForCausalLMEagle3`):
//! loading its checkpoint and running one draft forward.
//!
//! This module owns [`Eagle3Config`] (the head's `config.json`, checked
//! against the target it drafts for) and [`Eagle3Head`] (its weights on a
//! [`Backend`]). Scheduling, acceptance and where the head's KV pages come
//! from belong to the caller.
//!
//! The head is one Llama decoder layer whose q/k/v read the concatenation
//! `[input_layernorm(embed(id)), hidden_norm(h)]` (width `2 * hidden`), with
//! `h = fc(features)` for a target feature (the outputs of the target layers
//! [`Eagle3Head::aux_layers`], concatenated in that order) or the previous
//! draft step's `aux` when the target's feature is not known. Its LM head
//! covers the draft vocabulary only; `d2t` maps a draft id to the target id
//! `draft + d2t[draft]`.
//!
//! Invariants established by [`Eagle3Head::load`]: every tensor has the
//! shape the config implies (errors name the tensor and the file); the
//! 2h-wide q/k/v weights are split into their embedding and hidden halves
//! (there is no concat op, so `q = Wq_e · norm(e) + Wq_h · norm(h)`); every
//! `d2t` target id lies inside the target's vocabulary (and agrees with
//! `t2d` when the checkpoint has one); the aux layer ids are target layers;
//! the hidden width the head reads is the target's. A forward uses only
//! [`Backend`] operations and the caller's attention over layer 0 of a KV
//! cache of [`Eagle3Head::kv_spec`], so it runs on every backend.

use crate::head_common::{
    HeadFile, HeadMap, Mlp, SplitLinear, cfg_err, check_architecture, check_batch, check_hidden,
    check_kv, check_plain_llama, check_vocab, kv_spec, lin, lm_logits, read_bool, read_config,
    rope_attention, select_rows, upload_inv_freq,
};
use arbor_engine_core::{
    Backend, CoreError, DType, ForwardBatch, ForwardContext, KvSpec, ModelSpec, Result, Tensor,
};
use arbor_models::DecoderConfig;
use safetensors::tensor::{Dtype, TensorView};
use serde_json::Value;
use std::path::Path;
use std::sync::Arc;

/// The architecture name an EAGLE3 head's `config.json` carries.
pub const EAGLE3_ARCHITECTURE: &str = "LlamaForCausalLMEagle3";

/// An EAGLE3 head's `config.json`: a Llama config plus the draft keys.
#[derive(Clone, Debug, PartialEq)]
pub struct Eagle3Config {
    /// The Llama part (hidden size, heads, rope, ...); `num_hidden_layers` is 1.
    pub decoder: DecoderConfig,
    /// Rows of the head's LM head (`draft_vocab_size`; `vocab_size` when absent).
    pub draft_vocab_size: usize,
    /// Width of one target hidden state (`target_hidden_size`; `hidden_size` when absent).
    pub target_hidden_size: usize,
    /// `eagle_config.eagle_aux_hidden_state_layer_ids`, when given.
    pub aux_layer_ids: Option<[usize; 3]>,
    /// Whether `fc` carries a bias (the config's `bias`).
    pub fc_bias: bool,
}

impl Eagle3Config {
    /// Parses the head's `config.json` value; `file` names it in errors.
    pub fn from_json(v: &Value, file: &str) -> Result<Self> {
        let decoder = DecoderConfig::from_json(v, file)?;
        check_architecture(&decoder, file, EAGLE3_ARCHITECTURE)?;
        if decoder.num_hidden_layers != 1 {
            return Err(cfg_err(
                file,
                "num_hidden_layers",
                format!(
                    "is {}; only single-layer EAGLE3 heads are supported",
                    decoder.num_hidden_layers
                ),
            ));
        }
        check_plain_llama(
            v,
            &decoder,
            file,
            "is true; EAGLE3 heads have no attention or MLP biases",
            "is set; EAGLE3 heads attend over the whole context",
        )?;
        let usize_opt = |key: &str| -> Result<Option<usize>> {
            match v.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| {
                        cfg_err(file, key, format!("must be a positive integer, found {x}"))
                    }),
            }
        };
        let draft_vocab_size = usize_opt("draft_vocab_size")?.unwrap_or(decoder.vocab_size);
        if draft_vocab_size > decoder.vocab_size {
            return Err(cfg_err(
                file,
                "draft_vocab_size",
                format!(
                    "({draft_vocab_size}) exceeds vocab_size ({})",
                    decoder.vocab_size
                ),
            ));
        }
        if decoder.tie_word_embeddings && draft_vocab_size != decoder.vocab_size {
            return Err(cfg_err(
                file,
                "draft_vocab_size",
                format!(
                    "({draft_vocab_size}) must equal vocab_size ({}) with tie_word_embeddings",
                    decoder.vocab_size
                ),
            ));
        }
        let target_hidden_size = usize_opt("target_hidden_size")?.unwrap_or(decoder.hidden_size);
        const IDS: &str = "eagle_config.eagle_aux_hidden_state_layer_ids";
        let aux_layer_ids = match v
            .get("eagle_config")
            .and_then(|e| e.get("eagle_aux_hidden_state_layer_ids"))
        {
            None | Some(Value::Null) => None,
            Some(x) => {
                let ids: Option<Vec<usize>> = x
                    .as_array()
                    .map(|a| a.iter().map(|i| i.as_u64().map(|n| n as usize)).collect())
                    .unwrap_or(None);
                match ids.as_deref() {
                    Some(&[a, b, c]) => Some([a, b, c]),
                    _ => {
                        return Err(cfg_err(
                            file,
                            IDS,
                            format!("must be a list of three layer ids, found {x}"),
                        ));
                    }
                }
            }
        };
        let fc_bias = read_bool(v, file, "bias", false)?;
        Ok(Self {
            decoder,
            draft_vocab_size,
            target_hidden_size,
            aux_layer_ids,
            fc_bias,
        })
    }

    /// The target layers whose output residual streams the head fuses, for
    /// a target of `num_layers`: the configured ids, else SGLang's default
    /// `[1, L/2 - 1, L - 4]` (its capture at the inputs of layers 2, L/2, L-3).
    pub fn aux_layers(&self, num_layers: usize, file: &str) -> Result<[usize; 3]> {
        const IDS: &str = "eagle_config.eagle_aux_hidden_state_layer_ids";
        let ids = match self.aux_layer_ids {
            Some(ids) => ids,
            None => {
                let d = (num_layers / 2)
                    .checked_sub(1)
                    .zip(num_layers.checked_sub(4))
                    .filter(|_| num_layers >= 5);
                match d {
                    Some((mid, late)) => [1, mid, late],
                    None => {
                        return Err(cfg_err(
                            file,
                            IDS,
                            format!(
                                "is absent and the default [1, L/2 - 1, L - 4] does not exist for a target of {num_layers} layers"
                            ),
                        ));
                    }
                }
            }
        };
        if let Some(bad) = ids.iter().find(|&&l| l >= num_layers) {
            return Err(cfg_err(
                file,
                IDS,
                format!("names layer {bad} of a target with {num_layers} layers"),
            ));
        }
        Ok(ids)
    }

    /// Checks that the head fits `target`: the hidden width it reads and the vocabulary.
    pub fn check_target(&self, target: &ModelSpec, file: &str) -> Result<()> {
        if self.target_hidden_size != target.hidden_size {
            let key = if self.target_hidden_size == self.decoder.hidden_size {
                "hidden_size"
            } else {
                "target_hidden_size"
            };
            return Err(cfg_err(
                file,
                key,
                format!(
                    "gives the head a target hidden size of {} (target_hidden_size, else hidden_size), but the target's hidden_size is {}",
                    self.target_hidden_size, target.hidden_size
                ),
            ));
        }
        check_vocab(&self.decoder, target, file)
    }
}

/// What one draft forward returns, at the batch's `logits_rows`.
#[derive(Clone, Debug)]
pub struct Eagle3Output {
    /// f32 `[rows, draft_vocab_size]` logits over the draft vocabulary.
    pub logits: Tensor,
    /// f32 `[rows, hidden_size]`: the pre-norm output, the next step's hidden
    /// when the target's feature is not known.
    pub aux: Tensor,
}

/// A loaded EAGLE3 draft head.
pub struct Eagle3Head {
    cfg: Eagle3Config,
    backend: Arc<dyn Backend>,
    aux_layers: [usize; 3],
    embed: Tensor,
    fc: Tensor,
    fc_bias: Option<Tensor>,
    input_norm: Tensor,
    hidden_norm: Tensor,
    q: SplitLinear,
    k: SplitLinear,
    v: SplitLinear,
    o: Tensor,
    post_norm: Tensor,
    mlp: Mlp,
    norm: Tensor,
    lm_head: Tensor,
    inv_freq: Tensor,
    /// Target id of each draft id.
    d2t: Vec<u32>,
}

impl std::fmt::Debug for Eagle3Head {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Eagle3Head(hidden {}, draft vocab {}, aux layers {:?})",
            self.cfg.decoder.hidden_size, self.cfg.draft_vocab_size, self.aux_layers
        )
    }
}

fn read_i64(t: &TensorView<'_>) -> Vec<i64> {
    t.data()
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
        .collect()
}

impl Eagle3Head {
    /// Loads the head in `dir` (`config.json`, `model.safetensors` or `pytorch_model.bin`) for
    /// `target`. `target_embed` (`[vocab, hidden]`, the target's input
    /// embedding) is used when the checkpoint has no `embed_tokens.weight`.
    pub fn load(
        dir: &Path,
        target: &ModelSpec,
        target_embed: Option<Tensor>,
        backend: Arc<dyn Backend>,
    ) -> Result<Self> {
        let (v, file) = read_config(dir)?;
        let cfg = Eagle3Config::from_json(&v, &file)?;
        cfg.check_target(target, &file)?;
        let aux_layers = cfg.aux_layers(target.num_layers, &file)?;

        let map = HeadMap::open(dir)?;
        let src = map.file()?;
        let st_path = src.path;

        let c = &cfg.decoder;
        let (h, th, nh, nkv, hd) = (
            c.hidden_size,
            cfg.target_hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let inter = c.intermediate_size;
        let (vocab, dv) = (c.vocab_size, cfg.draft_vocab_size);
        let b = &*backend;
        let weight = |name: &str, shape: &[usize]| src.weight(b, name, shape);
        let vector = |name: &str, len: usize| src.vector(b, name, len);
        let split = |name: &str, out: usize| src.split(b, name, out, h);

        let embed = match src.view_shaped("embed_tokens.weight", &[vocab, h])? {
            Some(t) => src.upload(b, "embed_tokens.weight", &t)?,
            None => match target_embed {
                Some(_) if h != target.hidden_size => {
                    return Err(cfg_err(
                        &file,
                        "hidden_size",
                        format!(
                            "is {h}, but a head without 'embed_tokens.weight' reads the target's embedding of width {}",
                            target.hidden_size
                        ),
                    ));
                }
                Some(e) if e.shape() == [vocab, h] => e,
                Some(e) => {
                    return Err(CoreError::Config(format!(
                        "{}: the head has no 'embed_tokens.weight' and the target embedding given is {:?}, expected [{vocab}, {h}] (vocab_size, hidden_size)",
                        st_path.display(),
                        e.shape()
                    )));
                }
                None => {
                    return Err(src.err(
                        "embed_tokens.weight",
                        "is missing and no target embedding was given",
                    ));
                }
            },
        };
        let fc = weight("fc.weight", &[h, 3 * th])?;
        let fc_bias = if cfg.fc_bias {
            Some(vector("fc.bias", h)?)
        } else {
            None
        };
        let p = "midlayer";
        let input_norm = vector(&format!("{p}.input_layernorm.weight"), h)?;
        let hidden_norm = vector(&format!("{p}.hidden_norm.weight"), h)?;
        let q = split(&format!("{p}.self_attn.q_proj.weight"), nh * hd)?;
        let k = split(&format!("{p}.self_attn.k_proj.weight"), nkv * hd)?;
        let v = split(&format!("{p}.self_attn.v_proj.weight"), nkv * hd)?;
        let o = weight(&format!("{p}.self_attn.o_proj.weight"), &[h, nh * hd])?;
        let post_norm = vector(&format!("{p}.post_attention_layernorm.weight"), h)?;
        let mlp = Mlp::load(&src, b, &format!("{p}.mlp"), h, inter)?;
        let norm = vector("norm.weight", h)?;
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            weight("lm_head.weight", &[dv, h])?
        };

        let d2t = draft_to_target(&src, dv, vocab)?;

        let inv_freq = upload_inv_freq(b, c)?;
        Ok(Self {
            cfg,
            backend: backend.clone(),
            aux_layers,
            embed,
            fc,
            fc_bias,
            input_norm,
            hidden_norm,
            q,
            k,
            v,
            o,
            post_norm,
            mlp,
            norm,
            lm_head,
            inv_freq,
            d2t,
        })
    }

    /// The parsed configuration.
    pub fn config(&self) -> &Eagle3Config {
        &self.cfg
    }

    /// Hidden size of the head (width of `aux` and of the fused hidden).
    pub fn hidden_size(&self) -> usize {
        self.cfg.decoder.hidden_size
    }

    /// Rows of the draft logits.
    pub fn draft_vocab_size(&self) -> usize {
        self.cfg.draft_vocab_size
    }

    /// The target layers whose outputs are fused, in concatenation order
    /// (as [`ForwardBatch::hidden_layers`] indices: the residual stream after that layer).
    pub fn aux_layers(&self) -> [usize; 3] {
        self.aux_layers
    }

    /// The head's KV cache shape: one layer.
    pub fn kv_spec(&self, page_size: usize, num_pages: usize, dtype: DType) -> KvSpec {
        kv_spec(&self.cfg.decoder, 1, page_size, num_pages, dtype)
    }

    /// The target id of draft id `draft_id`.
    pub fn target_id(&self, draft_id: u32) -> Result<u32> {
        self.d2t.get(draft_id as usize).copied().ok_or_else(|| {
            CoreError::invalid(format!(
                "draft id {draft_id} outside the draft vocabulary of {}",
                self.d2t.len()
            ))
        })
    }

    /// `fc`: target features `[t, 3 * target_hidden]` (f32) to the head's hidden `[t, hidden]`.
    pub fn fuse(&self, features: &Tensor) -> Result<Tensor> {
        let want = 3 * self.cfg.target_hidden_size;
        if features.dtype() != DType::F32
            || features.shape().len() != 2
            || features.row_len() != want
        {
            return Err(CoreError::invalid(format!(
                "EAGLE3 features {features:?}: expected f32 [tokens, {want}]"
            )));
        }
        let out = self
            .backend
            .alloc(DType::F32, &[features.rows(), self.hidden_size()])?;
        self.backend
            .linear(features, &self.fc, self.fc_bias.as_ref(), &out)?;
        Ok(out)
    }

    /// One draft forward over `batch`'s new tokens. `hidden` is f32 `[t,
    /// hidden]` (fused features or previous `aux`) or `[t, 3 *
    /// target_hidden]` target features, which go through `fc` first (as
    /// SGLang does when the width differs from the hidden size). K and V are
    /// written into layer 0 of `ctx.kv`; logits and `aux` come back at
    /// `batch.logits_rows`.
    pub fn forward(
        &self,
        batch: &ForwardBatch,
        hidden: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<Eagle3Output> {
        let c = &self.cfg.decoder;
        check_batch(batch, c.vocab_size, "EAGLE3")?;
        let b = &*self.backend;
        let t = batch.input_ids.len();
        let (h, nh, nkv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let fused;
        let hidden = if hidden.row_len() != h && hidden.row_len() == 3 * self.cfg.target_hidden_size
        {
            fused = self.fuse(hidden)?;
            &fused
        } else {
            hidden
        };
        check_hidden(hidden, t, h, "EAGLE3")?;
        check_kv(ctx, c, 1, "EAGLE3")?;
        let ids = b.upload_u32(&[t], &batch.input_ids)?;
        let pos = b.upload_u32(&[t], &batch.positions)?;
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let eps = c.rms_norm_eps;

        // x = [input_layernorm(embed(ids)), hidden_norm(hidden)], kept as two halves.
        let e = f32t(&[t, h])?;
        b.embedding(&self.embed, &ids, &e)?;
        b.rms_norm(&e, &self.input_norm, eps, &e)?;
        let hn = f32t(&[t, h])?;
        b.rms_norm(hidden, &self.hidden_norm, eps, &hn)?;
        let q = f32t(&[t, nh * hd])?;
        let k = f32t(&[t, nkv * hd])?;
        let v = f32t(&[t, nkv * hd])?;
        let q2 = f32t(&[t, nh * hd])?;
        let k2 = f32t(&[t, nkv * hd])?;
        let v2 = f32t(&[t, nkv * hd])?;
        b.linear_many(
            &e,
            &[
                lin(&self.q.embed, &q),
                lin(&self.k.embed, &k),
                lin(&self.v.embed, &v),
            ],
        )?;
        b.linear_many(
            &hn,
            &[
                lin(&self.q.hidden, &q2),
                lin(&self.k.hidden, &k2),
                lin(&self.v.hidden, &v2),
            ],
        )?;
        b.add_assign(&q, &q2)?;
        b.add_assign(&k, &k2)?;
        b.add_assign(&v, &v2)?;
        let attn = rope_attention(b, ctx, 0, c, &self.inv_freq, &pos, &q, &k, &v)?;
        let proj = f32t(&[t, h])?;
        b.linear(&attn, &self.o, None, &proj)?;

        // resid = hidden + attn; x = post_attention_layernorm(resid).
        let resid = f32t(&[t, h])?;
        b.copy(hidden, &resid)?;
        let x = f32t(&[t, h])?;
        b.add_rms_norm(&resid, &proj, &self.post_norm, eps, &x)?;
        self.mlp.forward(b, &x, &proj)?;
        // resid = aux = mlp + resid; x = norm(aux).
        b.add_rms_norm(&resid, &proj, &self.norm, eps, &x)?;

        let aux = select_rows(b, resid, &batch.logits_rows)?;
        let normed = select_rows(b, x, &batch.logits_rows)?;
        let logits = lm_logits(b, &normed, &self.lm_head, self.cfg.draft_vocab_size)?;
        Ok(Eagle3Output { logits, aux })
    }
}

/// The draft vocabulary's target ids: `d2t` holds each draft id's offset
/// (absent: the vocabularies are the same); `t2d`, when present, must mark
/// exactly the target ids `d2t` maps to.
fn draft_to_target(src: &HeadFile<'_>, dv: usize, vocab: usize) -> Result<Vec<u32>> {
    let d2t = match src.view("d2t")? {
        Some(t) => {
            if t.dtype() != Dtype::I64 || t.shape() != [dv] {
                return Err(src.err(
                    "d2t",
                    format!(
                        "is {:?} {:?}, expected I64 [{dv}] (draft_vocab_size)",
                        t.dtype(),
                        t.shape()
                    ),
                ));
            }
            let mut ids = Vec::with_capacity(dv);
            for (d, off) in read_i64(&t).into_iter().enumerate() {
                let id = (d as i64)
                    .checked_add(off)
                    .filter(|&id| id >= 0 && (id as usize) < vocab)
                    .ok_or_else(|| {
                        src.err(
                            "d2t",
                            format!(
                                "maps draft id {d} to {d} + {off}, outside the vocabulary of {vocab}"
                            ),
                        )
                    })?;
                ids.push(id as u32);
            }
            ids
        }
        None if dv == vocab => (0..vocab as u32).collect(),
        None => {
            return Err(src.err(
                "d2t",
                format!(
                    "is missing (needed to map the {dv} draft ids into the target's vocabulary of {vocab})"
                ),
            ));
        }
    };
    if let Some(t) = src.view("t2d")? {
        if t.dtype() != Dtype::BOOL || t.shape() != [vocab] {
            return Err(src.err(
                "t2d",
                format!(
                    "is {:?} {:?}, expected BOOL [{vocab}] (vocab_size)",
                    t.dtype(),
                    t.shape()
                ),
            ));
        }
        let marked = t.data().iter().filter(|&&x| x != 0).count();
        let agree = d2t.iter().all(|&id| t.data()[id as usize] != 0);
        if marked != dv || !agree {
            return Err(src.err(
                "t2d",
                format!("marks {marked} target ids, which are not the {dv} ids d2t maps to"),
            ));
        }
    }
    Ok(d2t)
}
