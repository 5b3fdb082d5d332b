//! Section formats with special-token markers: DeepSeek V3
//! (`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{..}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>`),
//! DeepSeek V3.1 (`<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{..}<｜tool▁call▁end｜>`)
//! and Kimi K2 (`<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{..}<|tool_call_end|><|tool_calls_section_end|>`).
//!
//! A section holds calls one after another (whitespace between them). A
//! block may also start at a single call's marker, as SGLang accepts. The
//! name is certain once the call's header is complete (through the fence
//! line for V3, the separator for V3.1, the argument marker for Kimi); the
//! arguments are the JSON value's text as written; anything between the
//! value and the call's end marker is dropped. The section ends at its end
//! marker, at text that is not a call, or at the end of the answer.

use super::scan::{CallScan, Region, Val, json_value, skip_ws};
use crate::text::is_tag_prefix;

pub(super) const SECTION: &str = "<｜tool▁calls▁begin｜>";
pub(super) const CALL: &str = "<｜tool▁call▁begin｜>";
const SECTION_END: &str = "<｜tool▁calls▁end｜>";
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";
pub(super) const KIMI_SECTION: &str = "<|tool_calls_section_begin|>";
pub(super) const KIMI_CALL: &str = "<|tool_call_begin|>";
const KIMI_SECTION_END: &str = "<|tool_calls_section_end|>";
const KIMI_CALL_END: &str = "<|tool_call_end|>";
const KIMI_ARGS: &str = "<|tool_call_argument_begin|>";

/// A call's header, read from after its begin marker.
enum Head {
    /// The name, and where the arguments start.
    Done {
        name: String,
        args_at: usize,
    },
    Incomplete,
    Invalid,
}

/// One section format.
pub(super) struct Section {
    begin: &'static str,
    end: &'static str,
    call: &'static str,
    call_end: &'static str,
    header: fn(&str, bool) -> Head,
}

pub(super) const V3: Section = Section {
    begin: SECTION,
    end: SECTION_END,
    call: CALL,
    call_end: CALL_END,
    header: v3_header,
};

pub(super) const V31: Section = Section {
    begin: SECTION,
    end: SECTION_END,
    call: CALL,
    call_end: CALL_END,
    header: v31_header,
};

pub(super) const KIMI: Section = Section {
    begin: KIMI_SECTION,
    end: KIMI_SECTION_END,
    call: KIMI_CALL,
    call_end: KIMI_CALL_END,
    header: kimi_header,
};

/// A header with no separator yet: broken if a call ends first or a line
/// ends (names have none), else waiting.
fn no_sep(t: &str, call_end: &str, eof: bool) -> Head {
    if eof || t.contains(call_end) || t.contains('\n') || t.len() > 256 {
        Head::Invalid
    } else {
        Head::Incomplete
    }
}

/// `function<｜tool▁sep｜>NAME\n```json\n`.
fn v3_header(t: &str, eof: bool) -> Head {
    let Some(s) = t.find(SEP) else {
        return no_sep(t, CALL_END, eof);
    };
    let at = s + SEP.len();
    let Some(nl) = t[at..].find('\n') else {
        return if eof || t[at..].contains('<') {
            Head::Invalid
        } else {
            Head::Incomplete
        };
    };
    let name = t[at..at + nl].trim();
    if name.is_empty() {
        return Head::Invalid;
    }
    let mut k = skip_ws(t, at + nl);
    const FENCE: &str = "```json";
    if t[k..].starts_with(FENCE) {
        k = skip_ws(t, k + FENCE.len());
    } else if !eof && (t[k..].is_empty() || is_tag_prefix(&t[k..], &[FENCE])) {
        return Head::Incomplete;
    }
    Head::Done {
        name: name.to_string(),
        args_at: k,
    }
}

/// `NAME<｜tool▁sep｜>`.
fn v31_header(t: &str, eof: bool) -> Head {
    let Some(s) = t.find(SEP) else {
        return no_sep(t, CALL_END, eof);
    };
    let name = t[..s].trim();
    if name.is_empty() {
        return Head::Invalid;
    }
    Head::Done {
        name: name.to_string(),
        args_at: skip_ws(t, s + SEP.len()),
    }
}

/// `functions.NAME:IDX<|tool_call_argument_begin|>`.
fn kimi_header(t: &str, eof: bool) -> Head {
    let Some(s) = t.find(KIMI_ARGS) else {
        return no_sep(t, KIMI_CALL_END, eof);
    };
    let id = t[..s].trim();
    let id = id.strip_prefix("functions.").unwrap_or(id);
    let Some((name, idx)) = id.rsplit_once(':') else {
        return Head::Invalid;
    };
    let name_ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == '.');
    if !name_ok || idx.is_empty() || !idx.bytes().all(|b| b.is_ascii_digit()) {
        return Head::Invalid;
    }
    Head::Done {
        name: name.to_string(),
        args_at: skip_ws(t, s + KIMI_ARGS.len()),
    }
}

/// Reads one call from `at` (its begin marker). Returns where the next
/// thing starts, or the block state when the call decides it.
fn call(
    f: &Section,
    r: &str,
    at: usize,
    eof: bool,
    calls: &mut Vec<CallScan>,
) -> Result<usize, Region> {
    let h = at + f.call.len();
    let (name, args_at) = match (f.header)(&r[h..], eof) {
        Head::Done { name, args_at } => (name, h + args_at),
        Head::Incomplete => {
            return Err(Region::wait(std::mem::take(calls), eof, at));
        }
        Head::Invalid => {
            let taken = std::mem::take(calls);
            let end = if taken.is_empty() {
                at + f.call.len()
            } else {
                at
            };
            return Err(Region::closed(taken, end));
        }
    };
    let (args, after) = match json_value(&r[args_at..], eof) {
        Val::Complete(n) => (&r[args_at..args_at + n], Some(args_at + n)),
        Val::Incomplete => (&r[args_at..], None),
        Val::Invalid(p) => (&r[args_at..args_at + p], Some(args_at + p)),
    };
    calls.push(CallScan {
        name,
        args: args.to_string(),
    });
    let Some(after) = after else {
        return Err(Region::wait(std::mem::take(calls), eof, r.len()));
    };
    match r[after..].find(f.call_end) {
        Some(e) => Ok(after + e + f.call_end.len()),
        None => Err(Region::wait(std::mem::take(calls), eof, r.len())),
    }
}

/// Reads a section (or a lone call) starting with `marker`.
pub(super) fn scan(f: &Section, r: &str, marker: &str, eof: bool) -> Region {
    let mut calls = Vec::new();
    let mut i = if marker == f.begin { f.begin.len() } else { 0 };
    loop {
        let j = skip_ws(r, i);
        let rest = &r[j..];
        if rest.starts_with(f.end) {
            return Region::closed(calls, j + f.end.len());
        }
        if rest.starts_with(f.call) {
            match call(f, r, j, eof, &mut calls) {
                Ok(next) => {
                    i = next;
                    continue;
                }
                Err(region) => return region,
            }
        }
        if rest.is_empty() || (!eof && is_tag_prefix(rest, &[f.end, f.call])) {
            // Still open; at the end, whatever follows the calls is content.
            return Region::wait(calls, eof, if i == 0 { r.len() } else { i });
        }
        // Text that is not a call: the block ends before it.
        let end = if calls.is_empty() && i == 0 {
            r.len().min(1)
        } else {
            i
        };
        return Region::closed(calls, end);
    }
}
