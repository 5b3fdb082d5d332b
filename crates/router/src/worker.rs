//! Workers and their state: in-flight load, health, circuit breaker and
//! approximate prefix tree; and the registry that adds and removes them at
//! run time.
//!
//! Invariants: a URL is registered at most once (normalized: no trailing
//! slash); `load` counts exactly the [`LoadGuard`]s alive for the worker
//! (a guard lives as long as the request, streamed body included); a
//! removed worker's in-flight requests keep their `Arc` and finish.

use crate::policy::CandidateState;
use crate::tree::PrefixTree;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

/// Circuit breaker settings (`--cb-*`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BreakerSettings {
    /// Off: the circuit never opens.
    pub disabled: bool,
    /// Consecutive failures that open the circuit.
    pub failure_threshold: u32,
    /// Consecutive successes in half-open that close it.
    pub success_threshold: u32,
    /// How long it stays open before a probe is let through.
    pub timeout: Duration,
}

/// A circuit breaker's state (the gauge's value is the discriminant).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Circuit {
    /// Requests flow; failures are counted.
    Closed = 0,
    /// Requests are refused until the timeout passes.
    Open = 1,
    /// Probing: successes close it, a failure opens it again.
    HalfOpen = 2,
}

#[derive(Debug)]
struct BreakerState {
    circuit: Circuit,
    failures: u32,
    successes: u32,
    opened: Instant,
}

/// One worker's circuit breaker.
#[derive(Debug)]
pub struct CircuitBreaker {
    settings: BreakerSettings,
    state: Mutex<BreakerState>,
}

impl CircuitBreaker {
    /// A closed breaker.
    pub fn new(settings: BreakerSettings) -> Self {
        Self {
            settings,
            state: Mutex::new(BreakerState {
                circuit: Circuit::Closed,
                failures: 0,
                successes: 0,
                opened: Instant::now(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BreakerState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request may go to the worker now (an open circuit whose
    /// timeout passed turns half-open and lets probes through).
    pub fn allows(&self) -> bool {
        if self.settings.disabled {
            return true;
        }
        let mut s = self.lock();
        if s.circuit == Circuit::Open && s.opened.elapsed() >= self.settings.timeout {
            s.circuit = Circuit::HalfOpen;
            s.successes = 0;
        }
        s.circuit != Circuit::Open
    }

    /// Records a request's outcome.
    pub fn record(&self, success: bool) {
        if self.settings.disabled {
            return;
        }
        let mut s = self.lock();
        match (s.circuit, success) {
            (Circuit::Closed, true) => s.failures = 0,
            (Circuit::Closed, false) => {
                s.failures += 1;
                if s.failures >= self.settings.failure_threshold {
                    s.circuit = Circuit::Open;
                    s.opened = Instant::now();
                }
            }
            (Circuit::HalfOpen, true) => {
                s.successes += 1;
                if s.successes >= self.settings.success_threshold {
                    s.circuit = Circuit::Closed;
                    s.failures = 0;
                }
            }
            (Circuit::HalfOpen, false) => {
                s.circuit = Circuit::Open;
                s.opened = Instant::now();
            }
            (Circuit::Open, _) => {}
        }
    }

    /// The current state.
    pub fn circuit(&self) -> Circuit {
        self.lock().circuit
    }
}

/// Health check settings (`--health-*`).
#[derive(Clone, Debug, PartialEq)]
pub struct HealthSettings {
    /// Consecutive failed checks that mark a worker unhealthy.
    pub failure_threshold: u32,
    /// Consecutive passed checks that mark it healthy again.
    pub success_threshold: u32,
    /// Time between checks.
    pub interval: Duration,
    /// Time one check may take.
    pub timeout: Duration,
    /// The path checked (`/health`).
    pub endpoint: String,
}

#[derive(Debug, Default)]
struct HealthCounts {
    failures: u32,
    successes: u32,
}

/// What a worker does in the deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// A whole worker (prefill and decode).
    Regular,
    /// Computes prompts and sends their KV to a decode worker.
    Prefill,
    /// Receives KV and generates.
    Decode,
}

impl Role {
    /// The name in listings and `worker_type`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Regular => "regular",
            Self::Prefill => "prefill",
            Self::Decode => "decode",
        }
    }
}

/// One worker.
#[derive(Debug)]
pub struct Worker {
    url: String,
    role: Role,
    /// Decode workers: where their KV transfer engine listens.
    kv_peer: Option<String>,
    load: AtomicUsize,
    processed: AtomicU64,
    healthy: AtomicBool,
    counts: Mutex<HealthCounts>,
    breaker: CircuitBreaker,
    tree: Mutex<PrefixTree>,
}

impl Worker {
    fn new(url: String, role: Role, kv_peer: Option<String>, breaker: BreakerSettings) -> Self {
        Self {
            url,
            role,
            kv_peer,
            load: AtomicUsize::new(0),
            processed: AtomicU64::new(0),
            healthy: AtomicBool::new(true),
            counts: Mutex::new(HealthCounts::default()),
            breaker: CircuitBreaker::new(breaker),
            tree: Mutex::new(PrefixTree::new()),
        }
    }

    /// Its base URL (no trailing slash).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Its role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// A decode worker's KV transfer address (`HOST:PORT`).
    pub fn kv_peer(&self) -> Option<&str> {
        self.kv_peer.as_deref()
    }

    /// Requests in flight through this router.
    pub fn load(&self) -> usize {
        self.load.load(Ordering::Relaxed)
    }

    /// Requests it answered (any status but a retried failure).
    pub fn processed(&self) -> u64 {
        self.processed.load(Ordering::Relaxed)
    }

    /// Counts one answered request.
    pub fn count_processed(&self) {
        self.processed.fetch_add(1, Ordering::Relaxed);
    }

    /// Whether health checks pass.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Its circuit breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// Whether it may take a request now.
    pub fn available(&self) -> bool {
        self.healthy() && self.breaker.allows()
    }

    /// Its approximate prefix tree.
    pub fn tree(&self) -> MutexGuard<'_, PrefixTree> {
        self.tree.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What a policy sees of it for a text (`text` empty: no tree lookup).
    pub fn candidate(&self, text: &[char]) -> CandidateState {
        let (matched, tree_size) = if text.is_empty() {
            (0, 0)
        } else {
            let t = self.tree();
            (t.match_len(text), t.size())
        };
        CandidateState {
            load: self.load(),
            matched,
            tree_size,
        }
    }

    /// Records one health check; returns the new health when it changed.
    pub fn record_check(&self, passed: bool, s: &HealthSettings) -> Option<bool> {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        if passed {
            c.failures = 0;
            c.successes += 1;
            if !self.healthy() && c.successes >= s.success_threshold {
                self.healthy.store(true, Ordering::Relaxed);
                return Some(true);
            }
        } else {
            c.successes = 0;
            c.failures += 1;
            if self.healthy() && c.failures >= s.failure_threshold {
                self.healthy.store(false, Ordering::Relaxed);
                return Some(false);
            }
        }
        None
    }

    /// Marks it unhealthy at once (a refused connection); health checks
    /// bring it back.
    pub fn mark_unhealthy(&self) -> bool {
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.successes = 0;
        self.healthy.swap(false, Ordering::Relaxed)
    }
}

/// Holds one unit of a worker's load; gives it back on drop.
#[derive(Debug)]
pub struct LoadGuard(Arc<Worker>);

impl LoadGuard {
    /// Counts one request in flight on `w`.
    pub fn new(w: Arc<Worker>) -> Self {
        w.load.fetch_add(1, Ordering::Relaxed);
        Self(w)
    }

    /// The worker.
    pub fn worker(&self) -> &Arc<Worker> {
        &self.0
    }
}

impl Drop for LoadGuard {
    fn drop(&mut self) {
        self.0.load.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Why a worker URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WorkerUrlError {
    /// Not `http://host[:port]` (or https).
    #[error("worker URL {0:?} is not http://HOST:PORT or https://HOST:PORT")]
    Malformed(String),
    /// Registered already.
    #[error("worker {0} is registered already")]
    Duplicate(String),
    /// Not registered.
    #[error("worker {0} is not registered")]
    Unknown(String),
}

/// `url` without a trailing slash, if it is an http(s) URL with a host and
/// no path.
pub fn normalize_url(url: &str) -> Result<String, WorkerUrlError> {
    let bad = || WorkerUrlError::Malformed(url.to_string());
    let trimmed = url.trim().trim_end_matches('/');
    let rest = trimmed
        .strip_prefix("http://")
        .or_else(|| trimmed.strip_prefix("https://"))
        .ok_or_else(bad)?;
    let (host, port) = match rest.strip_prefix('[') {
        // An IPv6 literal: http://[::1]:8000.
        Some(r) => {
            let (h, after) = r.split_once(']').ok_or_else(bad)?;
            match after {
                "" => (h, None),
                a => (h, Some(a.strip_prefix(':').ok_or_else(bad)?)),
            }
        }
        None => match rest.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (rest, None),
        },
    };
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok());
    if host.is_empty() || rest.contains('/') || !port_ok {
        return Err(bad());
    }
    Ok(trimmed.to_string())
}

/// The registered workers.
#[derive(Debug)]
pub struct Workers {
    list: RwLock<Vec<Arc<Worker>>>,
    breaker: BreakerSettings,
}

impl Workers {
    /// No workers yet.
    pub fn new(breaker: BreakerSettings) -> Self {
        Self {
            list: RwLock::new(Vec::new()),
            breaker,
        }
    }

    /// A snapshot of all workers, in registration order.
    pub fn all(&self) -> Vec<Arc<Worker>> {
        self.list.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Registers `url` as a regular worker.
    pub fn add(&self, url: &str) -> Result<Arc<Worker>, WorkerUrlError> {
        self.add_with(url, Role::Regular, None)
    }

    /// Registers `url` with `role` (and a decode worker's KV address).
    pub fn add_with(
        &self,
        url: &str,
        role: Role,
        kv_peer: Option<String>,
    ) -> Result<Arc<Worker>, WorkerUrlError> {
        let url = normalize_url(url)?;
        let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
        if list.iter().any(|w| w.url == url) {
            return Err(WorkerUrlError::Duplicate(url));
        }
        let w = Arc::new(Worker::new(url, role, kv_peer, self.breaker));
        list.push(w.clone());
        Ok(w)
    }

    /// Unregisters `url`.
    pub fn remove(&self, url: &str) -> Result<Arc<Worker>, WorkerUrlError> {
        let url = normalize_url(url)?;
        let mut list = self.list.write().unwrap_or_else(|p| p.into_inner());
        let i = list
            .iter()
            .position(|w| w.url == url)
            .ok_or(WorkerUrlError::Unknown(url))?;
        Ok(list.remove(i))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CB: BreakerSettings = BreakerSettings {
        disabled: false,
        failure_threshold: 3,
        success_threshold: 2,
        timeout: Duration::from_millis(30),
    };

    #[test]
    fn breaker_opens_probes_and_closes() {
        let b = CircuitBreaker::new(CB);
        b.record(false);
        b.record(false);
        b.record(true);
        b.record(false);
        b.record(false);
        assert_eq!(b.circuit(), Circuit::Closed, "a success resets the count");
        b.record(false);
        assert_eq!(b.circuit(), Circuit::Open);
        assert!(!b.allows());
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.allows());
        assert_eq!(b.circuit(), Circuit::HalfOpen);
        b.record(false);
        assert_eq!(b.circuit(), Circuit::Open, "a failed probe opens it again");
        std::thread::sleep(Duration::from_millis(40));
        assert!(b.allows());
        b.record(true);
        b.record(true);
        assert_eq!(b.circuit(), Circuit::Closed);
        let off = CircuitBreaker::new(BreakerSettings {
            disabled: true,
            ..CB
        });
        for _ in 0..10 {
            off.record(false);
        }
        assert!(off.allows());
    }

    #[test]
    fn health_needs_consecutive_checks() {
        let s = HealthSettings {
            failure_threshold: 2,
            success_threshold: 2,
            interval: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            endpoint: "/health".into(),
        };
        let ws = Workers::new(CB);
        let w = ws.add("http://127.0.0.1:1").expect("valid");
        assert_eq!(w.record_check(false, &s), None);
        assert_eq!(w.record_check(false, &s), Some(false));
        assert!(!w.available());
        assert_eq!(w.record_check(true, &s), None);
        assert_eq!(w.record_check(true, &s), Some(true));
        assert!(w.mark_unhealthy());
        assert!(!w.healthy());
    }

    #[test]
    fn urls_are_checked_and_unique() {
        let ws = Workers::new(CB);
        assert!(ws.add("http://127.0.0.1:8000/").is_ok());
        assert_eq!(
            ws.add("http://127.0.0.1:8000").err(),
            Some(WorkerUrlError::Duplicate("http://127.0.0.1:8000".into()))
        );
        for bad in [
            "127.0.0.1:8000",
            "ftp://x",
            "http://",
            "http://h:99999",
            "http://h/v1",
        ] {
            assert!(
                matches!(ws.add(bad), Err(WorkerUrlError::Malformed(_))),
                "{bad}"
            );
        }
        assert!(ws.add("https://worker-1.svc:30000").is_ok());
        assert!(ws.add("http://[::1]:30000").is_ok());
        assert!(matches!(
            ws.add("http://[::1"),
            Err(WorkerUrlError::Malformed(_))
        ));
        assert!(matches!(
            ws.remove("http://h:1"),
            Err(WorkerUrlError::Unknown(_))
        ));
        assert_eq!(
            ws.remove("http://127.0.0.1:8000").ok().map(|w| w.load()),
            Some(0)
        );
        assert_eq!(ws.all().len(), 2);
    }

    #[test]
    fn load_guards_count_in_flight_requests() {
        let ws = Workers::new(CB);
        let w = ws.add("http://a:1").expect("valid");
        let g1 = LoadGuard::new(w.clone());
        let g2 = LoadGuard::new(w.clone());
        assert_eq!(w.load(), 2);
        drop(g1);
        assert_eq!(g2.worker().load(), 1);
        drop(g2);
        assert_eq!(w.load(), 0);
    }
}
