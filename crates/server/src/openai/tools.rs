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
//!   text is parsed with the server's tool-call parser
//!   (`ServerOptions::tool_call_parser`, [`arbor_chat_parsers::tool_call`];
//!   without one `qwen25`: `<tool_call>{...}</tool_call>` blocks, the format
//!   of Qwen, SmolLM and Hermes-style templates); what is outside the calls
//!   stays the message content. Calls to functions not among the tools are
//!   not calls.
//! - `"none"` ignores the tools.

use crate::constraint::{self, Constraint, ConstraintSpec};
use crate::error::ApiError;
pub(crate) use arbor_chat_parsers::tool_call::{ToolCall, ToolCallParser, ToolSpec as Tool};
use serde_json::{Value, json};

/// What the request allows.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
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

/// The `id` of call `index` of an answer: `call_<answer id>_<index>`, or
/// the one the format fixes (Kimi K2's `functions.NAME:IDX`).
pub(crate) fn call_id(parser: ToolCallParser, answer: &str, name: &str, index: usize) -> String {
    parser
        .call_id(name, index)
        .unwrap_or_else(|| format!("call_{answer}_{index}"))
}

/// OpenAI's `tool_calls` list (ids from [`call_id`]).
pub(crate) fn calls_json(calls: &[ToolCall], answer: &str, parser: ToolCallParser) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(i, c)| {
                json!({"id": call_id(parser, answer, &c.name, i), "type": "function",
                       "function": {"name": c.name, "arguments": c.arguments}})
            })
            .collect(),
    )
}

/// A request's tool choice, the tools its chat template is given, and the
/// parsed tools.
pub(crate) type ToolMode = (Option<ToolChoice>, Option<Value>, Vec<Tool>);

/// The tool mode of a request, the tools its chat template is given and
/// the parsed tools: required and named choices force a call through a
/// grammar (added to `constraint`); auto parses the answer with the
/// server's tool-call parser; none ignores them. A `tool_choice` other than
/// none or auto needs `tools`.
pub(crate) fn tool_mode(
    raw_tools: Option<Value>,
    raw_choice: Option<Value>,
    parallel: bool,
    constraint: &mut Option<ConstraintSpec>,
) -> Result<ToolMode, ApiError> {
    let raw_tools = raw_tools.filter(|t| !crate::fields::is_unset(t));
    let mut tool_list = Vec::new();
    let tool_mode = match &raw_tools {
        Some(t) => {
            let list = parse_tools(t)?;
            let choice = parse_choice(raw_choice.as_ref(), &list)?;
            if let Some(schema) = forcing_schema(&list, &choice, parallel) {
                constraint::set(
                    constraint,
                    ConstraintSpec::new("tools", Constraint::Tools(schema)),
                )?;
            }
            tool_list = list;
            Some(choice)
        }
        None => {
            if let Some(c) = &raw_choice
                && c.as_str() != Some("none")
                && c.as_str() != Some("auto")
                && !c.is_null()
            {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "'tool_choice' needs 'tools'",
                ));
            }
            None
        }
    };
    let template_tools = match (&tool_mode, &raw_tools) {
        (Some(ToolChoice::None), _) | (None, _) => None,
        (Some(_), t) => t.clone(),
    };
    Ok((tool_mode, template_tools, tool_list))
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
        let t = tools();
        let p = ToolCallParser::Qwen25.parse(
            "Let me check.\n<tool_call>\n{\"name\": \"now\", \"arguments\": {}}\n</tool_call>",
            &t,
        );
        assert_eq!(p.content, "Let me check.");
        assert_eq!(p.calls.len(), 1);
        let p = ToolCallParser::Qwen25.parse("no calls <tool_call>{broken</tool_call> here", &t);
        assert!(p.calls.is_empty());
        assert!(p.content.contains("{broken"));
        let ids = calls_json(&p.calls, "x", ToolCallParser::KimiK2);
        assert_eq!(ids, json!([]));
        let c = vec![ToolCall {
            name: "now".into(),
            arguments: "{}".into(),
        }];
        assert_eq!(
            calls_json(&c, "x_0", ToolCallParser::Qwen25)[0]["id"],
            "call_x_0_0"
        );
        assert_eq!(
            calls_json(&c, "x_0", ToolCallParser::KimiK2)[0]["id"],
            "functions.now:0"
        );
    }
}
