//! The executors of data-parallel attention (SGLang's
//! `--enable-dp-attention`): one scheduler per rank, each with its own
//! requests, page pool and KV cache, whose forwards run in lock-step because
//! the model's feed-forward layers are sharded over the ranks and gather
//! every rank's tokens (models `AttentionSharding::DataParallel`).
//!
//! [`DpAttentionGroup`] owns the ranks' [`LocalExecutor`]s; each scheduler
//! gets a [`DpAttentionRank`]. A plan submitted by a rank waits for the
//! group's next step; the first rank to arrive leads it: it waits briefly
//! for the ranks that ran in the previous step (so that busy ranks share
//! steps instead of alternating), then starts the step. Every rank with a
//! plan runs it on its own scheduler thread; the leader runs a forward of
//! no tokens for each rank without one, so that every rank joins every
//! layer's collectives.
//!
//! Invariants: a step's members are fixed when it starts; no rank joins a
//! running step; a rank whose forward fails (or panics) aborts the group,
//! so that no other rank stays blocked in a collective, and the leader
//! resets the group before the next step starts; every member counts itself
//! finished and the leader closes the step on every path, unwinding
//! included.

use crate::backend::attention::BatchLayout;
use crate::comm::Communicator;
use crate::error::{CoreError, Result};
use crate::executor::{Executor, ExecutorCapabilities, LocalExecutor};
use crate::kv::KvSpec;
use crate::model::{ForwardBatch, ModelSpec};
use crate::sampling::SamplingParams;
use crate::step::{StepOutput, StepPlan};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a step's leader waits for the ranks that ran in the previous
/// step before starting without them.
const GATHER_WAIT: Duration = Duration::from_millis(2);

/// The ranks of a data-parallel attention group and their step barrier.
pub struct DpAttentionGroup {
    ranks: Vec<LocalExecutor>,
    comms: Vec<Arc<dyn Communicator>>,
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Debug)]
struct State {
    /// Ranks waiting with a plan for the next step.
    waiting: Vec<bool>,
    /// A leader is gathering the next step.
    forming: bool,
    /// The running step's unfinished members, when one runs.
    running: Option<usize>,
    /// Steps started.
    started: u64,
    /// The members of the last step.
    last: Vec<bool>,
    /// A member of the running step failed.
    failed: bool,
}

impl DpAttentionGroup {
    /// Rank `i` runs `ranks[i]` and communicates through `comms[i]`.
    pub fn new(ranks: Vec<LocalExecutor>, comms: Vec<Arc<dyn Communicator>>) -> Result<Arc<Self>> {
        let n = ranks.len();
        if n == 0 {
            return Err(CoreError::invalid(
                "a data-parallel attention group of no ranks",
            ));
        }
        crate::comm::check_group(&comms, n)?;
        Ok(Arc::new(Self {
            ranks,
            comms,
            state: Mutex::new(State {
                waiting: vec![false; n],
                forming: false,
                running: None,
                started: 0,
                last: vec![false; n],
                failed: false,
            }),
            changed: Condvar::new(),
        }))
    }

    /// One executor per rank, for each rank's scheduler.
    pub fn executors(self: &Arc<Self>) -> Vec<DpAttentionRank> {
        (0..self.ranks.len())
            .map(|rank| DpAttentionRank {
                group: self.clone(),
                rank,
            })
            .collect()
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `plan` as rank `rank`'s part of the group's next step.
    fn step(&self, rank: usize, plan: &StepPlan) -> Result<StepOutput> {
        let mut g = self.lock();
        while g.running.is_some() {
            g = self.wait(g);
        }
        g.waiting[rank] = true;
        let next = g.started + 1;
        if g.forming {
            // Another rank leads this step and may be waiting for this one:
            // tell it, then wait for the step to start.
            self.changed.notify_all();
            while g.started < next {
                g = self.wait(g);
            }
            drop(g);
            let done = Finished::new(self, rank);
            let out = self.run_member(rank, plan);
            done.with(out.is_err());
            return out;
        }
        g.forming = true;
        let deadline = Instant::now() + GATHER_WAIT;
        loop {
            let missing = g.last.iter().zip(&g.waiting).any(|(&l, &w)| l && !w);
            let now = Instant::now();
            if !missing || now >= deadline {
                break;
            }
            g = self
                .changed
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        let members = std::mem::replace(&mut g.waiting, vec![false; self.ranks.len()]);
        g.last = members.clone();
        g.forming = false;
        g.failed = false;
        g.running = Some(members.iter().filter(|&&m| m).count());
        g.started = next;
        drop(g);
        self.changed.notify_all();
        let close = CloseStep(Some(self));
        let done = Finished::new(self, rank);
        let out = self.lead(rank, plan, &members);
        done.with(out.is_err());
        close.close()?;
        out
    }

    /// Closes the running step once every member has finished: resets the
    /// group's collectives when one failed, then lets the next step form.
    fn close_step(&self) -> Result<()> {
        let mut g = self.lock();
        while g.running.is_some_and(|left| left > 0) {
            g = self.wait(g);
        }
        let reset = if g.failed {
            self.comms[0].reset()
        } else {
            Ok(())
        };
        g.running = None;
        drop(g);
        self.changed.notify_all();
        reset
    }

    /// The leader's part: its own plan here, and a forward of no tokens for
    /// every rank that is not a member, on scoped threads.
    fn lead(&self, rank: usize, plan: &StepPlan, members: &[bool]) -> Result<StepOutput> {
        std::thread::scope(|s| {
            let idle: Vec<_> = (0..self.ranks.len())
                .filter(|&r| !members[r])
                .map(|r| s.spawn(move || self.idle_forward(r)))
                .collect();
            let out = self.run_member(rank, plan);
            let mut idle_failed = false;
            for h in idle {
                idle_failed |= !matches!(h.join(), Ok(Ok(())));
            }
            if idle_failed {
                self.lock().failed = true;
            }
            out
        })
    }

    /// Rank `rank`'s plan (and, when it has no sequences, which the local
    /// executor runs no forward for, a forward of no tokens); a failure
    /// aborts the group's collectives.
    fn run_member(&self, rank: usize, plan: &StepPlan) -> Result<StepOutput> {
        let out = self.ranks[rank].execute(plan);
        if plan.seqs.is_empty() && out.is_ok() {
            self.idle_forward(rank)?;
        }
        if let Err(e) = &out {
            tracing::error!("data-parallel attention rank {rank} failed its step: {e}");
            self.comms[rank].abort();
        }
        out
    }

    /// A forward of no tokens on rank `rank` (it joins each layer's
    /// collectives); a failure aborts the group's collectives.
    fn idle_forward(&self, rank: usize) -> Result<()> {
        let runner = self.ranks[rank].runner();
        let batch = ForwardBatch {
            input_ids: Vec::new(),
            positions: Vec::new(),
            layout: Arc::new(BatchLayout::new(runner.kv_spec().page_size)),
            logits_rows: Vec::new(),
            hidden_layers: Vec::new(),
            lora: Vec::new(),
            exit_after: None,
            hidden_at_every_row: false,
        };
        let out = runner.forward(&batch).map(|_| ());
        if let Err(e) = &out {
            tracing::error!(
                "data-parallel attention rank {rank} failed a forward of no tokens: {e}"
            );
            self.comms[rank].abort();
        }
        out
    }

    /// Counts a member of the running step as finished.
    fn finish(&self, failed: bool) {
        let mut g = self.lock();
        g.failed |= failed;
        if let Some(left) = g.running.as_mut() {
            *left = left.saturating_sub(1);
        }
        drop(g);
        self.changed.notify_all();
    }
}

/// Counts a member of the running step as finished when dropped: with
/// [`Finished::with`] after its part ran, or, if its part panicked, as
/// failed, with the group's collectives aborted so that no other rank stays
/// blocked and the leader does not wait for it forever.
struct Finished<'a> {
    group: &'a DpAttentionGroup,
    rank: usize,
    failed: bool,
}

impl<'a> Finished<'a> {
    fn new(group: &'a DpAttentionGroup, rank: usize) -> Self {
        Self {
            group,
            rank,
            failed: true,
        }
    }

    /// Finishes with the part's outcome.
    fn with(mut self, failed: bool) {
        self.failed = failed;
    }
}

impl Drop for Finished<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.group.comms[self.rank].abort();
        }
        self.group.finish(self.failed);
    }
}

/// The leader's duty to close its step, done by [`CloseStep::close`] or,
/// if the leader's part panicked, when dropped.
struct CloseStep<'a>(Option<&'a DpAttentionGroup>);

impl CloseStep<'_> {
    fn close(mut self) -> Result<()> {
        match self.0.take() {
            Some(g) => g.close_step(),
            None => Ok(()),
        }
    }
}

impl Drop for CloseStep<'_> {
    fn drop(&mut self) {
        if let Some(g) = self.0.take() {
            // Unwinding: the step still closes so that no rank waits forever.
            let _ = g.close_step();
        }
    }
}

/// One rank's executor of a [`DpAttentionGroup`], for that rank's scheduler.
pub struct DpAttentionRank {
    group: Arc<DpAttentionGroup>,
    rank: usize,
}

impl DpAttentionRank {
    fn local(&self) -> &LocalExecutor {
        &self.group.ranks[self.rank]
    }
}

impl Executor for DpAttentionRank {
    fn model_spec(&self) -> &ModelSpec {
        self.local().model_spec()
    }

    fn kv_spec(&self) -> &KvSpec {
        self.local().kv_spec()
    }

    fn capabilities(&self) -> ExecutorCapabilities {
        ExecutorCapabilities {
            // A step returns once the group's step has run.
            asynchronous: false,
            tree: self.local().capabilities().tree,
        }
    }

    fn sampler_name(&self) -> &str {
        self.local().sampler_name()
    }

    fn needs_context(&self, params: &SamplingParams) -> bool {
        self.local().needs_context(params)
    }

    fn execute(&self, plan: &StepPlan) -> Result<StepOutput> {
        self.group.step(self.rank, plan)
    }

    /// Rank 0 reports the group's expert load (each rank counts the tokens
    /// of every rank that its shard computed; the largest count is the
    /// group's); the other ranks report none, so that the engine's sum over
    /// its ranks counts each token once.
    fn expert_load(&self) -> Vec<crate::model::moe::ExpertLoad> {
        if self.rank != 0 {
            return Vec::new();
        }
        crate::parallel::tp::group_expert_load(&self.group.ranks)
    }
}
