//! Multi-LoRA serving over HTTP, SGLang's shapes: `lora_path` on
//! `/generate` (one adapter name, or one per prompt of a batch, `null` for
//! the base model), the OpenAI `model` field naming `base:adapter` or the
//! adapter alone (or SGLang's extra `lora_path` field there), `POST /load_lora_adapter` (`lora_name`, `lora_path`) and
//! `POST /unload_lora_adapter` (`lora_name`), and adapters listed by
//! `/v1/models` with the served model as their parent.
//!
//! Names resolve through the server's [`LoraRegistry`] when the request
//! arrives: an adapter unloaded later keeps serving the requests that
//! already hold it. Without a registry (`--enable-lora` off) every LoRA
//! field is a 400 saying how to turn it on.

use crate::error::ApiError;
use crate::fields::Fields;
use crate::state::AppState;
use arbor_engine_core::LoraAdapter;
use arbor_lora::{LoraError, LoraRegistry};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::path::PathBuf;
use std::sync::Arc;

impl From<LoraError> for ApiError {
    fn from(e: LoraError) -> Self {
        let status = match e {
            LoraError::Device { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            _ => StatusCode::BAD_REQUEST,
        };
        ApiError::new(status, e.to_string())
    }
}

const NOT_ENABLED: &str = "LoRA is not enabled on this server (start it with --enable-lora)";

impl AppState {
    fn lora_registry(&self, param: &str) -> Result<&Arc<LoraRegistry>, ApiError> {
        self.lora
            .as_ref()
            .ok_or_else(|| ApiError::bad_param(param, NOT_ENABLED))
    }

    /// The adapter named `name` (request field `param`).
    pub fn adapter(&self, param: &str, name: &str) -> Result<Arc<LoraAdapter>, ApiError> {
        self.lora_registry(param)?
            .get(name)
            .map_err(|e| ApiError::from(e).with_param(param))
    }

    /// The `model` OpenAI responses name: the served model, or
    /// `served:adapter` for a request with an adapter.
    pub fn response_model(&self, lora: Option<&LoraAdapter>) -> String {
        match lora {
            Some(a) => format!("{}:{}", self.opts.served_model_name, a.name()),
            None => self.opts.served_model_name.clone(),
        }
    }

    /// The request's `model` field, when given, refused unless it names
    /// what is served (the base model, or a loaded adapter).
    pub(crate) fn checked_model(&self, f: &mut Fields) -> Result<Option<String>, ApiError> {
        let model = f.string("model")?;
        if let Some(m) = &model {
            self.resolve_model(m)?;
        }
        Ok(model)
    }

    /// What an OpenAI `model` field asks for: the base model (`None`), or
    /// an adapter as `base:adapter` or by its name alone.
    pub fn resolve_model(&self, model: &str) -> Result<Option<Arc<LoraAdapter>>, ApiError> {
        if self.serves_model(model) {
            return Ok(None);
        }
        let served = &self.opts.served_model_name;
        let missing = || {
            ApiError::not_found(format!(
                "the model '{model}' does not exist; this server serves '{served}'{}",
                match &self.lora {
                    Some(r) if !r.list().is_empty() => format!(
                        " and the adapters {}",
                        r.list()
                            .iter()
                            .map(|(n, _)| format!("'{served}:{n}'"))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    _ => String::new(),
                }
            ))
            .with_param("model")
        };
        let Some(registry) = &self.lora else {
            return Err(missing());
        };
        let name = match model.rsplit_once(':') {
            Some((base, adapter)) if self.serves_model(base) => adapter,
            Some(_) => return Err(missing()),
            None => model,
        };
        registry.get(name).map(Some).map_err(|_| missing())
    }
}

/// `lora_path` of `/generate`, one entry per prompt (`None`: the base model).
pub(crate) fn per_prompt_adapters(
    st: &AppState,
    values: Vec<Option<Value>>,
) -> Result<Vec<Option<Arc<LoraAdapter>>>, ApiError> {
    values
        .into_iter()
        .map(|v| match v {
            None => Ok(None),
            Some(Value::String(name)) => st.adapter("lora_path", &name).map(Some),
            Some(other) => Err(ApiError::bad_param(
                "lora_path",
                format!("'lora_path' must name a loaded adapter, got {other}"),
            )),
        })
        .collect()
}

/// The `/v1/models` cards of the loaded adapters.
pub(crate) fn adapter_cards(st: &AppState, created: u64) -> Vec<Value> {
    let Some(r) = &st.lora else {
        return Vec::new();
    };
    r.list()
        .into_iter()
        .map(|(name, l)| {
            json!({
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "arbor",
                "root": l.path.display().to_string(),
                "parent": st.opts.served_model_name,
                "max_model_len": st.opts.context_length,
            })
        })
        .collect()
}

/// SGLang's answer to a load or unload: success and the adapters loaded now.
fn loaded_reply(r: &LoraRegistry) -> Response {
    let mut m = Map::new();
    for (name, l) in r.list() {
        m.insert(name, json!(l.path.display().to_string()));
    }
    Json(json!({"success": true, "error_message": "", "loaded_adapters": m})).into_response()
}

fn name_field(f: &mut Fields) -> Result<String, ApiError> {
    f.string("lora_name")?
        .filter(|n| !n.is_empty())
        .ok_or_else(|| ApiError::bad_param("lora_name", "'lora_name' is required"))
}

/// Handles `POST /load_lora_adapter`.
pub(crate) async fn load_lora_adapter(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Body,
) -> Response {
    let run = async {
        let registry = st.lora_registry("lora_name")?.clone();
        let mut f = crate::fields::request_fields(&st, &headers, b).await?;
        let name = name_field(&mut f)?;
        let path = f
            .string("lora_path")?
            .filter(|p| !p.is_empty())
            .ok_or_else(|| ApiError::bad_param("lora_path", "'lora_path' is required"))?;
        // Pinning keeps an adapter in SGLang's GPU pool; here every loaded
        // adapter stays on the device until unloaded.
        f.bool("pinned")?;
        f.finish()?;
        let r = registry.clone();
        let dir = PathBuf::from(path);
        tokio::task::spawn_blocking(move || r.load(&name, &dir))
            .await
            .map_err(|e| ApiError::internal(format!("loading the adapter failed: {e}")))??;
        Ok::<_, ApiError>(loaded_reply(&registry))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}

/// Handles `POST /unload_lora_adapter`.
pub(crate) async fn unload_lora_adapter(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    b: Body,
) -> Response {
    let run = async {
        let registry = st.lora_registry("lora_name")?.clone();
        let mut f = crate::fields::request_fields(&st, &headers, b).await?;
        let name = name_field(&mut f)?;
        f.finish()?;
        registry.unload(&name)?;
        Ok::<_, ApiError>(loaded_reply(&registry))
    };
    run.await.unwrap_or_else(IntoResponse::into_response)
}
