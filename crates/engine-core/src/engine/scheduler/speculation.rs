//! Drafting for the decoding requests of one step (speculative decoding).
//!
//! A request drafts when it decodes exactly one pending token (not right
//! after a jump-forward), will generate at least two more tokens, and its
//! tokens are drawn by the standard sampler (rejection sampling needs that
//! sampler's distribution). The speculator first sees every token the
//! request gained since it last looked, then proposes up to
//! `num_draft_tokens` (clipped to the tokens the request may still generate
//! and the context); the adaptive controller cuts drafts that do not pay;
//! pages for the kept drafts come from free or evictable pages only (never
//! by retracting another request), and a draft that finds no page is cut to
//! the slots the request already holds.
//!
//! Drafts are trees where the executor verifies trees (its attention
//! implementation supports tree masks) and the request has no grammar; the
//! executor moves the accepted path's KV into chain order after verifying.
//! Elsewhere the first chain of a proposed tree is verified.

use super::{PrefillEntry, Scheduler};
use crate::engine::request::Req;
use crate::speculative::{ComputedStates, Draft, DraftRequest, DraftSampling, Drafting};
use crate::step::{SampleRows, SeqOutput};

/// Tokens of a request's tail given to the speculator, at least (its
/// longest match window needs no more).
const MIN_TAIL: usize = 64;

/// One sequence's kept states, owned until the speculator has seen them.
struct Kept {
    key: u64,
    start: usize,
    next_tokens: Vec<u32>,
    pages: Vec<u32>,
    states: Vec<f32>,
}

impl Scheduler {
    /// The hidden layers the step plans ask for (the speculator's).
    pub(super) fn planned_hidden_layers(&self) -> Vec<usize> {
        match (&self.cfg.speculative, &self.speculator) {
            (Some(_), Some(s)) => s.hidden_layers().to_vec(),
            _ => Vec::new(),
        }
    }

    /// Tells the speculator what each sequence of the step computed and
    /// kept, with its hidden states (when it reads any): a prompt chunk's
    /// every position (the last one only when a token follows it), a
    /// decoding request's pending tokens and accepted drafts. Called before
    /// the outputs are applied (`decoding` still has its old `computed`).
    pub(super) fn report_states(
        &mut self,
        prefill: &[PrefillEntry],
        decoding: &[Req],
        outputs: &[SeqOutput],
    ) {
        let layers = match &self.speculator {
            Some(s) if !s.hidden_layers().is_empty() => s.hidden_layers().len(),
            _ => return,
        };
        let h = self.executor.model_spec().hidden_size;
        let mut kept: Vec<Kept> = Vec::with_capacity(outputs.len());
        let seqs = prefill
            .iter()
            .map(|e| (&e.req, e.start))
            .chain(decoding.iter().map(|r| (r, r.computed)));
        for (((r, start), plan), out) in seqs.zip(&self.seq_bufs).zip(outputs) {
            if out.hidden().len() != layers || out.error().is_some() {
                continue;
            }
            // Plan rows whose KV was kept, in position order.
            let rows: Vec<usize> = if out.tokens.is_empty() {
                (0..plan.tokens.len()).collect()
            } else if !out.accepted_path().is_empty() {
                std::iter::once(0)
                    .chain(out.accepted_path().iter().copied())
                    .collect()
            } else {
                let drafts = match plan.sample.as_ref().map(|s| s.rows) {
                    Some(SampleRows::Verify { drafts }) => drafts,
                    _ => 0,
                };
                (0..plan.tokens.len() - drafts + out.accepted.min(drafts)).collect()
            };
            // The token after each kept position.
            let mut next: Vec<u32> = rows.iter().skip(1).map(|&i| plan.tokens[i]).collect();
            let after = match out.tokens.last() {
                Some(&t) => Some(t),
                None => r.tail(start + plan.tokens.len()).first().copied(),
            };
            next.extend(after);
            let n = next.len().min(rows.len());
            let mut states = Vec::with_capacity(n * layers * h);
            for &i in &rows[..n] {
                for l in out.hidden() {
                    states.extend_from_slice(&l[i * h..(i + 1) * h]);
                }
            }
            let mut pages = Vec::new();
            r.page_table_into(&mut pages);
            next.truncate(n);
            kept.push(Kept {
                key: r.key,
                start,
                next_tokens: next,
                pages,
                states,
            });
        }
        let view: Vec<ComputedStates<'_>> = kept
            .iter()
            .filter(|k| !k.next_tokens.is_empty())
            .map(|k| ComputedStates {
                key: k.key,
                start: k.start,
                next_tokens: &k.next_tokens,
                pages: &k.pages,
                states: &k.states,
            })
            .collect();
        if let Some(s) = self.speculator.as_mut()
            && !view.is_empty()
        {
            s.observe_states(&view);
        }
    }

    fn may_draft(&self, r: &Req) -> bool {
        r.len() - r.computed == 1
            && r.remaining_new() > 1
            && r.kind != super::RequestKind::PrefixOnly
            && (self.executor.sampler_name() == "standard")
    }

    /// Draft tokens for each decoding request (empty where none), with pages
    /// allocated for them. A [`Drafting::Lookup`] speculator proposes first
    /// and its drafts are cut afterwards; a [`Drafting::Model`] one is told
    /// each request's granted length, with its pages held, before it runs.
    /// The list is empty when no request drafted (read it with [`draft_of`]).
    pub(super) fn draft(&mut self, decoding: &mut [Req], base_tokens: usize) -> Vec<Draft> {
        let mut drafts: Vec<Draft> = Vec::new();
        let Some(cfg) = self.cfg.speculative.clone() else {
            return drafts;
        };
        let tree_ok = self.executor.capabilities().tree;
        let context = self.executor.model_spec().max_position_embeddings;
        let eligible: Vec<usize> = (0..decoding.len())
            .filter(|&i| self.may_draft(&decoding[i]))
            .collect();
        if eligible.is_empty() {
            return drafts;
        }
        let Some(spec) = self.speculator.as_mut() else {
            return drafts;
        };
        let drafting = spec.drafting();
        // (index into `decoding`, draft limit, tree allowed) of each request asked.
        let mut picked: Vec<(usize, usize, bool)> = Vec::with_capacity(eligible.len());
        for &i in &eligible {
            let r = &mut decoding[i];
            if r.spec_observed < r.len() {
                spec.observe(r.key, &r.tail(r.spec_observed));
                r.spec_observed = r.len();
            }
            let room = context.saturating_sub(r.len() + 1);
            let mut limit = cfg.num_draft_tokens.min(r.remaining_new() - 1).min(room);
            let mut tree = tree_ok && r.matcher.is_none();
            if let Drafting::Model {
                max_tokens,
                tree: trees,
            } = drafting
            {
                limit = limit.min(max_tokens);
                tree &= trees;
            }
            if limit > 0 {
                picked.push((i, limit, tree));
            }
        }
        if let Drafting::Model { .. } = drafting {
            let mut wants: Vec<(usize, usize)> = picked.iter().map(|&(i, l, _)| (i, l)).collect();
            self.grant_and_hold(decoding, &mut wants, base_tokens, cfg.adaptive);
            for (p, (_, g)) in picked.iter_mut().zip(wants) {
                p.1 = g;
            }
            picked.retain(|p| p.1 > 0);
        }
        if picked.is_empty() {
            return drafts;
        }
        let tail_len = MIN_TAIL.max(cfg.ngram.max_match_window_size + 1);
        let model = matches!(drafting, Drafting::Model { .. });
        let mut tails: Vec<Vec<u32>> = Vec::with_capacity(picked.len());
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(if model { picked.len() } else { 0 });
        for &(i, _, _) in &picked {
            let r = &decoding[i];
            tails.push(r.tail(r.len().saturating_sub(tail_len)));
            if model {
                let mut t = Vec::new();
                r.page_table_into(&mut t);
                tables.push(t);
            }
        }
        let no_pages: &[u32] = &[];
        // A model drafter may sample a sampled request's chain (seeded from
        // the request's generator).
        let seeds: Vec<Option<u64>> = picked
            .iter()
            .map(|&(i, _, _)| {
                let r = &mut decoding[i];
                (model && !r.params.is_greedy()).then(|| r.rng.next_u64())
            })
            .collect();
        let reqs: Vec<DraftRequest<'_>> = picked
            .iter()
            .enumerate()
            .map(|(k, &(i, limit, tree))| DraftRequest {
                key: decoding[i].key,
                tokens: &tails[k],
                len: decoding[i].len(),
                max_tokens: limit,
                allow_tree: tree,
                pages: tables.get(k).map_or(no_pages, |t| t.as_slice()),
                sampling: seeds[k].map(|seed| DraftSampling {
                    params: &decoding[i].params,
                    seed,
                }),
            })
            .collect();
        let Some(spec) = self.speculator.as_mut() else {
            return drafts;
        };
        let proposed = spec.propose(&reqs);
        drop(reqs);
        let mut chains: Vec<(usize, Draft)> = Vec::new();
        for (&(i, limit, tree), d) in picked.iter().zip(proposed) {
            let mut c = match d.validate() {
                Ok(()) if tree || d.parents.is_none() => d,
                Ok(()) => d.into_first_chain(),
                Err(_) => Draft::default(),
            };
            c.truncate(limit);
            if !c.is_empty() {
                chains.push((i, c));
            }
        }
        if !model {
            let mut wants: Vec<(usize, usize)> =
                chains.iter().map(|(i, c)| (*i, c.len())).collect();
            self.grant_and_hold(decoding, &mut wants, base_tokens, cfg.adaptive);
            for ((_, c), (_, g)) in chains.iter_mut().zip(wants) {
                c.truncate(g);
            }
        }
        let mut granted = 0usize;
        if !chains.is_empty() {
            drafts.resize_with(decoding.len(), Draft::default);
        }
        for (i, c) in chains {
            granted += c.len();
            drafts[i] = c;
        }
        self.counters.spec_draft_budget = granted as f64 / decoding.len().max(1) as f64;
        drafts
    }

    /// Cuts each wanted (request, draft length) to what the adaptive
    /// controller grants (when `adaptive`), then holds pages for it: free or
    /// evictable ones only (never by retracting another request); a length
    /// that finds none is cut to the slots the request already holds.
    fn grant_and_hold(
        &mut self,
        decoding: &mut [Req],
        wants: &mut [(usize, usize)],
        base_tokens: usize,
        adaptive: bool,
    ) {
        if adaptive && !wants.is_empty() {
            let lens: Vec<usize> = wants.iter().map(|w| w.1).collect();
            let rates: Vec<(f64, f64)> = wants.iter().map(|w| decoding[w.0].spec_rate).collect();
            let grant = self.adaptive.grant(&lens, &rates, base_tokens);
            for (w, g) in wants.iter_mut().zip(grant) {
                self.counters.spec_draft_tokens_skipped_total += (w.1 - g) as u64;
                w.1 = g;
            }
        }
        let ps = self.page_size;
        for (i, len) in wants.iter_mut() {
            if *len == 0 {
                continue;
            }
            let r = &mut decoding[*i];
            let need = (r.len() + *len).div_ceil(ps);
            let have = r.page_capacity(ps) / ps;
            if need <= have {
                continue;
            }
            let evictable = self.cache.stats().evictable_tokens / ps;
            let got = if need - have <= self.pool.free_pages() + evictable {
                self.alloc_pages(need - have)
            } else {
                None
            };
            match got {
                Some(p) => {
                    if r.append_own(p).is_err() {
                        *len = 0;
                    }
                }
                None => *len = (*len).min(r.page_capacity(ps).saturating_sub(r.len())),
            }
        }
    }
}

/// No draft tokens.
static NO_DRAFT: Draft = Draft {
    tokens: Vec::new(),
    parents: None,
    probs: Vec::new(),
};

/// The draft of decoding request `i` in a list from [`Scheduler::draft`]
/// (empty when the list is).
pub(super) fn draft_of(drafts: &[Draft], i: usize) -> &Draft {
    drafts.get(i).unwrap_or(&NO_DRAFT)
}
