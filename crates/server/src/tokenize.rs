//! `/tokenize` and `/detokenize` (and their `/v1/` forms), as SGLang serves
//! them: the served model's tokenizer, no generation.
//!
//! `POST /tokenize {"prompt": str | [str], "add_special_tokens": true}`
//! answers `{"tokens", "count", "max_model_len"}` (a list of lists and of
//! counts for a list of prompts); `POST /detokenize {"tokens": [id] |
//! [[id]], "skip_special_tokens": true}` answers `{"text"}` (a list for a
//! list). `model`, when given, must name the served model. Bad input is a
//! 400 naming its field; token ids outside the vocabulary are refused.

use crate::error::{ApiError, json_reply};
use crate::fields::request_fields;
use crate::state::AppState;
use arbor_engine_core::TokenDecoder;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

/// Handles `POST /tokenize` and `POST /v1/tokenize`.
pub(crate) async fn tokenize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(tokenize_inner(&st, &headers, body).await)
}

async fn tokenize_inner(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Value, ApiError> {
    let mut f = request_fields(st, headers, body).await?;
    // A loaded adapter shares the base tokenizer.
    st.checked_model(&mut f)?;
    let add_special = f.bool("add_special_tokens")?.unwrap_or(true);
    let prompt = f
        .raw("prompt")
        .ok_or_else(|| ApiError::bad_param("prompt", "'prompt' is required"))?;
    f.finish()?;
    let encode =
        |s: &str| -> Result<Vec<u32>, ApiError> { Ok(st.tokenizer.encode(s, add_special)?) };
    let bad = || ApiError::bad_param("prompt", "'prompt' must be a string or a list of strings");
    let max_model_len = st.opts.context_length;
    match prompt {
        Value::String(s) => {
            let ids = encode(&s)?;
            Ok(json!({"tokens": ids, "count": ids.len(), "max_model_len": max_model_len}))
        }
        Value::Array(items) => {
            let lists = items
                .iter()
                .map(|x| x.as_str().ok_or_else(bad).and_then(encode))
                .collect::<Result<Vec<_>, _>>()?;
            let counts: Vec<usize> = lists.iter().map(Vec::len).collect();
            Ok(json!({"tokens": lists, "count": counts, "max_model_len": max_model_len}))
        }
        _ => Err(bad()),
    }
}

/// Handles `POST /detokenize` and `POST /v1/detokenize`.
pub(crate) async fn detokenize(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(detokenize_inner(&st, &headers, body).await)
}

/// Token ids from a JSON list, each within the vocabulary.
fn ids_of(v: &Value, vocab: usize) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::bad_param(
            "tokens",
            "'tokens' must be a list of token ids or a list of such lists",
        )
    };
    v.as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|x| {
            let id = x.as_u64().ok_or_else(bad)?;
            if id as usize >= vocab {
                return Err(ApiError::bad_param(
                    "tokens",
                    format!("'tokens' has token id {id}, outside the vocabulary of {vocab}"),
                ));
            }
            Ok(id as u32)
        })
        .collect()
}

async fn detokenize_inner(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let mut f = request_fields(st, headers, body).await?;
    // A loaded adapter shares the base tokenizer.
    st.checked_model(&mut f)?;
    let skip_special = f.bool("skip_special_tokens")?.unwrap_or(true);
    let tokens = f
        .raw("tokens")
        .ok_or_else(|| ApiError::bad_param("tokens", "'tokens' is required"))?;
    f.finish()?;
    let vocab = st.tokenizer.vocab_size();
    let decode =
        |ids: &[u32]| -> Result<String, ApiError> { Ok(st.tokenizer.decode(ids, skip_special)?) };
    let nested = tokens
        .as_array()
        .is_some_and(|a| !a.is_empty() && a.iter().all(Value::is_array));
    if nested {
        let texts = tokens
            .as_array()
            .into_iter()
            .flatten()
            .map(|l| ids_of(l, vocab).and_then(|ids| decode(&ids)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(json!({ "text": texts }))
    } else {
        Ok(json!({ "text": decode(&ids_of(&tokens, vocab)?)? }))
    }
}
