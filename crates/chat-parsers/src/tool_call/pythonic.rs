//! Pythonic calls (Llama 4 and others): a Python list of calls with keyword
//! arguments, `[get_weather(city="Paris", days=3), now()]`.
//!
//! A block starts at `[` followed by a name and `(`; anything else after
//! `[` makes the `[` plain content at once. Arguments are Python literals
//! (strings with either quote and escapes, numbers, `True`/`False`/`None`,
//! lists, tuples, dicts), turned into compact JSON. Each call comes out
//! whole (name and arguments) when its `)` is read; the block ends at `]`.
//! Text that breaks the list ends the block after the last complete call
//! and stays content; a list broken before any call is content. As SGLang's
//! detector does, `<|python_start|>` and `<|python_end|>` (Llama 4 writes
//! them around its calls) are removed wherever they are ([`strip_markers`]).

use super::scan::{CallScan, Region, args_json, skip_ws};
use serde_json::{Map, Number, Value};

/// Why a literal could not be read.
#[derive(Debug, PartialEq, Eq)]
enum Stop {
    /// More text could complete it.
    More,
    /// It is broken.
    Broken,
}

const MAX_DEPTH: usize = 64;

/// The markers Llama 4 may write around pythonic calls.
const MARKERS: [&str; 2] = ["<|python_start|>", "<|python_end|>"];

/// `held` (a partial marker kept from before) and `chunk` with the markers
/// removed; unless at the end (`eof`), a tail that could begin a marker is
/// kept in `held` instead of returned.
pub(super) fn strip_markers(held: &mut String, chunk: &str, eof: bool) -> String {
    held.push_str(chunk);
    let mut text = std::mem::take(held);
    for m in MARKERS {
        if text.contains(m) {
            text = text.replace(m, "");
        }
    }
    if !eof {
        let keep = MARKERS
            .iter()
            .map(|m| {
                (1..m.len())
                    .rev()
                    .find(|&k| text.ends_with(&m[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        *held = text.split_off(text.len() - keep);
    }
    text
}

fn ident(s: &str, i: usize) -> usize {
    let b = s.as_bytes();
    let mut k = i;
    while k < b.len() && (b[k].is_ascii_alphanumeric() || b[k] == b'_') {
        k += 1;
    }
    if k > i && b[i].is_ascii_digit() {
        return i;
    }
    k
}

/// A quoted Python string from `i` (its quote): the value and the end.
fn string(s: &str, i: usize) -> Result<(Value, usize), Stop> {
    let quote = s.as_bytes()[i] as char;
    let mut out = String::new();
    let mut chars = s[i + 1..].char_indices();
    while let Some((k, c)) = chars.next() {
        match c {
            '\\' => {
                let Some((_, e)) = chars.next() else {
                    return Err(Stop::More);
                };
                match e {
                    'n' => out.push('\n'),
                    't' => out.push('\t'),
                    'r' => out.push('\r'),
                    '0' => out.push('\0'),
                    'u' | 'x' => {
                        let n = if e == 'u' { 4 } else { 2 };
                        let hex: String = chars.by_ref().take(n).map(|(_, h)| h).collect();
                        if hex.len() < n {
                            return Err(Stop::More);
                        }
                        let code = u32::from_str_radix(&hex, 16).map_err(|_| Stop::Broken)?;
                        out.push(char::from_u32(code).ok_or(Stop::Broken)?);
                    }
                    other => out.push(other),
                }
            }
            c if c == quote => return Ok((Value::String(out), i + 1 + k + 1)),
            c => out.push(c),
        }
    }
    Err(Stop::More)
}

/// Items of a list, tuple or dict from `i` (after its opener) to `close`.
fn items(
    s: &str,
    mut i: usize,
    close: u8,
    dict: bool,
    depth: usize,
) -> Result<(Value, usize), Stop> {
    let mut list = Vec::new();
    let mut map = Map::new();
    loop {
        i = skip_ws(s, i);
        let Some(&c) = s.as_bytes().get(i) else {
            return Err(Stop::More);
        };
        if c == close {
            let v = if dict {
                Value::Object(map)
            } else {
                Value::Array(list)
            };
            return Ok((v, i + 1));
        }
        let (v, e) = literal(s, i, depth + 1)?;
        i = skip_ws(s, e);
        if dict {
            if s.as_bytes().get(i).is_none() {
                return Err(Stop::More);
            }
            if s.as_bytes()[i] != b':' {
                return Err(Stop::Broken);
            }
            let key = match v {
                Value::String(k) => k,
                other => other.to_string(),
            };
            let (value, e) = literal(s, skip_ws(s, i + 1), depth + 1)?;
            map.insert(key, value);
            i = skip_ws(s, e);
        } else {
            list.push(v);
        }
        match s.as_bytes().get(i) {
            None => return Err(Stop::More),
            Some(b',') => i += 1,
            Some(&c) if c == close => {}
            Some(_) => return Err(Stop::Broken),
        }
    }
}

/// The Python literal at `i`: its JSON value and its end.
fn literal(s: &str, i: usize, depth: usize) -> Result<(Value, usize), Stop> {
    if depth > MAX_DEPTH {
        return Err(Stop::Broken);
    }
    let b = s.as_bytes();
    let Some(&c) = b.get(i) else {
        return Err(Stop::More);
    };
    match c {
        b'"' | b'\'' => string(s, i),
        b'[' => items(s, i + 1, b']', false, depth),
        b'(' => items(s, i + 1, b')', false, depth),
        b'{' => items(s, i + 1, b'}', true, depth),
        b'-' | b'+' | b'.' | b'0'..=b'9' => {
            let mut k = i + 1;
            while k < b.len()
                && (b[k].is_ascii_alphanumeric() || matches!(b[k], b'.' | b'_' | b'+' | b'-'))
            {
                k += 1;
            }
            if k == b.len() {
                return Err(Stop::More);
            }
            let t = s[i..k].replace('_', "");
            let v = if let Ok(n) = t.parse::<i64>() {
                Value::from(n)
            } else {
                let f = t.parse::<f64>().map_err(|_| Stop::Broken)?;
                Value::Number(Number::from_f64(f).ok_or(Stop::Broken)?)
            };
            Ok((v, k))
        }
        _ => {
            let k = ident(s, i);
            if k == b.len() {
                return Err(Stop::More);
            }
            let v = match &s[i..k] {
                "True" | "true" => Value::Bool(true),
                "False" | "false" => Value::Bool(false),
                "None" | "null" => Value::Null,
                _ => return Err(Stop::Broken),
            };
            Ok((v, k))
        }
    }
}

/// One call `name(k=v, ...)` from `i`: (name, arguments JSON, end).
fn call(s: &str, i: usize) -> Result<(String, String, usize), Stop> {
    let b = s.as_bytes();
    if i >= b.len() {
        return Err(Stop::More);
    }
    let k = ident(s, i);
    if k == i {
        return Err(Stop::Broken);
    }
    let name = s[i..k].to_string();
    let mut j = skip_ws(s, k);
    match b.get(j) {
        None => return Err(Stop::More),
        Some(b'(') => j += 1,
        Some(_) => return Err(Stop::Broken),
    }
    let mut pairs = Vec::new();
    loop {
        j = skip_ws(s, j);
        match b.get(j) {
            None => return Err(Stop::More),
            Some(b')') => return Ok((name, args_json(&pairs, true), j + 1)),
            Some(_) => {}
        }
        let e = ident(s, j);
        if e == j {
            return Err(Stop::Broken);
        }
        let key = s[j..e].to_string();
        let eq = skip_ws(s, e);
        match b.get(eq) {
            None => return Err(Stop::More),
            Some(b'=') => {}
            Some(_) => return Err(Stop::Broken),
        }
        let (v, end) = literal(s, skip_ws(s, eq + 1), 0)?;
        pairs.push((key, v));
        j = skip_ws(s, end);
        match b.get(j) {
            None => return Err(Stop::More),
            Some(b',') => j += 1,
            Some(b')') => {}
            Some(_) => return Err(Stop::Broken),
        }
    }
}

/// The block ends after the last complete call, or is only its `[`.
fn cut(calls: Vec<CallScan>, last_end: Option<usize>) -> Region {
    match last_end {
        Some(e) => Region::closed(calls, e),
        None => Region::closed(Vec::new(), 1),
    }
}

/// Reads a call list starting with `[`.
pub(super) fn scan(r: &str, eof: bool) -> Region {
    let mut calls = Vec::new();
    let mut last_end = None;
    let mut i = 1;
    loop {
        let j = skip_ws(r, i);
        match call(r, j) {
            Ok((name, args, end)) => {
                calls.push(CallScan { name, args });
                last_end = Some(end);
                let k = skip_ws(r, end);
                match r.as_bytes().get(k) {
                    None if eof => return Region::closed(calls, end),
                    None => return Region::open(calls),
                    Some(b',') => i = k + 1,
                    Some(b']') => return Region::closed(calls, k + 1),
                    Some(_) => return cut(calls, last_end),
                }
            }
            Err(Stop::More) if !eof => return Region::open(calls),
            Err(_) => return cut(calls, last_end),
        }
    }
}
