//! The `Prefiller` gRPC service: validates requests and runs each as a
//! [`Bridge`] job whose progress and outcome stream back to the caller.

use std::{pin::Pin, sync::Arc};

use pdbridge_common::proto::{PrefillEvent, PrefillRequest, prefiller_server::Prefiller};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, wrappers::ReceiverStream};
use tonic::{Request, Response, Status};

use crate::prefill::{Bridge, Job};

pub struct PrefillerService {
    /// None when no engine is configured: every call is UNAVAILABLE.
    bridge: Option<Arc<Bridge>>,
    /// Used when a request names no decoder.
    default_decoder: Option<String>,
}

impl PrefillerService {
    pub fn new(bridge: Option<Arc<Bridge>>, default_decoder: Option<String>) -> Self {
        Self { bridge, default_decoder }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<PrefillEvent, Status>> + Send>>;

/// Counts a refusal in `pdbridge_grpc_errors_total` on its way out.
fn refuse(status: Status) -> Status {
    metrics::counter!("pdbridge_grpc_errors_total", "service" => "Prefiller", "code" => format!("{:?}", status.code()))
        .increment(1);
    status
}

#[tonic::async_trait]
impl Prefiller for PrefillerService {
    type PrefillStream = EventStream;

    async fn prefill(&self, request: Request<PrefillRequest>) -> Result<Response<EventStream>, Status> {
        let bridge = match &self.bridge {
            Some(bridge) if bridge.vllm.is_ready() => bridge.clone(),
            _ => return Err(refuse(Status::unavailable("prefill engine is not ready"))),
        };
        let request = request.into_inner();
        if request.token_ids.is_empty() {
            return Err(refuse(Status::invalid_argument("token_ids is empty")));
        }
        let decoder_addr = match (request.decoder_addr.is_empty(), &self.default_decoder) {
            (false, _) => request.decoder_addr,
            (true, Some(default)) => default.clone(),
            (true, None) => {
                return Err(refuse(Status::invalid_argument(
                    "decoder_addr is empty and no default decoder is configured",
                )));
            }
        };
        let request_id =
            if request.request_id.is_empty() { pdbridge_common::request_id::new("pf") } else { request.request_id };
        let job = Job { request_id, token_ids: request.token_ids, decoder_addr, first_block: request.first_block };
        let (tx, rx) = mpsc::channel(16);
        tokio::spawn(bridge.run(job, tx));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx).map(Ok))))
    }
}
