//! The decoder's forward pass: the residual stream of a batch through the
//! layers (attention, then feed-forward, each pre-normed), the hidden
//! states asked for, the final norm and the LM head. [`Pass`] owns the
//! step's buffers and the batch's views (its logit rows, this rank's LoRA
//! segments); the blocks write their output to `Pass::proj`, which the
//! next norm adds to the residual stream.

use super::{Attn, DecoderModel, Ffn, Layer, TpRank};
use crate::dp_attention::feed_forward_over_ranks;
use arbor_engine_core::lora::{LoraSegment, LoraTarget, apply_lora};
use arbor_engine_core::{
    AttentionParams, Backend, CoreError, DType, ForwardBatch, ForwardContext, ForwardOutput,
    KvScales, Result, RopeStyle, Tensor,
};
use std::borrow::Cow;

/// The buffers and batch views of one forward pass.
struct Pass<'a> {
    b: &'a dyn Backend,
    batch: &'a ForwardBatch,
    /// Tokens in the batch, and the hidden size.
    t: usize,
    h: usize,
    pos: Tensor,
    /// The residual stream (before the latest block's output is added).
    resid: Tensor,
    /// The normed input of the current block (after the last layer: the
    /// final normed state).
    x: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_heads: Tensor,
    k_heads: Tensor,
    attn: Tensor,
    /// The latest block's output.
    proj: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
    params: AttentionParams,
    /// This rank's LoRA segments.
    lora: Cow<'a, [LoraSegment]>,
    /// The logit rows: how many, and their indices unless they are every
    /// row in order.
    rows: usize,
    idx: Option<Tensor>,
}

impl Pass<'_> {
    fn f32t(&self, shape: &[usize]) -> Result<Tensor> {
        self.b.alloc(DType::F32, shape)
    }

    /// Whether the logit rows are every row in order.
    fn all_rows(&self) -> bool {
        self.idx.is_none() && self.rows == self.t
    }

    /// Rows `logits_rows` of an f32 `[t, h]` tensor, as a new tensor.
    fn select(&self, src: &Tensor) -> Result<Tensor> {
        let out = self.f32t(&[self.rows, self.h])?;
        match &self.idx {
            Some(idx) => self.b.gather_rows(src, idx, &out)?,
            None if self.rows > 0 => self.b.copy(src, &out)?,
            None => {}
        }
        Ok(out)
    }

    /// The rows of a hidden state that are kept, as a new tensor.
    fn capture(&self, src: &Tensor) -> Result<Tensor> {
        if self.batch.hidden_at_every_row {
            let out = self.f32t(&[self.t, self.h])?;
            self.b.copy(src, &out)?;
            Ok(out)
        } else {
            self.select(src)
        }
    }

    /// Adds the batch's LoRA deltas of one linear (nothing without adapters).
    fn lora(&self, layer: usize, target: LoraTarget, x: &Tensor, out: &Tensor) -> Result<()> {
        apply_lora(self.b, &self.lora, layer, target, x, out)
    }

    /// The adapter of this rank's segments that targets one of `targets` of
    /// layer `i`, if any.
    fn adapter_on(&self, i: usize, targets: &[LoraTarget]) -> Option<&LoraSegment> {
        self.lora
            .iter()
            .find(|s| targets.iter().any(|&t| s.adapter.pair(i, t).is_some()))
    }
}

impl DecoderModel {
    pub(super) fn run(
        &self,
        batch: &ForwardBatch,
        ctx: &ForwardContext<'_>,
        embeds: Option<&Tensor>,
    ) -> Result<ForwardOutput> {
        let dp_rank = self.tp.as_ref().filter(|t| t.dp_attention);
        if let Some(dp) = dp_rank
            && batch.input_ids.is_empty()
            && batch.exit_after.is_none()
        {
            // A rank without tokens this step (the only valid empty batch).
            return self.idle_forward(dp);
        }
        batch.validate(self.spec.vocab_size)?;
        if dp_rank.is_some() && !batch.lora.is_empty() {
            return Err(CoreError::unsupported(
                "LoRA adapters with data-parallel attention",
            ));
        }
        let run = self.layers_to_run(batch)?;
        let kv_spec = ctx.kv.spec();
        if kv_spec.num_layers != self.cfg.num_hidden_layers
            || kv_spec.num_kv_heads != self.spec.num_kv_heads
            || kv_spec.head_dim != self.spec.head_dim
        {
            return Err(CoreError::invalid(format!(
                "KV cache {kv_spec:?} does not fit the model"
            )));
        }
        let p = self.pass(batch)?;
        self.embed(&p, embeds)?;
        let eps = self.cfg.rms_norm_eps;
        let mut hidden: Vec<Option<Tensor>> = vec![None; batch.hidden_layers.len()];
        for (i, layer) in self.layers.iter().enumerate().take(run) {
            if i > 0 {
                self.capture_after(&p, i - 1, &mut hidden)?;
                p.b.add_rms_norm(&p.resid, &p.proj, &layer.input_norm, eps, &p.x)?;
            } else {
                p.b.rms_norm(&p.resid, &layer.input_norm, eps, &p.x)?;
            }
            self.attention(&p, i, layer, ctx)?;
            if let Some(dp) = dp_rank {
                self.dp_feed_forward(&p, layer, dp)?;
                continue;
            }
            self.reduce(&p.proj)?;
            p.b.add_rms_norm(&p.resid, &p.proj, &layer.post_norm, eps, &p.x)?;
            self.feed_forward(&p, i, layer)?;
        }
        self.head(p, hidden)
    }

    /// Layers a pass of `batch` runs: all, or the first `exit_after`.
    fn layers_to_run(&self, batch: &ForwardBatch) -> Result<usize> {
        let n_layers = self.layers.len();
        if let Some(bad) = batch.hidden_layers.iter().find(|&&l| l > n_layers) {
            return Err(CoreError::invalid(format!(
                "hidden state of layer {bad} asked of a model with {n_layers} layers"
            )));
        }
        match batch.exit_after {
            None => Ok(n_layers),
            Some(n) if n <= n_layers && (n == n_layers || batch.hidden_layers.is_empty()) => Ok(n),
            Some(n) => Err(CoreError::invalid(format!(
                "an early exit after {n} of {n_layers} layers (with {} hidden states asked)",
                batch.hidden_layers.len()
            ))),
        }
    }

    /// This rank's LoRA segments of `batch`: a tensor-parallel rank applies
    /// its shard of each adapter, a data-parallel replica the copy on its
    /// own device.
    fn rank_lora<'a>(&self, batch: &'a ForwardBatch) -> Result<Cow<'a, [LoraSegment]>> {
        if batch.lora.is_empty() {
            return Ok(Cow::Borrowed(&batch.lora));
        }
        let (rank, world) = self
            .tp
            .as_ref()
            .map_or((0, 1), |t| (t.comm.rank(), t.comm.world_size()));
        // The device this rank's weights (and its adapters' factors) are on.
        let device = self.norm.buffer_id().device;
        let segments = batch
            .lora
            .iter()
            .map(|s| {
                Ok(LoraSegment {
                    adapter: s.adapter.for_rank(device, rank, world)?,
                    rows: s.rows.clone(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Cow::Owned(segments))
    }

    /// The step's buffers and views.
    fn pass<'a>(&'a self, batch: &'a ForwardBatch) -> Result<Pass<'a>> {
        let b = &*self.backend;
        let c = &self.cfg;
        let t = batch.input_ids.len();
        let (h, nh, nkv, hd) = (
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        );
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let (q, k) = (f32t(&[t, nh * hd])?, f32t(&[t, nkv * hd])?);
        let rows = batch.logits_rows.len();
        let in_order =
            rows == t && (batch.logits_rows.iter().enumerate()).all(|(i, &r)| r as usize == i);
        let idx = if in_order || rows == 0 {
            None
        } else {
            Some(b.upload_u32(&[rows], &batch.logits_rows)?)
        };
        Ok(Pass {
            b,
            batch,
            t,
            h,
            pos: b.upload_u32(&[t], &batch.positions)?,
            resid: f32t(&[t, h])?,
            x: f32t(&[t, h])?,
            q_heads: q.reshape(&[t * nh, hd])?,
            k_heads: k.reshape(&[t * nkv, hd])?,
            q,
            k,
            v: f32t(&[t, nkv * hd])?,
            attn: f32t(&[t, nh * hd])?,
            proj: f32t(&[t, h])?,
            gate: f32t(&[t, c.intermediate_size])?,
            up: f32t(&[t, c.intermediate_size])?,
            act: f32t(&[t, c.intermediate_size])?,
            params: AttentionParams {
                num_heads: nh,
                num_kv_heads: nkv,
                head_dim: hd,
                scale: 1.0 / (hd as f32).sqrt(),
                sliding_window: c.sliding_window,
                kv_scales: KvScales::ONE,
            },
            lora: self.rank_lora(batch)?,
            rows,
            idx,
        })
    }

    /// The residual stream entering layer 0: `embeds`, or the embeddings of
    /// the batch's ids.
    fn embed(&self, p: &Pass<'_>, embeds: Option<&Tensor>) -> Result<()> {
        let (t, h) = (p.t, p.h);
        match embeds {
            Some(e) if e.rows() == t && e.row_len() == h => p.b.copy(e, &p.resid),
            Some(e) => Err(CoreError::invalid(format!(
                "input embeddings {e:?} for {t} tokens of width {h}"
            ))),
            None => match &self.embed {
                Some(table) => {
                    let ids = p.b.upload_u32(&[t], &p.batch.input_ids)?;
                    p.b.embedding(table, &ids, &p.resid)
                }
                None => Err(CoreError::invalid(
                    "this model was loaded to run from input embeddings (it has no embedding table)",
                )),
            },
        }
    }

    /// Captures the hidden states asked after layer `l` (not the last):
    /// the residual stream `resid + proj`.
    fn capture_after(&self, p: &Pass<'_>, l: usize, hidden: &mut [Option<Tensor>]) -> Result<()> {
        for (slot, _) in (p.batch.hidden_layers.iter().enumerate()).filter(|&(_, &x)| x == l) {
            let full = p.f32t(&[p.t, p.h])?;
            p.b.copy(&p.resid, &full)?;
            p.b.add_assign(&full, &p.proj)?;
            hidden[slot] = Some(if p.batch.hidden_at_every_row {
                full
            } else {
                p.select(&full)?
            });
        }
        Ok(())
    }

    /// Layer `i`'s attention of the normed `p.x` into `p.proj`.
    fn attention(
        &self,
        p: &Pass<'_>,
        i: usize,
        layer: &Layer,
        ctx: &ForwardContext<'_>,
    ) -> Result<()> {
        let (b, eps, hd) = (p.b, self.cfg.rms_norm_eps, self.cfg.head_dim);
        match &layer.attn {
            Attn::Mha(m) => {
                let qkv = [m.q.to(&p.q), m.k.to(&p.k), m.v.to(&p.v)];
                b.linear_many(&p.x, &qkv)?;
                p.lora(i, LoraTarget::Q, &p.x, &p.q)?;
                p.lora(i, LoraTarget::K, &p.x, &p.k)?;
                p.lora(i, LoraTarget::V, &p.x, &p.v)?;
                if let (Some(qn), Some(kn)) = (&m.q_norm, &m.k_norm) {
                    b.rms_norm(&p.q_heads, qn, eps, &p.q_heads)?;
                    b.rms_norm(&p.k_heads, kn, eps, &p.k_heads)?;
                }
                b.rope(&p.q, &p.pos, &self.inv_freq, hd, RopeStyle::Neox)?;
                b.rope(&p.k, &p.pos, &self.inv_freq, hd, RopeStyle::Neox)?;
                let params = AttentionParams {
                    kv_scales: m.kv_scales,
                    ..p.params
                };
                ctx.attention.forward(
                    ctx.attention_batch,
                    ctx.kv.layer(i)?,
                    &p.q,
                    &p.k,
                    &p.v,
                    &p.attn,
                    &params,
                )?;
                self.linear(&p.attn, &m.o, &p.proj)?;
                p.lora(i, LoraTarget::O, &p.attn, &p.proj)
            }
            Attn::Mla(a) => {
                let targets = [LoraTarget::Q, LoraTarget::K, LoraTarget::V, LoraTarget::O];
                if let Some(s) = p.adapter_on(i, &targets) {
                    return Err(CoreError::unsupported(format!(
                        "LoRA adapter '{}' targets the latent attention of layer {i}",
                        s.adapter.name()
                    )));
                }
                let rope = crate::mla::Rope {
                    positions: &p.pos,
                    inv_freq: &self.inv_freq,
                };
                a.forward(b, &p.x, rope, i, ctx, &p.proj)
            }
        }
    }

    /// With data-parallel attention: the attention was whole, so `p.proj` is
    /// already this rank's rows of the output; the feed-forward runs over
    /// every rank's rows.
    fn dp_feed_forward(&self, p: &Pass<'_>, layer: &Layer, dp: &TpRank) -> Result<()> {
        let eps = self.cfg.rms_norm_eps;
        p.b.add_rms_norm(&p.resid, &p.proj, &layer.post_norm, eps, &p.x)?;
        feed_forward_over_ranks(p.b, &*dp.comm, &p.x, &p.proj, |i, o| {
            self.whole_feed_forward(&layer.ffn, i, o)
        })
    }

    /// Layer `i`'s feed-forward of the normed `p.x` into `p.proj`.
    fn feed_forward(&self, p: &Pass<'_>, i: usize, layer: &Layer) -> Result<()> {
        match &layer.ffn {
            Ffn::Dense { gate, up, down } => {
                p.b.linear_many(&p.x, &[gate.to(&p.gate), up.to(&p.up)])?;
                p.lora(i, LoraTarget::Gate, &p.x, &p.gate)?;
                p.lora(i, LoraTarget::Up, &p.x, &p.up)?;
                p.b.silu_mul(&p.gate, &p.up, &p.act)?;
                self.linear(&p.act, down, &p.proj)?;
                p.lora(i, LoraTarget::Down, &p.act, &p.proj)?;
                self.reduce(&p.proj)
            }
            Ffn::Moe(block) => {
                let targets = [LoraTarget::Gate, LoraTarget::Up, LoraTarget::Down];
                if let Some(s) = p.adapter_on(i, &targets) {
                    return Err(CoreError::unsupported(format!(
                        "LoRA adapter '{}' targets the MLP of layer {i}, a mixture of experts",
                        s.adapter.name()
                    )));
                }
                // The whole output on every rank (the block reduces).
                block.forward(p.b, &p.x, &p.proj)
            }
        }
    }

    /// The final norm, the last hidden states asked, and the logits of the
    /// wanted rows.
    fn head(&self, p: Pass<'_>, mut hidden: Vec<Option<Tensor>>) -> Result<ForwardOutput> {
        let (b, c) = (p.b, &self.cfg);
        let n_layers = self.layers.len();
        b.add_rms_norm(&p.resid, &p.proj, &self.norm, c.rms_norm_eps, &p.x)?;
        // After the final add, `resid` is the stream after the last layer.
        for (slot, &l) in p.batch.hidden_layers.iter().enumerate() {
            if l + 1 == n_layers {
                hidden[slot] = Some(p.capture(&p.resid)?);
            } else if l == n_layers {
                hidden[slot] = Some(p.capture(&p.x)?);
            }
        }
        let hidden = hidden
            .into_iter()
            .map(|h| h.ok_or_else(|| CoreError::Internal("a hidden state was not captured".into())))
            .collect::<Result<Vec<_>>>()?;
        let logits = p.f32t(&[p.rows, c.vocab_size])?;
        if p.rows == 0 {
            return Ok(ForwardOutput { logits, hidden });
        }
        let sel = if p.all_rows() {
            p.x.clone()
        } else {
            p.select(&p.x)?
        };
        match &self.tp {
            Some(t) if t.vocab_parallel => {
                let local = p.f32t(&[p.rows, self.lm_head.rows()])?;
                b.linear(&sel, &self.lm_head, None, &local)?;
                t.comm.all_gather(&local, &logits)?;
            }
            _ => b.linear(&sel, &self.lm_head, None, &logits)?,
        }
        Ok(ForwardOutput { logits, hidden })
    }
}
