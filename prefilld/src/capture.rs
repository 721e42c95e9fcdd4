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
//!
//! On this box a block's payload may stay in the plugin's shared ring (the kv
//! route's): the connection names the ring (a descriptor of the connected
//! process, mapped read-only through /proc), a block says where its bytes are,
//! and its payload is a view of the mapping ([`InRing`]), not a copy. Each
//! block's bytes go back to the plugin (a `PluginRelease` on the connection)
//! once nothing here holds them any more, pushed or dropped; the connection
//! ends only after the last, so the plugin never reuses bytes that are still
//! being read.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use bytes::{Bytes, BytesMut};
use pdbridge_common::proto::{
    Dtype,
    engine::{
        BundleReply, PluginFailure, PluginFrame, PluginRelease, PluginTensor, PluginTimings, plugin_frame::Frame,
    },
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
    /// The plugin on this box names its shared ring: its descriptor `fd`, of `size` bytes.
    Ring { fd: u32, size: u64 },
}

/// How a connection's frames end: the stream's end, or a bundle request (its only frame).
enum Ended {
    Closed,
    Bundle(String),
}

/// A connection from the plugin on this box: the process at its other end, whose ring it may
/// name, and where its blocks' releases go.
struct Local {
    peer_pid: Option<i32>,
    releases: mpsc::UnboundedSender<u64>,
}

impl Local {
    /// Maps the ring the peer holds as descriptor `fd` (at least `size` bytes), read-only.
    fn map(&self, fd: u32, size: u64) -> Result<Ring, CaptureError> {
        let pid = self.peer_pid.ok_or_else(|| malformed_ring("the connected process is unknown"))?;
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::File::open(&path).map_err(|e| malformed_ring(&format!("{path}: {e}")))?;
        let len = file.metadata().map_err(|e| malformed_ring(&format!("{path}: {e}")))?.len();
        if len < size {
            return Err(malformed_ring(&format!("{path} holds {len} bytes, not {size}")));
        }
        // SAFETY: the plugin writes a block's bytes before its frame and not again until its
        // release, which is sent only once every view of them here is gone (`InRing`).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| malformed_ring(&format!("{path}: {e}")))?;
        Ok(Ring { map: Arc::new(map), releases: self.releases.clone() })
    }
}

fn malformed_ring(why: &str) -> CaptureError {
    CaptureError::Malformed(format!("the plugin's ring cannot be mapped: {why}"))
}

/// The plugin's ring as one connection maps it.
struct Ring {
    map: Arc<memmap2::Mmap>,
    releases: mpsc::UnboundedSender<u64>,
}

impl Ring {
    /// The `bytes` at `offset`, a view that releases them to the plugin when its last clone drops.
    fn payload(&self, offset: u64, bytes: u64) -> Result<Bytes, CaptureError> {
        let end = offset.checked_add(bytes).filter(|end| *end <= self.map.len() as u64);
        end.ok_or_else(|| {
            CaptureError::Malformed(format!(
                "a block of {bytes} bytes at {offset} outside the {}-byte ring",
                self.map.len()
            ))
        })?;
        let (start, len) = (offset as usize, bytes as usize);
        Ok(Bytes::from_owner(InRing { map: self.map.clone(), start, len, releases: self.releases.clone() }))
    }
}

/// A block's bytes in the plugin's ring; dropped, they are the plugin's again.
struct InRing {
    map: Arc<memmap2::Mmap>,
    start: usize,
    len: usize,
    releases: mpsc::UnboundedSender<u64>,
}

impl AsRef<[u8]> for InRing {
    fn as_ref(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }
}

impl Drop for InRing {
    fn drop(&mut self) {
        // The connection's answering side is gone only once every InRing is (it holds the
        // receiver until the last sender drops).
        let _ = self.releases.send(self.start as u64);
    }
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
            let peer_pid = stream.peer_cred().ok().and_then(|cred| cred.pid());
            tokio::spawn(async move {
                if let Err(e) = router.relay_local(stream, peer_pid).await {
                    tracing::warn!(error = %e, "plugin connection failed");
                }
            });
        }
        let _ = std::fs::remove_file(path);
        Ok(())
    }

    /// Forwards the messages of one connection from the plugin on this box (`peer_pid`, the
    /// process whose ring it may name), answering each of its ring's blocks once nothing here
    /// holds it; the connection ends after the last answer.
    pub(crate) async fn relay_local(
        &self,
        stream: impl AsyncRead + AsyncWrite + Unpin,
        peer_pid: Option<i32>,
    ) -> Result<(), CaptureError> {
        let (mut frames, answers) = tokio::io::split(stream);
        let (releases, released) = mpsc::unbounded_channel();
        let forwarded = self.forward(&mut frames, Some(Local { peer_pid, releases }));
        let (ended, ()) = tokio::join!(forwarded, answer_releases(answers, released));
        match ended? {
            Ended::Closed => Ok(()),
            Ended::Bundle(_) => Err(CaptureError::Malformed("a bundle request on the plugin socket".into())),
        }
    }

    /// Forwards the messages of a connection from a stage on another box; one that asks for a
    /// bundle is answered with it from `bundles`, which ends it.
    pub(crate) async fn relay(
        &self,
        mut stream: impl AsyncRead + AsyncWrite + Unpin,
        bundles: &Path,
    ) -> Result<(), CaptureError> {
        match self.forward(&mut stream, None).await? {
            Ended::Closed => Ok(()),
            Ended::Bundle(sha256) => serve_bundle(&mut stream, bundles, &sha256).await,
        }
    }

    /// Forwards one connection's messages to their request, until it ends or asks for a bundle
    /// (its first and only frame). Requests the connection was carrying when it ends (the engine
    /// died mid-request) get an error event at once instead of waiting out their deadline.
    async fn forward(
        &self,
        stream: &mut (impl AsyncRead + Unpin),
        local: Option<Local>,
    ) -> Result<Ended, CaptureError> {
        let mut unfinished = HashSet::new();
        let mut ring = None;
        let ended = loop {
            let (request_id, event) = match read_incoming(stream, |id| self.max_payload(id), ring.as_ref()).await {
                Ok(Some(Incoming::Event { request_id, event })) => (request_id, event),
                Ok(Some(Incoming::Bundle { sha256 })) if unfinished.is_empty() => break Ok(Ended::Bundle(sha256)),
                Ok(Some(Incoming::Bundle { .. })) => {
                    break Err(CaptureError::Malformed("a bundle request on a stream of blocks".into()));
                }
                Ok(Some(Incoming::Ring { fd, size })) => match local.as_ref().map(|local| local.map(fd, size)) {
                    Some(Ok(mapped)) => {
                        ring = Some(mapped);
                        continue;
                    }
                    Some(Err(e)) => break Err(e),
                    None => break Err(CaptureError::Malformed("a ring named from another box".into())),
                },
                Ok(None) => break Ok(Ended::Closed),
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

/// Tells the plugin each of its ring's blocks released (`PluginRelease`, framed as its frames
/// are), until no block of the connection is held here any more. A plugin that stopped reading
/// is still waited for: its ring's bytes must not be reused while they are read here.
async fn answer_releases(mut answers: impl AsyncWrite + Unpin, mut released: mpsc::UnboundedReceiver<u64>) {
    let mut writable = true;
    while let Some(ring_offset) = released.recv().await {
        if writable {
            let message = PluginRelease { ring_offset }.encode_to_vec();
            let mut frame = (message.len() as u32).to_le_bytes().to_vec();
            frame.extend(message);
            writable = answers.write_all(&frame).await.is_ok();
        }
    }
    let _ = answers.shutdown().await;
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
    ring: Option<&Ring>,
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
            let limit = max_payload(&frame.request_id);
            let in_ring = match (block.ring_offset, ring) {
                (Some(offset), Some(ring)) => Some(ring.payload(offset, bytes)?),
                (Some(_), None) => return Err(CaptureError::Malformed("a block in a ring never named".into())),
                (None, _) => None,
            };
            let part = match limit {
                Some(limit) if bytes > limit as u64 => return Err(too_large(bytes, limit, &frame.request_id)),
                Some(_) => {
                    let payload = match in_ring {
                        Some(payload) => payload,
                        None => read_payload(stream, bytes).await?,
                    };
                    Part { tensors, payload }
                }
                None => {
                    if in_ring.is_none() {
                        skip(stream, bytes).await?;
                    }
                    // Nobody waits for it: the payload they pointed into is gone (a ring's released).
                    Part { tensors: Vec::new(), payload: Bytes::new() }
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
        Some(Frame::Ring(ring)) => return Ok(Some(Incoming::Ring { fd: ring.fd, size: ring.size })),
        None => return Err(CaptureError::Malformed("a frame that is no block, done or error".into())),
    };
    Ok(Some(Incoming::Event { request_id: frame.request_id, event }))
}

fn too_large(bytes: u64, limit: usize, request_id: &str) -> CaptureError {
    CaptureError::Malformed(format!("block of {bytes} bytes for {request_id:?}, which accepts at most {limit}"))
}

/// A block's payload of `bytes` from the stream (its size checked against its request's limit).
async fn read_payload(stream: &mut (impl AsyncRead + Unpin), bytes: u64) -> Result<Bytes, CaptureError> {
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
