//! The OpenAI-compatible API: `/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`.
//!
//! This module holds what both generation routes share: the model-name
//! check, the sampling fields (OpenAI's plus SGLang's extras such as `top_k`,
//! `min_p`, `ignore_eos`, `stop_token_ids`), `stream_options`, the `usage`
//! object (with `prompt_tokens_details.cached_tokens` under
//! `--enable-cache-report`) and log-probability entries. Requests are read
//! with [`Fields`], so unknown fields and fields that ask for something
//! unsupported are refused with a 400 naming them; engine messages are
//! rewritten to OpenAI's parameter names (`max_tokens`, ...).

pub(crate) mod chat;
pub(crate) mod completions;
pub(crate) mod tools;

use crate::constraint::{self, Constraint, ConstraintSpec};
use crate::error::ApiError;
use crate::fields::Fields;
use crate::run::Run;
use crate::state::AppState;
use arbor_engine_core::{CacheNamespace, SamplingParams, TokenDecoder};
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// Engine parameter names and their OpenAI names, for messages.
pub(crate) const RENAMES: &[(&str, &str)] = &[
    ("max_new_tokens", "max_tokens"),
    ("min_new_tokens", "min_tokens"),
    ("top_logprobs_num", "logprobs"),
];

/// What the two generation routes parse alike.
pub(crate) struct Common {
    pub params: SamplingParams,
    pub max_tokens: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    pub constraint: Option<ConstraintSpec>,
    pub rid: Option<String>,
    pub priority: i64,
    /// Prefix-cache namespace from `extra_key` and `cache_salt`.
    pub namespace: CacheNamespace,
    /// SGLang's `data_parallel_rank`: the replica to run on.
    pub data_parallel_rank: Option<usize>,
}

/// Checks the `model` field against the served name and the loaded LoRA
/// adapters (`base:adapter`, or the adapter's name), and SGLang's extra
/// `lora_path` field (an adapter's name); returns the adapter.
pub(crate) fn check_model(
    st: &AppState,
    f: &mut Fields,
) -> Result<Option<Arc<arbor_engine_core::LoraAdapter>>, ApiError> {
    let by_model = match f.string("model")? {
        Some(m) => st.resolve_model(&m)?,
        None => None,
    };
    let Some(name) = f.string("lora_path")? else {
        return Ok(by_model);
    };
    let a = st.adapter("lora_path", &name)?;
    if by_model.as_ref().is_some_and(|m| !Arc::ptr_eq(m, &a)) {
        return Err(ApiError::bad_param(
            "lora_path",
            "'lora_path' names another adapter than 'model'",
        ));
    }
    Ok(Some(a))
}

/// Reads a token limit that must be at least 1.
fn max_tokens(f: &mut Fields, key: &str) -> Result<Option<usize>, ApiError> {
    match f.int(key, i64::MIN, i64::MAX)? {
        None => Ok(None),
        Some(x) if x < 1 => Err(ApiError::bad_param(
            key,
            format!("'{key}' must be at least 1, got {x}"),
        )),
        Some(x) => Ok(Some(usize::try_from(x).unwrap_or(usize::MAX))),
    }
}

/// Parses the fields both routes share; `max_keys` are the token-limit fields in priority order.
pub(crate) fn common(f: &mut Fields, max_keys: &[&str]) -> Result<Common, ApiError> {
    let mut p = SamplingParams::default();
    let mut limit = None;
    for k in max_keys {
        let v = max_tokens(f, k)?;
        limit = limit.or(v);
    }
    if let Some(x) = f.f32("temperature")? {
        if !(0.0..=2.0).contains(&x) {
            return Err(ApiError::bad_param(
                "temperature",
                format!("'temperature' must be in [0, 2], got {x}"),
            ));
        }
        p.temperature = x;
    }
    if let Some(x) = f.f32("top_p")? {
        p.top_p = x;
    }
    if let Some(x) = f.int("top_k", i64::from(i32::MIN), i64::from(i32::MAX))? {
        p.top_k = if x == 0 { -1 } else { x as i32 };
    }
    if let Some(x) = f.f32("min_p")? {
        p.min_p = x;
    }
    if let Some(x) = f.f32("frequency_penalty")? {
        p.frequency_penalty = x;
    }
    if let Some(x) = f.f32("presence_penalty")? {
        p.presence_penalty = x;
    }
    if let Some(x) = f.f32("repetition_penalty")? {
        p.repetition_penalty = x;
    }
    if let Some(x) = f.int("n", i64::MIN, i64::MAX)? {
        if !(1..=128).contains(&x) {
            return Err(ApiError::bad_param(
                "n",
                format!("'n' must be in [1, 128], got {x}"),
            ));
        }
        p.n = x as usize;
    }
    if let Some(x) = f.stop("stop")? {
        p.stop = x;
    }
    if let Some(x) = f.get::<Vec<u32>>("stop_token_ids")? {
        p.stop_token_ids = x;
    }
    if let Some(x) = f.get::<u64>("seed")? {
        p.seed = Some(x);
    }
    if let Some(x) = f.logit_bias("logit_bias")? {
        p.logit_bias = x;
    }
    if let Some(x) = f.int("min_tokens", 0, i64::from(u32::MAX))? {
        p.min_new_tokens = x as usize;
    }
    if let Some(x) = f.bool("ignore_eos")? {
        p.ignore_eos = x;
    }
    if let Some(x) = f.bool("skip_special_tokens")? {
        p.skip_special_tokens = x;
    }
    if let Some(x) = f.bool("no_stop_trim")? {
        p.no_stop_trim = x;
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(v) = f.raw("stream_options") {
        let mut so = Fields::new(v, "'stream_options'", "stream_options.")?;
        include_usage = so.bool("include_usage")?.unwrap_or(false);
        so.unset_only("continuous_usage_stats", "usage in every chunk")?;
        so.finish()?;
    }
    let mut c = None;
    if let Some(s) = f.string("regex")? {
        constraint::set(&mut c, ConstraintSpec::new("regex", Constraint::Regex(s)))?;
    }
    if let Some(s) = f.string("ebnf")? {
        constraint::set(&mut c, ConstraintSpec::new("ebnf", Constraint::Ebnf(s)))?;
    }
    if let Some(v) = f.raw("json_schema") {
        let text = match v {
            Value::String(s) => s,
            other => other.to_string(),
        };
        constraint::set(
            &mut c,
            ConstraintSpec::new("json_schema", Constraint::JsonSchema(text)),
        )?;
    }
    if let Some(v) = f.raw("response_format")
        && let Some(spec) = response_format(v)?
    {
        constraint::set(&mut c, spec)?;
    }
    let rid = f.string("rid")?;
    let priority = f.int("priority", i64::MIN, i64::MAX)?.unwrap_or(0);
    let data_parallel_rank = crate::fields::data_parallel_rank(f)?;
    // Requests with other keys never share cached prefixes (tenants, adapters).
    let extra_key = f.string("extra_key")?;
    let cache_salt = f.string("cache_salt")?;
    let namespace = CacheNamespace::new(extra_key.as_deref(), cache_salt.as_deref());
    for k in ["user", "metadata", "store", "service_tier"] {
        f.ignore(k);
    }
    for (k, what) in [
        ("lora_path", "LoRA"),
        ("session_params", "sessions"),
        ("return_hidden_states", "returning hidden states"),
        ("custom_logit_processor", "custom logit processors"),
        ("custom_params", "custom parameters"),
    ] {
        f.unset_only(k, what)?;
    }
    Ok(Common {
        params: p,
        max_tokens: limit,
        stream,
        include_usage,
        constraint: c,
        rid,
        priority,
        namespace,
        data_parallel_rank,
    })
}

/// Parses `response_format`: `text` asks for nothing; the others are constraints.
fn response_format(v: Value) -> Result<Option<ConstraintSpec>, ApiError> {
    let mut f = Fields::new(v, "'response_format'", "response_format.")?;
    let kind = f.string("type")?.ok_or_else(|| {
        ApiError::bad_param("response_format.type", "'response_format.type' is required")
    })?;
    let spec = match kind.as_str() {
        "text" => None,
        "json_object" => Some(Constraint::JsonObject),
        "json_schema" => {
            // OpenAI nests the schema: {"json_schema": {"name", "schema", "strict"}}.
            let mut js = f.raw("json_schema").unwrap_or(Value::Null);
            let schema = match js.get_mut("schema") {
                Some(s) => s.take(),
                None => js,
            };
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        "structural_tag" => Some(Constraint::StructuralTag(Value::Null)),
        other => {
            return Err(ApiError::bad_param(
                "response_format.type",
                format!(
                    "'response_format.type' must be text, json_object, json_schema or structural_tag, got '{other}'"
                ),
            ));
        }
    };
    // The rest of the object belongs to the constraint (schema, tags...).
    Ok(spec.map(|c| ConstraintSpec::new("response_format", c)))
}

/// The `usage` object of a run.
pub(crate) fn usage(st: &AppState, run: &Run) -> Value {
    let prompt = run.prompt_tokens();
    let completion = run.completion_tokens();
    let details = if st.opts.enable_cache_report {
        json!({"cached_tokens": run.cached_tokens()})
    } else {
        Value::Null
    };
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": details,
    })
}

/// The text of one token (for log-probability entries).
pub(crate) fn token_text(st: &AppState, id: u32) -> String {
    st.tokenizer.decode(&[id], false).unwrap_or_default()
}

/// Handles `GET /v1/models`.
pub(crate) async fn models(State(st): State<Arc<AppState>>) -> Response {
    let mut data = vec![model_card(&st)];
    data.extend(crate::lora::adapter_cards(&st, AppState::now_unix()));
    Json(json!({"object": "list", "data": data})).into_response()
}

/// Handles `GET /v1/models/{id}`.
pub(crate) async fn model(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if st.serves_model(&id) {
        Json(model_card(&st)).into_response()
    } else if let Some(card) = crate::lora::adapter_cards(&st, AppState::now_unix())
        .into_iter()
        .find(|c| c["id"] == id.as_str())
    {
        Json(card).into_response()
    } else {
        ApiError::not_found(format!("the model '{id}' does not exist"))
            .with_param("model")
            .into_response()
    }
}

fn model_card(st: &AppState) -> Value {
    json!({
        "id": st.opts.served_model_name,
        "object": "model",
        "created": AppState::now_unix(),
        "owned_by": "arbor",
        "root": st.opts.model_path,
        "max_model_len": st.opts.context_length,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn response_format_extracts_the_schema() {
        let v = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
        let spec = response_format(v).unwrap().unwrap();
        assert_eq!(spec.field, "response_format");
        assert_eq!(
            spec.constraint,
            Constraint::JsonSchema("{\"type\":\"object\"}".into())
        );
        assert!(response_format(json!({"type": "text"})).unwrap().is_none());
        assert!(response_format(json!({"type": "xml"})).is_err());
        assert!(response_format(json!({})).is_err());
    }
}
