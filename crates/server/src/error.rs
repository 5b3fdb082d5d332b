//! HTTP errors: one type, [`ApiError`], rendered as OpenAI-style JSON.
//!
//! Every failure a handler can meet becomes an `ApiError` with a status code
//! and a message that names the offending field where there is one. The body
//! is always `{"error": {"message", "type", "param", "code"}}` (`code` is the
//! HTTP status), on every route, so clients need one error parser. Engine
//! errors map by kind, never by message: a parameter at fault
//! (`CoreError::InvalidParam`) is a 400 naming it as the called API spells
//! it ([`Dialect::api_name`]), other invalid arguments and unsupported
//! requests 400, exhaustion 503, everything else 500.

use crate::params::Dialect;
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

/// A JSON route's answer: the value with 200, or the error.
pub(crate) fn json_reply(r: Result<serde_json::Value, ApiError>) -> axum::response::Response {
    use axum::response::IntoResponse;
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
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

    /// The answer to an engine error, for a request of dialect `d`: a
    /// parameter at fault is named as `d` spells it.
    pub fn from_core(e: CoreError, d: Dialect) -> Self {
        match e {
            CoreError::InvalidParam { param, reason } => {
                let name = d.api_name(param);
                ApiError::bad_param(&name, format!("'{name}' {reason}"))
            }
            CoreError::InvalidArgument(m) => ApiError::bad_request(m),
            CoreError::OutOfMemory(m) => ApiError::unavailable(format!("out of memory: {m}")),
            CoreError::Unsupported(m) => ApiError::bad_request(format!("unsupported: {m}")),
            other => ApiError::internal(other.to_string()),
        }
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

impl From<CoreError> for ApiError {
    /// Engine errors outside a request of one API (admin routes) use the native names.
    fn from(e: CoreError) -> Self {
        ApiError::from_core(e, Dialect::Native)
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
    use arbor_engine_core::Param;

    #[test]
    fn engine_errors_name_their_parameter_as_the_api_spells_it() {
        let e = || CoreError::param(Param::MaxNewTokens, "exceeds the context length of 8");
        let native = ApiError::from_core(e(), Dialect::Native);
        assert_eq!(native.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            native.param.as_deref(),
            Some("sampling_params.max_new_tokens")
        );
        let chat = ApiError::from_core(e(), Dialect::Chat);
        assert_eq!(chat.param.as_deref(), Some("max_tokens"));
        assert!(
            chat.message.starts_with("'max_tokens' exceeds"),
            "{}",
            chat.message
        );
        let b = chat.body();
        assert_eq!(b["error"]["code"], 400);
        assert_eq!(b["error"]["type"], "invalid_request_error");
        let e: ApiError = CoreError::Internal("x".into()).into();
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
    }
}
