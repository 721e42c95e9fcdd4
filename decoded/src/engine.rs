//! The decode engine: the mlx-lm adapter (`decoded/engine/pdbridge_mlx`) as a
//! supervised child process, and a typed client for its unix-socket protocol.
//!
//! Protocol: one request per connection, a JSON object and a newline; the
//! adapter answers with JSON lines and closes. A line with `"error"` ends a
//! failed request. The adapter prints `{"ready": true}` on stdout once its
//! model is loaded and its reconstruction bundle written.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::Duration,
};

use pdbridge_common::{
    process,
    proto::{CacheKind, CacheSpec, DecoderCode, Dtype, LayerSpec, Rope, TensorSpec},
    readiness::Readiness,
    spec,
};
use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    net::{UnixStream, unix::OwnedReadHalf},
    process::{Child, Command},
    sync::watch,
};
use tokio_util::sync::CancellationToken;

use crate::config::EngineConfig;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("decode engine is not ready")]
    NotReady,
    #[error("decoded runs on a fixed spec (spec_file) without a decode engine")]
    SpecOnly,
    #[error("decode engine connection: {0}")]
    Io(#[from] std::io::Error),
    #[error("decode engine sent an unreadable reply: {0}")]
    Protocol(String),
    /// The adapter refused the request as malformed (e.g. a block that does
    /// not match the spec).
    #[error("decode engine refused the request: {0}")]
    BadRequest(String),
    #[error("decode engine failed: {0}")]
    Internal(String),
    /// A store block the request named is missing, unreadable or fails its
    /// checksum: the store's fault, not the request's.
    #[error("store block {block} is unusable: {message}")]
    BlockUnusable { block: usize, message: String },
}

// ---------------------------------------------------------------------------
// Wire types of the adapter protocol.
// ---------------------------------------------------------------------------

#[derive(Debug, Deserialize)]
struct InfoReply {
    model_id: String,
    spec: SpecJson,
    bundle_path: PathBuf,
    bundle_sha256: String,
    tokenizer_sha256: String,
}

#[derive(Debug, Deserialize)]
struct SpecJson {
    architecture: String,
    num_layers: u32,
    num_attention_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    hidden_size: u32,
    vocab_size: u32,
    max_context: u32,
    block_tokens: u32,
    layers: Vec<LayerJson>,
    decoder_code: DecoderCodeJson,
    /// The activation dtype layer inputs are cast to ("F32", "BF16", …).
    input_dtype: String,
}

#[derive(Debug, Deserialize)]
struct DecoderCodeJson {
    model_type: String,
    mlx: String,
    mlx_lm: String,
}

#[derive(Debug, Deserialize)]
struct LayerJson {
    index: u32,
    cache_class: String,
    tensors: Vec<TensorJson>,
    rope: Option<RopeJson>,
    kind: String,
    #[serde(default)]
    unsupported_reason: String,
    #[serde(default)]
    window: u32,
    #[serde(default)]
    keep: u32,
    #[serde(default)]
    kv_bits: u32,
    #[serde(default)]
    kv_group_size: u32,
}

#[derive(Debug, Deserialize)]
struct TensorJson {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    /// Absent for a snapshot layer's tensors.
    #[serde(default)]
    token_axis: u32,
}

#[derive(Debug, Deserialize)]
struct RopeJson {
    kind: String,
    base: f64,
    traditional: bool,
    dims: u32,
    #[serde(default)]
    scaling: BTreeMap<String, f64>,
    module: String,
}

/// What the decoder tokenizes.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum TokenizeInput<'a> {
    Chat {
        messages: &'a serde_json::Value,
        add_generation_prompt: bool,
        /// The request's tool definitions, rendered by the chat template.
        #[serde(skip_serializing_if = "Option::is_none")]
        tools: Option<&'a serde_json::Value>,
    },
    Text {
        prompt: &'a str,
    },
}

/// A generation request; `blocks` are store files covering the prompt's start.
#[derive(Debug, Serialize)]
pub struct GenerateRequest<'a> {
    pub tokens: &'a [u32],
    pub blocks: &'a [PathBuf],
    /// The prompt's tail after `blocks` (all but its last token), in the block
    /// file format, when prefilld bridged it for this request.
    pub tail: Option<&'a Path>,
    pub spec_fingerprint: &'a str,
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    /// Stop sequences, applied by the adapter to the streamed text.
    pub stop: &'a [String],
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Each token's log probability with this many alternatives; None: off.
    pub logprobs: Option<u32>,
    /// The request's tool definitions: the adapter parses tool calls out of the answer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tools: Option<&'a serde_json::Value>,
}

/// A tool call the model made, parsed by mlx-lm's tool parser for the chat template.
#[derive(Debug, Clone, Deserialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text, as OpenAI's `function.arguments`.
    pub arguments: String,
}

/// One line of a generation.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum GenerateEvent {
    Token {
        token: u32,
        text: String,
        /// When asked for: OpenAI's entry for this token (`token`, `logprob`,
        /// `bytes`, `top_logprobs`), as the adapter computed it.
        #[serde(default)]
        logprob: Option<serde_json::Value>,
        /// Calls completed with this token (their text is not in `text`).
        #[serde(default)]
        tool_calls: Vec<ToolCall>,
    },
    Done(GenerateSummary),
}

#[derive(Debug, Clone, Deserialize)]
pub struct GenerateSummary {
    pub done: bool,
    pub finish_reason: String,
    pub prompt_tokens: u32,
    pub cached_tokens: u32,
    pub completion_tokens: u32,
    #[serde(default)]
    pub timings_ms: BTreeMap<String, f64>,
    /// Characters the detokenizer held back until the end.
    #[serde(default)]
    pub text: String,
    /// A call that ended with the answer (a parser without an end marker).
    #[serde(default)]
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Debug, Deserialize)]
struct ErrorReply {
    error: String,
    #[serde(default)]
    kind: String,
    /// With kind `block_unusable`: which of the request's blocks.
    block: Option<usize>,
}

// ---------------------------------------------------------------------------
// The engine as the rest of decoded sees it.
// ---------------------------------------------------------------------------

/// The decoder's identity once its engine is up.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub spec: CacheSpec,
    pub bundle_path: PathBuf,
}

/// Handle to the decode engine: a client plus the current [`EngineInfo`]
/// (None while the engine is down).
#[derive(Clone)]
pub struct Engine {
    /// The adapter's socket; None when decoded runs on a fixed spec without
    /// an engine ([`Engine::fixed`]).
    socket: Option<PathBuf>,
    info: watch::Receiver<Option<Arc<EngineInfo>>>,
}

impl Engine {
    /// A decoder that publishes the spec in `path` (an adapter `info` reply,
    /// as JSON) and stores blocks, with no engine to tokenize or generate:
    /// the store and `CacheStore` work as with one, the front door answers 503.
    pub fn fixed(path: &Path, block_tokens: u32) -> Result<Engine, EngineError> {
        let read = |e: &dyn std::fmt::Display| EngineError::Protocol(format!("spec file {}: {e}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|e| read(&e))?;
        let info = to_spec(serde_json::from_str(&text).map_err(|e| read(&e))?)?;
        if info.spec.block_tokens != block_tokens {
            return Err(read(&format!(
                "block_tokens {} differs from store.block_tokens {block_tokens}",
                info.spec.block_tokens
            )));
        }
        let (_, info) = watch::channel(Some(Arc::new(info)));
        Ok(Engine { socket: None, info })
    }

    pub fn info(&self) -> Result<Arc<EngineInfo>, EngineError> {
        self.info.borrow().clone().ok_or(EngineError::NotReady)
    }

    /// Whether there is an engine to compute with (not a fixed spec alone).
    pub fn can_compute(&self) -> Result<(), EngineError> {
        self.socket().map(drop)
    }

    fn socket(&self) -> Result<&Path, EngineError> {
        self.socket.as_deref().ok_or(EngineError::SpecOnly)
    }

    /// The decoder's token ids for a chat or a plain prompt.
    pub async fn tokenize(&self, input: TokenizeInput<'_>) -> Result<Vec<u32>, EngineError> {
        self.info()?;
        #[derive(Serialize)]
        struct Req<'a> {
            op: &'static str,
            #[serde(flatten)]
            input: TokenizeInput<'a>,
        }
        #[derive(Deserialize)]
        struct Reply {
            tokens: Vec<u32>,
        }
        let mut lines = request(self.socket()?, &Req { op: "tokenize", input }).await?;
        let reply: Reply = next_reply(&mut lines).await?;
        Ok(reply.tokens)
    }

    /// Starts a generation; read its events from the returned stream.
    pub async fn generate(&self, req: &GenerateRequest<'_>) -> Result<Generation, EngineError> {
        self.info()?;
        #[derive(Serialize)]
        struct Req<'a, 'b> {
            op: &'static str,
            #[serde(flatten)]
            req: &'a GenerateRequest<'b>,
        }
        let lines = request(self.socket()?, &Req { op: "generate", req }).await?;
        Ok(Generation { lines, finished: false, first: None })
    }

    /// Computes the decoder's cache for the layer inputs in the safetensors
    /// file `inputs` (`"{layer}.input"`, `[rows, hidden_size]`, the tokens at
    /// positions `offset..offset + rows`) with its own modules and kernels,
    /// and writes its tensors (`"{layer}.{tensor}"`) to `out`.
    pub async fn reconstruct(&self, inputs: &Path, offset: u64, out: &Path) -> Result<(), EngineError> {
        self.info()?;
        #[derive(Deserialize)]
        struct Reply {}
        let body = serde_json::json!({"op": "reconstruct", "inputs": inputs, "offset": offset, "out": out});
        let mut lines = request(self.socket()?, &body).await?;
        next_reply::<Reply>(&mut lines).await.map(drop)
    }
}

/// The events of one generation, in order, ending with [`GenerateEvent::Done`].
pub struct Generation {
    lines: Lines<BufReader<OwnedReadHalf>>,
    finished: bool,
    /// The first event, read ahead by [`Generation::started`].
    first: Option<GenerateEvent>,
}

impl Generation {
    /// Waits for the first event, which the adapter sends only after it has
    /// restored the blocks and prefilled the rest of the prompt; an error
    /// before it (such as an unusable block) is returned here, while the
    /// request can still be served another way. The event stays for `next`.
    pub async fn started(&mut self) -> Result<(), EngineError> {
        match self.next().await {
            Some(Ok(event)) => {
                self.first = Some(event);
                self.finished = false;
                Ok(())
            }
            Some(Err(e)) => Err(e),
            None => Err(EngineError::Protocol("generation ended before it started".into())),
        }
    }

    pub async fn next(&mut self) -> Option<Result<GenerateEvent, EngineError>> {
        if let Some(event) = self.first.take() {
            self.finished = !matches!(event, GenerateEvent::Token { .. });
            return Some(Ok(event));
        }
        if self.finished {
            return None;
        }
        let event = next_reply::<GenerateEvent>(&mut self.lines).await;
        self.finished = !matches!(event, Ok(GenerateEvent::Token { .. }));
        Some(event)
    }
}

async fn request(socket: &Path, body: &impl Serialize) -> Result<Lines<BufReader<OwnedReadHalf>>, EngineError> {
    let stream = UnixStream::connect(socket).await?;
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_vec(body).map_err(|e| EngineError::Protocol(e.to_string()))?;
    line.push(b'\n');
    write.write_all(&line).await?;
    write.shutdown().await?;
    Ok(BufReader::new(read).lines())
}

async fn next_reply<T: for<'de> Deserialize<'de>>(
    lines: &mut Lines<BufReader<OwnedReadHalf>>,
) -> Result<T, EngineError> {
    let line =
        lines.next_line().await?.ok_or_else(|| EngineError::Protocol("connection closed before a reply".into()))?;
    if let Ok(err) = serde_json::from_str::<ErrorReply>(&line) {
        return Err(match (err.kind.as_str(), err.block) {
            ("bad_request", _) => EngineError::BadRequest(err.error),
            ("block_unusable", Some(block)) => EngineError::BlockUnusable { block, message: err.error },
            _ => EngineError::Internal(err.error),
        });
    }
    serde_json::from_str(&line).map_err(|e| EngineError::Protocol(format!("{e}: {line}")))
}

fn dtype_of(name: &str) -> Result<Dtype, EngineError> {
    Dtype::from_safetensors_name(name).ok_or_else(|| EngineError::Protocol(format!("unknown dtype {name}")))
}

fn to_spec(reply: InfoReply) -> Result<EngineInfo, EngineError> {
    let s = reply.spec;
    let layers = s
        .layers
        .into_iter()
        .map(|l| {
            let tensors = l
                .tensors
                .into_iter()
                .map(|t| {
                    let dtype = dtype_of(&t.dtype)?;
                    Ok(TensorSpec { name: t.name, dtype: dtype as i32, shape: t.shape, token_axis: t.token_axis })
                })
                .collect::<Result<Vec<_>, EngineError>>()?;
            let kind = match l.kind.as_str() {
                "rows" => CacheKind::Rows,
                "snapshot" => CacheKind::Snapshot,
                "pooled" => CacheKind::Pooled,
                "unsupported" => CacheKind::Unsupported,
                other => return Err(EngineError::Protocol(format!("layer {}: unknown cache kind {other:?}", l.index))),
            };
            Ok(LayerSpec {
                index: l.index,
                cache_class: l.cache_class,
                tensors,
                rope: l.rope.map(|r| Rope {
                    kind: r.kind,
                    base: r.base,
                    traditional: r.traditional,
                    dims: r.dims,
                    scaling: r.scaling,
                    module: r.module,
                }),
                window: l.window,
                keep: l.keep,
                kv_bits: l.kv_bits,
                kv_group_size: l.kv_group_size,
                kind: kind as i32,
                unsupported_reason: l.unsupported_reason,
            })
        })
        .collect::<Result<Vec<_>, EngineError>>()?;
    let mut spec = CacheSpec {
        model_id: reply.model_id,
        architecture: s.architecture,
        num_layers: s.num_layers,
        num_attention_heads: s.num_attention_heads,
        num_kv_heads: s.num_kv_heads,
        head_dim: s.head_dim,
        hidden_size: s.hidden_size,
        vocab_size: s.vocab_size,
        max_context: s.max_context,
        block_tokens: s.block_tokens,
        layers,
        weights_fingerprint: reply.bundle_sha256,
        tokenizer_fingerprint: reply.tokenizer_sha256,
        spec_fingerprint: String::new(),
        decoder_code: Some(DecoderCode {
            model_type: s.decoder_code.model_type,
            mlx: s.decoder_code.mlx,
            mlx_lm: s.decoder_code.mlx_lm,
        }),
        input_dtype: dtype_of(&s.input_dtype)? as i32,
    };
    spec.spec_fingerprint = spec::fingerprint(&spec);
    Ok(EngineInfo { spec, bundle_path: reply.bundle_path })
}

// ---------------------------------------------------------------------------
// Supervision.
// ---------------------------------------------------------------------------

/// Starts the adapter and keeps it running until `stop`: waits for its ready
/// line, loads its spec, flips `readiness`, and restarts it (same arguments)
/// whenever it exits. The returned task ends once `stop` has stopped the adapter.
pub fn supervise(
    config: EngineConfig,
    block_tokens: u32,
    readiness: Readiness,
    stop: CancellationToken,
) -> (Engine, tokio::task::JoinHandle<()>) {
    let (info_tx, info_rx) = watch::channel(None);
    let engine = Engine { socket: Some(config.socket.clone()), info: info_rx };
    let task = tokio::spawn(async move {
        let on_down = || {
            readiness.set(false);
            info_tx.send_replace(None);
        };
        let run = || run_once(&config, block_tokens, &readiness, &info_tx, &stop);
        process::supervise(ENGINE, config.restart_backoff, stop.clone(), run, on_down).await;
    });
    (engine, task)
}

/// Engine label in metrics.
const ENGINE: &str = "mlx";

/// How long the adapter gets to exit after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(10);

async fn run_once(
    config: &EngineConfig,
    block_tokens: u32,
    readiness: &Readiness,
    info_tx: &watch::Sender<Option<Arc<EngineInfo>>>,
    stop: &CancellationToken,
) -> Result<(), EngineError> {
    let mut child = spawn(config, block_tokens)?;
    let leader = child.id();
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let started = tokio::time::Instant::now();
    let ready = tokio::select! {
        _ = stop.cancelled() => return stop_child(child).await,
        r = tokio::time::timeout(config.start_timeout, wait_ready(&mut lines)) => r,
    };
    match ready {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            let _ = stop_child(child).await;
            return Err(e);
        }
        Err(_) => {
            let _ = stop_child(child).await;
            return Err(EngineError::Internal(format!("not ready after {:?}", config.start_timeout)));
        }
    }
    let info = match request(&config.socket, &serde_json::json!({"op": "info"})).await {
        Ok(mut lines) => next_reply::<InfoReply>(&mut lines).await.and_then(to_spec),
        Err(e) => Err(e),
    };
    let info = match info {
        Ok(info) => info,
        Err(e) => {
            let _ = stop_child(child).await;
            return Err(e);
        }
    };
    if info.spec.block_tokens != block_tokens {
        let _ = stop_child(child).await;
        return Err(EngineError::Protocol(format!(
            "engine block size {} differs from store.block_tokens {block_tokens}",
            info.spec.block_tokens
        )));
    }
    tracing::info!(
        model = %info.spec.model_id,
        layers = info.spec.num_layers,
        spec = %info.spec.spec_fingerprint,
        bytes_per_token = spec::bytes_per_token(&info.spec),
        startup = ?started.elapsed(),
        "decode engine ready"
    );
    info_tx.send_replace(Some(Arc::new(info)));
    readiness.set(true);
    process::mark_up(ENGINE);
    tokio::select! {
        _ = stop.cancelled() => stop_child(child).await,
        status = child.wait() => {
            process::kill_group(leader);
            Err(EngineError::Internal(format!("adapter exited: {}", status?)))
        }
    }
}

fn spawn(config: &EngineConfig, block_tokens: u32) -> Result<Child, EngineError> {
    if let Some(dir) = config.socket.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut cmd = Command::new(&config.python);
    cmd.arg("-m")
        .arg("pdbridge_mlx")
        .arg("--model")
        .arg(&config.model)
        .arg("--socket")
        .arg(&config.socket)
        .arg("--block-tokens")
        .arg(block_tokens.to_string())
        .arg("--dtype")
        .arg(config.dtype.as_str())
        .arg("--kv-group-size")
        .arg(config.kv_group_size.to_string())
        .arg("--max-batch")
        .arg(config.max_batch.to_string())
        .env("PYTHONPATH", &config.adapter_dir)
        .env("HF_HUB_OFFLINE", "1")
        .envs(&config.env)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    if let Some(bits) = config.kv_bits {
        cmd.arg("--kv-bits").arg(bits.to_string());
    }
    if let Some(template) = &config.chat_template {
        cmd.arg("--chat-template").arg(template);
    }
    process::contain(&mut cmd);
    tracing::info!(python = %config.python.display(), model = %config.model.display(), "starting decode engine");
    cmd.spawn().map_err(|e| EngineError::Internal(format!("spawn {}: {e}", config.python.display())))
}

async fn wait_ready(lines: &mut Lines<BufReader<tokio::process::ChildStdout>>) -> Result<(), EngineError> {
    while let Some(line) = lines.next_line().await? {
        if serde_json::from_str::<serde_json::Value>(&line).is_ok_and(|v| v["ready"] == true) {
            return Ok(());
        }
    }
    Err(EngineError::Internal("adapter exited before it was ready".into()))
}

async fn stop_child(mut child: Child) -> Result<(), EngineError> {
    Ok(process::terminate(&mut child, STOP_GRACE).await?)
}
