//! OpenAI tool calling: parsing `tools` and `tool_choice`, the grammar that
//! forces a call, and turning generated text back into `tool_calls`.
//!
//! - `tool_choice: "required"` (or `parallel_tool_calls: false` with it) and a
//!   named function become a JSON schema over the call(s): an array of
//!   `{"name": <one of the tools>, "arguments": <its parameters schema>}`
//!   (at least one; at most one without parallel calls), or for a named
//!   function a single such object. Constrained decoding makes every output
//!   parse and validate. As in OpenAI's strict mode, an arguments object whose
//!   schema does not mention `additionalProperties` takes no undeclared keys.
//! - `"auto"` (the default when tools are given) leaves generation free; the
//!   text is scanned afterwards for `<tool_call>{...}</tool_call>` blocks (the
//!   format of Qwen, SmolLM and Hermes-style templates); what is outside them
//!   stays the message content.
//! - `"none"` ignores the tools.

use crate::error::ApiError;
use serde_json::{Value, json};

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Tool {
    pub name: String,
    pub parameters: Value,
}

/// What the request allows.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A call found in the output.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI sends them as a string).
    pub arguments: String,
}

/// Parses OpenAI `tools`.
pub(crate) fn parse_tools(v: &Value) -> Result<Vec<Tool>, ApiError> {
    let Some(list) = v.as_array() else {
        return Err(ApiError::bad_param("tools", "'tools' must be a list"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let bad =
            |m: &str| ApiError::bad_param(&format!("tools[{i}]"), format!("'tools[{i}]' {m}"));
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad("must have type 'function'"));
        }
        let f = t
            .get("function")
            .ok_or_else(|| bad("needs a 'function' object"))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| bad("needs 'function.name'"))?;
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => return Err(bad("'function.parameters' must be a JSON schema object")),
        };
        out.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    if out.is_empty() {
        return Err(ApiError::bad_param("tools", "'tools' must not be empty"));
    }
    Ok(out)
}

/// Parses `tool_choice` (absent: `auto` when tools are given).
pub(crate) fn parse_choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let choice = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    format!(
                        "'tool_choice' must be none, auto, required or a function, got '{other}'"
                    ),
                ));
            }
        },
        Some(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    ApiError::bad_param(
                        "tool_choice",
                        "'tool_choice' must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                    )
                })?;
            ToolChoice::Named(name.to_string())
        }
    };
    if let ToolChoice::Named(n) = &choice
        && !tools.iter().any(|t| &t.name == n)
    {
        return Err(ApiError::bad_param(
            "tool_choice",
            format!("'tool_choice' names '{n}', which is not among the tools"),
        ));
    }
    Ok(choice)
}

fn call_object(t: &Tool) -> Value {
    // As OpenAI's strict mode: arguments hold the declared parameters only,
    // unless the tool's schema says otherwise (keeps small models from
    // wandering into invented keys).
    let mut params = t.parameters.clone();
    if let Some(o) = params.as_object_mut()
        && o.contains_key("properties")
        && !o.contains_key("additionalProperties")
    {
        o.insert("additionalProperties".into(), json!(false));
    }
    json!({
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// The JSON schema a forced call must follow, or `None` when nothing is forced.
pub(crate) fn forcing_schema(
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
) -> Option<String> {
    let schema = match choice {
        ToolChoice::None | ToolChoice::Auto => return None,
        ToolChoice::Named(n) => call_object(tools.iter().find(|t| &t.name == n)?),
        ToolChoice::Required => {
            let items = json!({"anyOf": tools.iter().map(call_object).collect::<Vec<_>>()});
            let mut s = json!({"type": "array", "minItems": 1, "items": items});
            if !parallel {
                s["maxItems"] = json!(1);
            }
            s
        }
    };
    Some(schema.to_string())
}

fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v
        .get("arguments")
        .or_else(|| v.get("parameters"))
        .cloned()
        .unwrap_or(json!({}));
    Some(ToolCall {
        name,
        arguments: args.to_string(),
    })
}

/// Calls in the output of a forced call (`forcing_schema`): an array or one object.
pub(crate) fn parse_forced(text: &str) -> Option<Vec<ToolCall>> {
    match serde_json::from_str::<Value>(text).ok()? {
        Value::Array(a) => a.iter().map(call_of).collect(),
        o @ Value::Object(_) => call_of(&o).map(|c| vec![c]),
        _ => None,
    }
}

/// `<tool_call>{...}</tool_call>` blocks of free text: the calls and the text around them.
pub(crate) fn parse_tagged(text: &str) -> (String, Vec<ToolCall>) {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut calls = Vec::new();
    let mut content = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(OPEN) {
        let after = &rest[i + OPEN.len()..];
        let (body, next) = match after.find(CLOSE) {
            Some(j) => (&after[..j], &after[j + CLOSE.len()..]),
            None => (after, ""),
        };
        match serde_json::from_str::<Value>(body.trim())
            .ok()
            .as_ref()
            .and_then(call_of)
        {
            Some(c) => {
                content.push_str(&rest[..i]);
                calls.push(c);
            }
            None => content.push_str(&rest[..i + OPEN.len() + body.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

/// OpenAI's `tool_calls` list; ids are `call_<request id>_<index>`.
pub(crate) fn calls_json(calls: &[ToolCall], id: &str) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": format!("call_{id}_{i}"), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        parse_tools(&json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "now"}}
        ]))
        .unwrap()
    }

    #[test]
    fn choices_and_schemas() {
        let t = tools();
        assert_eq!(parse_choice(None, &t).unwrap(), ToolChoice::Auto);
        assert_eq!(
            parse_choice(Some(&json!("required")), &t).unwrap(),
            ToolChoice::Required
        );
        let named = json!({"type": "function", "function": {"name": "now"}});
        assert_eq!(
            parse_choice(Some(&named), &t).unwrap(),
            ToolChoice::Named("now".into())
        );
        let e = parse_choice(
            Some(&json!({"type": "function", "function": {"name": "x"}})),
            &t,
        )
        .unwrap_err();
        assert!(e.message.contains("not among the tools"));
        assert!(parse_choice(Some(&json!("sometimes")), &t).is_err());
        assert!(forcing_schema(&t, &ToolChoice::Auto, true).is_none());
        let s: Value =
            serde_json::from_str(&forcing_schema(&t, &ToolChoice::Required, false).unwrap())
                .unwrap();
        assert_eq!(s["maxItems"], 1);
        assert_eq!(
            s["items"]["anyOf"][0]["properties"]["name"]["const"],
            "get_weather"
        );
        assert!(parse_tools(&json!([{"type": "function", "function": {}}])).is_err());
        assert!(parse_tools(&json!([])).is_err());
    }

    #[test]
    fn outputs_become_calls() {
        let calls =
            parse_forced(r#"[{"name":"get_weather","arguments":{"city":"Paris"}}]"#).unwrap();
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments, r#"{"city":"Paris"}"#);
        assert!(parse_forced("not json").is_none());
        let (content, calls) = parse_tagged(
            "Let me check.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        let (content, calls) = parse_tagged("no calls <tool_call>{broken</tool_call> here");
        assert!(calls.is_empty());
        assert!(content.contains("{broken"));
    }
}
