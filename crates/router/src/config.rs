//! `arbor router`'s command line (SGLang router's flag names and defaults)
//! and its checked form, [`RouterConfig`].
//!
//! Every check happens here, once: a bad value is a [`RouterError::Config`]
//! naming its flag, before any worker is contacted.

use crate::RouterError;
use crate::discovery::DiscoveryConfig;
use crate::policy::{CacheAwareSettings, PolicyKind};
use crate::worker::{BreakerSettings, HealthSettings, Role};
use std::time::Duration;

/// `arbor router` options.
#[derive(clap::Args, Debug, Clone)]
pub struct RouterArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the address is printed).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// Worker base URLs (`http://HOST:PORT`); more can be added at run time
    /// with `POST /add_worker?url=...`.
    #[arg(long = "worker-urls", num_args = 1..)]
    pub worker_urls: Vec<String>,
    /// Routing policy.
    #[arg(long, value_enum, default_value = "cache_aware")]
    pub policy: PolicyKind,
    /// Prefill/decode disaggregation: route each request through a prefill
    /// worker (`--prefill`), which sends the prompt's KV to a decode worker
    /// (`--decode`) that generates.
    #[arg(long)]
    pub pd_disaggregation: bool,
    /// PD: prefill worker URLs (`arbor serve --disaggregation-mode prefill`).
    #[arg(long, num_args = 1..)]
    pub prefill: Vec<String>,
    /// PD: decode worker URLs (`arbor serve --disaggregation-mode decode`).
    #[arg(long, num_args = 1..)]
    pub decode: Vec<String>,
    /// PD: the prefill pool's policy [default: --policy].
    #[arg(long, value_enum)]
    pub prefill_policy: Option<PolicyKind>,
    /// PD: the decode pool's policy [default: --policy].
    #[arg(long, value_enum)]
    pub decode_policy: Option<PolicyKind>,
    /// Find workers through the Kubernetes API: ready pods matching --selector.
    #[arg(long)]
    pub service_discovery: bool,
    /// Discovery: label selector of worker pods (`app=arbor`, several are ANDed).
    #[arg(long, num_args = 1..)]
    pub selector: Vec<String>,
    /// Discovery with --pd-disaggregation: label selector of prefill pods.
    #[arg(long, num_args = 1..)]
    pub prefill_selector: Vec<String>,
    /// Discovery with --pd-disaggregation: label selector of decode pods.
    #[arg(long, num_args = 1..)]
    pub decode_selector: Vec<String>,
    /// Discovery: the workers' HTTP port on each pod.
    #[arg(long, default_value_t = 30000)]
    pub service_discovery_port: u16,
    /// Discovery: the namespace [default: the router's own, else default].
    #[arg(long)]
    pub service_discovery_namespace: Option<String>,
    /// Discovery: seconds between pod listings.
    #[arg(long, default_value_t = 10)]
    pub service_discovery_interval_secs: u64,
    /// Discovery: the Kubernetes API URL [default: in-cluster, from the service account].
    #[arg(long)]
    pub kube_api_url: Option<String>,
    /// cache_aware: minimum matched fraction of the text for prefix affinity (0..=1).
    #[arg(long, default_value_t = 0.3)]
    pub cache_threshold: f64,
    /// cache_aware: loads are imbalanced when max − min exceeds this...
    #[arg(long, default_value_t = 64)]
    pub balance_abs_threshold: usize,
    /// ...and max exceeds this multiple of min.
    #[arg(long, default_value_t = 1.5)]
    pub balance_rel_threshold: f64,
    /// cache_aware: seconds between tree evictions.
    #[arg(long, visible_alias = "eviction-interval", default_value_t = 120)]
    pub eviction_interval_secs: u64,
    /// cache_aware: characters each worker's tree keeps after an eviction.
    #[arg(long, default_value_t = 1 << 26)]
    pub max_tree_size: usize,
    /// cache_aware bounded load: no worker takes more than this multiple of
    /// the mean in-flight load (> 1; unset: no bound, as SGLang).
    #[arg(long)]
    pub max_load_factor: Option<f64>,
    /// Seconds to wait for the start-up workers to become healthy.
    #[arg(long, default_value_t = 600)]
    pub worker_startup_timeout_secs: u64,
    /// Seconds between health polls while waiting at start-up.
    #[arg(long, default_value_t = 1)]
    pub worker_startup_check_interval: u64,
    /// Consecutive failed health checks that take a worker out.
    #[arg(long, default_value_t = 3)]
    pub health_failure_threshold: u32,
    /// Consecutive passed health checks that bring it back.
    #[arg(long, default_value_t = 2)]
    pub health_success_threshold: u32,
    /// Seconds one health check may take.
    #[arg(long, default_value_t = 5)]
    pub health_check_timeout_secs: u64,
    /// Seconds between health checks.
    #[arg(long, default_value_t = 60)]
    pub health_check_interval_secs: u64,
    /// The path checked on each worker.
    #[arg(long, default_value = "/health")]
    pub health_check_endpoint: String,
    /// Retries of a request that failed before its response started
    /// (connection error, 408, 429 or 5xx).
    #[arg(long, default_value_t = 5)]
    pub retry_max_retries: u32,
    /// First backoff between attempts, in milliseconds.
    #[arg(long, default_value_t = 50)]
    pub retry_initial_backoff_ms: u64,
    /// Largest backoff, in milliseconds.
    #[arg(long, default_value_t = 30_000)]
    pub retry_max_backoff_ms: u64,
    /// Backoff growth per attempt.
    #[arg(long, default_value_t = 1.5)]
    pub retry_backoff_multiplier: f64,
    /// Random spread of each backoff (0..=1, as a fraction of it).
    #[arg(long, default_value_t = 0.2)]
    pub retry_jitter_factor: f64,
    /// Send each request once.
    #[arg(long)]
    pub disable_retries: bool,
    /// Consecutive failures that open a worker's circuit.
    #[arg(long, default_value_t = 10)]
    pub cb_failure_threshold: u32,
    /// Consecutive successes in half-open that close it.
    #[arg(long, default_value_t = 3)]
    pub cb_success_threshold: u32,
    /// Seconds an open circuit waits before letting a probe through.
    #[arg(long, default_value_t = 60)]
    pub cb_timeout_duration_secs: u64,
    /// Never open circuits.
    #[arg(long)]
    pub disable_circuit_breaker: bool,
    /// Seconds a proxied request may take, streamed body included.
    #[arg(long, default_value_t = 1800)]
    pub request_timeout_secs: u64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 512 << 20)]
    pub max_payload_size: usize,
    /// The API key the router authorizes itself with at the workers (sent as
    /// `Authorization: Bearer`, in place of a client's own), for workers
    /// started with `arbor serve --api-key`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Also serve the router's `/metrics` on this port, for a Prometheus
    /// scraper kept off the serving port [default: only on --port].
    #[arg(long)]
    pub prometheus_port: Option<u16>,
    /// Address of the --prometheus-port listener.
    #[arg(long, default_value = "127.0.0.1")]
    pub prometheus_host: String,
}

/// Retry settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetrySettings {
    /// Attempts after the first (0: retries off).
    pub max_retries: u32,
    /// First backoff.
    pub initial: Duration,
    /// Largest backoff.
    pub max: Duration,
    /// Growth per attempt.
    pub multiplier: f64,
    /// Spread as a fraction.
    pub jitter: f64,
}

impl RetrySettings {
    /// The pause before attempt `attempt + 1` given a uniform `u` in [0, 1).
    pub fn backoff(&self, attempt: u32, u: f64) -> Duration {
        let base = self.initial.as_secs_f64() * self.multiplier.powi(attempt as i32);
        let base = base.min(self.max.as_secs_f64());
        Duration::from_secs_f64((base * (1.0 + self.jitter * (2.0 * u - 1.0))).max(0.0))
    }
}

/// Prefill/decode disaggregation settings.
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    /// Prefill workers at start-up.
    pub prefill: Vec<String>,
    /// Decode workers at start-up.
    pub decode: Vec<String>,
    /// The prefill pool's policy.
    pub prefill_policy: PolicyKind,
    /// The decode pool's policy.
    pub decode_policy: PolicyKind,
}

fn discovery(a: &RouterArgs) -> Result<Option<DiscoveryConfig>, RouterError> {
    if !a.service_discovery {
        for (flag, set) in [
            ("--selector", !a.selector.is_empty()),
            ("--kube-api-url", a.kube_api_url.is_some()),
            (
                "--service-discovery-namespace",
                a.service_discovery_namespace.is_some(),
            ),
        ] {
            if set {
                return Err(bad(flag, "needs --service-discovery"));
            }
        }
        return Ok(None);
    }
    let selectors = if a.pd_disaggregation {
        if a.prefill_selector.is_empty() || a.decode_selector.is_empty() {
            return Err(bad(
                "--service-discovery",
                "with --pd-disaggregation, give --prefill-selector and --decode-selector",
            ));
        }
        vec![
            (Role::Prefill, a.prefill_selector.clone()),
            (Role::Decode, a.decode_selector.clone()),
        ]
    } else {
        if a.selector.is_empty() {
            return Err(bad(
                "--selector",
                "--service-discovery needs a label selector, e.g. app=arbor",
            ));
        }
        vec![(Role::Regular, a.selector.clone())]
    };
    for (_, sel) in &selectors {
        if let Some(s) = sel.iter().find(|s| !s.contains('=') || s.starts_with('=')) {
            return Err(bad("--selector", format!("{s:?} is not KEY=VALUE")));
        }
    }
    if let Some(u) = &a.kube_api_url
        && !(u.starts_with("http://") || u.starts_with("https://"))
    {
        return Err(bad(
            "--kube-api-url",
            format!("{u:?} is not an http(s) URL"),
        ));
    }
    Ok(Some(DiscoveryConfig {
        selectors,
        port: a.service_discovery_port,
        namespace: a.service_discovery_namespace.clone(),
        api_url: a.kube_api_url.clone(),
        interval: positive(
            "--service-discovery-interval-secs",
            a.service_discovery_interval_secs,
        )?,
    }))
}

/// Checked router settings.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// Listen address.
    pub host: String,
    /// Listen port.
    pub port: u16,
    /// Start-up workers.
    pub worker_urls: Vec<String>,
    /// Policy (of the decode pool too, unless `decode_policy` says otherwise).
    pub policy: PolicyKind,
    /// PD mode: the prefill and decode workers at start-up, with the pools' policies.
    pub pd: Option<PdConfig>,
    /// Kubernetes service discovery.
    pub discovery: Option<DiscoveryConfig>,
    /// cache_aware thresholds.
    pub cache_aware: CacheAwareSettings,
    /// Tree eviction period.
    pub eviction_interval: Duration,
    /// Tree size after eviction.
    pub max_tree_size: usize,
    /// Start-up wait.
    pub startup_timeout: Duration,
    /// Start-up poll period.
    pub startup_check_interval: Duration,
    /// Health checks.
    pub health: HealthSettings,
    /// Retries.
    pub retry: RetrySettings,
    /// Circuit breakers.
    pub breaker: BreakerSettings,
    /// Per-request time limit.
    pub request_timeout: Duration,
    /// Body size limit.
    pub max_payload_size: usize,
    /// The key sent to workers (`Authorization: Bearer`), when set.
    pub api_key: Option<String>,
    /// The separate metrics listener's (host, port), when asked for.
    pub prometheus: Option<(String, u16)>,
}

fn bad(flag: &str, message: impl Into<String>) -> RouterError {
    RouterError::Config {
        flag: flag.to_string(),
        message: message.into(),
    }
}

fn positive(flag: &str, v: u64) -> Result<Duration, RouterError> {
    if v == 0 {
        return Err(bad(flag, "must be at least 1"));
    }
    Ok(Duration::from_secs(v))
}

/// The numeric and textual checks of `a` that stand alone.
fn check_limits(a: &RouterArgs) -> Result<(), RouterError> {
    if !(0.0..=1.0).contains(&a.cache_threshold) {
        return Err(bad(
            "--cache-threshold",
            format!("{} is not in 0..=1", a.cache_threshold),
        ));
    }
    if !(a.balance_rel_threshold.is_finite() && a.balance_rel_threshold >= 1.0) {
        return Err(bad(
            "--balance-rel-threshold",
            format!("{} is not a finite number >= 1", a.balance_rel_threshold),
        ));
    }
    if let Some(f) = a.max_load_factor
        && !(f.is_finite() && f > 1.0)
    {
        return Err(bad(
            "--max-load-factor",
            format!("{f} is not a finite number > 1"),
        ));
    }
    if a.health_failure_threshold == 0 {
        return Err(bad("--health-failure-threshold", "must be at least 1"));
    }
    if a.health_success_threshold == 0 {
        return Err(bad("--health-success-threshold", "must be at least 1"));
    }
    if !a.health_check_endpoint.starts_with('/') {
        return Err(bad(
            "--health-check-endpoint",
            format!("{:?} does not start with /", a.health_check_endpoint),
        ));
    }
    if !(a.retry_backoff_multiplier.is_finite() && a.retry_backoff_multiplier >= 1.0) {
        return Err(bad(
            "--retry-backoff-multiplier",
            "must be a finite number >= 1",
        ));
    }
    if !(0.0..=1.0).contains(&a.retry_jitter_factor) {
        return Err(bad("--retry-jitter-factor", "must be in 0..=1"));
    }
    if a.cb_failure_threshold == 0 {
        return Err(bad("--cb-failure-threshold", "must be at least 1"));
    }
    if a.cb_success_threshold == 0 {
        return Err(bad("--cb-success-threshold", "must be at least 1"));
    }
    if a.max_payload_size == 0 {
        return Err(bad("--max-payload-size", "must be at least 1"));
    }
    Ok(())
}

/// The PD pair of `a` with `--pd-disaggregation`; without it, an error for
/// any PD-only flag that is set.
fn pd_config(a: &RouterArgs) -> Result<Option<PdConfig>, RouterError> {
    Ok(if a.pd_disaggregation {
        if !a.worker_urls.is_empty() {
            return Err(bad(
                "--worker-urls",
                "with --pd-disaggregation, name workers with --prefill and --decode",
            ));
        }
        if !a.service_discovery && (a.prefill.is_empty() || a.decode.is_empty()) {
            return Err(bad(
                "--pd-disaggregation",
                "needs at least one --prefill and one --decode worker",
            ));
        }
        Some(PdConfig {
            prefill: a.prefill.clone(),
            decode: a.decode.clone(),
            prefill_policy: a.prefill_policy.unwrap_or(a.policy),
            decode_policy: a.decode_policy.unwrap_or(a.policy),
        })
    } else {
        for (flag, set) in [
            ("--prefill", !a.prefill.is_empty()),
            ("--decode", !a.decode.is_empty()),
            ("--prefill-policy", a.prefill_policy.is_some()),
            ("--decode-policy", a.decode_policy.is_some()),
            ("--prefill-selector", !a.prefill_selector.is_empty()),
            ("--decode-selector", !a.decode_selector.is_empty()),
        ] {
            if set {
                return Err(bad(flag, "needs --pd-disaggregation"));
            }
        }
        None
    })
}

impl RouterConfig {
    /// Checks `a` (see the module doc).
    pub fn from_args(a: RouterArgs) -> Result<Self, RouterError> {
        check_limits(&a)?;
        let pd = pd_config(&a)?;
        let discovery = discovery(&a)?;
        Ok(Self {
            discovery,
            cache_aware: CacheAwareSettings {
                cache_threshold: a.cache_threshold,
                balance_abs_threshold: a.balance_abs_threshold,
                balance_rel_threshold: a.balance_rel_threshold,
                max_load_factor: a.max_load_factor,
            },
            eviction_interval: positive("--eviction-interval-secs", a.eviction_interval_secs)?,
            max_tree_size: a.max_tree_size,
            startup_timeout: Duration::from_secs(a.worker_startup_timeout_secs),
            startup_check_interval: positive(
                "--worker-startup-check-interval",
                a.worker_startup_check_interval,
            )?,
            health: HealthSettings {
                failure_threshold: a.health_failure_threshold,
                success_threshold: a.health_success_threshold,
                interval: positive("--health-check-interval-secs", a.health_check_interval_secs)?,
                timeout: positive("--health-check-timeout-secs", a.health_check_timeout_secs)?,
                endpoint: a.health_check_endpoint,
            },
            retry: RetrySettings {
                max_retries: if a.disable_retries {
                    0
                } else {
                    a.retry_max_retries
                },
                initial: Duration::from_millis(a.retry_initial_backoff_ms),
                max: Duration::from_millis(a.retry_max_backoff_ms.max(a.retry_initial_backoff_ms)),
                multiplier: a.retry_backoff_multiplier,
                jitter: a.retry_jitter_factor,
            },
            breaker: BreakerSettings {
                disabled: a.disable_circuit_breaker,
                failure_threshold: a.cb_failure_threshold,
                success_threshold: a.cb_success_threshold,
                timeout: positive("--cb-timeout-duration-secs", a.cb_timeout_duration_secs)?,
            },
            request_timeout: positive("--request-timeout-secs", a.request_timeout_secs)?,
            max_payload_size: a.max_payload_size,
            api_key: match a.api_key {
                Some(k) if k.trim().is_empty() => {
                    return Err(bad("--api-key", "must not be empty"));
                }
                Some(k) if k.chars().any(|c| c.is_control()) => {
                    return Err(bad("--api-key", "must not hold control characters"));
                }
                k => k,
            },
            prometheus: match a.prometheus_port {
                Some(p) if p == a.port && p != 0 && a.prometheus_host == a.host => {
                    return Err(bad(
                        "--prometheus-port",
                        format!("{p} is the router's own --port"),
                    ));
                }
                Some(p) => Some((a.prometheus_host, p)),
                None => None,
            },
            host: a.host,
            port: a.port,
            worker_urls: a.worker_urls,
            policy: a.policy,
            pd,
        })
    }

    /// The policy of the workers of `role`.
    pub fn policy_for(&self, role: Role) -> PolicyKind {
        match (role, &self.pd) {
            (Role::Prefill, Some(pd)) => pd.prefill_policy,
            (Role::Decode, Some(pd)) => pd.decode_policy,
            _ => self.policy,
        }
    }
}

/// Test helpers: configurations parsed from a command line as `arbor
/// router` parses it, and a router state of the default one.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use clap::Parser;

    /// The router's flags alone, as a command line.
    #[derive(Parser)]
    pub(crate) struct Cli {
        #[command(flatten)]
        pub args: RouterArgs,
    }

    /// The configuration of `router` followed by `extra`.
    pub(crate) fn parse(extra: &[&str]) -> Result<RouterConfig, RouterError> {
        let mut argv = vec!["router"];
        argv.extend_from_slice(extra);
        RouterConfig::from_args(Cli::parse_from(argv).args)
    }

    /// The state of a router of the default configuration (with the TLS
    /// provider that `run` installs before building its client).
    pub(crate) fn default_state() -> crate::RouterState {
        let cfg = parse(&[]).expect("config");
        let _ = rustls::crypto::ring::default_provider().install_default();
        crate::RouterState::new(cfg, reqwest::Client::new())
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{Cli, parse};
    use super::*;
    use clap::Parser;

    #[test]
    fn sglang_defaults() {
        let c = parse(&["--worker-urls", "http://a:1", "http://b:2"]).expect("valid");
        assert_eq!(c.policy, PolicyKind::CacheAware);
        assert_eq!(c.cache_aware.cache_threshold, 0.3);
        assert_eq!(c.cache_aware.balance_abs_threshold, 64);
        assert_eq!(c.cache_aware.balance_rel_threshold, 1.5);
        assert_eq!(c.cache_aware.max_load_factor, None);
        assert_eq!(c.worker_urls.len(), 2);
        assert_eq!(c.retry.max_retries, 5);
        assert_eq!((c.api_key, c.prometheus), (None, None));
        let c = parse(&["--api-key", "k", "--prometheus-port", "29000"]).expect("valid");
        assert_eq!(c.api_key.as_deref(), Some("k"));
        assert_eq!(c.prometheus, Some(("127.0.0.1".to_string(), 29000)));
        assert!(
            parse(&["--disable-retries"])
                .expect("valid")
                .retry
                .max_retries
                == 0
        );
    }

    #[test]
    fn bad_values_name_their_flag() {
        for (args, flag) in [
            (&["--cache-threshold", "1.5"][..], "--cache-threshold"),
            (&["--max-load-factor", "1"], "--max-load-factor"),
            (
                &["--balance-rel-threshold", "0.5"],
                "--balance-rel-threshold",
            ),
            (
                &["--health-check-endpoint", "health"],
                "--health-check-endpoint",
            ),
            (
                &["--eviction-interval-secs", "0"],
                "--eviction-interval-secs",
            ),
            (&["--retry-jitter-factor", "2"], "--retry-jitter-factor"),
            (&["--api-key", " "], "--api-key"),
            (&["--api-key", "a\nb"], "--api-key"),
            (&["--prometheus-port", "30000"], "--prometheus-port"),
        ] {
            match parse(args) {
                Err(RouterError::Config { flag: f, .. }) => assert_eq!(f, flag),
                other => panic!("{args:?}: {other:?}"),
            }
        }
        for (args, flag) in [
            (&["--prefill", "http://a:1"][..], "--prefill"),
            (
                &["--pd-disaggregation", "--prefill", "http://a:1"],
                "--pd-disaggregation",
            ),
            (
                &["--pd-disaggregation", "--worker-urls", "http://a:1"],
                "--worker-urls",
            ),
        ] {
            match parse(args) {
                Err(RouterError::Config { flag: f, .. }) => assert_eq!(f, flag),
                other => panic!("{args:?}: {other:?}"),
            }
        }
        for (args, flag) in [
            (&["--selector", "app=arbor"][..], "--selector"),
            (&["--service-discovery"], "--selector"),
            (
                &["--service-discovery", "--selector", "arbor"],
                "--selector",
            ),
            (
                &[
                    "--service-discovery",
                    "--pd-disaggregation",
                    "--selector",
                    "a=b",
                ],
                "--service-discovery",
            ),
        ] {
            match parse(args) {
                Err(RouterError::Config { flag: f, .. }) => assert_eq!(f, flag, "{args:?}"),
                other => panic!("{args:?}: {other:?}"),
            }
        }
        let d = parse(&[
            "--service-discovery",
            "--selector",
            "app=arbor",
            "component=worker",
        ])
        .expect("valid");
        assert_eq!(
            d.discovery.map(|x| x.selectors),
            Some(vec![(
                Role::Regular,
                vec!["app=arbor".to_string(), "component=worker".to_string()]
            )])
        );
        let pd = parse(&[
            "--pd-disaggregation",
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:2",
            "--decode-policy",
            "round_robin",
        ])
        .expect("valid");
        assert_eq!(pd.policy_for(Role::Prefill), PolicyKind::CacheAware);
        assert_eq!(pd.policy_for(Role::Decode), PolicyKind::RoundRobin);
        let Err(e) = Cli::try_parse_from(["router", "--policy", "least_busy"]) else {
            panic!("an unknown policy parsed");
        };
        assert!(e.to_string().contains("cache_aware"), "{e}");
    }

    #[test]
    fn backoff_grows_to_its_cap_with_jitter() {
        let r = RetrySettings {
            max_retries: 5,
            initial: Duration::from_millis(100),
            max: Duration::from_millis(300),
            multiplier: 2.0,
            jitter: 0.5,
        };
        assert_eq!(r.backoff(0, 0.5), Duration::from_millis(100));
        assert_eq!(r.backoff(1, 0.5), Duration::from_millis(200));
        assert_eq!(r.backoff(5, 0.5), Duration::from_millis(300));
        assert_eq!(r.backoff(0, 0.0), Duration::from_millis(50));
    }
}
