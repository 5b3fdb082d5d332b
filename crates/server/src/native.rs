//! SGLang's native API: `POST /generate`.
//!
//! Request: `text` or `input_ids` (one prompt or a batch), `sampling_params`
//! (one object for all, or one per prompt; SGLang's names; null values mean
//! "default"), `rid`, `stream`, `return_logprob`, `top_logprobs_num`,
//! `token_ids_logprob` (ids whose log-probabilities every scored position
//! reports, as `output_token_ids_logprobs` and `input_token_ids_logprobs`),
//! `logprob_start_len`, `return_text_in_logprobs`, `session_params` (one
//! prompt continuing a session; see `sessions.rs`), `priority`, `extra_key` (per
//! prompt) and `cache_salt` (prefix-cache namespaces: requests with other
//! keys never share cached KV), `lora_path` (a loaded LoRA adapter's name,
//! or one per prompt; see `lora.rs`), `bootstrap_host` / `bootstrap_port` /
//! `bootstrap_room` (SGLang's router in PD mode; see `disagg.rs`). Fields SGLang
//! has and Arbor does not implement yet (`lora_id`, `image_data`, ...) are
//! accepted while they ask for nothing and refused with a 400 naming the
//! field otherwise; unknown fields are refused.
//!
//! Response: `{text, output_ids, meta_info: {id, finish_reason, prompt_tokens,
//! completion_tokens, cached_tokens, e2e_latency, ...}}`, or a list of them
//! for a batch or `n > 1` (prompt-major). Streaming sends one SSE frame per
//! engine chunk with the *cumulative* `text` and `output_ids` and the
//! current `meta_info`, then `data: [DONE]`.

use crate::constraint::ConstraintSpec;
use crate::error::ApiError;
use crate::fields::{Fields, read_json};
use crate::params::{self, Dialect};
use crate::run::{self, Event, Job, Run, Sample};
use crate::sse::{StreamFormat, stream_response};
use crate::state::AppState;
use arbor_engine_core::TokenDecoder;
use arbor_engine_core::engine::{Finish, FinishKind, TokenLogprob};
use arbor_engine_core::{CacheNamespace, SamplingParams};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// A parsed `/generate` request.
struct NativeRequest {
    jobs: Vec<Job>,
    stream: bool,
    /// Answer with a list (batch input or n > 1).
    list: bool,
    text_in_logprobs: bool,
    /// `session_params`, when the request continues a session.
    session: Option<crate::sessions::SessionParams>,
}

/// Handles `POST /generate`.
pub(crate) async fn generate(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match generate_inner(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn generate_inner(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    st.check_accepting()?;
    let v = read_json(&headers, body, st.opts.max_request_bytes).await?;
    let mut req = parse(&st, v)?;
    // A session request runs on its parent's tokens.
    let pending = match (&req.session, req.jobs.first_mut()) {
        (Some(p), Some(job)) => {
            let input = std::mem::take(&mut job.req.input_ids);
            st.sessions.expire(&st.engine);
            let pending = st.sessions.compose(p, input, st.tokenizer.bos_token_id)?;
            job.req.input_ids = pending.prompt.clone();
            // The session keeps its turns cached (released on close or expiry).
            job.req.hold = Some(Arc::from(p.id.as_str()));
            Some(pending)
        }
        _ => None,
    };
    let logprobs = req.jobs.iter().map(|j| j.req.return_logprob).collect();
    let named = req
        .jobs
        .iter()
        .map(|j| j.req.token_ids_logprob.is_some())
        .collect();
    // A prompt scored from position 0: its first token, which has no logprob.
    let heads = req
        .jobs
        .iter()
        .map(|j| {
            (j.req.logprob_start_len == Some(0))
                .then(|| j.req.input_ids.first().copied())
                .flatten()
        })
        .collect();
    let mut run = run::submit(&st, req.jobs, &headers, Dialect::Native).await?;
    if let (Some(p), Some(s)) = (&pending, run.samples.first()) {
        st.sessions.started(&p.session, &s.rid);
    }
    let mut fmt = NativeFormat {
        state: st.clone(),
        list: req.list,
        text_in_logprobs: req.text_in_logprobs,
        logprobs,
        named,
        heads,
        session: pending,
    };
    if req.stream {
        return Ok(stream_response(run, fmt));
    }
    run.finish_all().await;
    fmt.record_session(&run);
    if let Some(e) = run.failure() {
        return Err(e);
    }
    let outs: Vec<Value> = (0..run.samples.len())
        .map(|i| fmt.sample_json(&run.samples[i], i))
        .collect();
    if req.list {
        Ok(Json(Value::Array(outs)).into_response())
    } else {
        Ok(Json(outs.into_iter().next().unwrap_or(Value::Null)).into_response())
    }
}

/// A value given once for all prompts or as a list with one per prompt.
fn per_prompt(
    f: &mut Fields,
    key: &str,
    count: usize,
    batch: bool,
) -> Result<Vec<Option<Value>>, ApiError> {
    match f.raw(key) {
        None => Ok(vec![None; count]),
        Some(Value::Array(a)) if batch || key != "sampling_params" && key != "rid" => {
            if a.len() != count {
                return Err(ApiError::bad_param(
                    key,
                    format!(
                        "'{key}' has {} entries but the batch has {count} prompts",
                        a.len()
                    ),
                ));
            }
            Ok(a.into_iter().map(|v| (!v.is_null()).then_some(v)).collect())
        }
        Some(v) if v.is_array() => Err(ApiError::bad_param(
            key,
            format!("'{key}' is a list but the request has a single prompt"),
        )),
        Some(v) => Ok(vec![Some(v); count]),
    }
}

/// `token_ids_logprob`: one list of ids for every prompt, or (a batch)
/// one list per prompt.
fn named_ids_per_prompt(
    f: &mut Fields,
    count: usize,
    batch: bool,
) -> Result<Vec<Option<Value>>, ApiError> {
    const KEY: &str = "token_ids_logprob";
    match f.raw(KEY) {
        None | Some(Value::Null) => Ok(vec![None; count]),
        Some(Value::Array(a))
            if batch && !a.is_empty() && a.iter().all(|x| x.is_array() || x.is_null()) =>
        {
            if a.len() != count {
                return Err(ApiError::bad_param(
                    KEY,
                    format!(
                        "'{KEY}' has {} lists but the batch has {count} prompts",
                        a.len()
                    ),
                ));
            }
            Ok(a.into_iter().map(|v| (!v.is_null()).then_some(v)).collect())
        }
        Some(v) => Ok(vec![Some(v); count]),
    }
}

fn typed<T: serde::de::DeserializeOwned>(
    key: &str,
    v: Option<Value>,
) -> Result<Option<T>, ApiError> {
    let Some(v) = v else { return Ok(None) };
    let mut f = Fields::new(json!({ key: v }), "value", "")?;
    f.get(key)
}

fn prompts(st: &AppState, f: &mut Fields) -> Result<(Vec<Vec<u32>>, bool), ApiError> {
    let encode = |s: &str| -> Result<Vec<u32>, ApiError> {
        if s.is_empty() {
            return Err(ApiError::bad_param("text", "the prompt is empty"));
        }
        Ok(st.tokenizer.encode(s, true)?)
    };
    let ids_of = |v: &Value| -> Option<Vec<u32>> {
        v.as_array()?
            .iter()
            .map(|x| x.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect()
    };
    match (f.raw("text"), f.raw("input_ids")) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "give either 'text' or 'input_ids', not both",
        )),
        (None, None) => Err(ApiError::bad_request(
            "one of 'text' or 'input_ids' is required",
        )),
        (Some(Value::String(s)), None) => Ok((vec![encode(&s)?], false)),
        (Some(Value::Array(a)), None) => {
            if a.is_empty() {
                return Err(ApiError::bad_param(
                    "text",
                    "'text' must not be an empty list",
                ));
            }
            let mut out = Vec::with_capacity(a.len());
            for x in a {
                let Value::String(s) = x else {
                    return Err(ApiError::bad_param(
                        "text",
                        "'text' must be a string or a list of strings",
                    ));
                };
                out.push(encode(&s)?);
            }
            Ok((out, true))
        }
        (Some(_), None) => Err(ApiError::bad_param(
            "text",
            "'text' must be a string or a list of strings",
        )),
        (None, Some(v)) => {
            let bad = || {
                ApiError::bad_param(
                    "input_ids",
                    "'input_ids' must be a list of token ids or a list of such lists",
                )
            };
            let Value::Array(a) = &v else {
                return Err(bad());
            };
            if a.is_empty() {
                return Err(ApiError::bad_param("input_ids", "the prompt is empty"));
            }
            if a.iter().all(Value::is_array) {
                let out: Option<Vec<Vec<u32>>> = a.iter().map(ids_of).collect();
                Ok((out.ok_or_else(bad)?, true))
            } else {
                Ok((vec![ids_of(&v).ok_or_else(bad)?], false))
            }
        }
    }
}

fn parse(st: &AppState, v: Value) -> Result<NativeRequest, ApiError> {
    let mut f = Fields::new(v, "the request body", "")?;
    let (prompts, batch) = prompts(st, &mut f)?;
    let count = prompts.len();
    let sp = per_prompt(&mut f, "sampling_params", count, batch)?;
    let rids = per_prompt(&mut f, "rid", count, batch)?;
    let extra_keys = per_prompt(&mut f, "extra_key", count, batch)?;
    let cache_salt = f.string("cache_salt")?;
    let lp = per_prompt(&mut f, "return_logprob", count, batch)?;
    let lp_start = per_prompt(&mut f, "logprob_start_len", count, batch)?;
    let top = per_prompt(&mut f, "top_logprobs_num", count, batch)?;
    let named = named_ids_per_prompt(&mut f, count, batch)?;
    let adapters =
        crate::lora::per_prompt_adapters(st, per_prompt(&mut f, "lora_path", count, batch)?)?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let text_in_logprobs = f.bool("return_text_in_logprobs")?.unwrap_or(false);
    let priority = f.int("priority", i64::MIN, i64::MAX)?.unwrap_or(0);
    let dp_rank = crate::fields::data_parallel_rank(&mut f)?;
    f.ignore("log_metrics");
    f.ignore("stream_interval");
    for (k, what) in [
        ("lora_id", "LoRA by id (name the adapter in 'lora_path')"),
        ("image_data", "image input"),
        ("video_data", "video input"),
        ("audio_data", "audio input"),
        ("input_embeds", "embedding input"),
        ("modalities", "multimodal input"),
        ("return_routed_experts", "returning routed experts"),
        ("return_hidden_states", "returning hidden states"),
        ("custom_logit_processor", "custom logit processors"),
    ] {
        f.unset_only(k, what)?;
    }
    let bootstrap = crate::disagg::bootstrap_fields(&mut f, count)?;
    let session = f
        .raw("session_params")
        .filter(|v| !v.is_null())
        .map(crate::sessions::SessionParams::parse)
        .transpose()?;
    if session.is_some() && batch {
        return Err(ApiError::bad_param(
            "session_params",
            "'session_params' takes one prompt, not a batch",
        ));
    }
    f.finish_lenient()?;

    let mut jobs = Vec::with_capacity(count);
    let mut n = None;
    for (i, ids) in prompts.into_iter().enumerate() {
        let (params, constraint) = sampling_params(sp[i].clone())?;
        if *n.get_or_insert(params.n) != params.n {
            return Err(ApiError::bad_param(
                "n",
                "every prompt of a batch must use the same n",
            ));
        }
        let return_logprob = typed::<bool>("return_logprob", lp[i].clone())?.unwrap_or(false);
        // -1 (SGLang's default): the output's log-probabilities only.
        let start = typed::<i64>("logprob_start_len", lp_start[i].clone())?.unwrap_or(-1);
        let top_n = typed::<u32>("top_logprobs_num", top[i].clone())?.unwrap_or(0);
        let mut job = Job::new(ids, params);
        let r = &mut job.req;
        r.rid = typed::<String>("rid", rids[i].clone())?;
        r.return_logprob = return_logprob;
        r.top_logprobs_num = if return_logprob { top_n as usize } else { 0 };
        r.logprob_start_len = (return_logprob && start >= 0).then_some(start as usize);
        r.token_ids_logprob = token_ids(st, named[i].clone())?.filter(|_| return_logprob);
        r.priority = priority;
        let extra_key = typed::<String>("extra_key", extra_keys[i].clone())?;
        r.namespace = CacheNamespace::new(extra_key.as_deref(), cache_salt.as_deref());
        r.lora = adapters[i].clone();
        r.data_parallel_rank = dp_rank;
        job.constraint = constraint;
        job.bootstrap = bootstrap[i].clone();
        jobs.push(job);
    }
    let list = batch || n.unwrap_or(1) > 1;
    if session.is_some() && n.unwrap_or(1) > 1 {
        return Err(ApiError::bad_param(
            "session_params",
            "'session_params' takes one sample (n = 1)",
        ));
    }
    Ok(NativeRequest {
        jobs,
        stream,
        list,
        text_in_logprobs,
        session,
    })
}

/// A prompt's `token_ids_logprob`: a list of token ids of the vocabulary
/// (`None` when absent or null).
fn token_ids(st: &AppState, v: Option<Value>) -> Result<Option<std::sync::Arc<[u32]>>, ApiError> {
    let Some(ids) = typed::<Vec<u32>>("token_ids_logprob", v)? else {
        return Ok(None);
    };
    let vocab = st.tokenizer.vocab_size();
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::bad_param(
            "token_ids_logprob",
            format!("'token_ids_logprob' holds {bad}, outside the vocabulary of {vocab}"),
        ));
    }
    Ok(Some(ids.into()))
}

/// Parses SGLang's `sampling_params` object ([`params::sampling`] in the
/// native dialect; `max_new_tokens` defaults to 128).
pub(crate) fn sampling_params(
    v: Option<Value>,
) -> Result<(SamplingParams, Option<ConstraintSpec>), ApiError> {
    let Some(v) = v else {
        return Ok((SamplingParams::default(), None));
    };
    let mut f = Fields::new(v, "'sampling_params'", "sampling_params.")?;
    let (mut p, max_new_tokens, c) = params::sampling(Dialect::Native, &mut f)?;
    if let Some(m) = max_new_tokens {
        p.max_new_tokens = m;
    }
    f.finish()?;
    Ok((p, c))
}

/// SGLang's `finish_reason` object.
pub(crate) fn finish_json(f: &Finish, completion_tokens: usize) -> Value {
    match f.kind {
        FinishKind::Stop => json!({"type": "stop", "matched": run::matched_value(f)}),
        FinishKind::Length => json!({"type": "length", "length": completion_tokens}),
        FinishKind::Abort => json!({"type": "abort", "message": f.message}),
    }
}

struct NativeFormat {
    state: Arc<AppState>,
    list: bool,
    text_in_logprobs: bool,
    /// Per prompt: whether log-probabilities were asked for.
    logprobs: Vec<bool>,
    /// Per prompt scored from position 0: its first token (listed with a
    /// null logprob, as SGLang does).
    heads: Vec<Option<u32>>,
    /// Per prompt: it named ids (`token_ids_logprob`).
    named: Vec<bool>,
    /// The session the request joins once it finished.
    session: Option<crate::sessions::Pending>,
}

impl NativeFormat {
    fn lp_entry(&self, logprob: f32, id: u32) -> Value {
        self.lp_entry_of(Some(logprob), id)
    }

    /// `[logprob, id, text]` (`logprob` null for a prompt's first token).
    fn lp_entry_of(&self, logprob: Option<f32>, id: u32) -> Value {
        let text = if self.text_in_logprobs {
            self.state
                .tokenizer
                .decode(&[id], false)
                .ok()
                .map(Value::String)
        } else {
            None
        };
        json!([logprob, id, text])
    }

    /// Per position, the named ids' `[logprob, id, text]` entries.
    fn named_lists(&self, lps: &[TokenLogprob]) -> Vec<Value> {
        lps.iter()
            .map(|l| Value::Array(l.ids.iter().map(|&(t, p)| self.lp_entry(p, t)).collect()))
            .collect()
    }

    fn logprob_lists(&self, lps: &[TokenLogprob]) -> (Value, Value) {
        let chosen: Vec<Value> = lps
            .iter()
            .map(|l| self.lp_entry(l.logprob, l.token))
            .collect();
        let top: Vec<Value> = lps
            .iter()
            .map(|l| Value::Array(l.top.iter().map(|&(t, p)| self.lp_entry(p, t)).collect()))
            .collect();
        (Value::Array(chosen), Value::Array(top))
    }

    fn sample_json(&self, s: &Sample, index: usize) -> Value {
        let m = &s.meta;
        let mut meta = json!({
            "id": s.rid,
            "finish_reason": s.finish.as_ref().map(|f| finish_json(f, m.completion_tokens)),
            "prompt_tokens": m.prompt_tokens,
            "completion_tokens": m.completion_tokens,
            "cached_tokens": m.cached_tokens,
            "e2e_latency": m.elapsed,
            "queue_time": m.queue_time,
            "weight_version": self.state.weights().version,
        });
        if let (true, Some(o)) = (m.cached_tokens_host > 0, meta.as_object_mut()) {
            // Which tier served the cached prompt tokens (HiCache).
            o.insert(
                "cached_tokens_details".into(),
                json!({
                    "device": m.cached_tokens.saturating_sub(m.cached_tokens_host),
                    "host": m.cached_tokens_host - m.cached_tokens_storage,
                    "storage": m.cached_tokens_storage,
                }),
            );
        }
        if let (Some(len), Some(o)) = (m.spec_accept_length(), meta.as_object_mut()) {
            o.insert("spec_verify_ct".into(), json!(m.spec_verify_ct));
            o.insert("spec_accept_length".into(), json!(len));
        }
        if self.logprobs.get(s.prompt).copied().unwrap_or(false) {
            let (chosen, top) = self.logprob_lists(&s.logprobs);
            let (mut in_chosen, mut in_top) = (Vec::new(), Vec::new());
            if let Some(Some(head)) = self.heads.get(s.prompt) {
                in_chosen.push(self.lp_entry_of(None, *head));
                in_top.push(Value::Null);
            }
            if let (Value::Array(c), Value::Array(t)) = self.logprob_lists(&s.prompt_logprobs) {
                in_chosen.extend(c);
                in_top.extend(t);
            }
            if let Some(o) = meta.as_object_mut() {
                o.insert("input_token_logprobs".into(), Value::Array(in_chosen));
                o.insert("input_top_logprobs".into(), Value::Array(in_top));
                o.insert("output_token_logprobs".into(), chosen);
                o.insert("output_top_logprobs".into(), top);
                if self.named.get(s.prompt).copied().unwrap_or(false) {
                    let mut input = Vec::new();
                    if let Some(Some(_)) = self.heads.get(s.prompt) {
                        input.push(Value::Null);
                    }
                    input.extend(self.named_lists(&s.prompt_logprobs));
                    o.insert("input_token_ids_logprobs".into(), Value::Array(input));
                    o.insert(
                        "output_token_ids_logprobs".into(),
                        Value::Array(self.named_lists(&s.logprobs)),
                    );
                }
            }
        }
        let mut out = json!({"text": s.text, "output_ids": s.ids, "meta_info": meta});
        if self.list
            && let Some(o) = out.as_object_mut()
        {
            o.insert("index".into(), json!(index));
        }
        out
    }
}

impl NativeFormat {
    /// Adds a finished session request (not an aborted one) to its session.
    fn record_session(&mut self, run: &Run) {
        let (Some(p), Some(s)) = (self.session.take(), run.samples.first()) else {
            return;
        };
        let done = s
            .finish
            .as_ref()
            .is_some_and(|f| f.kind != FinishKind::Abort);
        self.state
            .sessions
            .finished(&p, &s.rid, done.then_some(s.ids.as_slice()));
    }
}

impl StreamFormat for NativeFormat {
    fn event(&mut self, run: &Run, ev: &Event) -> Vec<String> {
        match run.samples.get(ev.sample) {
            Some(s) => vec![self.sample_json(s, ev.sample).to_string()],
            None => Vec::new(),
        }
    }

    fn end(&mut self, run: &Run) -> Vec<String> {
        self.record_session(run);
        Vec::new()
    }
}
