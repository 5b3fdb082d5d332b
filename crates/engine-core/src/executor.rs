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
//! Verification (greedy): walk the drafts from the root; while the target's
//! token at the current row equals a draft child, accept it and move there;
//! the first disagreement (or the end) contributes the target's own token.
//! Verification (temperature > 0): recursive rejection sampling at each row
//! ([`verify_row`]): a child drawn from the drafter's `q` is accepted with
//! probability `min(1, p(d) / q(d))`, a deterministic one (a point mass)
//! with probability `p(d)`; after a rejection `p` keeps only the residual
//! and the next child is tried; when no child is accepted, the token is
//! drawn from what is left of `p`. The output distribution is then exactly
//! that of plain sampling.

use crate::attention::BatchLayout;
use crate::backend::{Backend, SampleRow};
use crate::error::{CoreError, Result};
use crate::kv::KvSpec;
use crate::logit_edits::{LogitEdits, RowEdits};
use crate::lora::LoraSegment;
use crate::model::{ForwardBatch, ModelSpec};
use crate::runner::ModelRunner;
use crate::sampling::{
    LogitsContext, LogitsProcessor, Sampler, SamplingParams, SeqRng, argmax, filtered_candidates,
};
use crate::step::{
    MaskInput, SampleRows, SampleSpec, SeqOutput, SeqPlan, StepMasks, StepOutput, StepPlan,
    TokenLogprob,
};
use crate::tensor::Tensor;
use crate::tier::{CopyDirection, KvCopyStats, KvTierOps};
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
    /// Tokens routed to each expert of each MoE layer so far (empty for a
    /// dense model).
    fn expert_load(&self) -> Vec<crate::moe::ExpertLoad> {
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

/// What [`Executor::memory`] does.
pub enum MemoryOp {
    /// Run on these weights from the next step (same shape).
    SwapModel(Arc<dyn crate::model::Model>),
    /// Free the KV cache's memory and/or the weights.
    Release { kv: bool, weights: bool },
    /// Allocate the KV cache again, and install these weights when given.
    Resume(Option<Arc<dyn crate::model::Model>>),
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
    /// sampler, no draft rejection sampling, no logprobs (what else acts on
    /// its rows goes into [`LogitEdits`] by [`Self::seq_edits`]).
    fn device_samples(&self, s: &SampleSpec, standard: bool) -> bool {
        let verify_sampled = matches!(s.rows, SampleRows::Verify { .. }) && !s.params.is_greedy();
        standard && !verify_sampled && s.logprobs.is_none()
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
        let (empty_prompt, empty_output) = (Vec::new(), Vec::new());
        let (prompt, output) = sp
            .context
            .as_ref()
            .map_or((&empty_prompt, &empty_output), |c| (&*c.prompt, &c.output));
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
        ids.extend_from_slice(&s.tokens);
        match &s.tree {
            // A chain's positions follow one another (no list built).
            None => {
                positions.extend((s.prefix_len..s.prefix_len + s.tokens.len()).map(|p| p as u32))
            }
            Some(_) => positions.extend(s.positions()),
        }
        first_row[i] = rows.len();
        rows.extend(s.sampled_rows().map(|r| (q_start + r) as u32));
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

impl Executor for LocalExecutor {
    fn model_spec(&self) -> &ModelSpec {
        self.runner.spec()
    }

    fn kv_spec(&self) -> &KvSpec {
        self.runner.kv_spec()
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        ExecutorCapabilities {
            asynchronous: self.runner.backend().capabilities().asynchronous,
            tree: self.runner.attention().capabilities().tree,
        }
    }

    fn sampler_name(&self) -> &str {
        self.sampler.name()
    }

    fn needs_context(&self, params: &SamplingParams) -> bool {
        self.processors.iter().any(|p| p.is_active(params))
    }

    fn expert_load(&self) -> Vec<crate::moe::ExpertLoad> {
        self.runner.model().expert_load()
    }

    fn memory(&self, op: MemoryOp) -> Result<()> {
        match op {
            MemoryOp::SwapModel(m) => self.runner.swap_model(m).map(drop),
            MemoryOp::Release { kv, weights } => {
                self.runner.release_memory(kv, weights);
                Ok(())
            }
            MemoryOp::Resume(m) => self.runner.resume_memory(m),
        }
    }

    fn execute(&self, plan: &StepPlan) -> Result<StepOutput> {
        let kv_copy = self.copy_tier_pages(&plan.kv_ops)?;
        if plan.seqs.is_empty() {
            return Ok(StepOutput {
                seqs: Vec::new(),
                kv_copy,
                host_sampled_rows: 0,
            });
        }
        let ps = self.runner.kv_spec().page_size;
        let (batch, first_row, q_starts) = build_batch(plan, ps)?;
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
        let mut dev_rows_so_far = 0u32;
        for (i, s) in plan.seqs.iter().enumerate() {
            let Some(sp) = s.sample.as_ref() else {
                on_device.push(true);
                continue;
            };
            let seq_masks = masks.and_then(|m| m.get(i)).map_or(&[][..], Vec::as_slice);
            let seq_edits = self
                .device_samples(sp, standard)
                .then(|| self.seq_edits(s, sp, seq_masks, dev_rows_so_far, vocab))
                .flatten();
            on_device.push(seq_edits.is_some());
            if let Some(e) = seq_edits {
                e.add_to(&mut edits)?;
                dev_rows_so_far += s.sampled_rows().len() as u32;
            }
        }
        let rows_of = |want: bool| -> Vec<u32> {
            plan.seqs
                .iter()
                .zip(&first_row)
                .zip(&on_device)
                .filter(|(_, d)| **d == want)
                .flat_map(|((s, &r0), _)| (r0..r0 + s.sampled_rows().len()).map(|r| r as u32))
                .collect()
        };
        let (dev_rows, host_rows) = (rows_of(true), rows_of(false));
        let total = batch.logits_rows.len();
        // Device ids and host logits, each in the order of its rows.
        let dev_ids = if dev_rows.is_empty() {
            Vec::new()
        } else {
            let t = select_rows(&**backend, &out.logits, &dev_rows, total)?;
            let dev_seqs = plan
                .seqs
                .iter()
                .zip(&on_device)
                .filter(|(_, d)| **d)
                .map(|(s, _)| s);
            if !edits.is_empty() {
                backend.edit_logits(&t, &edits)?;
            }
            sample_on_device(&**backend, &t, dev_seqs)?
        };
        let host_logits = if host_rows.is_empty() {
            Vec::new()
        } else {
            let t = select_rows(&**backend, &out.logits, &host_rows, total)?;
            backend.download_f32(&t)?
        };
        let (mut di, mut hi) = (0usize, 0usize);
        let mut seqs: Vec<SeqOutput> = Vec::with_capacity(plan.seqs.len());
        for (i, s) in plan.seqs.iter().enumerate() {
            let n = if s.sample.is_some() {
                s.sampled_rows().len()
            } else {
                0
            };
            if on_device[i] {
                seqs.push(verify_ids(s, &dev_ids[di..di + n]));
                di += n;
                continue;
            }
            let rows = &host_logits[hi * vocab..(hi + n) * vocab];
            hi += n;
            let m = masks.and_then(|m| m.get(i)).map(Vec::as_slice);
            seqs.push(
                self.sample_on_host(s, rows, vocab, m.unwrap_or(&[]))
                    .unwrap_or_else(|e| SeqOutput {
                        error: Some(e.to_string()),
                        ..SeqOutput::default()
                    }),
            );
        }
        for (seq, out) in plan.seqs.iter().zip(&seqs) {
            if seq.tree.is_some() && !out.accepted_path.is_empty() {
                self.compact_accepted(seq, &out.accepted_path)?;
            }
        }
        if !plan.hidden_layers.is_empty() {
            let hidden_size = self.model_spec().hidden_size;
            for t in &out.hidden {
                let h = backend.download_f32(t)?;
                for (s, (seq, &r0)) in seqs.iter_mut().zip(plan.seqs.iter().zip(&q_starts)) {
                    let n = seq.tokens.len();
                    s.hidden
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

/// Rows `rows` (of `total`) of the logits: the tensor itself when that is
/// all of them in order (with LoRA adapters the packed order may differ
/// from the plan's).
fn select_rows(
    backend: &(dyn Backend + 'static),
    logits: &Tensor,
    rows: &[u32],
    total: usize,
) -> Result<Tensor> {
    if rows.len() == total && rows.iter().enumerate().all(|(i, &r)| r as usize == i) {
        return Ok(logits.clone());
    }
    let idx = backend.upload_u32(&[rows.len()], rows)?;
    let out = backend.alloc(crate::DType::F32, &[rows.len(), logits.row_len()])?;
    backend.gather_rows(logits, &idx, &out)?;
    Ok(out)
}

/// One id per sampled row of `seqs` (whose rows `logits` holds, in order),
/// drawn by [`Backend::sample`].
fn sample_on_device<'a>(
    backend: &dyn Backend,
    logits: &Tensor,
    seqs: impl Iterator<Item = &'a SeqPlan>,
) -> Result<Vec<u32>> {
    let mut rows = Vec::new();
    for s in seqs {
        let Some(sp) = &s.sample else { continue };
        // Verify rows reach the device only when greedy, so one seed serves every row.
        let row = SampleRow::of(&sp.params, sp.seed);
        rows.extend(std::iter::repeat_n(row, s.sampled_rows().len()));
    }
    let out = backend.alloc(crate::DType::U32, &[rows.len()])?;
    backend.sample(logits, &rows, &out)?;
    let mut bytes = vec![0u8; rows.len() * 4];
    backend.download(&out, &mut bytes)?;
    Ok(bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// The children (row indices within the sampled rows) of row `at`, in order.
fn children(s: &SeqPlan, at: usize) -> Vec<usize> {
    let n = s.sampled_rows().len();
    let base = s.tokens.len() - n;
    match &s.tree {
        Some(parents) => (at + 1..n)
            .filter(|&j| parents[base + j] == (base + at) as i32)
            .collect(),
        None if at + 1 < n => vec![at + 1],
        None => Vec::new(),
    }
}

/// Output of a sequence from the target's token at each sampled row (greedy
/// verification, or a single sampled row).
fn verify_ids(s: &SeqPlan, ids: &[u32]) -> SeqOutput {
    let base = s.tokens.len() - ids.len();
    let mut out = SeqOutput::default();
    let mut at = 0;
    while let Some(&t) = ids.get(at) {
        out.tokens.push(t);
        let next = children(s, at)
            .into_iter()
            .find(|&c| s.tokens[base + c] == t);
        match next {
            Some(c) => {
                out.accepted += 1;
                if s.tree.is_some() {
                    out.accepted_path.push(base + c);
                }
                at = c;
            }
            None => break,
        }
    }
    out
}

fn log_sum_exp(v: &[f32]) -> f32 {
    let m = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m;
    }
    m + v.iter().map(|x| (x - m).exp()).sum::<f32>().ln()
}

fn top_n(v: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 {
        return Vec::new();
    }
    let mut idx: Vec<(u32, f32)> = v.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
    let k = n.min(idx.len());
    idx.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
    idx.truncate(k);
    idx.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    idx
}

impl LocalExecutor {
    /// Runs a plan's copies between device pages and host slots, in order.
    /// A host page holds, per layer, the page's K bytes then its V bytes. On
    /// the CPU a copy is a memcpy; it is still counted and timed.
    fn copy_tier_pages(&self, ops: &KvTierOps) -> Result<KvCopyStats> {
        let mut stats = KvCopyStats::default();
        let Some(host) = ops.host.as_ref().filter(|_| !ops.is_empty()) else {
            return Ok(stats);
        };
        let start = std::time::Instant::now();
        let kv = self.runner.kv();
        let spec = *kv.spec();
        let backend = self.runner.backend();
        let part = spec.bytes_per_token() * spec.page_size / (2 * spec.num_layers);
        if host.page_bytes() != 2 * spec.num_layers * part {
            return Err(CoreError::invalid(format!(
                "host KV pages of {} bytes for device pages of {}",
                host.page_bytes(),
                2 * spec.num_layers * part
            )));
        }
        let mut views = Vec::with_capacity(2 * spec.num_layers);
        for c in &ops.copies {
            if c.device_page as usize >= spec.num_pages {
                return Err(CoreError::invalid(format!(
                    "KV copy of device page {} of {}",
                    c.device_page, spec.num_pages
                )));
            }
            let first = c.device_page as usize * spec.page_size;
            views.clear();
            for l in 0..spec.num_layers {
                let layer = kv.layer(l)?;
                views.push(layer.k.narrow(first, spec.page_size)?);
                views.push(layer.v.narrow(first, spec.page_size)?);
            }
            let mut failed = None;
            match c.direction {
                CopyDirection::ToHost => {
                    let written = host.write(c.host, |bytes| {
                        for (view, dst) in views.iter().zip(bytes.chunks_exact_mut(part)) {
                            if let Err(e) = backend.download(view, dst) {
                                failed = Some(e);
                                return;
                            }
                        }
                    });
                    if !written {
                        return Err(CoreError::Internal(format!(
                            "KV backup into freed host slot {}",
                            c.host.slot
                        )));
                    }
                    stats.pages_to_host += 1;
                }
                CopyDirection::ToDevice => {
                    let read = host.read(c.host, std::time::Duration::ZERO, |bytes| {
                        for (view, src) in views.iter().zip(bytes.chunks_exact(part)) {
                            if let Err(e) = backend.write(view, src) {
                                failed = Some(e);
                                return;
                            }
                        }
                    });
                    if read.is_none() {
                        return Err(CoreError::Internal(format!(
                            "KV load from host slot {} that holds no page",
                            c.host.slot
                        )));
                    }
                    stats.pages_to_device += 1;
                }
            }
            if let Some(e) = failed {
                return Err(e);
            }
            stats.bytes += host.page_bytes() as u64;
        }
        stats.seconds = start.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// After a draft tree's verification, moves the KV of the accepted path
    /// (plan indices `path`, increasing) into chain order, so that the
    /// sequence's first `prefix_len + 1 + path.len()` slots hold its tokens
    /// in order. Safe in place: the j-th accepted token moves from index
    /// `path[j] >= j + 1` to `j + 1`, and later sources lie past every
    /// earlier destination.
    fn compact_accepted(&self, s: &SeqPlan, path: &[usize]) -> Result<()> {
        let kv = self.runner.kv();
        let ps = kv.spec().page_size;
        let slot = |i: usize| -> Result<usize> {
            let t = s.prefix_len + i;
            let page = s
                .pages
                .get(t / ps)
                .ok_or_else(|| crate::error::CoreError::invalid("draft past its pages"))?;
            Ok(*page as usize * ps + t % ps)
        };
        let backend = self.runner.backend();
        for (j, &src) in path.iter().enumerate() {
            let dst = j + 1;
            if src == dst {
                continue;
            }
            let (from, to) = (slot(src)?, slot(dst)?);
            for l in 0..kv.spec().num_layers {
                let layer = kv.layer(l)?;
                for t in [&layer.k, &layer.v] {
                    backend.copy(&t.narrow(from, 1)?, &t.narrow(to, 1)?)?;
                }
            }
        }
        Ok(())
    }

    /// Samples (and verifies) one sequence's rows on the host.
    fn sample_on_host(
        &self,
        s: &SeqPlan,
        rows: &[f32],
        vocab: usize,
        masks: &[crate::grammar::TokenBitmask],
    ) -> Result<SeqOutput> {
        let Some(sp) = &s.sample else {
            return Ok(SeqOutput::default());
        };
        let p = &*sp.params;
        let n = s.sampled_rows().len();
        let base = s.tokens.len() - n;
        let mut rng = SeqRng::new(sp.seed);
        let mut out = SeqOutput::default();
        // Output so far, extended by the accepted drafts (what processors see).
        let mut history: Vec<u32> = sp
            .context
            .as_ref()
            .map(|c| c.output.clone())
            .unwrap_or_default();
        let empty: Vec<u32> = Vec::new();
        let prompt = sp.context.as_ref().map_or(&empty, |c| &*c.prompt);
        let mut at = 0;
        loop {
            let raw = &rows[at * vocab..(at + 1) * vocab];
            let mut l = raw.to_vec();
            if sp.generated + out.tokens.len() < p.min_new_tokens {
                for &e in self.eos.iter().chain(&p.stop_token_ids) {
                    if let Some(x) = l.get_mut(e as usize) {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
            let ctx = LogitsContext {
                prompt,
                output: &history,
                params: p,
            };
            for q in &self.processors {
                if q.is_active(p) {
                    q.process(&mut l, &ctx)?;
                }
            }
            if let Some(m) = masks.get(at) {
                m.apply_to_logits(&mut l);
            }
            let kids = children(s, at);
            let (tok, next) = if kids.is_empty() {
                (self.sampler.sample(&mut l, p, &mut rng)?, None)
            } else if p.is_greedy() {
                let t = argmax(&l);
                (t, kids.into_iter().find(|&c| s.tokens[base + c] == t))
            } else {
                // Draft token `c - 1` sits at row `c`; siblings share one `q`.
                let q = sp.draft_probs.get(kids[0] - 1).map(|q| &q[..]);
                let drafts: Vec<u32> = kids.iter().map(|&c| s.tokens[base + c]).collect();
                let (t, i) = verify_row(&l, p, &drafts, q, &mut rng);
                (t, i.map(|i| kids[i]))
            };
            if let Some(top) = sp.logprobs {
                let lse = log_sum_exp(raw);
                out.logprobs.push(TokenLogprob {
                    token: tok,
                    logprob: raw.get(tok as usize).copied().unwrap_or(f32::NEG_INFINITY) - lse,
                    top: top_n(raw, top)
                        .into_iter()
                        .map(|(t, x)| (t, x - lse))
                        .collect(),
                });
            }
            out.tokens.push(tok);
            history.push(tok);
            match next {
                Some(c) => {
                    out.accepted += 1;
                    if s.tree.is_some() {
                        out.accepted_path.push(base + c);
                    }
                    at = c;
                }
                None => break,
            }
        }
        Ok(out)
    }
}

/// Verification of one row's draft children (`drafts`, in order) by
/// recursive rejection sampling, which keeps the token's law exactly `p`,
/// the standard sampler's filtered distribution of `logits`. Child `x` is
/// accepted with probability `min(1, p(x) / q(x))`; on rejection `p`
/// becomes `max(0, p - q)` normalized and `q` loses `x` (renormalized), so
/// children drawn from `q` without replacement, in order, are each checked
/// against the law they were drawn from (Leviathan et al. for one child;
/// Jeon et al.'s recursive speculative decoding for several). Without `q`,
/// or for a child that `q` does not hold, the child is a point mass:
/// accepted with probability `p(x)`, after which `p` loses `x` (SGLang's
/// target-only verification). Returns the token and the index of the
/// accepted child (`None`: drawn from what is left of `p`).
fn verify_row(
    logits: &[f32],
    params: &SamplingParams,
    drafts: &[u32],
    q_dist: Option<&[(f32, u32)]>,
    rng: &mut SeqRng,
) -> (u32, Option<usize>) {
    let point = |t: u32| (t, drafts.iter().position(|&d| d == t));
    let Some(cand) = filtered_candidates(logits, params) else {
        // Nothing finite: the plain sampler takes the argmax; so does this.
        return point(argmax(logits));
    };
    // Dense over the vocabulary: each rejection updates every entry.
    let mut p = vec![0f32; logits.len()];
    for (w, t) in cand {
        if let Some(x) = p.get_mut(t as usize) {
            *x = w;
        }
    }
    if !normalize(&mut p) {
        return point(argmax(logits));
    }
    let mut q = Vec::new();
    if let Some(dist) = q_dist {
        q = vec![0f32; logits.len()];
        for &(w, t) in dist {
            if let Some(x) = q.get_mut(t as usize) {
                *x = w;
            }
        }
        if !normalize(&mut q) {
            q.clear();
        }
    }
    for (i, &d) in drafts.iter().enumerate() {
        let pd = p.get(d as usize).copied().unwrap_or(0.0);
        let qd = q.get(d as usize).copied().unwrap_or(0.0);
        // q(d) = 0: d cannot have come from q; it counts as a point mass.
        let accept = if qd > 0.0 { (pd / qd).min(1.0) } else { pd };
        if rng.next_f32() < accept {
            return (d, Some(i));
        }
        // The residual; nothing only through rounding (p = q accepts
        // surely, as does p = δ_d): then p stays.
        if qd > 0.0 {
            let mass: f32 = p.iter().zip(&q).map(|(x, y)| (x - y).max(0.0)).sum();
            if mass > 0.0 && mass.is_finite() {
                for (x, y) in p.iter_mut().zip(&q) {
                    *x = (*x - y).max(0.0) / mass;
                }
            }
        } else if let Some(x) = p.get_mut(d as usize) {
            let pd = std::mem::take(x);
            if !normalize(&mut p) {
                p[d as usize] = pd;
            }
        }
        if let Some(x) = q.get_mut(d as usize) {
            *x = 0.0;
            if !normalize(&mut q) {
                q.clear();
            }
        }
    }
    let mut r = rng.next_f32();
    let mut last = 0;
    for (t, &x) in p.iter().enumerate() {
        if x > 0.0 {
            r -= x;
            last = t;
            if r < 0.0 {
                break;
            }
        }
    }
    (last as u32, None)
}

/// Scales `d` to sum to 1; false when it sums to nothing.
fn normalize(d: &mut [f32]) -> bool {
    let total: f32 = d.iter().sum();
    if total.is_nan() || total <= 0.0 {
        return false;
    }
    for x in d.iter_mut() {
        *x /= total;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Draws `k` distinct tokens from `q` without replacement, in order.
    fn draws(q: &[f32], k: usize, rng: &mut SeqRng) -> Vec<u32> {
        let mut left = q.to_vec();
        let mut out = Vec::new();
        for _ in 0..k {
            let total: f32 = left.iter().sum();
            let mut r = rng.next_f32() * total;
            let mut pick = left.len() - 1;
            for (i, &w) in left.iter().enumerate() {
                if w > 0.0 {
                    pick = i;
                    r -= w;
                    if r < 0.0 {
                        break;
                    }
                }
            }
            out.push(pick as u32);
            left[pick] = 0.0;
        }
        out
    }

    /// Token frequencies and acceptance rate of `n` verifications of `k`
    /// children drawn from `q` (or point masses at `fixed` when set).
    fn run(p: &[f32], q: &[f32], k: usize, fixed: Option<&[u32]>, n: usize) -> (Vec<f64>, f64) {
        let logits: Vec<f32> = p.iter().map(|x| x.ln()).collect();
        let params = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        let dist: Vec<(f32, u32)> = q.iter().enumerate().map(|(t, &w)| (w, t as u32)).collect();
        let mut counts = vec![0usize; p.len()];
        let mut accepted = 0usize;
        let mut rng = SeqRng::new(11);
        for _ in 0..n {
            let (drafts, q) = match fixed {
                Some(f) => (f.to_vec(), None),
                None => (draws(q, k, &mut rng), Some(&dist[..])),
            };
            let (t, acc) = verify_row(&logits, &params, &drafts, q, &mut rng);
            if let Some(i) = acc {
                assert_eq!(drafts[i], t);
                accepted += 1;
            }
            counts[t as usize] += 1;
        }
        let f = counts.iter().map(|&c| c as f64 / n as f64).collect();
        (f, accepted as f64 / n as f64)
    }

    fn assert_close(f: &[f64], p: &[f32]) {
        for (x, &y) in f.iter().zip(p) {
            assert!((x - f64::from(y)).abs() < 0.005, "{f:?} against {p:?}");
        }
    }

    #[test]
    fn one_child_drawn_from_q_keeps_the_distribution() {
        // p = (0.5, 0.3, 0.2); the child drawn from q = (0.1, 0.6, 0.3).
        let p = [0.5f32, 0.3, 0.2];
        let (f, a) = run(&p, &[0.1, 0.6, 0.3], 1, None, 200_000);
        assert_close(&f, &p);
        // Acceptance is sum(min(p, q)) = 0.1 + 0.3 + 0.2 = 0.6.
        assert!((a - 0.6).abs() < 0.005, "accept rate {a}");
    }

    #[test]
    fn children_drawn_without_replacement_keep_the_distribution() {
        let p = [0.4f32, 0.05, 0.25, 0.2, 0.1];
        let q = [0.05f32, 0.4, 0.1, 0.15, 0.3];
        let (f1, a1) = run(&p, &q, 1, None, 200_000);
        assert_close(&f1, &p);
        let (f3, a3) = run(&p, &q, 3, None, 200_000);
        assert_close(&f3, &p);
        // More children drawn from q accept more often.
        assert!(a3 > a1 + 0.1, "1 child {a1}, 3 children {a3}");
        let (f5, a5) = run(&p, &q, 5, None, 100_000);
        assert_close(&f5, &p);
        // All of the vocabulary drawn: one child is always accepted.
        assert!(a5 > 0.99, "3 children {a3}, all 5 {a5}");
    }

    #[test]
    fn point_mass_children_keep_the_distribution() {
        let p = [0.5f32, 0.3, 0.2];
        let (f, a) = run(&p, &[], 1, Some(&[1]), 200_000);
        assert_close(&f, &p);
        assert!((a - 0.3).abs() < 0.005, "accept rate {a}");
        let (f, a) = run(&p, &[], 2, Some(&[2, 0]), 200_000);
        assert_close(&f, &p);
        assert!((a - 0.7).abs() < 0.005, "accept rate {a}");
    }
}
