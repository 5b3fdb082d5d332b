//! SGLang's parser routes: the tool-call and reasoning parsers run on a
//! text the client gives, no generation.
//!
//! - `POST /parse_function_call {"text", "tool_call_parser", "tools"}`
//!   answers `{"normal_text", "calls": [{"tool_index", "name",
//!   "parameters"}]}`: `parameters` is the arguments' JSON text, `tool_index`
//!   the called function's position in `tools`. Without calls `normal_text`
//!   is the text unchanged (SGLang's rule), else the text outside the calls,
//!   trimmed. `tools` are OpenAI tools; absent or empty, nothing is a call.
//! - `POST /separate_reasoning {"text", "reasoning_parser"}` answers
//!   `{"text", "reasoning_text"}`.
//!
//! The parser name defaults to the server's own parser when it has one; an
//! unknown name or a bad field is a 400 naming the field.

use crate::error::{ApiError, json_reply};
use crate::fields::{Fields, request_fields};
use crate::openai::tools;
use crate::reasoning::{self, ReasoningParser};
use crate::state::AppState;
use crate::tool_call::ToolCallParser;
use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Value, json};
use std::sync::Arc;

/// The required `text` field.
fn text(f: &mut Fields) -> Result<String, ApiError> {
    f.string("text")?
        .ok_or_else(|| ApiError::bad_param("text", "'text' is required"))
}

/// A parser named by `key`, else the server's, else an error.
fn parser<P: std::str::FromStr>(
    f: &mut Fields,
    key: &str,
    default: Option<P>,
) -> Result<P, ApiError>
where
    P::Err: std::fmt::Display,
{
    match f.string(key)? {
        Some(name) => name
            .parse::<P>()
            .map_err(|e| ApiError::bad_param(key, format!("'{key}': {e}"))),
        None => default.ok_or_else(|| {
            ApiError::bad_param(
                key,
                format!("'{key}' is required (the server has no default)"),
            )
        }),
    }
}

/// Handles `POST /parse_function_call`.
pub(crate) async fn parse_function_call(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(function_call_inner(&st, &headers, body).await)
}

async fn function_call_inner(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let mut f = request_fields(st, headers, body).await?;
    let text = text(&mut f)?;
    let default = st.opts.tool_call_parser.unwrap_or(ToolCallParser::Qwen25);
    let parser: ToolCallParser = parser(&mut f, "tool_call_parser", Some(default))?;
    let tools = match f.raw("tools") {
        None => Vec::new(),
        Some(Value::Array(a)) if a.is_empty() => Vec::new(),
        Some(t) => tools::parse_tools(&t)?,
    };
    f.finish()?;
    let parsed = parser.parse(&text, &tools);
    if parsed.calls.is_empty() {
        return Ok(json!({"normal_text": text, "calls": []}));
    }
    let calls: Vec<Value> = parsed
        .calls
        .iter()
        .map(|c| {
            let index = tools.iter().position(|t| t.name == c.name);
            json!({"tool_index": index, "name": c.name, "parameters": c.arguments})
        })
        .collect();
    Ok(json!({"normal_text": parsed.content, "calls": calls}))
}

/// Handles `POST /separate_reasoning`.
pub(crate) async fn separate_reasoning(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    json_reply(reasoning_inner(&st, &headers, body).await)
}

async fn reasoning_inner(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Value, ApiError> {
    let mut f = request_fields(st, headers, body).await?;
    let text = text(&mut f)?;
    let parser: ReasoningParser = parser(&mut f, "reasoning_parser", st.opts.reasoning_parser)?;
    f.finish()?;
    let parts = reasoning::split(parser, &text);
    Ok(json!({"text": parts.content, "reasoning_text": parts.reasoning}))
}
