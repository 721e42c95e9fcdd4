//! Every way the front door refuses or fails a request, in OpenAI's error
//! shape (`{"error": {"message", "type", "code"}}`) with its HTTP status, or in Anthropic's
//! (`{"type": "error", "error": {"type", "message"}}`) on `/v1/messages`.

use std::time::Duration;

use axum::{
    Json,
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
};
use pdbridge_common::reason::Reason;
use serde_json::json;

use super::{InvalidRequest, openai};
use crate::engine::EngineError;
use crate::front::verdict;

#[derive(Debug, thiserror::Error)]
pub enum FrontError {
    #[error("{0}")]
    BadRequest(String),
    #[error(
        "missing or incorrect API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a key from \
         front.api_keys"
    )]
    Unauthorized,
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

impl From<InvalidRequest> for FrontError {
    fn from(e: InvalidRequest) -> Self {
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
            FrontError::Unauthorized => (StatusCode::UNAUTHORIZED, "invalid_request_error", Some("invalid_api_key")),
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

impl FrontError {
    /// The error as Anthropic's API answers it: its type follows the status.
    pub fn into_anthropic_response(self) -> Response {
        let (status, ..) = self.shape();
        let kind = match status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            _ => "api_error",
        };
        let body = json!({"type": "error", "error": {"type": kind, "message": self.to_string()}});
        self.with_headers((status, Json(body)).into_response())
    }

    /// What the response of any shape carries besides its body: `Retry-After` when overloaded,
    /// the verdict of a required bridge that failed.
    fn with_headers(&self, mut response: Response) -> Response {
        if let FrontError::Overloaded { .. } = self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let FrontError::BridgeRequired { reason, .. } = self {
            verdict::set(&mut response, &json!({"outcome": "failed", "reason": reason}));
        }
        response
    }
}

impl IntoResponse for FrontError {
    fn into_response(self) -> Response {
        let (status, kind, code) = self.shape();
        let body = json!({"error": {"message": self.to_string(), "type": kind, "code": code}});
        self.with_headers((status, Json(body)).into_response())
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
        let other: FrontError = InvalidRequest("`n` must be …".into()).into();
        assert_eq!(other.shape(), (StatusCode::BAD_REQUEST, "invalid_request_error", None));
    }

    /// On `/v1/messages` the same errors come in Anthropic's shape, with their status and headers.
    #[tokio::test]
    async fn on_anthropics_api_an_error_has_anthropics_shape() {
        for (error, status, kind) in [
            (FrontError::Overloaded { limit: 3 }, 429, "rate_limit_error"),
            (FrontError::BadRequest("`max_tokens` is required".into()), 400, "invalid_request_error"),
            (FrontError::EngineUnavailable, 503, "overloaded_error"),
        ] {
            let message = error.to_string();
            let overloaded = matches!(error, FrontError::Overloaded { .. });
            let response = error.into_anthropic_response();
            assert_eq!(response.status().as_u16(), status);
            assert_eq!(response.headers().contains_key(header::RETRY_AFTER), overloaded);
            let body = axum::body::to_bytes(response.into_body(), 1 << 16).await.unwrap();
            let body: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert_eq!(body, json!({"type": "error", "error": {"type": kind, "message": message}}));
        }
    }
}
