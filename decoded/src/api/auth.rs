//! API keys at the front door, as OpenAI clients send them (`Authorization: Bearer <key>`) or
//! Anthropic's (`x-api-key: <key>`).

use std::{collections::HashSet, sync::Arc};

use axum::{
    extract::State,
    http::{HeaderMap, header},
    response::Response,
};
use pdbridge_common::metric;
use sha2::{Digest, Sha256};

use super::{Api, error::FrontError};
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

/// Middleware: a missing or wrong key is a 401 in the API's own shape: OpenAI's
/// `invalid_api_key`, or Anthropic's `authentication_error` on its Messages API.
pub async fn require_api_key(
    State(keys): State<ApiKeys>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if keys.admits(request.headers()) {
        return next.run(request).await;
    }
    metrics::counter!(metric::FRONT_UNAUTHORIZED.name).increment(1);
    Api::at(request.uri().path()).respond(Err(FrontError::Unauthorized))
}
