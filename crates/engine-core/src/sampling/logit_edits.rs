//! Edits of logits rows before sampling, built on the host from sparse
//! request state and applied where the logits are ([`Backend::edit_logits`]).
//!
//! A step's [`LogitEdits`] holds, per row of a `[rows, vocab]` logits tensor,
//! a few token edits and optionally a grammar mask. A [`TokenEdit`] maps the
//! token's logit `x` through fixed stages, in order:
//!
//! 1. repetition: `x * pos_scale` when `x > 0`, else `x * neg_scale`
//!    (`1 / r` and `r` for a repetition penalty `r`, both 1 for none);
//! 2. `x - penalty` (frequency and presence penalties);
//! 3. `x + bias` (`logit_bias`);
//! 4. `-inf` when `forbidden` (`min_new_tokens` keeping EOS and stop ids out).
//!
//! then the row's mask sets every token it disallows to `-inf`. Every stage
//! is one correctly rounded f32 operation (no division, which GPUs may round
//! otherwise), so a device applying them gives the same bits as the host.
//!
//! Invariants, checked by [`LogitEdits::check`]: entries are sorted by
//! (row, token) and unique; rows and tokens lie inside the logits; masks
//! have `vocab.div_ceil(32)` words each (missing words of a shorter mask
//! are zero: those tokens are disallowed, as on the host).
//!
//! Processors contribute through [`RowEdits`], which keeps the stage order:
//! a processor that writes a stage another already passed for a token (which
//! the host would apply in another order, with other rounding) makes the row
//! [`RowEdits::is_exact`] false, and the caller then processes it on the host.
//!
//! [`Backend::edit_logits`]: crate::backend::Backend::edit_logits

use crate::error::{CoreError, Result};
use crate::grammar::TokenBitmask;
use std::collections::HashMap;

/// One token's edit in one row (the module's stages, in order).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenEdit {
    /// Row of the logits tensor.
    pub row: u32,
    /// Token id (column).
    pub token: u32,
    /// Factor of a positive logit.
    pub pos_scale: f32,
    /// Factor of a logit at or below zero.
    pub neg_scale: f32,
    /// Subtracted after scaling.
    pub penalty: f32,
    /// Added after the penalty.
    pub bias: f32,
    /// The logit becomes `-inf`.
    pub forbidden: bool,
}

impl TokenEdit {
    fn new(row: u32, token: u32) -> Self {
        Self {
            row,
            token,
            pos_scale: 1.0,
            neg_scale: 1.0,
            penalty: 0.0,
            bias: 0.0,
            forbidden: false,
        }
    }

    /// The edit as the device kernels read it: row, token (bit 31:
    /// forbidden), then the f32 bits of pos_scale, neg_scale, penalty, bias.
    pub fn device_words(&self) -> [u32; 6] {
        [
            self.row,
            self.token | (u32::from(self.forbidden) << 31),
            self.pos_scale.to_bits(),
            self.neg_scale.to_bits(),
            self.penalty.to_bits(),
            self.bias.to_bits(),
        ]
    }

    /// The edited logit.
    pub fn apply(&self, x: f32) -> f32 {
        if self.forbidden {
            return f32::NEG_INFINITY;
        }
        let x = if x > 0.0 {
            x * self.pos_scale
        } else {
            x * self.neg_scale
        };
        (x - self.penalty) + self.bias
    }
}

/// Token edits and masks of one step's logits rows.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitEdits {
    /// Sorted by (row, token), unique.
    pub tokens: Vec<TokenEdit>,
    /// Rows that carry a mask, increasing.
    pub mask_rows: Vec<u32>,
    /// `mask_rows.len() * mask_words` words: each masked row's allowed ids.
    pub mask_bits: Vec<u32>,
    /// Words per mask (`vocab.div_ceil(32)`).
    pub mask_words: usize,
}

impl LogitEdits {
    /// No edits for rows of `vocab` logits.
    pub fn new(vocab: usize) -> Self {
        Self {
            mask_words: vocab.div_ceil(32),
            ..Self::default()
        }
    }

    /// Whether applying the edits changes nothing.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty() && self.mask_rows.is_empty()
    }

    /// Masks `row` with `mask` (rows in increasing order, after its token edits).
    pub fn push_mask(&mut self, row: u32, mask: &TokenBitmask) -> Result<()> {
        if self.mask_rows.last().is_some_and(|&r| r >= row) {
            return Err(CoreError::invalid(format!(
                "logit mask rows out of order at row {row}"
            )));
        }
        self.mask_rows.push(row);
        let words = mask.words();
        let n = words.len().min(self.mask_words);
        self.mask_bits.extend_from_slice(&words[..n]);
        self.mask_bits
            .extend(std::iter::repeat_n(0, self.mask_words - n));
        Ok(())
    }

    /// Checks the module invariants against `[rows, vocab]` logits.
    pub fn check(&self, rows: usize, vocab: usize) -> Result<()> {
        let bad = |what: String| Err(CoreError::invalid(format!("logit edits: {what}")));
        if self.mask_words != vocab.div_ceil(32) {
            return bad(format!(
                "masks of {} words for a vocabulary of {vocab}",
                self.mask_words
            ));
        }
        if self.mask_bits.len() != self.mask_rows.len() * self.mask_words {
            return bad(format!(
                "{} mask words for {} masked rows",
                self.mask_bits.len(),
                self.mask_rows.len()
            ));
        }
        if !self.mask_rows.is_sorted_by(|a, b| a < b) {
            return bad("mask rows not increasing".into());
        }
        if self.mask_rows.last().is_some_and(|&r| r as usize >= rows) {
            return bad(format!("a mask past row {rows}"));
        }
        let key = |e: &TokenEdit| (e.row, e.token);
        if !self.tokens.is_sorted_by(|a, b| key(a) < key(b)) {
            return bad("token edits not sorted by (row, token) or repeated".into());
        }
        if let Some(e) = self
            .tokens
            .iter()
            .find(|e| e.row as usize >= rows || e.token as usize >= vocab)
        {
            return bad(format!(
                "an edit of token {} in row {} of [{rows}, {vocab}] logits",
                e.token, e.row
            ));
        }
        Ok(())
    }

    /// Applies the edits to `[rows, vocab]` logits on the host (the
    /// definition every backend's implementation matches bit for bit).
    pub fn apply(&self, logits: &mut [f32], vocab: usize) -> Result<()> {
        let rows = logits.len().checked_div(vocab).unwrap_or(0);
        if rows * vocab != logits.len() {
            return Err(CoreError::invalid(format!(
                "logit edits on {} values of rows of {vocab}",
                logits.len()
            )));
        }
        self.check(rows, vocab)?;
        for e in &self.tokens {
            let x = &mut logits[e.row as usize * vocab + e.token as usize];
            *x = e.apply(*x);
        }
        for (&r, words) in self
            .mask_rows
            .iter()
            .zip(self.mask_bits.chunks_exact(self.mask_words.max(1)))
        {
            let row = &mut logits[r as usize * vocab..(r as usize + 1) * vocab];
            for (chunk, &w) in row.chunks_mut(32).zip(words) {
                if w == u32::MAX {
                    continue;
                }
                for (j, x) in chunk.iter_mut().enumerate() {
                    if w & (1 << j) == 0 {
                        *x = f32::NEG_INFINITY;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The stages of [`TokenEdit`], as bits of what a token has had written.
const REPETITION: u8 = 1;
const PENALTY: u8 = 2;
const BIAS: u8 = 4;

/// Builds one row's token edits from the processors that act on it, in
/// their order (see the module doc for when the row stops being exact).
#[derive(Debug)]
pub struct RowEdits {
    row: u32,
    vocab: usize,
    /// (edit, stages written), in first-touch order.
    edits: Vec<(TokenEdit, u8)>,
    /// Position in `edits` of each token's edit.
    index: HashMap<u32, usize>,
    exact: bool,
}

impl RowEdits {
    /// Starts the edits of `row` of `[_, vocab]` logits; they join a
    /// step's [`LogitEdits`] when [finished](RowEdits::finish).
    pub fn new(row: u32, vocab: usize) -> Self {
        Self {
            row,
            vocab,
            edits: Vec::new(),
            index: HashMap::new(),
            exact: true,
        }
    }

    fn slot(&mut self, token: u32) -> &mut (TokenEdit, u8) {
        let i = *self.index.entry(token).or_insert_with(|| {
            self.edits.push((TokenEdit::new(self.row, token), 0));
            self.edits.len() - 1
        });
        &mut self.edits[i]
    }

    fn entry(&mut self, token: u32, stage: u8) -> Option<&mut TokenEdit> {
        if token as usize >= self.vocab {
            // The host ignores ids past the vocabulary too.
            return None;
        }
        // A stage written twice, or before one already written, would be
        // applied in another order than the processors gave.
        let in_order = self.slot(token).1 < stage;
        self.exact &= in_order;
        let (e, written) = self.slot(token);
        *written |= stage;
        Some(e)
    }

    /// Repetition penalty `r` (> 0) on `token`: positive logits are divided
    /// by `r` (multiplied by its f32 reciprocal), others multiplied.
    pub fn repeat(&mut self, token: u32, r: f32) {
        if let Some(e) = self.entry(token, REPETITION) {
            e.pos_scale = 1.0 / r;
            e.neg_scale = r;
        }
    }

    /// Subtracts `v` from `token`'s logit.
    pub fn penalize(&mut self, token: u32, v: f32) {
        if let Some(e) = self.entry(token, PENALTY) {
            e.penalty = v;
        }
    }

    /// Adds `v` to `token`'s logit.
    pub fn bias(&mut self, token: u32, v: f32) {
        if let Some(e) = self.entry(token, BIAS) {
            e.bias = v;
        }
    }

    /// Sets `token`'s logit to `-inf` (absorbing: the order of the other
    /// stages does not matter then).
    pub fn forbid(&mut self, token: u32) {
        if (token as usize) < self.vocab {
            self.slot(token).0.forbidden = true;
        }
    }

    /// Whether the edits equal what the processors do on the host.
    pub fn is_exact(&self) -> bool {
        self.exact
    }

    /// Marks the row as not expressible (a processor acts on it in a way
    /// token edits cannot say).
    pub fn give_up(&mut self) {
        self.exact = false;
    }

    /// Adds the row's edits to `all` (rows in increasing order).
    pub fn finish(mut self, all: &mut LogitEdits) -> Result<()> {
        if all.tokens.last().is_some_and(|e| e.row >= self.row) {
            return Err(CoreError::invalid(format!(
                "logit edit rows out of order at row {}",
                self.row
            )));
        }
        self.edits.sort_unstable_by_key(|(e, _)| e.token);
        all.tokens.extend(self.edits.into_iter().map(|(e, _)| e));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stages_apply_in_order() {
        let mut all = LogitEdits::new(4);
        let mut r = RowEdits::new(0, 4);
        r.repeat(1, 2.0);
        r.penalize(1, 0.5);
        r.bias(1, 1.0);
        r.repeat(2, 2.0);
        r.forbid(3);
        r.bias(9, 1.0); // past the vocabulary: ignored
        assert!(r.is_exact());
        r.finish(&mut all).unwrap();
        let mut l = vec![1.0, 3.0, -3.0, 7.0];
        all.apply(&mut l, 4).unwrap();
        assert_eq!(l, vec![1.0, 3.0 * 0.5 - 0.5 + 1.0, -6.0, f32::NEG_INFINITY]);
    }

    #[test]
    fn out_of_order_stages_are_not_exact() {
        let mut r = RowEdits::new(0, 4);
        r.bias(1, 1.0);
        r.repeat(1, 2.0);
        assert!(!r.is_exact());
        let mut r = RowEdits::new(0, 4);
        r.bias(1, 1.0);
        r.bias(1, 1.0);
        assert!(!r.is_exact());
    }

    #[test]
    fn masks_cover_missing_words_as_disallowed() {
        let mut all = LogitEdits::new(40);
        let mut m = TokenBitmask::new(33);
        m.allow(0);
        m.allow(32);
        all.push_mask(1, &m).unwrap();
        let mut l = vec![1.0f32; 80];
        all.apply(&mut l, 40).unwrap();
        assert!(l[..40].iter().all(|&x| x == 1.0));
        let allowed: Vec<usize> = (0..40).filter(|&j| l[40 + j] == 1.0).collect();
        assert_eq!(allowed, vec![0, 32]);
        // Bad shapes are refused.
        assert!(all.check(1, 40).is_err());
        assert!(all.check(2, 65).is_err());
        assert!(all.push_mask(0, &m).is_err());
    }
}
