//! JSON call formats: `qwen25` (`<tool_call>{..}</tool_call>`, one call per
//! block, or a JSON list of calls in one block as SGLang reads it), `llama3` (`<|python_tag|>{..}; {..}`, or an answer starting with
//! `{`) and `mistral` (`[TOOL_CALLS] [{..}, {..}]`).
//!
//! Each call is a `{"name": .., "arguments" | "parameters": ..}` object; the
//! name is certain once its string is complete; the arguments are the
//! value's text as written (`{}` when absent). A block whose first object
//! is broken before its name stays content: for `qwen25` up to its
//! `</tool_call>`, for the others only the marker (the rest is read again).

use super::scan::{CallScan, Region, Val, call_object, skip_ws};
use crate::text::is_tag_prefix;

const QWEN_OPEN: &str = "<tool_call>";
const QWEN_CLOSE: &str = "</tool_call>";

/// Where the block ends when it is cut at `from`: after the next
/// `</tool_call>`, or at the end of the text.
fn qwen_close(r: &str, from: usize, calls: Vec<CallScan>, eof: bool) -> Region {
    match r.get(from..).and_then(|t| t.find(QWEN_CLOSE)) {
        Some(j) => Region::closed(calls, from + j + QWEN_CLOSE.len()),
        None => Region::wait(calls, eof, r.len()),
    }
}

/// `<tool_call>` `{"name": .., "arguments": ..}` `</tool_call>`.
pub(super) fn qwen25(r: &str, eof: bool) -> Region {
    let i = skip_ws(r, QWEN_OPEN.len());
    if i >= r.len() {
        return Region::wait(Vec::new(), eof, r.len());
    }
    if r[i..].starts_with('[') {
        return qwen_list(r, i, eof);
    }
    if !r[i..].starts_with('{') {
        return qwen_close(r, i, Vec::new(), eof);
    }
    let body = &r[i..];
    let o = call_object(body, eof);
    match o.state {
        Val::Complete(n) => {
            let calls: Vec<CallScan> = o.call(body, true).into_iter().collect();
            let j = skip_ws(r, i + n);
            let rest = &r[j..];
            if rest.starts_with(QWEN_CLOSE) {
                Region::closed(calls, j + QWEN_CLOSE.len())
            } else if rest.is_empty() || (is_tag_prefix(rest, &[QWEN_CLOSE]) && !eof) {
                Region::wait(calls, eof, r.len())
            } else {
                // No closing tag after the object: the block ends with it.
                Region::closed(calls, i + n)
            }
        }
        Val::Incomplete => Region::wait(o.call(body, eof).into_iter().collect(), eof, r.len()),
        Val::Invalid(p) => qwen_close(r, i + p, o.call(body, true).into_iter().collect(), eof),
    }
}

/// `<tool_call>` `[{..}, {..}]` `</tool_call>`: several calls in one block
/// (the list starts at `i`). A list that yields no call is content up to the
/// block's end; text that breaks it ends the block after its last call.
fn qwen_list(r: &str, i: usize, eof: bool) -> Region {
    let list = object_list(r, i + 1, b',', Some(b']'), eof);
    let Some(end) = list.end else {
        return list;
    };
    if list.calls.is_empty() {
        return qwen_close(r, i, Vec::new(), eof);
    }
    let j = skip_ws(r, end);
    let rest = &r[j..];
    if rest.starts_with(QWEN_CLOSE) {
        Region::closed(list.calls, j + QWEN_CLOSE.len())
    } else if rest.is_empty() || (is_tag_prefix(rest, &[QWEN_CLOSE]) && !eof) {
        Region::wait(list.calls, eof, r.len())
    } else {
        Region::closed(list.calls, end)
    }
}

/// Reads call objects separated by `sep` from `i` on; `end_char` closes the
/// list (mistral's `]`). Returns the block state.
fn object_list(r: &str, start: usize, sep: u8, end_char: Option<u8>, eof: bool) -> Region {
    let mut calls = Vec::new();
    let mut last_end = None;
    let mut i = start;
    loop {
        let j = skip_ws(r, i);
        let cut = |calls: Vec<CallScan>, last_end: Option<usize>| match last_end {
            Some(e) => Region::closed(calls, e),
            None => Region::closed(Vec::new(), start.max(1)),
        };
        let Some(&c) = r.as_bytes().get(j) else {
            return match last_end {
                Some(e) if eof => Region::closed(calls, e),
                None if eof => Region::closed(calls, r.len()),
                _ => Region::open(calls),
            };
        };
        if c != b'{' {
            return cut(calls, last_end);
        }
        let body = &r[j..];
        let o = call_object(body, eof);
        match o.state {
            Val::Complete(n) => match o.call(body, true) {
                Some(call) => {
                    calls.push(call);
                    last_end = Some(j + n);
                    i = j + n;
                }
                // An object without a name: not a call.
                None if last_end.is_none() => return Region::closed(Vec::new(), j + n),
                None => return cut(calls, last_end),
            },
            Val::Incomplete => {
                calls.extend(o.call(body, eof));
                return Region::wait(calls, eof, r.len());
            }
            Val::Invalid(p) => match o.call(body, true) {
                Some(call) => {
                    calls.push(call);
                    return Region::closed(calls, j + p);
                }
                None => return cut(calls, last_end),
            },
        }
        // After an object: the separator, the list's end, or the block's end.
        let k = skip_ws(r, i);
        match r.as_bytes().get(k) {
            None => return Region::wait(calls, eof, i),
            Some(&b) if b == sep => i = k + 1,
            Some(&b) if Some(b) == end_char => return Region::closed(calls, k + 1),
            Some(_) => return cut(calls, last_end),
        }
    }
}

/// `<|python_tag|>` then `{..}` objects separated by `;`; `marker` is empty
/// for an answer that starts with `{`.
pub(super) fn llama3(r: &str, marker: &str, eof: bool) -> Region {
    object_list(r, marker.len(), b';', None, eof)
}

/// `[TOOL_CALLS]` then a JSON array of call objects.
pub(super) fn mistral(r: &str, eof: bool) -> Region {
    const MARKER: &str = "[TOOL_CALLS]";
    let i = skip_ws(r, MARKER.len());
    match r.as_bytes().get(i) {
        None => Region::wait(Vec::new(), eof, r.len()),
        Some(b'[') => {
            let mut region = object_list(r, i + 1, b',', Some(b']'), eof);
            if region.calls.is_empty() && region.end == Some(i + 1) {
                // Not a list of calls: only the marker is content.
                region.end = Some(MARKER.len());
            }
            region
        }
        Some(_) => Region::closed(Vec::new(), MARKER.len()),
    }
}
