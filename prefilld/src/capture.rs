//! Receiving finished blocks from the vLLM plugin.
//!
//! The plugin (in the engine process that owns a request) connects to
//! prefilld's unix socket and sends, per request, `block` messages as blocks
//! finish and one `done` (or `error`) when the engine reports the end of the
//! request's prefill. Each message is a little-endian u32 header length, a
//! JSON header, then `payload_bytes` raw bytes. The [`Router`] hands every
//! message to the Prefill call that registered the request id, through a
//! bounded channel: a slow decoder link slows the plugin, never grows memory.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use bytes::{Bytes, BytesMut};
use serde::Deserialize;
use tokio::{
    io::{AsyncRead, AsyncReadExt},
    net::UnixListener,
    sync::mpsc,
};
use tokio_util::sync::CancellationToken;

/// Largest JSON header accepted from the plugin.
const MAX_HEADER_BYTES: usize = 1 << 20;
/// Largest block payload accepted from the plugin.
const MAX_PAYLOAD_BYTES: usize = 1 << 30;

/// One tensor's slice of a block payload.
#[derive(Debug, Clone, Deserialize)]
pub struct TensorSlice {
    pub layer: u32,
    pub name: String,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub offset: usize,
    pub nbytes: usize,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
enum Header {
    Block {
        request_id: String,
        block_index: u32,
        payload_bytes: usize,
        tensors: Vec<TensorSlice>,
    },
    Done {
        request_id: String,
        num_tokens: u32,
        blocks_emitted: u32,
        #[serde(default)]
        timings_ms: BTreeMap<String, f64>,
    },
    Error {
        request_id: String,
        reason: String,
        #[serde(default)]
        message: String,
    },
}

/// What the plugin reports for one request.
#[derive(Debug)]
pub enum PluginEvent {
    Block { index: u32, tensors: Vec<TensorSlice>, payload: Bytes },
    Done { num_tokens: u32, blocks_emitted: u32, timings_ms: BTreeMap<String, f64> },
    Error { reason: String, message: String },
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

/// Request id → the channel of the Prefill call waiting for its blocks.
pub struct Router {
    socket: PathBuf,
    waiting: Mutex<HashMap<String, mpsc::Sender<PluginEvent>>>,
}

/// A request's subscription; unregisters on drop.
pub struct Registration {
    router: Arc<Router>,
    request_id: String,
    pub events: mpsc::Receiver<PluginEvent>,
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

    /// Subscribes to the plugin's messages for `request_id`.
    pub fn register(self: &Arc<Self>, request_id: &str, capacity: usize) -> Registration {
        let (tx, rx) = mpsc::channel(capacity);
        self.waiting.lock().unwrap().insert(request_id.to_owned(), tx);
        Registration { router: self.clone(), request_id: request_id.to_owned(), events: rx }
    }

    fn sender(&self, request_id: &str) -> Option<mpsc::Sender<PluginEvent>> {
        self.waiting.lock().unwrap().get(request_id).cloned()
    }

    /// Binds the plugin socket (replacing a stale one) and serves it until `stop`.
    pub async fn serve(self: Arc<Self>, stop: CancellationToken) -> Result<(), CaptureError> {
        let path = self.socket.clone();
        let path = path.as_path();
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| CaptureError::Bind(path.display().to_string(), e))?;
        }
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path).map_err(|e| CaptureError::Bind(path.display().to_string(), e))?;
        loop {
            let stream = tokio::select! {
                _ = stop.cancelled() => break,
                accepted = listener.accept() => accepted?.0,
            };
            let router = self.clone();
            tokio::spawn(async move {
                if let Err(e) = router.relay(stream).await {
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
    async fn relay(&self, mut stream: impl AsyncRead + Unpin) -> Result<(), CaptureError> {
        let mut unfinished = HashSet::new();
        let ended = loop {
            let (request_id, event) = match read_message(&mut stream).await {
                Ok(Some(message)) => message,
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
                let message = "the plugin's connection closed before the request's end (did the engine die?)";
                let _ =
                    tx.send(PluginEvent::Error { reason: "plugin_disconnected".into(), message: message.into() }).await;
            }
        }
        ended
    }
}

async fn read_message(stream: &mut (impl AsyncRead + Unpin)) -> Result<Option<(String, PluginEvent)>, CaptureError> {
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
    let header: Header = serde_json::from_slice(&header).map_err(|e| CaptureError::Malformed(e.to_string()))?;
    Ok(Some(match header {
        Header::Block { request_id, block_index, payload_bytes, tensors } => {
            if payload_bytes > MAX_PAYLOAD_BYTES {
                return Err(CaptureError::Malformed(format!("payload of {payload_bytes} bytes")));
            }
            if let Some(t) = tensors.iter().find(|t| t.offset.saturating_add(t.nbytes) > payload_bytes) {
                return Err(CaptureError::Malformed(format!("tensor {}.{} outside the payload", t.layer, t.name)));
            }
            let mut payload = BytesMut::zeroed(payload_bytes);
            stream.read_exact(&mut payload).await?;
            (request_id, PluginEvent::Block { index: block_index, tensors, payload: payload.freeze() })
        }
        Header::Done { request_id, num_tokens, blocks_emitted, timings_ms } => {
            (request_id, PluginEvent::Done { num_tokens, blocks_emitted, timings_ms })
        }
        Header::Error { request_id, reason, message } => (request_id, PluginEvent::Error { reason, message }),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(header: serde_json::Value, payload: &[u8]) -> Vec<u8> {
        let header = serde_json::to_vec(&header).unwrap();
        let mut out = (header.len() as u32).to_le_bytes().to_vec();
        out.extend(header);
        out.extend(payload);
        out
    }

    #[tokio::test]
    async fn parses_block_done_and_error_messages() {
        let tensor = serde_json::json!({"layer": 0, "name": "keys", "dtype": "F32", "shape": [1, 1, 1, 2], "offset": 0, "nbytes": 8});
        let mut bytes = frame(
            serde_json::json!({"type": "block", "request_id": "r", "block_index": 3, "payload_bytes": 8, "tensors": [tensor]}),
            &[1, 2, 3, 4, 5, 6, 7, 8],
        );
        bytes.extend(frame(
            serde_json::json!({"type": "done", "request_id": "r", "num_tokens": 9, "blocks_emitted": 1}),
            &[],
        ));
        bytes.extend(frame(serde_json::json!({"type": "error", "request_id": "r", "reason": "x"}), &[]));
        let mut reader = bytes.as_slice();
        let (id, event) = read_message(&mut reader).await.unwrap().unwrap();
        assert_eq!(id, "r");
        assert!(matches!(event, PluginEvent::Block { index: 3, ref payload, .. } if payload.len() == 8));
        let (_, event) = read_message(&mut reader).await.unwrap().unwrap();
        assert!(matches!(event, PluginEvent::Done { num_tokens: 9, blocks_emitted: 1, .. }));
        let (_, event) = read_message(&mut reader).await.unwrap().unwrap();
        assert!(matches!(event, PluginEvent::Error { ref reason, .. } if reason == "x"));
        assert!(read_message(&mut reader).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn refuses_a_tensor_outside_its_payload() {
        let tensor =
            serde_json::json!({"layer": 0, "name": "keys", "dtype": "F32", "shape": [2], "offset": 4, "nbytes": 8});
        let bytes = frame(
            serde_json::json!({"type": "block", "request_id": "r", "block_index": 0, "payload_bytes": 8, "tensors": [tensor]}),
            &[0; 8],
        );
        assert!(matches!(read_message(&mut bytes.as_slice()).await, Err(CaptureError::Malformed(_))));
    }

    #[tokio::test]
    async fn a_connection_lost_mid_request_ends_that_request() {
        let router = Router::new("unused.sock".into());
        let mut cut = router.register("cut", 4);
        let mut finished = router.register("finished", 4);
        let block = |id: &str| {
            let tensor =
                serde_json::json!({"layer": 0, "name": "keys", "dtype": "F32", "shape": [1], "offset": 0, "nbytes": 4});
            frame(
                serde_json::json!({"type": "block", "request_id": id, "block_index": 0, "payload_bytes": 4, "tensors": [tensor]}),
                &[0; 4],
            )
        };
        let mut bytes = block("cut");
        bytes.extend(block("finished"));
        bytes.extend(frame(
            serde_json::json!({"type": "done", "request_id": "finished", "num_tokens": 4, "blocks_emitted": 1}),
            &[],
        ));
        router.relay(bytes.as_slice()).await.unwrap();
        assert!(matches!(cut.events.recv().await, Some(PluginEvent::Block { .. })));
        assert!(
            matches!(cut.events.recv().await, Some(PluginEvent::Error { ref reason, .. }) if reason == "plugin_disconnected")
        );
        assert!(matches!(finished.events.recv().await, Some(PluginEvent::Block { .. })));
        assert!(matches!(finished.events.recv().await, Some(PluginEvent::Done { .. })));
        assert!(finished.events.try_recv().is_err(), "a finished request hears nothing more");
    }
}
