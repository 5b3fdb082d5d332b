//! Admin and observability endpoints (SGLang's): `/health`,
//! `/health_generate`, `/flush_cache`, `/abort_request`, `/get_model_info`,
//! `/get_server_info`, `/metrics`.
//!
//! `/health` answers 200 while the server accepts work and 503 once it is
//! shutting down. `/health_generate` runs a one-token generation through the
//! engine within a time limit. `/flush_cache` empties the prefix cache (its
//! device and host tiers; `?storage=true` also clears the storage tier) only
//! when no request is queued or running (400 otherwise, as SGLang).

use crate::error::ApiError;
use crate::fields::{Fields, read_json};
use crate::state::AppState;
use arbor_engine_core::SamplingParams;
use arbor_engine_core::engine::{FinishKind, GenerateRequest};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// `GET /health`.
pub(crate) async fn health(State(st): State<Arc<AppState>>) -> Response {
    match st.check_accepting() {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /health_generate`: one greedy token within the time limit.
pub(crate) async fn health_generate(State(st): State<Arc<AppState>>) -> Response {
    if let Err(e) = st.check_accepting() {
        return e.into_response();
    }
    let tok = st.tokenizer.bos_token_id.unwrap_or(0);
    let mut req = GenerateRequest::new(
        vec![tok],
        SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(1)
        },
    );
    req.rid = Some(format!("health-{}", st.new_id()));
    let mut stream = match st.engine.submit(req) {
        Ok(s) => s,
        Err(e) => {
            return ApiError::unavailable(format!("the engine refused a health check: {e}"))
                .into_response();
        }
    };
    let limit = st.opts.health_generate_timeout;
    let outcome = tokio::time::timeout(limit, async {
        while let Some(c) = stream.next().await {
            if let Some(f) = c.finish {
                return f.kind != FinishKind::Abort;
            }
        }
        false
    })
    .await;
    match outcome {
        Ok(true) => StatusCode::OK.into_response(),
        Ok(false) => {
            ApiError::unavailable("the health check generation was aborted").into_response()
        }
        Err(_) => ApiError::unavailable(format!(
            "the health check generation did not finish within {} s",
            limit.as_secs_f64()
        ))
        .into_response(),
    }
}

/// `POST|GET /flush_cache`; `?storage=true` also clears the HiCache storage tier.
pub(crate) async fn flush_cache(
    State(st): State<Arc<AppState>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let storage = match query.as_deref().unwrap_or("") {
        "" | "storage=false" => false,
        "storage=true" => true,
        other => {
            return ApiError::bad_request(format!(
                "unknown /flush_cache query '{other}' (accepted: storage=true)"
            ))
            .into_response();
        }
    };
    let engine = st.engine.clone();
    let r = tokio::task::spawn_blocking(move || engine.flush_cache_tiers(storage)).await;
    match r {
        Ok(Ok(true)) => (
            StatusCode::OK,
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n",
        )
            .into_response(),
        Ok(Ok(false)) => ApiError::bad_request(
            "the cache was not flushed: requests are running or waiting (flush only works when idle)",
        )
        .into_response(),
        Ok(Err(e)) => ApiError::from(e).into_response(),
        Err(e) => ApiError::internal(format!("flush task failed: {e}")).into_response(),
    }
}

/// `POST /abort_request` with `{"rid": "..."}` or `{"abort_all": true}`.
pub(crate) async fn abort_request(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let r: Result<(), ApiError> = async {
        let v = read_json(&headers, body, st.opts.max_request_bytes).await?;
        let mut f = Fields::new(v, "the request body", "")?;
        let rid = f.string("rid")?;
        let all = f.bool("abort_all")?.unwrap_or(false);
        f.ignore("abort_message");
        f.finish()?;
        match (rid, all) {
            (_, true) => st.engine.abort_all(),
            (Some(rid), false) if !rid.is_empty() => st.engine.abort(&rid),
            _ => return Err(ApiError::bad_request("give 'rid' or 'abort_all': true")),
        }
        Ok(())
    }
    .await;
    match r {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /get_model_info`.
pub(crate) async fn model_info(State(st): State<Arc<AppState>>) -> Response {
    let w = st.weights();
    Json(json!({
        "model_path": w.model_path,
        "tokenizer_path": st.opts.model_path,
        "served_model_name": st.opts.served_model_name,
        "is_generation": true,
        "context_length": st.opts.context_length,
        "has_chat_template": st.chat_template.is_some(),
        "preferred_sampling_params": Value::Null,
        "weight_version": w.version,
        "weight_updates": w.updates,
        "memory_released": w.released,
    }))
    .into_response()
}

/// `GET /get_server_info`: the start-up settings plus live state.
pub(crate) async fn server_info(State(st): State<Arc<AppState>>) -> Response {
    let s = st.engine.stats();
    let mut info = match &st.opts.server_info {
        Value::Object(o) => o.clone(),
        _ => Default::default(),
    };
    info.insert("served_model_name".into(), json!(st.opts.served_model_name));
    info.insert("model_path".into(), json!(st.weights().model_path));
    info.insert("weight_version".into(), json!(st.weights().version));
    info.insert("context_length".into(), json!(st.opts.context_length));
    info.insert("max_total_num_tokens".into(), json!(s.max_total_tokens));
    // A hybrid model's recurrent state slots beside the KV pages (0 otherwise).
    info.insert("max_mamba_cache_size".into(), json!(s.max_state_slots));
    info.insert("used_mamba_cache_slots".into(), json!(s.used_state_slots));
    info.insert("version".into(), json!(env!("CARGO_PKG_VERSION")));
    info.insert("uptime_s".into(), json!(st.started.elapsed().as_secs_f64()));
    info.insert("draining".into(), json!(st.draining.load(Ordering::SeqCst)));
    // bench_serving reads internal_states[0].avg_spec_accept_length; one
    // entry per data-parallel rank, as SGLang's.
    let states: Vec<Value> = st
        .engine
        .rank_stats()
        .iter()
        .map(|s| {
            json!({
                "avg_spec_accept_length": Value::Null,
                "last_gen_throughput": s.gen_throughput,
                "num_running_reqs": s.num_running_reqs,
                "num_queue_reqs": s.num_queue_reqs,
                "num_used_tokens": s.num_used_tokens,
                "token_usage": s.token_usage,
                "evictable_tokens": s.evictable_tokens,
                "held_tokens": s.held_tokens,
                "cache_tokens": s.cache_tokens,
                "cache_hit_rate": s.cache_hit_rate,
                "new_token_ratio": s.new_token_ratio,
                "iterations": s.iterations,
            })
        })
        .collect();
    info.insert("internal_states".into(), Value::Array(states));
    Json(Value::Object(info)).into_response()
}

/// `GET /get_load`: SGLang's load report, one entry per data-parallel rank
/// (`--dp-size`): requests running and queued, those queued, and the
/// tokens they weigh (KV held plus queued prompt tokens), plus the requests
/// the rank has received since start-up; SGLang's router sums the entries
/// per worker for `/get_loads` and its power-of-two policy.
pub(crate) async fn get_load(State(st): State<Arc<AppState>>) -> Response {
    let ranks: Vec<Value> = st
        .engine
        .rank_stats()
        .iter()
        .enumerate()
        .map(|(rank, s)| {
            json!({
                "dp_rank": rank,
                "num_reqs": s.num_running_reqs + s.num_queue_reqs,
                "num_waiting_reqs": s.num_queue_reqs,
                "num_tokens": s.num_used_tokens + s.num_queue_tokens,
                "num_requests_total": s.num_requests_total,
            })
        })
        .collect();
    Json(Value::Array(ranks)).into_response()
}

/// `GET /metrics` (Prometheus text format).
pub(crate) async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    if !st.opts.enable_metrics {
        return ApiError::not_found("metrics are disabled; start the server with --enable-metrics")
            .into_response();
    }
    let text = st.metrics.render(
        &st.engine.stats(),
        st.grammar_queue.load(std::sync::atomic::Ordering::SeqCst),
        st.grammar.as_ref().map(|g| g.stats()),
    );
    let mut r = text.into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    r
}
