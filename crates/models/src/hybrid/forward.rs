//! The hybrid forward pass: embeddings, then per layer a (1 + w) RMSNorm,
//! the mixer (a Gated DeltaNet over the batch's state slots, or gated
//! attention over the KV pages of the attention layers), a second norm and
//! the feed-forward; the final norm and the LM head at the logit rows.
//! Hidden states are captured as `ForwardBatch::hidden_layers` asks: after
//! layer `i < n` the residual stream, `n` the final normed state. A model
//! without recurrent layers (the MTP layer) reads no state slots.

use super::{AttentionMixer, Ffn, HybridModel, Layer, Mixer, RecurrentMixer};
use arbor_engine_core::state::{GatedDeltaNet, GatedDeltaWeights, StateSeq};
use arbor_engine_core::{
    AttentionParams, Backend, CoreError, DType, ForwardBatch, ForwardContext, ForwardOutput,
    KvScales, Result, RopeStyle, Tensor,
};

/// One pass's buffers.
struct Pass<'a> {
    b: &'a dyn Backend,
    t: usize,
    pos: Tensor,
    resid: Tensor,
    x: Tensor,
    proj: Tensor,
    /// The batch's state slots (none without recurrent layers).
    seqs: Vec<StateSeq>,
    /// Rows of the doubled `q_proj` output (`[t * heads * 2, head_dim]`)
    /// that are queries (even) and gates (odd).
    query_rows: Tensor,
    gate_rows: Tensor,
}

impl HybridModel {
    pub(super) fn run(
        &self,
        batch: &ForwardBatch,
        ctx: &ForwardContext<'_>,
    ) -> Result<ForwardOutput> {
        self.run_from(batch, ctx, None)
    }

    /// The forward from input embeddings `x` (f32 `[tokens, hidden]`)
    /// instead of the batch's ids (which are still validated); the only way
    /// to run a model loaded without an embedding table (the MTP layer).
    pub fn forward_from_embeds(
        &self,
        batch: &ForwardBatch,
        x: &Tensor,
        ctx: &ForwardContext<'_>,
    ) -> Result<ForwardOutput> {
        self.run_from(batch, ctx, Some(x))
    }

    /// Checks the batch and the caches against the model.
    fn check(&self, batch: &ForwardBatch, ctx: &ForwardContext<'_>) -> Result<()> {
        batch.validate(self.spec.vocab_size)?;
        if !batch.lora.is_empty() {
            return Err(CoreError::unsupported(
                "LoRA adapters on a hybrid (recurrent) model",
            ));
        }
        if batch.exit_after.is_some() {
            return Err(CoreError::unsupported(
                "early exit on a hybrid (recurrent) model",
            ));
        }
        let n = self.layers.len();
        if let Some(bad) = batch.hidden_layers.iter().find(|&&l| l > n) {
            return Err(CoreError::invalid(format!(
                "hidden state of layer {bad} asked of a model of {n} layers"
            )));
        }
        let kv_spec = ctx.kv.spec();
        if kv_spec.num_layers != self.spec.kv_layers()
            || kv_spec.num_kv_heads != self.spec.num_kv_heads
            || kv_spec.head_dim != self.spec.head_dim
        {
            return Err(CoreError::invalid(format!(
                "KV cache {kv_spec:?} does not fit the model"
            )));
        }
        if self.spec.state.is_some() {
            let state = ctx.kv.state()?;
            if state.spec() != &self.cfg.state {
                return Err(CoreError::invalid(format!(
                    "recurrent state {:?} does not fit the model",
                    state.spec()
                )));
            }
        }
        Ok(())
    }

    fn run_from(
        &self,
        batch: &ForwardBatch,
        ctx: &ForwardContext<'_>,
        embeds: Option<&Tensor>,
    ) -> Result<ForwardOutput> {
        self.check(batch, ctx)?;
        let b = &*self.backend;
        let (t, h) = (batch.input_ids.len(), self.cfg.base.hidden_size);
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let nh = self.cfg.base.num_attention_heads;
        let query: Vec<u32> = (0..(t * nh) as u32).map(|r| 2 * r).collect();
        let gate: Vec<u32> = query.iter().map(|r| r + 1).collect();
        let recurrent = self.spec.state.is_some();
        let p = Pass {
            b,
            t,
            pos: b.upload_u32(&[t], &batch.positions)?,
            resid: f32t(&[t, h])?,
            x: f32t(&[t, h])?,
            proj: f32t(&[t, h])?,
            seqs: if recurrent {
                batch.layout.state_seqs()?
            } else {
                Vec::new()
            },
            query_rows: b.upload_u32(&[t * nh], &query)?,
            gate_rows: b.upload_u32(&[t * nh], &gate)?,
        };
        // Restored snapshots first: the sequences continue from them.
        if recurrent {
            let state = ctx.kv.state()?;
            for &(from, to) in &batch.layout.state_restores {
                state.copy_slot(b, from, to)?;
            }
        }
        match (embeds, &self.embed) {
            (Some(x), _) => {
                if x.shape() != [t, h] {
                    return Err(CoreError::invalid(format!(
                        "input embeddings of shape {:?} for {t} tokens of width {h}",
                        x.shape()
                    )));
                }
                b.copy(x, &p.resid)?;
            }
            (None, Some(embed)) => {
                let ids = b.upload_u32(&[t], &batch.input_ids)?;
                b.embedding(embed, &ids, &p.resid)?;
            }
            (None, None) => {
                return Err(CoreError::invalid(
                    "this model runs from input embeddings (it has no embedding table)",
                ));
            }
        }
        let eps = self.cfg.base.rms_norm_eps;
        let n = self.layers.len();
        let mut hidden: Vec<Option<Tensor>> = vec![None; batch.hidden_layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            if i > 0 {
                b.add_rms_norm(&p.resid, &p.proj, &layer.input_norm, eps, &p.x)?;
            } else {
                b.rms_norm(&p.resid, &layer.input_norm, eps, &p.x)?;
            }
            match &layer.mixer {
                Mixer::Recurrent(m) => self.recurrent(&p, m, ctx)?,
                Mixer::Attention(m) => self.attention(&p, m, ctx)?,
            }
            b.add_rms_norm(&p.resid, &p.proj, &layer.post_norm, eps, &p.x)?;
            self.feed_forward(&p, layer)?;
            if i + 1 < n {
                capture_after(&p, batch, i, &mut hidden)?;
            }
        }
        b.add_rms_norm(&p.resid, &p.proj, &self.norm, eps, &p.x)?;
        // After the final add, `resid` is the stream after the last layer.
        for (slot, &l) in batch.hidden_layers.iter().enumerate() {
            if l + 1 == n {
                hidden[slot] = Some(capture(&p, batch, &p.resid)?);
            } else if l == n {
                hidden[slot] = Some(capture(&p, batch, &p.x)?);
            }
        }
        let hidden = hidden
            .into_iter()
            .map(|h| h.ok_or_else(|| CoreError::Internal("a hidden state was not captured".into())))
            .collect::<Result<Vec<_>>>()?;
        let rows = batch.logits_rows.len();
        let vocab = self.spec.vocab_size;
        let logits = f32t(&[rows, vocab])?;
        if rows > 0 {
            let sel = f32t(&[rows, h])?;
            let idx = b.upload_u32(&[rows], &batch.logits_rows)?;
            b.gather_rows(&p.x, &idx, &sel)?;
            b.linear(&sel, &self.lm_head, None, &logits)?;
        }
        Ok(ForwardOutput { logits, hidden })
    }

    /// A Gated DeltaNet layer of `p.x` into `p.proj`.
    fn recurrent(&self, p: &Pass<'_>, m: &RecurrentMixer, ctx: &ForwardContext<'_>) -> Result<()> {
        let (b, t, s) = (p.b, p.t, &self.cfg.state);
        let value = s.v_heads * s.v_dim;
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let (mixed, z) = (f32t(&[t, s.conv_channels])?, f32t(&[t, value])?);
        let (beta_in, decay_in) = (f32t(&[t, s.v_heads])?, f32t(&[t, s.v_heads])?);
        b.linear_many(
            &p.x,
            &[
                m.qkv.to(&mixed),
                m.z.to(&z),
                m.b.to(&beta_in),
                m.a.to(&decay_in),
            ],
        )?;
        let core = f32t(&[t, value])?;
        b.gated_delta_net(&GatedDeltaNet {
            spec: s,
            mixed: &mixed,
            a: &decay_in,
            b: &beta_in,
            weights: GatedDeltaWeights {
                conv: &m.conv,
                a_log: &m.a_log,
                dt_bias: &m.dt_bias,
            },
            state: ctx.kv.state()?.layer(m.state_index)?,
            seqs: &p.seqs,
            out: &core,
        })?;
        // Gated RMSNorm per value head: norm(core) * w * silu(z).
        let heads = [t * s.v_heads, s.v_dim];
        let normed = f32t(&heads)?;
        b.rms_norm(
            &core.reshape(&heads)?,
            &m.norm,
            self.cfg.base.rms_norm_eps,
            &normed,
        )?;
        let gated = f32t(&heads)?;
        b.silu_mul(&z.reshape(&heads)?, &normed, &gated)?;
        b.linear_many(&gated.reshape(&[t, value])?, &[m.out.to(&p.proj)])
    }

    /// A gated attention layer of `p.x` into `p.proj`.
    fn attention(&self, p: &Pass<'_>, m: &AttentionMixer, ctx: &ForwardContext<'_>) -> Result<()> {
        let c = &self.cfg.base;
        let (b, t) = (p.b, p.t);
        let (nh, nkv, hd, eps) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            c.rms_norm_eps,
        );
        let f32t = |shape: &[usize]| b.alloc(DType::F32, shape);
        let doubled = f32t(&[t, 2 * nh * hd])?;
        let (k, v) = (f32t(&[t, nkv * hd])?, f32t(&[t, nkv * hd])?);
        b.linear_many(&p.x, &[m.q.to(&doubled), m.k.to(&k), m.v.to(&v)])?;
        let halves = doubled.reshape(&[t * nh * 2, hd])?;
        let (q, gate) = (f32t(&[t * nh, hd])?, f32t(&[t * nh, hd])?);
        b.gather_rows(&halves, &p.query_rows, &q)?;
        b.gather_rows(&halves, &p.gate_rows, &gate)?;
        b.rms_norm(&q, &m.q_norm, eps, &q)?;
        let k_heads = k.reshape(&[t * nkv, hd])?;
        b.rms_norm(&k_heads, &m.k_norm, eps, &k_heads)?;
        let q = q.reshape(&[t, nh * hd])?;
        b.rope(&q, &p.pos, &self.inv_freq, hd, RopeStyle::Neox)?;
        b.rope(&k, &p.pos, &self.inv_freq, hd, RopeStyle::Neox)?;
        let attn = f32t(&[t, nh * hd])?;
        let params = AttentionParams {
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            sliding_window: None,
            kv_scales: KvScales::ONE,
        };
        ctx.attention.forward(
            ctx.attention_batch,
            ctx.kv.layer(m.kv_index)?,
            &q,
            &k,
            &v,
            &attn,
            &params,
        )?;
        let gated = f32t(&[t, nh * hd])?;
        b.sigmoid_mul(&gate.reshape(&[t, nh * hd])?, &attn, &gated)?;
        b.linear_many(&gated, &[m.o.to(&p.proj)])
    }

    /// The layer's feed-forward of `p.x` into `p.proj`.
    fn feed_forward(&self, p: &Pass<'_>, layer: &Layer) -> Result<()> {
        let b = p.b;
        match &layer.ffn {
            Ffn::Dense { gate, up, down } => {
                let shape = [p.t, self.cfg.base.intermediate_size];
                let (g, u) = (b.alloc(DType::F32, &shape)?, b.alloc(DType::F32, &shape)?);
                b.linear_many(&p.x, &[gate.to(&g), up.to(&u)])?;
                let act = b.alloc(DType::F32, &shape)?;
                b.silu_mul(&g, &u, &act)?;
                b.linear_many(&act, &[down.to(&p.proj)])
            }
            Ffn::Moe(block) => block.forward(b, &p.x, &p.proj),
        }
    }
}

/// The rows of `src` a hidden state keeps (every row, or the logits rows),
/// as a new tensor.
fn capture(p: &Pass<'_>, batch: &ForwardBatch, src: &Tensor) -> Result<Tensor> {
    let b = p.b;
    let h = src.shape()[1];
    if batch.hidden_at_every_row {
        let out = b.alloc(DType::F32, &[p.t, h])?;
        b.copy(src, &out)?;
        return Ok(out);
    }
    let rows = batch.logits_rows.len();
    let out = b.alloc(DType::F32, &[rows, h])?;
    if rows > 0 {
        let idx = b.upload_u32(&[rows], &batch.logits_rows)?;
        b.gather_rows(src, &idx, &out)?;
    }
    Ok(out)
}

/// Captures the hidden states asked after layer `l` (not the last): the
/// residual stream `resid + proj`.
fn capture_after(
    p: &Pass<'_>,
    batch: &ForwardBatch,
    l: usize,
    hidden: &mut [Option<Tensor>],
) -> Result<()> {
    for (slot, _) in (batch.hidden_layers.iter().enumerate()).filter(|&(_, &x)| x == l) {
        let full = p.b.alloc(DType::F32, &[p.t, p.resid.shape()[1]])?;
        p.b.copy(&p.resid, &full)?;
        p.b.add_assign(&full, &p.proj)?;
        hidden[slot] = Some(capture(p, batch, &full)?);
    }
    Ok(())
}
