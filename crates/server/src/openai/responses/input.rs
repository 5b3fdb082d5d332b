//! A Responses request's conversation and options in chat terms: `input`
//! items become chat messages, flat function tools and `tool_choice`
//! become chat's `tools` and `tool_choice`, and `text.format` becomes a
//! structured-output constraint.
//!
//! Input items: messages (`{role, content}` with `type: "message"` or
//! without a type; content a string or `input_text` / `output_text` /
//! `refusal` parts, joined with newlines), `function_call` items (an
//! assistant message's `tool_calls`; calls right after an assistant
//! message join it) and `function_call_output` items (`tool` messages
//! named after the call they answer). `reasoning` items are dropped, as
//! SGLang drops earlier reasoning. Every other item or part type is
//! refused with a 400 naming it (`input[i].type`,
//! `input[i].content[j].type`). The output items of a response are valid
//! input items, so a stored response's output goes through the same path.

use crate::constraint::{Constraint, ConstraintSpec};
use crate::error::ApiError;
use crate::fields::Fields;
use arbor_models::ChatMessage;
use serde_json::{Value, json};

const ROLES: &[&str] = &["user", "assistant", "system", "developer"];

fn required(f: &mut Fields, key: &str) -> Result<String, ApiError> {
    let name = f.name(key);
    f.string(key)?
        .ok_or_else(|| ApiError::bad_param(&name, format!("'{name}' is required")))
}

/// The text of a message's `content`: a string or a list of text parts.
fn content_text(v: Value, name: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.into_iter().enumerate() {
                let pname = format!("{name}[{j}].");
                let mut f = Fields::new(p, &format!("'{name}[{j}]'"), &pname)?;
                let kind = f.string("type")?.unwrap_or_default();
                let key = match kind.as_str() {
                    "input_text" | "output_text" | "text" => "text",
                    "refusal" => "refusal",
                    other => {
                        return Err(ApiError::unsupported(
                            &format!("{pname}type"),
                            &format!("content of type '{other}'"),
                        ));
                    }
                };
                texts.push(required(&mut f, key)?);
                f.ignore("annotations");
                f.ignore("logprobs");
                f.finish()?;
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::bad_param(
            name,
            format!("'{name}' must be a string or a list of content parts"),
        )),
    }
}

/// One message item.
fn message(mut f: Fields, prefix: &str) -> Result<ChatMessage, ApiError> {
    let role = required(&mut f, "role")?;
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
        None => {
            return Err(ApiError::bad_param(
                &format!("{prefix}content"),
                format!("'{prefix}content' is required"),
            ));
        }
    };
    for k in ["id", "status", "phase"] {
        f.ignore(k);
    }
    f.finish()?;
    Ok(ChatMessage::new(&role, &content))
}

/// Appends `call` to the assistant message that ends `out`, or to a new
/// one (with empty content: templates that show no calls concatenate it).
fn push_call(out: &mut Vec<ChatMessage>, call: Value) {
    let joins = out
        .last()
        .is_some_and(|m| m.role == "assistant" && m.tool_call_id.is_none());
    if !joins {
        out.push(ChatMessage {
            role: "assistant".into(),
            content: Some(String::new()),
            tool_calls: None,
            name: None,
            tool_call_id: None,
        });
    }
    if let Some(m) = out.last_mut() {
        let list = m.tool_calls.get_or_insert_with(|| json!([]));
        if let Some(a) = list.as_array_mut() {
            a.push(call);
        }
    }
}

/// The name of the function whose call `call_id` answers, among `msgs`.
fn call_name(msgs: &[ChatMessage], call_id: &str) -> Option<String> {
    msgs.iter()
        .rev()
        .filter_map(|m| m.tool_calls.as_ref()?.as_array())
        .flatten()
        .find(|c| c["id"] == call_id)
        .and_then(|c| c["function"]["name"].as_str())
        .map(str::to_string)
}

/// The items of a request's `input` as `GET /v1/responses/{id}/input_items`
/// lists them, in order: a string is one user `message` with one
/// `input_text`; a message's string content becomes one `input_text`
/// (`output_text` for the assistant's); an item without an `id` gets
/// `{kind}_{tail}_{i}` (`msg`, `fc`, `fco`, `rs`). `input` was checked by
/// [`push_messages`].
pub(crate) fn input_items(input: &Value, tail: &str) -> Vec<Value> {
    let list = match input {
        Value::String(s) => vec![json!({"role": "user", "content": s})],
        Value::Array(a) => a.clone(),
        _ => Vec::new(),
    };
    list.into_iter()
        .enumerate()
        .filter_map(|(i, item)| {
            let Value::Object(mut o) = item else {
                return None;
            };
            let kind = o
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("message")
                .to_string();
            o.insert("type".into(), json!(kind));
            if kind == "message" {
                let role = o.get("role").and_then(Value::as_str).unwrap_or("user");
                let part = if role == "assistant" {
                    "output_text"
                } else {
                    "input_text"
                };
                if let Some(Value::String(text)) = o.get("content") {
                    let content = json!([{"type": part, "text": text}]);
                    o.insert("content".into(), content);
                }
                o.entry("status").or_insert(json!("completed"));
            }
            let short = match kind.as_str() {
                "message" => "msg",
                "function_call" => "fc",
                "function_call_output" => "fco",
                "reasoning" => "rs",
                _ => "item",
            };
            o.entry("id")
                .or_insert(json!(format!("{short}_{tail}_{i}")));
            Some(Value::Object(o))
        })
        .collect()
}

/// Appends the chat messages of `input` (a string or a list of items) to
/// `out`, which holds the conversation so far (tool messages are named
/// after calls in it). `field` names `input` in errors.
pub(crate) fn push_messages(
    out: &mut Vec<ChatMessage>,
    input: Value,
    field: &str,
) -> Result<(), ApiError> {
    let list = match input {
        Value::String(s) => {
            out.push(ChatMessage::new("user", &s));
            return Ok(());
        }
        Value::Array(a) => a,
        _ => {
            return Err(ApiError::bad_param(
                field,
                format!("'{field}' must be a string or a list of input items"),
            ));
        }
    };
    for (i, item) in list.into_iter().enumerate() {
        let prefix = format!("{field}[{i}].");
        let mut f = Fields::new(item, &format!("'{field}[{i}]'"), &prefix)?;
        let kind = f.string("type")?.unwrap_or_else(|| "message".into());
        match kind.as_str() {
            "message" => out.push(message(f, &prefix)?),
            "function_call" => {
                let call_id = required(&mut f, "call_id")?;
                let name = required(&mut f, "name")?;
                let arguments = required(&mut f, "arguments")?;
                for k in ["id", "status"] {
                    f.ignore(k);
                }
                f.finish()?;
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                push_call(out, call);
            }
            "function_call_output" => {
                let call_id = required(&mut f, "call_id")?;
                let output = match f.raw("output") {
                    Some(v) => content_text(v, &format!("{prefix}output"))?,
                    None => {
                        return Err(ApiError::bad_param(
                            &format!("{prefix}output"),
                            format!("'{prefix}output' is required"),
                        ));
                    }
                };
                for k in ["id", "status"] {
                    f.ignore(k);
                }
                f.finish()?;
                out.push(ChatMessage {
                    role: "tool".into(),
                    content: Some(output),
                    tool_calls: None,
                    name: call_name(out, &call_id),
                    tool_call_id: Some(call_id),
                });
            }
            // Earlier reasoning is not shown to the model again.
            "reasoning" => {}
            other => {
                return Err(ApiError::unsupported(
                    &format!("{prefix}type"),
                    &format!("input items of type '{other}'"),
                ));
            }
        }
    }
    Ok(())
}

/// Responses' flat function tools (`{type: "function", name, description,
/// parameters, strict}`) as chat tools; other tool types are refused
/// naming `tools[i].type`.
pub(crate) fn chat_tools(v: &Value) -> Result<Value, ApiError> {
    let Some(list) = v.as_array() else {
        return Err(ApiError::bad_param("tools", "'tools' must be a list"));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let prefix = format!("tools[{i}].");
        let mut f = Fields::new(t.clone(), &format!("'tools[{i}]'"), &prefix)?;
        let kind = required(&mut f, "type")?;
        if kind != "function" {
            return Err(ApiError::unsupported(
                &format!("{prefix}type"),
                &format!("tools of type '{kind}' (only 'function' tools are)"),
            ));
        }
        let name = required(&mut f, "name")?;
        let mut function = json!({"name": name});
        if let Some(d) = f.string("description")? {
            function["description"] = json!(d);
        }
        if let Some(p) = f.raw("parameters") {
            function["parameters"] = p;
        }
        // Forced calls follow the schema strictly either way.
        f.bool("strict")?;
        f.finish()?;
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Value::Array(out))
}

/// Responses' `tool_choice` as chat's: the strings pass, `{type:
/// "function", name}` becomes `{type: "function", function: {name}}`.
pub(crate) fn chat_tool_choice(v: Value) -> Result<Value, ApiError> {
    if v.is_string() {
        return Ok(v);
    }
    let mut f = Fields::new(v, "'tool_choice'", "tool_choice.")?;
    let kind = required(&mut f, "type")?;
    if kind != "function" {
        return Err(ApiError::unsupported(
            "tool_choice.type",
            &format!("a tool choice of type '{kind}'"),
        ));
    }
    let name = required(&mut f, "name")?;
    f.finish()?;
    Ok(json!({"type": "function", "function": {"name": name}}))
}

/// `text`: `format` (`text`, `json_object`, or `json_schema` with its
/// `name`, `schema`, `strict`, `description` flat in it) and `verbosity`
/// (ignored). Returns the constraint, if any.
pub(crate) fn text_format(v: Value) -> Result<Option<ConstraintSpec>, ApiError> {
    let mut f = Fields::new(v, "'text'", "text.")?;
    f.ignore("verbosity");
    let format = f.raw("format");
    f.finish()?;
    let Some(format) = format else {
        return Ok(None);
    };
    let mut f = Fields::new(format, "'text.format'", "text.format.")?;
    let kind = required(&mut f, "type")?;
    let c = match kind.as_str() {
        "text" => None,
        "json_object" => Some(Constraint::JsonObject),
        "json_schema" => {
            let schema = f.raw("schema").ok_or_else(|| {
                ApiError::bad_param(
                    "text.format.schema",
                    "'text.format.schema' is required with type 'json_schema'",
                )
            })?;
            if !schema.is_object() {
                return Err(ApiError::bad_param(
                    "text.format.schema",
                    "'text.format.schema' must be a JSON schema object",
                ));
            }
            f.string("name")?;
            f.string("description")?;
            f.bool("strict")?;
            Some(Constraint::JsonSchema(schema.to_string()))
        }
        other => {
            return Err(ApiError::bad_param(
                "text.format.type",
                format!(
                    "'text.format.type' must be text, json_object or json_schema, got '{other}'"
                ),
            ));
        }
    };
    f.finish()?;
    Ok(c.map(|c| ConstraintSpec::new("text.format", c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(v: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let mut out = Vec::new();
        push_messages(&mut out, v, "input")?;
        Ok(out)
    }

    #[test]
    fn input_items_become_chat_messages() {
        assert_eq!(
            msgs(json!("Hi")).unwrap(),
            vec![ChatMessage::new("user", "Hi")]
        );
        let m = msgs(json!([
            {"role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Weather"}, {"type": "input_text", "text": "in Paris?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
            {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
             "content": [{"type": "output_text", "text": "Checking.", "annotations": [], "logprobs": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
             "arguments": "{\"city\":\"Paris\"}", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "now", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
        ]))
        .unwrap();
        assert_eq!(m.len(), 5);
        assert_eq!(m[0], ChatMessage::new("developer", "Be brief."));
        assert_eq!(m[1].content.as_deref(), Some("Weather\nin Paris?"));
        assert_eq!(m[2].role, "assistant");
        assert_eq!(m[2].content.as_deref(), Some("Checking."));
        let calls = m[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["id"], "call_1");
        assert_eq!(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
        assert_eq!(calls[1]["function"]["name"], "now");
        assert_eq!(m[3].role, "tool");
        assert_eq!(m[3].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(m[3].name.as_deref(), Some("get_weather"));
        assert_eq!(m[4].content.as_deref(), Some("noon"));
        assert_eq!(m[4].name.as_deref(), Some("now"));
        // A call with no assistant message before it gets its own.
        let m = msgs(json!([{"role": "user", "content": "x"},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
        .unwrap();
        assert_eq!(m[1].content.as_deref(), Some(""));
    }

    #[test]
    fn bad_items_are_refused_by_name() {
        let param = |v: Value| msgs(v).unwrap_err().param.unwrap();
        assert_eq!(param(json!(3)), "input");
        assert_eq!(
            param(json!([{"type": "item_reference", "id": "x"}])),
            "input[0].type"
        );
        assert_eq!(
            param(json!([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}])),
            "input[1].role"
        );
        assert_eq!(
            param(
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
            ),
            "input[0].content[0].type"
        );
        assert_eq!(
            param(json!([{"role": "user", "content": "a", "colour": 1}])),
            "input[0].colour"
        );
        assert_eq!(
            param(json!([{"type": "function_call", "name": "f", "arguments": "{}"}])),
            "input[0].call_id"
        );
    }

    #[test]
    fn tools_and_formats_map_to_chat() {
        let t = chat_tools(
            &json!([{"type": "function", "name": "f", "description": "d",
            "parameters": {"type": "object"}, "strict": true}]),
        )
        .unwrap();
        assert_eq!(
            t,
            json!([{"type": "function", "function": {"name": "f", "description": "d",
                "parameters": {"type": "object"}}}])
        );
        let e = chat_tools(&json!([{"type": "function", "name": "f"}, {"type": "web_search"}]))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tools[1].type"));
        assert_eq!(
            chat_tool_choice(json!({"type": "function", "name": "f"})).unwrap(),
            json!({"type": "function", "function": {"name": "f"}})
        );
        assert_eq!(
            chat_tool_choice(json!("required")).unwrap(),
            json!("required")
        );
        let e = chat_tool_choice(json!({"type": "allowed_tools"})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("tool_choice.type"));
        let c = text_format(json!({"format": {"type": "json_schema", "name": "x",
            "schema": {"type": "object"}, "strict": true}}))
        .unwrap()
        .unwrap();
        assert_eq!(c.field, "text.format");
        assert_eq!(
            c.constraint,
            Constraint::JsonSchema("{\"type\":\"object\"}".into())
        );
        assert!(
            text_format(json!({"format": {"type": "text"}}))
                .unwrap()
                .is_none()
        );
        let e = text_format(json!({"format": {"type": "xml"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text.format.type"));
        let e = text_format(json!({"format": {"type": "json_schema", "name": "x"}})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text.format.schema"));
    }
}
