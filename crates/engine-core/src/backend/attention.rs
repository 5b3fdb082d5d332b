//! Attention over the paged KV cache.
//!
//! A batch is a list of sequences, each contributing `q_len` new tokens that
//! follow `prefix_len` tokens already in the cache (a decode step is `q_len ==
//! 1`; a prefill over a cached prefix has `prefix_len > 0`). The
//! [`BatchLayout`] is built once per batch on the host; an
//! [`AttentionBackend`] turns it into device metadata once
//! ([`AttentionBackend::prepare`]) and then, for every layer, writes the new K
//! and V into their slots and computes causal attention of the new queries over
//! prefix + new keys.
//!
//! A sequence's new tokens are a chain (token `j` sees the prefix and new
//! tokens `0..=j`: prefill, decode and chain verification) or a *tree* of
//! draft tokens: then `tree_parents` gives each new token's parent among the
//! sequence's new tokens (`-1` for the root, token 0), and token `j` sees the
//! prefix, its ancestors and itself. New tokens occupy slots
//! `prefix_len..prefix_len + q_len` of the sequence in that order either way.
//!
//! Invariants of a layout, checked once by [`BatchLayout::validate`] (every
//! attention backend calls it, with its cache's slot count): sequences are
//! packed in order (`q_start` of one equals the end of the previous); each adds
//! at least one token; each sequence's pages cover `prefix_len + q_len` tokens
//! and lie inside the cache; `slot_mapping` has one in-cache slot per new
//! token; a tree's token 0 is its only root and every other token's parent
//! comes before it.
//!
//! Device kernels take a tree as bits ([`BatchLayout::tree_mask_words`]): per
//! new token its depth and which of its sequence's new tokens it sees, in a
//! fixed [`TREE_MASK_WORDS`] words, so a tree has at most
//! [`TREE_MASK_TOKENS`] new tokens there.

use crate::backend::paging::{KvLayer, page_of, pages_for};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::tensor::Tensor;
use std::ops::Range;
use std::sync::Arc;

/// Words per new token of [`BatchLayout::tree_mask_words`].
pub const TREE_MASK_WORDS: usize = 4;

/// The most new tokens of one draft tree that [`BatchLayout::tree_mask_words`]
/// describes (three words of bits; a tree of `MAX_DRAFT_TOKENS` drafts has
/// one more token than that).
pub const TREE_MASK_TOKENS: usize = 32 * (TREE_MASK_WORDS - 1);

/// One sequence of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqLayout {
    /// Row of the sequence's first new token in the packed batch.
    pub q_start: usize,
    /// New tokens computed in this batch.
    pub q_len: usize,
    /// Tokens already in the KV cache before this batch.
    pub prefix_len: usize,
    /// The sequence's pages within [`BatchLayout::page_table`].
    pub pages: Range<usize>,
    /// For a draft tree: the parents of the new tokens within
    /// [`BatchLayout::tree_parents`] (`q_len` entries); `None` for a chain.
    pub tree: Option<Range<usize>>,
}

impl SeqLayout {
    /// Tokens in the cache after this batch.
    pub fn kv_len(&self) -> usize {
        self.prefix_len + self.q_len
    }
}

/// Host-side description of a batch's KV layout.
#[derive(Clone, Debug, Default)]
pub struct BatchLayout {
    /// Tokens per page.
    pub page_size: usize,
    /// Sequences in batch order.
    pub seqs: Vec<SeqLayout>,
    /// Page indices of all sequences, concatenated.
    pub page_table: Vec<u32>,
    /// KV slot of every new token, in batch order.
    pub slot_mapping: Vec<u32>,
    /// Parents of tree sequences' new tokens (index within the sequence, `-1`
    /// for the root), concatenated.
    pub tree_parents: Vec<i32>,
    /// The recurrent state slot of each sequence, in order (a hybrid
    /// model's; empty for a model without recurrent layers).
    pub state_slots: Vec<u32>,
    /// State snapshots this batch takes: `(sequence, n, slot)` copies the
    /// state after the sequence's first `n` new tokens into `slot`.
    pub state_snapshots: Vec<(usize, usize, u32)>,
    /// State restored before the forward: `(from, to)` copies slot `from`
    /// (a snapshot) into slot `to` (a sequence's), every recurrent layer.
    pub state_restores: Vec<(u32, u32)>,
}

/// The error of a sequence [`BatchLayout::push_seq`] refuses (kept out of
/// its path).
#[cold]
fn bad_seq(page_size: usize, q_len: usize, kv_len: usize, pages: usize) -> CoreError {
    if page_size == 0 {
        CoreError::invalid("batch layout with page_size 0")
    } else if q_len == 0 {
        CoreError::invalid("a sequence must add at least one token")
    } else {
        CoreError::invalid(format!(
            "{pages} pages of {page_size} cannot hold {kv_len} tokens"
        ))
    }
}

impl BatchLayout {
    /// An empty layout for pages of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size,
            ..Default::default()
        }
    }

    /// Total new tokens in the batch.
    pub fn num_tokens(&self) -> usize {
        self.slot_mapping.len()
    }

    /// Appends a sequence with `q_len` new tokens after `prefix_len` cached ones,
    /// stored in `pages` (which must cover `prefix_len + q_len` tokens).
    #[inline]
    pub fn push_seq(&mut self, prefix_len: usize, q_len: usize, pages: &[u32]) -> Result<()> {
        let ps = self.page_size;
        let kv_len = prefix_len + q_len;
        if ps == 0 || q_len == 0 || pages.len() * ps < kv_len {
            return Err(bad_seq(ps, q_len, kv_len, pages.len()));
        }
        let q_start = self.slot_mapping.len();
        let start = self.page_table.len();
        let used_pages = pages_for(kv_len, ps);
        self.page_table.extend_from_slice(&pages[..used_pages]);
        if q_len == 1 {
            // A decode token: one slot on the last page.
            let last = used_pages - 1;
            let slot = pages[last] as usize * ps + (prefix_len - last * ps);
            let slot = u32::try_from(slot)
                .map_err(|_| CoreError::invalid(format!("KV slot {slot} does not fit in u32")))?;
            self.slot_mapping.push(slot);
        } else {
            // Slots page by page: one division and one range check per page.
            let mut t = prefix_len;
            while t < kv_len {
                let page_index = page_of(t, ps);
                let (page, offset) = (pages[page_index] as usize, t - page_index * ps);
                let n = (ps - offset).min(kv_len - t);
                let first = page * ps + offset;
                let slots = u32::try_from(first)
                    .ok()
                    .zip(u32::try_from(first + n).ok())
                    .ok_or_else(|| {
                        CoreError::invalid(format!("KV slot {} does not fit in u32", first + n - 1))
                    })?;
                for slot in slots.0..slots.1 {
                    self.slot_mapping.push(slot);
                }
                t += n;
            }
        }
        self.seqs.push(SeqLayout {
            q_start,
            q_len,
            prefix_len,
            pages: start..start + used_pages,
            tree: None,
        });
        Ok(())
    }

    /// Appends a sequence whose new tokens form a tree: `parents[j]` is the
    /// parent of new token `j` (`-1` for token 0, the root; earlier tokens otherwise).
    pub fn push_tree_seq(
        &mut self,
        prefix_len: usize,
        parents: &[i32],
        pages: &[u32],
    ) -> Result<()> {
        check_tree(parents)?;
        self.push_seq(prefix_len, parents.len(), pages)?;
        let start = self.tree_parents.len();
        self.tree_parents.extend_from_slice(parents);
        if let Some(s) = self.seqs.last_mut() {
            s.tree = Some(start..start + parents.len());
        }
        Ok(())
    }

    /// The sequences as a recurrent layer sees them: rows, state slot, and
    /// whether the state starts from zero (the sequence starts at position
    /// 0). Errors unless every sequence has a slot and is a chain.
    pub fn state_seqs(&self) -> Result<Vec<crate::backend::recurrent::StateSeq>> {
        if self.state_slots.len() != self.seqs.len() {
            return Err(CoreError::invalid(format!(
                "{} state slots for {} sequences of a model with recurrent layers",
                self.state_slots.len(),
                self.seqs.len()
            )));
        }
        if self.has_tree() {
            return Err(CoreError::unsupported(
                "draft trees on a model with recurrent layers",
            ));
        }
        Ok(self
            .seqs
            .iter()
            .zip(&self.state_slots)
            .enumerate()
            .map(|(i, (s, &slot))| crate::backend::recurrent::StateSeq {
                rows: s.q_start..s.q_start + s.q_len,
                slot,
                fresh: s.prefix_len == 0,
                snapshots: self
                    .state_snapshots
                    .iter()
                    .filter(|(seq, _, _)| *seq == i)
                    .map(|&(_, n, dst)| (n, dst))
                    .collect(),
            })
            .collect())
    }

    /// True when every sequence adds exactly one token (a pure decode batch).
    pub fn is_decode(&self) -> bool {
        self.seqs.iter().all(|s| s.q_len == 1)
    }

    /// True when some sequence is a draft tree.
    pub fn has_tree(&self) -> bool {
        self.seqs.iter().any(|s| s.tree.is_some())
    }

    /// The parents of a tree sequence's new tokens (`None` for a chain).
    pub fn parents(&self, seq: &SeqLayout) -> Option<&[i32]> {
        seq.tree.clone().and_then(|r| self.tree_parents.get(r))
    }

    /// Whether new token `j` of `seq` attends to new token `i` of the same sequence.
    pub fn sees(&self, seq: &SeqLayout, j: usize, i: usize) -> bool {
        match self.parents(seq) {
            None => i <= j,
            Some(p) => {
                let mut cur = j as i32;
                while cur > i as i32 {
                    cur = p[cur as usize];
                }
                cur == i as i32
            }
        }
    }

    /// The batch's draft trees as device kernels read them, `None` when no
    /// sequence is a tree: [`TREE_MASK_WORDS`] words per new token of the
    /// batch, in batch order. For a tree token, word 0 is its depth + 1 (its
    /// position is `prefix_len + depth`) and bit `i % 32` of word `1 + i / 32`
    /// is set when it sees its sequence's new token `i` (its ancestors and
    /// itself); a chain's tokens have four zero words. Refuses a tree of more
    /// than [`TREE_MASK_TOKENS`] tokens.
    pub fn tree_mask_words(&self) -> Result<Option<Vec<u32>>> {
        if !self.has_tree() {
            return Ok(None);
        }
        let mut words = vec![0u32; TREE_MASK_WORDS * self.num_tokens()];
        for s in &self.seqs {
            let Some(parents) = self.parents(s) else {
                continue;
            };
            if parents.len() > TREE_MASK_TOKENS {
                return Err(CoreError::unsupported(format!(
                    "a draft tree of {} tokens (device attention masks at most {TREE_MASK_TOKENS})",
                    parents.len()
                )));
            }
            let base = TREE_MASK_WORDS * s.q_start;
            let rows = words
                .get_mut(base..base + TREE_MASK_WORDS * parents.len())
                .ok_or_else(|| CoreError::invalid(format!("tree of {s:?} out of range")))?;
            for (j, &p) in parents.iter().enumerate() {
                let mut row = [0u32; TREE_MASK_WORDS];
                if j > 0 {
                    // A parent must come before its child: its row is filled.
                    let p = usize::try_from(p).ok().filter(|&p| p < j).ok_or_else(|| {
                        CoreError::invalid(format!("draft tree token {j} has parent {p}"))
                    })?;
                    row.copy_from_slice(&rows[TREE_MASK_WORDS * p..TREE_MASK_WORDS * (p + 1)]);
                }
                row[0] += 1;
                row[1 + j / 32] |= 1 << (j % 32);
                rows[TREE_MASK_WORDS * j..TREE_MASK_WORDS * (j + 1)].copy_from_slice(&row);
            }
        }
        Ok(Some(words))
    }

    /// Checks every invariant of the module doc against a cache of `slots` KV slots.
    pub fn validate(&self, slots: usize) -> Result<()> {
        let ps = self.page_size;
        if ps == 0 {
            return Err(CoreError::invalid("attention layout with page size 0"));
        }
        if let Some(bad) = self.slot_mapping.iter().find(|&&s| s as usize >= slots) {
            return Err(CoreError::invalid(format!(
                "KV slot {bad} outside a cache of {slots} slots"
            )));
        }
        if let Some(bad) = self
            .page_table
            .iter()
            .find(|&&p| (p as usize + 1) * ps > slots)
        {
            return Err(CoreError::invalid(format!(
                "KV page {bad} outside a cache of {slots} slots"
            )));
        }
        let mut next = 0;
        for s in &self.seqs {
            if s.q_start != next
                || s.q_len == 0
                || s.pages.start > s.pages.end
                || s.pages.end > self.page_table.len()
                || s.pages.len() * ps < s.kv_len()
            {
                return Err(CoreError::invalid(format!(
                    "inconsistent sequence layout {s:?}"
                )));
            }
            if let Some(t) = &s.tree {
                let parents = self
                    .tree_parents
                    .get(t.clone())
                    .filter(|p| p.len() == s.q_len)
                    .ok_or_else(|| CoreError::invalid(format!("tree of {s:?} out of range")))?;
                check_tree(parents)?;
            }
            next += s.q_len;
        }
        if next != self.num_tokens() {
            return Err(CoreError::invalid(
                "sequence lengths do not add up to the batch",
            ));
        }
        Ok(())
    }

    /// The largest slot count any page or slot of the layout needs.
    pub fn needed_slots(&self) -> usize {
        let ps = self.page_size;
        let max_slot = self.slot_mapping.iter().map(|&s| s as usize + 1).max();
        let max_page = self.page_table.iter().map(|&p| (p as usize + 1) * ps).max();
        max_slot.unwrap_or(0).max(max_page.unwrap_or(0))
    }
}

fn check_tree(parents: &[i32]) -> Result<()> {
    if parents.first() != Some(&-1) {
        return Err(CoreError::invalid(
            "a draft tree's first token must be its root (parent -1)",
        ));
    }
    for (j, &p) in parents.iter().enumerate().skip(1) {
        if p < 0 || p as usize >= j {
            return Err(CoreError::invalid(format!(
                "draft tree token {j} has parent {p}, not an earlier token"
            )));
        }
    }
    Ok(())
}

/// What an attention implementation can run, declared once.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionCapabilities {
    /// Sequences whose new tokens form a draft tree ([`BatchLayout::push_tree_seq`]).
    pub tree: bool,
    /// The widest head it attends over (`None`: any); a model with wider
    /// heads is refused when its runner is made.
    pub max_head_dim: Option<usize>,
}

/// Per-layer attention shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionParams {
    /// Query heads.
    pub num_heads: usize,
    /// KV heads (divides `num_heads`; grouped-query attention when smaller).
    pub num_kv_heads: usize,
    /// Dimension of one head.
    pub head_dim: usize,
    /// Score scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
    /// Attend only to the last `w` positions (Mistral), when set.
    pub sliding_window: Option<usize>,
    /// This layer's KV cache scales (the checkpoint's `k_scale`/`v_scale`).
    pub kv_scales: KvScales,
}

/// A layer's KV cache scales, as checkpoints calibrated for an FP8 KV cache
/// carry them (`self_attn.k_scale` and `v_scale`): a key `x` is stored as
/// `fp8(x / k)` and read back as `stored * k`, a value likewise with `v`.
/// They apply to FP8 caches only; a 16- or 32-bit cache stores keys and
/// values as they are (vLLM and SGLang read them the same way).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvScales {
    /// Scale of the stored keys.
    pub k: f32,
    /// Scale of the stored values.
    pub v: f32,
}

impl KvScales {
    /// No scaling: what a checkpoint without scales gets.
    pub const ONE: KvScales = KvScales { k: 1.0, v: 1.0 };

    /// The scales a cache of `dtype` applies: these for FP8, one otherwise.
    pub fn for_cache(self, dtype: DType) -> KvScales {
        match dtype {
            DType::F8E4M3 | DType::F8E5M2 => self,
            _ => Self::ONE,
        }
    }

    /// Checks that both scales are finite and positive.
    pub fn validate(&self) -> Result<()> {
        for (what, s) in [("k", self.k), ("v", self.v)] {
            if !(s.is_finite() && s > 0.0) {
                return Err(CoreError::invalid(format!(
                    "KV cache {what} scale {s} is not a positive finite number"
                )));
            }
        }
        Ok(())
    }
}

impl Default for KvScales {
    fn default() -> Self {
        Self::ONE
    }
}

impl AttentionParams {
    /// Checks head counts.
    pub fn validate(&self) -> Result<()> {
        if self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
            || self.head_dim == 0
        {
            return Err(CoreError::invalid(format!(
                "attention with {} heads, {} KV heads, head_dim {}",
                self.num_heads, self.num_kv_heads, self.head_dim
            )));
        }
        self.kv_scales.validate()
    }
}

/// A batch layout prepared for one attention implementation.
#[derive(Clone, Debug)]
pub struct AttentionBatch {
    /// The host layout.
    pub layout: Arc<BatchLayout>,
    /// Device copies of the layout in the implementation's own format.
    pub device: Vec<Tensor>,
}

/// An attention implementation on one device.
pub trait AttentionBackend: Send + Sync {
    /// Registered name.
    fn name(&self) -> &str;
    /// What the implementation can run.
    fn capabilities(&self) -> AttentionCapabilities {
        AttentionCapabilities::default()
    }
    /// Uploads the batch metadata once per batch.
    fn prepare(&self, layout: Arc<BatchLayout>) -> Result<AttentionBatch>;
    /// For one layer: writes `k`, `v` (`[tokens, kv_heads * head_dim]`) into their
    /// slots of `kv`, then writes causal attention of `q` (`[tokens, heads * head_dim]`)
    /// over each sequence's prefix and new tokens to `out` (shaped like `q`).
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        batch: &AttentionBatch,
        kv: &KvLayer,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        params: &AttentionParams,
    ) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decode_token_takes_the_slot_a_chunk_would() {
        // The one-token path against the page-by-page one: a chunk's last
        // slot is where a decode token at that position goes.
        for ps in [1usize, 3, 4, 16] {
            let pages: Vec<u32> = (0..12).map(|i| (i * 5 + 2) as u32).collect();
            for prefix in 0..pages.len() * ps {
                let mut decode = BatchLayout::new(ps);
                decode.push_seq(prefix, 1, &pages).unwrap();
                let mut chunk = BatchLayout::new(ps);
                chunk.push_seq(0, prefix + 1, &pages).unwrap();
                assert_eq!(decode.slot_mapping, chunk.slot_mapping[prefix..]);
                assert_eq!(decode.page_table, chunk.page_table);
                assert_eq!(decode.seqs[0].pages, chunk.seqs[0].pages);
            }
            let mut l = BatchLayout::new(ps);
            assert!(l.push_seq(pages.len() * ps, 1, &pages).is_err());
        }
    }

    #[test]
    fn layout_slots() {
        let mut l = BatchLayout::new(4);
        l.push_seq(0, 5, &[7, 2]).unwrap();
        l.push_seq(6, 1, &[3, 9, 1]).unwrap();
        assert_eq!(l.slot_mapping, vec![28, 29, 30, 31, 8, 38]);
        assert_eq!(l.seqs[1].q_start, 5);
        assert_eq!(l.page_table, vec![7, 2, 3, 9]);
        assert!(l.push_seq(7, 2, &[1, 2]).is_err());
        assert!(!l.is_decode());
        l.validate(40).unwrap();
        assert!(l.validate(38).is_err());
    }

    #[test]
    fn tree_visibility_and_checks() {
        let mut l = BatchLayout::new(4);
        // root 0; 1 and 2 children of 0; 3 child of 2
        l.push_tree_seq(3, &[-1, 0, 0, 2], &[5, 6]).unwrap();
        let s = l.seqs[0].clone();
        assert!(l.sees(&s, 3, 2) && l.sees(&s, 3, 0) && l.sees(&s, 3, 3));
        assert!(!l.sees(&s, 3, 1) && !l.sees(&s, 1, 2) && !l.sees(&s, 0, 1));
        l.validate(28).unwrap();
        assert!(l.push_tree_seq(0, &[-1, 1], &[1]).is_err());
        assert!(l.push_tree_seq(0, &[0, -1], &[1]).is_err());
        let mut bad = l.clone();
        bad.tree_parents[2] = 3;
        assert!(bad.validate(28).is_err());
    }

    #[test]
    fn tree_mask_words_agree_with_visibility() {
        let mut l = BatchLayout::new(4);
        assert_eq!(l.tree_mask_words().unwrap(), None);
        l.push_seq(2, 3, &[1, 2]).unwrap();
        // A deep right branch: 0 - 1, 0 - 2 - 3 - ... - 39, plus 40 and 41 under 38.
        let mut parents = vec![-1, 0, 0];
        parents.extend(2..39);
        parents.extend([38, 38]);
        l.push_tree_seq(1, &parents, &(3..15).collect::<Vec<u32>>())
            .unwrap();
        let words = l.tree_mask_words().unwrap().unwrap();
        assert_eq!(words.len(), 4 * l.num_tokens());
        assert!(words[..12].iter().all(|&w| w == 0), "chain tokens");
        let s = l.seqs[1].clone();
        for j in 0..parents.len() {
            let row = &words[4 * (s.q_start + j)..4 * (s.q_start + j + 1)];
            let mut depth = 0;
            let mut a = j as i32;
            while parents[a as usize] >= 0 {
                a = parents[a as usize];
                depth += 1;
            }
            assert_eq!(row[0], depth + 1, "depth of {j}");
            for i in 0..96 {
                let bit = row[1 + i / 32] >> (i % 32) & 1 == 1;
                assert_eq!(bit, i < parents.len() && l.sees(&s, j, i), "{j} sees {i}");
            }
        }
        let mut big = BatchLayout::new(4);
        let chain: Vec<i32> = (-1..96).collect();
        big.push_tree_seq(0, &chain, &(0..25).collect::<Vec<u32>>())
            .unwrap();
        assert!(big.tree_mask_words().is_err());
    }
}
