//! Kubernetes service discovery (`--service-discovery`): the router lists
//! the pods that match `--selector` (and, in PD mode, `--prefill-selector` /
//! `--decode-selector`) through the Kubernetes API every
//! `--service-discovery-interval-secs`, and keeps one worker per ready pod
//! at `http://POD_IP:--service-discovery-port`.
//!
//! In a pod the API is `https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`
//! with the service account's token and CA; `--kube-api-url` names another
//! (e.g. `kubectl proxy`'s `http://127.0.0.1:8001`, no token). The router's
//! service account needs `list` on pods (deploy/kubernetes/router-discovery.yaml).
//!
//! Invariants: only workers this module added are removed by it (workers
//! from `--worker-urls` or `/add_worker` stay); a pod counts once it runs,
//! has an IP, is Ready and is not being deleted; a pod joins like
//! `/add_worker` (health probe and role check) and is retried on the next
//! pass when that fails; an API error changes nothing (the last known set
//! keeps serving).

use crate::state::RouterState;
use crate::worker::Role;
use serde_json::Value;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

const SA_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

/// Checked discovery settings.
#[derive(Clone, Debug, PartialEq)]
pub struct DiscoveryConfig {
    /// Label selectors (`k=v`) per role.
    pub selectors: Vec<(Role, Vec<String>)>,
    /// The workers' HTTP port on each pod.
    pub port: u16,
    /// The namespace listed (`None`: the router's own, else `default`).
    pub namespace: Option<String>,
    /// The API base URL (`None`: in-cluster).
    pub api_url: Option<String>,
    /// Time between listings.
    pub interval: Duration,
}

/// How to reach the API.
#[derive(Debug)]
pub struct KubeApi {
    base: String,
    token: Option<String>,
    namespace: String,
    client: reqwest::Client,
}

/// Percent-encodes a query value (RFC 3986 unreserved characters stay).
fn encode(v: &str) -> String {
    v.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

impl KubeApi {
    /// The API of `cfg`: `--kube-api-url`, else the in-cluster service.
    pub fn new(cfg: &DiscoveryConfig) -> Result<Self, String> {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let own_ns = std::fs::read_to_string(format!("{SA_DIR}/namespace")).ok();
        let namespace = cfg
            .namespace
            .clone()
            .or_else(|| own_ns.map(|s| s.trim().to_string()))
            .unwrap_or_else(|| "default".into());
        if let Some(base) = &cfg.api_url {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .map_err(|e| e.to_string())?;
            return Ok(Self {
                base: base.trim_end_matches('/').to_string(),
                token: None,
                namespace,
                client,
            });
        }
        let (Ok(host), Ok(port)) = (
            std::env::var("KUBERNETES_SERVICE_HOST"),
            std::env::var("KUBERNETES_SERVICE_PORT"),
        ) else {
            return Err(
                "not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST is unset); give --kube-api-url".into(),
            );
        };
        let token = std::fs::read_to_string(format!("{SA_DIR}/token"))
            .map_err(|e| format!("reading the service account token: {e}"))?;
        let ca = std::fs::read(format!("{SA_DIR}/ca.crt"))
            .map_err(|e| format!("reading the cluster CA: {e}"))?;
        let ca = reqwest::Certificate::from_pem(&ca).map_err(|e| format!("the cluster CA: {e}"))?;
        let client = reqwest::Client::builder()
            .add_root_certificate(ca)
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| e.to_string())?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host
        };
        Ok(Self {
            base: format!("https://{host}:{port}"),
            token: Some(token.trim().to_string()),
            namespace,
            client,
        })
    }

    /// The pod list (`PodList` JSON) matching `selector`.
    pub async fn pods(&self, selector: &[String]) -> Result<Value, String> {
        let url = format!(
            "{}/api/v1/namespaces/{}/pods?labelSelector={}",
            self.base,
            encode(&self.namespace),
            encode(&selector.join(","))
        );
        let mut rq = self.client.get(&url);
        if let Some(t) = &self.token {
            rq = rq.bearer_auth(t);
        }
        let r = rq.send().await.map_err(|e| format!("{url}: {e}"))?;
        let status = r.status();
        let body = r.text().await.map_err(|e| format!("{url}: {e}"))?;
        if !status.is_success() {
            return Err(format!("{url} answered {status}: {}", body.trim()));
        }
        serde_json::from_str(&body).map_err(|e| format!("{url}: not a pod list: {e}"))
    }
}

/// The worker URLs of the ready pods of a `PodList`.
pub fn ready_pod_urls(list: &Value, port: u16) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for pod in list["items"].as_array().into_iter().flatten() {
        if !pod["metadata"]["deletionTimestamp"].is_null() || pod["status"]["phase"] != "Running" {
            continue;
        }
        let ready = pod["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|c| c["type"] == "Ready" && c["status"] == "True");
        let Some(ip) = pod["status"]["podIP"].as_str().filter(|ip| !ip.is_empty()) else {
            continue;
        };
        if ready {
            let host = if ip.contains(':') {
                format!("[{ip}]")
            } else {
                ip.to_string()
            };
            out.insert(format!("http://{host}:{port}"));
        }
    }
    out
}

/// What changes: URLs to add, URLs to remove.
pub fn plan(current: &BTreeSet<String>, desired: &BTreeSet<String>) -> (Vec<String>, Vec<String>) {
    (
        desired.difference(current).cloned().collect(),
        current.difference(desired).cloned().collect(),
    )
}

/// Lists and reconciles forever.
pub async fn run(st: Arc<RouterState>, cfg: DiscoveryConfig, api: KubeApi) {
    let mut ours: Vec<BTreeSet<String>> = vec![BTreeSet::new(); cfg.selectors.len()];
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for (i, (role, selector)) in cfg.selectors.iter().enumerate() {
            let desired = match api.pods(selector).await {
                Ok(list) => ready_pod_urls(&list, cfg.port),
                Err(e) => {
                    tracing::warn!("service discovery ({}): {e}", selector.join(","));
                    continue;
                }
            };
            let (add, remove) = plan(&ours[i], &desired);
            for url in remove {
                if st.workers.remove(&url).is_ok() {
                    tracing::warn!("service discovery: pod {url} is gone or not ready; removed");
                }
                ours[i].remove(&url);
            }
            for url in add {
                if let Err(e) = crate::check_health(&st, &url).await {
                    tracing::info!("service discovery: {url} not healthy yet: {e}");
                    continue;
                }
                let peer = match crate::pd::check_role(&st, &url, *role).await {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::warn!("service discovery: {e}");
                        continue;
                    }
                };
                match st.workers.add_with(&url, *role, peer) {
                    Ok(_) => {
                        tracing::warn!("service discovery: added {} worker {url}", role.name())
                    }
                    Err(e) => tracing::info!("service discovery: {e}"),
                }
                ours[i].insert(url);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A `PodList` as `GET /api/v1/namespaces/NS/pods` returns it (fields trimmed).
    fn pods() -> Value {
        let pod = |name: &str, ip: &str, phase: &str, ready: &str, deleting: bool| {
            let mut p = json!({
                "metadata": {"name": name, "namespace": "serving", "labels": {"app": "arbor"}},
                "spec": {"containers": [{"name": "arbor", "ports": [{"containerPort": 30000}]}]},
                "status": {"phase": phase, "podIP": ip, "conditions": [
                    {"type": "Initialized", "status": "True"},
                    {"type": "Ready", "status": ready},
                    {"type": "ContainersReady", "status": ready}]}
            });
            if deleting {
                p["metadata"]["deletionTimestamp"] = json!("2026-12-02T05:00:00Z");
            }
            p
        };
        json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "123"}, "items": [
            pod("arbor-worker-0", "10.1.0.4", "Running", "True", false),
            pod("arbor-worker-1", "10.1.0.5", "Running", "False", false),
            pod("arbor-worker-2", "10.1.0.6", "Pending", "False", false),
            pod("arbor-worker-3", "10.1.0.7", "Running", "True", true),
            pod("arbor-worker-4", "fd00::8", "Running", "True", false),
            pod("arbor-worker-5", "", "Running", "True", false),
        ]})
    }

    #[test]
    fn only_ready_running_pods_with_an_ip_are_workers() {
        let urls: Vec<String> = ready_pod_urls(&pods(), 30000).into_iter().collect();
        assert_eq!(urls, ["http://10.1.0.4:30000", "http://[fd00::8]:30000"]);
        assert!(ready_pod_urls(&json!({"kind": "Status"}), 1).is_empty());
    }

    #[test]
    fn plans_add_what_appeared_and_remove_what_left() {
        let cur: BTreeSet<String> = ["a", "b"].map(String::from).into();
        let want: BTreeSet<String> = ["b", "c"].map(String::from).into();
        assert_eq!(
            plan(&cur, &want),
            (vec!["c".to_string()], vec!["a".to_string()])
        );
        assert_eq!(plan(&want, &want), (vec![], vec![]));
    }

    #[test]
    fn selectors_are_encoded_and_the_cluster_is_required() {
        assert_eq!(
            encode("app=arbor,component=worker"),
            "app%3Darbor%2Ccomponent%3Dworker"
        );
        let cfg = DiscoveryConfig {
            selectors: vec![(Role::Regular, vec!["app=arbor".into()])],
            port: 30000,
            namespace: None,
            api_url: None,
            interval: Duration::from_secs(10),
        };
        if std::env::var("KUBERNETES_SERVICE_HOST").is_err() {
            let e = KubeApi::new(&cfg).err().unwrap_or_default();
            assert!(e.contains("KUBERNETES_SERVICE_HOST"), "{e}");
        }
        let api = KubeApi::new(&DiscoveryConfig {
            api_url: Some("http://127.0.0.1:8001/".into()),
            namespace: Some("serving".into()),
            ..cfg
        })
        .expect("an explicit API URL");
        assert_eq!(
            (api.base.as_str(), api.namespace.as_str()),
            ("http://127.0.0.1:8001", "serving")
        );
    }
}
