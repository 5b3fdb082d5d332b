//! RL weight refit and memory control of a running engine (SGLang's
//! `update_weights_from_disk`, `pause_generation`, `continue_generation`,
//! `release_memory_occupation`, `resume_memory_occupation`).
//!
//! Every operation is a message the scheduler thread handles between steps,
//! so a step runs entirely on the old weights or entirely on the new ones.
//!
//! - [`Engine::update_weights`]: new weights for each data-parallel rank
//!   (on that rank's devices; a shard per rank of a tensor-parallel
//!   executor), each with the served model's
//!   shape ([`crate::ModelSpec::same_shape`]); otherwise it is refused and
//!   the old weights stay. With `drain`, no waiting request is admitted
//!   until the running ones finished; then the weights swap. Without it (or
//!   while generation is paused) they swap at the next step boundary and
//!   running requests continue on their existing KV. Either way the prefix
//!   cache is flushed and requests admitted later never match KV computed
//!   by older weights (the cache namespace carries the weight version).
//! - [`Engine::pause_generation`]: no step runs until
//!   [`Engine::continue_generation`]; `Abort` aborts every request first,
//!   `Retract` moves the running ones back to the queue (their KV to the
//!   cache), `InPlace` keeps them as they are. New requests queue meanwhile.
//! - [`Engine::release_memory`]: with no request running, flushes the cache
//!   and frees the KV cache and/or the weights; generation stays paused
//!   until [`Engine::resume_memory`] gives the memory (and weights) back.

use super::{Engine, Msg};
use crate::error::{CoreError, Result};
use crate::executor::RankWeights;
use std::sync::mpsc;
use std::time::Duration;

/// How [`Engine::pause_generation`] treats the requests in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PauseMode {
    /// Abort every request (SGLang's default).
    Abort,
    /// Move running requests back to the waiting queue.
    Retract,
    /// Keep them as they are; they continue after `continue_generation`.
    InPlace,
}

impl std::str::FromStr for PauseMode {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "abort" => Ok(Self::Abort),
            "retract" => Ok(Self::Retract),
            "in_place" => Ok(Self::InPlace),
            other => Err(CoreError::invalid(format!(
                "unknown pause mode '{other}' (abort, retract, in_place)"
            ))),
        }
    }
}

/// How a weight update is applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RefitOptions {
    /// Let running requests finish first (admitting none meanwhile).
    pub drain: bool,
    /// Stay paused after the update (until `continue_generation`).
    pub keep_pause: bool,
}

/// What a weight update did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefitReport {
    /// Weight updates applied since start (this one included).
    pub version: u64,
    /// Requests running or paused when the weights swapped (they continue
    /// on KV partly computed by the old weights).
    pub running_at_swap: usize,
    /// Time from the request reaching the scheduler to the swap (the drain).
    pub waited: Duration,
}

/// Messages of this module to the scheduler thread.
pub(crate) enum Control {
    UpdateWeights {
        weights: RankWeights,
        opts: RefitOptions,
        reply: mpsc::Sender<Result<RefitReport>>,
    },
    Pause {
        mode: PauseMode,
        reply: mpsc::Sender<Result<usize>>,
    },
    Continue {
        reply: mpsc::Sender<Result<()>>,
    },
    Release {
        kv: bool,
        weights: bool,
        reply: mpsc::Sender<Result<()>>,
    },
    Resume {
        weights: Option<RankWeights>,
        reply: mpsc::Sender<Result<()>>,
    },
}

impl Engine {
    /// Runs `make`'s control on every rank (`make` gets the rank), in rank
    /// order; the first error wins (after every rank answered).
    fn control<T>(
        &self,
        make: impl Fn(usize, mpsc::Sender<Result<T>>) -> Control,
    ) -> Result<Vec<T>> {
        let (tx, rx) = mpsc::channel();
        self.send_each(|rank| Msg::Control(make(rank, tx.clone())))?;
        drop(tx);
        let answers: Vec<Result<T>> = self
            .ranks
            .iter()
            .map(|_| {
                rx.recv().map_err(|_| {
                    CoreError::Internal("the scheduler stopped before answering".into())
                })?
            })
            .collect();
        answers.into_iter().collect()
    }

    /// Checks that `weights` holds the weights of each data-parallel rank
    /// (each rank's executor holds them on its own devices), the ranks'
    /// alike in shape; each rank then checks its own against the served
    /// model before any rank changes.
    fn check_rank_weights(&self, weights: &[RankWeights], what: &str) -> Result<()> {
        if weights.len() != self.dp_size() {
            return Err(CoreError::invalid(format!(
                "{what}: {} models for {} data-parallel ranks (one per rank)",
                weights.len(),
                self.dp_size()
            )));
        }
        let first = &weights[0];
        for w in &weights[1..] {
            if w.len() != first.len() {
                return Err(CoreError::invalid(format!(
                    "{what}: the data-parallel ranks' weights differ in shards"
                )));
            }
            for (a, b) in first.iter().zip(w) {
                a.spec().same_shape(b.spec())?;
            }
        }
        Ok(())
    }

    /// Replaces the weights by `weights` (each data-parallel rank's, in rank
    /// order: a model per tensor-parallel rank of its executor; see the
    /// module doc). Blocks until every rank swapped
    /// (after its drain, with `opts.drain`). The report gives the requests
    /// running at the swaps on all ranks and the longest wait.
    pub fn update_weights(
        &self,
        weights: Vec<RankWeights>,
        opts: RefitOptions,
    ) -> Result<RefitReport> {
        self.check_rank_weights(&weights, "updating the weights")?;
        let reports = self.control(|rank, reply| Control::UpdateWeights {
            weights: weights[rank].clone(),
            opts,
            reply,
        })?;
        reports
            .into_iter()
            .reduce(|a, b| RefitReport {
                version: a.version.max(b.version),
                running_at_swap: a.running_at_swap + b.running_at_swap,
                waited: a.waited.max(b.waited),
            })
            .ok_or_else(|| CoreError::Internal("no rank answered the weight update".into()))
    }

    /// Pauses generation; returns the requests left paused (running, or
    /// queued by retraction) on every rank.
    pub fn pause_generation(&self, mode: PauseMode) -> Result<usize> {
        Ok(self
            .control(|_, reply| Control::Pause { mode, reply })?
            .into_iter()
            .sum())
    }

    /// Resumes generation after a pause (not after a release: resume memory).
    pub fn continue_generation(&self) -> Result<()> {
        self.control(|_, reply| Control::Continue { reply })?;
        Ok(())
    }

    /// Frees the KV cache (`kv`) and/or the weights (`weights`); refused while
    /// requests run.
    pub fn release_memory(&self, kv: bool, weights: bool) -> Result<()> {
        self.control(|_, reply| Control::Release { kv, weights, reply })?;
        Ok(())
    }

    /// Allocates the KV cache again and installs `weights` (each
    /// data-parallel rank's, as for [`Engine::update_weights`]; required
    /// when the weights were released), then resumes
    /// generation.
    pub fn resume_memory(&self, weights: Option<Vec<RankWeights>>) -> Result<()> {
        if let Some(w) = &weights {
            self.check_rank_weights(w, "reinstalling released weights")?;
        }
        self.control(|rank, reply| Control::Resume {
            weights: weights.as_ref().map(|w| w[rank].clone()),
            reply,
        })?;
        Ok(())
    }
}
