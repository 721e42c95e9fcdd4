//! The OpenAI-compatible front door (`/v1/chat/completions`, `/v1/completions`,
//! `/v1/models`), which decides per request whether to bridge or to serve
//! natively and says which in the `X-PD-Bridge` header.
//!
//! Per request: tokenize with the decoder's own tokenizer, look up the cached
//! prefix, and — when the uncached whole blocks reach `front.min_bridge_tokens`
//! and prefilld is healthy — ask prefilld to prefill and push them, then
//! generate from the store. The verdict is `bridged` (every whole block came
//! from the store), `partial` (a prefix did), `cached` (the store already had
//! them), or `native` with a reason. A native answer never claims `bridged`:
//! the verdict's covered tokens are the ones the engine actually restored.

use std::{
    collections::{BTreeMap, HashSet},
    convert::Infallible,
    sync::Arc,
    time::Duration,
};

use axum::{
    Json, Router,
    extract::State,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response, Sse, sse::Event},
    routing::{get, post},
};
use pdbridge_common::{
    block::{self, BlockKey},
    proto::{
        Outcome, PrefillRequest, outcome::Status as OutcomeStatus, prefill_event::Event as PrefillEventKind,
        prefiller_client::PrefillerClient,
    },
    telemetry,
    tls::{self, Tls},
};
use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::{
    config::{ApiKey, FrontConfig},
    engine::{Engine, EngineError, GenerateEvent, GenerateRequest, GenerateSummary, TokenizeInput},
    inflight::{Bridges, Claim},
    openai,
    store::Store,
};

/// The request header that picks a mode for A/B runs and debugging.
const MODE_HEADER: &str = "x-pd-bridge-mode";
/// The response header carrying the verdict.
const VERDICT_HEADER: &str = "x-pd-bridge";

#[derive(Clone)]
struct Front {
    engine: Option<Engine>,
    store: Arc<Store>,
    config: Arc<FrontConfig>,
    /// How prefilld reaches this decoder's CacheStore.
    advertise_addr: String,
    prefilld: Option<Channel>,
    /// Bridges in progress, shared by concurrent requests for the same blocks.
    bridges: Bridges,
    /// One permit per request inside the front door (`front.max_pending_requests`).
    admission: Arc<Semaphore>,
}

/// A request let in: its admission permit and its deadline, both carried to
/// the end of a streamed answer.
struct Admitted {
    permit: OwnedSemaphorePermit,
    deadline: Instant,
}

pub fn router(
    engine: Option<Engine>,
    store: Arc<Store>,
    config: FrontConfig,
    advertise_addr: String,
    tls: Option<&Tls>,
    api_keys: Vec<ApiKey>,
) -> Router {
    let prefilld =
        config.prefilld.as_ref().and_then(|addr| match tls::endpoint(addr, tls, config.prefilld_name.as_deref()) {
            Ok(endpoint) => Some(endpoint.tcp_nodelay(true).connect_lazy()),
            Err(e) => {
                tracing::error!(addr, error = %e, "front.prefilld cannot be dialed; bridging disabled");
                None
            }
        });
    let admission = Arc::new(Semaphore::new(config.max_pending_requests));
    let max_body_bytes = config.max_body_bytes;
    let state = Front {
        engine,
        store,
        config: Arc::new(config),
        advertise_addr,
        prefilld,
        bridges: Bridges::default(),
        admission,
    };
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/pd/v1/tokenize", post(tokenize))
        .with_state(state)
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(ApiKeys::new(api_keys), require_api_key))
}

/// The front door's API keys, kept as digests so a comparison's timing says
/// nothing about a key's bytes. None configured: everyone is let in.
#[derive(Clone)]
struct ApiKeys(Arc<HashSet<[u8; 32]>>);

impl ApiKeys {
    fn new(keys: Vec<ApiKey>) -> Self {
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
        bearer.is_some_and(|key| self.0.contains(&Self::digest(key.trim())))
    }
}

/// OpenAI's answer to a missing or wrong key: 401, `invalid_api_key`.
async fn require_api_key(
    State(keys): State<ApiKeys>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    if keys.admits(request.headers()) {
        return next.run(request).await;
    }
    metrics::counter!("pdbridge_front_unauthorized_total").increment(1);
    let message = "missing or incorrect API key: send `Authorization: Bearer <key>` with a key from front.api_keys";
    let body = json!({"error": {"message": message, "type": "invalid_request_error", "code": "invalid_api_key"}});
    (StatusCode::UNAUTHORIZED, Json(body)).into_response()
}

// ---------------------------------------------------------------------------
// Errors and verdicts.
// ---------------------------------------------------------------------------

#[derive(Debug, thiserror::Error)]
enum FrontError {
    #[error("{0}")]
    BadRequest(String),
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
    BridgeRequired { reason: &'static str, detail: String },
}

impl From<openai::InvalidRequest> for FrontError {
    fn from(e: openai::InvalidRequest) -> Self {
        FrontError::BadRequest(e.0)
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

impl IntoResponse for FrontError {
    fn into_response(self) -> Response {
        let (status, kind) = match &self {
            FrontError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request_error"),
            FrontError::Body(status, _) => (*status, "invalid_request_error"),
            FrontError::ModelNotFound(..) => (StatusCode::NOT_FOUND, "invalid_request_error"),
            FrontError::EngineUnavailable => (StatusCode::SERVICE_UNAVAILABLE, "engine_unavailable"),
            FrontError::EngineRefused(_) | FrontError::Engine(_) => (StatusCode::INTERNAL_SERVER_ERROR, "engine_error"),
            FrontError::BridgeRequired { .. } => (StatusCode::BAD_GATEWAY, "bridge_unavailable"),
            FrontError::Overloaded { .. } => (StatusCode::TOO_MANY_REQUESTS, "overloaded"),
            FrontError::Timeout(_) => (StatusCode::GATEWAY_TIMEOUT, "timeout"),
        };
        let code = match &self {
            FrontError::ModelNotFound(..) => Some("model_not_found"),
            _ => None,
        };
        let mut response =
            (status, Json(json!({"error": {"message": self.to_string(), "type": kind, "code": code}}))).into_response();
        if let FrontError::Overloaded { .. } = &self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if let FrontError::BridgeRequired { reason, .. } = &self {
            let verdict = json!({"outcome": "failed", "reason": reason}).to_string();
            response.headers_mut().insert(VERDICT_HEADER, HeaderValue::from_str(&verdict).expect("ascii json"));
        }
        response
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Auto,
    Native,
    Bridge,
}

/// What the response's `X-PD-Bridge` header says.
#[derive(Debug, Clone, Serialize)]
struct Verdict {
    outcome: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    reason: Option<&'static str>,
    /// What prefilld said when the bridge fell short (e.g. which layer of an unsupported model, and why).
    #[serde(skip_serializing_if = "Option::is_none")]
    detail: Option<String>,
    prompt_tokens: u32,
    /// Prompt tokens restored from the store.
    cached_tokens: u32,
    /// Blocks this request pushed through the bridge, of `block_tokens` each.
    blocks: u32,
    block_tokens: u32,
    bytes: u64,
    timings_ms: BTreeMap<String, f64>,
}

/// The plan for one request, before generation.
struct Plan {
    verdict: Verdict,
    /// Store blocks the engine restores (a prefix of the prompt's keys).
    blocks: usize,
}

impl Plan {
    /// Restores only the first `leased` blocks (the rest were evicted since
    /// planning), saying so in the verdict.
    fn restrict_to(&mut self, leased: usize, total: usize, b: usize) {
        if leased >= self.blocks {
            return;
        }
        self.blocks = leased;
        let verdict = &mut self.verdict;
        verdict.cached_tokens = (leased * b).min(verdict.prompt_tokens as usize - 1) as u32;
        verdict.outcome = match leased {
            0 => "native",
            n if n < total && verdict.outcome == "bridged" => "partial",
            _ => verdict.outcome,
        };
        verdict.reason = verdict.reason.or(Some("evicted"));
    }
}

/// Unusable store blocks one request may quarantine before it fails.
const MAX_UNUSABLE_BLOCKS: usize = 2;

// ---------------------------------------------------------------------------
// Handlers.
// ---------------------------------------------------------------------------

async fn models(State(front): State<Front>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": front.config.model_name, "object": "model", "owned_by": "pd-bridge"}]}),
    )
}

/// The decoder's token ids for a chat or a prompt, for pre-warm clients
/// (`pdbridge warm`) that must bridge exactly what a later request will hit.
/// A JSON request body; what axum refuses (not JSON, over `front.max_body_bytes`, no
/// content type) is answered in OpenAI's error shape with axum's status.
struct Body(Value);

impl<S: Send + Sync> axum::extract::FromRequest<S> for Body {
    type Rejection = FrontError;

    async fn from_request(request: axum::extract::Request, state: &S) -> Result<Self, FrontError> {
        match Json::<Value>::from_request(request, state).await {
            Ok(Json(value)) => Ok(Body(value)),
            Err(rejection) => Err(FrontError::Body(rejection.status(), rejection.body_text())),
        }
    }
}

async fn tokenize(State(front): State<Front>, Body(body): Body) -> Result<Json<Value>, FrontError> {
    let engine = front.engine.as_ref().ok_or(FrontError::EngineUnavailable)?;
    let input = match (body.get("messages").filter(|m| m.is_array()), body.get("prompt").and_then(Value::as_str)) {
        (Some(messages), None) => TokenizeInput::Chat { messages, add_generation_prompt: true },
        (None, Some(prompt)) => TokenizeInput::Text { prompt },
        _ => return Err(FrontError::BadRequest("give either `messages` (an array) or `prompt` (a string)".into())),
    };
    let tokens = engine.tokenize(input).await?;
    let block_tokens = engine.info()?.spec.block_tokens;
    Ok(Json(json!({"tokens": tokens, "block_tokens": block_tokens})))
}

async fn chat(State(front): State<Front>, headers: HeaderMap, Body(body): Body) -> Result<Response, FrontError> {
    let messages = openai::chat_messages(&body)?;
    let input = TokenizeInput::Chat { messages: &messages, add_generation_prompt: true };
    front.complete(&headers, &body, input, Kind::Chat).await
}

async fn completions(State(front): State<Front>, headers: HeaderMap, Body(body): Body) -> Result<Response, FrontError> {
    let prompt =
        body.get("prompt").and_then(Value::as_str).ok_or(FrontError::BadRequest("`prompt` must be a string".into()))?;
    front.complete(&headers, &body, TokenizeInput::Text { prompt }, Kind::Text).await
}

#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Text,
}

fn mode(headers: &HeaderMap) -> Result<Mode, FrontError> {
    match headers.get(MODE_HEADER).map(|v| v.to_str().unwrap_or("").trim().to_ascii_lowercase()) {
        None => Ok(Mode::Auto),
        Some(v) if v == "auto" => Ok(Mode::Auto),
        Some(v) if v == "native" => Ok(Mode::Native),
        Some(v) if v == "bridge" => Ok(Mode::Bridge),
        Some(v) => Err(FrontError::BadRequest(format!("{MODE_HEADER} must be auto, native or bridge, not {v:?}"))),
    }
}

impl Front {
    /// Admits a request (or answers 429) and serves it within
    /// `front.request_timeout` (or answers 504; dropping the unfinished work
    /// cancels its bridge and its generation).
    async fn complete(
        &self,
        headers: &HeaderMap,
        body: &Value,
        input: TokenizeInput<'_>,
        kind: Kind,
    ) -> Result<Response, FrontError> {
        // A client asking for another model must not be answered by this one.
        if let Some(asked) = body.get("model").and_then(Value::as_str).filter(|m| *m != self.config.model_name) {
            return Err(FrontError::ModelNotFound(asked.to_owned(), self.config.model_name.clone()));
        }
        let admitted = self
            .admission
            .clone()
            .try_acquire_owned()
            .map_err(|_| FrontError::Overloaded { limit: self.config.max_pending_requests })?;
        let deadline = Instant::now() + self.config.request_timeout;
        let served = self.serve(headers, body, input, kind, Admitted { permit: admitted, deadline });
        tokio::time::timeout_at(deadline, served).await.unwrap_or(Err(FrontError::Timeout(self.config.request_timeout)))
    }

    async fn serve(
        &self,
        headers: &HeaderMap,
        body: &Value,
        input: TokenizeInput<'_>,
        kind: Kind,
        admitted: Admitted,
    ) -> Result<Response, FrontError> {
        let started = Instant::now();
        let mode = mode(headers)?;
        let sampling = openai::sampling(body)?;
        let engine = self.engine.as_ref().ok_or(FrontError::EngineUnavailable)?;
        let _in_flight = telemetry::InFlight::enter("pdbridge_front_requests_in_flight");
        let tokens = engine.tokenize(input).await?;
        if tokens.is_empty() {
            return Err(FrontError::BadRequest("the prompt tokenizes to nothing".into()));
        }
        let tokenized_ms = ms(started);
        // One spec for the whole request: its keys plan the bridge and pick the blocks to restore.
        let info = engine.info()?;
        let max_tokens = openai::generation_budget(
            sampling.max_tokens,
            self.config.default_max_tokens,
            tokens.len(),
            info.spec.max_context,
        )?;
        let b = info.spec.block_tokens as usize;
        let keys = block::keys(&info.spec.spec_fingerprint, &tokens, b);
        // A block the adapter finds unusable (missing, rotten) is quarantined
        // and the request planned again: bridged anew, or served without it.
        let mut unusable = 0;
        let (mut plan, lease, mut generation) = loop {
            let mut plan = self.plan(&tokens, &keys, b, mode).await?;
            let lease = self.store.lease(&keys[..plan.blocks]);
            // Evicted between planning and leasing: serve what is still there, honestly.
            plan.restrict_to(lease.paths().len(), keys.len(), b);
            let request = GenerateRequest {
                tokens: &tokens,
                blocks: lease.paths(),
                spec_fingerprint: &info.spec.spec_fingerprint,
                max_tokens,
                temperature: sampling.temperature,
                top_p: sampling.top_p,
                seed: sampling.seed,
                stop: &sampling.stop,
            };
            // The lease lives until the generation ends: the adapter reads the
            // block files on its own schedule, after this request is written.
            let mut generation = engine.generate(&request).await?;
            match generation.started().await {
                Ok(()) => break (plan, lease, generation),
                Err(EngineError::BlockUnusable { block, message }) if unusable < MAX_UNUSABLE_BLOCKS => {
                    tracing::warn!(block, error = message, "quarantining an unusable store block");
                    unusable += 1;
                    drop(lease);
                    if let Err(e) = self.store.quarantine_block(&keys[block]) {
                        tracing::error!(block, error = %e, "cannot quarantine block");
                    }
                }
                Err(e) => return Err(e.into()),
            }
        };
        plan.verdict.timings_ms.insert("tokenize".into(), tokenized_ms);
        let id = pdbridge_common::request_id::new("chatcmpl");
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        let model = self.config.model_name.clone();
        plan.verdict.timings_ms.insert("generate_start".into(), ms(started));

        if sampling.stream {
            let verdict = plan.verdict.clone();
            let (tx, rx) = tokio::sync::mpsc::channel::<Event>(16);
            tokio::spawn(async move {
                // Both held until the last event: the blocks stay leased, the request admitted.
                let _lease = lease;
                let Admitted { permit: _permit, deadline } = admitted;
                let mut first = true;
                loop {
                    let event = match tokio::time::timeout_at(deadline, generation.next()).await {
                        Ok(Some(event)) => event,
                        Ok(None) => break,
                        Err(_) => Err(EngineError::Internal("front.request_timeout passed".into())),
                    };
                    let data = match event {
                        Ok(GenerateEvent::Token { text, .. }) => {
                            if std::mem::take(&mut first) {
                                record_ttft(&verdict, started);
                            }
                            chunk_json(kind, &id, created, &model, Some(&text), None)
                        }
                        Ok(GenerateEvent::Done(summary)) => {
                            if let Err(e) = check_restored(&verdict, &summary) {
                                json!({"error": {"message": e.to_string(), "type": "engine_error"}})
                            } else {
                                record_outcome(&verdict);
                                let mut last =
                                    chunk_json(kind, &id, created, &model, None, Some(&summary.finish_reason));
                                last["usage"] = usage(&summary);
                                // The header left before the engine ran: its stages ride here.
                                last["pd_bridge"] = json!({"engine_timings_ms": summary.timings_ms});
                                last
                            }
                        }
                        Err(e) => json!({"error": {"message": e.to_string(), "type": "engine_error"}}),
                    };
                    let failed = data.get("error").is_some();
                    if tx.send(Event::default().data(data.to_string())).await.is_err() || failed {
                        return;
                    }
                }
                let _ = tx.send(Event::default().data("[DONE]")).await;
            });
            let stream =
                tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok::<_, Infallible>);
            let mut response = Sse::new(stream).into_response();
            set_verdict(&mut response, &plan.verdict);
            return Ok(response);
        }

        let mut text = String::new();
        let summary = loop {
            match generation.next().await {
                Some(Ok(GenerateEvent::Token { text: piece, .. })) => {
                    if text.is_empty() {
                        record_ttft(&plan.verdict, started);
                        plan.verdict.timings_ms.insert("first_token".into(), ms(started));
                    }
                    text.push_str(&piece);
                }
                Some(Ok(GenerateEvent::Done(summary))) => {
                    text.push_str(&summary.text);
                    break summary;
                }
                Some(Err(e)) => return Err(e.into()),
                None => return Err(FrontError::Engine("generation ended without a summary".into())),
            }
        };
        drop(lease);
        plan.verdict.timings_ms.insert("total".into(), ms(started));
        for (stage, value) in &summary.timings_ms {
            plan.verdict.timings_ms.insert(format!("engine_{stage}"), *value);
        }
        check_restored(&plan.verdict, &summary)?;
        record_outcome(&plan.verdict);
        record_stages(&plan.verdict, &summary);
        let body = match kind {
            Kind::Chat => json!({
                "id": id, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": summary.finish_reason}],
                "usage": usage(&summary),
            }),
            Kind::Text => json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "finish_reason": summary.finish_reason}],
                "usage": usage(&summary),
            }),
        };
        let mut response = Json(body).into_response();
        set_verdict(&mut response, &plan.verdict);
        Ok(response)
    }
}

impl Front {
    /// Decides how this prompt is served and, when bridging, runs the bridge.
    async fn plan(&self, tokens: &[u32], keys: &[BlockKey], b: usize, mode: Mode) -> Result<Plan, FrontError> {
        let verdict = |outcome, reason, restored: usize| Verdict {
            outcome,
            reason,
            detail: None,
            prompt_tokens: tokens.len() as u32,
            cached_tokens: (restored * b).min(tokens.len() - 1) as u32,
            blocks: 0,
            block_tokens: b as u32,
            bytes: 0,
            timings_ms: BTreeMap::new(),
        };
        let plain = |outcome, reason, restored| Plan { verdict: verdict(outcome, reason, restored), blocks: restored };
        if mode == Mode::Native {
            return Ok(plain("native", Some("requested"), 0));
        }
        // A request bridging our first missing block right now is waited for,
        // not duplicated; then the store is asked again.
        let mut waited: Option<Instant> = None;
        let (cached, _claim) = loop {
            let cached = self.store.longest_prefix(keys);
            if cached == keys.len() {
                break (cached, None);
            }
            match self.bridges.claim(&keys[cached..]) {
                Claim::Produce(claim) => break (cached, Some(claim)),
                Claim::Wait(ended) => {
                    waited.get_or_insert_with(Instant::now);
                    ended.wait().await;
                }
            }
        };
        let shared = |mut plan: Plan| {
            if let Some(since) = waited {
                plan.verdict.timings_ms.insert("shared_bridge_wait".into(), ms(since));
            }
            plan
        };
        let lookup = if cached > 0 { "hit" } else { "miss" };
        metrics::counter!("pdbridge_store_lookups_total", "outcome" => lookup).increment(1);
        let missing_tokens = (keys.len() - cached) * b;
        // Why the bridge is not used for the missing blocks, if it is not.
        let refusal = if missing_tokens == 0 {
            Some(if cached > 0 { None } else { Some("short_prompt") })
        } else if !self.config.bridge {
            Some(Some("disabled"))
        } else if mode == Mode::Auto && missing_tokens < self.config.min_bridge_tokens as usize {
            Some(Some("short_prompt"))
        } else if !self.prefilld_serving().await {
            Some(Some("prefill_unavailable"))
        } else {
            None
        };
        if let Some(reason) = refusal {
            if let (Mode::Bridge, Some(reason)) = (mode, reason) {
                return Err(FrontError::BridgeRequired { reason, detail: String::new() });
            }
            let outcome = if cached > 0 { "cached" } else { "native" };
            return Ok(shared(plain(outcome, reason, cached)));
        }

        let started = Instant::now();
        let bridged = self.bridge(tokens, cached as u32).await;
        let now_cached = self.store.longest_prefix(keys);
        // Why the bridge fell short, if it did: its failure, or prefilld's reason for a partial outcome.
        let shortfall = match &bridged {
            Err(failure) => Some(failure.reason),
            Ok(outcome) if outcome.status() == OutcomeStatus::Partial => Some(reason_of(&outcome.reason)),
            Ok(_) => None,
        };
        let (outcome, reason) = if now_cached == keys.len() && now_cached > cached {
            ("bridged", None)
        } else if now_cached > cached {
            ("partial", shortfall)
        } else {
            (if cached > 0 { "cached" } else { "native" }, shortfall.or(Some("transfer_failed")))
        };
        if let Err(failure) = &bridged {
            tracing::warn!(reason = failure.reason, detail = failure.detail, outcome, "bridge fell short");
            if mode == Mode::Bridge && outcome != "bridged" {
                return Err(FrontError::BridgeRequired { reason: failure.reason, detail: failure.detail.clone() });
            }
        }
        let mut plan = shared(plain(outcome, reason, now_cached));
        if let Err(failure) = &bridged {
            plan.verdict.detail = Some(header_safe(&failure.detail));
        }
        plan.verdict.timings_ms.insert("bridge".into(), ms(started));
        match bridged {
            Ok(outcome) => {
                plan.verdict.blocks = outcome.blocks_committed;
                plan.verdict.bytes = outcome.bytes;
                for (stage, value) in outcome.stage_ms {
                    plan.verdict.timings_ms.insert(format!("prefill_{stage}"), value);
                }
            }
            // Blocks that landed before the fault still count: the store
            // says which, the last progress report how many bytes were sent.
            Err(failure) => {
                plan.verdict.blocks = now_cached.saturating_sub(cached) as u32;
                plan.verdict.bytes = failure.bytes_sent;
            }
        }
        Ok(plan)
    }

    /// Whether prefilld's health says its Prefiller is SERVING.
    async fn prefilld_serving(&self) -> bool {
        let Some(channel) = self.prefilld.clone() else { return false };
        let mut health = HealthClient::new(channel);
        let check = health.check(HealthCheckRequest { service: "pdbridge.v1.Prefiller".into() });
        matches!(
            tokio::time::timeout(Duration::from_secs(2), check).await,
            Ok(Ok(reply)) if reply.get_ref().status() == ServingStatus::Serving
        )
    }

    /// Asks prefilld to prefill and push the missing blocks; returns its
    /// outcome or why there is none.
    async fn bridge(&self, tokens: &[u32], first_block: u32) -> Result<Outcome, BridgeFailure> {
        let channel =
            self.prefilld.clone().ok_or_else(|| BridgeFailure::new("prefill_unavailable", "no prefilld configured"))?;
        let deadline = self.config.prefill_deadline_base
            + self.config.prefill_deadline_per_1k_tokens.mul_f64(tokens.len() as f64 / 1000.0);
        let request = PrefillRequest {
            request_id: String::new(),
            token_ids: tokens.to_vec(),
            decoder_addr: self.advertise_addr.clone(),
            first_block: Some(first_block),
        };
        let mut bytes_sent = 0;
        let run = async {
            let mut events = PrefillerClient::new(channel)
                .max_decoding_message_size(64 << 20)
                .max_encoding_message_size(64 << 20)
                .prefill(request)
                .await
                .map_err(|s| BridgeFailure::new("prefill_unavailable", s.message()))?
                .into_inner();
            while let Some(event) =
                events.message().await.map_err(|s| BridgeFailure::new("transfer_failed", s.message()))?
            {
                match event.event {
                    Some(PrefillEventKind::Progress(progress)) => bytes_sent = progress.bytes_sent,
                    Some(PrefillEventKind::Outcome(outcome)) => {
                        return match outcome.status() {
                            OutcomeStatus::Bridged | OutcomeStatus::Partial => Ok(outcome),
                            _ => {
                                Err(BridgeFailure::new(reason_of(&outcome.reason), &outcome.reason).sent(outcome.bytes))
                            }
                        };
                    }
                    None => {}
                }
            }
            Err(BridgeFailure::new("transfer_failed", "prefill stream ended without an outcome"))
        };
        let result = match tokio::time::timeout(deadline, run).await {
            Ok(result) => result,
            Err(_) => Err(BridgeFailure::new("timeout", &format!("no outcome within {deadline:?}"))),
        };
        result.map_err(|failure| if failure.bytes_sent == 0 { failure.sent(bytes_sent) } else { failure })
    }
}

/// Why a bridge produced no outcome, and what it had sent by then.
struct BridgeFailure {
    reason: &'static str,
    detail: String,
    bytes_sent: u64,
}

impl BridgeFailure {
    fn new(reason: &'static str, detail: &str) -> Self {
        Self { reason, detail: detail.to_owned(), bytes_sent: 0 }
    }

    fn sent(self, bytes_sent: u64) -> Self {
        Self { bytes_sent, ..self }
    }
}

/// A verdict reason for prefilld's outcome reason ("<reason>: <detail>").
fn reason_of(outcome_reason: &str) -> &'static str {
    match outcome_reason.split(':').next().unwrap_or_default() {
        "spec_mismatch" => "spec_mismatch",
        "unsupported_model" => "unsupported_model",
        "timeout" => "timeout",
        "decoder_unavailable" | "bundle_failed" => "decoder_unreachable",
        "prefill_failed" => "prefill_failed",
        _ => "transfer_failed",
    }
}

/// `text` as it can travel in a header: printable ASCII, at most 400 characters.
fn header_safe(text: &str) -> String {
    const MAX: usize = 400;
    let mut out: String = text.chars().map(|c| if c == ' ' || c.is_ascii_graphic() { c } else { '?' }).collect();
    if out.len() > MAX {
        out.truncate(MAX - 3);
        out.push_str("...");
    }
    out
}

/// The engine must have restored exactly the tokens the verdict claims.
fn check_restored(verdict: &Verdict, summary: &GenerateSummary) -> Result<(), FrontError> {
    if summary.cached_tokens != verdict.cached_tokens {
        return Err(FrontError::Engine(format!(
            "engine restored {} tokens, the verdict says {}",
            summary.cached_tokens, verdict.cached_tokens
        )));
    }
    Ok(())
}

fn set_verdict(response: &mut Response, verdict: &Verdict) {
    let json = serde_json::to_string(verdict).expect("verdict serializes");
    response.headers_mut().insert(VERDICT_HEADER, HeaderValue::from_str(&json).expect("ascii json"));
}

/// Stages of a front-door request, as `pdbridge_stage_seconds{stage}`.
fn record_stages(verdict: &Verdict, summary: &GenerateSummary) {
    let ms = |key: &str| verdict.timings_ms.get(key).copied();
    for (stage, value) in [
        ("tokenize", ms("tokenize")),
        ("bridge", ms("bridge")),
        ("restore", summary.timings_ms.get("restore").copied()),
        ("tail_prefill", summary.timings_ms.get("prefill").copied()),
        ("first_token", summary.timings_ms.get("first_token").copied()),
    ] {
        if let Some(value) = value {
            telemetry::record_stage(stage, value / 1e3);
        }
    }
}

fn record_outcome(verdict: &Verdict) {
    metrics::counter!(
        "pdbridge_bridge_outcomes_total",
        "outcome" => verdict.outcome,
        "reason" => verdict.reason.unwrap_or("none")
    )
    .increment(1);
}

fn record_ttft(verdict: &Verdict, started: Instant) {
    metrics::histogram!("pdbridge_ttft_seconds", "outcome" => verdict.outcome).record(started.elapsed().as_secs_f64());
}

fn usage(summary: &GenerateSummary) -> Value {
    json!({
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "total_tokens": summary.prompt_tokens + summary.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": summary.cached_tokens},
    })
}

fn chunk_json(kind: Kind, id: &str, created: u64, model: &str, text: Option<&str>, finish: Option<&str>) -> Value {
    match kind {
        Kind::Chat => json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": text.map_or(json!({}), |t| json!({"content": t})), "finish_reason": finish}],
        }),
        Kind::Text => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text.unwrap_or(""), "finish_reason": finish}],
        }),
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_detail_always_fits_in_a_header() {
        let said = "unsupported_model: layer 1: ArraysCache: recurrent state → not rows\n";
        let safe = header_safe(said);
        assert_eq!(safe, "unsupported_model: layer 1: ArraysCache: recurrent state ? not rows?");
        let long = header_safe(&"x".repeat(1000));
        assert_eq!(long.len(), 400);
        assert!(long.ends_with("..."));
        let verdict = Verdict {
            outcome: "native",
            reason: Some("unsupported_model"),
            detail: Some(safe),
            prompt_tokens: 1,
            cached_tokens: 0,
            blocks: 0,
            block_tokens: 16,
            bytes: 0,
            timings_ms: BTreeMap::new(),
        };
        assert!(HeaderValue::from_str(&serde_json::to_string(&verdict).unwrap()).is_ok());
    }
}
