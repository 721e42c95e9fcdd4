//! The front door's client of prefilld: its health, and one bridge (a
//! `Prefill` call followed to its outcome within a deadline).

use std::time::Duration;

use pdbridge_common::{
    proto::{
        Outcome, PrefillRequest, outcome::Status as OutcomeStatus, prefill_event::Event as PrefillEventKind,
        prefiller_client::PrefillerClient,
    },
    reason::Reason,
    tls::{self, Tls},
};
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::config::FrontConfig;

/// Longest wait for prefilld's health before a request is served without it.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

pub struct Prefiller {
    /// None without `front.prefilld` (or when it cannot be dialed): never bridge.
    channel: Option<Channel>,
    /// How prefilld reaches this decoder's CacheStore (one of its `[[decoders]]`).
    advertise_addr: String,
    deadline_base: Duration,
    deadline_per_1k_tokens: Duration,
}

/// Why a bridge produced no outcome, and what it had sent by then.
#[derive(Debug)]
pub struct BridgeFailure {
    pub reason: Reason,
    pub detail: String,
    pub bytes_sent: u64,
}

impl BridgeFailure {
    fn new(reason: Reason, detail: &str) -> Self {
        Self { reason, detail: detail.to_owned(), bytes_sent: 0 }
    }

    fn sent(self, bytes_sent: u64) -> Self {
        Self { bytes_sent, ..self }
    }
}

impl Prefiller {
    pub fn new(config: &FrontConfig, tls: Option<&Tls>, advertise_addr: String) -> Self {
        let channel =
            config.prefilld.as_ref().and_then(|addr| match tls::endpoint(addr, tls, config.prefilld_name.as_deref()) {
                Ok(endpoint) => Some(endpoint.tcp_nodelay(true).connect_lazy()),
                Err(e) => {
                    tracing::error!(addr, error = %e, "front.prefilld cannot be dialed; bridging disabled");
                    None
                }
            });
        Prefiller {
            channel,
            advertise_addr,
            deadline_base: config.prefill_deadline_base,
            deadline_per_1k_tokens: config.prefill_deadline_per_1k_tokens,
        }
    }

    /// Whether prefilld's health says its Prefiller is SERVING.
    pub async fn serving(&self) -> bool {
        let Some(channel) = self.channel.clone() else { return false };
        let mut health = HealthClient::new(channel);
        let check = health.check(HealthCheckRequest { service: "pdbridge.v1.Prefiller".into() });
        matches!(
            tokio::time::timeout(HEALTH_TIMEOUT, check).await,
            Ok(Ok(reply)) if reply.get_ref().status() == ServingStatus::Serving
        )
    }

    /// Asks prefilld to prefill and push the prompt's blocks from
    /// `first_block`, and its tail for this request; returns its outcome
    /// (bridged or partial) or why there is none.
    pub async fn bridge(&self, tokens: &[u32], first_block: u32) -> Result<Outcome, BridgeFailure> {
        let channel = self
            .channel
            .clone()
            .ok_or_else(|| BridgeFailure::new(Reason::PrefillUnavailable, "no prefilld configured"))?;
        let deadline = self.deadline_base + self.deadline_per_1k_tokens.mul_f64(tokens.len() as f64 / 1000.0);
        let request = PrefillRequest {
            request_id: String::new(),
            token_ids: tokens.to_vec(),
            decoder_addr: self.advertise_addr.clone(),
            first_block: Some(first_block),
            tail: true,
        };
        let mut bytes_sent = 0;
        let run = async {
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
                    Some(PrefillEventKind::Progress(progress)) => bytes_sent = progress.bytes_sent,
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
        };
        let result = match tokio::time::timeout(deadline, run).await {
            Ok(result) => result,
            Err(_) => Err(BridgeFailure::new(Reason::Timeout, &format!("no outcome within {deadline:?}"))),
        };
        result.map_err(|failure| if failure.bytes_sent == 0 { failure.sent(bytes_sent) } else { failure })
    }
}
