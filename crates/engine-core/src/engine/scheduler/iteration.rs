//! One scheduler iteration: decide, emit a [`StepPlan`], execute it, update.
//!
//! The plan holds, in batch order, the prefill entries (a prompt chunk each;
//! only a prompt's last chunk samples) and then the decoding requests (their
//! pending tokens — the last sampled one, plus any a grammar forced — and,
//! under speculation, a draft chain to verify). Grammar masks, one per
//! sampled row, are filled on this thread before the forward, or beside it
//! on a helper thread under overlap scheduling (then they reach the executor
//! through a channel), together with the admission of the next batch. The
//! plan's sequences are kept after the step and refilled by the next one, so
//! their token and page lists allocate only when the batch grows.
//!
//! Update: a request's `computed` grows by the tokens whose KV the step wrote
//! and kept (pending tokens plus accepted drafts); the executor's tokens are
//! appended one by one through the stop checks; pages past what the sequence
//! now holds return to the pool (rejected drafts); grammar matchers only ever
//! saw the accepted tokens (draft masks were filled by accepting drafts
//! tentatively and rolling back).

use super::speculation::draft_of;
use super::{
    AdapterKey, PrefillEntry, RequestKind, Scheduler, abort_finish, adapter_key, add_distinct,
};
use crate::engine::request::Req;
use crate::error::{CoreError, Result};
use crate::grammar::TokenBitmask;
use crate::kv::pages_for;
use crate::kv::state::StateSlot;
use crate::speculative::{Draft, Drafting};
use crate::step::{
    MaskInput, PromptLogprobs, SampleContext, SampleRows, SampleSpec, SeqOutput, SeqPlan,
    StepMasks, StepOutput, StepPlan,
};
use std::sync::Arc;
use std::time::Instant;

/// Fills the masks of `r`'s sampled rows: the next token's, then after each
/// draft token (accepted tentatively, rolled back at the end). A draft token
/// the grammar refuses ends the filling; the rows after it (never reached by
/// verification, since that token is masked out) allow everything.
fn fill_masks(
    r: &mut Req,
    drafts: &[u32],
    vocab: usize,
) -> std::result::Result<Vec<TokenBitmask>, String> {
    let Some(m) = r.matcher.as_mut() else {
        return Ok(Vec::new());
    };
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut masks = Vec::with_capacity(drafts.len() + 1);
        let mut mask = TokenBitmask::new(vocab);
        m.fill_mask(&mut mask).map_err(|e| e.to_string())?;
        let mut tentative = 0;
        for &d in drafts {
            let allowed = mask.is_allowed(d);
            masks.push(std::mem::replace(&mut mask, TokenBitmask::new(vocab)));
            if !allowed || m.accept(d).is_err() {
                break;
            }
            tentative += 1;
            m.fill_mask(&mut mask).map_err(|e| e.to_string())?;
        }
        if masks.len() == tentative {
            masks.push(mask);
        }
        if tentative > 0 {
            m.rollback(tentative).map_err(|e| e.to_string())?;
        }
        while masks.len() < drafts.len() + 1 {
            masks.push(TokenBitmask::new_allow_all(vocab));
        }
        Ok(masks)
    }));
    match run {
        Ok(r) => r,
        Err(_) => Err("the grammar matcher panicked".into()),
    }
}

/// Fills the masks of every constrained request; errors are kept on the request.
fn fill_all(constrained: &mut [(usize, &mut Req, &[u32])], seqs: usize, vocab: usize) -> StepMasks {
    let mut masks: StepMasks = vec![Vec::new(); seqs];
    for (i, r, drafts) in constrained.iter_mut() {
        match fill_masks(r, drafts, vocab) {
            Ok(m) => masks[*i] = m,
            Err(e) => r.mask_error = Some(e),
        }
    }
    masks
}

/// The requests that stay running after a forward during which the next
/// batch is admitted: how many, the tokens they are expected to add, and
/// their adapters.
struct InFlight {
    requests: usize,
    reserve: f64,
    adapters: Vec<AdapterKey>,
}

/// The requests that sample after this forward under a grammar, with their
/// plan index and drafts: a prefill entry only on its prompt's last chunk
/// (and not a prefix-only one or one with no new tokens).
fn constrained_rows<'a>(
    prefill: &'a mut [PrefillEntry],
    decoding: &'a mut [Req],
    drafts: &'a [Draft],
) -> Vec<(usize, &'a mut Req, &'a [u32])> {
    let npre = prefill.len();
    let no_drafts: &[u32] = &[];
    prefill
        .iter_mut()
        .enumerate()
        .filter(|(_, e)| e.last && e.req.token_limit() > 0)
        .map(|(i, e)| (i, &mut e.req, no_drafts))
        .chain(
            decoding
                .iter_mut()
                .enumerate()
                .map(|(i, r)| (npre + i, r, draft_of(drafts, i).tokens.as_slice())),
        )
        .filter(|(_, r, _)| r.matcher.is_some())
        .collect()
}

impl Scheduler {
    /// Sets how `r` samples this step into `slot` (a buffer reused across
    /// steps, usually holding the same request's spec of the last step).
    fn set_sample(&self, r: &mut Req, rows: SampleRows, slot: &mut Option<SampleSpec>) {
        // Whether processors act depends on the parameters alone: a slot
        // holding the same parameters answers without asking the executor.
        let needs_context = match slot {
            Some(sp) if Arc::ptr_eq(&sp.params, &r.params) => sp.context.is_some(),
            _ => self.executor.needs_context(&r.params),
        };
        let context = needs_context.then(|| SampleContext {
            prompt: r.prompt.clone(),
            output: r.output.clone(),
        });
        let seed = r.rng.next_u64();
        let logprobs = r.return_logprob.then_some(r.top_logprobs_num);
        let logprob_ids = r.token_ids_logprob.clone().filter(|_| r.return_logprob);
        match slot {
            Some(sp) => {
                if !Arc::ptr_eq(&sp.params, &r.params) {
                    sp.params = r.params.clone();
                }
                sp.rows = rows;
                sp.seed = seed;
                sp.context = context;
                sp.logprobs = logprobs;
                sp.logprob_ids = logprob_ids;
                sp.generated = r.output.len();
                sp.draft_probs.clear();
            }
            None => {
                *slot = Some(SampleSpec {
                    params: r.params.clone(),
                    rows,
                    seed,
                    context,
                    logprobs,
                    generated: r.output.len(),
                    draft_probs: Vec::new(),
                    logprob_ids,
                })
            }
        }
    }

    /// Fills `s` (a buffer reused across steps) with the plan of a prompt chunk.
    fn prefill_plan(&self, e: &mut PrefillEntry, s: &mut SeqPlan) {
        let samples = e.last && e.req.token_limit() > 0;
        s.tokens.clear();
        e.req.extend_tail(e.start, e.len, &mut s.tokens);
        s.prefix_len = e.start;
        e.req.page_table_into(&mut s.pages);
        s.tree = None;
        if samples {
            self.set_sample(&mut e.req, SampleRows::Last, &mut s.sample);
        } else {
            s.sample = None;
        }
        s.lora.clone_from(&e.req.lora);
        s.state_slot = e.req.state_slot.as_ref().map(StateSlot::index);
        // The first chunk after a cached prefix starts from its snapshot.
        s.state_ops.restore_from = match &e.req.restore {
            Some((len, slot)) if *len == e.start => Some(slot.index()),
            _ => None,
        };
        s.pool = match e.req.kind {
            RequestKind::Embed(p) => Some(p),
            _ => None,
        };
        s.prompt_logprobs = e
            .req
            .prompt_rows(e.start, e.len)
            .map(|(rows, next)| PromptLogprobs {
                rows,
                next,
                top: e.req.top_logprobs_num,
                ids: e.req.token_ids_logprob.clone(),
                ranks: e.req.prompt_logprob_ranks,
            });
    }

    /// Fills `s` (a buffer reused across steps) with the plan of a decoding
    /// request. `stamp` is the page-list stamp `s.pages` was copied at: the
    /// copy is kept while it equals the request's (a decode step's pages
    /// usually did not change since the last step).
    fn decode_plan(&self, r: &mut Req, draft: &Draft, s: &mut SeqPlan, stamp: &mut u64) {
        s.tokens.clear();
        s.prompt_logprobs = None;
        s.pool = None;
        match r.output.last() {
            // The common case: one pending token, the last sampled one.
            Some(&t) if r.computed + 1 == r.len() => s.tokens.push(t),
            _ => r.extend_tail(r.computed, usize::MAX, &mut s.tokens),
        }
        s.tokens.extend_from_slice(&draft.tokens);
        let rows = if draft.is_empty() {
            SampleRows::Last
        } else {
            SampleRows::Verify {
                drafts: draft.len(),
            }
        };
        // A tree's root is the pending token (drafting needs exactly one).
        s.tree = draft
            .layout_parents()
            .filter(|p| !draft.is_empty() && p.len() == s.tokens.len());
        s.prefix_len = r.computed;
        if *stamp != r.pages_stamp() {
            r.page_table_into(&mut s.pages);
            *stamp = r.pages_stamp();
        }
        self.set_sample(r, rows, &mut s.sample);
        if !draft.is_empty()
            && draft.probs.len() == draft.len()
            && let Some(sp) = s.sample.as_mut()
        {
            sp.draft_probs.clone_from(&draft.probs);
        }
        s.lora.clone_from(&r.lora);
        s.state_slot = r.state_slot.as_ref().map(StateSlot::index);
        // After a verification that rejected drafts: the state at the last
        // accepted token.
        s.state_ops.restore_from = match &r.restore {
            Some((len, slot)) if *len == r.computed => Some(slot.index()),
            _ => None,
        };
    }

    /// Runs the KV tier copies the cache recorded, in a step of their own
    /// (when no forward is due: an idle engine still backs up its KV);
    /// true when there were any.
    pub(super) fn run_tier_copies(&mut self) -> Result<bool> {
        let kv_ops = self.cache.take_kv_ops();
        if kv_ops.is_empty() {
            return Ok(false);
        }
        let plan = StepPlan {
            kv_ops,
            ..StepPlan::default()
        };
        match self.executor.execute(&plan) {
            Ok(o) => self.counters.kv_copy.add(&o.kv_copy),
            Err(e) => {
                tracing::error!("KV tier copies failed: {e}; flushing the prefix cache");
                self.flush_cache();
            }
        }
        Ok(true)
    }

    /// Runs one step; false when there was nothing to run.
    pub(super) fn iterate(&mut self) -> Result<bool> {
        let mut prefill = self.schedule_prefill()?;
        let decode = prefill.is_empty() || self.cfg.enable_mixed_chunk;
        if decode && !self.running.is_empty() {
            self.prepare_decode()?;
        }
        let mut decoding: Vec<Req> = if decode {
            std::mem::take(&mut self.running)
        } else {
            Vec::new()
        };
        if prefill.is_empty() && decoding.is_empty() {
            return self.run_tier_copies();
        }
        // The step's tokens before drafts (what the drafting budget is
        // weighed against): a walk over every request, only when speculating.
        let base_tokens: usize = if self.speculator.is_some() {
            prefill.iter().map(|e| e.len).sum::<usize>()
                + decoding.iter().map(|r| r.len() - r.computed).sum::<usize>()
        } else {
            0
        };
        let drafting = Instant::now();
        let mut drafts = self.draft(&mut decoding, base_tokens);
        if self.state_pool.is_some() && !drafts.is_empty() {
            self.hold_draft_states(&mut decoding, &mut drafts);
        }
        // A model drafter's forwards are part of what a draft token costs.
        let draft_secs = match self.speculator.as_ref().map(|s| s.drafting()) {
            Some(Drafting::Model { .. }) => drafting.elapsed().as_secs_f64(),
            _ => 0.0,
        };
        let (mut plan, stamps, any_grammar) = self.plan_step(&mut prefill, &mut decoding, &drafts);
        // Tokens the forward computes, for speculation's cost model only.
        let plan_tokens: usize = if self.speculator.is_some() {
            plan.seqs.iter().map(|s| s.tokens.len()).sum()
        } else {
            0
        };
        let n_seqs = plan.seqs.len();
        // Admit the next batch's prefills during this forward, unless a
        // chunked prompt is mid-way (its next chunk must come first).
        let lookahead = (self.overlap
            && self.lookahead.is_empty()
            && self.chunked.is_none()
            && !self.waiting.is_empty()
            && prefill.iter().all(|e| e.last))
        .then(|| self.in_flight(&prefill, &decoding));
        let constrained = if any_grammar {
            constrained_rows(&mut prefill, &mut decoding, &drafts)
        } else {
            Vec::new()
        };
        let started = Instant::now();
        // An admission error during the forward is reported after this
        // batch's results are delivered.
        let (result, deferred) = self.forward(&mut plan, constrained, lookahead);
        if self.speculator.is_some() {
            self.adaptive
                .cost
                .record(plan_tokens, started.elapsed().as_secs_f64() + draft_secs);
        }
        self.counters.iterations += 1;
        if let Ok(o) = &result {
            self.counters.kv_copy.add(&o.kv_copy);
        }
        let kv_ops_ran = !plan.kv_ops.is_empty();
        self.seq_bufs = std::mem::take(&mut plan.seqs);
        self.seq_stamps = stamps;
        let outputs = match result {
            Ok(o) if o.seqs.len() == n_seqs => o.seqs,
            other => {
                let msg = match other {
                    Err(e) => format!("forward pass failed: {e}"),
                    Ok(o) => format!(
                        "the executor returned {} of {n_seqs} sequences",
                        o.seqs.len()
                    ),
                };
                self.fail_step(prefill, decoding, &msg, kv_ops_ran);
                return deferred.map_or(Ok(true), Err);
            }
        };
        if self.state_pool.is_some() {
            self.settle_snapshots(&mut prefill, &mut decoding, &outputs);
        }
        self.report_states(&prefill, &decoding, &outputs);
        self.apply_outputs(prefill, decoding, &drafts, outputs)?;
        deferred.map_or(Ok(true), Err)
    }

    /// The step's plan: the prefill entries' chunks, then the decoding
    /// requests' pending tokens and drafts, in the sequence buffers of the
    /// last step (refilled: no allocation per request once they have grown)
    /// with their page-list stamps (taken and given back together); and
    /// whether any request samples under a grammar.
    fn plan_step(
        &mut self,
        prefill: &mut [PrefillEntry],
        decoding: &mut [Req],
        drafts: &[Draft],
    ) -> (StepPlan, Vec<u64>, bool) {
        let mut plan = StepPlan {
            seqs: std::mem::take(&mut self.seq_bufs),
            ..StepPlan::default()
        };
        let mut stamps = std::mem::take(&mut self.seq_stamps);
        let n_plan = prefill.len() + decoding.len();
        plan.seqs.resize_with(n_plan, SeqPlan::default);
        stamps.resize(n_plan, 0);
        let (pre_seqs, dec_seqs) = plan.seqs.split_at_mut(prefill.len());
        let (pre_stamps, dec_stamps) = stamps.split_at_mut(prefill.len());
        for ((e, s), stamp) in prefill.iter_mut().zip(pre_seqs).zip(pre_stamps) {
            self.prefill_plan(e, s);
            if self.snapshots.is_some() {
                let limit = e.req.prompt.len().saturating_sub(1);
                self.plan_snapshot(&mut e.req, (e.start, e.len, limit), s);
            }
            *stamp = 0;
        }
        // Whether any request samples under a grammar (found in the same walk).
        let mut any_grammar = prefill.iter().any(|e| e.req.matcher.is_some());
        for (i, ((r, s), stamp)) in decoding
            .iter_mut()
            .zip(dec_seqs)
            .zip(dec_stamps)
            .enumerate()
        {
            any_grammar |= r.matcher.is_some();
            self.decode_plan(r, draft_of(drafts, i), s, stamp);
            if self.snapshots.is_some() {
                let span = (s.prefix_len, s.tokens.len(), usize::MAX);
                self.plan_snapshot(r, span, s);
            }
            for (j, slot) in r.draft_states.iter().enumerate() {
                s.state_ops.snapshots.push((j + 1, slot.index()));
            }
        }
        // Copies between device and host tiers that the admissions and
        // evictions before this point recorded run first.
        plan.kv_ops = self.cache.take_kv_ops();
        plan.hidden_layers = self.planned_hidden_layers();
        if self.lora_used {
            let mut seen: Vec<AdapterKey> = Vec::new();
            add_distinct(&mut seen, plan.seqs.iter().map(|s| adapter_key(&s.lora)));
            let c = &mut self.counters.lora_max_step_adapters;
            *c = (*c).max(seen.len());
        }
        (plan, stamps, any_grammar)
    }

    /// What admission during this forward counts as running on top of
    /// `self.running`: a request whose next token is its last
    /// (max_new_tokens) leaves after this forward; the others keep running,
    /// and their pages stay counted as used until they are released.
    fn in_flight(&self, prefill: &[PrefillEntry], decoding: &[Req]) -> InFlight {
        let staying: Vec<&Req> = prefill
            .iter()
            .map(|e| &e.req)
            .filter(|r| r.kind != RequestKind::PrefixOnly)
            .chain(decoding.iter())
            .filter(|r| r.remaining_new() > 1)
            .collect();
        let reserve: f64 = staying.iter().map(|r| self.expected_new(r)).sum();
        let mut adapters: Vec<AdapterKey> = Vec::new();
        if self.lora_used {
            add_distinct(&mut adapters, staying.iter().map(|r| adapter_key(&r.lora)));
        }
        InFlight {
            requests: staying.len(),
            reserve,
            adapters,
        }
    }

    /// Executes `plan` with the grammar masks of `constrained`; under overlap
    /// scheduling the masks fill and the next batch (when `lookahead` says
    /// what stays in flight) is admitted beside the forward. Returns the
    /// forward's result and an admission error to report after it.
    fn forward(
        &mut self,
        plan: &mut StepPlan,
        mut constrained: Vec<(usize, &mut Req, &[u32])>,
        lookahead: Option<InFlight>,
    ) -> (Result<StepOutput>, Option<CoreError>) {
        let (n_seqs, vocab) = (plan.seqs.len(), self.executor.model_spec().vocab_size);
        if !self.overlap || (constrained.is_empty() && lookahead.is_none()) {
            if !constrained.is_empty() {
                plan.masks = MaskInput::Ready(fill_all(&mut constrained, n_seqs, vocab));
            }
            drop(constrained);
            return (self.executor.execute(plan), None);
        }
        let (tx, rx) = std::sync::mpsc::channel();
        if !constrained.is_empty() {
            plan.masks = MaskInput::Late(rx);
        }
        // The forward stays on this thread (device contexts and CUDA
        // graphs are bound to it); the bookkeeping runs beside it.
        let executor = Arc::clone(&self.executor);
        let sched = &mut *self;
        let plan = &*plan;
        let (result, admitted) = std::thread::scope(|s| {
            let side = s.spawn(move || {
                if !constrained.is_empty() {
                    let _ = tx.send(fill_all(&mut constrained, n_seqs, vocab));
                }
                drop(tx);
                match &lookahead {
                    Some(f) => sched.admit(f.requests, f.reserve, &f.adapters),
                    None => Ok(Vec::new()),
                }
            });
            let result = executor.execute(plan);
            let admitted = side.join().unwrap_or_else(|p| {
                Err(CoreError::Internal(format!(
                    "scheduling during the forward panicked: {}",
                    crate::grammar::panic_message(&*p)
                )))
            });
            (result, admitted)
        });
        match admitted {
            Ok(entries) => {
                self.counters.overlap_admitted_total += entries.len() as u64;
                self.lookahead = entries;
                (result, None)
            }
            Err(e) => (result, Some(e)),
        }
    }

    /// Ends every request of a step whose forward failed (`msg` says why);
    /// the followers of a prefix-only request wait again.
    fn fail_step(
        &mut self,
        prefill: Vec<PrefillEntry>,
        decoding: Vec<Req>,
        msg: &str,
        kv_ops_ran: bool,
    ) {
        tracing::error!("{msg}");
        for mut e in prefill {
            e.req
                .followers
                .drain(..)
                .for_each(|f| self.waiting.push_back(f));
            self.finish(e.req, abort_finish(msg));
        }
        for r in decoding {
            self.finish(r, abort_finish(msg));
        }
        if kv_ops_ran {
            // The tier copies may not have run: cached KV cannot be trusted.
            self.flush_cache();
        }
    }

    /// Applies a step's outputs (in plan order): a prompt chunk that is not
    /// the last is cached and stays chunked; the others advance, and those
    /// still running form the new running batch (prefills first).
    fn apply_outputs(
        &mut self,
        prefill: Vec<PrefillEntry>,
        mut decoding: Vec<Req>,
        drafts: &[Draft],
        outputs: Vec<SeqOutput>,
    ) -> Result<()> {
        self.step_time = crate::engine::request::clock_secs(Instant::now());
        if !decoding.is_empty() {
            self.new_token_ratio = (self.new_token_ratio - self.decay).max(self.min_ratio);
        }
        let mut outputs = outputs.into_iter();
        for e in prefill {
            let mut out = outputs.next().unwrap_or_default();
            let mut r = e.req;
            r.computed = e.start + e.len;
            if r.prompt_scoring.is_some() {
                let scores = std::mem::take(&mut out.extra_mut().prompt_logprobs);
                r.record_prompt_scores(e.start, e.len, scores);
            }
            let pooled = std::mem::take(&mut out.extra_mut().embedding);
            if !r.record_embedding(e.start, e.len, pooled) {
                self.finish(
                    r,
                    super::Finish::aborted(
                        crate::engine::AbortCause::Failed,
                        "this executor computes no embeddings (tensor or data-parallel attention ranks)",
                    ),
                );
                continue;
            }
            if !e.last {
                self.cache_unfinished(&mut r)?;
                self.chunked = Some(r);
                continue;
            }
            self.record_hit(&r);
            self.counters.prompt_tokens_total += if r.retractions == 0 {
                r.prompt.len() as u64
            } else {
                0
            };
            if r.token_limit() == 0 {
                self.finish(
                    r,
                    super::Finish {
                        kind: super::FinishKind::Length,
                        matched: None,
                        message: None,
                        cause: None,
                    },
                );
                continue;
            }
            if self.advance(&mut r, out, None) {
                self.running.push(r);
            }
        }
        // Decoding requests advance in place (a request is large: moving
        // each one out and back every step costs more than the rest).
        let speculating = self.speculator.is_some();
        let mut finished = 0usize;
        for (i, r) in decoding.iter_mut().enumerate() {
            let d = draft_of(drafts, i);
            let out = outputs.next().unwrap_or_default();
            r.computed = r.len();
            r.finished = !self.advance(r, out, speculating.then_some(d.len()));
            finished += usize::from(r.finished);
        }
        if finished > 0 {
            decoding.retain(|r| !r.finished);
        }
        if self.running.is_empty() {
            std::mem::swap(&mut self.running, &mut decoding);
        } else {
            self.running.append(&mut decoding);
        }
        Ok(())
    }

    /// Applies a step's output to `r`: accepted drafts (whose KV the step
    /// wrote) count as computed, the tokens go through the stop checks one by
    /// one, pages past the sequence return to the pool, then the tokens its
    /// grammar forces are appended (jump-forward) and the request streams and
    /// keeps running (true), or finishes. `drafted` is the draft length verified
    /// (`None` when the request did not decode under speculation).
    fn advance(&mut self, r: &mut Req, out: SeqOutput, drafted: Option<usize>) -> bool {
        if let Some(e) = r.mask_error.take() {
            self.finish_mut(r, abort_finish(&format!("grammar failed: {e}")));
            return false;
        }
        if let Some(e) = out.error() {
            self.finish_mut(r, abort_finish(&format!("sampling failed: {e}")));
            return false;
        }
        if out.tokens.is_empty() {
            self.finish_mut(r, abort_finish("the executor sampled no token"));
            return false;
        }
        if let Some(d) = drafted {
            let accepted = out.accepted.min(d);
            r.spec_verify_ct += 1;
            r.spec_accepted += accepted as u32;
            self.counters.spec_verify_ct_total += 1;
            self.counters.spec_draft_tokens_total += d as u64;
            self.counters.spec_accepted_tokens_total += accepted as u64;
            self.window_verify += 1;
            self.window_accepted += accepted as u64;
            self.adaptive.observe(&mut r.spec_rate, d, accepted);
        }
        r.computed += out.accepted;
        // Logprobs come with some outputs only (nothing is built otherwise).
        let mut logprobs = out.extra.map(|e| e.logprobs.into_iter());
        for &tok in out.tokens.iter() {
            let logprob = logprobs.as_mut().and_then(Iterator::next);
            if let Some(f) = self.append(r, tok, logprob) {
                r.computed = r.computed.min(r.len());
                self.trim_pages(r);
                self.finish_mut(r, f);
                return false;
            }
        }
        r.computed = r.computed.min(r.len());
        self.trim_pages(r);
        // Jump-forward: tokens the grammar forces need no forward pass each;
        // they join the next step's input with the sampled token.
        if self.cfg.enable_jump_forward {
            let forced = match r.matcher.as_mut().map(|m| m.forced_tokens()) {
                Some(Ok(f)) => f,
                Some(Err(e)) => {
                    self.finish_mut(r, abort_finish(&format!("grammar failed: {e}")));
                    return false;
                }
                None => Vec::new(),
            };
            for t in forced {
                self.counters.jump_forward_tokens_total += 1;
                if let Some(f) = self.append(r, t, None) {
                    self.finish_mut(r, f);
                    return false;
                }
            }
        }
        r.emit_at(None, &*self.decoder, self.step_time, &mut self.out);
        true
    }

    /// Returns the request's own pages past those its tokens occupy (the
    /// slots of rejected drafts) to the pool.
    fn trim_pages(&mut self, r: &mut Req) {
        let keep = pages_for(r.len(), self.page_size).saturating_sub(r.tree_pages().len());
        r.trim_own(keep);
    }
}
