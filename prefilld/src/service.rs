//! The `Prefiller` gRPC service: validates requests and runs each as a
//! [`Bridge`] job whose progress and outcome stream back to the caller.

use std::{pin::Pin, sync::Arc};

use pdbridge_common::{
    layers::access::{Access, Rules},
    proto::{Payload, PrefillEvent, PrefillRequest, prefiller_server::Prefiller},
    request_id, traces,
};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};
use tracing::{Instrument, field::Empty};

use crate::prefill::{Bridge, Job};

pub struct PrefillerService {
    /// None when no engine is configured: every call is UNAVAILABLE.
    bridge: Option<Arc<Bridge>>,
    /// The configured decoders' addresses, the first used when a request names none.
    decoders: Vec<String>,
}

/// Only the decoders in `tls.peers` may start a prefill.
pub const ACCESS: Rules = &[("/pdbridge.v1.Prefiller/Prefill", Access::Peer)];

impl PrefillerService {
    pub fn new(bridge: Option<Arc<Bridge>>, decoders: Vec<String>) -> Self {
        Self { bridge, decoders }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<PrefillEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Prefiller for PrefillerService {
    type PrefillStream = EventStream;

    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<EventStream>, Status> {
        let span = tracing::info_span!(
            "prefill",
            otel.kind = "server",
            pdbridge.request_id = Empty,
            pdbridge.outcome = Empty,
            pdbridge.blocks = Empty
        );
        traces::continue_grpc(&span, request.metadata());
        let request = request.into_inner();
        // A caller never chooses where prefilld connects: only configured decoders.
        let decoder_addr = match (request.decoder_addr.is_empty(), self.decoders.first()) {
            (true, Some(first)) => first.clone(),
            (true, None) => return Err(Status::failed_precondition("no [[decoders]] are configured")),
            (false, _) if self.decoders.contains(&request.decoder_addr) => request.decoder_addr,
            (false, _) => {
                return Err(Status::permission_denied(format!(
                    "decoder_addr {:?} is not one of prefilld's [[decoders]]",
                    request.decoder_addr
                )));
            }
        };
        let bridge = match &self.bridge {
            Some(bridge) if bridge.vllm.is_ready() => bridge.clone(),
            _ => return Err(Status::unavailable("prefill engine is not ready")),
        };
        if request.token_ids.is_empty() {
            return Err(Status::invalid_argument("token_ids is empty"));
        }
        let payload = Payload::try_from(request.payload)
            .map_err(|_| Status::invalid_argument(format!("payload {} is not a Payload", request.payload)))?;
        let request_id = if request.request_id.is_empty() {
            request_id::new("pf")
        } else if request_id::is_valid(&request.request_id) {
            request.request_id
        } else {
            return Err(Status::invalid_argument(format!(
                "request_id: at most {} of [A-Za-z0-9._-]",
                request_id::MAX_LEN
            )));
        };
        // Held from here to the end of the job: a second call with the same id
        // can never read this one's blocks.
        let registration = bridge
            .router
            .register(&request_id, bridge.stream.queue_frames)
            .map_err(|id| Status::already_exists(format!("request_id {id:?} is already in progress")))?;
        let job = Job {
            request_id,
            token_ids: request.token_ids,
            decoder_addr,
            first_block: request.first_block,
            tail: request.tail,
            payload,
            registration,
        };
        let (tx, rx) = mpsc::channel(16);
        span.record("pdbridge.request_id", &job.request_id);
        tokio::spawn(bridge.run(job, tx).instrument(span));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_rpc_says_who_may_call_it() {
        let missing = pdbridge_common::layers::access::without_rule(super::ACCESS, "pdbridge.v1.Prefiller");
        assert!(missing.is_empty(), "RPCs with no access rule: {missing:?}");
    }
}
