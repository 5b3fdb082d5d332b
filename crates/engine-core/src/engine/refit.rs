//! RL weight refit and memory control of a running engine (SGLang's
//! `update_weights_from_disk`, `pause_generation`, `continue_generation`,
//! `release_memory_occupation`, `resume_memory_occupation`).
//!
//! Every operation is a message the scheduler thread handles between steps,
//! so a step runs entirely on the old weights or entirely on the new ones.
//!
//! - [`Engine::update_weights`]: one new model per data-parallel rank (on
//!   that rank's devices), each with the served model's
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
use crate::model::Model;
use std::sync::Arc;
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
        model: Arc<dyn Model>,
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
        model: Option<Arc<dyn Model>>,
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

    /// Checks that `models` holds one model per data-parallel rank (each
    /// rank's executor holds weights on its own devices), all of one shape;
    /// each rank then checks its model against the served one.
    fn check_rank_models(&self, models: &[Arc<dyn Model>], what: &str) -> Result<()> {
        if models.len() != self.dp_size() {
            return Err(CoreError::invalid(format!(
                "{what}: {} models for {} data-parallel ranks (one per rank)",
                models.len(),
                self.dp_size()
            )));
        }
        for m in &models[1..] {
            models[0].spec().same_shape(m.spec())?;
        }
        Ok(())
    }

    /// Replaces the weights by `models`' (one per data-parallel rank, in
    /// rank order; see the module doc). Blocks until every rank swapped
    /// (after its drain, with `opts.drain`). The report gives the requests
    /// running at the swaps on all ranks and the longest wait.
    pub fn update_weights(
        &self,
        models: Vec<Arc<dyn Model>>,
        opts: RefitOptions,
    ) -> Result<RefitReport> {
        self.check_rank_models(&models, "updating the weights")?;
        let reports = self.control(|rank, reply| Control::UpdateWeights {
            model: models[rank].clone(),
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

    /// Allocates the KV cache again and installs `models` (one per
    /// data-parallel rank; required when the weights were released), then resumes
    /// generation.
    pub fn resume_memory(&self, models: Option<Vec<Arc<dyn Model>>>) -> Result<()> {
        if let Some(m) = &models {
            self.check_rank_models(m, "reinstalling released weights")?;
        }
        self.control(|rank, reply| Control::Resume {
            model: models.as_ref().map(|m| m[rank].clone()),
            reply,
        })?;
        Ok(())
    }
}
