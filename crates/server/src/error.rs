//! HTTP errors: one type, [`ApiError`], rendered as OpenAI-style JSON.
//!
//! Every failure a handler can meet becomes an `ApiError` with a status code
//! and a message that names the offending field where there is one. The body
//! is always `{"error": {"message", "type", "param", "code"}}` (`code` is the
//! HTTP status), on every route, so clients need one error parser. Engine
//! errors map by kind: invalid arguments are 400, everything else 5xx.

use arbor_engine_core::CoreError;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to the client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message; names the field when one is at fault.
    pub message: String,
    /// The request field at fault, when known.
    pub param: Option<String>,
}

impl ApiError {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// 400 Bad Request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 400 naming `param`.
    pub fn bad_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request(message).with_param(param)
    }

    /// 400: a field asks for something not implemented yet.
    pub fn unsupported(param: &str, what: &str) -> Self {
        Self::bad_param(param, format!("'{param}': {what} is not supported yet"))
    }

    /// 404 Not Found.
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }

    /// 503 Service Unavailable.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
    }

    /// 500 Internal Server Error.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// Sets the field at fault.
    pub fn with_param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// Rewrites engine parameter names into the names of the API that was called.
    pub fn renamed(mut self, pairs: &[(&str, &str)]) -> Self {
        for (from, to) in pairs {
            self.message = self.message.replace(from, to);
            if self.param.as_deref() == Some(*from) {
                self.param = Some((*to).to_string());
            }
        }
        self
    }

    /// The OpenAI error `type` for the status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::PAYLOAD_TOO_LARGE => "invalid_request_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            s if s.is_client_error() => "invalid_request_error",
            _ => "server_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

/// Parameter names the engine's messages start with (used to fill `param`).
const ENGINE_PARAMS: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_new_tokens",
    "max_new_tokens",
    "n",
    "stop",
    "logit_bias",
    "top_logprobs_num",
    "rid",
];

impl From<CoreError> for ApiError {
    fn from(e: CoreError) -> Self {
        match e {
            CoreError::InvalidArgument(m) => {
                let first = m.split([' ', ':']).next().unwrap_or_default();
                let param = ENGINE_PARAMS
                    .iter()
                    .find(|p| **p == first)
                    .map(|p| (*p).to_string())
                    .or_else(|| {
                        m.contains("max_new_tokens")
                            .then(|| "max_new_tokens".to_string())
                    });
                ApiError {
                    status: StatusCode::BAD_REQUEST,
                    message: m,
                    param,
                }
            }
            CoreError::OutOfMemory(m) => ApiError::unavailable(format!("out of memory: {m}")),
            CoreError::Unsupported(m) => ApiError::bad_request(format!("unsupported: {m}")),
            other => ApiError::internal(other.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!("{}: {}", self.status, self.message);
        } else {
            tracing::debug!("{}: {}", self.status, self.message);
        }
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::PAYLOAD_TOO_LARGE {
            // The rest of the body is never read: the connection cannot be reused.
            r.headers_mut().insert(
                axum::http::header::CONNECTION,
                axum::http::HeaderValue::from_static("close"),
            );
        }
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_name_their_parameter() {
        let e: ApiError = CoreError::invalid("top_p must be in (0, 1], got 2").into();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("top_p"));
        let e = e.renamed(&[("top_p", "nucleus")]);
        assert_eq!(e.param.as_deref(), Some("nucleus"));
        let b = e.body();
        assert_eq!(b["error"]["code"], 400);
        assert_eq!(b["error"]["type"], "invalid_request_error");
        let e: ApiError = CoreError::Internal("x".into()).into();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
