//! The step plan and its output: what the scheduler asks an
//! [`Executor`](crate::executor::Executor) to compute, and what comes back.
//!
//! A [`StepPlan`] is plain data (no device handles but the shared, read-only
//! LoRA adapters): per sequence the tokens to compute after `prefix_len`
//! cached ones, the pages that hold them, an optional draft tree, the
//! adapter, and how to sample. It is built on the scheduler thread
//! and may be built while the previous plan runs (overlap scheduling).
//!
//! Invariants of a [`SeqPlan`] (checked by [`SeqPlan::validate`]):
//! `tokens` is not empty; `pages` cover `prefix_len + tokens.len()` slots; with
//! a tree, `tree` has one parent per token (`-1` for token 0, the root, an
//! earlier index otherwise) and the positions follow the tree depth; with
//! [`SampleRows::Verify`], the last `drafts + 1` tokens are the last sampled
//! token followed by the draft tokens (the whole plan for a tree), and masks
//! (when present) number one per sampled row.

use crate::error::{CoreError, Result};
use crate::grammar::TokenBitmask;
use crate::kv::tier::{KvCopyStats, KvTierOps};
use crate::model::lora::LoraAdapter;
use crate::sampling::SamplingParams;
use std::sync::Arc;
use std::sync::mpsc::Receiver;

/// Which rows of a sequence are sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleRows {
    /// The last token's row: one new token.
    Last,
    /// The last `drafts + 1` rows: the last sampled token then `drafts` draft
    /// tokens; verification keeps the drafts the target agrees with and adds
    /// one token of its own (up to `drafts + 1` new tokens).
    Verify {
        /// Draft tokens at the end of `tokens`.
        drafts: usize,
    },
}

/// How one sequence samples after the forward.
#[derive(Clone, Debug)]
pub struct SampleSpec {
    /// The request's sampling parameters.
    pub params: Arc<SamplingParams>,
    /// Rows sampled.
    pub rows: SampleRows,
    /// Seeds this step's draws (drawn from the request's generator by the scheduler).
    pub seed: u64,
    /// Prompt and output so far (before this step's tokens), given when a
    /// logits processor needs them; `None` otherwise.
    pub context: Option<SampleContext>,
    /// Return log-probabilities, with this many top alternatives.
    pub logprobs: Option<usize>,
    /// With `logprobs`: also those of these ids (sampled on the host).
    pub logprob_ids: Option<Arc<[u32]>>,
    /// Tokens generated so far (for `min_new_tokens`).
    pub generated: usize,
    /// For drafts sampled from a drafter's distribution (a chain or a
    /// tree): the distribution each draft token was drawn from
    /// ([`crate::Draft::probs`]); verification then runs recursive
    /// rejection sampling at each row: child `x` of the row is accepted with
    /// probability `min(1, p(x) / q(x))`, else `p` becomes `max(0, p - q)`
    /// normalized, `q` loses `x`, and the next child is tried. Empty for
    /// deterministic drafts (point masses).
    pub draft_probs: Vec<crate::DraftDist>,
}

/// The history logits processors see.
#[derive(Clone, Debug)]
pub struct SampleContext {
    /// Prompt token ids.
    pub prompt: Arc<[u32]>,
    /// Output so far.
    pub output: Vec<u32>,
}

/// One sequence of a step.
#[derive(Clone, Debug, Default)]
pub struct SeqPlan {
    /// Tokens to compute: a prompt chunk, the last sampled token (with the
    /// tokens a grammar forced), or the last sampled token plus draft tokens.
    pub tokens: Vec<u32>,
    /// Tokens of the sequence already in the KV cache.
    pub prefix_len: usize,
    /// Pages holding the sequence, covering `prefix_len + tokens.len()`.
    pub pages: Vec<u32>,
    /// Parents of the tokens when they form a draft tree (see the module doc).
    pub tree: Option<Vec<i32>>,
    /// Sampling after the forward; `None` for a prompt chunk that is not the last.
    pub sample: Option<SampleSpec>,
    /// The LoRA adapter the sequence runs with (`None`: the base model).
    pub lora: Option<Arc<LoraAdapter>>,
    /// The sequence's recurrent state slot (models with recurrent layers;
    /// `None` otherwise), and what else the step does with its state.
    pub state_slot: Option<u32>,
    /// Snapshots and restores of the sequence's recurrent state.
    pub state_ops: StateOps,
    /// Log-probabilities of prompt tokens this step's rows predict (a
    /// prompt chunk of a request that asked for them); `None` otherwise.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// An embedding request's prompt chunk: its final normed hidden states
    /// pooled into [`SeqExtra::embedding`]; `None` otherwise.
    pub pool: Option<Pooling>,
}

/// How an embedding request pools its prompt's hidden states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pooling {
    /// The last token's (causal models: the only one that saw every token).
    #[default]
    Last,
    /// The mean over every token (the prompt is computed whole, never
    /// served from the prefix cache).
    Mean,
}

/// Which rows of a prompt chunk score the prompt's next tokens: row `r`
/// (within the step's tokens) predicts `next[r - rows.start]`, the prompt
/// token after it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PromptLogprobs {
    /// Rows of the step's tokens, consecutive.
    pub rows: std::ops::Range<usize>,
    /// The prompt token each row predicts.
    pub next: Vec<u32>,
    /// Most likely alternatives wanted per row.
    pub top: usize,
    /// Ids whose log-probabilities are wanted at every row too.
    pub ids: Option<Arc<[u32]>>,
    /// The rank of each predicted token among its row's logits is wanted.
    pub ranks: bool,
}

/// What a step does with a sequence's recurrent state besides updating it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateOps {
    /// Before the forward, copy this slot (a snapshot of the cached prefix
    /// the sequence starts after, or of the last accepted draft token)
    /// into the sequence's slot.
    pub restore_from: Option<u32>,
    /// Copy the state after the first `n` of the step's tokens into a slot,
    /// for each `(n, slot)`: a page boundary's snapshot, and the state at
    /// each draft token being verified.
    pub snapshots: Vec<(usize, u32)>,
}

impl SeqPlan {
    /// Absolute positions of the tokens.
    pub fn positions(&self) -> Vec<u32> {
        match &self.tree {
            None => (self.prefix_len..self.prefix_len + self.tokens.len())
                .map(|p| p as u32)
                .collect(),
            Some(parents) => {
                let mut depth = vec![0u32; parents.len()];
                for (j, &p) in parents.iter().enumerate().skip(1) {
                    depth[j] = depth.get(p as usize).copied().unwrap_or(0) + 1;
                }
                depth.iter().map(|d| self.prefix_len as u32 + d).collect()
            }
        }
    }

    /// Rows (within `tokens`) that are sampled.
    pub fn sampled_rows(&self) -> std::ops::Range<usize> {
        let n = self.tokens.len();
        match self.sample.as_ref().map(|s| s.rows) {
            None => n..n,
            Some(SampleRows::Last) => n - 1..n,
            Some(SampleRows::Verify { drafts }) => n - 1 - drafts..n,
        }
    }

    /// Checks the module invariants with pages of `page_size` tokens.
    #[inline]
    pub fn validate(&self, page_size: usize) -> Result<()> {
        if self.tokens.is_empty() {
            return Err(CoreError::invalid("a step sequence computes no token"));
        }
        if self.pages.len() * page_size < self.prefix_len + self.tokens.len() {
            return Err(CoreError::invalid(format!(
                "{} pages cannot hold {} tokens",
                self.pages.len(),
                self.prefix_len + self.tokens.len()
            )));
        }
        if let Some(SampleRows::Verify { drafts }) = self.sample.as_ref().map(|s| s.rows)
            && drafts + 1 > self.tokens.len()
        {
            return Err(CoreError::invalid(format!(
                "{drafts} drafts to verify in {} tokens",
                self.tokens.len()
            )));
        }
        if let Some(t) = &self.tree {
            if t.len() != self.tokens.len() {
                return Err(CoreError::invalid(
                    "a draft tree needs one parent per token",
                ));
            }
            let verify_all = matches!(
                self.sample.as_ref().map(|s| s.rows),
                Some(SampleRows::Verify { drafts }) if drafts + 1 == self.tokens.len()
            );
            if !verify_all {
                return Err(CoreError::invalid(
                    "a draft tree is verified whole: its root then every draft",
                ));
            }
        }
        Ok(())
    }
}

/// Grammar bitmasks of a step: one list per sequence (empty for a sequence
/// without a grammar, else one mask per sampled row).
pub type StepMasks = Vec<Vec<TokenBitmask>>;

/// Masks given with the plan, or filled while the forward runs (overlap
/// scheduling) and received before sampling.
#[derive(Debug, Default)]
pub enum MaskInput {
    /// No sequence has a grammar.
    #[default]
    None,
    /// Filled already.
    Ready(StepMasks),
    /// Sent by the scheduler's helper thread; a closed channel means the
    /// filling failed and every constrained row is left unmasked (the
    /// scheduler aborts those requests).
    Late(Receiver<StepMasks>),
}

/// Everything one step computes.
#[derive(Debug, Default)]
pub struct StepPlan {
    /// Sequences in batch order.
    pub seqs: Vec<SeqPlan>,
    /// Grammar bitmasks of the sampled rows.
    pub masks: MaskInput,
    /// Layers whose hidden states are wanted at every new token (see
    /// [`ForwardBatch::hidden_layers`](crate::model::ForwardBatch)): what an
    /// EAGLE-style drafter reads.
    pub hidden_layers: Vec<usize>,
    /// KV tier operations.
    pub kv_ops: KvTierOps,
}

/// Log-probability of one token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability under the model.
    pub logprob: f32,
    /// The most likely alternatives, best first.
    pub top: Vec<(u32, f32)>,
    /// The log-probabilities of the ids the request named
    /// ([`crate::engine::GenerateRequest::token_ids_logprob`]), in its order.
    pub ids: Vec<(u32, f32)>,
    /// Its rank among the row's logits (1: the most likely), for prompt
    /// tokens of a request that asked for ranks
    /// ([`crate::engine::GenerateRequest::prompt_logprob_ranks`]); `None`
    /// otherwise and for an id past the logits.
    pub rank: Option<u32>,
}

/// The tokens one sequence's step produced: one, or up to `drafts + 1`
/// after verification; held inline up to four (no allocation per request
/// per step).
pub type StepTokens = smallvec::SmallVec<[u32; 4]>;

/// What one sequence of a step produced. The common case (tokens and an
/// accepted count) is held inline; what only some sequences produce
/// (a tree's path, logprobs, hidden states, an error) is kept out of line,
/// so a decode step moves and drops small values.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeqOutput {
    /// New tokens: the accepted drafts then one sampled token (empty without sampling).
    pub tokens: StepTokens,
    /// Draft tokens accepted (`tokens.len() - 1` after verification; 0 otherwise).
    pub accepted: usize,
    /// The rest, when there is any.
    pub extra: Option<Box<SeqExtra>>,
}

/// The parts of a [`SeqOutput`] that only some sequences have.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SeqExtra {
    /// For a tree: the indices (within the plan's tokens) of the accepted
    /// drafts, in order; empty for a chain.
    pub accepted_path: Vec<usize>,
    /// Log-probabilities of `tokens`, when asked.
    pub logprobs: Vec<TokenLogprob>,
    /// Log-probabilities of the prompt tokens the plan's
    /// [`SeqPlan::prompt_logprobs`] rows predict, in order.
    pub prompt_logprobs: Vec<TokenLogprob>,
    /// Hidden states at every token of the plan's sequence, one `[tokens *
    /// hidden]` f32 vector per layer the plan asked for.
    pub hidden: Vec<Vec<f32>>,
    /// With [`SeqPlan::pool`]: the sum of the chunk's final normed hidden
    /// states (mean pooling) or its last one.
    pub embedding: Vec<f32>,
    /// Sampling this sequence failed (a logits processor or sampler error);
    /// only its request fails.
    pub error: Option<String>,
}

impl SeqOutput {
    /// The output of a sequence whose sampling failed with `error`.
    pub fn failed(error: String) -> Self {
        let mut o = Self::default();
        o.extra_mut().error = Some(error);
        o
    }

    /// The out-of-line parts, created on first use.
    pub fn extra_mut(&mut self) -> &mut SeqExtra {
        self.extra.get_or_insert_with(Box::default)
    }

    /// See [`SeqExtra::accepted_path`].
    pub fn accepted_path(&self) -> &[usize] {
        self.extra.as_ref().map_or(&[], |e| &e.accepted_path)
    }

    /// See [`SeqExtra::logprobs`].
    pub fn logprobs(&self) -> &[TokenLogprob] {
        self.extra.as_ref().map_or(&[], |e| &e.logprobs)
    }

    /// See [`SeqExtra::hidden`].
    pub fn hidden(&self) -> &[Vec<f32>] {
        self.extra.as_ref().map_or(&[], |e| &e.hidden)
    }

    /// See [`SeqExtra::error`].
    pub fn error(&self) -> Option<&str> {
        self.extra.as_ref().and_then(|e| e.error.as_deref())
    }
}

/// What a step produced, one entry per sequence of the plan.
#[derive(Clone, Debug, Default)]
pub struct StepOutput {
    /// Per sequence, in plan order.
    pub seqs: Vec<SeqOutput>,
    /// What the plan's KV tier copies cost.
    pub kv_copy: KvCopyStats,
    /// Sampled rows whose logits were copied to the host (the rest were
    /// sampled where the logits are).
    pub host_sampled_rows: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(rows: SampleRows) -> SampleSpec {
        SampleSpec {
            params: Arc::new(SamplingParams::greedy(4)),
            rows,
            seed: 0,
            context: None,
            logprobs: None,
            generated: 0,
            draft_probs: Vec::new(),
            logprob_ids: None,
        }
    }

    #[test]
    fn positions_rows_and_checks() {
        let mut s = SeqPlan {
            lora: None,
            state_slot: None,
            state_ops: Default::default(),
            prompt_logprobs: None,
            pool: None,
            tokens: vec![1, 2, 3, 4],
            prefix_len: 5,
            pages: vec![0, 1, 2],
            tree: None,
            sample: Some(spec(SampleRows::Verify { drafts: 3 })),
        };
        s.validate(4).unwrap();
        assert_eq!(s.positions(), vec![5, 6, 7, 8]);
        assert_eq!(s.sampled_rows(), 0..4);
        s.tree = Some(vec![-1, 0, 0, 1]);
        s.validate(4).unwrap();
        assert_eq!(s.positions(), vec![5, 6, 6, 7]);
        s.sample = Some(spec(SampleRows::Last));
        assert!(s.validate(4).is_err());
        s.tree = None;
        assert_eq!(s.sampled_rows(), 3..4);
        s.pages.pop();
        assert!(s.validate(4).is_err());
    }
}
