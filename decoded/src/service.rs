//! The `CacheStore` gRPC service: translates wire messages into store and
//! engine calls and their errors into gRPC statuses.

use std::pin::Pin;

use pdbridge_common::{
    proto::{
        BundleChunk, CacheSpec, GetBundleRequest, GetSpecRequest, LookupRequest, LookupResponse, PushFrame,
        PushReceipt, cache_store_server::CacheStore,
    },
    readiness::Readiness,
};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

pub struct CacheStoreService {
    /// The spec, bundle and store all come from the decode engine; until it is
    /// ready every call answers UNAVAILABLE rather than guessing.
    readiness: Readiness,
}

impl CacheStoreService {
    pub fn new(readiness: Readiness) -> Self {
        Self { readiness }
    }

    fn require_engine(&self) -> Result<(), Status> {
        if self.readiness.is_ready() { Ok(()) } else { Err(Status::unavailable("decode engine is not ready")) }
    }
}

type BundleStream = Pin<Box<dyn Stream<Item = Result<BundleChunk, Status>> + Send>>;

#[tonic::async_trait]
impl CacheStore for CacheStoreService {
    async fn get_spec(&self, _: Request<GetSpecRequest>) -> Result<Response<CacheSpec>, Status> {
        self.require_engine()?;
        Err(Status::unimplemented("GetSpec"))
    }

    type GetBundleStream = BundleStream;

    async fn get_bundle(&self, _: Request<GetBundleRequest>) -> Result<Response<BundleStream>, Status> {
        self.require_engine()?;
        Err(Status::unimplemented("GetBundle"))
    }

    async fn lookup(&self, _: Request<LookupRequest>) -> Result<Response<LookupResponse>, Status> {
        self.require_engine()?;
        Err(Status::unimplemented("Lookup"))
    }

    async fn push(&self, _: Request<Streaming<PushFrame>>) -> Result<Response<PushReceipt>, Status> {
        self.require_engine()?;
        Err(Status::unimplemented("Push"))
    }
}
