//! The executor: runs a [`StepPlan`] on the model and samples where the logits are.
//!
//! [`Executor`] is what the scheduler drives; [`LocalExecutor`] is the
//! single-device implementation over a [`ModelRunner`] (one runner per rank
//! comes with tensor parallelism). It builds the typed attention layout from
//! the plan (chains and draft trees), runs the forward, then samples:
//!
//! - **On the device** when the sequence needs only what
//!   [`Backend::edit_logits`] and [`Backend::sample`] do: its rows' edits
//!   ([`LogitEdits`]: `min_new_tokens`, repetition/frequency/presence
//!   penalties, logit bias, grammar masks) go to the device, which then takes
//!   the argmax or a seeded temperature/top-k/top-p/min-p draw, and only the
//!   ids cross to the host. Greedy verification of drafts takes this path
//!   too (argmax per row, compared on the host), each row edited with the
//!   history its path implies.
//! - **On the host** otherwise — a logits processor that cannot say what it
//!   does as token edits (plugins), logprobs, a sampler other than
//!   `standard`, or rejection sampling of drafts at temperature > 0 — at the
//!   cost of copying the sequence's logits rows. Both paths edit a row to
//!   the same bits.
//!
//! Drafts are verified by the rules of [`crate::speculative::verify`].

use crate::backend::attention::BatchLayout;
use crate::backend::{Backend, MAX_TOP_LOGPROBS, SampleRow};
use crate::error::Result;
use crate::kv::KvSpec;
use crate::logprobs::{DeviceLogprobs, RowLogprob};
use crate::model::lora::LoraSegment;
use crate::model::{ForwardBatch, ModelSpec};
use crate::runner::ModelRunner;
use crate::sampling::logit_edits::{LogitEdits, RowEdits};
use crate::sampling::{LogitsContext, LogitsProcessor, Sampler, SamplingParams};
use crate::speculative::verify::verify_ids;
use crate::step::{
    MaskInput, SampleRows, SampleSpec, SeqOutput, SeqPlan, StepMasks, StepOutput, StepPlan,
    TokenLogprob,
};
use crate::tensor::Tensor;
use std::sync::Arc;

/// What an executor can run, declared once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecutorCapabilities {
    /// The device runs asynchronously to the host (overlap scheduling pays).
    pub asynchronous: bool,
    /// Draft trees can be verified (the attention implementation supports them).
    pub tree: bool,
}

/// Runs step plans.
pub trait Executor: Send + Sync {
    /// The model's shape.
    fn model_spec(&self) -> &ModelSpec;
    /// The KV cache's shape (the scheduler's page pool mirrors it).
    fn kv_spec(&self) -> &KvSpec;
    /// What the executor can run.
    fn capabilities(&self) -> ExecutorCapabilities;
    /// Name of the sampler rows are drawn with (`standard` unless configured).
    fn sampler_name(&self) -> &str;
    /// Whether some logits processor acts on a request with `params` (then
    /// plans carry the request's history).
    fn needs_context(&self, params: &SamplingParams) -> bool;
    /// Computes the plan's sequences and samples their rows.
    fn execute(&self, plan: &StepPlan) -> Result<StepOutput>;
    /// Recurrent state slots the executor's cache holds (0: none; a model
    /// with recurrent layers needs them, one per running request).
    fn state_slots(&self) -> usize {
        0
    }
    /// Tokens routed to each expert of each MoE layer so far (empty for a
    /// dense model).
    fn expert_load(&self) -> Vec<crate::model::moe::ExpertLoad> {
        Vec::new()
    }
    /// Memory control of RL weight refit, called by the scheduler between
    /// steps ([`crate::engine::refit`]). Executors without it refuse.
    fn memory(&self, _op: MemoryOp) -> Result<()> {
        Err(crate::error::CoreError::unsupported(
            "weight refit and memory release on this executor",
        ))
    }
}

/// One executor's weights: a model per tensor-parallel rank, in rank order
/// (one model without tensor parallelism), each on its rank's devices.
pub type RankWeights = Vec<Arc<dyn crate::model::Model>>;

/// What [`Executor::memory`] does.
pub enum MemoryOp {
    /// Fails unless [`MemoryOp::SwapModel`] would accept these weights (one
    /// model per rank, each of its rank's shape); changes nothing.
    Check(RankWeights),
    /// Run on these weights from the next step (checked first: on an error
    /// no rank changed).
    SwapModel(RankWeights),
    /// Free the KV cache's memory and/or the weights.
    Release { kv: bool, weights: bool },
    /// Allocate the KV cache again, and install these weights when given.
    Resume(Option<RankWeights>),
}

/// The one model of a single-rank executor's weights.
fn single(w: RankWeights) -> Result<Arc<dyn crate::model::Model>> {
    let n = w.len();
    match w.into_iter().next() {
        Some(m) if n == 1 => Ok(m),
        _ => Err(crate::error::CoreError::invalid(format!(
            "{n} models for an executor of one rank"
        ))),
    }
}

/// The single-device executor.
pub struct LocalExecutor {
    runner: Arc<ModelRunner>,
    sampler: Arc<dyn Sampler>,
    processors: Vec<Arc<dyn LogitsProcessor>>,
    eos: Vec<u32>,
}

impl LocalExecutor {
    /// Binds a runner to the sampler, processors and EOS ids of the engine.
    pub fn new(
        runner: impl Into<Arc<ModelRunner>>,
        sampler: Arc<dyn Sampler>,
        processors: Vec<Arc<dyn LogitsProcessor>>,
        eos: Vec<u32>,
    ) -> Self {
        Self {
            runner: runner.into(),
            sampler,
            processors,
            eos,
        }
    }

    /// The runner (shared with a drafter that runs the target's layers).
    pub fn runner(&self) -> &Arc<ModelRunner> {
        &self.runner
    }

    /// Whether `s` can be sampled where the logits are: the standard
    /// sampler, no draft rejection sampling, at most
    /// [`crate::backend::MAX_TOP_LOGPROBS`] alternatives (what else acts on
    /// its rows goes into [`LogitEdits`] by [`Self::seq_edits`]).
    fn device_samples(&self, s: &SampleSpec, standard: bool) -> bool {
        let verify_sampled = matches!(s.rows, SampleRows::Verify { .. }) && !s.params.is_greedy();
        standard
            && !verify_sampled
            && s.logprobs.is_none_or(DeviceLogprobs::fits)
            && s.logprob_ids.is_none()
    }

    /// Samples the device rows (`dev`, gathered in plan order) where the
    /// logits are: the logprob statistics of the raw rows that ask for them
    /// first, then the edits, then the draws. Returns one id per device row
    /// and, per device row, its logprob when its request asked (empty when
    /// no row asked).
    fn sample_device_rows(
        &self,
        logits: &Tensor,
        dev: &DeviceRows,
        edits: &LogitEdits,
    ) -> Result<(Vec<u32>, Vec<Option<RowLogprob>>)> {
        let backend = &**self.runner.backend();
        if dev.rows.is_empty() {
            return Ok((Vec::new(), Vec::new()));
        }
        let lp = (!dev.lp_rows.is_empty())
            .then(|| DeviceLogprobs::start(backend, logits, &dev.lp_rows, dev.top))
            .transpose()?;
        let t = select_rows(backend, logits, &dev.rows)?;
        if !edits.is_empty() {
            backend.edit_logits(&t, edits)?;
        }
        let out = backend.alloc(crate::DType::U32, &[dev.draws.len()])?;
        backend.sample(&t, &dev.draws, &out)?;
        let ids = backend.download_u32(&out)?;
        // Filled only when some row asked for logprobs (empty otherwise).
        let mut per_row = Vec::new();
        if let Some(lp) = lp {
            per_row.resize(ids.len(), None);
            let toks: Vec<u32> = dev.lp_at.iter().map(|&i| ids[i]).collect();
            for (&i, l) in dev.lp_at.iter().zip(lp.finish(backend, &toks)?) {
                per_row[i] = Some(l);
            }
        }
        Ok((ids, per_row))
    }

    /// True when nothing edits the rows of `sp`: no grammar mask, no active
    /// logits processor, and `min_new_tokens` reached (the common case,
    /// decided without building edits).
    fn unedited(&self, sp: &SampleSpec, masks: &[crate::grammar::TokenBitmask]) -> bool {
        masks.is_empty()
            && sp.generated >= sp.params.min_new_tokens
            && !self.processors.iter().any(|q| q.is_active(&sp.params))
    }

    /// The edits of a sequence's sampled rows (the first at `first_row` of
    /// the device's logits): `min_new_tokens`, the active logits processors
    /// (each row seeing the output extended by the drafts on its path, as
    /// the host walk does) and the grammar masks. `None` when some processor
    /// cannot say what it does as token edits.
    fn seq_edits<'m>(
        &self,
        s: &SeqPlan,
        sp: &SampleSpec,
        masks: &'m [crate::grammar::TokenBitmask],
        first_row: u32,
        vocab: usize,
    ) -> Option<SeqEdits<'m>> {
        let p = &*sp.params;
        let n = s.sampled_rows().len();
        let base = s.tokens.len() - n;
        let active: Vec<&Arc<dyn LogitsProcessor>> =
            self.processors.iter().filter(|q| q.is_active(p)).collect();
        let mut out = SeqEdits {
            rows: Vec::new(),
            masks: Vec::new(),
        };
        // Tokens accepted before row j: the drafts on the path from the root.
        let path = |j: usize| -> Vec<u32> {
            let mut toks = Vec::new();
            match &s.tree {
                None => toks.extend_from_slice(&s.tokens[base + 1..=base + j]),
                Some(parents) => {
                    let mut at = base + j;
                    while at > base {
                        toks.push(s.tokens[at]);
                        at = usize::try_from(parents[at]).unwrap_or(base);
                    }
                    toks.reverse();
                }
            }
            toks
        };
        let empty_output = Vec::new();
        let (prompt, output): (&[u32], &Vec<u32>) = sp
            .context
            .as_ref()
            .map_or((&[], &empty_output), |c| (&c.prompt, &c.output));
        for j in 0..n {
            let row = first_row + j as u32;
            let drafted = if j == 0 { Vec::new() } else { path(j) };
            let forbid_eos = sp.generated + drafted.len() < p.min_new_tokens;
            if let Some(m) = masks.get(j) {
                out.masks.push((row, m));
            }
            if active.is_empty() && !forbid_eos {
                continue;
            }
            let mut edits = RowEdits::new(row, vocab);
            if forbid_eos {
                for &e in self.eos.iter().chain(&p.stop_token_ids) {
                    edits.forbid(e);
                }
            }
            if !active.is_empty() {
                let mut history = output.clone();
                history.extend_from_slice(&drafted);
                let ctx = LogitsContext {
                    prompt,
                    output: &history,
                    params: p,
                };
                for q in &active {
                    q.edit(&ctx, &mut edits);
                }
            }
            if !edits.is_exact() {
                return None;
            }
            out.rows.push(edits);
        }
        Some(out)
    }
}

/// One sequence's share of a step's [`LogitEdits`].
struct SeqEdits<'m> {
    rows: Vec<RowEdits>,
    masks: Vec<(u32, &'m crate::grammar::TokenBitmask)>,
}

impl SeqEdits<'_> {
    fn add_to(self, all: &mut LogitEdits) -> Result<()> {
        for r in self.rows {
            r.finish(all)?;
        }
        for (row, m) in self.masks {
            all.push_mask(row, m)?;
        }
        Ok(())
    }
}

/// The rows sampled where the logits are, gathered in plan order while
/// each sequence's path is decided (one walk over the plan).
#[derive(Default)]
struct DeviceRows {
    /// Rows of the logits, and how each is drawn (verify rows reach the
    /// device only when greedy, so one seed serves every row of a sequence).
    rows: Vec<u32>,
    draws: Vec<SampleRow>,
    /// Rows of the logits whose logprobs were asked, their index in `rows`,
    /// and the most alternatives asked.
    lp_rows: Vec<u32>,
    lp_at: Vec<usize>,
    top: usize,
}

impl DeviceRows {
    /// Adds the `n` sampled rows of a sequence, the first at `first_row` of the logits.
    fn add(&mut self, sp: &SampleSpec, first_row: usize, n: usize) {
        if let Some(k) = sp.logprobs {
            self.top = self.top.max(k);
            self.lp_at.extend(self.rows.len()..self.rows.len() + n);
            self.lp_rows
                .extend((first_row..first_row + n).map(|r| r as u32));
        }
        let draw = SampleRow::of(&sp.params, sp.seed);
        // Pushed one by one: a decode sequence has one row, for which this
        // is cheaper than extending from an iterator.
        for r in first_row..first_row + n {
            self.rows.push(r as u32);
            self.draws.push(draw);
        }
    }
}

/// The packed forward batch of a plan, with each sequence's first sampled
/// row and its first packed row (both indexed by plan order). Sequences are packed in plan order, except
/// that with LoRA adapters those of one adapter are packed next to one
/// another (base rows first), one [`LoraSegment`] per adapter.
fn build_batch(
    plan: &StepPlan,
    page_size: usize,
) -> Result<(ForwardBatch, Vec<usize>, Vec<usize>)> {
    let mut layout = BatchLayout::new(page_size);
    let tokens: usize = plan.seqs.iter().map(|s| s.tokens.len()).sum();
    layout.seqs.reserve(plan.seqs.len());
    layout.slot_mapping.reserve(tokens);
    layout
        .page_table
        .reserve(plan.seqs.iter().map(|s| s.pages.len()).sum());
    let mut ids = Vec::with_capacity(tokens);
    let mut positions = Vec::with_capacity(tokens);
    let mut rows = Vec::with_capacity(plan.seqs.len());
    let mut first_row = vec![0; plan.seqs.len()];
    let mut q_starts = vec![0; plan.seqs.len()];
    // Packing order, only built when some sequence has an adapter.
    let sorted: Option<Vec<usize>> = plan.seqs.iter().any(|s| s.lora.is_some()).then(|| {
        let mut order: Vec<usize> = (0..plan.seqs.len()).collect();
        order.sort_by_key(|i| plan.seqs[*i].lora.as_ref().map(Arc::as_ptr));
        order
    });
    let mut lora: Vec<LoraSegment> = Vec::new();
    for k in 0..plan.seqs.len() {
        let i = sorted.as_ref().map_or(k, |o| o[k]);
        let s = &plan.seqs[i];
        s.validate(page_size)?;
        let q_start = ids.len();
        q_starts[i] = q_start;
        match &s.tree {
            Some(parents) => layout.push_tree_seq(s.prefix_len, parents, &s.pages)?,
            None => layout.push_seq(s.prefix_len, s.tokens.len(), &s.pages)?,
        }
        if let Some(slot) = s.state_slot {
            let seq = layout.state_slots.len();
            layout.state_slots.push(slot);
            if let Some(from) = s.state_ops.restore_from {
                layout.state_restores.push((from, slot));
            }
            for &(n, dst) in &s.state_ops.snapshots {
                layout.state_snapshots.push((seq, n, dst));
            }
        }
        // Pushed one by one: cheaper than slice and iterator extends for
        // the one token of a decode sequence, and no slower for a chunk.
        for &t in &s.tokens {
            ids.push(t);
        }
        match &s.tree {
            // A chain's positions follow one another (no list built).
            None => {
                for p in s.prefix_len..s.prefix_len + s.tokens.len() {
                    positions.push(p as u32);
                }
            }
            Some(_) => positions.extend(s.positions()),
        }
        first_row[i] = rows.len();
        for r in s.sampled_rows() {
            rows.push((q_start + r) as u32);
        }
        if let Some(a) = &s.lora {
            match lora.last_mut() {
                Some(seg) if Arc::ptr_eq(&seg.adapter, a) => seg.rows.end = ids.len(),
                _ => lora.push(LoraSegment {
                    adapter: a.clone(),
                    rows: q_start..ids.len(),
                }),
            }
        }
    }
    // Prompt rows scored for their next tokens come after every sampled
    // row, in plan order, so the sampled rows keep their indices.
    for (s, &q0) in plan.seqs.iter().zip(&q_starts) {
        if let Some(p) = &s.prompt_logprobs {
            rows.extend(p.rows.clone().map(|r| (q0 + r) as u32));
        }
    }
    let batch = ForwardBatch {
        input_ids: ids,
        positions,
        layout: Arc::new(layout),
        logits_rows: rows,
        hidden_layers: plan.hidden_layers.clone(),
        lora,
        exit_after: None,
        hidden_at_every_row: !plan.hidden_layers.is_empty(),
    };
    Ok((batch, first_row, q_starts))
}

/// With an embedding request's chunk in the plan, the final normed state
/// (layer `num_layers`) is captured at every row: its index among the
/// batch's hidden layers (added after the plan's own when they lack it).
fn pooled_hidden_layer(
    plan: &StepPlan,
    batch: &mut ForwardBatch,
    num_layers: usize,
) -> Option<usize> {
    if plan.seqs.iter().all(|s| s.pool.is_none()) {
        return None;
    }
    batch.hidden_at_every_row = true;
    Some(
        match batch.hidden_layers.iter().position(|&l| l == num_layers) {
            Some(k) => k,
            None => {
                batch.hidden_layers.push(num_layers);
                batch.hidden_layers.len() - 1
            }
        },
    )
}

/// Pools each embedding chunk's rows of `hidden` (`[tokens, hidden_size]`,
/// the final normed state at every row) into its output: the sum of its
/// rows (mean pooling) or its last row.
fn pool_embeddings(
    plan: &StepPlan,
    q_starts: &[usize],
    hidden: &[f32],
    hidden_size: usize,
    seqs: &mut [SeqOutput],
) {
    for ((s, &r0), out) in plan.seqs.iter().zip(q_starts).zip(seqs.iter_mut()) {
        let Some(pool) = s.pool else { continue };
        let n = s.tokens.len();
        let row = |r: usize| hidden.get((r0 + r) * hidden_size..(r0 + r + 1) * hidden_size);
        let v = match pool {
            crate::step::Pooling::Last => row(n - 1).map(<[f32]>::to_vec),
            crate::step::Pooling::Mean => (0..n).try_fold(vec![0f32; hidden_size], |mut acc, r| {
                let x = row(r)?;
                acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
                Some(acc)
            }),
        };
        out.extra_mut().embedding = v.unwrap_or_default();
    }
}

impl Executor for LocalExecutor {
    fn model_spec(&self) -> &ModelSpec {
        self.runner.spec()
    }

    fn kv_spec(&self) -> &KvSpec {
        self.runner.kv_spec()
    }

    fn state_slots(&self) -> usize {
        self.runner.state_slots()
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        ExecutorCapabilities {
            asynchronous: self.runner.backend().capabilities().asynchronous,
            // Recurrent state follows one chain of tokens per sequence.
            tree: self.runner.attention().capabilities().tree && self.runner.spec().state.is_none(),
        }
    }

    fn sampler_name(&self) -> &str {
        self.sampler.name()
    }

    fn needs_context(&self, params: &SamplingParams) -> bool {
        self.processors.iter().any(|p| p.is_active(params))
    }

    fn expert_load(&self) -> Vec<crate::model::moe::ExpertLoad> {
        self.runner.model().expert_load()
    }

    fn memory(&self, op: MemoryOp) -> Result<()> {
        match op {
            MemoryOp::Check(w) => self.runner.spec().same_shape(single(w)?.spec()),
            MemoryOp::SwapModel(w) => self.runner.swap_model(single(w)?).map(drop),
            MemoryOp::Release { kv, weights } => {
                self.runner.release_memory(kv, weights);
                Ok(())
            }
            MemoryOp::Resume(w) => self.runner.resume_memory(w.map(single).transpose()?),
        }
    }

    fn execute(&self, plan: &StepPlan) -> Result<StepOutput> {
        // `_loads` keeps the loaded host slots until the step's end.
        let (kv_copy, _loads) = kv_ops::copy_tier_pages(&[self], false, &plan.kv_ops)?;
        if plan.seqs.is_empty() {
            return Ok(StepOutput {
                seqs: Vec::new(),
                kv_copy,
                host_sampled_rows: 0,
            });
        }
        let ps = self.runner.kv_spec().page_size;
        let (mut batch, first_row, q_starts) = build_batch(plan, ps)?;
        let pooled_layer = pooled_hidden_layer(plan, &mut batch, self.model_spec().num_layers);
        let out = self.runner.forward(&batch)?;
        let backend = self.runner.backend();
        let vocab = self.model_spec().vocab_size;
        let late;
        let masks: Option<&StepMasks> = match &plan.masks {
            MaskInput::None => None,
            MaskInput::Ready(m) => Some(m),
            MaskInput::Late(rx) => {
                late = rx.recv().ok();
                late.as_ref()
            }
        };
        // Per sequence: sampled on the device (edits go, ids come back) or on the host.
        let standard = self.sampler.name() == "standard";
        let mut on_device = Vec::with_capacity(plan.seqs.len());
        let mut edits = LogitEdits::new(vocab);
        let mut dev = DeviceRows {
            rows: Vec::with_capacity(plan.seqs.len()),
            draws: Vec::with_capacity(plan.seqs.len()),
            ..DeviceRows::default()
        };
        // Counted in the same walk, so later walks run only when needed.
        let (mut host_seqs, mut any_tree) = (0usize, false);
        for (i, s) in plan.seqs.iter().enumerate() {
            any_tree |= s.tree.is_some();
            let Some(sp) = s.sample.as_ref() else {
                on_device.push(true);
                continue;
            };
            let seq_masks = masks.and_then(|m| m.get(i)).map_or(&[][..], Vec::as_slice);
            let device = self.device_samples(sp, standard);
            // Edits address the rows by their place among the device rows.
            let here = dev.rows.len() as u32;
            let sampled = device
                && (self.unedited(sp, seq_masks)
                    || match self.seq_edits(s, sp, seq_masks, here, vocab) {
                        Some(e) => {
                            e.add_to(&mut edits)?;
                            true
                        }
                        None => false,
                    });
            on_device.push(sampled);
            if sampled {
                dev.add(sp, first_row[i], s.sampled_rows().len());
            } else {
                host_seqs += 1;
            }
        }
        let host_rows: Vec<u32> = if host_seqs == 0 {
            Vec::new()
        } else {
            plan.seqs
                .iter()
                .zip(&first_row)
                .zip(&on_device)
                .filter(|(_, d)| !**d)
                .flat_map(|((s, &r0), _)| (r0..r0 + s.sampled_rows().len()).map(|r| r as u32))
                .collect()
        };
        // Device ids (and logprobs) and host logits, each in the order of its rows.
        let (dev_ids, dev_logprobs) = self.sample_device_rows(&out.logits, &dev, &edits)?;
        let host_logits = if host_rows.is_empty() {
            Vec::new()
        } else {
            let t = select_rows(&**backend, &out.logits, &host_rows)?;
            backend.download_f32(&t)?
        };
        let (mut di, mut hi) = (0usize, 0usize);
        let mut seqs: Vec<SeqOutput> = Vec::with_capacity(plan.seqs.len());
        for (i, s) in plan.seqs.iter().enumerate() {
            let Some(sp) = s.sample.as_ref() else {
                seqs.push(SeqOutput::default());
                continue;
            };
            let n = s.sampled_rows().len();
            if on_device[i] && n == 1 && sp.logprobs.is_none() {
                // One token, nothing to verify (a decode step).
                seqs.push(SeqOutput {
                    tokens: smallvec::smallvec![dev_ids[di]],
                    ..SeqOutput::default()
                });
                di += 1;
                continue;
            }
            if on_device[i] {
                let mut o = verify_ids(s, &dev_ids[di..di + n]);
                if let Some(k) = s.sample.as_ref().and_then(|sp| sp.logprobs) {
                    attach_logprobs(s, &mut o, &dev_logprobs[di..di + n], k);
                }
                seqs.push(o);
                di += n;
                continue;
            }
            let rows = &host_logits[hi * vocab..(hi + n) * vocab];
            hi += n;
            let m = masks.and_then(|m| m.get(i)).map(Vec::as_slice);
            seqs.push(
                self.sample_on_host(s, rows, vocab, m.unwrap_or(&[]))
                    .unwrap_or_else(|e| SeqOutput::failed(e.to_string())),
            );
        }
        self.score_prompt_rows(plan, &out.logits, &mut seqs)?;
        for (seq, out) in plan.seqs.iter().zip(&seqs).filter(|_| any_tree) {
            if seq.tree.is_some() && !out.accepted_path().is_empty() {
                self.compact_accepted(seq, out.accepted_path())?;
            }
        }
        if let Some(k) = pooled_layer {
            let h = backend.download_f32(&out.hidden[k])?;
            pool_embeddings(
                plan,
                &q_starts,
                &h,
                self.model_spec().hidden_size,
                &mut seqs,
            );
        }
        if !plan.hidden_layers.is_empty() {
            let hidden_size = self.model_spec().hidden_size;
            for t in out.hidden.iter().take(plan.hidden_layers.len()) {
                let h = backend.download_f32(t)?;
                for (s, (seq, &r0)) in seqs.iter_mut().zip(plan.seqs.iter().zip(&q_starts)) {
                    let n = seq.tokens.len();
                    s.extra_mut()
                        .hidden
                        .push(h[r0 * hidden_size..(r0 + n) * hidden_size].to_vec());
                }
            }
        }
        Ok(StepOutput {
            seqs,
            kv_copy,
            host_sampled_rows: host_rows.len(),
        })
    }
}

impl LocalExecutor {
    /// The log-probabilities of the prompt tokens the plan's prompt rows
    /// predict (the logits' last rows, see [`build_batch`]), of the raw
    /// logits, into each sequence's output.
    fn score_prompt_rows(
        &self,
        plan: &StepPlan,
        logits: &Tensor,
        seqs: &mut [SeqOutput],
    ) -> Result<()> {
        let wanted: usize = plan
            .seqs
            .iter()
            .filter_map(|s| s.prompt_logprobs.as_ref())
            .map(|p| p.rows.len())
            .sum();
        if wanted == 0 {
            return Ok(());
        }
        let first = logits.rows() - wanted;
        let mut next = Vec::with_capacity(wanted);
        let mut top = 0;
        for p in plan.seqs.iter().filter_map(|s| s.prompt_logprobs.as_ref()) {
            next.extend_from_slice(&p.next);
            top = top.max(p.top);
        }
        let backend = &**self.runner.backend();
        // The prompt rows are the logits' tail, which nothing edits: scored in place.
        let tail = logits.narrow(first, wanted)?;
        let stats = DeviceLogprobs::of_rows(backend, tail, top.min(MAX_TOP_LOGPROBS))?;
        let scored = stats.finish(backend, &next)?;
        // Named ids and ranks are computed where the logits are, for the
        // rows of the sequences that ask for them.
        let mut named_ids: Vec<Option<&[u32]>> = Vec::with_capacity(wanted);
        let mut want_ranks = false;
        for p in plan.seqs.iter().filter_map(|s| s.prompt_logprobs.as_ref()) {
            named_ids.extend(std::iter::repeat_n(p.ids.as_deref(), p.next.len()));
            want_ranks |= p.ranks;
        }
        let mut named = stats.named(backend, &scored, &named_ids)?.into_iter();
        let ranks = if want_ranks {
            stats.ranks(backend, &next)?
        } else {
            vec![None; wanted]
        };
        let mut at = 0;
        for (s, out) in plan.seqs.iter().zip(seqs.iter_mut()) {
            let Some(p) = &s.prompt_logprobs else {
                continue;
            };
            let lps: Vec<TokenLogprob> = scored[at..at + p.next.len()]
                .iter()
                .zip(&p.next)
                .zip(&ranks[at..at + p.next.len()])
                .map(|((l, &token), &rank)| TokenLogprob {
                    token,
                    logprob: l.logprob,
                    top: l.top.iter().take(p.top).copied().collect(),
                    ids: named.next().unwrap_or_default(),
                    rank: rank.filter(|_| p.ranks),
                })
                .collect();
            out.extra_mut().prompt_logprobs.extend(lps);
            at += p.next.len();
        }
        Ok(())
    }
}

/// Rows `rows` of the logits: the tensor itself when that is all of them
/// in order (with LoRA adapters the packed order may differ from the
/// plan's).
fn select_rows(backend: &(dyn Backend + 'static), logits: &Tensor, rows: &[u32]) -> Result<Tensor> {
    if rows.len() == logits.rows() && rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
        return Ok(logits.clone());
    }
    let idx = backend.upload_u32(&[rows.len()], rows)?;
    let out = backend.alloc(crate::DType::F32, &[rows.len(), logits.row_len()])?;
    backend.gather_rows(logits, &idx, &out)?;
    Ok(out)
}

/// Adds to a device sequence's output the logprobs (with `top`
/// alternatives) of the rows its walk visited: the root, then each accepted
/// draft's row.
fn attach_logprobs(s: &SeqPlan, out: &mut SeqOutput, rows: &[Option<RowLogprob>], top: usize) {
    let base = s.tokens.len() - rows.len();
    let visited = std::iter::once(0).chain(match &s.tree {
        Some(_) => out
            .accepted_path()
            .iter()
            .map(|p| p - base)
            .collect::<Vec<_>>(),
        None => (1..out.tokens.len()).collect(),
    });
    let logprobs: Vec<TokenLogprob> = out
        .tokens
        .iter()
        .zip(visited)
        .filter_map(|(&token, row)| match rows.get(row) {
            Some(Some(l)) => Some(TokenLogprob {
                token,
                logprob: l.logprob,
                top: l.top.iter().take(top).copied().collect(),
                // Rows whose request names ids are sampled on the host.
                ids: Vec::new(),
                rank: None,
            }),
            _ => None,
        })
        .collect();
    out.extra_mut().logprobs.extend(logprobs);
}

mod host;
pub(crate) mod kv_ops;
