//! API keys at the front door, as OpenAI clients send them (`Authorization: Bearer <key>`) or
//! Anthropic's (`x-api-key: <key>`).

use std::{collections::HashSet, sync::Arc};

use axum::{
    Json,
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
};
use serde_json::json;
use sha2::{Digest, Sha256};

use super::verdict::metric;
use crate::config::ApiKey;

/// The configured keys, kept as digests so a comparison's timing says nothing
/// about a key's bytes. None configured: everyone is let in.
#[derive(Clone)]
pub struct ApiKeys(Arc<HashSet<[u8; 32]>>);

impl ApiKeys {
    pub fn new(keys: Vec<ApiKey>) -> Self {
        ApiKeys(Arc::new(keys.iter().map(|key| Self::digest(key.expose())).collect()))
    }

    fn digest(key: &str) -> [u8; 32] {
        Sha256::digest(key.as_bytes()).into()
    }

    fn admits(&self, headers: &HeaderMap) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.strip_prefix("Bearer "));
        let anthropic = headers.get("x-api-key").and_then(|value| value.to_str().ok());
        [bearer, anthropic].into_iter().flatten().any(|key| self.0.contains(&Self::digest(key.trim())))
    }
}

/// Middleware: OpenAI's answer to a missing or wrong key is 401, `invalid_api_key`.
pub async fn require_api_key(
    State(keys): State<ApiKeys>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if keys.admits(request.headers()) {
        return next.run(request).await;
    }
    metrics::counter!(metric::UNAUTHORIZED).increment(1);
    let message = "missing or incorrect API key: send `Authorization: Bearer <key>` (or `x-api-key: <key>`) with a key from front.api_keys";
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}});
    (StatusCode::UNAUTHORIZED, Json(body)).into_response()
}
