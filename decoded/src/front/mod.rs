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
//!
//! This module serves requests; the OpenAI wire format is `crate::openai`,
//! the decision `policy`, the prefilld client `prefiller`, the verdict and its
//! metrics `verdict`, API keys `auth`, errors `error`.

mod auth;
mod error;
mod policy;
mod prefiller;
pub mod verdict;

use std::{convert::Infallible, sync::Arc};

use axum::{
    Json, Router,
    extract::State,
    http::HeaderMap,
    response::{IntoResponse, Response, Sse, sse::Event},
    routing::{get, post},
};
use pdbridge_common::{
    block::{self, BlockKey},
    proto::outcome::Status as OutcomeStatus,
    reason::Reason,
    spec, telemetry,
    tls::Tls,
};
use serde_json::{Value, json};
use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    time::Instant,
};

use crate::{
    config::{ApiKey, FrontConfig},
    engine::{Engine, EngineError, GenerateEvent, GenerateRequest, GenerateSummary, TokenizeInput},
    inflight::{Bridges, Claim},
    openai::{self, Kind},
    store::{self, Store},
};
use error::FrontError;
use policy::{Decision, Mode, Situation, Step};
use prefiller::Prefiller;
use verdict::{Outcome, Plan, Verdict, header_safe, metric, record_outcome, record_stages, record_ttft};

/// The request header that picks a mode for A/B runs and debugging.
const MODE_HEADER: &str = "x-pd-bridge-mode";

#[derive(Clone)]
struct Front {
    engine: Option<Engine>,
    store: Arc<Store>,
    config: Arc<FrontConfig>,
    prefiller: Arc<Prefiller>,
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
    let prefiller = Arc::new(Prefiller::new(&config, tls, advertise_addr));
    let admission = Arc::new(Semaphore::new(config.max_pending_requests));
    let max_body_bytes = config.max_body_bytes;
    let state = Front { engine, store, config: Arc::new(config), prefiller, bridges: Bridges::default(), admission };
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/pd/v1/tokenize", post(tokenize))
        .with_state(state)
        .layer(axum::extract::DefaultBodyLimit::max(max_body_bytes))
        .layer(axum::middleware::from_fn_with_state(auth::ApiKeys::new(api_keys), auth::require_api_key))
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
        (Some(messages), None) => {
            TokenizeInput::Chat { messages, add_generation_prompt: true, tools: openai::tools(&body)? }
        }
        (None, Some(prompt)) => TokenizeInput::Text { prompt },
        _ => return Err(FrontError::BadRequest("give either `messages` (an array) or `prompt` (a string)".into())),
    };
    let tokens = engine.tokenize(input).await?;
    let block_tokens = engine.info()?.spec.block_tokens;
    Ok(Json(json!({"tokens": tokens, "block_tokens": block_tokens})))
}

async fn chat(State(front): State<Front>, headers: HeaderMap, Body(body): Body) -> Result<Response, FrontError> {
    let messages = openai::chat_messages(&body)?;
    let tools = openai::tools(&body)?;
    let input = TokenizeInput::Chat { messages: &messages, add_generation_prompt: true, tools };
    front.complete(&headers, &body, input, Kind::Chat).await
}

async fn completions(State(front): State<Front>, headers: HeaderMap, Body(body): Body) -> Result<Response, FrontError> {
    let prompt =
        body.get("prompt").and_then(Value::as_str).ok_or(FrontError::BadRequest("`prompt` must be a string".into()))?;
    front.complete(&headers, &body, TokenizeInput::Text { prompt }, Kind::Text).await
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
        let sampling = openai::sampling(body, kind)?;
        let tools = match input {
            TokenizeInput::Chat { tools, .. } => tools.cloned(),
            TokenizeInput::Text { .. } => None,
        };
        let engine = self.engine.as_ref().ok_or(FrontError::EngineUnavailable)?;
        let _in_flight = telemetry::InFlight::enter(metric::IN_FLIGHT);
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
        let keys = spec::block_keys(&info.spec, &tokens);
        // A block the adapter finds unusable (missing, rotten) is quarantined
        // and the request planned again: bridged anew, or served without it.
        let mut unusable = 0;
        let (mut plan, lease, generation) = loop {
            let mut plan = self.plan(&tokens, &keys, &info.spec.spec_fingerprint, b, mode).await?;
            let lease = self.store.lease(&keys[..plan.blocks]);
            // Evicted between planning and leasing: serve what is still there, honestly.
            plan.restrict_to(lease.paths().len(), keys.len(), b);
            let request = GenerateRequest {
                tokens: &tokens,
                blocks: lease.paths(),
                tail: plan.tail.as_ref().map(|tail| tail.path()),
                spec_fingerprint: &info.spec.spec_fingerprint,
                max_tokens,
                temperature: sampling.temperature,
                top_p: sampling.top_p,
                seed: sampling.seed,
                stop: &sampling.stop,
                presence_penalty: sampling.presence_penalty,
                frequency_penalty: sampling.frequency_penalty,
                logprobs: sampling.logprobs,
                tools: tools.as_ref(),
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
                    // Past the whole blocks it is the tail, which dies with its plan.
                    if let Some(key) = keys.get(block)
                        && let Err(e) = self.store.quarantine_block(key)
                    {
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
        // Every further answer (`n` > 1) restores the same leased blocks and tail.
        let choices = Choices {
            engine: engine.clone(),
            tokens,
            blocks: lease.paths().to_vec(),
            tail: plan.tail.take(),
            spec_fingerprint: info.spec.spec_fingerprint.clone(),
            max_tokens,
            sampling,
            tools,
        };

        if choices.sampling.stream {
            let verdict = plan.verdict.clone();
            let (tx, rx) = tokio::sync::mpsc::channel::<Event>(16);
            tokio::spawn(async move {
                // All held until the last event: the blocks stay leased, the request admitted.
                let _lease = lease;
                let Admitted { permit: _permit, deadline } = admitted;
                let ids = (id.as_str(), created, model.as_str());
                let (mut first, mut completion_tokens) = (true, 0);
                let mut generation = Some(generation);
                for index in 0..choices.sampling.n {
                    let mut calls_sent = 0;
                    let mut generation = match generation.take() {
                        Some(started) => started,
                        None => match choices.start(index).await {
                            Ok(started) => started,
                            Err(e) => {
                                let _ = tx.send(Event::default().data(stream_error(e).to_string())).await;
                                return;
                            }
                        },
                    };
                    loop {
                        let event = match tokio::time::timeout_at(deadline, generation.next()).await {
                            Ok(Some(event)) => event,
                            Ok(None) => break,
                            Err(_) => Err(EngineError::Internal("front.request_timeout passed".into())),
                        };
                        let data = match event {
                            Ok(GenerateEvent::Token { text, logprob, tool_calls, .. }) => {
                                if std::mem::take(&mut first) {
                                    record_ttft(&verdict, started);
                                }
                                let text = Some(text.as_str()).filter(|t| !t.is_empty() || tool_calls.is_empty());
                                let mut chunk = openai::chunk(kind, ids, index, text, None);
                                if !tool_calls.is_empty() {
                                    openai::add_tool_calls(&mut chunk, &tool_calls, calls_sent);
                                    calls_sent += tool_calls.len();
                                }
                                if let Some(entry) = logprob {
                                    chunk["choices"][0]["logprobs"] = openai::logprobs(kind, &[entry]);
                                }
                                chunk
                            }
                            Ok(GenerateEvent::Done(summary)) => {
                                if let Err(e) = check_restored(&verdict, &summary) {
                                    stream_error(e)
                                } else {
                                    completion_tokens += summary.completion_tokens;
                                    // Text the adapter held back to the end (a partial character,
                                    // a possible stop sequence that never completed) ends the answer.
                                    let held = Some(summary.text.as_str()).filter(|t| !t.is_empty());
                                    let mut last = openai::chunk(kind, ids, index, held, Some(&summary.finish_reason));
                                    if !summary.tool_calls.is_empty() {
                                        openai::add_tool_calls(&mut last, &summary.tool_calls, calls_sent);
                                    }
                                    if index + 1 == choices.sampling.n {
                                        record_outcome(&verdict);
                                        last["usage"] = openai::usage(
                                            summary.prompt_tokens,
                                            completion_tokens,
                                            summary.cached_tokens,
                                        );
                                        // The header left before the engine ran: its stages ride here.
                                        last["pd_bridge"] = json!({"engine_timings_ms": summary.timings_ms});
                                    }
                                    last
                                }
                            }
                            Err(e) => stream_error(e),
                        };
                        let failed = data.get("error").is_some();
                        if tx.send(Event::default().data(data.to_string())).await.is_err() || failed {
                            return;
                        }
                    }
                }
                let _ = tx.send(Event::default().data("[DONE]")).await;
            });
            let stream =
                tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok::<_, Infallible>);
            let mut response = Sse::new(stream).into_response();
            verdict::set(&mut response, &plan.verdict);
            return Ok(response);
        }

        let mut answers = Vec::new();
        let mut summaries: Vec<GenerateSummary> = Vec::new();
        let mut generation = Some(generation);
        for index in 0..choices.sampling.n {
            let mut generation = match generation.take() {
                Some(started) => started,
                None => choices.start(index).await?,
            };
            let mut text = String::new();
            let mut logprobs = Vec::new();
            let mut calls = Vec::new();
            let summary = loop {
                match generation.next().await {
                    Some(Ok(GenerateEvent::Token { text: piece, logprob, tool_calls, .. })) => {
                        calls.extend(tool_calls);
                        if !plan.verdict.timings_ms.contains_key("first_token") {
                            record_ttft(&plan.verdict, started);
                            plan.verdict.timings_ms.insert("first_token".into(), ms(started));
                        }
                        text.push_str(&piece);
                        logprobs.extend(logprob);
                    }
                    Some(Ok(GenerateEvent::Done(summary))) => {
                        text.push_str(&summary.text);
                        calls.extend(summary.tool_calls.iter().cloned());
                        break summary;
                    }
                    Some(Err(e)) => return Err(e.into()),
                    None => return Err(FrontError::Engine("generation ended without a summary".into())),
                }
            };
            check_restored(&plan.verdict, &summary)?;
            let logprobs = choices.sampling.logprobs.map(|_| openai::logprobs(kind, &logprobs));
            answers.push(openai::choice(kind, index, &text, &summary.finish_reason, logprobs, &calls));
            summaries.push(summary);
        }
        drop(lease);
        let first = &summaries[0];
        plan.verdict.timings_ms.insert("total".into(), ms(started));
        for (stage, value) in &first.timings_ms {
            plan.verdict.timings_ms.insert(format!("engine_{stage}"), *value);
        }
        record_outcome(&plan.verdict);
        record_stages(&plan.verdict, first);
        let mut body = openai::completion(kind, &id, created, &model, answers);
        let completion_tokens = summaries.iter().map(|s| s.completion_tokens).sum();
        body["usage"] = openai::usage(first.prompt_tokens, completion_tokens, first.cached_tokens);
        let mut response = Json(body).into_response();
        verdict::set(&mut response, &plan.verdict);
        Ok(response)
    }
}

/// What each answer of a request generates from, owned, so a streamed answer's
/// task can start one after another (`n` > 1).
struct Choices {
    engine: Engine,
    tokens: Vec<u32>,
    blocks: Vec<std::path::PathBuf>,
    /// Held (its file kept) until the last answer has started.
    tail: Option<store::Tail>,
    spec_fingerprint: String,
    max_tokens: u32,
    sampling: openai::Sampling,
    tools: Option<Value>,
}

impl Choices {
    /// Generation `index`; sampled answers differ by seed (`seed + index`).
    async fn start(&self, index: u32) -> Result<crate::engine::Generation, EngineError> {
        let sampling = &self.sampling;
        let request = GenerateRequest {
            tokens: &self.tokens,
            blocks: &self.blocks,
            tail: self.tail.as_ref().map(store::Tail::path),
            spec_fingerprint: &self.spec_fingerprint,
            max_tokens: self.max_tokens,
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            seed: sampling.seed.map(|seed| seed + u64::from(index)),
            stop: &sampling.stop,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            logprobs: sampling.logprobs,
            tools: self.tools.as_ref(),
        };
        let mut generation = self.engine.generate(&request).await?;
        generation.started().await?;
        Ok(generation)
    }
}

impl Front {
    /// Decides how this prompt is served and, when bridging, runs the bridge.
    async fn plan(
        &self,
        tokens: &[u32],
        keys: &[BlockKey],
        spec_fingerprint: &str,
        b: usize,
        mode: Mode,
    ) -> Result<Plan, FrontError> {
        let plan = |outcome, reason, restored| Plan::new(outcome, reason, tokens.len(), restored, b);
        if mode == Mode::Native {
            return Ok(plan(Outcome::Native, Some(Reason::Requested), 0));
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
        let situation = Situation {
            mode,
            cached_blocks: cached,
            total_blocks: keys.len(),
            block_tokens: b,
            bridge_enabled: self.config.bridge,
            min_bridge_tokens: self.config.min_bridge_tokens as usize,
        };
        let decision = match policy::decide(&situation) {
            Step::Decided(decision) => decision,
            Step::AskPrefilld => policy::with_prefilld(&situation, self.prefiller.serving().await),
        };
        match decision {
            Decision::Serve { outcome, reason } => return Ok(shared(plan(outcome, reason, cached))),
            Decision::Refuse(reason) => return Err(FrontError::BridgeRequired { reason, detail: String::new() }),
            Decision::Bridge => {}
        }

        let started = Instant::now();
        // A prefilld that fails mid-way leaves its committed blocks in the store; another takes
        // the rest, from the first block still missing.
        let mut failed: Vec<prefiller::BridgeFailure> = Vec::new();
        let bridged = loop {
            let tried: Vec<String> = failed.iter().filter_map(|f| f.prefiller.clone()).collect();
            let from = self.store.longest_prefix(keys) as u32;
            match self.prefiller.bridge(tokens, from, &tried).await {
                Err(failure) if failure.another_may_succeed() => {
                    tracing::warn!(prefiller = failure.prefiller, reason = %failure.reason, detail = failure.detail, "bridge failed on a prefilld; asking another");
                    failed.push(failure);
                }
                // None left to ask: the last one's failure says more than "none is serving".
                Err(none_left) if none_left.prefiller.is_none() && !failed.is_empty() => {
                    break Err(failed.pop().expect("not empty"));
                }
                other => break other,
            }
        };
        let now_cached = self.store.longest_prefix(keys);
        // Why the bridge fell short, if it did: its failure, or prefilld's reason for a partial outcome.
        let shortfall = match &bridged {
            Err(failure) => Some(failure.reason),
            Ok((_, outcome)) if outcome.status() == OutcomeStatus::Partial => {
                Some(Reason::from_proto(outcome.reason()).unwrap_or(Reason::TransferFailed))
            }
            Ok(_) => None,
        };
        let (outcome, reason) = policy::after_bridge(cached, now_cached, keys.len(), shortfall);
        if let Err(failure) = &bridged {
            tracing::warn!(reason = %failure.reason, detail = failure.detail, outcome = outcome.label(), "bridge fell short");
            if mode == Mode::Bridge && outcome != Outcome::Bridged {
                return Err(FrontError::BridgeRequired { reason: failure.reason, detail: failure.detail.clone() });
            }
        }
        let mut plan = shared(plan(outcome, reason, now_cached));
        plan.verdict.timings_ms.insert("bridge".into(), ms(started));
        // Blocks that landed before a fault still count: the store says which.
        plan.verdict.blocks = now_cached.saturating_sub(cached) as u32;
        plan.verdict.bytes = failed.iter().map(|f| f.bytes_sent).sum();
        plan.verdict.prefillers = failed.iter().filter_map(|f| f.prefiller.clone()).collect();
        let failovers: Vec<String> = failed
            .iter()
            .map(|f| format!("{}: {}: {}", f.prefiller.as_deref().unwrap_or("?"), f.reason, f.detail))
            .collect();
        match bridged {
            Ok((prefiller, outcome)) => {
                if !failovers.is_empty() {
                    plan.verdict.detail =
                        Some(header_safe(&format!("{}; finished by {prefiller}", failovers.join("; "))));
                }
                plan.verdict.prefillers.push(prefiller);
                if outcome.tail_tokens > 0 && now_cached == keys.len() {
                    let start = keys.len() * b;
                    let tail_ids = &tokens[start..start + outcome.tail_tokens as usize];
                    let key = block::tail_key(spec_fingerprint, keys, tail_ids);
                    if let Some(tail) = self.store.take_tail(&key) {
                        plan.with_tail(tail, outcome.tail_tokens);
                    }
                }
                plan.verdict.bytes += outcome.bytes;
                for (stage, value) in outcome.stage_ms {
                    plan.verdict.timings_ms.insert(format!("prefill_{stage}"), value);
                }
            }
            // The last progress report says how many bytes were sent.
            Err(failure) => {
                let detail = failovers.iter().map(String::as_str).chain([failure.detail.as_str()]).collect::<Vec<_>>();
                plan.verdict.detail = Some(header_safe(&detail.join("; ")));
                plan.verdict.bytes += failure.bytes_sent;
                plan.verdict.prefillers.extend(failure.prefiller);
            }
        }
        Ok(plan)
    }
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

/// An error event ending a streamed answer (its headers have already left).
fn stream_error(e: impl std::fmt::Display) -> Value {
    json!({"error": {"message": e.to_string(), "type": "engine_error"}})
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
