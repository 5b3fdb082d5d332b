//! Reading request bodies: size limits, JSON, and typed fields by name.
//!
//! [`read_json`] enforces the body size limit (413) and parses JSON (400 with
//! serde's position on failure). [`Fields`] takes a JSON object apart one key
//! at a time, so that every error names its field (with a path such as
//! `sampling_params.temperature`), `null` always means "not given" (SGLang's
//! clients send nulls), fields that are known but not implemented are
//! accepted only while they ask for nothing, and any key left over at
//! [`Fields::finish`] is refused as unknown.

use crate::error::ApiError;
use axum::body::Body;
use axum::http::{HeaderMap, StatusCode, header};
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};
use std::collections::BTreeMap;

/// Reads the whole body (at most `limit` bytes) and parses it as JSON.
/// A request body as [`Fields`]: JSON read within the server's size limit.
pub(crate) async fn request_fields(
    st: &crate::state::AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Fields, ApiError> {
    let v = read_json(headers, body, st.opts.max_request_bytes).await?;
    Fields::new(v, "the request body", "")
}

pub(crate) async fn read_json(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Value, ApiError> {
    let too_large = || {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body exceeds the limit of {limit} bytes"),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(too_large());
    }
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        let mut src: Option<&(dyn std::error::Error + 'static)> = Some(&e);
        while let Some(s) = src {
            if s.to_string().contains("length limit exceeded") {
                return too_large();
            }
            src = s.source();
        }
        ApiError::bad_request(format!("could not read the request body: {e}"))
    })?;
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; expected a JSON object",
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))
}

/// A JSON object being taken apart field by field.
pub(crate) struct Fields {
    map: Map<String, Value>,
    prefix: String,
}

/// True for values that ask for nothing: null, false, 0, "", [], {}.
/// SGLang's `data_parallel_rank` (a request of the native or the OpenAI
/// API): the replica to run on, checked against the engine's replicas when
/// the request is submitted.
pub(crate) fn data_parallel_rank(f: &mut Fields) -> Result<Option<usize>, ApiError> {
    Ok(f.int("data_parallel_rank", 0, i64::from(u32::MAX))?
        .map(|r| r as usize))
}

pub(crate) fn is_unset(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Bool(b) => !b,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

impl Fields {
    /// Takes `v` apart; `what` names it in the error when it is not an object.
    /// `prefix` is prepended to field names in messages (e.g. `sampling_params.`).
    pub fn new(v: Value, what: &str, prefix: &str) -> Result<Self, ApiError> {
        match v {
            Value::Object(map) => Ok(Self {
                map,
                prefix: prefix.to_string(),
            }),
            other => Err(ApiError::bad_request(format!(
                "{what} must be a JSON object, got {}",
                type_name(&other)
            ))),
        }
    }

    /// The full name of `key` for messages.
    pub fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Removes `key`; `None` when absent or null.
    pub fn raw(&mut self, key: &str) -> Option<Value> {
        match self.map.remove(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    /// Removes and deserializes `key`; `None` when absent or null.
    pub fn get<T: DeserializeOwned>(&mut self, key: &str) -> Result<Option<T>, ApiError> {
        let Some(v) = self.raw(key) else {
            return Ok(None);
        };
        let name = self.name(key);
        let got = type_name(&v);
        serde_json::from_value(v)
            .map(Some)
            .map_err(|e| ApiError::bad_param(&name, format!("'{name}': {e} (got {got})")))
    }

    /// A boolean field.
    pub fn bool(&mut self, key: &str) -> Result<Option<bool>, ApiError> {
        self.get(key)
    }

    /// A float field.
    pub fn f32(&mut self, key: &str) -> Result<Option<f32>, ApiError> {
        let name = self.name(key);
        match self.raw(key) {
            None => Ok(None),
            Some(Value::Number(n)) => Ok(n.as_f64().map(|x| x as f32)),
            Some(other) => Err(ApiError::bad_param(
                &name,
                format!("'{name}' must be a number, got {}", type_name(&other)),
            )),
        }
    }

    /// An integer field within `[min, max]`.
    pub fn int(&mut self, key: &str, min: i64, max: i64) -> Result<Option<i64>, ApiError> {
        let name = self.name(key);
        let Some(v) = self.raw(key) else {
            return Ok(None);
        };
        let x = match &v {
            Value::Number(n) => n.as_i64().or_else(|| {
                n.as_f64()
                    .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                    .map(|f| f as i64)
            }),
            _ => None,
        };
        let Some(x) = x else {
            return Err(ApiError::bad_param(
                &name,
                format!("'{name}' must be an integer, got {}", type_name(&v)),
            ));
        };
        if x < min || x > max {
            return Err(ApiError::bad_param(
                &name,
                format!("'{name}' must be in [{min}, {max}], got {x}"),
            ));
        }
        Ok(Some(x))
    }

    /// A string field.
    pub fn string(&mut self, key: &str) -> Result<Option<String>, ApiError> {
        self.get(key)
    }

    /// Stop strings: a string or a list of strings.
    pub fn stop(&mut self, key: &str) -> Result<Option<Vec<String>>, ApiError> {
        let name = self.name(key);
        let bad = |got: &str| {
            ApiError::bad_param(
                &name,
                format!("'{name}' must be a string or a list of strings, got {got}"),
            )
        };
        let list = match self.raw(key) {
            None => return Ok(None),
            Some(Value::String(s)) => vec![s],
            Some(Value::Array(a)) => a
                .into_iter()
                .map(|x| match x {
                    Value::String(s) => Ok(s),
                    other => Err(bad(&format!("a list holding {}", type_name(&other)))),
                })
                .collect::<Result<Vec<_>, _>>()?,
            Some(other) => return Err(bad(type_name(&other))),
        };
        Ok(Some(list))
    }

    /// Token id → bias, keys given as strings of integers (OpenAI's shape).
    pub fn logit_bias(&mut self, key: &str) -> Result<Option<BTreeMap<u32, f32>>, ApiError> {
        let name = self.name(key);
        let Some(v) = self.raw(key) else {
            return Ok(None);
        };
        let Value::Object(o) = v else {
            return Err(ApiError::bad_param(
                &name,
                format!("'{name}' must be an object of token id to bias"),
            ));
        };
        let mut out = BTreeMap::new();
        for (k, b) in o {
            let id: u32 = k.trim().parse().map_err(|_| {
                ApiError::bad_param(&name, format!("'{name}': key '{k}' is not a token id"))
            })?;
            let bias = b
                .as_f64()
                .filter(|x| x.is_finite() && (-100.0..=100.0).contains(x))
                .ok_or_else(|| {
                    ApiError::bad_param(
                        &name,
                        format!("'{name}': bias of token {k} must be a number in [-100, 100]"),
                    )
                })?;
            out.insert(id, bias as f32);
        }
        Ok(Some(out))
    }

    /// Accepts `key` only while it asks for nothing (see [`is_unset`]).
    pub fn unset_only(&mut self, key: &str, what: &str) -> Result<(), ApiError> {
        match self.map.remove(key) {
            Some(v) if !is_unset(&v) => Err(ApiError::unsupported(&self.name(key), what)),
            _ => Ok(()),
        }
    }

    /// Accepts `key` with any value and drops it (hints with no effect here).
    pub fn ignore(&mut self, key: &str) {
        self.map.remove(key);
    }

    /// Top-level request bodies: keys left over are ignored while they ask for
    /// nothing (clients such as SGLang's `bench_serving` send new fields with
    /// default values like `false` or `null`) and refused otherwise.
    pub fn finish_lenient(mut self) -> Result<(), ApiError> {
        self.map.retain(|k, v| {
            let keep = !is_unset(v);
            if !keep {
                tracing::debug!("ignoring unknown field '{k}' that asks for nothing");
            }
            keep
        });
        self.finish()
    }

    /// Refuses whatever keys are left.
    pub fn finish(self) -> Result<(), ApiError> {
        match self.map.keys().next() {
            None => Ok(()),
            Some(k) => {
                let name = format!("{}{k}", self.prefix);
                Err(ApiError::bad_param(
                    &name,
                    format!("unknown field '{name}'"),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fields_name_errors_and_accept_nulls() {
        let v = json!({"a": null, "b": "x", "c": 3, "d": [1], "stop": ["x", 1], "lb": {"5": 1.5}});
        let mut f = Fields::new(v, "body", "p.").unwrap();
        assert_eq!(f.f32("a").unwrap(), None);
        let e = f.f32("b").unwrap_err();
        assert!(e.message.contains("'p.b'"), "{}", e.message);
        assert_eq!(e.param.as_deref(), Some("p.b"));
        assert!(f.int("c", 5, 9).unwrap_err().message.contains("[5, 9]"));
        assert!(
            f.unset_only("d", "thing")
                .unwrap_err()
                .message
                .contains("not supported yet")
        );
        assert!(
            f.stop("stop")
                .unwrap_err()
                .message
                .contains("list of strings")
        );
        assert_eq!(f.logit_bias("lb").unwrap().unwrap().get(&5), Some(&1.5));
        f.finish().unwrap();
        let mut f = Fields::new(json!({"zzz": 1}), "body", "").unwrap();
        f.ignore("nothing");
        assert!(
            f.finish()
                .unwrap_err()
                .message
                .contains("unknown field 'zzz'")
        );
        let f = Fields::new(json!({"new_flag": false, "other": null}), "body", "").unwrap();
        f.finish_lenient().unwrap();
        let f = Fields::new(json!({"new_flag": true}), "body", "").unwrap();
        assert!(f.finish_lenient().is_err());
        assert!(Fields::new(json!([1]), "the body", "").is_err());
    }
}
