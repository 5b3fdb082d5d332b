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
//! Invariants of a layout: sequences are packed in order (`q_start` of one
//! equals the end of the previous); each sequence's pages cover
//! `prefix_len + q_len` tokens; `slot_mapping` has one slot per new token.

use crate::error::{CoreError, Result};
use crate::kv::KvLayer;
use crate::tensor::Tensor;
use std::ops::Range;
use std::sync::Arc;

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
    pub fn push_seq(&mut self, prefix_len: usize, q_len: usize, pages: &[u32]) -> Result<()> {
        let ps = self.page_size;
        if ps == 0 {
            return Err(CoreError::invalid("batch layout with page_size 0"));
        }
        if q_len == 0 {
            return Err(CoreError::invalid("a sequence must add at least one token"));
        }
        let kv_len = prefix_len + q_len;
        if pages.len() * ps < kv_len {
            return Err(CoreError::invalid(format!(
                "{} pages of {ps} cannot hold {kv_len} tokens",
                pages.len()
            )));
        }
        let q_start = self.slot_mapping.len();
        let start = self.page_table.len();
        let used_pages = kv_len.div_ceil(ps);
        self.page_table.extend_from_slice(&pages[..used_pages]);
        for t in prefix_len..kv_len {
            let page = pages[t / ps] as usize;
            let slot = page * ps + t % ps;
            self.slot_mapping.push(
                u32::try_from(slot).map_err(|_| {
                    CoreError::invalid(format!("KV slot {slot} does not fit in u32"))
                })?,
            );
        }
        self.seqs.push(SeqLayout {
            q_start,
            q_len,
            prefix_len,
            pages: start..start + used_pages,
        });
        Ok(())
    }

    /// True when every sequence adds exactly one token (a pure decode batch).
    pub fn is_decode(&self) -> bool {
        self.seqs.iter().all(|s| s.q_len == 1)
    }
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
        Ok(())
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
    fn layout_slots() {
        let mut l = BatchLayout::new(4);
        l.push_seq(0, 5, &[7, 2]).unwrap();
        l.push_seq(6, 1, &[3, 9, 1]).unwrap();
        assert_eq!(l.slot_mapping, vec![28, 29, 30, 31, 8, 38]);
        assert_eq!(l.seqs[1].q_start, 5);
        assert_eq!(l.page_table, vec![7, 2, 3, 9]);
        assert!(l.push_seq(7, 2, &[1, 2]).is_err());
        assert!(!l.is_decode());
    }
}
