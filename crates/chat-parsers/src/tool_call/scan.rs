//! Reading pieces of call blocks that may still be incomplete: where a JSON
//! value ends, a `{"name":..,"arguments":..}` object, and the parameter
//! values of text formats typed by a tool's schema.
//!
//! Scanners are pure functions of the text read so far and of whether it is
//! the end (`eof`). Their results only grow as text is added: a call's name,
//! once given, stays; its arguments are always a prefix of the final ones.

use super::ToolSpec;
use serde_json::Value;

/// One call a block scan found: its name is certain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CallScan {
    pub name: String,
    /// The arguments' JSON text so far (final once the block is closed).
    pub args: String,
}

/// The state of a call block.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Region {
    pub calls: Vec<CallScan>,
    /// Where the block ends (bytes from its marker), once known.
    pub end: Option<usize>,
}

impl Region {
    pub(crate) fn open(calls: Vec<CallScan>) -> Self {
        Self { calls, end: None }
    }
    pub(crate) fn closed(calls: Vec<CallScan>, end: usize) -> Self {
        Self {
            calls,
            end: Some(end),
        }
    }
    /// Open while more text may come, else closed at `end`.
    pub(crate) fn wait(calls: Vec<CallScan>, eof: bool, end: usize) -> Self {
        if eof {
            Self::closed(calls, end)
        } else {
            Self::open(calls)
        }
    }
}

/// How a JSON value at the start of a text stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Val {
    /// It ends after this many bytes.
    Complete(usize),
    /// All the text is the value's beginning.
    Incomplete,
    /// It is broken at this byte.
    Invalid(usize),
}

pub(crate) fn skip_ws(s: &str, i: usize) -> usize {
    let b = s.as_bytes();
    let mut i = i.min(b.len());
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// The index after the closing quote of the string opening at `start`.
pub(crate) fn string_end(b: &[u8], start: usize) -> Option<usize> {
    let mut i = start + 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// Where the JSON value at the start of `s` ends. Containers are matched
/// bracket by bracket (strings skipped), not fully validated.
pub(crate) fn json_value(s: &str, eof: bool) -> Val {
    let b = s.as_bytes();
    let Some(&first) = b.first() else {
        return if eof {
            Val::Invalid(0)
        } else {
            Val::Incomplete
        };
    };
    match first {
        b'{' | b'[' => {
            let mut stack = Vec::new();
            let mut i = 0;
            while i < b.len() {
                match b[i] {
                    b'"' => match string_end(b, i) {
                        Some(e) => {
                            i = e;
                            continue;
                        }
                        None => return Val::Incomplete,
                    },
                    b'{' => stack.push(b'}'),
                    b'[' => stack.push(b']'),
                    c @ (b'}' | b']') => {
                        if stack.pop() != Some(c) {
                            return Val::Invalid(i);
                        }
                        if stack.is_empty() {
                            return Val::Complete(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            Val::Incomplete
        }
        b'"' => string_end(b, 0).map_or(Val::Incomplete, Val::Complete),
        b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
            let n = b
                .iter()
                .position(|c| !(c.is_ascii_alphanumeric() || matches!(c, b'+' | b'-' | b'.')))
                .unwrap_or(b.len());
            if n == b.len() && !eof {
                return Val::Incomplete;
            }
            match serde_json::from_str::<Value>(&s[..n]) {
                Ok(_) => Val::Complete(n),
                Err(_) => Val::Invalid(0),
            }
        }
        _ => Val::Invalid(0),
    }
}

/// A `{"name": .., "arguments"|"parameters": ..}` object, read so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Obj {
    pub name: Option<String>,
    /// The arguments value: its start and, once complete (or broken), its end.
    pub args: Option<(usize, Option<usize>)>,
    pub state: Val,
}

impl Obj {
    /// The call, if its name is known: `closing` makes absent arguments `{}`.
    pub(crate) fn call(&self, s: &str, closing: bool) -> Option<CallScan> {
        let name = self.name.clone()?;
        let args = match self.args {
            Some((a, Some(e))) => s.get(a..e).unwrap_or_default().to_string(),
            Some((a, None)) => s.get(a..).unwrap_or_default().to_string(),
            None if closing || matches!(self.state, Val::Complete(_)) => "{}".to_string(),
            None => String::new(),
        };
        Some(CallScan { name, args })
    }
}

/// Reads the call object at the start of `s` (which starts with `{`).
pub(crate) fn call_object(s: &str, eof: bool) -> Obj {
    let b = s.as_bytes();
    let mut o = Obj {
        name: None,
        args: None,
        state: Val::Incomplete,
    };
    let mut i = 1;
    loop {
        i = skip_ws(s, i);
        let Some(&c) = b.get(i) else { return o };
        if c == b'}' {
            o.state = Val::Complete(i + 1);
            return o;
        }
        if c != b'"' {
            o.state = Val::Invalid(i);
            return o;
        }
        let Some(ke) = string_end(b, i) else { return o };
        let Ok(key) = serde_json::from_str::<String>(&s[i..ke]) else {
            o.state = Val::Invalid(i);
            return o;
        };
        i = skip_ws(s, ke);
        match b.get(i) {
            None => return o,
            Some(b':') => i = skip_ws(s, i + 1),
            Some(_) => {
                o.state = Val::Invalid(i);
                return o;
            }
        }
        if i >= b.len() {
            return o;
        }
        let is_args = (key == "arguments" || key == "parameters") && o.args.is_none();
        match json_value(&s[i..], eof) {
            Val::Incomplete => {
                if is_args {
                    o.args = Some((i, None));
                }
                return o;
            }
            Val::Invalid(p) => {
                if is_args {
                    o.args = Some((i, Some(i + p)));
                }
                o.state = Val::Invalid(i + p);
                return o;
            }
            Val::Complete(n) => {
                if key == "name" && o.name.is_none() {
                    match serde_json::from_str::<String>(&s[i..i + n]) {
                        Ok(name) => o.name = Some(name),
                        Err(_) => {
                            o.state = Val::Invalid(i);
                            return o;
                        }
                    }
                } else if is_args {
                    o.args = Some((i, Some(i + n)));
                }
                i = skip_ws(s, i + n);
            }
        }
        match b.get(i) {
            None => return o,
            Some(b',') => i += 1,
            Some(b'}') => {
                o.state = Val::Complete(i + 1);
                return o;
            }
            Some(_) => {
                o.state = Val::Invalid(i);
                return o;
            }
        }
    }
}

/// The schema type of parameter `key` of function `name` (the first
/// non-null one of a type list), if the tools say.
pub(crate) fn param_type<'t>(tools: &'t [ToolSpec], name: &str, key: &str) -> Option<&'t str> {
    let tool = tools.iter().find(|t| t.name == name)?;
    let ty = tool.parameters.get("properties")?.get(key)?.get("type")?;
    match ty {
        Value::String(s) => Some(s.as_str()),
        Value::Array(a) => a.iter().filter_map(Value::as_str).find(|t| *t != "null"),
        _ => None,
    }
}

/// A text parameter value typed by its schema type: strings stay as
/// written; numbers, booleans, null, objects and arrays are parsed, and
/// stay strings when they do not parse; without a type, JSON if it parses.
pub(crate) fn typed_value(raw: &str, ty: Option<&str>) -> Value {
    let t = raw.trim();
    let parsed = match ty {
        Some("string") => None,
        Some("integer") => t.parse::<i64>().ok().map(Value::from).or_else(|| float(t)),
        Some("number") => t.parse::<i64>().ok().map(Value::from).or_else(|| float(t)),
        Some("boolean") => match t.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        Some("null") => (t == "null" || t == "None").then_some(Value::Null),
        _ => serde_json::from_str::<Value>(t).ok(),
    };
    parsed.unwrap_or_else(|| Value::String(raw.to_string()))
}

fn float(t: &str) -> Option<Value> {
    let f = t.parse::<f64>().ok()?;
    serde_json::Number::from_f64(f).map(Value::Number)
}

/// `{"k": v, ...` for the parameters so far, closed with `}` when `done`.
pub(crate) fn args_json(pairs: &[(String, Value)], done: bool) -> String {
    let mut s = String::from("{");
    for (k, (key, value)) in pairs.iter().enumerate() {
        if k > 0 {
            s.push_str(", ");
        }
        s.push_str(&Value::String(key.clone()).to_string());
        s.push_str(": ");
        s.push_str(&value.to_string());
    }
    if done {
        s.push('}');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_values_end_where_they_should() {
        assert_eq!(json_value(r#"{"a": "}"} x"#, false), Val::Complete(10));
        assert_eq!(json_value(r#"{"a": [1, {"b"#, false), Val::Incomplete);
        assert_eq!(json_value(r#"{"a": 1]"#, false), Val::Invalid(7));
        assert_eq!(json_value("12", false), Val::Incomplete);
        assert_eq!(json_value("12", true), Val::Complete(2));
        assert_eq!(json_value("12,", false), Val::Complete(2));
        assert_eq!(json_value("nul", true), Val::Invalid(0));
        assert_eq!(json_value(r#""a\"b" "#, false), Val::Complete(6));
        assert_eq!(json_value("x", false), Val::Invalid(0));
    }

    #[test]
    fn call_objects() {
        let s = r#"{"name": "f", "arguments": {"a": 1}}"#;
        let o = call_object(s, false);
        assert_eq!(o.state, Val::Complete(s.len()));
        assert_eq!(
            o.call(s, false),
            Some(CallScan {
                name: "f".into(),
                args: r#"{"a": 1}"#.into()
            })
        );
        let s = r#"{"name": "f", "parameters": {"a": [1"#;
        let o = call_object(s, false);
        assert_eq!(o.state, Val::Incomplete);
        assert_eq!(o.call(s, false).map(|c| c.args), Some(r#"{"a": [1"#.into()));
        let s = r#"{"name": "f"}"#;
        assert_eq!(
            call_object(s, false).call(s, false).map(|c| c.args),
            Some("{}".into())
        );
        assert_eq!(call_object(r#"{"name": 5}"#, false).state, Val::Invalid(9));
        assert_eq!(call_object(r#"{"name" "f"}"#, false).state, Val::Invalid(8));
    }

    #[test]
    fn typed_values() {
        assert_eq!(typed_value("42", Some("integer")), json!(42));
        assert_eq!(typed_value("4.5", Some("number")), json!(4.5));
        assert_eq!(typed_value("42", Some("string")), json!("42"));
        assert_eq!(typed_value("True", Some("boolean")), json!(true));
        assert_eq!(typed_value("[1, 2]", Some("array")), json!([1, 2]));
        assert_eq!(typed_value("abc", Some("integer")), json!("abc"));
        assert_eq!(typed_value("{\"a\": 1}", None), json!({"a": 1}));
        assert_eq!(typed_value("Paris", None), json!("Paris"));
        let tools = vec![ToolSpec {
            name: "f".into(),
            parameters: json!({"properties": {"n": {"type": ["integer", "null"]}}}),
        }];
        assert_eq!(param_type(&tools, "f", "n"), Some("integer"));
        assert_eq!(param_type(&tools, "f", "m"), None);
        assert_eq!(
            args_json(&[("a".into(), json!(1)), ("b".into(), json!("x"))], true),
            r#"{"a": 1, "b": "x"}"#
        );
    }
}
