//! Prefill/decode disaggregation through the router.
//!
//! Per request: the decode pool's policy picks a decode worker, the prefill
//! pool's picks a prefill worker; the request goes to the prefill worker
//! with `x-arbor-kv-peer` naming the decode worker's KV transfer address,
//! and the router waits for its answer, which comes once the prompt's KV is
//! in the decode worker's prefix cache. Then the unchanged request goes to
//! the decode worker, whose answer (streamed or not) is the client's. When
//! the prefill fails, the decode worker still answers (it computes the
//! prompt itself): a prefill fault costs time, never the request. Both
//! pools keep their own trees, so repeated prefixes stay on one prefill
//! and one decode worker.
//!
//! A worker's role is checked when it joins: `/get_server_info` must say
//! `disaggregation.mode` is `prefill` or `decode` as configured, and a
//! decode worker must publish `kv_transfer_address` (its port is used with
//! the host of the worker's URL).

use crate::metrics::FailureKind;
use crate::proxy::{Outgoing, error_response, forward};
use crate::state::RouterState;
use crate::worker::Role;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::Value;
use std::sync::Arc;

/// The header a prefill worker reads (see `arbor_server::disagg`).
pub const PEER_HEADER: &str = "x-arbor-kv-peer";

/// Checks that `url` serves as `role`; returns a decode worker's KV address.
pub async fn check_role(st: &RouterState, url: &str, role: Role) -> Result<Option<String>, String> {
    if role == Role::Regular {
        return Ok(None);
    }
    let resp = st
        .client
        .get(format!("{url}/get_server_info"))
        .timeout(st.cfg.health.timeout)
        .send()
        .await
        .map_err(|e| format!("{url}/get_server_info: {e}"))?;
    let status = resp.status();
    if status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN {
        return Err(format!(
            "{url}/get_server_info: {status}: the worker wants an API key (give the router --api-key)"
        ));
    }
    let info: Value = resp
        .json()
        .await
        .map_err(|e| format!("{url}/get_server_info: {e}"))?;
    let d = &info["disaggregation"];
    let mode = d["mode"].as_str().unwrap_or("null");
    if mode != role.name() {
        return Err(format!(
            "worker {url} runs --disaggregation-mode {mode}, not {}",
            role.name()
        ));
    }
    if role == Role::Prefill {
        return Ok(None);
    }
    let addr = d["kv_transfer_address"]
        .as_str()
        .ok_or_else(|| format!("decode worker {url} publishes no kv_transfer_address"))?;
    let port = addr
        .rsplit_once(':')
        .map(|(_, p)| p)
        .filter(|p| p.parse::<u16>().is_ok())
        .ok_or_else(|| format!("decode worker {url}: bad kv_transfer_address {addr:?}"))?;
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let host = match rest.strip_prefix('[') {
        Some(r) => format!("[{}]", r.split(']').next().unwrap_or("")),
        None => rest.split(':').next().unwrap_or("").to_string(),
    };
    Ok(Some(format!("{host}:{port}")))
}

/// Routes one generation request through a prefill and a decode worker.
pub async fn generate(st: &Arc<RouterState>, text: &[char], out: Outgoing) -> Response {
    let Some(decode) = st.pick(Role::Decode, Some(text), &[]) else {
        st.metrics.failure(FailureKind::NoWorker);
        return error_response(
            StatusCode::SERVICE_UNAVAILABLE,
            "no healthy decode worker is available",
        );
    };
    if let Some(peer) = decode
        .worker()
        .kv_peer()
        .and_then(|p| HeaderValue::from_str(p).ok())
    {
        let mut pre = out.clone();
        pre.headers.insert(PEER_HEADER, peer);
        let r = forward(st, Role::Prefill, Some(text), pre, None).await;
        let status = r.status();
        // The answer ends once the KV is in place: read it to the end.
        let body = axum::body::to_bytes(r.into_body(), st.cfg.max_payload_size).await;
        if !status.is_success() || body.is_err() {
            st.metrics.failure(FailureKind::Prefill);
            let detail = body
                .map(|b| String::from_utf8_lossy(&b).into_owned())
                .unwrap_or_else(|e| e.to_string());
            tracing::warn!(
                "prefill failed ({status}): {}; decode worker {} computes the prompt",
                detail.trim(),
                decode.worker().url()
            );
        }
    }
    forward(st, Role::Decode, Some(text), out, Some(decode)).await
}
