//! Receiving finished blocks from the vLLM plugin.
//!
//! The plugin (in the engine process that owns a request) connects to
//! prefilld's unix socket and sends, per request, a `block` frame as each
//! block finishes and one `done` (or `error`) when the engine reports the end
//! of the request's prefill. Under pipeline parallelism every stage does so
//! on its own connection, each block holding only that stage's layers;
//! [`Stages`] assembles them. A frame is a little-endian u32 length, a
//! `PluginFrame` (proto/engine.proto, protobuf's binary encoding), then the
//! block's payload. The [`Router`] hands every frame to the Prefill call that
//! registered the request id, through a bounded channel: a slow decoder link
//! slows the plugin, never grows memory.
//!
//! The socket is the engine's, not the network's: it is created 0600, only
//! processes of prefilld's own user may connect, and a block's payload is
//! allocated only after its size is checked against the largest block the
//! waiting request's decoder spec allows. Stages on other boxes send the same
//! frames over mutual TLS (`stage_listener`), where a connection may instead
//! ask for a reconstruction bundle ([`serve_bundle`]).

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use bytes::{Bytes, BytesMut};
use pdbridge_common::proto::{
    Dtype,
    engine::{BundleReply, PluginFailure, PluginFrame, PluginTensor, PluginTimings, plugin_frame::Frame},
};
use prost::Message;
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::UnixListener,
    sync::mpsc,
};
use tokio_util::sync::CancellationToken;

/// Largest frame header accepted from the plugin.
const MAX_HEADER_BYTES: usize = 1 << 20;

/// One tensor's slice of a block payload, checked to lie inside it.
#[derive(Debug, Clone)]
pub struct TensorSlice {
    pub layer: u32,
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub offset: usize,
    pub nbytes: usize,
}

impl TensorSlice {
    fn of(t: PluginTensor, payload_bytes: u64) -> Result<Self, CaptureError> {
        let malformed = |why: &str| CaptureError::Malformed(format!("tensor {}.{} {why}", t.layer, t.name));
        let dtype = Dtype::try_from(t.dtype).ok().filter(|d| d.size_bytes().is_some());
        let dtype = dtype.ok_or_else(|| malformed("has no known dtype"))?;
        if t.offset.checked_add(t.nbytes).is_none_or(|end| end > payload_bytes) {
            return Err(malformed("lies outside the payload"));
        }
        // Within `payload_bytes`, which is held to a usize bound before any slice of it is taken.
        let (offset, nbytes) = (t.offset as usize, t.nbytes as usize);
        Ok(TensorSlice { layer: t.layer, name: t.name, dtype, shape: t.shape, offset, nbytes })
    }
}

/// Which pipeline stage sent a message: the whole engine unless it says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stage {
    pub index: u32,
    pub count: u32,
}

impl Stage {
    fn of(frame: &PluginFrame) -> Self {
        Stage { index: frame.stage, count: frame.stages.max(1) }
    }
}

/// One frame from the plugin.
#[derive(Debug)]
enum Incoming {
    /// What it reports for one request.
    Event { request_id: String, event: PluginEvent },
    /// A stage on another box asks for the bundle of this SHA-256.
    Bundle { sha256: String },
}

/// What the plugin reports for one request.
#[derive(Debug)]
pub enum PluginEvent {
    Block { index: u32, part: Part, stage: Stage },
    Done { end: End, stage: Stage },
    Error { failure: PluginFailure, message: String },
}

#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    #[error("plugin socket {0}: {1}")]
    Bind(String, std::io::Error),
    #[error("plugin stream: {0}")]
    Io(#[from] std::io::Error),
    #[error("plugin sent a malformed message: {0}")]
    Malformed(String),
}

/// Request id → the Prefill call waiting for its blocks.
pub struct Router {
    socket: PathBuf,
    waiting: Mutex<HashMap<String, Waiting>>,
}

struct Waiting {
    events: mpsc::Sender<PluginEvent>,
    /// Largest block payload this request may receive (0 until it knows its
    /// decoder's spec: no block is expected before that).
    max_payload: usize,
}

/// A request's subscription; unregisters on drop.
pub struct Registration {
    router: Arc<Router>,
    request_id: String,
    pub events: mpsc::Receiver<PluginEvent>,
}

impl Registration {
    /// Accepts blocks of up to `bytes` from now on.
    pub fn expect_blocks(&self, bytes: usize) {
        if let Some(waiting) = self.router.waiting.lock().unwrap().get_mut(&self.request_id) {
            waiting.max_payload = bytes;
        }
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.router.waiting.lock().unwrap().remove(&self.request_id);
    }
}

impl Router {
    pub fn new(socket: PathBuf) -> Arc<Self> {
        Arc::new(Router { socket, waiting: Mutex::new(HashMap::new()) })
    }

    /// The unix socket the plugin connects to.
    pub fn socket_path(&self) -> &Path {
        &self.socket
    }

    /// Subscribes to the plugin's messages for `request_id`; refuses (with
    /// the id) one that is already registered, so no call can take over
    /// another's channel.
    pub fn register(self: &Arc<Self>, request_id: &str, capacity: usize) -> Result<Registration, String> {
        let (tx, rx) = mpsc::channel(capacity);
        match self.waiting.lock().unwrap().entry(request_id.to_owned()) {
            std::collections::hash_map::Entry::Occupied(_) => return Err(request_id.to_owned()),
            std::collections::hash_map::Entry::Vacant(slot) => slot.insert(Waiting { events: tx, max_payload: 0 }),
        };
        Ok(Registration { router: self.clone(), request_id: request_id.to_owned(), events: rx })
    }

    fn sender(&self, request_id: &str) -> Option<mpsc::Sender<PluginEvent>> {
        self.waiting.lock().unwrap().get(request_id).map(|w| w.events.clone())
    }

    /// None when nobody waits for `request_id` (its call ended).
    fn max_payload(&self, request_id: &str) -> Option<usize> {
        self.waiting.lock().unwrap().get(request_id).map(|w| w.max_payload)
    }

    /// Binds the plugin socket (replacing a stale one) and serves it until `stop`.
    pub async fn serve(self: Arc<Self>, stop: CancellationToken) -> Result<(), CaptureError> {
        let path = self.socket.clone();
        let path = path.as_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| CaptureError::Bind(path.display().to_string(), e))?;
        }
        let _ = std::fs::remove_file(path);
        let bind_error = |e| CaptureError::Bind(path.display().to_string(), e);
        let listener = UnixListener::bind(path).map_err(bind_error)?;
        std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).map_err(bind_error)?;
        // SAFETY: geteuid cannot fail.
        let own_uid = unsafe { libc::geteuid() };
        loop {
            let stream = tokio::select! {
                _ = stop.cancelled() => break,
                accepted = listener.accept() => accepted?.0,
            };
            // A connection made before the chmod, or by root, still has to be ours.
            match stream.peer_cred() {
                Ok(cred) if cred.uid() == own_uid => {}
                other => {
                    tracing::warn!(peer = ?other.map(|c| c.uid()), "plugin socket: a connection from another user refused");
                    continue;
                }
            }
            let router = self.clone();
            tokio::spawn(async move {
                if let Err(e) = router.relay(stream, None).await {
                    tracing::warn!(error = %e, "plugin connection failed");
                }
            });
        }
        let _ = std::fs::remove_file(path);
        Ok(())
    }

    /// Forwards one plugin connection's messages to their request. Requests
    /// the connection was carrying when it ends (the engine died mid-request)
    /// get an error event at once instead of waiting out their deadline.
    /// `bundles`: where bundles are served from, on connections that may ask
    /// for one (a stage on another box); its answer ends the connection.
    pub(crate) async fn relay(
        &self,
        mut stream: impl AsyncRead + AsyncWrite + Unpin,
        bundles: Option<&Path>,
    ) -> Result<(), CaptureError> {
        let mut unfinished = HashSet::new();
        let ended = loop {
            let (request_id, event) = match read_incoming(&mut stream, |id| self.max_payload(id)).await {
                Ok(Some(Incoming::Event { request_id, event })) => (request_id, event),
                Ok(Some(Incoming::Bundle { sha256 })) => match bundles {
                    Some(dir) if unfinished.is_empty() => break serve_bundle(&mut stream, dir, &sha256).await,
                    _ => break Err(CaptureError::Malformed("a bundle request on a stream of blocks".into())),
                },
                Ok(None) => break Ok(()),
                Err(e) => break Err(e),
            };
            if matches!(event, PluginEvent::Block { .. }) {
                unfinished.insert(request_id.clone());
            } else {
                unfinished.remove(&request_id);
            }
            let Some(tx) = self.sender(&request_id) else {
                tracing::warn!(request_id, "plugin message for a request nobody waits for; dropped");
                continue;
            };
            // The receiver may be gone (the Prefill call gave up); keep draining.
            let _ = tx.send(event).await;
        };
        for request_id in unfinished {
            if let Some(tx) = self.sender(&request_id) {
                let message = "the plugin's connection closed before the request's end (did the engine die?)".into();
                let _ = tx.send(PluginEvent::Error { failure: PluginFailure::Internal, message }).await;
            }
        }
        ended
    }
}

/// The end of a request's prefill as one stage (or the whole engine) reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct End {
    pub num_tokens: u32,
    pub blocks_emitted: u32,
    /// The plugin's stages by name (`PluginTimings`' fields without "_ms"), as `Outcome.stage_ms`
    /// reports them.
    pub timings_ms: BTreeMap<String, f64>,
}

/// `PluginTimings` by stage name.
fn named(t: PluginTimings) -> BTreeMap<String, f64> {
    let stages = [
        ("capture", t.capture_ms),
        ("to_mlx", t.to_mlx_ms),
        ("reconstruct", t.reconstruct_ms),
        ("to_host", t.to_host_ms),
        ("send", t.send_ms),
        ("ring_wait", t.ring_wait_ms),
    ];
    stages.into_iter().map(|(name, ms)| (name.to_owned(), ms)).collect()
}

impl End {
    /// The whole engine's end from its stages': the tokens and blocks every stage got to (the
    /// least), each timing the slowest stage's (stages run side by side), and with several stages
    /// each stage's own as `{name}_stage{i}`.
    fn merged(ends: BTreeMap<u32, End>) -> End {
        let mut merged = End { num_tokens: u32::MAX, blocks_emitted: u32::MAX, timings_ms: BTreeMap::new() };
        let several = ends.len() > 1;
        for (stage, end) in ends {
            merged.num_tokens = merged.num_tokens.min(end.num_tokens);
            merged.blocks_emitted = merged.blocks_emitted.min(end.blocks_emitted);
            for (name, ms) in end.timings_ms {
                if several {
                    merged.timings_ms.insert(format!("{name}_stage{stage}"), ms);
                }
                let slowest = merged.timings_ms.entry(name).or_insert(ms);
                *slowest = slowest.max(ms);
            }
        }
        merged
    }
}

/// One stage's part of a block: its layers' tensors, slices of `payload`.
#[derive(Debug)]
pub struct Part {
    pub tensors: Vec<TensorSlice>,
    pub payload: Bytes,
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum StageError {
    #[error("stage {index} of {count} does not exist")]
    OutOfRange { index: u32, count: u32 },
    #[error("stage {index} counts {count} stages, an earlier message {known}")]
    Inconsistent { index: u32, count: u32, known: u32 },
    #[error("stage {stage} sent block {block} twice")]
    DuplicatePart { stage: u32, block: u32 },
    #[error("stage {stage} ended twice")]
    DuplicateEnd { stage: u32 },
}

/// Assembles one request's blocks from the engine's pipeline stages: each
/// sends its own layers' part of every block and its own end. A block, or
/// the end, is whole once every stage's has arrived (at once with one
/// stage). Parts wait here rather than in the decoder, so it only ever sees
/// whole blocks; they are bounded by how far one stage runs ahead of another
/// (the plugin's queue).
#[derive(Debug, Default)]
pub struct Stages {
    count: Option<u32>,
    parts: BTreeMap<u32, BTreeMap<u32, Part>>,
    ends: BTreeMap<u32, End>,
}

impl Stages {
    fn check(&mut self, stage: Stage) -> Result<(), StageError> {
        let Stage { index, count } = stage;
        if index >= count {
            return Err(StageError::OutOfRange { index, count });
        }
        match *self.count.get_or_insert(count) {
            known if known != count => Err(StageError::Inconsistent { index, count, known }),
            _ => Ok(()),
        }
    }

    /// Every stage's part of block `index`, in stage order, once the last has arrived.
    pub fn block(&mut self, stage: Stage, index: u32, part: Part) -> Result<Option<Vec<Part>>, StageError> {
        self.check(stage)?;
        let parts = self.parts.entry(index).or_default();
        if parts.insert(stage.index, part).is_some() {
            return Err(StageError::DuplicatePart { stage: stage.index, block: index });
        }
        if parts.len() < stage.count as usize {
            return Ok(None);
        }
        Ok(self.parts.remove(&index).map(|parts| parts.into_values().collect()))
    }

    /// The engine's end, once every stage has ended.
    pub fn end(&mut self, stage: Stage, end: End) -> Result<Option<End>, StageError> {
        self.check(stage)?;
        if self.ends.insert(stage.index, end).is_some() {
            return Err(StageError::DuplicateEnd { stage: stage.index });
        }
        if self.ends.len() < stage.count as usize {
            return Ok(None);
        }
        Ok(Some(End::merged(std::mem::take(&mut self.ends))))
    }
}

/// Answers a bundle request: a `BundleReply` framed like a `PluginFrame`, then
/// the bundle's bytes, or why there are none. Only `<dir>/<sha256>.safetensors`
/// can be read, and only for a well-formed SHA-256.
async fn serve_bundle(stream: &mut (impl AsyncWrite + Unpin), dir: &Path, sha256: &str) -> Result<(), CaptureError> {
    let well_formed = sha256.len() == 64 && sha256.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    let opened = match well_formed {
        true => open_bundle(&dir.join(format!("{sha256}.safetensors"))).await,
        false => Err(format!("{sha256:?} is not a SHA-256 (64 lowercase hex digits)")),
    };
    let reply = match &opened {
        Ok((_, size)) => BundleReply { size: *size, error: String::new() },
        Err(why) => BundleReply { size: 0, error: why.clone() },
    };
    let header = reply.encode_to_vec();
    stream.write_all(&(header.len() as u32).to_le_bytes()).await?;
    stream.write_all(&header).await?;
    match opened {
        Ok((mut file, size)) => {
            if tokio::io::copy(&mut file, stream).await? != size {
                return Err(CaptureError::Io(std::io::ErrorKind::UnexpectedEof.into()));
            }
            tracing::info!(bundle = sha256, bytes = size, "bundle served to a stage on another box");
        }
        Err(why) => tracing::warn!(bundle = sha256, why, "bundle refused to a stage on another box"),
    }
    stream.shutdown().await?;
    Ok(())
}

async fn open_bundle(path: &Path) -> Result<(tokio::fs::File, u64), String> {
    let missing = |e: std::io::Error| {
        format!(
            "no bundle {} here ({e}): prefilld fetches a decoder's bundle when it meets the decoder",
            path.display()
        )
    };
    let file = tokio::fs::File::open(path).await.map_err(missing)?;
    let size = file.metadata().await.map_err(missing)?.len();
    Ok((file, size))
}

/// Reads one frame; `max_payload` says how large a block the named request
/// may receive, checked before anything is allocated for it (None: nobody
/// waits for it, so its payload is skipped unread).
async fn read_incoming(
    stream: &mut (impl AsyncRead + Unpin),
    max_payload: impl Fn(&str) -> Option<usize>,
) -> Result<Option<Incoming>, CaptureError> {
    let mut len = [0u8; 4];
    match stream.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let header_len = u32::from_le_bytes(len) as usize;
    if header_len > MAX_HEADER_BYTES {
        return Err(CaptureError::Malformed(format!("header of {header_len} bytes")));
    }
    let mut header = vec![0u8; header_len];
    stream.read_exact(&mut header).await?;
    let frame = PluginFrame::decode(header.as_slice()).map_err(|e| CaptureError::Malformed(e.to_string()))?;
    let stage = Stage::of(&frame);
    let event = match frame.frame {
        Some(Frame::Block(block)) => {
            let bytes = block.payload_bytes;
            let tensors: Vec<_> =
                block.tensors.into_iter().map(|t| TensorSlice::of(t, bytes)).collect::<Result<_, _>>()?;
            let part = match max_payload(&frame.request_id) {
                Some(limit) => Part { tensors, payload: read_payload(stream, bytes, limit, &frame.request_id).await? },
                None => {
                    skip(stream, bytes).await?;
                    Part { tensors: Vec::new(), payload: Bytes::new() } // the payload they pointed into is gone
                }
            };
            PluginEvent::Block { index: block.index, part, stage }
        }
        Some(Frame::Done(done)) => {
            let timings_ms = named(done.timings.unwrap_or_default());
            PluginEvent::Done {
                end: End { num_tokens: done.num_tokens, blocks_emitted: done.blocks_emitted, timings_ms },
                stage,
            }
        }
        Some(Frame::Error(error)) => PluginEvent::Error { failure: error.failure(), message: error.message },
        Some(Frame::Bundle(request)) => return Ok(Some(Incoming::Bundle { sha256: request.sha256 })),
        None => return Err(CaptureError::Malformed("a frame that is no block, done or error".into())),
    };
    Ok(Some(Incoming::Event { request_id: frame.request_id, event }))
}

/// A block's payload of `bytes`, if its request accepts that much (`limit`).
async fn read_payload(
    stream: &mut (impl AsyncRead + Unpin),
    bytes: u64,
    limit: usize,
    request_id: &str,
) -> Result<Bytes, CaptureError> {
    if bytes > limit as u64 {
        return Err(CaptureError::Malformed(format!(
            "block of {bytes} bytes for {request_id:?}, which accepts at most {limit}"
        )));
    }
    // Read into spare capacity: zero-filling first would be one more pass over every byte of the
    // cache (17 GB at 128K tokens of an 8B model). `take` keeps the reads inside this payload.
    let mut payload = BytesMut::with_capacity(bytes as usize);
    let mut rest = (&mut *stream).take(bytes);
    while (payload.len() as u64) < bytes {
        if rest.read_buf(&mut payload).await? == 0 {
            return Err(CaptureError::Io(std::io::ErrorKind::UnexpectedEof.into()));
        }
    }
    Ok(payload.freeze())
}

/// Reads past a payload nobody waits for.
async fn skip(stream: &mut (impl AsyncRead + Unpin), bytes: u64) -> Result<(), CaptureError> {
    if tokio::io::copy(&mut (&mut *stream).take(bytes), &mut tokio::io::sink()).await? < bytes {
        return Err(CaptureError::Io(std::io::ErrorKind::UnexpectedEof.into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
