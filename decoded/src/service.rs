//! The `CacheStore` gRPC service: translates wire messages into engine, store
//! and ingest calls, and their errors into gRPC statuses (in one place,
//! [`status_of`]).

use std::{pin::Pin, sync::Arc, time::Duration};

use pdbridge_common::{
    layers::access::{Access, Caller, Rules},
    metric,
    proto::{
        BundleChunk, CacheSpec, GetBundleRequest, GetSpecRequest, LookupRequest, LookupResponse, PushFrame,
        PushReceipt, PushSeal, cache_store_server::CacheStore, push_frame::Frame,
    },
    shard::ShardError,
    spec, telemetry, traces,
};
use tokio::{io::AsyncReadExt, sync::Semaphore};
use tokio_stream::Stream;
use tonic::{Code, Request, Response, Status, Streaming};
use tracing::{Instrument, field::Empty};

use crate::{
    config::StoreConfig,
    engine::{Engine, EngineError, EngineInfo},
    ingest::{Ingest, IngestError, PushMemory},
    reconstruct::ReconstructError,
    store::{Store, StoreError},
};

/// Bundle bytes per `BundleChunk`.
const BUNDLE_CHUNK_BYTES: usize = 4 << 20;

pub struct CacheStoreService {
    engine: Option<Engine>,
    store: Arc<Store>,
    max_open_blocks: usize,
    push_memory: PushMemory,
    /// One permit per open Push stream, `max_push_streams` in all.
    push_slots: Arc<Semaphore>,
    max_push_streams: usize,
    push_idle_timeout: Duration,
}

/// Who may call: any holder of a CA-signed certificate may read the spec; only `tls.peers` (the
/// prefillers) may Lookup, Push and read the bundle.
pub const ACCESS: Rules = &[
    ("/pdbridge.v1.CacheStore/GetSpec", Access::Certified),
    ("/pdbridge.v1.CacheStore/GetBundle", Access::Peer),
    ("/pdbridge.v1.CacheStore/Lookup", Access::Peer),
    ("/pdbridge.v1.CacheStore/Push", Access::Peer),
];

impl CacheStoreService {
    pub fn new(engine: Option<Engine>, store: Arc<Store>, config: &StoreConfig) -> Self {
        Self {
            engine,
            store,
            max_open_blocks: config.max_open_blocks,
            push_memory: PushMemory::new(config.max_push_bytes),
            push_slots: Arc::new(Semaphore::new(config.max_push_streams)),
            max_push_streams: config.max_push_streams,
            push_idle_timeout: config.push_idle_timeout,
        }
    }

    /// The current spec; UNAVAILABLE while the engine is down.
    fn info(&self) -> Result<Arc<EngineInfo>, Status> {
        self.engine.as_ref().ok_or(EngineError::NotReady).and_then(Engine::info).map_err(|e| status_of(&e.into()))
    }

    /// FAILED_PRECONDITION unless `claimed` is empty or the current spec.
    fn check_spec(info: &EngineInfo, claimed: &str) -> Result<(), Status> {
        if claimed.is_empty() || claimed == info.spec.spec_fingerprint {
            return Ok(());
        }
        Err(status_of(&ServiceError::Ingest(IngestError::SpecMismatch {
            got: claimed.to_owned(),
            want: info.spec.spec_fingerprint.clone(),
        })))
    }
}

/// Every failure the service can report.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Ingest(#[from] IngestError),
    #[error("{0}")]
    BadStream(&'static str),
    #[error("{limit} Push streams are already open; retry later")]
    TooManyPushStreams { limit: usize },
    #[error("no Push frame for {0:?}")]
    PushIdle(Duration),
    #[error("token_ids: {0}")]
    BadTokens(String),
}

/// The one mapping from domain errors to gRPC statuses: the code, and the
/// `Reason` in the details where the error names one.
pub fn status_of(err: &ServiceError) -> Status {
    use pdbridge_common::reason::Reason;
    let code = match err {
        ServiceError::Engine(EngineError::NotReady) => Code::Unavailable,
        ServiceError::Engine(EngineError::BadRequest(_)) => Code::InvalidArgument,
        ServiceError::Engine(_) => Code::Internal,
        ServiceError::BadStream(_) | ServiceError::BadTokens(_) => Code::InvalidArgument,
        ServiceError::TooManyPushStreams { .. } => Code::ResourceExhausted,
        ServiceError::PushIdle(_) => Code::DeadlineExceeded,
        ServiceError::Ingest(e) => match e {
            IngestError::SpecMismatch { .. } => Code::FailedPrecondition,
            IngestError::Shard { source: ShardError::Checksum { .. }, .. } => Code::DataLoss,
            IngestError::TooManyOpenBlocks { .. } | IngestError::PushMemorySpent { .. } => Code::ResourceExhausted,
            IngestError::Store(StoreError::TooLarge { .. } | StoreError::NoSpace { .. }) => Code::ResourceExhausted,
            IngestError::Store(_) => Code::Internal,
            IngestError::NoEngine(EngineError::NotReady) => Code::Unavailable,
            IngestError::NoEngine(_) | IngestError::PayloadUnsupported(_) | IngestError::TailUnsupported(_) => {
                Code::FailedPrecondition
            }
            IngestError::Reconstruct { source: ReconstructError::Engine(EngineError::NotReady), .. } => {
                Code::Unavailable
            }
            IngestError::Reconstruct { .. } => Code::Internal,
            IngestError::BadTail { .. }
            | IngestError::BlockOutOfRange { .. }
            | IngestError::UnknownPayload(_)
            | IngestError::UnknownTensor { .. }
            | IngestError::Shard { .. }
            | IngestError::AlreadyCommitted { .. } => Code::InvalidArgument,
        },
    };
    // An error that says why no bridge can go on with this decoder names its reason in the
    // status (every FAILED_PRECONDITION does), so prefilld need not guess it from the code; a
    // failure of the call alone carries none, and the caller names it for what it was doing.
    let reason = match err {
        ServiceError::Ingest(IngestError::SpecMismatch { .. }) => Some(Reason::SpecMismatch),
        ServiceError::Ingest(IngestError::PayloadUnsupported(_) | IngestError::TailUnsupported(_)) => {
            Some(Reason::UnsupportedModel)
        }
        ServiceError::Ingest(IngestError::NoEngine(e)) if !matches!(e, EngineError::NotReady) => {
            Some(Reason::UnsupportedModel)
        }
        _ => None,
    };
    match reason {
        Some(reason) => reason.status(code, err.to_string()),
        None => Status::new(code, err.to_string()),
    }
}

type BundleStream = Pin<Box<dyn Stream<Item = Result<BundleChunk, Status>> + Send>>;

#[tonic::async_trait]
impl CacheStore for CacheStoreService {
    async fn get_spec(&self, _request: Request<GetSpecRequest>) -> Result<Response<CacheSpec>, Status> {
        Ok(Response::new(self.info()?.spec.clone()))
    }

    type GetBundleStream = BundleStream;

    async fn get_bundle(&self, request: Request<GetBundleRequest>) -> Result<Response<BundleStream>, Status> {
        let info = self.info()?;
        Self::check_spec(&info, &request.get_ref().spec_fingerprint)?;
        let mut file = tokio::fs::File::open(&info.bundle_path)
            .await
            .map_err(|e| Status::internal(format!("open bundle {}: {e}", info.bundle_path.display())))?;
        let total_bytes = file.metadata().await.map_err(|e| Status::internal(e.to_string()))?.len();
        let sha256 = info.spec.weights_fingerprint.clone();
        // A reader task feeds a two-chunk channel: memory stays bounded and a
        // slow client slows the reads.
        let (tx, rx) = tokio::sync::mpsc::channel(2);
        tokio::spawn(async move {
            let mut offset = 0u64;
            loop {
                let mut buf = Vec::with_capacity(BUNDLE_CHUNK_BYTES);
                let read = (&mut file).take(BUNDLE_CHUNK_BYTES as u64).read_to_end(&mut buf).await;
                let chunk = match read {
                    Ok(0) => break,
                    Ok(_) => Ok(BundleChunk { offset, total_bytes, data: buf.into(), sha256: sha256.clone() }),
                    Err(e) => Err(Status::internal(format!("read bundle: {e}"))),
                };
                let failed = chunk.is_err();
                offset += chunk.as_ref().map_or(0, |c| c.data.len() as u64);
                if tx.send(chunk).await.is_err() || failed {
                    break;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn lookup(&self, request: Request<LookupRequest>) -> Result<Response<LookupResponse>, Status> {
        let info = self.info()?;
        let request = request.into_inner();
        Self::check_spec(&info, &request.spec_fingerprint)?;
        spec::check_tokens(&info.spec, &request.token_ids)
            .map_err(|problem| status_of(&ServiceError::BadTokens(problem)))?;
        let block_tokens = info.spec.block_tokens;
        let keys = spec::block_keys(&info.spec, &request.token_ids);
        let cached_blocks = self.store.longest_prefix(&keys) as u32;
        let outcome = if cached_blocks > 0 { "hit" } else { "miss" };
        metrics::counter!(metric::STORE_LOOKUPS.name, "outcome" => outcome).increment(1);
        Ok(Response::new(LookupResponse {
            cached_blocks,
            cached_tokens: cached_blocks * block_tokens,
            block_keys: keys.iter().map(|k| k.0.to_vec()).collect(),
            block_tokens,
        }))
    }

    async fn push(&self, request: Request<Streaming<PushFrame>>) -> Result<Response<PushReceipt>, Status> {
        let span = tracing::info_span!(
            "store.push",
            otel.kind = "server",
            pdbridge.request_id = Empty,
            pdbridge.blocks = Empty,
            pdbridge.bytes = Empty
        );
        traces::continue_grpc(&span, request.metadata());
        self.receive_push(request).instrument(span).await
    }
}

impl CacheStoreService {
    /// One Push stream, its blocks committed as they complete.
    async fn receive_push(&self, request: Request<Streaming<PushFrame>>) -> Result<Response<PushReceipt>, Status> {
        let peer = request.extensions().get::<Caller>().and_then(|caller| caller.0.clone());
        let info = self.info()?;
        let _slot = self
            .push_slots
            .clone()
            .try_acquire_owned()
            .map_err(|_| status_of(&ServiceError::TooManyPushStreams { limit: self.max_push_streams }))?;
        let mut frames = Frames { inner: request.into_inner(), idle_timeout: self.push_idle_timeout };
        let open = match frames.next().await? {
            Some(PushFrame { frame: Some(Frame::Open(open)) }) => open,
            Some(_) => return Err(bad_stream("the first frame of a Push must be `open`")),
            None => return Err(bad_stream("empty Push stream")),
        };
        spec::check_tokens(&info.spec, &open.token_ids)
            .map_err(|problem| status_of(&ServiceError::BadTokens(problem)))?;
        let spec = Arc::new(info.spec.clone());
        let memory = self.push_memory.clone();
        let mut ingest =
            Ingest::open(spec, self.store.clone(), open, self.max_open_blocks, memory, self.engine.clone())
                .map_err(|e| status_of(&e.into()))?;
        let _in_flight = telemetry::InFlight::enter(metric::PUSH_STREAMS_IN_FLIGHT.name);
        let received = receive(&mut frames, &mut ingest).await;
        // Whatever ended the stream, blocks that arrived whole still land;
        // only partial ones are dropped with `ingest`.
        let request_id = ingest.request_id().to_owned();
        let finished = ingest.finish(received.as_ref().ok().cloned().flatten()).await;
        if let Err(status) = &received {
            tracing::warn!(request_id, error = %status.message(), "push refused");
        }
        let receipt = received.and(finished.map_err(|e| {
            tracing::warn!(request_id, error = %e, "push failed");
            status_of(&e.into())
        }))?;
        let span = tracing::Span::current();
        span.record("pdbridge.request_id", &request_id);
        span.record("pdbridge.blocks", receipt.blocks_committed);
        span.record("pdbridge.bytes", receipt.bytes);
        tracing::info!(
            request_id,
            peer = peer.as_deref().unwrap_or("-"),
            blocks = receipt.blocks_committed,
            bytes = receipt.bytes,
            detail = receipt.detail,
            "push done"
        );
        Ok(Response::new(receipt))
    }
}

/// A Push stream's frames, each awaited at most `idle_timeout`.
struct Frames {
    inner: Streaming<PushFrame>,
    idle_timeout: Duration,
}

impl Frames {
    async fn next(&mut self) -> Result<Option<PushFrame>, Status> {
        match tokio::time::timeout(self.idle_timeout, self.inner.message()).await {
            Ok(frame) => frame,
            Err(_) => Err(status_of(&ServiceError::PushIdle(self.idle_timeout))),
        }
    }
}

/// Feeds a Push stream's shards to `ingest` until its seal (returned) or its
/// end without one (None).
async fn receive(frames: &mut Frames, ingest: &mut Ingest) -> Result<Option<PushSeal>, Status> {
    let seal = loop {
        match frames.next().await? {
            Some(PushFrame { frame: Some(Frame::Shard(shard)) }) => {
                ingest.accept(shard).await.map_err(|e| status_of(&e.into()))?
            }
            Some(PushFrame { frame: Some(Frame::Seal(seal)) }) => break Some(seal),
            Some(_) => return Err(bad_stream("a Push carries one `open`, then shards, then one `seal`")),
            None => break None,
        }
    };
    if seal.is_some() && frames.next().await?.is_some() {
        return Err(bad_stream("frames after `seal`"));
    }
    Ok(seal)
}

/// INVALID_ARGUMENT for a Push stream that breaks the protocol.
fn bad_stream(what: &'static str) -> Status {
    status_of(&ServiceError::BadStream(what))
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_rpc_says_who_may_call_it() {
        let missing = pdbridge_common::layers::access::without_rule(super::ACCESS, "pdbridge.v1.CacheStore");
        assert!(missing.is_empty(), "RPCs with no access rule: {missing:?}");
    }
}
