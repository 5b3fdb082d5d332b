//! The tensor-parallel executor: one [`LocalExecutor`] per rank (each with
//! its own device, model shard and KV cache shard), all running every step
//! plan at once, one thread per rank.
//!
//! Invariants:
//! - Every rank receives the same plan; the ranks' page tables are the
//!   scheduler's (one page pool mirrors all the shards: a page id names the
//!   same tokens on every rank, each rank holding its own heads).
//! - Collectives return bit-identical logits to every rank, so every rank
//!   samples the same tokens; rank 0's output is the step's output, and a
//!   rank whose output differs is an error, not a silent divergence.
//! - A rank that fails aborts the group so that no rank stays blocked in a
//!   collective; the group is reset before the step returns its error.
//! - [`TpRunners`](crate::speculative::TpRunners) runs a forward outside a plan (a LAYERSKIP drafter's) on
//!   every rank the same way.
//! - A plan's KV tier copies (HiCache, PD export and import) run once for
//!   the group, before the ranks compute: a host page holds every rank's
//!   heads in the single-engine layout ([`crate::executor::kv_ops`]), so
//!   the group's [`Executor::kv_spec`] is the whole model's cache shape.
//! - Weight refit and memory release ([`MemoryOp`]) apply to every rank;
//!   new weights are a shard per rank, checked on every rank before any
//!   rank changes, so the group never runs mixed weights.

use crate::comm::{Communicator, check_group, on_every_rank, settle};
use crate::error::{CoreError, Result};
use crate::executor::{Executor, ExecutorCapabilities, LocalExecutor, MemoryOp, RankWeights};
use crate::kv::KvSpec;
use crate::model::ModelSpec;
use crate::sampling::SamplingParams;
use crate::step::{MaskInput, StepOutput, StepPlan};
use std::sync::Arc;

/// Runs each plan on every rank of a tensor-parallel group.
pub struct TpExecutor {
    ranks: Vec<LocalExecutor>,
    comms: Vec<Arc<dyn Communicator>>,
    /// The whole model's shape (heads and widths of all ranks together).
    spec: ModelSpec,
    /// The whole model's KV cache shape (see [`TpExecutor::group_kv_spec`]).
    kv: KvSpec,
    /// Every rank holds the whole (latent) cache.
    kv_replicated: bool,
}

impl TpExecutor {
    /// Rank `i` is `ranks[i]`, communicating through `comms[i]`.
    pub fn new(ranks: Vec<LocalExecutor>, comms: Vec<Arc<dyn Communicator>>) -> Result<Self> {
        let first = ranks
            .first()
            .ok_or_else(|| CoreError::invalid("a tensor-parallel executor of no ranks"))?;
        check_group(&comms, ranks.len())?;
        let kv = first.kv_spec();
        if ranks.iter().any(|r| {
            let k = r.kv_spec();
            k.num_pages != kv.num_pages || k.page_size != kv.page_size
        }) {
            return Err(CoreError::invalid(
                "the ranks' KV caches differ in pages or page size",
            ));
        }
        let w = ranks.len();
        let spec = first
            .model_spec()
            .for_group(w, ranks.iter().map(|r| r.model_spec().weight_bytes).sum());
        let kv_replicated = first.model_spec().kv_values_in_keys;
        let kv = Self::group_kv_spec(kv, w);
        Ok(Self {
            ranks,
            comms,
            spec,
            kv,
            kv_replicated,
        })
    }

    /// The cache shape of a group of `world` ranks whose caches are `rank`:
    /// the ranks' KV heads together, or one rank's when each holds the whole
    /// latent cache (values in the keys: latent attention replicates it).
    pub fn group_kv_spec(rank: &KvSpec, world: usize) -> KvSpec {
        KvSpec {
            num_kv_heads: if rank.values_in_keys {
                rank.num_kv_heads
            } else {
                rank.num_kv_heads * world
            },
            ..*rank
        }
    }

    /// Ranks in the group.
    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }
}

impl Executor for TpExecutor {
    fn model_spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn kv_spec(&self) -> &KvSpec {
        &self.kv
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        ExecutorCapabilities {
            // A step returns once every rank has finished it.
            asynchronous: false,
            tree: self.ranks.iter().all(|r| r.capabilities().tree),
        }
    }

    fn sampler_name(&self) -> &str {
        self.ranks[0].sampler_name()
    }

    fn needs_context(&self, params: &SamplingParams) -> bool {
        self.ranks[0].needs_context(params)
    }

    /// Each rank counts the tokens its experts (or their slices) computed:
    /// every token on every rank when experts are split, each expert's
    /// tokens on its own rank only when they are partitioned; the largest
    /// count is the group's either way.
    fn expert_load(&self) -> Vec<crate::model::moe::ExpertLoad> {
        group_expert_load(&self.ranks)
    }

    /// Every rank's part of the operation, in rank order; new weights (one
    /// shard per rank, loaded with the rank's communicator) are checked on
    /// every rank before any rank changes.
    fn memory(&self, op: MemoryOp) -> Result<()> {
        match op {
            MemoryOp::Check(w) => self.check_shards(&w),
            MemoryOp::SwapModel(w) => {
                self.check_shards(&w)?;
                for (r, m) in self.ranks.iter().zip(w) {
                    r.memory(MemoryOp::SwapModel(vec![m]))?;
                }
                Ok(())
            }
            MemoryOp::Release { kv, weights } => {
                for r in &self.ranks {
                    r.memory(MemoryOp::Release { kv, weights })?;
                }
                Ok(())
            }
            MemoryOp::Resume(None) => {
                for r in &self.ranks {
                    r.memory(MemoryOp::Resume(None))?;
                }
                Ok(())
            }
            MemoryOp::Resume(Some(w)) => {
                self.check_shards(&w)?;
                for (r, m) in self.ranks.iter().zip(w) {
                    r.memory(MemoryOp::Resume(Some(vec![m])))?;
                }
                Ok(())
            }
        }
    }

    fn execute(&self, plan: &StepPlan) -> Result<StepOutput> {
        let shards: Vec<&LocalExecutor> = self.ranks.iter().collect();
        // `_loads` keeps the loaded host slots until the step's end.
        let (kv_copy, _loads) =
            crate::executor::kv_ops::copy_tier_pages(&shards, self.kv_replicated, &plan.kv_ops)?;
        let plans = rank_plans(plan, self.ranks.len());
        let results = on_every_rank(&self.comms, plans, |i, plan| self.ranks[i].execute(&plan));
        let mut results = settle(&self.comms, results)?.into_iter();
        let mut first = results
            .next()
            .ok_or_else(|| CoreError::Internal("no rank ran the step".into()))?;
        first.kv_copy = kv_copy;
        for (i, o) in results.enumerate() {
            if o.seqs
                .iter()
                .map(|s| &s.tokens)
                .ne(first.seqs.iter().map(|s| &s.tokens))
            {
                return Err(CoreError::Internal(format!(
                    "tensor-parallel rank {} sampled other tokens than rank 0",
                    i + 1
                )));
            }
        }
        Ok(first)
    }
}

impl TpExecutor {
    /// One shard per rank, each of its rank's shape.
    fn check_shards(&self, w: &RankWeights) -> Result<()> {
        if w.len() != self.ranks.len() {
            return Err(CoreError::invalid(format!(
                "{} models for {} tensor-parallel ranks (one shard per rank)",
                w.len(),
                self.ranks.len()
            )));
        }
        for (r, m) in self.ranks.iter().zip(w) {
            r.memory(MemoryOp::Check(vec![m.clone()]))?;
        }
        Ok(())
    }
}

/// A group's expert load from its ranks' counts: per layer and expert, the
/// largest count (see [`TpExecutor`]'s `expert_load`).
pub(crate) fn group_expert_load(ranks: &[LocalExecutor]) -> Vec<crate::model::moe::ExpertLoad> {
    let Some((first, rest)) = ranks.split_first() else {
        return Vec::new();
    };
    let mut merged = first.expert_load();
    for r in rest {
        for (m, l) in merged.iter_mut().zip(r.expert_load()) {
            for (a, b) in m.tokens.iter_mut().zip(l.tokens) {
                *a = (*a).max(b);
            }
        }
    }
    merged
}

/// One copy of `plan` per rank, without its KV tier copies: grammar masks
/// the scheduler sends late are received once here and handed to every
/// rank (a failed fill, a closed channel, stays a closed channel for each).
fn rank_plans(plan: &StepPlan, n: usize) -> Vec<StepPlan> {
    let masks = match &plan.masks {
        MaskInput::None => None,
        MaskInput::Ready(m) => Some(Some(m.clone())),
        MaskInput::Late(rx) => Some(rx.recv().ok()),
    };
    (0..n)
        .map(|_| StepPlan {
            seqs: plan.seqs.clone(),
            masks: match &masks {
                None => MaskInput::None,
                Some(Some(m)) => MaskInput::Ready(m.clone()),
                Some(None) => {
                    let (_, rx) = std::sync::mpsc::channel();
                    MaskInput::Late(rx)
                }
            },
            hidden_layers: plan.hidden_layers.clone(),
            // The group ran them (TpExecutor::execute).
            kv_ops: Default::default(),
        })
        .collect()
}
