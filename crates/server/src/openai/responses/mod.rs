//! OpenAI's Responses API: `POST /v1/responses` (streamed or not),
//! `GET /v1/responses/{id}`, `GET /v1/responses/{id}/input_items` and
//! `DELETE /v1/responses/{id}`.
//!
//! A request is a chat request in other words ([`input`]): `instructions`
//! become a system message first, then the conversation of
//! `previous_response_id` (its input and output), then `input`; flat
//! function tools and `text.format` map onto chat's tools and constraint
//! gate. The prompt is rendered through the chat template and generated as
//! one sample (`n` must be 1), and the answer is taken apart by the same
//! [`AnswerParser`] as chat's (reasoning parser, tool-call parser, forced
//! calls), into output items ([`items`]): `reasoning`, `message` with one
//! `output_text`, `function_call`. Streaming sends OpenAI's named events
//! (`event:` and `data:` lines, each with an increasing `sequence_number`),
//! from `response.created` to `response.completed` (or
//! `response.incomplete` when `max_output_tokens` cut the answer,
//! `response.failed`), with no `[DONE]`.
//!
//! `store` defaults to true, as in OpenAI and SGLang: the response and its
//! conversation are kept in a bounded in-memory [`store`] (the newest
//! [`store::CAPACITY`]) for `GET`, `GET .../input_items`, `DELETE` and
//! `previous_response_id`; an unknown id is a 404 naming the field.
//! `background: true` (with `store`, without `stream`) answers at once with
//! the response `in_progress`, stored; a task owns the run and stores its
//! result in every outcome; `POST /v1/responses/{id}/cancel` aborts it
//! (`cancelled`), `DELETE` aborts and forgets it. Unknown fields are refused with a
//! 400 naming them; `reasoning.effort`, `text.verbosity`, `truncation`,
//! `service_tier`, `max_tool_calls`, `prompt_cache_key` and
//! `safety_identifier` are accepted and ignored. Hanging up aborts the
//! engine request (the stream task drops the [`Run`]).

pub(crate) mod input;
pub(crate) mod items;
pub(crate) mod store;

use super::answer::{AnswerParser, Parsed};
use super::tools::{self, ToolCallParser, ToolChoice};
use super::{Common, check_model, common, prompt_ids, token_text};
use crate::constraint;
use crate::error::ApiError;
use crate::fields::{Fields, is_unset, read_json};
use crate::params::Dialect;
use crate::run::{self, Event, Job, Run};
use crate::sse::{StreamFormat, stream_response};
use crate::state::AppState;
use crate::tool_call::StreamItem;
use arbor_engine_core::engine::{AbortCause, FinishKind, TokenLogprob};
use arbor_models::{ChatMessage, TemplateVars};
use axum::Json;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use items::Items;
use serde_json::{Value, json};
use std::sync::Arc;
use store::Stored;

/// The request settings a response object echoes.
#[derive(Clone, Debug)]
struct Echo {
    instructions: Option<String>,
    max_output_tokens: Option<usize>,
    temperature: f32,
    top_p: f32,
    tools: Value,
    tool_choice: Value,
    parallel_tool_calls: bool,
    text: Value,
    store: bool,
    /// Run detached: the POST answers at once and the result is stored.
    background: bool,
    metadata: Value,
    previous_response_id: Option<String>,
    user: Option<String>,
    reasoning: Value,
    top_logprobs: usize,
}

/// A parsed request.
struct Request {
    lora: Option<Arc<arbor_engine_core::LoraAdapter>>,
    /// The prompt's messages (instructions first).
    msgs: Vec<ChatMessage>,
    /// The conversation without instructions (what a stored response keeps).
    history: Vec<ChatMessage>,
    template_tools: Option<Value>,
    common: Common,
    answer: AnswerParser,
    echo: Echo,
    logprobs: bool,
    /// SGLang's `request_id`: the response's id.
    request_id: Option<String>,
    /// `input` as given (for `input_items`).
    input: Value,
    /// `chat_template_kwargs`: extra variables of the chat template.
    template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// The conversation: `(messages, history, instructions,
/// previous_response_id, input as given)`.
type Conversation = (
    Vec<ChatMessage>,
    Vec<ChatMessage>,
    Option<String>,
    Option<String>,
    Value,
);

/// Reads `input`, `instructions` and `previous_response_id`.
fn conversation(st: &AppState, f: &mut Fields) -> Result<Conversation, ApiError> {
    let input = f
        .raw("input")
        .ok_or_else(|| ApiError::bad_param("input", "'input' is required"))?;
    let instructions = f.string("instructions")?;
    let previous = f.string("previous_response_id")?;
    let mut history = match &previous {
        Some(id) => {
            let stored = st.responses.get(id).ok_or_else(|| {
                ApiError::not_found(format!("'previous_response_id': no stored response '{id}'"))
                    .with_param("previous_response_id")
            })?;
            if stored.response["status"] == IN_PROGRESS.0 {
                return Err(ApiError::bad_param(
                    "previous_response_id",
                    format!("response '{id}' is still in progress"),
                ));
            }
            stored.history.clone()
        }
        None => Vec::new(),
    };
    input::push_messages(&mut history, input.clone(), "input")?;
    if history.is_empty() {
        return Err(ApiError::bad_param("input", "'input' must not be empty"));
    }
    let mut msgs = Vec::with_capacity(history.len() + 1);
    if let Some(i) = &instructions {
        msgs.push(ChatMessage::new("system", i));
    }
    msgs.extend(history.iter().cloned());
    Ok((msgs, history, instructions, previous, input))
}

/// `reasoning`: `effort` and `summary` accepted and ignored; the echo.
fn reasoning(f: &mut Fields) -> Result<Value, ApiError> {
    let Some(v) = f.raw("reasoning") else {
        return Ok(json!({"effort": null, "summary": null}));
    };
    let mut r = Fields::new(v, "'reasoning'", "reasoning.")?;
    let effort = r.string("effort")?;
    let summary = r.string("summary")?;
    r.ignore("generate_summary");
    r.finish()?;
    Ok(json!({"effort": effort, "summary": summary}))
}

/// `include`: true when it asks for the output's log-probabilities.
fn include(f: &mut Fields) -> Result<bool, ApiError> {
    let Some(list) = f.get::<Vec<String>>("include")? else {
        return Ok(false);
    };
    let mut logprobs = false;
    for (i, x) in list.iter().enumerate() {
        match x.as_str() {
            "message.output_text.logprobs" => logprobs = true,
            // Nothing is encrypted here: there is nothing to include.
            "reasoning.encrypted_content" => {}
            other => {
                return Err(ApiError::unsupported(
                    &format!("include[{i}]"),
                    &format!("including '{other}'"),
                ));
            }
        }
    }
    Ok(logprobs)
}

/// Reads the fields the Responses API has beside chat's (before
/// [`common`], which reads the sampling fields).
fn parse(st: &AppState, f: &mut Fields) -> Result<Request, ApiError> {
    let lora = check_model(st, f)?;
    let (msgs, history, instructions, previous_response_id, input) = conversation(st, f)?;
    let store = f.bool("store")?.unwrap_or(true);
    let metadata = f.raw("metadata").unwrap_or_else(|| json!({}));
    if !metadata.is_object() {
        return Err(ApiError::bad_param(
            "metadata",
            "'metadata' must be an object",
        ));
    }
    let user = f.string("user")?;
    if let Some(v) = f.raw("stream_options") {
        let mut so = Fields::new(v, "'stream_options'", "stream_options.")?;
        so.bool("include_obfuscation")?;
        so.finish()?;
    }
    let text = f.raw("text");
    let text_constraint = text.clone().map(input::text_format).transpose()?.flatten();
    let mut text = text.unwrap_or_else(|| json!({}));
    if text.get("format").is_none_or(Value::is_null) {
        text["format"] = json!({"type": "text"});
    }
    let raw_tools = f.raw("tools").filter(|t| !is_unset(t));
    let raw_choice = f.raw("tool_choice");
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let reasoning = reasoning(f)?;
    let template_kwargs = super::chat::template_kwargs(f)?;
    let include_logprobs = include(f)?;
    let top_logprobs = f.int("top_logprobs", 0, 20)?.unwrap_or(0) as usize;
    let request_id = f.string("request_id")?;
    f.string("truncation")?;
    for k in [
        "max_tool_calls",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
    ] {
        f.ignore(k);
    }
    let background = f.bool("background")?.unwrap_or(false);
    for (k, what) in [
        ("conversation", "conversations"),
        ("prompt", "prompt templates"),
    ] {
        f.unset_only(k, what)?;
    }
    let mut common = common(f, Dialect::Responses)?;
    if background && !store {
        return Err(ApiError::bad_param(
            "background",
            "'background' needs 'store' (the result is read back by its id)",
        ));
    }
    if background && common.stream {
        return Err(ApiError::unsupported(
            "background",
            "background with stream",
        ));
    }
    if common.params.n > 1 {
        return Err(ApiError::bad_param(
            "n",
            "'n' must be 1: a response holds one answer",
        ));
    }
    if let Some(c) = text_constraint {
        constraint::set(&mut common.constraint, c)?;
    }
    let chat_tools = raw_tools.as_ref().map(input::chat_tools).transpose()?;
    let chat_choice = raw_choice
        .clone()
        .map(input::chat_tool_choice)
        .transpose()?;
    let (mode, template_tools, tool_list) =
        tools::tool_mode(chat_tools, chat_choice, parallel, &mut common.constraint)?;
    let echo = Echo {
        instructions,
        max_output_tokens: common.max_tokens,
        temperature: common.params.temperature,
        top_p: common.params.top_p,
        tools: raw_tools.unwrap_or_else(|| json!([])),
        tool_choice: raw_choice.unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: parallel,
        text,
        store,
        background,
        metadata,
        previous_response_id,
        user,
        reasoning,
        top_logprobs,
    };
    let answer = AnswerParser {
        tools: mode.filter(|c| *c != ToolChoice::None),
        tool_parser: st.opts.tool_call_parser.unwrap_or(ToolCallParser::Qwen25),
        tool_list,
        reasoning: st.opts.reasoning_parser,
        thinking: super::chat::thinking_switched_on(st, template_kwargs.as_ref()),
        stream_reasoning: true,
    };
    Ok(Request {
        lora,
        msgs,
        history,
        template_tools,
        common,
        answer,
        echo,
        logprobs: include_logprobs || top_logprobs > 0,
        request_id,
        input,
        template_kwargs,
    })
}

/// Handles `POST /v1/responses`.
pub(crate) async fn create(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match create_inner(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn create_inner(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    st.check_accepting()?;
    let v = read_json(&headers, body, st.opts.max_request_bytes).await?;
    let mut f = Fields::new(v, "the request body", "")?;
    let rq = parse(&st, &mut f)?;
    f.finish_lenient()?;
    let vars = TemplateVars {
        add_generation_prompt: true,
        bos_token: st.tokenizer.bos_token.as_deref(),
        eos_token: st.tokenizer.eos_token.as_deref(),
        tools: rq.template_tools.as_ref(),
        extra: rq.template_kwargs.as_ref(),
    };
    let ids = prompt_ids(&st, &rq.msgs, &vars)?;
    let Common {
        mut params,
        max_tokens,
        stream,
        constraint,
        rid,
        priority,
        namespace,
        data_parallel_rank,
        ..
    } = rq.common;
    params.max_new_tokens = match max_tokens {
        Some(m) => m,
        None => st.max_sequence_tokens().saturating_sub(ids.len()).max(1),
    };
    let id = rq
        .request_id
        .unwrap_or_else(|| format!("resp_{}", st.new_id()));
    let mut job = Job::new(ids, params);
    let r = &mut job.req;
    let engine_rid = rid.unwrap_or_else(|| id.clone());
    r.rid = Some(engine_rid.clone());
    r.return_logprob = rq.logprobs;
    r.top_logprobs_num = rq.echo.top_logprobs;
    r.priority = priority;
    r.namespace = namespace;
    r.data_parallel_rank = data_parallel_rank;
    job.constraint = constraint;
    let model = st.response_model(rq.lora.as_deref());
    job.req.lora = rq.lora;
    let mut run = run::submit(&st, vec![job], &headers, Dialect::Responses).await?;
    let tail = id.strip_prefix("resp_").unwrap_or(&id).to_string();
    let mut fmt = ResponsesFormat {
        state: st.clone(),
        id,
        created_at: AppState::now_unix(),
        model,
        echo: rq.echo,
        answer: rq.answer,
        logprobs: rq.logprobs,
        history: rq.history,
        input_items: input::input_items(&rq.input, &tail),
        rid: engine_rid,
        items: Items::new(&tail),
        stream: None,
        sequence: 0,
    };
    if stream {
        return Ok(stream_response(run, fmt));
    }
    if fmt.echo.background {
        // Stored as in progress now; the task stores the result (and owns
        // the run: the server's end aborts it).
        let pending = fmt.response(&IN_PROGRESS, Vec::new(), Value::Null);
        st.responses.insert(
            &fmt.id,
            Stored {
                response: pending.clone(),
                history: Vec::new(),
                input_items: fmt.input_items.clone(),
                rid: fmt.rid.clone(),
            },
        );
        tokio::spawn(async move {
            run.finish_all().await;
            fmt.complete(&run);
        });
        return Ok(Json(pending).into_response());
    }
    run.finish_all().await;
    if let Some(e) = run.failure() {
        return Err(e);
    }
    Ok(Json(fmt.complete(&run)).into_response())
}

/// The outcome of a response still running.
const IN_PROGRESS: Outcome = ("in_progress", Value::Null, Value::Null);

/// Handles `POST /v1/responses/{id}/cancel`: aborts a background response
/// still in progress and answers it as stored once it stopped
/// (`cancelled`; a response that had finished is answered as it is).
pub(crate) async fn cancel(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    let Some(stored) = st.responses.get(&id) else {
        return unknown(&id);
    };
    if stored.response["background"] != true {
        return ApiError::bad_param("response_id", "only a background response can be cancelled")
            .into_response();
    }
    if stored.response["status"] == IN_PROGRESS.0 {
        st.engine.abort(&stored.rid);
    }
    for _ in 0..400 {
        match st.responses.get(&id) {
            Some(s) if s.response["status"] != IN_PROGRESS.0 => {
                return Json(s.response.clone()).into_response();
            }
            Some(_) => tokio::time::sleep(std::time::Duration::from_millis(25)).await,
            None => return unknown(&id),
        }
    }
    ApiError::unavailable(format!("response '{id}' did not stop within 10 s")).into_response()
}

/// Handles `GET /v1/responses/{id}`.
pub(crate) async fn retrieve(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    match st.responses.get(&id) {
        Some(s) => Json(s.response.clone()).into_response(),
        None => unknown(&id),
    }
}

/// Handles `DELETE /v1/responses/{id}`.
pub(crate) async fn delete(State(st): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    // A background response still running stops (and is not stored again).
    if let Some(s) = st.responses.get(&id)
        && s.response["status"] == IN_PROGRESS.0
    {
        st.engine.abort(&s.rid);
    }
    if st.responses.remove(&id) {
        Json(json!({"id": id, "object": "response.deleted", "deleted": true})).into_response()
    } else {
        unknown(&id)
    }
}

/// Handles `GET /v1/responses/{id}/input_items?limit&order&after`: the
/// stored response's input items as OpenAI lists them (`order` `desc` by
/// default, `limit` 1 to 100, 20 by default, `after` an item id of the
/// list), `{"object": "list", "data", "first_id", "last_id", "has_more"}`.
pub(crate) async fn input_items(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<std::collections::HashMap<String, String>>,
) -> Response {
    let Some(stored) = st.responses.get(&id) else {
        return unknown(&id);
    };
    match list_items(&stored.input_items, &q) {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// One page of `items` by the query's `limit`, `order` and `after`.
fn list_items(
    items: &[Value],
    q: &std::collections::HashMap<String, String>,
) -> Result<Value, ApiError> {
    for k in q.keys() {
        if !matches!(k.as_str(), "limit" | "order" | "after" | "include") {
            return Err(ApiError::bad_param(
                k,
                format!("unknown query parameter '{k}'"),
            ));
        }
    }
    let limit = match q.get("limit") {
        None => 20,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| {
                ApiError::bad_param("limit", format!("'limit' must be 1 to 100, got '{l}'"))
            })?,
    };
    let mut ordered: Vec<&Value> = items.iter().collect();
    match q.get("order").map(String::as_str) {
        None | Some("desc") => ordered.reverse(),
        Some("asc") => {}
        Some(o) => {
            return Err(ApiError::bad_param(
                "order",
                format!("'order' must be \"asc\" or \"desc\", got '{o}'"),
            ));
        }
    }
    let start = match q.get("after") {
        None => 0,
        Some(a) => {
            ordered
                .iter()
                .position(|i| i["id"] == a.as_str())
                .ok_or_else(|| {
                    ApiError::bad_param("after", format!("no input item '{a}' in this response"))
                })?
                + 1
        }
    };
    let page: Vec<Value> = ordered
        .iter()
        .skip(start)
        .take(limit)
        .map(|v| (*v).clone())
        .collect();
    Ok(json!({
        "object": "list",
        "data": page,
        "first_id": page.first().map(|i| i["id"].clone()),
        "last_id": page.last().map(|i| i["id"].clone()),
        "has_more": start + page.len() < ordered.len(),
    }))
}

fn unknown(id: &str) -> Response {
    ApiError::not_found(format!("no stored response '{id}'"))
        .with_param("response_id")
        .into_response()
}

/// Shapes a run into a response object, streamed or whole.
struct ResponsesFormat {
    state: Arc<AppState>,
    id: String,
    created_at: u64,
    model: String,
    echo: Echo,
    answer: AnswerParser,
    logprobs: bool,
    history: Vec<ChatMessage>,
    /// The request's input items (kept with a stored response).
    input_items: Vec<Value>,
    /// The engine request's id (what cancelling aborts).
    rid: String,
    items: Items,
    /// Streaming: the answer's incremental parsers (made at the start).
    stream: Option<super::answer::SampleStream>,
    /// The next event's `sequence_number`.
    sequence: u64,
}

/// A response's outcome: status, `incomplete_details`, `error`.
type Outcome = (&'static str, Value, Value);

impl ResponsesFormat {
    /// OpenAI's log-probability entries of `lps`.
    fn logprob_entries(&self, lps: &[TokenLogprob]) -> Vec<Value> {
        if !self.logprobs {
            return Vec::new();
        }
        let entry = |id: u32, logprob: f32| {
            let t = token_text(&self.state, id);
            json!({"token": t, "bytes": t.as_bytes(), "logprob": logprob})
        };
        lps.iter()
            .map(|l| {
                let mut e = entry(l.token, l.logprob);
                let top: Vec<Value> = l.top.iter().map(|&(t, p)| entry(t, p)).collect();
                e["top_logprobs"] = Value::Array(top);
                e
            })
            .collect()
    }

    /// The id of call `index` of the answer.
    fn call_id(&self, name: &str, index: usize) -> String {
        tools::call_id(self.answer.tool_parser, &self.id, name, index)
    }

    /// A whole answer into items; their events.
    fn whole(&mut self, text: &str) -> Vec<Value> {
        let Parsed {
            reasoning,
            content,
            calls,
        } = self.answer.parse(text);
        let mut ev = self.items.reasoning(reasoning.as_deref().unwrap_or(""));
        ev.extend(self.items.text(content.as_deref().unwrap_or("")));
        for (i, c) in calls.unwrap_or_default().into_iter().enumerate() {
            let call_id = self.call_id(&c.name, i);
            ev.extend(self.items.call(call_id, c.name, &c.arguments));
        }
        ev
    }

    /// The run's outcome.
    fn outcome(run: &Run) -> Outcome {
        let Some(f) = run.samples.first().and_then(|s| s.finish.as_ref()) else {
            return (
                "failed",
                Value::Null,
                json!({"code": "server_error", "message": "the answer did not finish"}),
            );
        };
        match (f.kind, f.cause) {
            (FinishKind::Stop, _) => ("completed", Value::Null, Value::Null),
            (FinishKind::Length, _) => (
                "incomplete",
                json!({"reason": "max_output_tokens"}),
                Value::Null,
            ),
            (FinishKind::Abort, Some(AbortCause::Requested)) => {
                ("cancelled", Value::Null, Value::Null)
            }
            (FinishKind::Abort, _) => {
                let msg = f.message.clone().unwrap_or_else(|| "aborted".into());
                (
                    "failed",
                    Value::Null,
                    json!({"code": "server_error", "message": msg}),
                )
            }
        }
    }

    /// Responses' `usage`.
    fn usage(&self, run: &Run) -> Value {
        let input = run.prompt_tokens();
        let output = run.completion_tokens();
        let reasoning = self.items.reasoning_text();
        let reasoning_tokens = if reasoning.is_empty() {
            0
        } else {
            let n = self
                .state
                .tokenizer
                .encode(&reasoning, false)
                .map_or(0, |t| t.len());
            n.min(output)
        };
        let cached = if self.state.opts.enable_cache_report {
            run.cached_tokens()
        } else {
            0
        };
        json!({
            "input_tokens": input,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input + output,
        })
    }

    /// The response object.
    fn response(&self, outcome: &Outcome, output: Vec<Value>, usage: Value) -> Value {
        let (status, incomplete, error) = outcome;
        let e = &self.echo;
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": e.background,
            "completed_at": (*status == "completed").then(AppState::now_unix),
            "error": error,
            "incomplete_details": incomplete,
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "max_tool_calls": null,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": e.previous_response_id,
            "reasoning": e.reasoning,
            "service_tier": "default",
            "store": e.store,
            "temperature": e.temperature,
            "text": e.text,
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_logprobs": e.top_logprobs,
            "top_p": e.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": e.user,
            "metadata": e.metadata,
        })
    }

    /// The response object of a finished run (not streamed).
    fn complete(&mut self, run: &Run) -> Value {
        if let Some(s) = run.samples.first() {
            let text = s.text.clone();
            let lps = self.logprob_entries(&s.logprobs);
            self.items.logprobs(lps);
            self.whole(&text);
        }
        self.finish(run).1
    }

    /// Ends the answer: the items' last events and the response object
    /// (kept in the store when asked and the answer finished).
    fn finish(&mut self, run: &Run) -> (Vec<Value>, Value) {
        let outcome = Self::outcome(run);
        let item_status = if outcome.0 == "completed" {
            "completed"
        } else {
            "incomplete"
        };
        let ev = self.items.finish(item_status);
        let output = self.items.output();
        let response = self.response(&outcome, output.clone(), self.usage(run));
        let finished = matches!(outcome.0, "completed" | "incomplete");
        // A background response is stored in every outcome, unless it was
        // deleted while it ran.
        let background = self.echo.background && self.state.responses.get(&self.id).is_some();
        if self.echo.store && (finished || background) {
            let mut history = std::mem::take(&mut self.history);
            if input::push_messages(&mut history, Value::Array(output), "output").is_ok()
                || background
            {
                self.state.responses.insert(
                    &self.id,
                    Stored {
                        response: response.clone(),
                        history,
                        input_items: std::mem::take(&mut self.input_items),
                        rid: self.rid.clone(),
                    },
                );
            }
        }
        (ev, response)
    }

    /// One event as an SSE payload (`event:` and `data:` lines).
    fn payload(&mut self, mut ev: Value) -> String {
        ev["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        let kind = ev["type"].as_str().unwrap_or("message").to_string();
        format!("event: {kind}\ndata: {ev}")
    }

    fn payloads(&mut self, events: Vec<Value>) -> Vec<String> {
        events.into_iter().map(|e| self.payload(e)).collect()
    }

    /// The items of streamed pieces.
    /// The parsers are dropped once flushed (`finish`).
    fn streamed(&mut self, text: &str, finish: bool) -> Vec<Value> {
        let Some(s) = self.stream.as_mut() else {
            return Vec::new();
        };
        let pieces = s.pieces(text, finish);
        if finish {
            self.stream = None;
        }
        let mut ev = self.items.reasoning(&pieces.reasoning);
        for item in pieces.items {
            match item {
                StreamItem::Content(c) => ev.extend(self.items.text(&c)),
                StreamItem::Call {
                    index,
                    name: Some(name),
                    arguments_delta,
                } => {
                    let call_id = self.call_id(&name, index);
                    ev.extend(self.items.call(call_id, name, &arguments_delta));
                }
                StreamItem::Call {
                    name: None,
                    arguments_delta,
                    ..
                } => ev.extend(self.items.arguments(&arguments_delta)),
            }
        }
        ev
    }
}

impl StreamFormat for ResponsesFormat {
    fn start(&mut self, _run: &Run) -> Vec<String> {
        self.stream = Some(self.answer.stream());
        let shell = self.response(
            &("in_progress", Value::Null, Value::Null),
            Vec::new(),
            Value::Null,
        );
        let created = json!({"type": "response.created", "response": shell});
        let progress = json!({"type": "response.in_progress", "response": shell});
        self.payloads(vec![created, progress])
    }

    fn event(&mut self, run: &Run, ev: &Event) -> Vec<String> {
        let c = &ev.chunk;
        let lps = self.logprob_entries(&c.logprobs);
        self.items.logprobs(lps);
        let events = if self.answer.forced() {
            match (&c.finish, run.samples.get(ev.sample)) {
                (Some(_), Some(s)) => {
                    let text = s.text.clone();
                    self.whole(&text)
                }
                _ => Vec::new(),
            }
        } else {
            self.streamed(&c.text, c.finish.is_some())
        };
        self.payloads(events)
    }

    fn end(&mut self, run: &Run) -> Vec<String> {
        // A sample ended without a last chunk (the engine dropped it): flush.
        let mut events = self.streamed("", true);
        let (done, response) = self.finish(run);
        events.extend(done);
        let kind = match response["status"].as_str() {
            Some("completed") => "response.completed",
            Some("incomplete") => "response.incomplete",
            _ => "response.failed",
        };
        events.push(json!({"type": kind, "response": response}));
        self.payloads(events)
    }

    fn frame(&self, payload: &str) -> Bytes {
        Bytes::from(format!("{payload}\n\n"))
    }

    fn done(&self) -> Option<&'static str> {
        None
    }
}
