//! Tag formats with text parameters: `qwen3_coder`
//! (`<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`)
//! and `glm45` (`<tool_call>NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>\n</tool_call>`).
//!
//! The name is certain once its tag (`<function=NAME>`) or line (GLM) is
//! complete. Values are typed by the tool's schema ([`typed_value`]):
//! Qwen3-Coder drops one newline at each end of a value, GLM trims it. The
//! arguments are built as compact JSON, one complete parameter at a time,
//! and closed with `}` when the function ends. A value ends at its closing
//! tag (Qwen3-Coder also at the next `<parameter=` or `</function>`).
//! Blocks where no name can be read stay content up to `</tool_call>`.

use super::ToolSpec;
use super::scan::{CallScan, Region, args_json, param_type, skip_ws, typed_value};
use crate::text::is_tag_prefix;
use serde_json::Value;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAM: &str = "<parameter=";
const PARAM_END: &str = "</parameter>";

/// Not a call: content up to the next `</tool_call>` (or the end).
fn not_a_call(r: &str, calls: Vec<CallScan>, from: usize, eof: bool) -> Region {
    match r.get(from..).and_then(|t| t.find(CLOSE)) {
        Some(j) => Region::closed(calls, from + j + CLOSE.len()),
        None => Region::wait(calls, eof, r.len()),
    }
}

/// The earliest of `tags` in `s`.
fn find_any(s: &str, tags: &[&str]) -> Option<usize> {
    tags.iter().filter_map(|t| s.find(t)).min()
}

/// Qwen3-Coder's parameters in `body` (the function's text after its
/// name tag): the complete ones, typed.
fn coder_params(body: &str, done: bool, name: &str, tools: &[ToolSpec]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(k) = body[pos..].find(PARAM) {
        let key_at = pos + k + PARAM.len();
        let Some(gt) = body[key_at..].find('>') else {
            break;
        };
        let key = body[key_at..key_at + gt].trim().to_string();
        let value_at = key_at + gt + 1;
        let rest = &body[value_at..];
        let (value, next) = match rest.find(PARAM_END) {
            Some(e) if find_any(rest, &[PARAM]).is_none_or(|p| e < p) => {
                (&rest[..e], value_at + e + PARAM_END.len())
            }
            _ => match find_any(rest, &[PARAM, FUNCTION_END]) {
                Some(e) => (&rest[..e], value_at + e),
                None if done => (rest, body.len()),
                None => break,
            },
        };
        let v = value.strip_prefix('\n').unwrap_or(value);
        let v = v.strip_suffix('\n').unwrap_or(v);
        out.push((key.clone(), typed_value(v, param_type(tools, name, &key))));
        pos = next;
    }
    out
}

/// `<tool_call>` with one or more `<function=NAME>` blocks.
pub(super) fn qwen3_coder(r: &str, eof: bool, tools: &[ToolSpec]) -> Region {
    let mut calls = Vec::new();
    let mut i = OPEN.len();
    loop {
        let j = skip_ws(r, i);
        let rest = &r[j..];
        if rest.starts_with(CLOSE) {
            return Region::closed(calls, j + CLOSE.len());
        }
        if rest.is_empty() || (!eof && is_tag_prefix(rest, &[CLOSE, FUNCTION])) {
            return Region::wait(calls, eof, r.len());
        }
        if !rest.starts_with(FUNCTION) {
            return not_a_call(r, calls, j, eof);
        }
        let name_at = j + FUNCTION.len();
        let Some(gt) = r[name_at..].find('>') else {
            return if r[name_at..].contains(['<', '\n']) {
                not_a_call(r, calls, j, eof)
            } else {
                Region::wait(calls, eof, r.len())
            };
        };
        let name = r[name_at..name_at + gt].trim().to_string();
        if name.is_empty() || name.contains(['<', '\n']) {
            return not_a_call(r, calls, j, eof);
        }
        let body_at = name_at + gt + 1;
        // The function ends at </function>, else at </tool_call> or the end.
        let end = r[body_at..].find(FUNCTION_END);
        let area_end = end
            .or_else(|| r[body_at..].find(CLOSE))
            .map(|e| body_at + e);
        let done = area_end.is_some() || eof;
        let body = &r[body_at..area_end.unwrap_or(r.len())];
        let params = coder_params(body, done, &name, tools);
        calls.push(CallScan {
            args: args_json(&params, done),
            name,
        });
        match (end, area_end) {
            (Some(e), _) => i = body_at + e + FUNCTION_END.len(),
            (None, Some(a)) => i = a,
            (None, None) => return Region::wait(calls, eof, r.len()),
        }
    }
}

/// GLM's `<arg_key>`/`<arg_value>` pairs in `body`, the complete ones, typed.
fn glm_params(body: &str, name: &str, tools: &[ToolSpec]) -> Vec<(String, Value)> {
    const KEY: &str = "<arg_key>";
    const KEY_END: &str = "</arg_key>";
    const VALUE: &str = "<arg_value>";
    const VALUE_END: &str = "</arg_value>";
    let mut out = Vec::new();
    let mut pos = 0;
    while let Some(k1) = body[pos..].find(KEY).map(|k| pos + k + KEY.len()) {
        let Some(k2) = body[k1..].find(KEY_END).map(|k| k1 + k) else {
            break;
        };
        let after_key = k2 + KEY_END.len();
        let Some(v1) = body[after_key..]
            .find(VALUE)
            .map(|v| after_key + v + VALUE.len())
        else {
            break;
        };
        let Some(v2) = body[v1..].find(VALUE_END).map(|v| v1 + v) else {
            break;
        };
        let key = body[k1..k2].trim().to_string();
        let raw = body[v1..v2].trim();
        let value = match param_type(tools, name, &key) {
            Some("string") => Value::String(raw.to_string()),
            _ => serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string())),
        };
        out.push((key, value));
        pos = v2 + VALUE_END.len();
    }
    out
}

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_alphanumeric() || matches!(c, '_' | '-' | '.' | ':'))
}

/// `<tool_call>NAME` then `<arg_key>`/`<arg_value>` pairs, `</tool_call>`.
pub(super) fn glm45(r: &str, eof: bool, tools: &[ToolSpec]) -> Region {
    let at = OPEN.len();
    let after = &r[at..];
    let name_end = find_any(after, &["\n", "<arg_key>", CLOSE]);
    let raw_name = &after[..name_end.unwrap_or(after.len())];
    let name = raw_name.trim();
    if name_end.is_none() && !eof {
        // Still reading the name: wait while it can be one.
        return if name.is_empty() || is_name(name) {
            Region::open(Vec::new())
        } else {
            not_a_call(r, Vec::new(), at, eof)
        };
    }
    if !is_name(name) {
        return not_a_call(r, Vec::new(), at, eof);
    }
    let body_at = at + raw_name.len();
    let close = r[body_at..].find(CLOSE).map(|c| body_at + c);
    let done = close.is_some() || eof;
    let body = &r[body_at..close.unwrap_or(r.len())];
    let params = glm_params(body, name, tools);
    let call = CallScan {
        name: name.to_string(),
        args: args_json(&params, done),
    };
    match close {
        Some(c) => Region::closed(vec![call], c + CLOSE.len()),
        None => Region::wait(vec![call], eof, r.len()),
    }
}
