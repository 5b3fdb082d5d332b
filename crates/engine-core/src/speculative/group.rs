//! A tensor-parallel group's runners as a drafter sees them
//! ([`TpRunners`]): a forward outside a step plan on every rank (a LAYERSKIP
//! drafter runs the target's own sharded layers), and for a draft head that
//! runs whole on rank 0 the whole model's shape and LM head there.
//!
//! Invariant: every rank runs the same batch; a rank that fails aborts the
//! group (no rank stays blocked in a collective) and the group is reset
//! before the error returns.

use crate::comm::{Communicator, check_group, on_every_rank, settle};
use crate::error::{CoreError, Result};
use crate::model::{ForwardBatch, ForwardOutput, ModelSpec};
use crate::runner::ModelRunner;
use crate::tensor::{HostTensor, Tensor};
use std::sync::Arc;

/// A tensor-parallel group's runners, for drafters: a model forward outside
/// a step plan for one that runs the target's own (sharded) layers
/// (LAYERSKIP): every rank runs the same batch on its shard and its KV
/// cache, meeting in the layers' collectives; rank 0's output is the
/// group's (the logits are gathered, so every rank holds the same). And,
/// for a draft head that runs whole on rank 0 (EAGLE, EAGLE3, NEXTN), the
/// whole model's shape and its LM head over the whole vocabulary there.
pub struct TpRunners {
    runners: Vec<Arc<ModelRunner>>,
    comms: Vec<Arc<dyn Communicator>>,
    /// The whole model's shape (as [`TpExecutor`](crate::parallel::tp::TpExecutor)'s).
    spec: ModelSpec,
}

impl TpRunners {
    /// Rank `i`'s runner `runners[i]`, communicating through `comms[i]`
    /// (the runners the group's [`TpExecutor`](crate::parallel::tp::TpExecutor) executes with).
    pub fn new(runners: Vec<Arc<ModelRunner>>, comms: Vec<Arc<dyn Communicator>>) -> Result<Self> {
        if runners.is_empty() {
            return Err(CoreError::invalid("a tensor-parallel group of no ranks"));
        }
        check_group(&comms, runners.len())?;
        let spec = runners[0].spec().for_group(
            runners.len(),
            runners.iter().map(|r| r.spec().weight_bytes).sum(),
        );
        Ok(Self {
            runners,
            comms,
            spec,
        })
    }

    /// The whole model's shape (heads and widths of every rank together).
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// The LM head over the whole vocabulary on rank 0's device, `None`
    /// when the model exposes none: rank 0's own when it holds every row,
    /// the input embedding when the head is a view of that table (tied
    /// weights; the table is replicated), else a copy of every rank's rows
    /// (vocab-parallel) in rank order. Rows of every weight format are
    /// contiguous, so the copy is the ranks' bytes one after the other.
    pub fn whole_lm_head(&self) -> Result<Option<Tensor>> {
        let first = self.runners[0].model();
        let Some(head) = first.lm_head() else {
            return Ok(None);
        };
        let vocab = self.spec.vocab_size;
        if head.rows() == vocab {
            return Ok(Some(head));
        }
        if let Some(table) = first.input_embedding()
            && table.buffer_id() == head.buffer_id()
            && table.rows() == vocab
        {
            return Ok(Some(table));
        }
        let mut bytes = Vec::with_capacity(head.byte_len()? * self.runners.len());
        for (rank, r) in self.runners.iter().enumerate() {
            let part = r.model().lm_head().ok_or_else(|| {
                CoreError::invalid(format!("tensor-parallel rank {rank} has no LM head"))
            })?;
            if part.dtype() != head.dtype() || part.row_len() != head.row_len() {
                return Err(CoreError::invalid(format!(
                    "tensor-parallel rank {rank}'s LM head {part:?} is not rank 0's kind {head:?}"
                )));
            }
            let at = bytes.len();
            bytes.resize(at + part.byte_len()?, 0);
            r.backend().download(&part, &mut bytes[at..])?;
        }
        let host = HostTensor {
            dtype: head.dtype(),
            shape: vec![vocab, head.row_len()],
            data: std::borrow::Cow::Owned(bytes),
        };
        host.validate("the gathered LM head")?;
        self.runners[0].backend().upload(&host).map(Some)
    }

    /// Rank 0's runner (its device holds the gathered logits).
    pub fn first(&self) -> &Arc<ModelRunner> {
        &self.runners[0]
    }

    /// Runs `batch` on every rank; rank 0's output.
    pub fn forward(&self, batch: &ForwardBatch) -> Result<ForwardOutput> {
        let inputs = vec![(); self.runners.len()];
        let results = on_every_rank(&self.comms, inputs, |i, ()| self.runners[i].forward(batch));
        settle(&self.comms, results)?
            .into_iter()
            .next()
            .ok_or_else(|| CoreError::Internal("no rank ran the forward".into()))
    }
}
