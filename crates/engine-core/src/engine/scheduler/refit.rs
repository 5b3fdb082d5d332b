//! The scheduler's side of weight refit and memory control
//! ([`crate::engine::refit`]): the pause state, a refit waiting for running
//! requests to drain, and the weight version that salts cache namespaces.
//!
//! Invariants: while `paused`, no step runs (the loop only handles
//! messages); while a drained refit is pending, no waiting request is
//! admitted (a chunked prefill in progress continues); once weights swapped,
//! the cache holds no unlocked node, and every request admitted afterwards
//! has a namespace carrying the new version, so it cannot match KV that
//! running requests computed with the old weights.

use super::Scheduler;
use crate::engine::refit::{Control, PauseMode, RefitOptions, RefitReport};
use crate::error::{CoreError, Result};
use crate::executor::MemoryOp;
use crate::executor::RankWeights;
use crate::kv::prefix_cache::CacheNamespace;
use std::sync::mpsc;
use std::time::Instant;

/// Separates a namespace from its weight version.
const VERSION_MARK: &str = "\u{1e}w";

struct PendingRefit {
    weights: RankWeights,
    opts: RefitOptions,
    since: Instant,
    reply: mpsc::Sender<Result<RefitReport>>,
}

/// Refit and pause state of the scheduler.
#[derive(Default)]
pub(super) struct RefitState {
    /// No step runs (pause_generation, or memory released).
    paused: bool,
    /// KV cache or weights released.
    released: bool,
    /// Weights released (resume needs new ones).
    weights_released: bool,
    pending: Option<PendingRefit>,
    /// Weight updates applied; 0 keeps namespaces as they are.
    version: u64,
}

/// `ns` for weight version `v`.
fn versioned(ns: &CacheNamespace, v: u64) -> CacheNamespace {
    if v == 0 {
        return ns.clone();
    }
    let s = ns.0.as_deref().unwrap_or("");
    let base = s.rsplit_once(VERSION_MARK).map_or(s, |(b, _)| b);
    CacheNamespace(Some(format!("{base}{VERSION_MARK}{v}")))
}

impl Scheduler {
    /// Nothing holds KV for a step: no running, chunked or look-ahead request.
    fn nothing_running(&self) -> bool {
        self.running.is_empty() && self.chunked.is_none() && self.lookahead.is_empty()
    }

    /// No step may run now.
    pub(super) fn halted(&self) -> bool {
        self.refit.paused
    }

    /// Waiting requests are not admitted now.
    pub(super) fn admission_held(&self) -> bool {
        self.refit.paused || self.refit.pending.is_some()
    }

    /// The namespace a request accepted now gets.
    pub(super) fn current_namespace(&self, ns: &CacheNamespace) -> CacheNamespace {
        versioned(ns, self.refit.version)
    }

    /// Applies a drained refit once nothing runs.
    pub(super) fn poll_refit(&mut self) {
        if self.refit.pending.is_some()
            && self.nothing_running()
            && let Some(p) = self.refit.pending.take()
        {
            self.apply_refit(p);
        }
    }

    pub(super) fn control(&mut self, c: Control) {
        match c {
            Control::UpdateWeights {
                weights,
                opts,
                reply,
            } => {
                let p = PendingRefit {
                    weights,
                    opts,
                    since: Instant::now(),
                    reply,
                };
                if let Err(e) = self.check_refit(&p) {
                    let _ = p.reply.send(Err(e));
                } else if opts.drain && !self.refit.paused && !self.nothing_running() {
                    self.refit.pending = Some(p);
                } else {
                    self.apply_refit(p);
                }
            }
            Control::Pause { mode, reply } => {
                let _ = reply.send(Ok(self.pause(mode)));
            }
            Control::Continue { reply } => {
                let r = if self.refit.released {
                    Err(CoreError::invalid(
                        "memory is released: resume memory occupation instead",
                    ))
                } else {
                    self.refit.paused = false;
                    Ok(())
                };
                let _ = reply.send(r);
            }
            Control::Release { kv, weights, reply } => {
                let _ = reply.send(self.release(kv, weights));
            }
            Control::Resume { weights, reply } => {
                let _ = reply.send(self.resume(weights));
            }
        }
        self.publish();
    }

    fn check_refit(&self, p: &PendingRefit) -> Result<()> {
        if self.refit.pending.is_some() {
            return Err(CoreError::invalid("another weight update is in progress"));
        }
        if self.refit.weights_released {
            return Err(CoreError::invalid(
                "the weights are released: resume memory occupation first",
            ));
        }
        self.executor.memory(MemoryOp::Check(p.weights.clone()))
    }

    fn apply_refit(&mut self, p: PendingRefit) {
        let running_at_swap =
            self.running.len() + usize::from(self.chunked.is_some()) + self.lookahead.len();
        if let Err(e) = self.executor.memory(MemoryOp::SwapModel(p.weights)) {
            let _ = p.reply.send(Err(e));
            return;
        }
        self.refit.version += 1;
        // The cache's KV was computed by the old weights.
        self.flush_cache();
        let v = self.refit.version;
        for r in self.waiting.iter_mut() {
            for f in r.followers.iter_mut() {
                f.ns = versioned(&f.ns, v);
            }
            if r.node.is_none() {
                r.ns = versioned(&r.ns, v);
            }
        }
        if p.opts.keep_pause {
            self.refit.paused = true;
        }
        tracing::info!(
            "weights updated (version {v}) after {:.3} s, {running_at_swap} requests running",
            p.since.elapsed().as_secs_f64()
        );
        let _ = p.reply.send(Ok(RefitReport {
            version: v,
            running_at_swap,
            waited: p.since.elapsed(),
        }));
    }

    fn pause(&mut self, mode: PauseMode) -> usize {
        match mode {
            PauseMode::Abort => self.abort(
                |_| true,
                super::AbortCause::Requested,
                "aborted by pause_generation",
            ),
            PauseMode::Retract => {
                while !self.running.is_empty() {
                    self.retract_one();
                }
                let mut back: Vec<_> = self.lookahead.drain(..).map(|e| e.req).collect();
                back.extend(self.chunked.take());
                for mut r in back.into_iter().rev() {
                    self.release_kv(&mut r, true);
                    self.waiting.push_front(r);
                }
            }
            PauseMode::InPlace => {}
        }
        self.refit.paused = true;
        self.running.len()
            + usize::from(self.chunked.is_some())
            + self.lookahead.len()
            + self.waiting.len()
    }

    fn release(&mut self, kv: bool, weights: bool) -> Result<()> {
        if !self.nothing_running() || self.refit.pending.is_some() {
            return Err(CoreError::invalid(
                "requests are running: pause generation (abort or retract) or let them finish first",
            ));
        }
        // Pending tier copies (backups) read device pages: run them first.
        self.run_tier_copies()?;
        // Nothing is locked: the cache frees every page, so the pool is whole.
        self.flush_cache();
        self.executor.memory(MemoryOp::Release { kv, weights })?;
        self.refit.released |= kv || weights;
        self.refit.weights_released |= weights;
        self.refit.paused = true;
        Ok(())
    }

    fn resume(&mut self, weights: Option<RankWeights>) -> Result<()> {
        if !self.refit.released {
            return Err(CoreError::invalid("memory is not released"));
        }
        if self.refit.weights_released && weights.is_none() {
            return Err(CoreError::invalid(
                "the weights were released: resume needs weights",
            ));
        }
        if let Some(w) = &weights {
            self.executor.memory(MemoryOp::Check(w.clone()))?;
        }
        self.executor.memory(MemoryOp::Resume(weights))?;
        self.refit.released = false;
        self.refit.weights_released = false;
        self.refit.paused = false;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_carry_the_version() {
        let plain = CacheNamespace(None);
        assert_eq!(versioned(&plain, 0), plain);
        let v1 = versioned(&plain, 1);
        assert_ne!(v1, plain);
        assert_eq!(versioned(&v1, 2), versioned(&plain, 2));
        let salted = CacheNamespace::new(Some("k"), None);
        assert_ne!(versioned(&salted, 1), v1);
        assert_eq!(versioned(&versioned(&salted, 1), 3), versioned(&salted, 3));
    }
}
