//! Every way the front door refuses or fails a request, in OpenAI's error
//! shape (`{"error": {"message", "type", "code"}}`) with its HTTP status.

use std::time::Duration;

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use pdbridge_common::reason::Reason;
use serde_json::json;

use super::verdict;
use crate::{engine::EngineError, openai};

#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    ContextLength(String),
    #[error("the model `{0}` does not exist; this server serves `{1}`")]
    ModelNotFound(String, String),
    #[error("decode engine is not ready")]
    EngineUnavailable,
    #[error("decode engine refused the request: {0}")]
    EngineRefused(String),
    #[error("decode engine failed: {0}")]
    Engine(String),
    #[error("{limit} requests are already pending; retry later")]
    Overloaded { limit: usize },
    #[error("not answered within front.request_timeout ({0:?})")]
    Timeout(Duration),
    /// A body that is not JSON, or larger than `front.max_body_bytes` (axum's status: 400, 413, 415).
    #[error("request body: {1}")]
    Body(StatusCode, String),
    /// `X-PD-Bridge-Mode: bridge` and the bridge could not be used.
    #[error("bridge required but unavailable: {reason}{}", if detail.is_empty() { String::new() } else { format!(" ({detail})") })]
    BridgeRequired { reason: Reason, detail: String },
}

impl From<openai::InvalidRequest> for FrontError {
    fn from(e: openai::InvalidRequest) -> Self {
        FrontError::BadRequest(e.0)
    }
}

impl From<openai::ContextLengthExceeded> for FrontError {
    fn from(e: openai::ContextLengthExceeded) -> Self {
        FrontError::ContextLength(e.0)
    }
}

impl From<EngineError> for FrontError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::NotReady | EngineError::SpecOnly => FrontError::EngineUnavailable,
            EngineError::BadRequest(m) => FrontError::EngineRefused(m),
            other => FrontError::Engine(other.to_string()),
        }
    }
}

impl FrontError {
    /// HTTP status, OpenAI error type and code.
    fn shape(&self) -> (StatusCode, &'static str, Option<&'static str>) {
        match self {
            FrontError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            FrontError::ContextLength(_) => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded"))
            }
            FrontError::Body(status, _) => (*status, "invalid_request_error", None),
            FrontError::ModelNotFound(..) => (StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found")),
            FrontError::EngineUnavailable => (StatusCode::SERVICE_UNAVAILABLE, "engine_unavailable", None),
            FrontError::EngineRefused(_) | FrontError::Engine(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "engine_error", None)
            }
            FrontError::BridgeRequired { reason, .. } => (
                StatusCode::from_u16(reason.http_status()).unwrap_or(StatusCode::BAD_GATEWAY),
                "bridge_unavailable",
                Some(reason.label()),
            ),
            FrontError::Overloaded { .. } => (StatusCode::TOO_MANY_REQUESTS, "overloaded", None),
            FrontError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout", None),
        }
    }
}

impl IntoResponse for FrontError {
    fn into_response(self) -> Response {
        let (status, kind, code) = self.shape();
        let mut response =
            (status, Json(json!({"error": {"message": self.to_string(), "type": kind, "code": code}}))).into_response();
        if let FrontError::Overloaded { .. } = &self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let FrontError::BridgeRequired { reason, .. } = &self {
            verdict::set(&mut response, &json!({"outcome": "failed", "reason": reason}));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prompt_past_the_context_has_openais_code() {
        let e: FrontError = openai::generation_budget(Some(10), 16, 8190, 8192).unwrap_err().into();
        assert_eq!(e.shape(), (StatusCode::BAD_REQUEST, "invalid_request_error", Some("context_length_exceeded")));
        assert!(e.to_string().contains("plus `max_tokens` (10)"), "{e}");
        let other: FrontError = openai::InvalidRequest("`n` must be …".into()).into();
        assert_eq!(other.shape(), (StatusCode::BAD_REQUEST, "invalid_request_error", None));
    }
}
