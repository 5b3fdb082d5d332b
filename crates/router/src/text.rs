//! The text a request is routed by: what the worker's prefix cache will see
//! first, as characters (the router has no tokenizer).
//!
//! `/generate`: `text` (the first of a batch), else `input_ids`;
//! `/v1/completions`: `prompt` (the first of a list; token ids too);
//! `/v1/chat/completions`: the messages' roles and text contents in order.
//! Token ids become one character each (offset past ASCII), so equal id
//! prefixes are equal text prefixes. Anything else routes by no text (the
//! policy then balances by load).

use serde_json::Value;

fn ids(v: &Value) -> Option<Vec<char>> {
    let arr = v.as_array()?;
    // A batch of id lists: the first.
    if let Some(first) = arr.first().filter(|f| f.is_array()) {
        return ids(first);
    }
    arr.iter().map(|x| x.as_u64().and_then(id_char)).collect()
}

/// One character per token id, past ASCII and around the surrogates.
fn id_char(id: u64) -> Option<char> {
    let id = u32::try_from(id).ok()?;
    let c = if id < 0xD700 {
        0x100 + id
    } else {
        0xE000 + (id - 0xD700)
    };
    char::from_u32(c)
}

fn text_or_ids(v: &Value) -> Option<Vec<char>> {
    match v {
        Value::String(s) => Some(s.chars().collect()),
        Value::Array(a) => match a.first() {
            Some(Value::String(s)) => Some(s.chars().collect()),
            _ => ids(v),
        },
        _ => None,
    }
}

fn content_text(c: &Value, out: &mut String) {
    match c {
        Value::String(s) => out.push_str(s),
        Value::Array(parts) => {
            for p in parts {
                if let Some(t) = p.get("text").and_then(Value::as_str) {
                    out.push_str(t);
                }
            }
        }
        _ => {}
    }
}

/// The routing text of a request to `path` with JSON body `body`.
pub fn routing_text(path: &str, body: &Value) -> Vec<char> {
    let found = match path {
        "/generate" => body
            .get("text")
            .and_then(text_or_ids)
            .or_else(|| body.get("input_ids").and_then(ids)),
        "/v1/completions" => body.get("prompt").and_then(text_or_ids),
        "/v1/chat/completions" => body.get("messages").and_then(Value::as_array).map(|ms| {
            let mut s = String::new();
            for m in ms {
                if let Some(r) = m.get("role").and_then(Value::as_str) {
                    s.push_str(r);
                    s.push(':');
                }
                if let Some(c) = m.get("content") {
                    content_text(c, &mut s);
                }
                s.push('\n');
            }
            s.chars().collect()
        }),
        _ => None,
    };
    found.unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn s(path: &str, body: Value) -> String {
        routing_text(path, &body).into_iter().collect()
    }

    #[test]
    fn each_api_routes_by_its_prompt() {
        assert_eq!(s("/generate", json!({"text": "héllo"})), "héllo");
        assert_eq!(s("/generate", json!({"text": ["a", "b"]})), "a");
        assert_eq!(s("/v1/completions", json!({"prompt": "p"})), "p");
        assert_eq!(s("/v1/completions", json!({"prompt": ["q", "r"]})), "q");
        assert_eq!(
            s(
                "/v1/chat/completions",
                json!({"messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url"}]}
                ]})
            ),
            "system:Be brief.\nuser:Hi\n"
        );
        assert_eq!(s("/v1/models", json!({})), "");
        assert_eq!(s("/generate", json!({"text": 3})), "");
    }

    #[test]
    fn token_ids_keep_their_prefixes() {
        let a = routing_text("/generate", &json!({"input_ids": [1, 2, 3, 4]}));
        let b = routing_text("/v1/completions", &json!({"prompt": [[1, 2, 3, 9]]}));
        assert_eq!(a.len(), 4);
        assert_eq!(a[..3], b[..3]);
        assert_ne!(a[3], b[3]);
        assert!(routing_text("/generate", &json!({"input_ids": [1, -2]})).is_empty());
        let big = routing_text(
            "/generate",
            &json!({"input_ids": [0xD6FF, 0xD700, 151_000]}),
        );
        assert_eq!(big.len(), 3);
        assert!(big[0] != big[1] && big[1] != big[2]);
    }
}
