//! `POST /v1/completions`: OpenAI's legacy completions.
//!
//! `prompt` may be a string, a list of strings (a batch), a list of token
//! ids, or a list of such lists. Choices are prompt-major (`index = prompt *
//! n + sample`). `max_tokens` defaults to 16 as in OpenAI. `logprobs: k`
//! returns the chosen token's log-probability and the `k` best alternatives.
//! `echo` puts the prompt before each choice's text (and, with `logprobs`,
//! the prompt's tokens before the output's, the first with a null
//! logprob); it is refused with `stream`. `suffix` is refused while it asks
//! for something; `best_of` is accepted only when it equals `n` (or is 1).

use super::{Common, check_model, common, token_text, usage};
use crate::error::ApiError;
use crate::fields::{Fields, read_json};
use crate::params::Dialect;
use crate::run::{self, Event, Job, Run, openai_finish_reason};
use crate::sse::{StreamFormat, stream_response};
use crate::state::AppState;
use arbor_engine_core::engine::TokenLogprob;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use std::sync::Arc;

/// Handles `POST /v1/completions`.
pub(crate) async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match inner(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn prompts(st: &AppState, v: Option<Value>) -> Result<Vec<Vec<u32>>, ApiError> {
    let empty = || ApiError::bad_param("prompt", "the prompt is empty");
    let bad = || {
        ApiError::bad_param(
            "prompt",
            "'prompt' must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        )
    };
    let encode = |s: &str| -> Result<Vec<u32>, ApiError> {
        if s.is_empty() {
            return Err(empty());
        }
        Ok(st.tokenizer.encode(s, true)?)
    };
    let ids = |v: &Value| -> Result<Vec<u32>, ApiError> {
        let a = v.as_array().ok_or_else(bad)?;
        if a.is_empty() {
            return Err(empty());
        }
        a.iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(bad)
            })
            .collect()
    };
    match v {
        None => Err(ApiError::bad_param("prompt", "'prompt' is required")),
        Some(Value::String(s)) => Ok(vec![encode(&s)?]),
        Some(Value::Array(a)) => {
            if a.is_empty() {
                return Err(empty());
            }
            if a.iter().all(Value::is_string) {
                a.iter()
                    .map(|s| encode(s.as_str().unwrap_or_default()))
                    .collect()
            } else if a.iter().all(Value::is_array) {
                a.iter().map(ids).collect()
            } else if a.iter().all(Value::is_number) {
                Ok(vec![ids(&Value::Array(a))?])
            } else {
                Err(bad())
            }
        }
        Some(_) => Err(bad()),
    }
}

async fn inner(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    st.check_accepting()?;
    let v = read_json(&headers, body, st.opts.max_request_bytes).await?;
    let mut f = Fields::new(v, "the request body", "")?;
    let lora = check_model(&st, &mut f)?;
    let raw_prompt = f.raw("prompt");
    let echo = f.bool("echo")?.unwrap_or(false);
    // The prompts as the client wrote them, kept only for `echo`.
    let prompt_texts: Vec<Option<String>> = match (&raw_prompt, echo) {
        (Some(Value::String(t)), true) => vec![Some(t.clone())],
        (Some(Value::Array(a)), true) => a.iter().map(|x| x.as_str().map(str::to_string)).collect(),
        _ => Vec::new(),
    };
    let prompts = prompts(&st, raw_prompt)?;
    let Common {
        mut params,
        max_tokens,
        stream,
        include_usage,
        constraint,
        rid,
        priority,
        namespace,
        data_parallel_rank,
        prompt_logprobs,
    } = common(&mut f, Dialect::Completions)?;
    let logprobs = f.int("logprobs", 0, i64::from(u32::MAX))?;
    if echo && stream {
        return Err(ApiError::unsupported("echo", "echo with stream"));
    }
    f.unset_only("suffix", "a suffix (fill-in-the-middle)")?;
    if let Some(b) = f.int("best_of", 1, 128)?
        && b != 1
        && b as usize != params.n
    {
        return Err(ApiError::unsupported("best_of", "best_of other than n"));
    }
    let bootstrap = crate::disagg::bootstrap_fields(&mut f, prompts.len())?;
    f.finish_lenient()?;
    params.max_new_tokens = max_tokens.unwrap_or(16);
    if rid.is_some() && prompts.len() > 1 {
        return Err(ApiError::bad_param(
            "rid",
            "'rid' cannot be given for a batch of prompts",
        ));
    }
    let id = format!("cmpl-{}", rid.clone().unwrap_or_else(|| st.new_id()));
    let jobs: Vec<Job> = prompts
        .into_iter()
        .zip(bootstrap)
        .map(|(ids, bootstrap)| {
            let mut j = Job::new(ids, params.clone());
            j.bootstrap = bootstrap;
            j.constraint = constraint.clone();
            let r = &mut j.req;
            r.rid = rid.clone();
            r.return_logprob = logprobs.is_some();
            r.top_logprobs_num = logprobs.unwrap_or(0) as usize;
            // Echoed with logprobs: the prompt's tokens are scored too.
            r.logprob_start_len = (echo && logprobs.is_some()).then_some(0);
            r.priority = priority;
            r.namespace = namespace.clone();
            r.data_parallel_rank = data_parallel_rank;
            r.lora = lora.clone();
            if let Some(k) = prompt_logprobs {
                super::ask_prompt_logprobs(r, k);
            }
            j
        })
        .collect();
    let prompt_ids: Vec<Vec<u32>> = if echo || prompt_logprobs.is_some() {
        jobs.iter().map(|j| j.req.input_ids.clone()).collect()
    } else {
        Vec::new()
    };
    let mut run = run::submit(&st, jobs, &headers, Dialect::Completions).await?;
    let mut fmt = CompletionFormat {
        state: st.clone(),
        id,
        model: st.response_model(lora.as_deref()),
        created: AppState::now_unix(),
        logprobs: logprobs.is_some(),
        top: logprobs.unwrap_or(0) as usize,
        include_usage,
        offsets: vec![0; run.samples.len()],
    };
    if stream {
        return Ok(stream_response(run, fmt));
    }
    run.finish_all().await;
    if let Some(e) = run.failure() {
        return Err(e);
    }
    let choices: Vec<Value> = run
        .samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut text = s.text.clone();
            let lp = if echo {
                let ids = prompt_ids.get(s.prompt).map_or(&[][..], Vec::as_slice);
                let shown = prompt_texts
                    .get(s.prompt)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| {
                        arbor_engine_core::TokenDecoder::decode(&*st.tokenizer, ids, false)
                            .unwrap_or_default()
                    });
                text = format!("{shown}{text}");
                fmt.logprobs.then(|| fmt.echo_logprob_json(i, ids, s))
            } else {
                fmt.logprobs.then(|| fmt.logprob_json(i, &s.logprobs))
            };
            let prompt_lp = prompt_logprobs.map(|k| {
                let ids = prompt_ids.get(s.prompt).map_or(&[][..], Vec::as_slice);
                super::prompt_logprobs_json(&st, ids, &s.prompt_logprobs, k)
            });
            let mut choice = json!({
                "index": i,
                "text": text,
                "logprobs": lp,
                "finish_reason": s.finish.as_ref().map(openai_finish_reason),
                "matched_stop": s.finish.as_ref().map(run::matched_value),
            });
            if let Some(p) = prompt_lp {
                choice["prompt_logprobs"] = p;
            }
            choice
        })
        .collect();
    Ok(Json(json!({
        "id": fmt.id,
        "object": "text_completion",
        "created": fmt.created,
        "model": fmt.model,
        "choices": choices,
        "usage": usage(&st, &run),
    }))
    .into_response())
}

struct CompletionFormat {
    state: Arc<AppState>,
    id: String,
    /// The `model` of responses: the served name, or `served:adapter`.
    model: String,
    created: u64,
    logprobs: bool,
    /// Alternatives per output token the request asked for (`logprobs`).
    top: usize,
    include_usage: bool,
    /// Per sample: characters of text covered by log-probability entries so far.
    offsets: Vec<usize>,
}

impl CompletionFormat {
    /// OpenAI's completions `logprobs` object for `lps`, continuing sample `i`'s offsets.
    fn logprob_json(&mut self, i: usize, lps: &[TokenLogprob]) -> Value {
        let mut tokens = Vec::new();
        let mut token_logprobs = Vec::new();
        let mut top = Vec::new();
        let mut offsets = Vec::new();
        for l in lps {
            let t = token_text(&self.state, l.token);
            let off = self.offsets.get(i).copied().unwrap_or(0);
            offsets.push(off);
            if let Some(o) = self.offsets.get_mut(i) {
                *o += t.chars().count();
            }
            tokens.push(t);
            token_logprobs.push(l.logprob);
            let mut m = Map::new();
            for &(id, p) in l.top.iter().take(self.top) {
                m.insert(token_text(&self.state, id), json!(p));
            }
            top.push(Value::Object(m));
        }
        json!({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets})
    }

    /// The `logprobs` object of an echoed sample: the prompt's tokens (the
    /// first with a null logprob, as OpenAI and vLLM give it), then the
    /// output's.
    fn echo_logprob_json(&mut self, i: usize, prompt: &[u32], s: &crate::run::Sample) -> Value {
        let Some(&head) = prompt.first() else {
            return self.logprob_json(i, &s.logprobs);
        };
        let head_text = token_text(&self.state, head);
        if let Some(o) = self.offsets.get_mut(i) {
            *o += head_text.chars().count();
        }
        let rest = self.logprob_json(
            i,
            &[s.prompt_logprobs.as_slice(), s.logprobs.as_slice()].concat(),
        );
        let prepend = |key: &str, v: Value| -> Value {
            let mut list = vec![v];
            list.extend(rest[key].as_array().cloned().unwrap_or_default());
            Value::Array(list)
        };
        json!({
            "tokens": prepend("tokens", json!(head_text)),
            "token_logprobs": prepend("token_logprobs", Value::Null),
            "top_logprobs": prepend("top_logprobs", Value::Null),
            "text_offset": prepend("text_offset", json!(0)),
        })
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
        let mut v = json!({
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.include_usage
            && let Some(o) = v.as_object_mut()
        {
            o.insert("usage".into(), usage.unwrap_or(Value::Null));
        }
        v.to_string()
    }
}

impl StreamFormat for CompletionFormat {
    fn event(&mut self, _run: &Run, ev: &Event) -> Vec<String> {
        let c = &ev.chunk;
        if c.text.is_empty() && c.finish.is_none() && (c.logprobs.is_empty() || !self.logprobs) {
            return Vec::new();
        }
        let lp = self
            .logprobs
            .then(|| self.logprob_json(ev.sample, &c.logprobs));
        let choice = json!({
            "index": ev.sample,
            "text": c.text,
            "logprobs": lp,
            "finish_reason": c.finish.as_ref().map(openai_finish_reason),
            "matched_stop": c.finish.as_ref().map(run::matched_value),
        });
        vec![self.chunk(json!([choice]), None)]
    }

    fn end(&mut self, run: &Run) -> Vec<String> {
        if self.include_usage {
            vec![self.chunk(json!([]), Some(usage(&self.state, run)))]
        } else {
            Vec::new()
        }
    }
}
