//! Running a model over a batch of sequences, and static-batch generation.
//!
//! [`ModelRunner`] binds a model to its device, attention implementation and
//! KV cache, and executes one forward pass over sequences described by their
//! new tokens, cached-prefix length and pages ([`SeqStep`]). It returns the
//! last-position logits of the sequences that ask for them, on the host.
//!
//! The weights and the KV cache can be replaced between forward passes
//! ([`ModelRunner::swap_model`], [`ModelRunner::release_memory`],
//! [`ModelRunner::resume_memory`]): every forward takes one snapshot of both
//! when it starts, so no pass sees half old, half new weights. A replacement
//! must have the same shape ([`ModelSpec::same_shape`]).
//!
//! [`generate_static`] decodes a fixed batch to completion (prefill all, then
//! decode all until each stops). It is what `arbor bench one-batch` measures
//! and what parity tests use; the serving scheduler (continuous batching)
//! drives [`ModelRunner::step`] directly.

use crate::backend::Backend;
use crate::backend::attention::{AttentionBackend, BatchLayout};
use crate::error::{CoreError, Result};
use crate::kv::state::{StatePool, StateSlot};
use crate::kv::{KvCache, KvSpec, PagePool, PageSet};
use crate::model::{ForwardBatch, ForwardContext, ForwardOutput, Model, ModelSpec};
use crate::sampling::{LogitsContext, LogitsProcessor, Sampler, SamplingParams, SeqRng};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

/// One sequence's part of a forward pass.
#[derive(Clone, Copy, Debug)]
pub struct SeqStep<'a> {
    /// New tokens to compute.
    pub tokens: &'a [u32],
    /// Tokens of this sequence already in the KV cache.
    pub prefix_len: usize,
    /// Pages holding the sequence (covering `prefix_len + tokens.len()`).
    pub pages: &'a [u32],
    /// Whether the last new token's logits are wanted.
    pub want_logits: bool,
    /// The sequence's recurrent state slot (a model with recurrent layers:
    /// see [`ModelRunner::new_state_pool`]).
    pub state_slot: Option<u32>,
}

/// State slots a runner allocates for a model with recurrent layers unless
/// told otherwise ([`ModelRunner::with_state_slots`]).
pub const DEFAULT_STATE_SLOTS: usize = 32;

/// The sizes of a runner's cache: pages, their element type, and the
/// recurrent state slots of a model that has recurrent layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvGeometry {
    /// Tokens per page.
    pub page_size: usize,
    /// Pages.
    pub num_pages: usize,
    /// Element type of the pages.
    pub kv_dtype: crate::DType,
    /// Recurrent state slots (ignored for a model without recurrent layers).
    pub state_slots: usize,
}

/// A model bound to a device, an attention implementation and a KV cache.
pub struct ModelRunner {
    /// The shape every model this runner runs has (fixed at creation).
    spec: ModelSpec,
    kv_spec: KvSpec,
    model: RwLock<Arc<dyn Model>>,
    backend: Arc<dyn Backend>,
    attention: Arc<dyn AttentionBackend>,
    kv: RwLock<Arc<KvCache>>,
}

/// What stands in for released weights: the shape, and an error on use.
struct ReleasedModel(ModelSpec);

impl Model for ReleasedModel {
    fn spec(&self) -> &ModelSpec {
        &self.0
    }
    fn forward(&self, _: &ForwardBatch, _: &ForwardContext<'_>) -> Result<ForwardOutput> {
        Err(CoreError::invalid(
            "the weights are released (resume memory occupation first)",
        ))
    }
}

impl ModelRunner {
    /// Allocates a KV cache of `num_pages` pages for `model` on `backend`
    /// (and [`DEFAULT_STATE_SLOTS`] state slots when it has recurrent layers).
    pub fn new(
        model: Arc<dyn Model>,
        backend: Arc<dyn Backend>,
        attention: Option<&str>,
        page_size: usize,
        num_pages: usize,
        kv_dtype: crate::DType,
    ) -> Result<Self> {
        let geometry = KvGeometry {
            page_size,
            num_pages,
            kv_dtype,
            state_slots: DEFAULT_STATE_SLOTS,
        };
        Self::with_state_slots(model, backend, attention, geometry)
    }

    /// [`new`](Self::new) with `geometry.state_slots` recurrent state slots
    /// beside the pages (ignored for a model without recurrent layers).
    pub fn with_state_slots(
        model: Arc<dyn Model>,
        backend: Arc<dyn Backend>,
        attention: Option<&str>,
        geometry: KvGeometry,
    ) -> Result<Self> {
        let KvGeometry {
            page_size,
            num_pages,
            kv_dtype,
            state_slots,
        } = geometry;
        let s = model.spec();
        let attention = backend.attention(attention)?;
        if let Some(max) = attention.capabilities().max_head_dim
            && s.head_dim > max
        {
            return Err(CoreError::unsupported(format!(
                "{} attention on {} takes heads of at most {max} dims; this model's are \
                 head_dim {} wide",
                attention.name(),
                backend.info().name,
                s.head_dim
            )));
        }
        let spec = KvSpec {
            num_layers: s.kv_layers(),
            num_kv_heads: s.num_kv_heads,
            head_dim: s.head_dim,
            page_size,
            num_pages,
            dtype: kv_dtype,
            values_in_keys: s.kv_values_in_keys,
        };
        let state = s.state.map(|st| (st, state_slots));
        let kv = KvCache::allocate_with_state(&*backend, spec, state)?;
        Ok(Self {
            spec: model.spec().clone(),
            kv_spec: spec,
            model: RwLock::new(model),
            backend,
            attention,
            kv: RwLock::new(Arc::new(kv)),
        })
    }

    /// The model now (a snapshot: a later swap does not change it).
    pub fn model(&self) -> Arc<dyn Model> {
        self.model.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The model's shape.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Replaces the weights by `model`'s (same shape); returns the old model.
    /// The next forward pass runs on the new weights; the KV cache stays
    /// (what it holds was computed by the old weights).
    pub fn swap_model(&self, model: Arc<dyn Model>) -> Result<Arc<dyn Model>> {
        self.spec.same_shape(model.spec())?;
        let mut m = self.model.write().unwrap_or_else(|e| e.into_inner());
        Ok(std::mem::replace(&mut *m, model))
    }

    /// Frees the KV cache's memory (`kv`) and the weights (`weights`); forward
    /// passes fail until [`resume_memory`](Self::resume_memory).
    pub fn release_memory(&self, kv: bool, weights: bool) {
        if kv {
            let empty = Arc::new(self.kv().released_like());
            *self.kv.write().unwrap_or_else(|e| e.into_inner()) = empty;
        }
        if weights {
            let stand_in: Arc<dyn Model> = Arc::new(ReleasedModel(self.spec.clone()));
            *self.model.write().unwrap_or_else(|e| e.into_inner()) = stand_in;
        }
    }

    /// Allocates the KV cache again if it was released (zeroed), and installs
    /// `model` when given (same shape).
    pub fn resume_memory(&self, model: Option<Arc<dyn Model>>) -> Result<()> {
        if let Some(m) = model {
            self.swap_model(m)?;
        }
        let mut kv = self.kv.write().unwrap_or_else(|e| e.into_inner());
        if kv.is_released() {
            *kv = Arc::new(KvCache::allocate_with_state(
                &*self.backend,
                *kv.spec(),
                kv.state_shape(),
            )?);
        }
        Ok(())
    }

    /// The device.
    pub fn backend(&self) -> &Arc<dyn Backend> {
        &self.backend
    }
    /// The KV cache's shape.
    pub fn kv_spec(&self) -> &KvSpec {
        &self.kv_spec
    }
    /// The KV cache now (a snapshot).
    pub fn kv(&self) -> Arc<KvCache> {
        self.kv.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
    /// A page pool matching the KV cache.
    pub fn new_page_pool(&self) -> PagePool {
        PagePool::new(self.kv_spec.num_pages, self.kv_spec.page_size)
    }

    /// Recurrent state slots the cache holds (0 for a model without
    /// recurrent layers).
    pub fn state_slots(&self) -> usize {
        self.kv().state_shape().map_or(0, |(_, n)| n)
    }

    /// A slot pool matching the cache's recurrent state slots.
    pub fn new_state_pool(&self) -> StatePool {
        StatePool::new(self.state_slots())
    }

    /// The attention implementation.
    pub fn attention(&self) -> &Arc<dyn AttentionBackend> {
        &self.attention
    }

    /// Runs one forward pass over a batch whose layout is already built.
    pub fn forward(&self, batch: &ForwardBatch) -> Result<ForwardOutput> {
        // One snapshot of the weights and the cache for the whole pass.
        let model = self.model();
        let kv = self.kv();
        let max_pos = self.spec.max_position_embeddings;
        if let Some(s) = batch.layout.seqs.iter().find(|s| s.kv_len() > max_pos) {
            return Err(CoreError::invalid(format!(
                "sequence of {} tokens exceeds the model's context of {max_pos}",
                s.kv_len()
            )));
        }
        let attention_batch = self.attention.prepare(batch.layout.clone())?;
        let ctx = ForwardContext {
            kv: &kv,
            attention: &*self.attention,
            attention_batch: &attention_batch,
        };
        model.forward(batch, &ctx)
    }

    /// Runs one forward pass; returns the logits of each sequence with `want_logits`, in order.
    pub fn step(&self, seqs: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>> {
        let ps = self.kv_spec.page_size;
        let mut layout = BatchLayout::new(ps);
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut rows = Vec::new();
        for s in seqs {
            let q_start = ids.len();
            layout.push_seq(s.prefix_len, s.tokens.len(), s.pages)?;
            if let Some(slot) = s.state_slot {
                layout.state_slots.push(slot);
            }
            ids.extend_from_slice(s.tokens);
            positions.extend((s.prefix_len..s.prefix_len + s.tokens.len()).map(|p| p as u32));
            if s.want_logits {
                rows.push((q_start + s.tokens.len() - 1) as u32);
            }
        }
        let batch = ForwardBatch {
            input_ids: ids,
            positions,
            layout: Arc::new(layout),
            logits_rows: rows,
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let out = self.forward(&batch)?;
        let flat = self.backend.download_f32(&out.logits)?;
        let vocab = self.spec.vocab_size;
        Ok(flat.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
    }
}

/// How generation of one sequence ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An EOS or stop token id (the id).
    Stop(u32),
    /// `max_new_tokens` reached.
    Length,
}

/// Output of [`generate_static`] for one prompt.
#[derive(Clone, Debug)]
pub struct StaticOutput {
    /// Generated ids (including a final stop id, when one ended it).
    pub tokens: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
}

/// Timings of [`generate_static`].
#[derive(Clone, Copy, Debug, Default)]
pub struct StaticTimings {
    /// Time of the prefill forward (all prompts in one batch).
    pub prefill: Duration,
    /// Time of all decode steps.
    pub decode: Duration,
    /// Decode steps run.
    pub decode_steps: usize,
}

/// What sampling needs besides the parameters.
pub struct SamplingSetup<'a> {
    /// The sampler.
    pub sampler: &'a dyn Sampler,
    /// Processors applied in order before sampling.
    pub processors: &'a [Arc<dyn LogitsProcessor>],
    /// Ids that end generation unless `ignore_eos`.
    pub eos_token_ids: &'a [u32],
}

/// Picks the next token of one sequence from its logits.
pub fn sample_next(
    logits: &mut [f32],
    prompt: &[u32],
    output: &[u32],
    params: &SamplingParams,
    setup: &SamplingSetup<'_>,
    rng: &mut SeqRng,
    mask: Option<&crate::grammar::TokenBitmask>,
) -> Result<u32> {
    let ctx = LogitsContext {
        prompt,
        output,
        params,
    };
    if output.len() < params.min_new_tokens {
        for &e in setup.eos_token_ids.iter().chain(&params.stop_token_ids) {
            if let Some(l) = logits.get_mut(e as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    for p in setup.processors {
        p.process(logits, &ctx)?;
    }
    if let Some(m) = mask {
        m.apply_to_logits(logits);
    }
    setup.sampler.sample(logits, params, rng)
}

/// Whether `token` ends a sequence with `params`.
#[inline]
pub fn is_stop(token: u32, params: &SamplingParams, eos: &[u32]) -> bool {
    params.stop_token_ids.contains(&token) || (!params.ignore_eos && eos.contains(&token))
}

/// Generates for a fixed batch: one prefill of all prompts, then decode steps
/// until every sequence stops. `on_token(seq, token)` sees each new token.
pub fn generate_static(
    runner: &ModelRunner,
    pool: &PagePool,
    prompts: &[Vec<u32>],
    params: &[SamplingParams],
    setup: &SamplingSetup<'_>,
    on_token: &mut dyn FnMut(usize, u32),
) -> Result<(Vec<StaticOutput>, StaticTimings)> {
    if prompts.len() != params.len() {
        return Err(CoreError::invalid(
            "one SamplingParams per prompt is required",
        ));
    }
    let vocab = runner.model().spec().vocab_size;
    for (p, sp) in prompts.iter().zip(params) {
        if p.is_empty() {
            return Err(CoreError::invalid("empty prompt"));
        }
        sp.validate(vocab)?;
    }
    let mut pages: Vec<PageSet> = Vec::with_capacity(prompts.len());
    for (p, sp) in prompts.iter().zip(params) {
        pages.push(pool.alloc(pool.pages_for(p.len() + sp.max_new_tokens))?);
    }
    // One recurrent state slot per sequence, for a model that keeps state.
    let state_pool = runner.new_state_pool();
    let slots: Vec<Option<StateSlot>> = prompts
        .iter()
        .map(|_| {
            (runner.spec().state.is_some())
                .then(|| state_pool.alloc())
                .transpose()
        })
        .collect::<Result<_>>()?;
    let slot_of = |i: usize| slots[i].as_ref().map(StateSlot::index);
    let mut rngs: Vec<SeqRng> = params
        .iter()
        .map(|p| p.seed.map_or_else(SeqRng::from_entropy, SeqRng::new))
        .collect();
    let mut outs: Vec<Vec<u32>> = vec![Vec::new(); prompts.len()];
    let mut finish: Vec<Option<FinishReason>> = vec![None; prompts.len()];
    let mut timings = StaticTimings::default();

    let t0 = Instant::now();
    let steps: Vec<SeqStep<'_>> = prompts
        .iter()
        .zip(&pages)
        .enumerate()
        .map(|(i, (p, pg))| SeqStep {
            tokens: p,
            prefix_len: 0,
            pages: pg.pages(),
            want_logits: true,
            state_slot: slot_of(i),
        })
        .collect();
    let mut logits = runner.step(&steps)?;
    timings.prefill = t0.elapsed();

    let t1 = Instant::now();
    // `order[i]` is the sequence whose logits are row i.
    let mut order: Vec<usize> = (0..prompts.len()).collect();
    loop {
        let mut active = Vec::new();
        for (l, &seq) in logits.iter_mut().zip(&order) {
            let tok = sample_next(
                l,
                &prompts[seq],
                &outs[seq],
                &params[seq],
                setup,
                &mut rngs[seq],
                None,
            )?;
            outs[seq].push(tok);
            on_token(seq, tok);
            if is_stop(tok, &params[seq], setup.eos_token_ids) {
                finish[seq] = Some(FinishReason::Stop(tok));
            } else if outs[seq].len() >= params[seq].max_new_tokens {
                finish[seq] = Some(FinishReason::Length);
            } else {
                active.push(seq);
            }
        }
        if active.is_empty() {
            break;
        }
        let last: Vec<[u32; 1]> = active
            .iter()
            .map(|&s| [outs[s][outs[s].len() - 1]])
            .collect();
        let steps: Vec<SeqStep<'_>> = active
            .iter()
            .zip(&last)
            .map(|(&s, tok)| SeqStep {
                tokens: tok,
                prefix_len: prompts[s].len() + outs[s].len() - 1,
                pages: pages[s].pages(),
                want_logits: true,
                state_slot: slot_of(s),
            })
            .collect();
        logits = runner.step(&steps)?;
        timings.decode_steps += 1;
        order = active;
    }
    timings.decode = t1.elapsed();
    drop(pages);
    let outputs = outs
        .into_iter()
        .zip(finish)
        .map(|(tokens, f)| StaticOutput {
            tokens,
            finish: f.unwrap_or(FinishReason::Length),
        })
        .collect();
    Ok((outputs, timings))
}
