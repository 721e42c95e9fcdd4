//! The `Prefiller` gRPC service.

use std::pin::Pin;

use pdbridge_common::{
    proto::{PrefillEvent, PrefillRequest, prefiller_server::Prefiller},
    readiness::Readiness,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub struct PrefillerService {
    /// Prefill needs the engine and the decoder's spec; until both are in
    /// hand every call answers UNAVAILABLE.
    readiness: Readiness,
}

impl PrefillerService {
    pub fn new(readiness: Readiness) -> Self {
        Self { readiness }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<PrefillEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Prefiller for PrefillerService {
    type PrefillStream = EventStream;

    async fn prefill(&self, _: Request<PrefillRequest>) -> Result<Response<EventStream>, Status> {
        if !self.readiness.is_ready() {
            return Err(Status::unavailable("prefill engine is not ready"));
        }
        Err(Status::unimplemented("Prefill"))
    }
}
