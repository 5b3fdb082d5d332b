//! The executor's host path: sampling (and verifying drafts) from logits rows
//! copied to the host, with any logits processor, grammar masks, logprobs
//! and recursive rejection sampling of drafts at temperature > 0
//! ([`crate::speculative::verify`]).

use super::LocalExecutor;
use crate::error::Result;
use crate::sampling::{LogitsContext, SeqRng, argmax, log_sum_exp, top_logits};
use crate::speculative::verify::{children, verify_row};
use crate::step::{SeqOutput, SeqPlan, TokenLogprob};

/// The log-probabilities of `ids` in a raw logits row whose log-sum-exp
/// is `lse` (an id past the row scores negative infinity).
pub(super) fn ids_logprobs(raw: &[f32], lse: f32, ids: Option<&[u32]>) -> Vec<(u32, f32)> {
    ids.unwrap_or_default()
        .iter()
        .map(|&t| {
            (
                t,
                raw.get(t as usize).map_or(f32::NEG_INFINITY, |x| x - lse),
            )
        })
        .collect()
}

impl LocalExecutor {
    /// Samples (and verifies) one sequence's rows on the host.
    pub(super) fn sample_on_host(
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
        let prompt: &[u32] = sp.context.as_ref().map_or(&[], |c| &c.prompt);
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
                out.extra_mut().logprobs.push(TokenLogprob {
                    token: tok,
                    logprob: raw.get(tok as usize).copied().unwrap_or(f32::NEG_INFINITY) - lse,
                    top: top_logits(raw, top)
                        .into_iter()
                        .map(|(t, x)| (t, x - lse))
                        .collect(),
                    ids: ids_logprobs(raw, lse, sp.logprob_ids.as_deref()),
                    rank: None,
                });
            }
            out.tokens.push(tok);
            history.push(tok);
            match next {
                Some(c) => {
                    out.accepted += 1;
                    if s.tree.is_some() {
                        out.extra_mut().accepted_path.push(base + c);
                    }
                    at = c;
                }
                None => break,
            }
        }
        Ok(out)
    }
}
