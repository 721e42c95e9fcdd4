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
mod tests {
    use super::*;

    use pdbridge_common::proto::engine::{PluginBlock, PluginDone, PluginError};

    /// The next frame, which must be a request's event.
    async fn read_message(
        stream: &mut (impl AsyncRead + Unpin),
        max_payload: impl Fn(&str) -> Option<usize>,
    ) -> Result<Option<(String, PluginEvent)>, CaptureError> {
        Ok(match read_incoming(stream, max_payload).await? {
            Some(Incoming::Event { request_id, event }) => Some((request_id, event)),
            Some(other) => panic!("not an event: {other:?}"),
            None => None,
        })
    }

    fn frame(message: PluginFrame, payload: &[u8]) -> Vec<u8> {
        let header = message.encode_to_vec();
        let mut out = (header.len() as u32).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(payload);
        out
    }

    fn tensor(offset: u64, nbytes: u64) -> PluginTensor {
        let shape = vec![nbytes / 4];
        PluginTensor { layer: 0, name: "keys".into(), dtype: Dtype::F32 as i32, shape, offset, nbytes }
    }

    fn message(request_id: &str, frame: Frame) -> PluginFrame {
        PluginFrame { request_id: request_id.into(), frame: Some(frame), ..Default::default() }
    }

    fn block(request_id: &str, payload_bytes: u64, tensors: Vec<PluginTensor>) -> PluginFrame {
        message(request_id, Frame::Block(PluginBlock { index: 0, payload_bytes, tensors }))
    }

    fn done(request_id: &str, num_tokens: u32) -> PluginFrame {
        message(request_id, Frame::Done(PluginDone { num_tokens, blocks_emitted: 1, timings: None }))
    }

    #[tokio::test]
    async fn parses_block_done_and_error_frames() {
        let third = PluginBlock { index: 3, payload_bytes: 8, tensors: vec![tensor(0, 8)] };
        let mut bytes = frame(message("r", Frame::Block(third)), &[1, 2, 3, 4, 5, 6, 7, 8]);
        bytes.extend(frame(done("r", 9), &[]));
        let error = PluginError { failure: PluginFailure::BundleMismatch as i32, message: "x".into() };
        bytes.extend(frame(message("r", Frame::Error(error)), &[]));
        let mut reader = bytes.as_slice();
        let (id, event) = read_message(&mut reader, |_| Some(8)).await.unwrap().unwrap();
        assert_eq!(id, "r");
        let whole = Stage { index: 0, count: 1 };
        let PluginEvent::Block { index: 3, part, stage } = event else { panic!("{event:?}") };
        assert_eq!((part.payload.len(), stage, part.tensors[0].dtype), (8, whole, Dtype::F32));
        let (_, event) = read_message(&mut reader, |_| Some(8)).await.unwrap().unwrap();
        assert!(
            matches!(event, PluginEvent::Done { ref end, stage } if (end.num_tokens, end.blocks_emitted) == (9, 1) && stage == whole)
        );
        let (_, event) = read_message(&mut reader, |_| Some(8)).await.unwrap().unwrap();
        assert!(
            matches!(event, PluginEvent::Error { failure: PluginFailure::BundleMismatch, ref message } if message == "x")
        );
        assert!(read_message(&mut reader, |_| Some(8)).await.unwrap().is_none());
    }

    /// proto/golden's frames, which the plugin's tests also hold to its writer: framed, they read
    /// as the events they describe, the plugin's timings under `Outcome.stage_ms`'s stage names.
    #[tokio::test]
    async fn the_golden_frames_read_as_their_events() {
        let golden = |name: &str| -> PluginFrame {
            let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden").join(name);
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
        };
        let block = golden("PluginFrame.json");
        let Some(Frame::Block(ref b)) = block.frame else { panic!("PluginFrame.json is a block") };
        let mut bytes = frame(block.clone(), &vec![0; b.payload_bytes as usize]);
        bytes.extend(frame(golden("PluginFrame.done.json"), &[]));
        bytes.extend(frame(golden("PluginFrame.error.json"), &[]));
        let mut reader = bytes.as_slice();
        let (_, event) = read_message(&mut reader, |_| Some(1 << 20)).await.unwrap().unwrap();
        let PluginEvent::Block { part, stage, .. } = event else { panic!("{event:?}") };
        assert_eq!((part.tensors.len(), stage), (b.tensors.len(), Stage { index: block.stage, count: block.stages }));
        let (_, event) = read_message(&mut reader, |_| None).await.unwrap().unwrap();
        let PluginEvent::Done { end, .. } = event else { panic!("{event:?}") };
        let stages: Vec<_> = end.timings_ms.keys().map(String::as_str).collect();
        assert_eq!(stages, ["capture", "reconstruct", "send", "to_host", "to_mlx"]);
        assert!(end.timings_ms.values().all(|&ms| ms > 0.0), "every stage's time is read: {:?}", end.timings_ms);
        let (_, event) = read_message(&mut reader, |_| None).await.unwrap().unwrap();
        assert!(matches!(event, PluginEvent::Error { failure, .. } if failure != PluginFailure::Unspecified));
    }

    fn part(layer: u32) -> Part {
        let tensor =
            TensorSlice { layer, name: "keys".into(), dtype: Dtype::F32, shape: vec![1], offset: 0, nbytes: 4 };
        Part { tensors: vec![tensor], payload: Bytes::from_static(&[0; 4]) }
    }

    fn end(num_tokens: u32, blocks_emitted: u32, reconstruct_ms: f64) -> End {
        End { num_tokens, blocks_emitted, timings_ms: [("reconstruct".to_owned(), reconstruct_ms)].into() }
    }

    #[test]
    fn a_whole_engine_passes_blocks_and_its_end_straight_through() {
        let mut stages = Stages::default();
        let whole = Stage { index: 0, count: 1 };
        let parts = stages.block(whole, 0, part(0)).unwrap().unwrap();
        assert_eq!(parts.len(), 1);
        assert_eq!(stages.end(whole, end(512, 2, 7.0)).unwrap(), Some(end(512, 2, 7.0)));
    }

    #[test]
    fn a_block_is_whole_once_every_stage_sent_its_part() {
        let mut stages = Stages::default();
        let (first, second) = (Stage { index: 0, count: 2 }, Stage { index: 1, count: 2 });
        assert!(stages.block(second, 0, part(1)).unwrap().is_none());
        assert!(stages.block(first, 1, part(0)).unwrap().is_none());
        let block0 = stages.block(first, 0, part(0)).unwrap().unwrap();
        assert_eq!(block0.iter().map(|p| p.tensors[0].layer).collect::<Vec<_>>(), [0, 1], "in stage order");
        assert_eq!(stages.block(second, 1, part(1)).unwrap().unwrap().len(), 2);

        assert!(stages.end(first, end(512, 2, 30.0)).unwrap().is_none());
        let merged = stages.end(second, end(512, 1, 20.0)).unwrap().unwrap();
        assert_eq!((merged.num_tokens, merged.blocks_emitted), (512, 1), "what every stage got to");
        let timings: Vec<_> = merged.timings_ms.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        assert_eq!(timings, [("reconstruct", 30.0), ("reconstruct_stage0", 30.0), ("reconstruct_stage1", 20.0)]);
    }

    #[test]
    fn stages_that_contradict_each_other_are_refused() {
        let mut stages = Stages::default();
        let first = Stage { index: 0, count: 2 };
        assert_eq!(
            stages.block(Stage { index: 2, count: 2 }, 0, part(0)).unwrap_err(),
            StageError::OutOfRange { index: 2, count: 2 }
        );
        stages.block(first, 0, part(0)).unwrap();
        assert_eq!(stages.block(first, 0, part(0)).unwrap_err(), StageError::DuplicatePart { stage: 0, block: 0 });
        assert_eq!(
            stages.block(Stage { index: 1, count: 3 }, 0, part(1)).unwrap_err(),
            StageError::Inconsistent { index: 1, count: 3, known: 2 }
        );
        stages.end(first, end(1, 1, 1.0)).unwrap();
        assert_eq!(stages.end(first, end(1, 1, 1.0)).unwrap_err(), StageError::DuplicateEnd { stage: 0 });
    }

    #[tokio::test]
    async fn a_stage_names_itself_in_its_messages() {
        let bytes = frame(PluginFrame { stage: 1, stages: 2, ..done("r", 9) }, &[]);
        let (_, event) = read_message(&mut bytes.as_slice(), |_| Some(8)).await.unwrap().unwrap();
        assert!(matches!(event, PluginEvent::Done { stage: Stage { index: 1, count: 2 }, .. }));
    }

    #[tokio::test]
    async fn refuses_a_tensor_outside_its_payload_or_of_no_known_dtype() {
        for (tensor, why) in [
            (tensor(4, 8), "outside the payload"),
            (tensor(u64::MAX, 2), "outside the payload"),
            (PluginTensor { dtype: 0, ..tensor(0, 8) }, "no known dtype"),
            (PluginTensor { dtype: 99, ..tensor(0, 8) }, "no known dtype"),
        ] {
            let bytes = frame(block("r", 8, vec![tensor]), &[0; 8]);
            let refused = read_message(&mut bytes.as_slice(), |_| Some(8)).await;
            assert!(matches!(refused, Err(CaptureError::Malformed(ref m)) if m.contains(why)), "{refused:?}");
        }
        let empty = frame(PluginFrame { request_id: "r".into(), ..Default::default() }, &[]);
        assert!(matches!(read_message(&mut empty.as_slice(), |_| Some(8)).await, Err(CaptureError::Malformed(_))));
    }

    #[tokio::test]
    async fn refuses_a_block_larger_than_its_request_accepts_before_reading_it() {
        // Only the header is there: a reader that allocated or waited for the payload would fail otherwise.
        let bytes = frame(block("r", 1 << 40, vec![tensor(0, 8)]), &[]);
        let refused = read_message(&mut bytes.as_slice(), |id| (id == "r").then_some(1 << 20)).await;
        assert!(matches!(refused, Err(CaptureError::Malformed(ref m)) if m.contains("at most 1048576")), "{refused:?}");
    }

    #[test]
    fn a_request_id_in_use_cannot_be_registered_again() {
        let router = Router::new("unused.sock".into());
        let first = router.register("r", 1).unwrap();
        assert_eq!(router.register("r", 1).err().as_deref(), Some("r"));
        drop(first);
        assert!(router.register("r", 1).is_ok(), "free again once the first call ends");
    }

    /// Only the stage listener serves bundles: on the plugin socket the request ends the connection
    /// and nothing is written back.
    #[tokio::test]
    async fn a_bundle_request_on_the_plugin_socket_is_refused() {
        use pdbridge_common::proto::engine::BundleRequest;
        let router = Router::new("unused.sock".into());
        let request =
            PluginFrame { frame: Some(Frame::Bundle(BundleRequest { sha256: "0".repeat(64) })), ..Default::default() };
        let bytes = frame(request, &[]);
        let mut written = Vec::new();
        let ended = router.relay(tokio::io::join(bytes.as_slice(), &mut written), None).await;
        assert!(matches!(ended, Err(CaptureError::Malformed(ref why)) if why.contains("bundle")), "{ended:?}");
        assert!(written.is_empty());
    }

    #[tokio::test]
    async fn a_connection_lost_mid_request_ends_that_request() {
        let router = Router::new("unused.sock".into());
        let mut cut = router.register("cut", 4).unwrap();
        let mut finished = router.register("finished", 4).unwrap();
        cut.expect_blocks(4);
        finished.expect_blocks(4);
        let mut bytes = frame(block("cut", 4, vec![tensor(0, 4)]), &[0; 4]);
        bytes.extend(frame(block("finished", 4, vec![tensor(0, 4)]), &[0; 4]));
        bytes.extend(frame(done("finished", 4), &[]));
        router.relay(tokio::io::join(bytes.as_slice(), tokio::io::sink()), None).await.unwrap();
        assert!(matches!(cut.events.recv().await, Some(PluginEvent::Block { .. })));
        assert!(
            matches!(cut.events.recv().await, Some(PluginEvent::Error { ref message, .. }) if message.contains("connection closed"))
        );
        assert!(matches!(finished.events.recv().await, Some(PluginEvent::Block { .. })));
        assert!(matches!(finished.events.recv().await, Some(PluginEvent::Done { .. })));
        assert!(finished.events.try_recv().is_err(), "a finished request hears nothing more");
    }

    /// Fuzzing the plugin frame reader: whatever arrives on the socket, the reader never
    /// panics, never hands on a block larger than its request accepts, and never a tensor
    /// outside its payload.
    mod fuzz {
        use proptest::prelude::*;

        use super::*;

        const LIMIT: usize = 4096;

        /// Reads every message of `bytes` (an in-memory slice: the reader never waits).
        fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            runtime.block_on(async {
                let mut reader = bytes;
                // Each message either parses within its bounds or ends the connection with an error.
                while let Ok(Some((_, event))) = read_message(&mut reader, |id| (id == "r").then_some(LIMIT)).await {
                    if let PluginEvent::Block { part, .. } = event {
                        prop_assert!(part.payload.len() <= LIMIT);
                        for t in part.tensors {
                            prop_assert!(t.offset + t.nbytes <= part.payload.len());
                        }
                    }
                }
                Ok(())
            })
        }

        fn block_frame() -> impl Strategy<Value = Vec<u8>> {
            let id = prop_oneof![Just("r".to_owned()), Just("gone".to_owned()), "[a-z]{0,3}"];
            (id, 0usize..2 * LIMIT, 0usize..LIMIT, 0usize..LIMIT, 0usize..64).prop_map(
                |(request_id, payload_bytes, offset, nbytes, sent)| {
                    let header = block(&request_id, payload_bytes as u64, vec![tensor(offset as u64, nbytes as u64)]);
                    frame(header, &vec![1u8; sent.min(payload_bytes)])
                },
            )
        }

        proptest! {
            // At least this many cases; PROPTEST_CASES asks for more.
            #![proptest_config(ProptestConfig { cases: ProptestConfig::default().cases.max(1024), ..ProptestConfig::default() })]

            #[test]
            fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
                check(&bytes)?;
            }

            #[test]
            fn hostile_block_frames_stay_in_bounds(frames in prop::collection::vec(block_frame(), 1..6), cut in any::<prop::sample::Index>()) {
                let mut bytes: Vec<u8> = frames.concat();
                // A connection may also end anywhere.
                let keep = cut.index(bytes.len() + 1);
                bytes.truncate(keep);
                check(&bytes)?;
            }
        }
    }
}
