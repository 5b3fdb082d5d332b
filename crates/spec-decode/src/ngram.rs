//! [`NgramSpeculator`]: SGLang's NGRAM speculator over one shared trie.
//!
//! It owns the trie and, per live request, the trie nodes of the suffixes
//! that end at the request's last observed token ("cursors", one per length
//! `1..L` with `L = max_match_window_size + max_trie_depth`) plus the last few
//! tokens. Observing a token extends every cursor by it (counting the n-grams
//! that end there: the match keys of every window length together with the
//! continuations of the keys that ended up to `max_trie_depth` tokens
//! earlier), so each token costs `L` child look-ups however long the history.
//!
//! Before each token the trie makes room for those `L` paths (evicting least
//! recently used subtrees), so inserting rarely has to check which nodes are
//! on the path being extended.
//!
//! Proposing matches the longest suffix (from `max_match_window_size` down to
//! `min_match_window_size` tokens) whose n-gram has been followed by
//! something; the cursors give those nodes directly when the request's
//! tokens are the ones observed, else the suffixes are walked from the root.
//!
//! Invariants: `cursors[d - 1]` names the node of the request's last `d`
//! observed tokens, or a dead reference (evicted, or not storable); a request
//! has state only between its first `observe` and its `release`; proposals
//! depend only on the observed history (same calls, same drafts).

use crate::draft::{self, Anchor, ProbScratch};
use crate::trie::{NodeRef, ROOT, Trie};
use arbor_engine_core::speculative::{NgramMatchType, NgramOptions};
use arbor_engine_core::{CoreError, Draft, DraftRequest, Result, SpeculativeConfig, Speculator};
use hashbrown::HashMap;

/// Longest stored path (`max_match_window_size + max_trie_depth`) accepted.
pub const MAX_PATH_LEN: usize = 1024;

/// Largest capacity accepted (2^30 nodes, about 48 GB).
pub const MAX_CAPACITY: usize = 1 << 30;

/// Counters of an [`NgramSpeculator`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NgramStats {
    /// Trie nodes held now.
    pub nodes: usize,
    /// Most trie nodes kept.
    pub capacity: usize,
    /// Trie nodes evicted so far.
    pub evicted: u64,
    /// Requests with per-request state.
    pub requests: usize,
    /// Bytes held by the trie (approximate).
    pub memory_bytes: usize,
}

struct ReqState {
    cursors: Vec<NodeRef>,
    valid: usize,
    recent: Vec<u32>,
    len: usize,
}

/// The n-gram speculator (`--speculative-algorithm NGRAM`).
pub struct NgramSpeculator {
    opts: NgramOptions,
    path_len: usize,
    trie: Trie,
    reqs: HashMap<u64, ReqState>,
    anchors: Vec<Anchor>,
    prob: ProbScratch,
}

impl NgramSpeculator {
    /// A speculator with these options (checked as `SpeculativeConfig::validate` does).
    pub fn new(opts: NgramOptions) -> Result<Self> {
        SpeculativeConfig {
            ngram: opts.clone(),
            ..SpeculativeConfig::default()
        }
        .validate()?;
        let path_len = opts.max_match_window_size + opts.max_trie_depth;
        if path_len > MAX_PATH_LEN {
            return Err(CoreError::InvalidSetting {
                key: "ngram_max_match_window_size",
                reason: format!(
                    "({}) plus ngram_max_trie_depth ({}) must be at most {MAX_PATH_LEN}",
                    opts.max_match_window_size, opts.max_trie_depth
                ),
            });
        }
        if opts.capacity > MAX_CAPACITY {
            return Err(CoreError::InvalidSetting {
                key: "ngram_capacity",
                reason: format!("must be at most {MAX_CAPACITY}, not {}", opts.capacity),
            });
        }
        Ok(Self {
            trie: Trie::new(
                opts.capacity,
                match opts.match_type {
                    NgramMatchType::Prob => opts.max_bfs_breadth,
                    NgramMatchType::Bfs => 0,
                },
            ),
            path_len,
            opts,
            reqs: HashMap::new(),
            anchors: Vec::new(),
            prob: ProbScratch::default(),
        })
    }

    /// The speculator of `cfg` (validated first): `cfg.ngram` is used.
    pub fn from_config(cfg: &SpeculativeConfig) -> Result<Self> {
        cfg.validate()?;
        Self::new(cfg.ngram.clone())
    }

    /// The options in use.
    pub fn options(&self) -> &NgramOptions {
        &self.opts
    }

    /// Counters: trie size, evictions, live requests.
    pub fn stats(&self) -> NgramStats {
        NgramStats {
            nodes: self.trie.len(),
            capacity: self.trie.capacity(),
            evicted: self.trie.evicted(),
            requests: self.reqs.len(),
            memory_bytes: self.trie.memory_bytes(),
        }
    }

    /// Drafts for one request (see [`Speculator::propose`]).
    pub fn propose_one(&mut self, req: &DraftRequest<'_>) -> Draft {
        if req.max_tokens == 0 || req.tokens.is_empty() {
            return Draft::default();
        }
        self.find_anchors(req.key, req.tokens, req.len, !req.allow_tree);
        let (trie, a, o) = (&self.trie, &self.anchors, &self.opts);
        if !req.allow_tree {
            return draft::chain(trie, a, req.max_tokens, o.max_trie_depth);
        }
        match o.match_type {
            NgramMatchType::Bfs => draft::bfs(trie, a, req.max_tokens, o),
            NgramMatchType::Prob => draft::prob(trie, a, req.max_tokens, o, &mut self.prob),
        }
    }

    /// Fills `anchors` with the matched suffixes that have children, longest
    /// first (only the longest when `first_only`).
    fn find_anchors(&mut self, key: u64, tokens: &[u32], len: usize, first_only: bool) {
        self.anchors.clear();
        let max_w = self.opts.max_match_window_size.min(tokens.len());
        let min_w = self.opts.min_match_window_size;
        let state = self
            .reqs
            .get(&key)
            .filter(|s| s.len == len && tokens.ends_with(&s.recent[s.recent.len() - max_w..]));
        for w in (min_w..=max_w).rev() {
            let node = state
                .filter(|s| w <= s.valid)
                .and_then(|s| self.trie.resolve(s.cursors[w - 1]))
                .or_else(|| self.trie.walk(&tokens[tokens.len() - w..]));
            if let Some(node) = node.filter(|&n| self.trie.has_children(n)) {
                self.anchors.push(Anchor { node, len: w });
                if first_only {
                    return;
                }
            }
        }
    }
}

impl Speculator for NgramSpeculator {
    fn name(&self) -> &str {
        "ngram"
    }

    fn propose(&mut self, reqs: &[DraftRequest<'_>]) -> Vec<Draft> {
        reqs.iter().map(|r| self.propose_one(r)).collect()
    }

    fn observe(&mut self, key: u64, tokens: &[u32]) {
        if tokens.is_empty() {
            return;
        }
        let keep = self.opts.max_match_window_size;
        let deepest = self.path_len - 1;
        let st = self.reqs.entry(key).or_insert_with(|| ReqState {
            cursors: vec![NodeRef::DEAD; deepest],
            valid: 0,
            recent: Vec::with_capacity(2 * keep),
            len: 0,
        });
        let trie = &mut self.trie;
        for &t in tokens {
            trie.make_room(st.valid + 1);
            // Deepest first: cursors[d] (length d + 1) grows from cursors[d - 1].
            for d in (1..=st.valid).rev() {
                let next = trie
                    .resolve(st.cursors[d - 1])
                    .and_then(|x| trie.extend(x, t));
                if d < deepest {
                    st.cursors[d] = next.map_or(NodeRef::DEAD, |c| trie.node_ref(c));
                }
            }
            st.cursors[0] = trie
                .extend(ROOT, t)
                .map_or(NodeRef::DEAD, |c| trie.node_ref(c));
            st.valid = (st.valid + 1).min(deepest);
        }
        st.len += tokens.len();
        if tokens.len() >= keep {
            st.recent.clear();
            st.recent.extend_from_slice(&tokens[tokens.len() - keep..]);
        } else {
            if st.recent.len() + tokens.len() > 2 * keep {
                let drop = st.recent.len() + tokens.len() - keep;
                st.recent.drain(..drop);
            }
            st.recent.extend_from_slice(tokens);
        }
    }

    fn release(&mut self, key: u64) {
        self.reqs.remove(&key);
    }
}

#[cfg(test)]
impl NgramSpeculator {
    pub(crate) fn check(&self) -> std::result::Result<(), String> {
        self.trie.check()?;
        for (k, s) in &self.reqs {
            if s.valid > s.cursors.len()
                || s.recent.len() < s.len.min(self.opts.max_match_window_size)
            {
                return Err(format!("request {k}: bad state"));
            }
        }
        Ok(())
    }
}
