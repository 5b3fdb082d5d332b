//! Embeddings of a model served with `--is-embedding`: OpenAI's
//! `POST /v1/embeddings` and SGLang's native `POST /encode`.
//!
//! Each input is one engine request of kind [`RequestKind::Embed`]: its
//! prompt runs through the model (chunked like any prompt) and the final
//! normed hidden states are pooled as the server was told (the checkpoint's
//! sentence-transformers pooling: last token or mean), then L2-normalized.
//! Nothing is sampled. Inputs: a string, a list of strings, a list of token
//! ids, or a list of such lists. `encoding_format` is `float` (the default)
//! or `base64` (little-endian f32, as OpenAI sends it). Bad input is a 400
//! naming its field; a server not started for embeddings refuses with a 400
//! saying so.

use crate::error::{ApiError, json_reply};
use crate::fields::request_fields;
use crate::params::Dialect;
use crate::run::{self, Job};
use crate::state::AppState;
use arbor_engine_core::SamplingParams;
use arbor_engine_core::engine::{Pooling, RequestKind};
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

/// How a model served for embeddings (`--is-embedding`) embeds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingOptions {
    /// How the final normed hidden states are pooled.
    pub pooling: Pooling,
    /// The vectors' length (the model's hidden size).
    pub dimensions: usize,
}

/// One input's token ids, from a string or a list of ids.
fn input_ids(st: &AppState, field: &str, v: &Value) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::bad_param(
            field,
            format!(
                "'{field}' must be a string, a list of strings, token ids or lists of token ids"
            ),
        )
    };
    let ids = match v {
        Value::String(s) => st.tokenizer.encode(s, true)?,
        Value::Array(a) => a
            .iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(bad)
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(bad()),
    };
    if ids.is_empty() {
        return Err(ApiError::bad_param(
            field,
            format!("'{field}' holds an empty input"),
        ));
    }
    Ok(ids)
}

/// The inputs of `v`: one, or a list of them.
fn inputs(st: &AppState, field: &str, v: &Value) -> Result<Vec<Vec<u32>>, ApiError> {
    match v {
        Value::Array(a) if !a.is_empty() && a.iter().all(|x| x.is_string() || x.is_array()) => {
            a.iter().map(|x| input_ids(st, field, x)).collect()
        }
        Value::Array(a) if a.is_empty() => Err(ApiError::bad_param(
            field,
            format!("'{field}' must not be an empty list"),
        )),
        other => Ok(vec![input_ids(st, field, other)?]),
    }
}

/// The pooling of the served model, or the refusal of a generation server.
fn options(st: &AppState) -> Result<EmbeddingOptions, ApiError> {
    st.opts.embedding.ok_or_else(|| {
        ApiError::bad_request(
            "this server serves a generation model; embeddings need a server started with --is-embedding",
        )
    })
}

/// Runs every input as an embedding request: the vectors and the prompt tokens.
async fn embed(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    inputs: Vec<Vec<u32>>,
    pooling: Pooling,
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let jobs: Vec<Job> = inputs
        .into_iter()
        .map(|ids| {
            let mut j = Job::new(ids, SamplingParams::greedy(0));
            j.req.kind = RequestKind::Embed(pooling);
            j
        })
        .collect();
    let mut r = run::submit(st, jobs, headers, Dialect::Native).await?;
    r.finish_all().await;
    if let Some(e) = r.failure() {
        return Err(e);
    }
    let tokens = r.prompt_tokens();
    Ok((r.samples.into_iter().map(|s| s.embedding).collect(), tokens))
}

fn base64_f32(v: &[f32]) -> String {
    const ABC: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for k in 0..4 {
            if k <= c.len() {
                out.push(ABC[((n >> (18 - 6 * k)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Handles `POST /v1/embeddings`.
pub(crate) async fn embeddings(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(embeddings_inner(&st, &headers, body).await)
}

async fn embeddings_inner(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    st.check_accepting()?;
    let mut f = request_fields(st, headers, body).await?;
    let model = st.checked_model(&mut f)?;
    let input = f
        .raw("input")
        .ok_or_else(|| ApiError::bad_param("input", "'input' is required"))?;
    let format = f
        .string("encoding_format")?
        .unwrap_or_else(|| "float".into());
    if format != "float" && format != "base64" {
        return Err(ApiError::bad_param(
            "encoding_format",
            format!("'encoding_format' must be float or base64, got '{format}'"),
        ));
    }
    let opts = options(st)?;
    let hidden = opts.dimensions;
    if let Some(d) = f.int("dimensions", 1, i64::MAX)?
        && d as usize != hidden
    {
        return Err(ApiError::bad_param(
            "dimensions",
            format!("'dimensions' must be the model's {hidden} (no truncated embeddings), got {d}"),
        ));
    }
    f.ignore("user");
    f.finish()?;
    let inputs = inputs(st, "input", &input)?;
    let (vectors, tokens) = embed(st, headers, inputs, opts.pooling).await?;
    let data: Vec<Value> = vectors
        .iter()
        .enumerate()
        .map(|(i, e)| {
            let embedding = if format == "base64" {
                json!(base64_f32(e))
            } else {
                json!(e)
            };
            json!({"object": "embedding", "embedding": embedding, "index": i})
        })
        .collect();
    Ok(json!({
        "object": "list",
        "data": data,
        "model": model.unwrap_or_else(|| st.opts.served_model_name.clone()),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }))
}

/// Handles `POST /encode` (SGLang's native embedding route): `text` or
/// `input_ids`, one or a list; answers `{"embedding", "meta_info"}` (a list
/// of them for a list).
pub(crate) async fn encode(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(encode_inner(&st, &headers, body).await)
}

async fn encode_inner(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    st.check_accepting()?;
    let mut f = request_fields(st, headers, body).await?;
    let (field, input) = match (f.raw("text"), f.raw("input_ids")) {
        (Some(t), None) => ("text", t),
        (None, Some(i)) => ("input_ids", i),
        (Some(_), Some(_)) => {
            return Err(ApiError::bad_param(
                "text",
                "give 'text' or 'input_ids', not both",
            ));
        }
        (None, None) => {
            return Err(ApiError::bad_param(
                "text",
                "'text' or 'input_ids' is required",
            ));
        }
    };
    let batch = matches!(&input, Value::Array(a) if a.iter().all(|x| x.is_string() || x.is_array()) && !a.is_empty());
    f.finish()?;
    let opts = options(st)?;
    let inputs = inputs(st, field, &input)?;
    let lens: Vec<usize> = inputs.iter().map(Vec::len).collect();
    let (vectors, _) = embed(st, headers, inputs, opts.pooling).await?;
    let mut out: Vec<Value> = vectors
        .into_iter()
        .zip(lens)
        .map(|(e, n)| json!({"embedding": e, "meta_info": {"prompt_tokens": n}}))
        .collect();
    Ok(if batch {
        Value::Array(out)
    } else {
        out.pop().unwrap_or(Value::Null)
    })
}

#[cfg(test)]
mod tests {
    use super::base64_f32;

    #[test]
    fn base64_is_little_endian_f32() {
        // 1.0f32 = 00 00 80 3f; 2.0 = 00 00 00 40.
        assert_eq!(base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(base64_f32(&[1.0, 2.0]), "AACAPwAAAEA=");
    }
}
