//! The router's shared state: settings, workers, metrics, the HTTP client,
//! and the one place a worker is chosen ([`RouterState::pick`]).
//!
//! Invariant: a choice and the load it adds happen under one lock, so
//! concurrent requests see each other's load (the bounded-load cap holds
//! exactly, and cache_aware inserts the text before the next choice).

use crate::config::RouterConfig;
use crate::metrics::RouterMetrics;
use crate::policy::{self, CandidateState, Decision, PolicyKind, Rng};
use crate::worker::{LoadGuard, Role, Worker, Workers};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

/// Shared by every handler and background task.
#[derive(Debug)]
pub struct RouterState {
    /// Settings.
    pub cfg: RouterConfig,
    /// Registered workers.
    pub workers: Workers,
    /// Counters.
    pub metrics: RouterMetrics,
    /// The client every worker request goes through.
    pub client: reqwest::Client,
    choice: Mutex<Chooser>,
}

#[derive(Debug)]
struct Chooser {
    rng: Rng,
    next: usize,
}

impl RouterState {
    /// State for `cfg` with no workers yet.
    pub fn new(cfg: RouterConfig, client: reqwest::Client) -> Self {
        let seed = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64);
        Self {
            workers: Workers::new(cfg.breaker),
            metrics: RouterMetrics::default(),
            client,
            choice: Mutex::new(Chooser {
                rng: Rng::new(seed),
                next: 0,
            }),
            cfg,
        }
    }

    /// A bootstrap room id, uniform in [0, 2^63) as SGLang's router draws it.
    pub fn room(&self) -> u64 {
        self.choice
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rng
            .next_u64()
            & (i64::MAX as u64)
    }

    /// A uniform number in [0, 1) (retry jitter).
    pub fn unit(&self) -> f64 {
        self.choice
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .rng
            .unit()
    }

    /// Chooses a worker of `role` for a request routed by `text` (`None`: not a
    /// generation request; the least loaded takes it and no decision is
    /// counted), skipping `tried` while others are available. Returns the
    /// worker's load guard, or `None` when no worker is available.
    pub fn pick(
        &self,
        role: Role,
        text: Option<&[char]>,
        tried: &[Arc<Worker>],
    ) -> Option<LoadGuard> {
        let mut ch = self.choice.lock().unwrap_or_else(|p| p.into_inner());
        let available: Vec<Arc<Worker>> = self
            .workers
            .all()
            .into_iter()
            .filter(|w| w.role() == role && w.available())
            .collect();
        let fresh: Vec<Arc<Worker>> = available
            .iter()
            .filter(|w| !tried.iter().any(|t| Arc::ptr_eq(t, w)))
            .cloned()
            .collect();
        let cands = if fresh.is_empty() { available } else { fresh };
        if cands.is_empty() {
            return None;
        }
        let Some(text) = text else {
            let i = (0..cands.len()).min_by_key(|&i| (cands[i].load(), i))?;
            return Some(LoadGuard::new(cands[i].clone()));
        };
        let policy = self.cfg.policy_for(role);
        let (i, decision) = match policy {
            PolicyKind::CacheAware => {
                let states: Vec<CandidateState> = cands.iter().map(|w| w.candidate(text)).collect();
                policy::cache_aware(&states, text.len(), &self.cfg.cache_aware)
            }
            PolicyKind::PowerOfTwo => {
                let states: Vec<CandidateState> = cands.iter().map(|w| w.candidate(&[])).collect();
                (
                    policy::power_of_two(&states, &mut ch.rng),
                    Decision::PowerOfTwo,
                )
            }
            PolicyKind::RoundRobin => {
                let i = ch.next % cands.len();
                ch.next = ch.next.wrapping_add(1);
                (i, Decision::RoundRobin)
            }
            PolicyKind::Random => (ch.rng.below(cands.len()), Decision::Random),
        };
        let w = cands.get(i)?.clone();
        if policy == PolicyKind::CacheAware && !text.is_empty() {
            w.tree().insert(text);
        }
        self.metrics.decision(policy, decision);
        Some(LoadGuard::new(w))
    }
}
