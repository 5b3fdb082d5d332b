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

use super::Scheduler;
use crate::engine::request::Req;
use crate::speculative::{Draft, DraftRequest};

/// Tokens of a request's tail given to the speculator, at least (its
/// longest match window needs no more).
const MIN_TAIL: usize = 64;

impl Scheduler {
    fn may_draft(&self, r: &Req) -> bool {
        r.len() - r.computed == 1
            && r.remaining_new() > 1
            && !r.prefix_only
            && (self.executor.sampler_name() == "standard")
    }

    /// Draft tokens for each decoding request (empty where none), with pages
    /// allocated for them.
    pub(super) fn draft(&mut self, decoding: &mut [Req], base_tokens: usize) -> Vec<Draft> {
        let mut drafts: Vec<Draft> = vec![Draft::default(); decoding.len()];
        let tree_ok = self.executor.capabilities().tree;
        let Some(cfg) = self.cfg.speculative.clone() else {
            return drafts;
        };
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
        let tail_len = MIN_TAIL.max(cfg.ngram.max_match_window_size + 1);
        let mut tails: Vec<Vec<u32>> = Vec::with_capacity(eligible.len());
        // (index into `decoding`, draft limit, tree allowed) of each request asked.
        let mut picked: Vec<(usize, usize, bool)> = Vec::with_capacity(eligible.len());
        for &i in &eligible {
            let r = &mut decoding[i];
            if r.spec_observed < r.len() {
                spec.observe(r.key, &r.tail(r.spec_observed));
                r.spec_observed = r.len();
            }
            let room = context.saturating_sub(r.len() + 1);
            let limit = cfg.num_draft_tokens.min(r.remaining_new() - 1).min(room);
            if limit > 0 {
                tails.push(r.tail(r.len().saturating_sub(tail_len)));
                picked.push((i, limit, tree_ok && r.matcher.is_none()));
            }
        }
        if picked.is_empty() {
            return drafts;
        }
        let reqs: Vec<DraftRequest<'_>> = picked
            .iter()
            .zip(&tails)
            .map(|(&(i, limit, tree), t)| DraftRequest {
                key: decoding[i].key,
                tokens: t,
                len: decoding[i].len(),
                max_tokens: limit,
                allow_tree: tree,
            })
            .collect();
        let proposed = spec.propose(&reqs);
        drop(reqs);
        let mut chains: Vec<(usize, Draft)> = Vec::new();
        for (&(i, limit, tree), d) in picked.iter().zip(proposed) {
            let mut c = match d.validate() {
                Ok(()) if tree => d,
                Ok(()) => Draft::chain(d.first_chain()),
                Err(_) => Draft::default(),
            };
            c.truncate(limit);
            if !c.is_empty() {
                chains.push((i, c));
            }
        }
        if cfg.adaptive && !chains.is_empty() {
            let lens: Vec<usize> = chains.iter().map(|(_, c)| c.len()).collect();
            let rates: Vec<(f64, f64)> =
                chains.iter().map(|(i, _)| decoding[*i].spec_rate).collect();
            let grant = self.adaptive.grant(&lens, &rates, base_tokens);
            for ((_, c), g) in chains.iter_mut().zip(grant) {
                self.counters.spec_draft_tokens_skipped_total += (c.len() - g) as u64;
                c.truncate(g);
            }
        }
        let mut granted = 0usize;
        for (i, mut c) in chains {
            let r = &mut decoding[i];
            let ps = self.page_size;
            let need = (r.len() + c.len()).div_ceil(ps);
            let have = r.page_capacity(ps) / ps;
            if need > have {
                let evictable = self.cache.stats().evictable_tokens / ps;
                let got = if need - have <= self.pool.free_pages() + evictable {
                    self.alloc_pages(need - have)
                } else {
                    None
                };
                match got {
                    Some(p) => {
                        if let Some(own) = r.own.as_mut()
                            && own.append(p).is_err()
                        {
                            c = Draft::default();
                        }
                    }
                    None => c.truncate(r.page_capacity(ps).saturating_sub(r.len())),
                }
            }
            granted += c.len();
            drafts[i] = c;
        }
        self.counters.spec_draft_budget = granted as f64 / decoding.len().max(1) as f64;
        drafts
    }
}
