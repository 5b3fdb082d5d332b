//! Speculative decoding: the [`Speculator`] trait and the engine's speculation settings.
//!
//! A speculator proposes draft tokens for the requests that decode in the
//! next step; the engine appends them to each request's input, the target
//! model computes logits for every draft position in one forward pass, and
//! verification keeps the longest prefix the target agrees with (greedy) or
//! the prefix accepted by rejection sampling (temperature > 0), so the output
//! is exactly (greedy) or in distribution (sampled) that of plain decoding.
//!
//! The speculator owns only its own proposal state (an n-gram table, a draft
//! model's KV); the scheduler owns requests and pages; [`verify`] holds
//! the rules by which every executor verifies drafts. The speculator is
//! told every token a request's sequence gains ([`Speculator::observe`]) and when a
//! request leaves ([`Speculator::release`]).
//!
//! Invariant of a [`Draft`]: `parents`, when present, has one entry per draft
//! token; entry `i` is `None` for a token that follows the request's last token
//! directly, else the index (`< i`) of its parent draft token. A chain is
//! `parents == None` (token `i` follows token `i - 1`). A sampled draft's
//! `probs` has one distribution per token, the one it was drawn from;
//! siblings were drawn together without replacement, in their listed order,
//! from one shared distribution (verification relies on that order).

mod group;
pub mod verify;

pub use group::TpRunners;

use crate::error::{CoreError, Result};
use crate::model::Model;
use crate::runner::ModelRunner;
use crate::sampling::SamplingParams;
use std::sync::Arc;

/// One request the speculator is asked to draft for.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    /// The request's key, stable while it lives (unique among live requests).
    pub key: u64,
    /// The sequence's most recent tokens (at least the longest match window
    /// plus one, or all of it when shorter), the last token included.
    pub tokens: &'a [u32],
    /// Length of the whole sequence (prompt plus output) that `tokens` ends.
    pub len: usize,
    /// Most draft tokens wanted (at least 1).
    pub max_tokens: usize,
    /// Whether the attention backend can verify a tree; when false, propose a chain.
    pub allow_tree: bool,
    /// The request's page table, covering `len + max_tokens` slots, for a
    /// [`Drafting::Model`] speculator (it writes draft KV at those slots);
    /// empty for a [`Drafting::Lookup`] one.
    pub pages: &'a [u32],
    /// Set for a request sampled at temperature > 0: a drafter may draw its
    /// chain or tree from its own distribution under these parameters (filtered as
    /// the standard sampler does: `sampling::filtered_candidates`), seeded
    /// by `seed`, and then returns that distribution in [`Draft::probs`].
    pub sampling: Option<DraftSampling<'a>>,
}

/// How a sampled request's drafts may be drawn ([`DraftRequest::sampling`]).
#[derive(Clone, Copy, Debug)]
pub struct DraftSampling<'a> {
    /// The request's sampling parameters.
    pub params: &'a SamplingParams,
    /// Seeds the draws (drawn from the request's generator).
    pub seed: u64,
}

/// What one sequence's step computed and kept, for a speculator that reads
/// the target's hidden states ([`Speculator::hidden_layers`]).
#[derive(Clone, Copy, Debug)]
pub struct ComputedStates<'a> {
    /// The request's key.
    pub key: u64,
    /// Position of the first computed token.
    pub start: usize,
    /// For each computed position `p` (from `start`), the token at `p + 1`:
    /// the prompt's, a kept draft, or the one just sampled.
    pub next_tokens: &'a [u32],
    /// The request's page table (covering at least `start + next_tokens.len()` positions).
    pub pages: &'a [u32],
    /// Row-major `[next_tokens.len(), layers * hidden_size]`: at each
    /// position, the hidden states of [`Speculator::hidden_layers`] in that
    /// order.
    pub states: &'a [f32],
}

/// How a speculator drafts, declared once ([`Speculator::drafting`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drafting {
    /// Proposals are cheap lookups (n-gram): the scheduler trims them
    /// afterwards to what pays and to the pages it can get.
    Lookup,
    /// Each draft token costs a model forward at the request's KV slots: the
    /// scheduler decides every request's draft length and holds its pages
    /// *before* proposing; the draft has at most `max_tokens` tokens.
    Model {
        /// Most draft tokens per request and step.
        max_tokens: usize,
        /// It proposes trees where the request allows them (else chains).
        tree: bool,
    },
}

/// What a speculator may be built over besides its settings.
#[derive(Clone)]
pub struct SpeculatorInputs {
    /// The target model's runner (its device, weights and KV cache; rank
    /// 0's with tensor parallelism).
    pub target: Arc<ModelRunner>,
    /// With tensor parallelism, every rank's runner of the target: a
    /// drafter that runs the target's layers (LAYERSKIP) runs them on all
    /// ranks through it; a draft head on rank 0 (EAGLE, EAGLE3, NEXTN)
    /// reads the whole model's shape and LM head from it. `None` on one
    /// device.
    pub target_group: Option<Arc<TpRunners>>,
    /// A separate draft model loaded on the target's device (STANDALONE).
    pub draft_model: Option<Arc<dyn Model>>,
    /// A draft checkpoint that the speculator loads itself (an EAGLE3 head's folder).
    pub draft_path: Option<std::path::PathBuf>,
}

/// Draft tokens proposed for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Draft {
    /// Draft tokens; empty when the speculator has nothing to propose.
    pub tokens: Vec<u32>,
    /// Parent of each token (`None` for a chain); see the module invariant.
    pub parents: Option<Vec<Option<u32>>>,
    /// A sampled draft's distributions: for each token, the one it was
    /// drawn from (siblings share one: they were drawn from it without
    /// replacement, in order). Empty for deterministic drafts (then each
    /// token counts as a point mass).
    pub probs: Vec<DraftDist>,
}

/// A drafter's distribution at one position: (probability, token id)
/// pairs summing to 1, shared by the draft tokens drawn from it.
pub type DraftDist = Arc<[(f32, u32)]>;

impl Draft {
    /// A chain of tokens.
    pub fn chain(tokens: Vec<u32>) -> Self {
        Self {
            tokens,
            parents: None,
            probs: Vec::new(),
        }
    }

    /// Keeps the first `n` tokens (still a valid tree: parents come first).
    pub fn truncate(&mut self, n: usize) {
        self.tokens.truncate(n);
        self.probs.truncate(n);
        if let Some(p) = self.parents.as_mut() {
            p.truncate(n);
        }
    }

    /// Number of draft tokens.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether there is no draft token.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Parents in a batch layout's terms (see `BatchLayout::push_tree_seq`):
    /// the request's last token is the root (index 0, parent -1) and draft
    /// token `i` is index `i + 1`; `None` for a chain.
    pub fn layout_parents(&self) -> Option<Vec<i32>> {
        let p = self.parents.as_ref()?;
        let mut out = Vec::with_capacity(p.len() + 1);
        out.push(-1);
        out.extend(p.iter().map(|q| q.map_or(0, |q| q as i32 + 1)));
        Some(out)
    }

    /// Checks the tree invariant and, for a sampled draft, one distribution
    /// per token, shared by siblings, which are distinct tokens.
    pub fn validate(&self) -> Result<()> {
        if let Some(p) = &self.parents {
            if p.len() != self.tokens.len() {
                return Err(CoreError::invalid(format!(
                    "draft of {} tokens with {} parents",
                    self.tokens.len(),
                    p.len()
                )));
            }
            for (i, parent) in p.iter().enumerate() {
                if parent.is_some_and(|q| q as usize >= i) {
                    return Err(CoreError::invalid(format!(
                        "draft token {i} has parent {parent:?}, not an earlier token"
                    )));
                }
            }
        }
        if self.probs.is_empty() {
            return Ok(());
        }
        if self.probs.len() != self.len() {
            return Err(CoreError::invalid(format!(
                "draft of {} tokens with {} distributions",
                self.len(),
                self.probs.len()
            )));
        }
        let Some(parents) = &self.parents else {
            return Ok(());
        };
        for (i, parent) in parents.iter().enumerate() {
            let Some(j) = (0..i).find(|&j| parents[j] == *parent) else {
                continue;
            };
            if self.tokens[..i]
                .iter()
                .zip(&parents[..i])
                .any(|(&t, q)| q == parent && t == self.tokens[i])
            {
                return Err(CoreError::invalid(format!(
                    "sampled draft token {i} repeats a sibling's token {}",
                    self.tokens[i]
                )));
            }
            let (a, b) = (&self.probs[j], &self.probs[i]);
            if !Arc::ptr_eq(a, b) && a[..] != b[..] {
                return Err(CoreError::invalid(format!(
                    "sampled draft token {i} has another distribution than its sibling {j}"
                )));
            }
        }
        Ok(())
    }

    /// The first chain of the draft: token 0, then at each step the first
    /// child of the previous token (the whole draft for a chain).
    pub fn first_chain(&self) -> Vec<u32> {
        self.first_chain_indices()
            .into_iter()
            .map(|i| self.tokens[i])
            .collect()
    }

    /// The first chain as a draft of its own, distributions kept (a first
    /// child is a plain draw from its distribution, so a sampled tree's
    /// first chain is a sampled chain).
    pub fn into_first_chain(self) -> Draft {
        let at = self.first_chain_indices();
        let probs = if self.probs.len() == self.len() {
            at.iter().map(|&i| self.probs[i].clone()).collect()
        } else {
            Vec::new()
        };
        Draft {
            tokens: at.iter().map(|&i| self.tokens[i]).collect(),
            parents: None,
            probs,
        }
    }

    /// Indices of the first chain's tokens.
    fn first_chain_indices(&self) -> Vec<usize> {
        let Some(parents) = &self.parents else {
            return (0..self.tokens.len()).collect();
        };
        let mut out = Vec::new();
        let mut cur: Option<u32> = None;
        while let Some(i) = parents.iter().position(|&p| p == cur) {
            if out.len() >= self.tokens.len() {
                break;
            }
            out.push(i);
            cur = Some(i as u32);
        }
        out
    }
}

/// Proposes draft tokens for running requests.
pub trait Speculator: Send {
    /// Registered name (`ngram`, ...).
    fn name(&self) -> &str;
    /// Drafts for each request, in order (one [`Draft`] per request).
    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft>;
    /// The request `key`'s sequence gained `tokens` (its prompt on admission,
    /// then every accepted or sampled token).
    fn observe(&mut self, key: u64, tokens: &[u32]);
    /// The request `key` left; per-request state may be dropped.
    fn release(&mut self, key: u64);
    /// How it drafts ([`Drafting::Lookup`] unless it runs a model).
    fn drafting(&self) -> Drafting {
        Drafting::Lookup
    }
    /// Target layers whose hidden states it reads at every computed
    /// position (index `i < num_layers`: the residual stream after layer
    /// `i`; see `ForwardBatch::hidden_layers`); empty (the default) for none.
    fn hidden_layers(&self) -> &[usize] {
        &[]
    }
    /// After every step (when [`hidden_layers`](Self::hidden_layers) is not
    /// empty): what each sequence computed and kept, with those states.
    fn observe_states(&mut self, _seqs: &[ComputedStates<'_>]) {}
}

/// N-gram matching options (SGLang's `--speculative-ngram-*` flags).
#[derive(Clone, Debug, PartialEq)]
pub struct NgramOptions {
    /// Shortest suffix of the sequence matched against the table.
    pub min_match_window_size: usize,
    /// Longest suffix matched.
    pub max_match_window_size: usize,
    /// Fewest children kept per level of a BFS draft tree.
    pub min_bfs_breadth: usize,
    /// Most children kept per level of a BFS draft tree.
    pub max_bfs_breadth: usize,
    /// `bfs` (breadth by depth) or `prob` (best nodes by frequency).
    pub match_type: NgramMatchType,
    /// Deepest path stored after a matched suffix.
    pub max_trie_depth: usize,
    /// Most trie nodes kept (least recently used ones are dropped first).
    pub capacity: usize,
}

impl Default for NgramOptions {
    fn default() -> Self {
        Self {
            min_match_window_size: 1,
            max_match_window_size: 12,
            min_bfs_breadth: 1,
            max_bfs_breadth: 10,
            match_type: NgramMatchType::Bfs,
            max_trie_depth: 18,
            capacity: 10_000_000,
        }
    }
}

/// How the n-gram speculator picks draft nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NgramMatchType {
    /// Breadth first: every level keeps a breadth that shrinks with depth.
    Bfs,
    /// The nodes of highest estimated probability (frequency products).
    Prob,
}

impl NgramMatchType {
    /// Parses SGLang's spelling (`BFS`, `PROB`, any case).
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "bfs" => Ok(Self::Bfs),
            "prob" => Ok(Self::Prob),
            _ => Err(CoreError::Config(format!(
                "speculative_ngram_match_type must be BFS or PROB, not '{s}'"
            ))),
        }
    }
}

/// Largest `num_draft_tokens` accepted.
pub const MAX_DRAFT_TOKENS: usize = 64;

/// Largest `eagle_topk` accepted.
pub const MAX_EAGLE_TOPK: usize = 16;

/// Speculation settings (SGLang's `--speculative-*` flags).
#[derive(Clone, Debug, PartialEq)]
pub struct SpeculativeConfig {
    /// The registered speculator (`ngram`), e.g. from `--speculative-algorithm NGRAM`.
    pub algorithm: String,
    /// Most draft tokens per request and step (1..=64).
    pub num_draft_tokens: usize,
    /// Draft fewer tokens, or none, where measured acceptance and step cost
    /// say speculation does not pay.
    pub adaptive: bool,
    /// Options of the n-gram speculator.
    pub ngram: NgramOptions,
    /// Draft tokens a model drafter (STANDALONE, LAYERSKIP) proposes per
    /// step, as a chain (SGLang's `--speculative-num-steps`); at most
    /// `num_draft_tokens`.
    pub num_steps: usize,
    /// Layers of the target that draft under LAYERSKIP (its first N, then
    /// the final norm and LM head); `--speculative-draft-layers`.
    pub draft_layers: Option<usize>,
    /// Draft heads (EAGLE, EAGLE3, NEXTN): children kept per step; above 1,
    /// a tree of the `num_draft_tokens` best nodes by cumulative probability
    /// over `num_steps` levels (SGLang's `--speculative-eagle-topk`).
    pub eagle_topk: usize,
}

impl Default for SpeculativeConfig {
    fn default() -> Self {
        Self {
            algorithm: "ngram".into(),
            num_draft_tokens: 8,
            adaptive: true,
            ngram: NgramOptions::default(),
            num_steps: 4,
            draft_layers: None,
            eagle_topk: 1,
        }
    }
}

impl SpeculativeConfig {
    /// Checks the ranges; errors are [`CoreError::InvalidSetting`] naming
    /// the setting (the binary adds its flag).
    pub fn validate(&self) -> Result<()> {
        let bad =
            |key: &'static str, reason: String| Err(CoreError::InvalidSetting { key, reason });
        if self.num_draft_tokens == 0 || self.num_draft_tokens > MAX_DRAFT_TOKENS {
            return bad(
                "num_draft_tokens",
                format!(
                    "must be between 1 and {MAX_DRAFT_TOKENS}, not {}",
                    self.num_draft_tokens
                ),
            );
        }
        if self.num_steps == 0 || self.num_steps > MAX_DRAFT_TOKENS {
            return bad(
                "num_steps",
                format!(
                    "must be between 1 and {MAX_DRAFT_TOKENS}, not {}",
                    self.num_steps
                ),
            );
        }
        if self.eagle_topk == 0 || self.eagle_topk > MAX_EAGLE_TOPK {
            return bad(
                "eagle_topk",
                format!(
                    "must be between 1 and {MAX_EAGLE_TOPK}, not {}",
                    self.eagle_topk
                ),
            );
        }
        if self.draft_layers == Some(0) {
            return bad("draft_layers", "must be at least 1".into());
        }
        let n = &self.ngram;
        if n.min_match_window_size == 0 || n.min_match_window_size > n.max_match_window_size {
            return bad(
                "ngram_min_match_window_size",
                format!(
                    "({}) must be at least 1 and at most ngram_max_match_window_size ({})",
                    n.min_match_window_size, n.max_match_window_size
                ),
            );
        }
        if n.min_bfs_breadth == 0 || n.min_bfs_breadth > n.max_bfs_breadth {
            return bad(
                "ngram_min_bfs_breadth",
                format!(
                    "({}) must be at least 1 and at most ngram_max_bfs_breadth ({})",
                    n.min_bfs_breadth, n.max_bfs_breadth
                ),
            );
        }
        if n.max_trie_depth == 0 {
            return bad("ngram_max_trie_depth", "must be at least 1".into());
        }
        if n.capacity == 0 {
            return bad("ngram_capacity", "must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draft_tree_invariant_and_first_chain() {
        let d = Draft {
            tokens: vec![10, 11, 12, 13],
            parents: Some(vec![None, None, Some(0), Some(2)]),
            probs: Vec::new(),
        };
        d.validate().unwrap();
        assert_eq!(d.first_chain(), vec![10, 12, 13]);
        assert_eq!(d.layout_parents(), Some(vec![-1, 0, 0, 1, 3]));
        let mut t = d.clone();
        t.truncate(3);
        t.validate().unwrap();
        assert_eq!(t.layout_parents(), Some(vec![-1, 0, 0, 1]));
        let bad = Draft {
            tokens: vec![1, 2],
            parents: Some(vec![None, Some(1)]),
            probs: Vec::new(),
        };
        assert!(bad.validate().is_err());
        assert_eq!(Draft::chain(vec![4, 5]).first_chain(), vec![4, 5]);
    }

    #[test]
    fn sampled_trees_share_distributions_among_distinct_siblings() {
        let q: DraftDist = Arc::from(vec![(0.5, 10), (0.5, 11)]);
        let r: DraftDist = Arc::from(vec![(1.0, 12)]);
        let mut d = Draft {
            tokens: vec![10, 11, 12],
            parents: Some(vec![None, None, Some(0)]),
            probs: vec![q.clone(), q.clone(), r.clone()],
        };
        d.validate().unwrap();
        d.probs[1] = r.clone();
        assert!(
            d.validate()
                .unwrap_err()
                .to_string()
                .contains("distribution")
        );
        d.probs[1] = q.clone();
        d.tokens[1] = 10;
        assert!(d.validate().unwrap_err().to_string().contains("repeats"));
        d.tokens[1] = 11;
        let chain = d.clone().into_first_chain();
        assert_eq!(chain.tokens, vec![10, 12]);
        assert!(Arc::ptr_eq(&chain.probs[0], &q) && Arc::ptr_eq(&chain.probs[1], &r));
        chain.validate().unwrap();
        d.probs.pop();
        assert!(
            d.validate()
                .unwrap_err()
                .to_string()
                .contains("3 tokens with 2")
        );
    }

    #[test]
    fn config_ranges_name_the_setting() {
        let mut c = SpeculativeConfig::default();
        c.validate().unwrap();
        c.num_draft_tokens = 0;
        assert!(matches!(
            c.validate(),
            Err(CoreError::InvalidSetting {
                key: "num_draft_tokens",
                ..
            })
        ));
        c.num_draft_tokens = 65;
        assert!(c.validate().is_err());
        c.num_draft_tokens = 64;
        c.validate().unwrap();
        assert!(NgramMatchType::parse("bfs").is_ok());
        assert!(NgramMatchType::parse("dfs").is_err());
    }
}
