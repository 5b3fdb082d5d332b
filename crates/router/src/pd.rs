//! Prefill/decode disaggregation through the router.
//!
//! Per request the decode pool's policy picks a decode worker and the
//! prefill pool's a prefill worker. Two flows:
//! - **Bootstrap rooms** (SGLang's, when the prefill worker publishes a
//!   bootstrap port): the request gets `bootstrap_host`, `bootstrap_port`
//!   and `bootstrap_room` (one room per prompt, as SGLang's router adds
//!   them) and goes to both workers at once. The prefill worker deposits
//!   each prompt's KV in its room; the decode worker pulls it before it
//!   runs the request, whose answer (streamed or not) is the client's. The
//!   prefill answer is read in the background: its failure is logged and
//!   counted, and the decode worker, whose pull then fails, computes the
//!   prompt itself.
//! - **Push** (a prefill worker without a bootstrap port): the request goes
//!   to the prefill worker with `x-arbor-kv-peer` naming the decode worker's
//!   KV transfer address, and the router waits for its answer, which comes
//!   once the prompt's KV is in the decode worker's prefix cache. Then the
//!   unchanged request goes to the decode worker.
//!
//! Either way a prefill fault costs time, never the request. Both pools
//! keep their own trees, so repeated prefixes stay on one prefill and one
//! decode worker.
//!
//! A worker's role is checked when it joins: `/get_server_info` must say
//! `disaggregation.mode` is `prefill` or `decode` as configured; a decode
//! worker must publish `kv_transfer_address`, a prefill worker may publish
//! `bootstrap_port` (the ports are used with the host of the worker's URL).

use crate::metrics::FailureKind;
use crate::proxy::{Outgoing, error_response, forward};
use crate::state::RouterState;
use crate::worker::Role;
use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use serde_json::{Value, json};
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
    let port = if role == Role::Prefill {
        match d["bootstrap_port"].as_u64() {
            Some(p) => u16::try_from(p)
                .map_err(|_| format!("prefill worker {url}: bad bootstrap_port {p}"))?
                .to_string(),
            None => return Ok(None),
        }
    } else {
        let addr = d["kv_transfer_address"]
            .as_str()
            .ok_or_else(|| format!("decode worker {url} publishes no kv_transfer_address"))?;
        addr.rsplit_once(':')
            .map(|(_, p)| p)
            .filter(|p| p.parse::<u16>().is_ok())
            .ok_or_else(|| format!("decode worker {url}: bad kv_transfer_address {addr:?}"))?
            .to_string()
    };
    Ok(Some(format!("{}:{port}", host_of(url))))
}

/// The host of a worker URL (an IPv6 host keeps its brackets).
fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    match rest.strip_prefix('[') {
        Some(r) => format!("[{}]", r.split(']').next().unwrap_or("")),
        None => rest.split(':').next().unwrap_or("").to_string(),
    }
}

/// Prompts a generation body holds, as SGLang's router counts them for
/// its bootstrap fields: `None` for one, else the list's length (a batch of
/// `text`, `input_ids` or `prompt`, or a chat request's `n`).
fn batch_size(body: &Value) -> Option<usize> {
    if let Some(n) = body.get("n").and_then(Value::as_u64).filter(|&n| n > 1) {
        return Some(n as usize);
    }
    if let Some(Value::Array(a)) = body.get("prompt").or_else(|| body.get("text")) {
        return Some(a.len());
    }
    match body.get("input_ids") {
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_array) => Some(a.len()),
        _ => None,
    }
}

/// `body` with bootstrap fields naming `boot` (`HOST:PORT`): one room per
/// prompt; `None` when the body is not a JSON object.
fn with_rooms(st: &RouterState, body: &[u8], boot: &str) -> Option<Vec<u8>> {
    let mut v: Value = serde_json::from_slice(body).ok()?;
    let (host, port) = boot.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let n = batch_size(&v);
    let obj = v.as_object_mut()?;
    match n {
        Some(n) => {
            obj.insert("bootstrap_host".into(), json!(vec![host; n]));
            obj.insert("bootstrap_port".into(), json!(vec![port; n]));
            let rooms: Vec<u64> = (0..n).map(|_| st.room()).collect();
            obj.insert("bootstrap_room".into(), json!(rooms));
        }
        None => {
            obj.insert("bootstrap_host".into(), json!(host));
            obj.insert("bootstrap_port".into(), json!(port));
            obj.insert("bootstrap_room".into(), json!(st.room()));
        }
    }
    serde_json::to_vec(&v).ok()
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
    let prefill = st.pick(Role::Prefill, Some(text), &[]);
    // Bootstrap rooms when the prefill worker serves them: both at once.
    let rooms = prefill.as_ref().and_then(|p| {
        p.worker()
            .kv_peer()
            .and_then(|boot| with_rooms(st, &out.body, boot))
    });
    let prefill = match (rooms, prefill) {
        (Some(body), Some(guard)) => {
            let out = Outgoing {
                body: body.into(),
                ..out
            };
            let url = guard.worker().url().to_string();
            let (pst, pre, ptext) = (st.clone(), out.clone(), text.to_vec());
            tokio::spawn(async move {
                let r = forward(&pst, Role::Prefill, Some(&ptext), pre, Some(guard)).await;
                let status = r.status();
                let body = axum::body::to_bytes(r.into_body(), pst.cfg.max_payload_size).await;
                if !status.is_success() || body.is_err() {
                    pst.metrics.failure(FailureKind::Prefill);
                    tracing::warn!(
                        "prefill worker {url} failed ({status}); the decode worker computes the prompt"
                    );
                }
            });
            return forward(st, Role::Decode, Some(text), out, Some(decode)).await;
        }
        (_, prefill) => prefill,
    };
    if let Some(peer) = decode
        .worker()
        .kv_peer()
        .and_then(|p| HeaderValue::from_str(p).ok())
    {
        let mut pre = out.clone();
        pre.headers.insert(PEER_HEADER, peer);
        let r = forward(st, Role::Prefill, Some(text), pre, prefill).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::testing::default_state as state;

    #[test]
    fn rooms_are_added_per_prompt_as_sglang_adds_them() {
        let st = state();
        let one = with_rooms(&st, br#"{"text": "hi", "stream": true}"#, "10.0.0.2:8998").unwrap();
        let v: Value = serde_json::from_slice(&one).unwrap();
        assert_eq!(v["bootstrap_host"], "10.0.0.2");
        assert_eq!(v["bootstrap_port"], 8998);
        assert!(
            v["bootstrap_room"]
                .as_u64()
                .is_some_and(|r| r <= i64::MAX as u64)
        );
        assert_eq!(v["stream"], true);
        for (body, n) in [
            (json!({"text": ["a", "b", "c"]}), 3),
            (json!({"input_ids": [[1, 2], [3]]}), 2),
            (json!({"prompt": ["x", "y"]}), 2),
            (json!({"messages": [], "n": 4}), 4),
        ] {
            let out = with_rooms(&st, body.to_string().as_bytes(), "[::1]:9").unwrap();
            let v: Value = serde_json::from_slice(&out).unwrap();
            let rooms = v["bootstrap_room"].as_array().unwrap();
            assert_eq!(rooms.len(), n, "{body}");
            assert_eq!(v["bootstrap_host"][0], "::1");
            assert_eq!(v["bootstrap_port"][n - 1], 9);
            let mut distinct = rooms.clone();
            distinct.dedup();
            assert_eq!(distinct.len(), n, "rooms differ");
        }
        // A single input_ids prompt is one room.
        let out = with_rooms(&st, br#"{"input_ids": [1, 2, 3]}"#, "h:1").unwrap();
        let v: Value = serde_json::from_slice(&out).unwrap();
        assert!(v["bootstrap_room"].is_u64());
        assert!(with_rooms(&st, b"[1, 2]", "h:1").is_none());
    }

    #[test]
    fn hosts_keep_ipv6_brackets() {
        assert_eq!(host_of("http://127.0.0.1:8000"), "127.0.0.1");
        assert_eq!(host_of("http://[::1]:8000"), "[::1]");
        assert_eq!(host_of("worker-0:30000"), "worker-0");
    }
}
