//! The router's Prometheus metrics (`GET /metrics`, text format 0.0.4).
//!
//! Counters only grow; per-worker counters are keyed by URL and survive the
//! worker's removal (Prometheus expects counters not to vanish mid-run),
//! while per-worker gauges (health, load, circuit, tree size) are rendered
//! from the live registry, so a removed worker's gauges disappear.

use crate::policy::{Decision, PolicyKind};
use crate::worker::Worker;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// What went wrong with a request the router could not complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FailureKind {
    /// No worker was available.
    NoWorker,
    /// Every attempt failed (connection or 5xx).
    Upstream,
    /// The worker failed after the response had started streaming.
    MidStream,
    /// The request itself was bad (never reached a worker).
    BadRequest,
    /// PD: the prefill worker failed (the decode worker computed the prompt).
    Prefill,
}

impl FailureKind {
    fn name(self) -> &'static str {
        match self {
            Self::NoWorker => "no_worker",
            Self::Upstream => "upstream",
            Self::MidStream => "mid_stream",
            Self::BadRequest => "bad_request",
            Self::Prefill => "prefill",
        }
    }
}

#[derive(Debug, Default)]
struct Labelled {
    requests_by_route: BTreeMap<String, u64>,
    requests_by_worker: BTreeMap<String, u64>,
    decisions: BTreeMap<(&'static str, &'static str), u64>,
    failures: BTreeMap<FailureKind, u64>,
}

/// The router's counters.
#[derive(Debug, Default)]
pub struct RouterMetrics {
    labelled: Mutex<Labelled>,
    retries: AtomicU64,
}

impl RouterMetrics {
    fn with<R>(&self, f: impl FnOnce(&mut Labelled) -> R) -> R {
        f(&mut self.labelled.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// One request arrived on `route`.
    pub fn request(&self, route: &str) {
        self.with(|l| *l.requests_by_route.entry(route.to_string()).or_default() += 1);
    }

    /// One request was sent to `worker` (retries count once per attempt).
    pub fn sent(&self, worker: &str) {
        self.with(|l| *l.requests_by_worker.entry(worker.to_string()).or_default() += 1);
    }

    /// A routing decision of `policy`.
    pub fn decision(&self, policy: PolicyKind, d: Decision) {
        self.with(|l| *l.decisions.entry((policy.name(), d.name())).or_default() += 1);
    }

    /// A retry.
    pub fn retry(&self) {
        self.retries.fetch_add(1, Ordering::Relaxed);
    }

    /// A request that failed.
    pub fn failure(&self, k: FailureKind) {
        self.with(|l| *l.failures.entry(k).or_default() += 1);
    }

    /// Retries so far.
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::Relaxed)
    }

    /// The exposition text.
    pub fn render(&self, workers: &[Arc<Worker>]) -> String {
        let mut o = String::new();
        let l = self.labelled.lock().unwrap_or_else(|p| p.into_inner());
        let family = |o: &mut String, name: &str, kind: &str, help: &str| {
            let _ = writeln!(o, "# HELP arbor_router_{name} {help}");
            let _ = writeln!(o, "# TYPE arbor_router_{name} {kind}");
        };
        family(
            &mut o,
            "requests_total",
            "counter",
            "Requests received, by route.",
        );
        for (route, n) in &l.requests_by_route {
            let _ = writeln!(
                o,
                "arbor_router_requests_total{{route=\"{}\"}} {n}",
                esc(route)
            );
        }
        family(
            &mut o,
            "worker_requests_total",
            "counter",
            "Requests sent to each worker (each attempt).",
        );
        for (w, n) in &l.requests_by_worker {
            let _ = writeln!(
                o,
                "arbor_router_worker_requests_total{{worker=\"{}\"}} {n}",
                esc(w)
            );
        }
        family(
            &mut o,
            "routing_decisions_total",
            "counter",
            "Routing decisions, by policy and reason.",
        );
        for ((policy, decision), n) in &l.decisions {
            let _ = writeln!(
                o,
                "arbor_router_routing_decisions_total{{policy=\"{policy}\",decision=\"{decision}\"}} {n}"
            );
        }
        family(
            &mut o,
            "retries_total",
            "counter",
            "Requests sent again after a failed attempt.",
        );
        let _ = writeln!(o, "arbor_router_retries_total {}", self.retries());
        family(
            &mut o,
            "request_failures_total",
            "counter",
            "Requests the router could not complete, by reason.",
        );
        for (k, n) in &l.failures {
            let _ = writeln!(
                o,
                "arbor_router_request_failures_total{{reason=\"{}\"}} {n}",
                k.name()
            );
        }
        drop(l);
        family(&mut o, "workers", "gauge", "Registered workers.");
        let _ = writeln!(o, "arbor_router_workers {}", workers.len());
        family(
            &mut o,
            "worker_healthy",
            "gauge",
            "1 when the worker passes its health checks.",
        );
        for w in workers {
            let _ = writeln!(
                o,
                "arbor_router_worker_healthy{{worker=\"{}\"}} {}",
                esc(w.url()),
                u8::from(w.healthy())
            );
        }
        family(
            &mut o,
            "worker_load",
            "gauge",
            "Requests in flight on the worker through this router.",
        );
        for w in workers {
            let _ = writeln!(
                o,
                "arbor_router_worker_load{{worker=\"{}\"}} {}",
                esc(w.url()),
                w.load()
            );
        }
        family(
            &mut o,
            "worker_circuit_state",
            "gauge",
            "Circuit breaker: 0 closed, 1 open, 2 half-open.",
        );
        for w in workers {
            let _ = writeln!(
                o,
                "arbor_router_worker_circuit_state{{worker=\"{}\"}} {}",
                esc(w.url()),
                w.breaker().circuit() as u8
            );
        }
        family(
            &mut o,
            "tree_chars",
            "gauge",
            "Characters in the worker's approximate prefix tree.",
        );
        for w in workers {
            let _ = writeln!(
                o,
                "arbor_router_tree_chars{{worker=\"{}\"}} {}",
                esc(w.url()),
                w.tree().size()
            );
        }
        o
    }
}

fn esc(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::worker::{BreakerSettings, Workers};
    use std::time::Duration;

    #[test]
    fn renders_counters_and_live_gauges() {
        let m = RouterMetrics::default();
        let ws = Workers::new(BreakerSettings {
            disabled: false,
            failure_threshold: 1,
            success_threshold: 1,
            timeout: Duration::from_secs(1),
        });
        let a = ws.add("http://a:1").expect("valid");
        ws.add("http://b:2").expect("valid");
        m.request("/generate");
        m.request("/generate");
        m.sent(a.url());
        m.decision(PolicyKind::CacheAware, Decision::CacheHit);
        m.retry();
        m.failure(FailureKind::MidStream);
        a.breaker().record(false);
        let text = m.render(&ws.all());
        for line in [
            "arbor_router_requests_total{route=\"/generate\"} 2",
            "arbor_router_worker_requests_total{worker=\"http://a:1\"} 1",
            "arbor_router_routing_decisions_total{policy=\"cache_aware\",decision=\"cache_hit\"} 1",
            "arbor_router_retries_total 1",
            "arbor_router_request_failures_total{reason=\"mid_stream\"} 1",
            "arbor_router_workers 2",
            "arbor_router_worker_healthy{worker=\"http://b:2\"} 1",
            "arbor_router_worker_circuit_state{worker=\"http://a:1\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        ws.remove("http://a:1").expect("registered");
        let text = m.render(&ws.all());
        assert!(text.contains("arbor_router_worker_requests_total{worker=\"http://a:1\"} 1"));
        assert!(!text.contains("arbor_router_worker_load{worker=\"http://a:1\"}"));
    }
}
