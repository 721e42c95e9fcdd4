//! The decode engine: the mlx-lm adapter (`decoded/engine/pdbridge_mlx`) as a
//! supervised child process, and a typed client for its unix-socket protocol.
//!
//! Protocol (`proto/engine.proto`, package `pdbridge.engine.v1`): one request
//! per connection, a `Request` as proto3 JSON and a newline; the adapter answers
//! with `Reply` lines and closes. A line with `error` ends a failed request.
//! The adapter prints a `Ready` line on stdout once its model is loaded and its
//! reconstruction bundle written.

use std::{
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::{Duration, SystemTime},
};

use pdbridge_common::{
    liveness, process,
    proto::{
        CacheKind, CacheSpec, Dtype, Extent,
        engine::{self as wire, ErrorKind, reply::Reply as Answer, request::Op},
    },
    readiness::Readiness,
    spec,
};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines},
    net::{UnixStream, unix::OwnedReadHalf},
    process::{Child, Command},
    sync::watch,
};
use tokio_util::sync::CancellationToken;

use crate::api::chat::{Message, Tool};
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
// What decoded asks of the adapter and what it answers, as the rest of decoded
// sees it. On the wire every line is a message of `proto/engine.proto`.
// ---------------------------------------------------------------------------

/// What the decoder tokenizes.
#[derive(Debug)]
pub enum TokenizeInput<'a> {
    Chat {
        messages: &'a [Message],
        add_generation_prompt: bool,
        /// The request's tool definitions, rendered by the chat template.
        tools: Option<&'a [Tool]>,
        /// Special-token text in the messages and tools is those tokens, not text
        /// (`front.allow_special_tokens_in_content`).
        allow_special_tokens: bool,
    },
    Text {
        prompt: &'a str,
    },
}

/// A generation request; `blocks` are store files covering the prompt's start.
#[derive(Debug)]
pub struct GenerateRequest<'a> {
    pub tokens: &'a [u32],
    pub blocks: &'a [PathBuf],
    /// The prompt's tail after `blocks` (all but its last token), in the block
    /// file format, when prefilld bridged it for this request.
    pub tail: Option<&'a Path>,
    pub spec_fingerprint: &'a str,
    /// Its `max_tokens` set: the front door has fit it to the context.
    pub sampling: Sampling,
    /// The request's tool definitions: the adapter parses tool calls out of the answer.
    pub tools: Option<&'a [Tool]>,
}

/// The last line of a generation: finish reason, usage, timings, held-back text.
pub use pdbridge_common::proto::engine::GenerateSummary;
/// A generated token's log probability and the most likely alternatives.
pub use pdbridge_common::proto::engine::Logprob;
/// How a generation chooses its tokens.
pub use pdbridge_common::proto::engine::Sampling;
/// A tool call the model made, parsed by mlx-lm's tool parser for the chat template.
pub use pdbridge_common::proto::engine::ToolCall;

/// One line of a generation.
#[derive(Debug)]
pub enum GenerateEvent {
    Token {
        token: u32,
        text: String,
        /// When asked for: the token's log probability, as the adapter computed it.
        logprob: Option<Logprob>,
        /// Calls completed with this token (their text is not in `text`).
        tool_calls: Vec<ToolCall>,
    },
    Done(GenerateSummary),
}

impl From<wire::Token> for GenerateEvent {
    fn from(t: wire::Token) -> GenerateEvent {
        GenerateEvent::Token { token: t.id, text: t.text, logprob: t.logprob, tool_calls: t.tool_calls }
    }
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
        let info = engine_info(serde_json::from_str(&text).map_err(|e| read(&e))?)?;
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
        let mut lines = request(self.socket()?, Op::Tokenize(tokenize_request(input))).await?;
        let reply = next_reply(&mut lines, |r| match r {
            Answer::Tokenize(t) => Some(t),
            _ => None,
        })
        .await?;
        Ok(reply.tokens)
    }

    /// Starts a generation; read its events from the returned stream.
    pub async fn generate(&self, req: GenerateRequest<'_>) -> Result<Generation, EngineError> {
        self.info()?;
        let req = wire::GenerateRequest {
            tokens: req.tokens.to_vec(),
            blocks: req.blocks.iter().map(|b| path_text(b)).collect::<Result<_, _>>()?,
            tail: req.tail.map(path_text).transpose()?,
            spec_fingerprint: req.spec_fingerprint.to_owned(),
            sampling: Some(req.sampling),
            tools_json: req.tools.map(json_text).unwrap_or_default(),
        };
        let sent_at = SystemTime::now();
        let lines = request(self.socket()?, Op::Generate(req)).await?;
        Ok(Generation { lines, finished: false, first: None, sent_at })
    }

    /// Computes the decoder's cache for the layer inputs in the safetensors
    /// file `inputs` (`"{layer}.input"`, `[rows, hidden_size]`, the tokens at
    /// positions `offset..offset + rows`) with its own modules and kernels,
    /// and writes its tensors (`"{layer}.{tensor}"`) to `out`.
    pub async fn reconstruct(&self, inputs: &Path, offset: u64, out: &Path) -> Result<(), EngineError> {
        self.info()?;
        let req = wire::ReconstructRequest { inputs: path_text(inputs)?, offset, out: path_text(out)? };
        let mut lines = request(self.socket()?, Op::Reconstruct(req)).await?;
        next_reply(&mut lines, |r| match r {
            Answer::Reconstruct(r) => Some(r),
            _ => None,
        })
        .await
        .map(drop)
    }
}

/// The events of one generation, in order, ending with [`GenerateEvent::Done`].
pub struct Generation {
    lines: Lines<BufReader<OwnedReadHalf>>,
    finished: bool,
    /// The first event, read ahead by [`Generation::started`].
    first: Option<GenerateEvent>,
    /// When the request went to the adapter, which times its stages from its arrival.
    pub sent_at: SystemTime,
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
        let event = next_reply(&mut self.lines, |r| match r {
            Answer::Token(t) => Some(GenerateEvent::from(t)),
            Answer::Done(summary) => Some(GenerateEvent::Done(summary)),
            _ => None,
        })
        .await;
        self.finished = !matches!(event, Ok(GenerateEvent::Token { .. }));
        Some(event)
    }
}

/// Sends `op` as the connection's one request line; the reply lines follow.
async fn request(socket: &Path, op: Op) -> Result<Lines<BufReader<OwnedReadHalf>>, EngineError> {
    let stream = UnixStream::connect(socket).await?;
    let (read, mut write) = stream.into_split();
    let body = wire::Request { op: Some(op) };
    let mut line = serde_json::to_vec(&body).map_err(|e| EngineError::Protocol(e.to_string()))?;
    line.push(b'\n');
    write.write_all(&line).await?;
    write.shutdown().await?;
    Ok(BufReader::new(read).lines())
}

/// The next reply line, as `expect` takes it (None: an answer of another op); an `error` line
/// is the request's failure.
async fn next_reply<T>(
    lines: &mut Lines<BufReader<OwnedReadHalf>>,
    expect: impl FnOnce(Answer) -> Option<T>,
) -> Result<T, EngineError> {
    let line =
        lines.next_line().await?.ok_or_else(|| EngineError::Protocol("connection closed before a reply".into()))?;
    let reply: wire::Reply = serde_json::from_str(&line).map_err(|e| EngineError::Protocol(format!("{e}: {line}")))?;
    match reply.reply {
        Some(Answer::Error(err)) => Err(engine_error(err)),
        Some(answer) => expect(answer).ok_or_else(|| EngineError::Protocol(format!("unexpected reply: {line}"))),
        None => Err(EngineError::Protocol(format!("empty reply: {line}"))),
    }
}

/// The adapter's error as decoded handles it: a block it names is the store's to quarantine.
pub(crate) fn tokenize_request(input: TokenizeInput<'_>) -> wire::TokenizeRequest {
    match input {
        TokenizeInput::Chat { messages, add_generation_prompt, tools, allow_special_tokens } => wire::TokenizeRequest {
            input: Some(wire::tokenize_request::Input::MessagesJson(json_text(messages))),
            add_generation_prompt: Some(add_generation_prompt),
            tools_json: tools.map(json_text).unwrap_or_default(),
            chat_template_kwargs_json: String::new(),
            allow_special_tokens_in_content: allow_special_tokens,
        },
        TokenizeInput::Text { prompt } => wire::TokenizeRequest {
            input: Some(wire::tokenize_request::Input::Prompt(prompt.to_owned())),
            ..Default::default()
        },
    }
}

/// The chat template's input as JSON text (the adapter hands it to the tokenizer as it is).
fn json_text(value: &(impl serde::Serialize + ?Sized)) -> String {
    serde_json::to_string(value).expect("chat messages and tools serialize")
}

fn engine_error(err: wire::Error) -> EngineError {
    match (err.kind(), err.block) {
        (ErrorKind::BadRequest, _) => EngineError::BadRequest(err.message),
        (ErrorKind::BlockUnusable, Some(block)) => {
            EngineError::BlockUnusable { block: block as usize, message: err.message }
        }
        _ => EngineError::Internal(err.message),
    }
}

/// A path as the adapter's JSON carries it (text).
fn path_text(path: &Path) -> Result<String, EngineError> {
    path.to_str().map(str::to_owned).ok_or_else(|| EngineError::Protocol(format!("path {path:?} is not UTF-8")))
}

/// The decoder's identity from its `info` reply: the spec completed with what the adapter leaves
/// to decoded (its model id and fingerprints, the spec fingerprint computed here).
fn engine_info(reply: wire::InfoReply) -> Result<EngineInfo, EngineError> {
    let mut spec = reply.spec.ok_or_else(|| EngineError::Protocol("info reply without a spec".into()))?;
    spec.model_id = reply.model_id;
    spec.weights_fingerprint = reply.bundle_sha256;
    spec.tokenizer_fingerprint = reply.tokenizer_sha256;
    for layer in &spec.layers {
        if layer.kind == CacheKind::Unspecified as i32 {
            return Err(EngineError::Protocol(format!("layer {}: no cache kind", layer.index)));
        }
        if let Some(t) = layer.tensors.iter().find(|t| t.dtype() == Dtype::Unspecified) {
            return Err(EngineError::Protocol(format!("layer {} tensor {}: no dtype", layer.index, t.name)));
        }
        if let Some(t) = layer.tensors.iter().find(|t| t.extent() == Extent::Unspecified) {
            return Err(EngineError::Protocol(format!("layer {} tensor {}: no extent", layer.index, t.name)));
        }
    }
    if spec.input_dtype() == Dtype::Unspecified {
        return Err(EngineError::Protocol("spec without an input_dtype".into()));
    }
    spec.spec_fingerprint = spec::fingerprint(&spec);
    Ok(EngineInfo { spec, bundle_path: PathBuf::from(reply.bundle_path) })
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
    let info = match info_reply(&config.socket).await.and_then(engine_info) {
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
    let probe = || info_reply(&config.socket);
    tokio::select! {
        _ = stop.cancelled() => stop_child(child).await,
        status = child.wait() => {
            process::kill_group(leader);
            Err(EngineError::Internal(format!("adapter exited: {}", status?)))
        }
        never = liveness::watch(ENGINE, &config.liveness, probe, |alive| readiness.set(alive)) => match never {},
    }
}

/// The adapter's `info`: answered from memory on the connection's own thread,
/// so a model thread busy with a long prefill or generation does not delay it
/// (MLX lets go of Python's lock while it computes).
async fn info_reply(socket: &Path) -> Result<wire::InfoReply, EngineError> {
    let mut lines = request(socket, Op::Info(wire::InfoRequest {})).await?;
    next_reply(&mut lines, |r| match r {
        Answer::Info(info) => Some(info),
        _ => None,
    })
    .await
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
        // Anything else on stdout (a library's print) is not the ready line.
        if let Ok(ready) = serde_json::from_str::<wire::Ready>(&line) {
            return match ready.ready {
                true => Ok(()),
                false => Err(EngineError::Internal(format!("adapter cannot start: {}", ready.error))),
            };
        }
    }
    Err(EngineError::Internal("adapter exited before it was ready".into()))
}

async fn stop_child(mut child: Child) -> Result<(), EngineError> {
    Ok(process::terminate(&mut child, STOP_GRACE).await?)
}

#[cfg(test)]
mod tests;
