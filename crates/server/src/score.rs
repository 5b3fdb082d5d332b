//! Scoring with a generation model: SGLang's `POST /v1/score` and a
//! `POST /v1/rerank` in Qwen3-Reranker's yes/no form.
//!
//! - `/v1/score`: `query` and `items` (text, or token ids for both), joined
//!   query first (or item first with `item_first`); each joined prompt's
//!   next-token log-probabilities of `label_token_ids` (the request's
//!   `token_ids_logprob` at the first output position) become
//!   probabilities: `exp` of each, or with `apply_softmax` a softmax over
//!   the labels. Answers `{"scores": [[p per label] per item], "model",
//!   "usage", "object": "scoring"}`, as SGLang does.
//! - `/v1/rerank`: `query`, `documents` and an optional `instruct`, each
//!   document put in Qwen3-Reranker's published prompt (its system line,
//!   `<Instruct>`, `<Query>`, `<Document>`, an empty think block); its score
//!   is `P(yes) / (P(yes) + P(no))` at the answer's first token. Answers the
//!   documents best first (`[{"score", "document", "index", "meta_info"}]`,
//!   SGLang's shape), `top_n` of them when given.
//!
//! One sampled token per prompt is computed and thrown away (the scores are
//! those of the raw logits). Bad input is a 400 naming its field.

use crate::error::{ApiError, json_reply};
use crate::fields::request_fields;
use crate::params::Dialect;
use crate::run::{self, Job};
use crate::state::AppState;
use arbor_engine_core::SamplingParams;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

/// Qwen3-Reranker's instruction when the request gives none.
const DEFAULT_INSTRUCT: &str =
    "Given a web search query, retrieve relevant passages that answer the query";
const RERANK_PREFIX: &str = "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n";
const RERANK_SUFFIX: &str = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n";

/// The next-token log-probabilities of `labels` after each prompt, and the
/// prompt tokens.
async fn label_logprobs(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    prompts: Vec<Vec<u32>>,
    labels: &[u32],
) -> Result<(Vec<Vec<f32>>, usize), ApiError> {
    let ids: Arc<[u32]> = labels.into();
    let jobs: Vec<Job> = prompts
        .into_iter()
        .map(|p| {
            let mut j = Job::new(p, SamplingParams::greedy(1));
            j.req.return_logprob = true;
            j.req.token_ids_logprob = Some(ids.clone());
            j
        })
        .collect();
    let mut r = run::submit(st, jobs, headers, Dialect::Native).await?;
    r.finish_all().await;
    if let Some(e) = r.failure() {
        return Err(e);
    }
    let tokens = r.prompt_tokens();
    let out = r
        .samples
        .iter()
        .map(|s| {
            s.logprobs
                .first()
                .map(|l| l.ids.iter().map(|&(_, p)| p).collect())
                .ok_or_else(|| ApiError::internal("the engine returned no log-probabilities"))
        })
        .collect::<Result<_, _>>()?;
    Ok((out, tokens))
}

fn check_ids(st: &AppState, field: &str, ids: &[u32]) -> Result<(), ApiError> {
    let vocab = st.tokenizer.vocab_size();
    match ids.iter().find(|&&t| t as usize >= vocab) {
        Some(bad) => Err(ApiError::bad_param(
            field,
            format!("'{field}' holds {bad}, outside the vocabulary of {vocab}"),
        )),
        None => Ok(()),
    }
}

/// Handles `POST /v1/score`.
pub(crate) async fn score(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(score_inner(&st, &headers, body).await)
}

async fn score_inner(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    st.check_accepting()?;
    let mut f = request_fields(st, headers, body).await?;
    let model = st.checked_model(&mut f)?;
    let query = f
        .raw("query")
        .ok_or_else(|| ApiError::bad_param("query", "'query' is required"))?;
    let items = f
        .raw("items")
        .ok_or_else(|| ApiError::bad_param("items", "'items' is required"))?;
    let labels: Vec<u32> = f
        .raw("label_token_ids")
        .map(serde_json::from_value)
        .transpose()
        .map_err(|_| {
            ApiError::bad_param(
                "label_token_ids",
                "'label_token_ids' must be a list of token ids",
            )
        })?
        .filter(|l: &Vec<u32>| !l.is_empty())
        .ok_or_else(|| {
            ApiError::bad_param(
                "label_token_ids",
                "'label_token_ids' must name at least one token",
            )
        })?;
    check_ids(st, "label_token_ids", &labels)?;
    let softmax = f.bool("apply_softmax")?.unwrap_or(false);
    let item_first = f.bool("item_first")?.unwrap_or(false);
    f.finish()?;
    let join = |q: &[u32], i: &[u32]| -> Vec<u32> {
        if item_first {
            [i, q].concat()
        } else {
            [q, i].concat()
        }
    };
    let prompts: Vec<Vec<u32>> = match (&query, &items) {
        (Value::String(q), Value::String(i)) => vec![text_ids(st, q, i, item_first)?],
        (Value::String(q), Value::Array(list)) if list.iter().all(Value::is_string) => list
            .iter()
            .map(|i| text_ids(st, q, i.as_str().unwrap_or_default(), item_first))
            .collect::<Result<_, _>>()?,
        (Value::Array(_), Value::Array(list)) if list.iter().all(Value::is_array) => {
            let q: Vec<u32> = serde_json::from_value(query.clone())
                .map_err(|_| ApiError::bad_param("query", "'query' must be token ids"))?;
            check_ids(st, "query", &q)?;
            let mut out = Vec::with_capacity(list.len());
            for i in list {
                let i: Vec<u32> = serde_json::from_value(i.clone()).map_err(|_| {
                    ApiError::bad_param("items", "'items' must be lists of token ids")
                })?;
                check_ids(st, "items", &i)?;
                out.push(join(&q, &i));
            }
            out
        }
        _ => {
            return Err(ApiError::bad_param(
                "items",
                "'query' and 'items' must be text (one item or a list) or token ids (a list of lists)",
            ));
        }
    };
    if prompts.is_empty() || prompts.iter().any(Vec::is_empty) {
        return Err(ApiError::bad_param(
            "items",
            "'items' holds nothing to score",
        ));
    }
    let (lps, tokens) = label_logprobs(st, headers, prompts, &labels).await?;
    let scores: Vec<Vec<f32>> = lps
        .into_iter()
        .map(|lp| {
            if softmax {
                let m = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = lp.iter().map(|x| (x - m).exp()).collect();
                let sum: f32 = e.iter().sum();
                e.iter().map(|x| x / sum).collect()
            } else {
                lp.iter().map(|x| x.exp()).collect()
            }
        })
        .collect();
    Ok(json!({
        "scores": scores,
        "model": model.unwrap_or_else(|| st.opts.served_model_name.clone()),
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "object": "scoring",
    }))
}

fn text_ids(st: &AppState, q: &str, i: &str, item_first: bool) -> Result<Vec<u32>, ApiError> {
    let text = if item_first {
        format!("{i}{q}")
    } else {
        format!("{q}{i}")
    };
    Ok(st.tokenizer.encode(&text, true)?)
}

/// Handles `POST /v1/rerank`.
pub(crate) async fn rerank(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(rerank_inner(&st, &headers, body).await)
}

/// A document in Qwen3-Reranker's prompt.
pub(crate) fn rerank_prompt(instruct: &str, query: &str, document: &str) -> String {
    format!(
        "{RERANK_PREFIX}<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {document}{RERANK_SUFFIX}"
    )
}

async fn rerank_inner(
    st: &Arc<AppState>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    st.check_accepting()?;
    let mut f = request_fields(st, headers, body).await?;
    st.checked_model(&mut f)?;
    let query = f
        .string("query")?
        .ok_or_else(|| ApiError::bad_param("query", "'query' is required"))?;
    let documents: Vec<String> = f
        .raw("documents")
        .map(serde_json::from_value)
        .transpose()
        .map_err(|_| ApiError::bad_param("documents", "'documents' must be a list of strings"))?
        .filter(|d: &Vec<String>| !d.is_empty())
        .ok_or_else(|| ApiError::bad_param("documents", "'documents' must hold at least one"))?;
    let instruct = f
        .string("instruct")?
        .unwrap_or_else(|| DEFAULT_INSTRUCT.into());
    let top_n = f.int("top_n", 1, i64::MAX)?.map(|n| n as usize);
    let return_documents = f.bool("return_documents")?.unwrap_or(true);
    f.finish()?;
    let label = |t: &str| {
        st.tokenizer.token_to_id(t).ok_or_else(|| {
            ApiError::bad_request(format!(
                "the model's vocabulary has no '{t}' token: /v1/rerank scores Qwen3-Reranker's yes/no answer"
            ))
        })
    };
    let (yes, no) = (label("yes")?, label("no")?);
    let prompts = documents
        .iter()
        .map(|d| {
            Ok(st
                .tokenizer
                .encode(&rerank_prompt(&instruct, &query, d), false)?)
        })
        .collect::<Result<Vec<_>, ApiError>>()?;
    let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let (lps, _) = label_logprobs(st, headers, prompts, &[yes, no]).await?;
    let mut results: Vec<(usize, f32)> = lps
        .iter()
        .enumerate()
        .map(|(i, lp)| {
            let (y, n) = (lp[0], lp[1]);
            let m = y.max(n);
            let (ey, en) = ((y - m).exp(), (n - m).exp());
            (i, ey / (ey + en))
        })
        .collect();
    results.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    results.truncate(top_n.unwrap_or(results.len()));
    Ok(Value::Array(
        results
            .into_iter()
            .map(|(i, score)| {
                json!({
                    "score": score,
                    "document": return_documents.then(|| documents[i].clone()),
                    "index": i,
                    "meta_info": {"prompt_tokens": lens[i]},
                })
            })
            .collect(),
    ))
}
