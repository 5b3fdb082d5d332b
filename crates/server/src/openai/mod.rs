//! The OpenAI-compatible API: `/v1/completions`, `/v1/chat/completions`,
//! `/v1/responses` ([`responses`]), `/v1/models`.
//!
//! This module holds what both generation routes share: the model-name
//! check, the sampling fields (OpenAI's plus SGLang's extras such as `top_k`,
//! `min_p`, `ignore_eos`, `stop_token_ids`), `stream_options`, the `usage`
//! object (with `prompt_tokens_details.cached_tokens` under
//! `--enable-cache-report`) and log-probability entries. Requests are read
//! with [`Fields`], so unknown fields and fields that ask for something
//! unsupported are refused with a 400 naming them; the engine's refusals
//! name OpenAI's parameters (`max_tokens`, ...) through [`Dialect`].

pub(crate) mod answer;
pub(crate) mod chat;
pub(crate) mod completions;
pub(crate) mod responses;
pub(crate) mod tools;

use crate::constraint::ConstraintSpec;
use crate::error::ApiError;
use crate::fields::Fields;
use crate::params::{self, Dialect};
use crate::run::Run;
use crate::state::AppState;
use arbor_engine_core::backend::MAX_TOP_LOGPROBS;
use arbor_engine_core::engine::{GenerateRequest, TokenLogprob};
use arbor_engine_core::{CacheNamespace, SamplingParams, TokenDecoder};
use arbor_models::{ChatMessage, TemplateVars};
use axum::Json;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// What the generation routes parse alike.
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
    /// vLLM's `prompt_logprobs` (chat and completions): the prompt tokens'
    /// log-probabilities with this many alternatives each.
    pub prompt_logprobs: Option<usize>,
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

/// Parses the fields both routes share ([`params::sampling`] in dialect `d`,
/// then the stream, cache and scheduling fields).
pub(crate) fn common(f: &mut Fields, d: Dialect) -> Result<Common, ApiError> {
    let (params, limit, c) = params::sampling(d, f)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let mut include_usage = false;
    if let Some(v) = f.raw("stream_options") {
        let mut so = Fields::new(v, "'stream_options'", "stream_options.")?;
        include_usage = so.bool("include_usage")?.unwrap_or(false);
        so.unset_only("continuous_usage_stats", "usage in every chunk")?;
        so.finish()?;
    }
    let rid = f.string("rid")?;
    let prompt_logprobs = match d {
        Dialect::Chat | Dialect::Completions => f
            .int("prompt_logprobs", 0, MAX_TOP_LOGPROBS as i64)?
            .map(|k| k as usize),
        _ => None,
    };
    if stream && prompt_logprobs.is_some() {
        return Err(ApiError::unsupported(
            "prompt_logprobs",
            "prompt_logprobs with stream",
        ));
    }
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
        (
            "session_params",
            "sessions on this route (they run on /generate)",
        ),
        ("return_hidden_states", "returning hidden states"),
        ("custom_logit_processor", "custom logit processors"),
        ("custom_params", "custom parameters"),
    ] {
        f.unset_only(k, what)?;
    }
    Ok(Common {
        params,
        max_tokens: limit,
        stream,
        include_usage,
        constraint: c,
        rid,
        priority,
        namespace,
        data_parallel_rank,
        prompt_logprobs,
    })
}

/// Asks `r` for vLLM's `prompt_logprobs`: every prompt token after the
/// first scored, with `k` alternatives (alternatives of the output are cut
/// to what the request asked by its formatter) and its rank.
pub(crate) fn ask_prompt_logprobs(r: &mut GenerateRequest, k: usize) {
    r.return_logprob = true;
    r.logprob_start_len = Some(0);
    r.top_logprobs_num = r.top_logprobs_num.max(k);
    r.prompt_logprob_ranks = true;
}

/// vLLM's `prompt_logprobs` of a prompt: `null` for its first token, then
/// per token an object keyed by token id (as a string) holding the token
/// and its `k` most likely alternatives, each `{"logprob", "rank",
/// "decoded_token"}` (an alternative's rank is its place in the list).
pub(crate) fn prompt_logprobs_json(
    st: &AppState,
    prompt: &[u32],
    scored: &[TokenLogprob],
    k: usize,
) -> Value {
    let entry = |id: u32, logprob: f32, rank: Option<u32>| json!({"logprob": logprob, "rank": rank, "decoded_token": token_text(st, id)});
    let mut out = Vec::with_capacity(prompt.len());
    if !prompt.is_empty() {
        out.push(Value::Null);
    }
    for l in scored {
        let mut m = Map::new();
        m.insert(l.token.to_string(), entry(l.token, l.logprob, l.rank));
        for (place, &(id, lp)) in l.top.iter().take(k).enumerate() {
            m.entry(id.to_string())
                .or_insert_with(|| entry(id, lp, Some(place as u32 + 1)));
        }
        out.push(Value::Object(m));
    }
    Value::Array(out)
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

/// The prompt's token ids: the messages through the model's chat template.
pub(crate) fn prompt_ids(
    st: &AppState,
    msgs: &[ChatMessage],
    vars: &TemplateVars<'_>,
) -> Result<Vec<u32>, ApiError> {
    let Some(template) = &st.chat_template else {
        return Err(ApiError::bad_request(
            "the model has no chat template; use /v1/completions or /generate",
        ));
    };
    let tok = &st.tokenizer;
    let text = template.render_with(msgs, vars)?;
    let ids = tok.encode(&text, false)?;
    if ids.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "the prompt is empty after applying the chat template",
        ));
    }
    Ok(ids)
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
