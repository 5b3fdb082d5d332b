//! RL weight refit endpoints, SGLang's request and response shapes:
//! `POST /update_weights_from_disk`, `/pause_generation`,
//! `/continue_generation`, `/release_memory_occupation`,
//! `/resume_memory_occupation`.
//!
//! Loading happens off the scheduler while the old weights keep serving; the
//! swap itself is one message the engine handles between steps
//! ([`arbor_engine_core::engine::refit`]). `update_weights_from_disk` drains
//! running requests first (admitting none meanwhile, so no request fails)
//! unless `is_async: true`, which swaps at the next step boundary and lets
//! running requests continue. New weights must have the served model's
//! architecture and shape; anything else is a 400 naming the problem, and
//! the old weights stay. Weight updates and memory release/resume are
//! serialized. The tokenizer and chat template are not reloaded.

use crate::error::ApiError;
use crate::fields::{Fields, read_json};
use crate::state::AppState;
use arbor_engine_core::RankWeights;
use arbor_engine_core::engine::refit::{PauseMode, RefitOptions};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Loads weights for a weight update or a resume (the binary knows how:
/// registry, device, dtype).
pub trait WeightLoader: Send + Sync {
    /// The model at `path` (a Hugging Face folder or a GGUF file), loaded
    /// for each data-parallel rank of the engine, in rank order, on that
    /// rank's devices (a shard per tensor-parallel rank); the error says
    /// what is wrong with it.
    fn load(&self, path: &Path) -> Result<Vec<RankWeights>, String>;
}

/// SGLang's failure shape: `{"success": false, "message": ...}`.
fn failure(status: StatusCode, message: impl Into<String>) -> Response {
    let message = message.into();
    (status, Json(json!({"success": false, "message": message}))).into_response()
}

fn bad(message: impl Into<String>) -> Response {
    failure(StatusCode::BAD_REQUEST, message)
}

async fn body_fields(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Fields, ApiError> {
    let limit = st.opts.max_request_bytes;
    let bytes = axum::body::to_bytes(body, limit)
        .await
        .map_err(|e| ApiError::bad_request(format!("could not read the request body: {e}")))?;
    // An empty body means every default.
    let v = if bytes.iter().all(u8::is_ascii_whitespace) {
        json!({})
    } else {
        read_json(headers, Body::from(bytes), limit).await?
    };
    Fields::new(v, "the request body", "")
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Response> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        failure(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("task failed: {e}"),
        )
    })
}

async fn load(st: &Arc<AppState>, path: PathBuf) -> Result<Vec<RankWeights>, Response> {
    let Some(loader) = st.loader.clone() else {
        return Err(bad(
            "this server cannot load weights (no weight loader configured)",
        ));
    };
    blocking(move || loader.load(&path)).await?.map_err(bad)
}

struct UpdateArgs {
    path: String,
    abort_all: bool,
    is_async: bool,
    keep_pause: bool,
    version: Option<String>,
}

fn update_args(mut f: Fields) -> Result<UpdateArgs, ApiError> {
    let path = f
        .string("model_path")?
        .filter(|p| !p.is_empty())
        .ok_or_else(|| ApiError::bad_param("model_path", "'model_path' is required"))?;
    match f.string("load_format")?.as_deref() {
        None | Some("auto") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                "load_format",
                &format!(
                    "load format '{other}' (weights load as the model path says: a folder or a GGUF file)"
                ),
            ));
        }
    }
    if f.bool("flush_cache")? == Some(false) {
        return Err(ApiError::unsupported(
            "flush_cache",
            "keeping the prefix cache across a weight update (its KV is invalid)",
        ));
    }
    let a = UpdateArgs {
        path,
        abort_all: f.bool("abort_all_requests")?.unwrap_or(false),
        is_async: f.bool("is_async")?.unwrap_or(false),
        keep_pause: f.bool("keep_pause")?.unwrap_or(false),
        version: f.string("weight_version")?,
    };
    for k in [
        "torch_empty_cache",
        "recapture_cuda_graph",
        "token_step",
        "rid",
    ] {
        f.ignore(k);
    }
    f.unset_only("manifest", "tensor manifests")?;
    f.finish()?;
    Ok(a)
}

/// `POST /update_weights_from_disk`.
pub(crate) async fn update_weights_from_disk(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let a = match body_fields(&st, &headers, body).await.and_then(update_args) {
        Ok(a) => a,
        Err(e) => return e.into_response(),
    };
    let _serial = st.refit_lock.lock().await;
    if st.weights().released {
        return bad("memory is released: call /resume_memory_occupation first");
    }
    let t0 = Instant::now();
    let model = match load(&st, PathBuf::from(&a.path)).await {
        Ok(m) => m,
        Err(r) => return r,
    };
    let load_s = t0.elapsed().as_secs_f64();
    if a.abort_all {
        st.engine.abort_all();
    }
    let engine = st.engine.clone();
    let opts = RefitOptions {
        drain: !a.is_async,
        keep_pause: a.keep_pause,
    };
    let report = match blocking(move || engine.update_weights(model, opts)).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => return bad(format!("{}: {e}", a.path)),
        Err(r) => return r,
    };
    st.set_weights(|w| {
        w.model_path = a.path.clone();
        w.updates = report.version;
        if let Some(v) = &a.version {
            w.version = v.clone();
        }
    });
    tracing::info!(
        "weights updated from {} (load {load_s:.3} s, swap after {:.3} s)",
        a.path,
        report.waited.as_secs_f64()
    );
    Json(json!({
        "success": true,
        "message": "Succeeded to update model weights.",
        "num_paused_requests": report.running_at_swap,
        "weight_version": st.weights().version,
        "load_time_s": load_s,
        "swap_wait_s": report.waited.as_secs_f64(),
    }))
    .into_response()
}

/// `POST /pause_generation` with `{"mode": "abort" | "retract" | "in_place"}`.
pub(crate) async fn pause_generation(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mode = async {
        let mut f = body_fields(&st, &headers, body).await?;
        let mode: PauseMode = f
            .string("mode")?
            .as_deref()
            .unwrap_or("abort")
            .parse()
            .map_err(|e| ApiError::bad_param("mode", format!("{e}")))?;
        f.ignore("rid");
        f.finish()?;
        Ok::<_, ApiError>(mode)
    }
    .await;
    let mode = match mode {
        Ok(m) => m,
        Err(e) => return e.into_response(),
    };
    let engine = st.engine.clone();
    match blocking(move || engine.pause_generation(mode)).await {
        Ok(Ok(n)) => Json(
            json!({"status": "ok", "message": "Generation paused successfully.",
                                 "num_paused_requests": n}),
        )
        .into_response(),
        Ok(Err(e)) => bad(e.to_string()),
        Err(r) => r,
    }
}

/// `POST /continue_generation`.
pub(crate) async fn continue_generation(State(st): State<Arc<AppState>>) -> Response {
    let engine = st.engine.clone();
    match blocking(move || engine.continue_generation()).await {
        Ok(Ok(())) => {
            Json(json!({"status": "ok", "message": "Generation continued successfully."}))
                .into_response()
        }
        Ok(Err(e)) => bad(e.to_string()),
        Err(r) => r,
    }
}

/// Which memory SGLang's `tags` name: (KV cache, weights).
fn tags(f: &mut Fields) -> Result<(bool, bool), ApiError> {
    let Some(v) = f.raw("tags").filter(|v| !v.is_null()) else {
        return Ok((true, true));
    };
    let list = v.as_array().ok_or_else(|| {
        ApiError::bad_param("tags", "'tags' must be a list of \"kv_cache\", \"weights\"")
    })?;
    let (mut kv, mut weights) = (false, false);
    for t in list {
        match t.as_str() {
            Some("kv_cache") => kv = true,
            Some("weights") => weights = true,
            // No CUDA graphs are captured on the host; nothing to free.
            Some("cuda_graph") => {}
            _ => {
                return Err(ApiError::bad_param(
                    "tags",
                    format!("unknown memory tag {t} (kv_cache, weights, cuda_graph)"),
                ));
            }
        }
    }
    Ok((kv, weights))
}

/// `POST /release_memory_occupation` with optional `{"tags": [...]}`.
pub(crate) async fn release_memory_occupation(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let which = async {
        let mut f = body_fields(&st, &headers, body).await?;
        let t = tags(&mut f)?;
        f.finish()?;
        Ok::<_, ApiError>(t)
    }
    .await;
    let (kv, weights) = match which {
        Ok(t) => t,
        Err(e) => return e.into_response(),
    };
    let _serial = st.refit_lock.lock().await;
    if st.weights().released {
        return bad("memory is already released");
    }
    let engine = st.engine.clone();
    match blocking(move || engine.release_memory(kv, weights)).await {
        Ok(Ok(())) => {
            st.set_weights(|w| {
                w.released = true;
                w.weights_released = weights;
            });
            Json(json!({"success": true, "message": "Memory released.",
                        "kv_cache": kv, "weights": weights}))
            .into_response()
        }
        Ok(Err(e)) => bad(e.to_string()),
        Err(r) => r,
    }
}

/// `POST /resume_memory_occupation`: everything released comes back (the
/// weights from the current model path).
pub(crate) async fn resume_memory_occupation(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let which = async {
        let mut f = body_fields(&st, &headers, body).await?;
        let t = tags(&mut f)?;
        f.finish()?;
        Ok::<_, ApiError>(t)
    }
    .await;
    if let Err(e) = which {
        return e.into_response();
    }
    let _serial = st.refit_lock.lock().await;
    let w = st.weights();
    if !w.released {
        return bad("memory is not released");
    }
    let t0 = Instant::now();
    let model = if w.weights_released {
        match load(&st, PathBuf::from(st.weights().model_path)).await {
            Ok(m) => Some(m),
            Err(r) => return r,
        }
    } else {
        None
    };
    let engine = st.engine.clone();
    match blocking(move || engine.resume_memory(model)).await {
        Ok(Ok(())) => {
            st.set_weights(|w| {
                w.released = false;
                w.weights_released = false;
            });
            Json(json!({"success": true, "message": "Memory resumed.",
                        "resume_time_s": t0.elapsed().as_secs_f64()}))
            .into_response()
        }
        Ok(Err(e)) => bad(e.to_string()),
        Err(r) => r,
    }
}
