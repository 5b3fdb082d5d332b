//! Log-probabilities of rows sampled where the logits are: the executor's
//! device path for requests that ask for logprobs.
//!
//! Before the rows are edited and sampled, [`DeviceLogprobs::start`] copies
//! the raw logits of the rows that want logprobs (a gather on the device)
//! and computes their statistics there ([`Backend::logprob_stats`]:
//! log-sum-exp and the top alternatives). Once the tokens are known,
//! [`DeviceLogprobs::finish`] gathers each sampled token's raw logit from
//! the copy and downloads only the statistics: a few floats per row instead
//! of the vocabulary. Logprobs are of the raw logits (before penalties,
//! bias and masks), as on the host path.

use crate::backend::{Backend, MAX_TOP_LOGPROBS};
use crate::dtype::DType;
use crate::error::Result;
use crate::tensor::Tensor;

/// Where token `t` of row `r` lies in `[rows, vocab]` logits read as one
/// column; a token past the vocabulary reads past every row, which a
/// gather gives as zero (its rule for a row past the input).
fn flat_index(r: usize, t: u32, vocab: usize) -> u32 {
    if (t as usize) < vocab {
        (r * vocab + t as usize) as u32
    } else {
        u32::MAX
    }
}

/// Logprob statistics of some rows of a step's logits, on the device.
pub(crate) struct DeviceLogprobs {
    /// `[n, vocab]` raw logits of the rows.
    raw: Tensor,
    lse: Tensor,
    ids: Tensor,
    vals: Tensor,
    /// Alternatives computed per row (the most any of the rows asked for).
    top: usize,
}

/// One row's logprob: the sampled token's and the alternatives'.
#[derive(Clone, Debug, Default)]
pub(crate) struct RowLogprob {
    /// The sampled token's log-probability.
    pub logprob: f32,
    /// The top alternatives as (id, logprob), best first.
    pub top: Vec<(u32, f32)>,
    /// The row's log-sum-exp.
    pub lse: f32,
}

impl DeviceLogprobs {
    /// Whether a request asking for `top` alternatives fits the device path.
    pub fn fits(top: usize) -> bool {
        top <= MAX_TOP_LOGPROBS
    }

    /// Statistics of rows `rows` of `logits`, with `top` alternatives
    /// (capped at the vocabulary).
    pub fn start(backend: &dyn Backend, logits: &Tensor, rows: &[u32], top: usize) -> Result<Self> {
        let vocab = logits.row_len();
        let top = top.min(vocab);
        let n = rows.len();
        let idx = backend.upload_u32(&[n], rows)?;
        let raw = backend.alloc(DType::F32, &[n, vocab])?;
        backend.gather_rows(logits, &idx, &raw)?;
        Self::of_rows(backend, raw, top)
    }

    /// Statistics of every row of `raw` (rows no later step edits: a view
    /// of the logits is enough, nothing is copied).
    pub fn of_rows(backend: &dyn Backend, raw: Tensor, top: usize) -> Result<Self> {
        let (n, vocab) = (raw.rows(), raw.row_len());
        let top = top.min(vocab);
        let lse = backend.alloc(DType::F32, &[n])?;
        let ids = backend.alloc(DType::U32, &[n, top])?;
        let vals = backend.alloc(DType::F32, &[n, top])?;
        backend.logprob_stats(&raw, top, &lse, &ids, &vals)?;
        Ok(Self {
            raw,
            lse,
            ids,
            vals,
            top,
        })
    }

    /// Per row, the logprob of `tokens[row]` and the alternatives.
    pub fn finish(&self, backend: &dyn Backend, tokens: &[u32]) -> Result<Vec<RowLogprob>> {
        let (n, vocab) = (self.raw.rows(), self.raw.row_len());
        let flat: Vec<u32> = tokens
            .iter()
            .enumerate()
            .map(|(r, &t)| flat_index(r, t, vocab))
            .collect();
        let idx = backend.upload_u32(&[n], &flat)?;
        let picked = backend.alloc(DType::F32, &[n, 1])?;
        backend.gather_rows(&self.raw.reshape(&[n * vocab, 1])?, &idx, &picked)?;
        let picked = backend.download_f32(&picked)?;
        let lse = backend.download_f32(&self.lse)?;
        let vals = backend.download_f32(&self.vals)?;
        let ids = backend.download_u32(&self.ids)?;
        Ok((0..n)
            .map(|r| RowLogprob {
                logprob: if (tokens[r] as usize) < vocab {
                    picked[r] - lse[r]
                } else {
                    f32::NEG_INFINITY
                },
                top: (r * self.top..(r + 1) * self.top)
                    .map(|k| (ids[k], vals[k]))
                    .collect(),
                lse: lse[r],
            })
            .collect())
    }

    /// Per row `r`, the log-probabilities of the ids `ids[r]` names, in
    /// order (an id past the vocabulary scores negative infinity), with
    /// each row's log-sum-exp from [`finish`](Self::finish): gathered where
    /// the logits are, so only the named values cross to the host.
    pub fn named(
        &self,
        backend: &dyn Backend,
        rows: &[RowLogprob],
        ids: &[Option<&[u32]>],
    ) -> Result<Vec<Vec<(u32, f32)>>> {
        let (n, vocab) = (self.raw.rows(), self.raw.row_len());
        let mut flat = Vec::new();
        for (r, row_ids) in ids.iter().enumerate().take(n) {
            for &t in row_ids.unwrap_or_default() {
                flat.push(flat_index(r, t, vocab));
            }
        }
        if flat.is_empty() {
            return Ok(vec![Vec::new(); ids.len()]);
        }
        let idx = backend.upload_u32(&[flat.len()], &flat)?;
        let picked = backend.alloc(DType::F32, &[flat.len(), 1])?;
        backend.gather_rows(&self.raw.reshape(&[n * vocab, 1])?, &idx, &picked)?;
        let mut picked = backend.download_f32(&picked)?.into_iter();
        let mut out = Vec::with_capacity(ids.len());
        for (r, row_ids) in ids.iter().enumerate() {
            let lse = rows.get(r).map_or(0.0, |l| l.lse);
            let row: Vec<(u32, f32)> = row_ids
                .unwrap_or_default()
                .iter()
                .map(|&t| {
                    let v = picked.next().unwrap_or(f32::NEG_INFINITY);
                    let lp = if (t as usize) < vocab {
                        v - lse
                    } else {
                        f32::NEG_INFINITY
                    };
                    (t, lp)
                })
                .collect();
            out.push(row);
        }
        Ok(out)
    }

    /// The rank of `tokens[r]` among row `r`'s logits (1: the most likely;
    /// `None` for a token past the vocabulary).
    pub fn ranks(&self, backend: &dyn Backend, tokens: &[u32]) -> Result<Vec<Option<u32>>> {
        let vocab = self.raw.row_len();
        Ok(backend
            .logit_ranks(&self.raw, tokens)?
            .into_iter()
            .zip(tokens)
            .map(|(k, &t)| ((t as usize) < vocab).then_some(k))
            .collect())
    }
}
