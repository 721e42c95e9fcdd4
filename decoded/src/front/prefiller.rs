//! The front door's client of its prefilld instances: their health, and one
//! bridge attempt (a `Prefill` call followed to its outcome within a deadline)
//! on the healthy instance with the fewest bridges in flight.

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use pdbridge_common::{
    proto::{
        Outcome, Payload, PrefillRequest, outcome::Status as OutcomeStatus, prefill_event::Event as PrefillEventKind,
        prefiller_client::PrefillerClient,
    },
    reason::Reason,
    tls::{self, Tls},
    traces,
};
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
use tracing::Instrument;

use crate::config::FrontConfig;

/// Longest wait for prefilld's health before a request is served without it.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// One prefilld instance.
struct Upstream {
    /// How it is named in verdicts and logs: its certificate identity, or its address.
    name: String,
    channel: Channel,
    in_flight: AtomicUsize,
}

pub struct Prefiller {
    /// Empty without a configured prefilld (or when none can be dialed): never bridge.
    upstreams: Vec<Arc<Upstream>>,
    /// How prefilld reaches this decoder's CacheStore (one of its `[[decoders]]`).
    advertise_addr: String,
    /// What prefilld pushes: the cache, or the layers' inputs to compute it from.
    payload: Payload,
    deadline_base: Duration,
    deadline_per_1k_tokens: Duration,
}

/// Why a bridge attempt produced no outcome, what it had sent by then, and on which prefilld.
#[derive(Debug)]
pub struct BridgeFailure {
    pub reason: Reason,
    pub detail: String,
    pub bytes_sent: u64,
    /// The prefilld that failed (None: none was tried).
    pub prefiller: Option<String>,
}

impl BridgeFailure {
    fn new(reason: Reason, detail: &str) -> Self {
        Self { reason, detail: detail.to_owned(), bytes_sent: 0, prefiller: None }
    }

    fn sent(self, bytes_sent: u64) -> Self {
        Self { bytes_sent, ..self }
    }

    /// Whether another prefilld may do what this one could not: it was unreachable, its stream
    /// broke or it ran out of time — not a refusal every instance would repeat.
    pub fn another_may_succeed(&self) -> bool {
        self.prefiller.is_some()
            && matches!(self.reason, Reason::PrefillUnavailable | Reason::TransferFailed | Reason::Timeout)
    }
}

/// Counts a bridge in flight on an upstream while it lives.
struct InFlight(Arc<Upstream>);

impl InFlight {
    fn enter(upstream: &Arc<Upstream>) -> Self {
        upstream.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(upstream.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Prefiller {
    pub fn new(config: &FrontConfig, tls: Option<&Tls>, advertise_addr: String) -> Self {
        let upstreams = config
            .prefillers()
            .into_iter()
            .filter_map(|p| match tls::endpoint(&p.addr, tls, p.name.as_deref()) {
                Ok(endpoint) => Some(Arc::new(Upstream {
                    name: p.name.unwrap_or(p.addr),
                    channel: endpoint.tcp_nodelay(true).connect_lazy(),
                    in_flight: AtomicUsize::new(0),
                })),
                Err(e) => {
                    tracing::error!(addr = p.addr, error = %e, "a prefilld cannot be dialed; not bridging through it");
                    None
                }
            })
            .collect();
        Prefiller {
            upstreams,
            advertise_addr,
            payload: config.reconstruct_on.payload(),
            deadline_base: config.prefill_deadline_base,
            deadline_per_1k_tokens: config.prefill_deadline_per_1k_tokens,
        }
    }

    /// Bridges in flight on the least busy prefilld (0 without any).
    pub fn least_busy(&self) -> usize {
        self.upstreams.iter().map(|u| u.in_flight.load(Ordering::Relaxed)).min().unwrap_or(0)
    }

    /// Whether a prefilld's health says its Prefiller is SERVING.
    pub async fn serving(&self) -> bool {
        self.healthy(&[]).await.is_some()
    }

    /// The SERVING prefilld with the fewest bridges in flight, of those not named in `tried`,
    /// counted as busy with one more from the moment it is considered (so concurrent requests
    /// spread even while their health checks are in flight).
    async fn healthy(&self, tried: &[String]) -> Option<InFlight> {
        let mut left: Vec<&Arc<Upstream>> = self.upstreams.iter().filter(|u| !tried.contains(&u.name)).collect();
        while let Some(at) = (0..left.len()).min_by_key(|&i| left[i].in_flight.load(Ordering::Relaxed)) {
            let candidate = InFlight::enter(left.swap_remove(at));
            let mut health = HealthClient::new(candidate.0.channel.clone());
            let check = health.check(HealthCheckRequest { service: "pdbridge.v1.Prefiller".into() });
            let problem = match tokio::time::timeout(HEALTH_TIMEOUT, check).await {
                Ok(Ok(reply)) if reply.get_ref().status() == ServingStatus::Serving => return Some(candidate),
                Ok(Ok(reply)) => format!("health says {:?}", reply.get_ref().status()),
                Ok(Err(status)) => format!("health check failed: {:?}: {}", status.code(), status.message()),
                Err(_) => format!("no health answer within {HEALTH_TIMEOUT:?}"),
            };
            tracing::warn!(prefiller = candidate.0.name, problem, "prefilld skipped");
        }
        None
    }

    /// Asks a healthy prefilld not named in `tried` to prefill and push the prompt's blocks from
    /// `first_block`, and its tail for this request; returns its name and outcome (bridged or
    /// partial), or why there is none.
    pub async fn bridge(
        &self,
        tokens: &[u32],
        first_block: u32,
        tried: &[String],
    ) -> Result<(String, Outcome), BridgeFailure> {
        let in_flight = self.healthy(tried).await.ok_or_else(|| {
            let what = if self.upstreams.is_empty() { "no prefilld configured" } else { "no prefilld is serving" };
            BridgeFailure::new(Reason::PrefillUnavailable, what)
        })?;
        let name = in_flight.0.name.clone();
        let deadline = self.deadline_base + self.deadline_per_1k_tokens.mul_f64(tokens.len() as f64 / 1000.0);
        let request = PrefillRequest {
            request_id: String::new(),
            token_ids: tokens.to_vec(),
            decoder_addr: self.advertise_addr.clone(),
            first_block: Some(first_block),
            tail: true,
            payload: self.payload as i32,
        };
        let mut bytes_sent = 0;
        let span =
            tracing::info_span!("prefilld.prefill", otel.kind = "client", pdbridge.prefiller = name, first_block);
        let run = follow(in_flight.0.channel.clone(), request, &mut bytes_sent).instrument(span);
        let result = match tokio::time::timeout(deadline, run).await {
            Ok(result) => result,
            Err(_) => Err(BridgeFailure::new(Reason::Timeout, &format!("no outcome within {deadline:?}"))),
        };
        result.map(|outcome| (name.clone(), outcome)).map_err(|failure| {
            // Cut short: the last progress report says how many bytes were sent.
            let failure = if failure.bytes_sent == 0 { failure.sent(bytes_sent) } else { failure };
            BridgeFailure { prefiller: Some(name), ..failure }
        })
    }
}

/// A `Prefill` call followed to its outcome, keeping `bytes_sent` as progress reports it.
async fn follow(channel: Channel, request: PrefillRequest, bytes_sent: &mut u64) -> Result<Outcome, BridgeFailure> {
    let mut request = tonic::Request::new(request);
    traces::inject_grpc(&tracing::Span::current(), request.metadata_mut());
    let mut events = PrefillerClient::new(channel)
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
        .prefill(request)
        .await
        .map_err(|s| BridgeFailure::new(Reason::PrefillUnavailable, s.message()))?
        .into_inner();
    while let Some(event) =
        events.message().await.map_err(|s| BridgeFailure::new(Reason::TransferFailed, s.message()))?
    {
        match event.event {
            Some(PrefillEventKind::Progress(progress)) => *bytes_sent = progress.bytes_sent,
            Some(PrefillEventKind::Outcome(outcome)) => {
                return match outcome.status() {
                    OutcomeStatus::Bridged | OutcomeStatus::Partial => Ok(outcome),
                    _ => {
                        let reason = Reason::from_proto(outcome.reason()).unwrap_or(Reason::TransferFailed);
                        Err(BridgeFailure::new(reason, &outcome.detail).sent(outcome.bytes))
                    }
                };
            }
            None => {}
        }
    }
    Err(BridgeFailure::new(Reason::TransferFailed, "prefill stream ended without an outcome"))
}
