//! `POST /v1/chat/completions`: messages rendered through the model's chat
//! template, then generated like a completion.
//!
//! Message `content` may be a string, null, or a list of `{"type": "text"}`
//! parts (joined with newlines); other part types are refused. The prompt is
//! tokenized without adding special tokens (the template writes BOS where the
//! model wants it). `max_completion_tokens` wins over `max_tokens`; without
//! either, the rest of the context is allowed. Streaming sends a first chunk
//! per choice with `delta.role`, then `delta.content` chunks, then a chunk
//! with `finish_reason`, then (with `stream_options.include_usage`) a chunk
//! with empty `choices` and the usage. `tools` and non-text
//! `response_format` go through the constraint gate. With a reasoning parser
//! the `<think>` block goes to `message.reasoning_content` (streamed as
//! `delta.reasoning_content`), unless the request sets `separate_reasoning:
//! false`; `stream_reasoning: false` sends it in one piece when it ends.

use super::answer::{AnswerParser, Pieces, SampleStream};
use super::tools::{self, ToolCallParser, ToolChoice};
use super::{Common, check_model, common, prompt_ids, token_text, usage};
use crate::constraint::ConstraintSpec;
use crate::error::ApiError;
use crate::fields::{Fields, read_json};
use crate::params::Dialect;
use crate::reasoning::ReasoningParser;
use crate::run::{self, Event, Job, Run, openai_finish_reason};
use crate::sse::{StreamFormat, stream_response};
use crate::state::AppState;
use crate::tool_call::StreamItem;
use arbor_engine_core::engine::TokenLogprob;
use arbor_models::{ChatMessage, TemplateVars};
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use std::sync::Arc;

/// Handles `POST /v1/chat/completions`.
pub(crate) async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match inner(st, headers, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

fn content_text(v: Value, name: &str) -> Result<Option<String>, ApiError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.into_iter().enumerate() {
                let pname = format!("{name}[{j}].");
                let mut f = Fields::new(p, &format!("'{name}[{j}]'"), &pname)?;
                let kind = f.string("type")?.unwrap_or_default();
                if kind != "text" {
                    return Err(ApiError::unsupported(
                        &format!("{pname}type"),
                        &format!("content of type '{kind}'"),
                    ));
                }
                texts.push(f.string("text")?.unwrap_or_default());
                f.finish()?;
            }
            Ok(Some(texts.join("\n")))
        }
        _ => Err(ApiError::bad_param(
            name,
            format!("'{name}' must be a string or a list of content parts"),
        )),
    }
}

fn messages(v: Option<Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(Value::Array(list)) = v else {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' is required and must be a list",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "'messages' must not be empty",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.into_iter().enumerate() {
        let prefix = format!("messages[{i}].");
        let mut f = Fields::new(m, &format!("'messages[{i}]'"), &prefix)?;
        let role = f.string("role")?.ok_or_else(|| {
            ApiError::bad_param(
                &format!("{prefix}role"),
                format!("'{prefix}role' is required"),
            )
        })?;
        if !ROLES.contains(&role.as_str()) {
            return Err(ApiError::bad_param(
                &format!("{prefix}role"),
                format!(
                    "'{prefix}role' must be one of {}, got '{role}'",
                    ROLES.join(", ")
                ),
            ));
        }
        let content = match f.raw("content") {
            Some(v) => content_text(v, &format!("{prefix}content"))?,
            None => None,
        };
        let msg = ChatMessage {
            role,
            content,
            tool_calls: f.raw("tool_calls"),
            name: f.string("name")?,
            tool_call_id: f.string("tool_call_id")?,
        };
        f.ignore("reasoning_content");
        f.ignore("refusal");
        f.finish()?;
        out.push(msg);
    }
    Ok(out)
}

async fn inner(st: Arc<AppState>, headers: HeaderMap, body: Body) -> Result<Response, ApiError> {
    st.check_accepting()?;
    let v = read_json(&headers, body, st.opts.max_request_bytes).await?;
    let mut f = Fields::new(v, "the request body", "")?;
    let lora = check_model(&st, &mut f)?;
    let msgs = messages(f.raw("messages"))?;
    let Common {
        mut params,
        max_tokens,
        stream,
        include_usage,
        mut constraint,
        rid,
        priority,
        namespace,
        data_parallel_rank,
        prompt_logprobs,
    } = common(&mut f, Dialect::Chat)?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = f.int("top_logprobs", 0, i64::from(u32::MAX))?.unwrap_or(0) as usize;
    let add_generation_prompt = f.bool("add_generation_prompt")?.unwrap_or(true);
    let template_kwargs = template_kwargs(&mut f)?;
    let (tool_mode, template_tools, tool_list) = tool_mode(&mut f, &mut constraint)?;
    let thinking = thinking_switched_on(&st, template_kwargs.as_ref());
    // SGLang's switches of the reasoning parser (both on by default).
    let separate_reasoning = f.bool("separate_reasoning")?.unwrap_or(true);
    let stream_reasoning = f.bool("stream_reasoning")?.unwrap_or(true);
    refuse_unsupported(&mut f)?;
    let bootstrap = crate::disagg::bootstrap_fields(&mut f, 1)?;
    f.finish_lenient()?;

    let vars = TemplateVars {
        add_generation_prompt,
        bos_token: st.tokenizer.bos_token.as_deref(),
        eos_token: st.tokenizer.eos_token.as_deref(),
        tools: template_tools.as_ref(),
        extra: template_kwargs.as_ref(),
    };
    let ids = prompt_ids(&st, &msgs, &vars)?;
    params.max_new_tokens = match max_tokens {
        Some(m) => m,
        None => st.max_sequence_tokens().saturating_sub(ids.len()).max(1),
    };
    let id = format!("chatcmpl-{}", rid.clone().unwrap_or_else(|| st.new_id()));
    let mut job = Job::new(ids, params);
    let r = &mut job.req;
    r.rid = rid;
    r.return_logprob = logprobs || top_logprobs > 0;
    r.top_logprobs_num = top_logprobs;
    if let Some(k) = prompt_logprobs {
        super::ask_prompt_logprobs(r, k);
    }
    let prompt = prompt_logprobs.map(|_| r.input_ids.clone());
    r.priority = priority;
    r.namespace = namespace;
    r.data_parallel_rank = data_parallel_rank;
    job.constraint = constraint;
    job.bootstrap = bootstrap.into_iter().next().flatten();
    let model = st.response_model(lora.as_deref());
    job.req.lora = lora;
    let mut run = run::submit(&st, vec![job], &headers, Dialect::Chat).await?;
    let fmt = ChatFormat {
        state: st.clone(),
        id,
        model,
        created: AppState::now_unix(),
        logprobs: logprobs || top_logprobs > 0,
        top: top_logprobs,
        include_usage,
        answer: AnswerParser {
            tools: tool_mode.filter(|c| *c != ToolChoice::None),
            tool_parser: st.opts.tool_call_parser.unwrap_or(ToolCallParser::Qwen25),
            tool_list,
            reasoning: st.opts.reasoning_parser.filter(|_| separate_reasoning),
            thinking,
            stream_reasoning,
        },
        samples: Vec::new(),
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
            let (message, finish) =
                fmt.message(i, &s.text, s.finish.as_ref().map(openai_finish_reason));
            json!({
                "index": i,
                "message": message,
                "logprobs": fmt.logprobs.then(|| fmt.logprob_json(&s.logprobs)),
                "finish_reason": finish,
                "matched_stop": s.finish.as_ref().map(run::matched_value),
            })
        })
        .collect();
    let mut body = json!({
        "id": fmt.id,
        "object": "chat.completion",
        "created": fmt.created,
        "model": fmt.model,
        "choices": choices,
        "usage": usage(&st, &run),
    });
    // vLLM puts the prompt's log-probabilities beside the choices.
    if let (Some(k), Some(ids), Some(s)) = (prompt_logprobs, &prompt, run.samples.first()) {
        body["prompt_logprobs"] = super::prompt_logprobs_json(&st, ids, &s.prompt_logprobs, k);
    }
    Ok(Json(body).into_response())
}

/// The tool fields of a chat request ([`tools::tool_mode`]).
fn tool_mode(
    f: &mut Fields,
    constraint: &mut Option<ConstraintSpec>,
) -> Result<tools::ToolMode, ApiError> {
    let raw_tools = f.raw("tools");
    let raw_choice = f.raw("tool_choice");
    let parallel = f.bool("parallel_tool_calls")?.unwrap_or(true);
    tools::tool_mode(raw_tools, raw_choice, parallel, constraint)
}

/// Ignores `reasoning_effort`; refuses the OpenAI fields Arbor does not
/// implement when they are set, and output modalities other than text.
fn refuse_unsupported(f: &mut Fields) -> Result<(), ApiError> {
    f.ignore("reasoning_effort");
    for (k, what) in [
        ("continue_final_message", "continuing the final message"),
        ("functions", "function calling"),
        ("function_call", "function calling"),
        ("audio", "audio output"),
        ("prediction", "predicted outputs"),
        ("web_search_options", "web search"),
    ] {
        f.unset_only(k, what)?;
    }
    if let Some(m) = f.raw("modalities")
        && m != json!(["text"])
    {
        return Err(ApiError::unsupported(
            "modalities",
            "output other than text",
        ));
    }
    Ok(())
}

/// `chat_template_kwargs`: variables the chat template sees beside the
/// standard ones (Qwen3's `enable_thinking`, DeepSeek's `thinking`), as
/// transformers' `apply_chat_template(**kwargs)` passes them.
/// The request's thinking switch in its template kwargs, for the reasoning
/// parser that has one (SGLang: then the answer starts in reasoning).
pub(super) fn thinking_switched_on(
    st: &AppState,
    kwargs: Option<&serde_json::Map<String, Value>>,
) -> bool {
    st.opts
        .reasoning_parser
        .and_then(ReasoningParser::thinking_switch)
        .and_then(|k| kwargs?.get(k)?.as_bool())
        .unwrap_or(false)
}

/// `chat_template_kwargs`: an object of extra template variables (not one
/// the request sets itself); chat's and the Responses API's.
pub(super) fn template_kwargs(
    f: &mut Fields,
) -> Result<Option<serde_json::Map<String, Value>>, ApiError> {
    const KEY: &str = "chat_template_kwargs";
    let Some(v) = f.raw(KEY) else {
        return Ok(None);
    };
    let Value::Object(map) = v else {
        return Err(ApiError::bad_param(
            KEY,
            format!("'{KEY}' must be an object"),
        ));
    };
    if let Some(k) = map
        .keys()
        .find(|k| arbor_models::RESERVED_TEMPLATE_VARS.contains(&k.as_str()))
    {
        return Err(ApiError::bad_param(
            KEY,
            format!(
                "'{KEY}.{k}' is set by the request itself and cannot be passed to the template"
            ),
        ));
    }
    Ok(Some(map))
}

struct ChatFormat {
    state: Arc<AppState>,
    id: String,
    /// The `model` of responses: the served name, or `served:adapter`.
    model: String,
    created: u64,
    logprobs: bool,
    /// Alternatives per output token the request asked for (`top_logprobs`).
    top: usize,
    include_usage: bool,
    /// How answers are taken apart (reasoning, content, tool calls).
    answer: AnswerParser,
    /// Streaming: the incremental parsers of each sample.
    samples: Vec<SampleStream>,
}

/// The deltas of `pieces`: reasoning and content in the first, a new
/// delta whenever content follows calls or calls follow content (so
/// their order survives), OpenAI's `tool_calls` shape for call pieces.
fn deltas(
    parser: ToolCallParser,
    answer: &str,
    pieces: Pieces,
) -> Vec<serde_json::Map<String, Value>> {
    let mut out: Vec<serde_json::Map<String, Value>> = vec![serde_json::Map::new()];
    if !pieces.reasoning.is_empty() {
        out[0].insert("reasoning_content".into(), json!(pieces.reasoning));
    }
    for item in pieces.items {
        let Some(last) = out.last_mut() else { break };
        match item {
            StreamItem::Content(c) => {
                if last.contains_key("tool_calls") {
                    out.push(serde_json::Map::new());
                }
                if let Some(d) = out.last_mut() {
                    let prev = d.get("content").and_then(Value::as_str).unwrap_or("");
                    let joined = format!("{prev}{c}");
                    d.insert("content".into(), json!(joined));
                }
            }
            StreamItem::Call {
                index,
                name,
                arguments_delta,
            } => {
                if last.contains_key("content") {
                    out.push(serde_json::Map::new());
                }
                let call = match name {
                    Some(n) => json!({"index": index,
                        "id": tools::call_id(parser, answer, &n, index),
                        "type": "function",
                        "function": {"name": n, "arguments": arguments_delta}}),
                    None => json!({"index": index, "function": {"arguments": arguments_delta}}),
                };
                if let Some(d) = out.last_mut() {
                    let list = d.entry("tool_calls").or_insert_with(|| json!([]));
                    if let Some(a) = list.as_array_mut() {
                        a.push(call);
                    }
                }
            }
        }
    }
    out
}

impl ChatFormat {
    /// The assistant message for `text`, with the reasoning separated when a
    /// parser is on, tool calls parsed out when tools are in play, and the
    /// finish reason (`tool_calls` when calls were made).
    fn message(
        &self,
        index: usize,
        text: &str,
        finish: Option<&'static str>,
    ) -> (Value, Option<&'static str>) {
        let a = self.answer.parse(text);
        let (mut message, finish) = match &a.calls {
            Some(calls) => (
                json!({"role": "assistant", "content": a.content,
                       "tool_calls": tools::calls_json(calls, &self.answer_id(index), self.answer.tool_parser)}),
                Some("tool_calls"),
            ),
            None => (json!({"role": "assistant", "content": a.content}), finish),
        };
        if self.answer.reasoning.is_some()
            && let Some(o) = message.as_object_mut()
        {
            o.insert("reasoning_content".into(), json!(a.reasoning));
        }
        (message, finish)
    }

    /// The id calls of sample `index` are numbered under.
    fn answer_id(&self, index: usize) -> String {
        format!("{}_{index}", self.id)
    }

    /// The parsers of sample `sample`, made on its first event.
    fn sample(&mut self, sample: usize) -> Option<&mut SampleStream> {
        while self.samples.len() <= sample {
            self.samples.push(self.answer.stream());
        }
        self.samples.get_mut(sample)
    }

    /// A forced call (required or named): parsed from the whole output and
    /// sent when the sample ends.
    fn forced_event(&self, run: &Run, ev: &Event) -> Vec<String> {
        let Some(f) = &ev.chunk.finish else {
            return Vec::new();
        };
        let text = run
            .samples
            .get(ev.sample)
            .map(|s| s.text.as_str())
            .unwrap_or_default();
        let (message, finish) = self.message(ev.sample, text, Some(openai_finish_reason(f)));
        let mut delta = message;
        if let Some(o) = delta.as_object_mut() {
            o.remove("role");
            if let Some(calls) = o.get_mut("tool_calls").and_then(Value::as_array_mut) {
                for (i, call) in calls.iter_mut().enumerate() {
                    if let Some(c) = call.as_object_mut() {
                        c.insert("index".into(), json!(i));
                    }
                }
            }
        }
        let choice = json!({"index": ev.sample, "delta": delta, "logprobs": null,
                            "finish_reason": finish, "matched_stop": run::matched_value(f)});
        vec![self.chunk(json!([choice]), None)]
    }

    fn entry(&self, id: u32, logprob: f32) -> Value {
        let t = token_text(&self.state, id);
        let bytes: Vec<u8> = t.as_bytes().to_vec();
        json!({"token": t, "logprob": logprob, "bytes": bytes})
    }

    /// OpenAI's chat `logprobs` object.
    fn logprob_json(&self, lps: &[TokenLogprob]) -> Value {
        let content: Vec<Value> = lps
            .iter()
            .map(|l| {
                let mut e = self.entry(l.token, l.logprob);
                let top: Vec<Value> = l
                    .top
                    .iter()
                    .take(self.top)
                    .map(|&(t, p)| self.entry(t, p))
                    .collect();
                if let Some(o) = e.as_object_mut() {
                    o.insert("top_logprobs".into(), Value::Array(top));
                }
                e
            })
            .collect();
        json!({"content": content})
    }

    fn chunk(&self, choices: Value, usage: Option<Value>) -> String {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
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

impl StreamFormat for ChatFormat {
    fn start(&mut self, run: &Run) -> Vec<String> {
        (0..run.samples.len())
            .map(|i| {
                let choice = json!({
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": null,
                    "finish_reason": null,
                });
                self.chunk(json!([choice]), None)
            })
            .collect()
    }

    fn event(&mut self, run: &Run, ev: &Event) -> Vec<String> {
        let c = &ev.chunk;
        if self.answer.forced() {
            return self.forced_event(run, ev);
        }
        let Some(s) = self.sample(ev.sample) else {
            return Vec::new();
        };
        let pieces = s.pieces(&c.text, c.finish.is_some());
        let calls_made = s.calls > 0;
        let mut deltas = deltas(self.answer.tool_parser, &self.answer_id(ev.sample), pieces);
        let last = deltas.len() - 1;
        let mut chunks = Vec::new();
        for (k, delta) in deltas.drain(..).enumerate() {
            let first = k == 0;
            let finish = c.finish.as_ref().filter(|_| k == last);
            if delta.is_empty()
                && finish.is_none()
                && (!first || c.logprobs.is_empty() || !self.logprobs)
            {
                continue;
            }
            let reason = finish.map(|f| {
                if calls_made {
                    "tool_calls"
                } else {
                    openai_finish_reason(f)
                }
            });
            let choice = json!({
                "index": ev.sample,
                "delta": Value::Object(delta),
                "logprobs": (self.logprobs && first).then(|| self.logprob_json(&c.logprobs)),
                "finish_reason": reason,
                "matched_stop": finish.map(run::matched_value),
            });
            chunks.push(self.chunk(json!([choice]), None));
        }
        chunks
    }

    fn end(&mut self, run: &Run) -> Vec<String> {
        if self.include_usage {
            vec![self.chunk(json!([]), Some(usage(&self.state, run)))]
        } else {
            Vec::new()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::tools::Tool;

    fn tool_list() -> Vec<Tool> {
        vec![Tool {
            name: "get_weather".into(),
            parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
        }]
    }

    /// Streams `chunks` through a sample's parsers and returns its deltas.
    fn run(
        reasoning: Option<ReasoningParser>,
        parser: ToolCallParser,
        chunks: &[&str],
    ) -> (Vec<Value>, usize) {
        let list = tool_list();
        let mut s = SampleStream::new(reasoning, true, false, Some((parser, &list)));
        let mut out = Vec::new();
        for (k, chunk) in chunks.iter().enumerate() {
            let pieces = s.pieces(chunk, k + 1 == chunks.len());
            out.extend(
                deltas(parser, "chatcmpl-1_0", pieces)
                    .into_iter()
                    .filter(|d| !d.is_empty())
                    .map(Value::Object),
            );
        }
        (out, s.calls)
    }

    #[test]
    fn auto_tools_stream_as_openai_deltas() {
        let (d, calls) = run(
            Some(ReasoningParser::Qwen3),
            ToolCallParser::Qwen25,
            &[
                "<think>need weather</think>Let me check. <tool_",
                "call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
                "\"Paris\"}}\n</tool_call>",
                "",
            ],
        );
        assert_eq!(calls, 1);
        assert_eq!(
            d,
            vec![
                json!({"reasoning_content": "need weather", "content": "Let me check. "}),
                json!({"tool_calls": [{"index": 0, "id": "call_chatcmpl-1_0_0", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": "}}]}),
                json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]}),
            ]
        );
        // Kimi's ids; content after a call in the same piece gets its own delta.
        let (d, _) = run(
            None,
            ToolCallParser::KimiK2,
            &[
                "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>Done.",
            ],
        );
        assert_eq!(
            d,
            vec![
                json!({"tool_calls": [{"index": 0, "id": "functions.get_weather:0", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{}"}}]}),
                json!({"content": "Done."}),
            ]
        );
        // No calls: plain content, and nothing is held but a marker prefix.
        let (d, calls) = run(None, ToolCallParser::Qwen25, &["Hello <tool", "box>"]);
        assert_eq!(calls, 0);
        assert_eq!(
            d,
            vec![
                json!({"content": "Hello "}),
                json!({"content": "<toolbox>"})
            ]
        );
    }
}
