//! decoded's configuration (see `deploy/examples/decoded.toml`).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use pdbridge_common::config::{ConfigError, LogConfig, ServerConfig, Validate};
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub store: StoreConfig,
    /// The decode engine. Without it (and without `spec_file`) decoded serves
    /// nothing but health, which stays NOT_SERVING.
    pub engine: Option<EngineConfig>,
    /// Instead of an engine: a fixed spec (the adapter's `info` reply as
    /// JSON). decoded then stores blocks and serves `CacheStore` without a
    /// decode engine; the front door answers 503. For tests and store-only hosts.
    pub spec_file: Option<PathBuf>,
    #[serde(default)]
    pub front: FrontConfig,
}

impl Validate for Config {
    fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.store.validate()?;
        if self.engine.is_some() && self.spec_file.is_some() {
            return Err(ConfigError::invalid("spec_file", "give either an [engine] or a spec_file, not both"));
        }
        if let Some(engine) = &self.engine {
            engine.validate()?;
        }
        self.front.validate()
    }
}

/// The prefix store.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Directory of block files (created if missing).
    pub dir: PathBuf,
    /// Bytes of block files kept before least-recently-used blocks are evicted.
    pub budget_bytes: u64,
    /// Tokens per block (B). Part of every block key.
    pub block_tokens: u32,
    /// Blocks a single Push stream may hold partially assembled at once;
    /// bounds memory to this many blocks per stream.
    pub max_open_blocks: usize,
    /// Push streams open at once, from all senders together: with
    /// `max_open_blocks`, bounds ingest memory for the whole daemon. A Push
    /// beyond it is refused with RESOURCE_EXHAUSTED.
    pub max_push_streams: usize,
    /// A Push stream that sends no frame for this long is cut (DEADLINE_EXCEEDED),
    /// so idle streams cannot hold their slots forever.
    #[serde(with = "humantime_serde")]
    pub push_idle_timeout: Duration,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            dir: "var/decoded/store".into(),
            budget_bytes: 8 << 30,
            block_tokens: 256,
            max_open_blocks: 4,
            max_push_streams: 32,
            push_idle_timeout: Duration::from_secs(600),
        }
    }
}

impl Validate for StoreConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.block_tokens == 0 || !self.block_tokens.is_multiple_of(16) {
            return Err(ConfigError::invalid("store.block_tokens", "must be a positive multiple of 16"));
        }
        if self.max_open_blocks == 0 {
            return Err(ConfigError::invalid("store.max_open_blocks", "must be at least 1"));
        }
        if self.budget_bytes == 0 {
            return Err(ConfigError::invalid("store.budget_bytes", "must be greater than zero"));
        }
        if self.max_push_streams == 0 {
            return Err(ConfigError::invalid("store.max_push_streams", "must be at least 1"));
        }
        if self.push_idle_timeout.is_zero() {
            return Err(ConfigError::invalid("store.push_idle_timeout", "must be greater than zero"));
        }
        Ok(())
    }
}

/// How decoded runs its decode engine (the mlx-lm adapter).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Python interpreter with mlx-lm installed.
    #[serde(default = "default_python")]
    pub python: PathBuf,
    /// Directory holding the `pdbridge_mlx` package.
    #[serde(default = "default_adapter_dir")]
    pub adapter_dir: PathBuf,
    /// The decoder's mlx-lm model folder.
    pub model: PathBuf,
    /// Unix socket decoded and the adapter talk over.
    #[serde(default = "default_socket")]
    pub socket: PathBuf,
    /// Longest wait for the adapter to load its model.
    #[serde(with = "humantime_serde", default = "default_start_timeout")]
    pub start_timeout: Duration,
    /// Pause before restarting a crashed adapter.
    #[serde(with = "humantime_serde", default = "default_restart_backoff")]
    pub restart_backoff: Duration,
    /// The decoder's activation and cache dtype.
    #[serde(default)]
    pub dtype: CacheDtype,
    /// Quantize the KV cache to this many bits, as mlx-lm's `kv_bits`; unset: not quantized.
    pub kv_bits: Option<u8>,
    /// Group size of the quantized KV cache.
    #[serde(default = "default_kv_group_size")]
    pub kv_group_size: u32,
}

impl Validate for EngineConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        // What MLX's affine quantization accepts.
        if self.kv_bits.is_some_and(|bits| ![2, 3, 4, 5, 6, 8].contains(&bits)) {
            return Err(ConfigError::invalid("engine.kv_bits", "must be 2, 3, 4, 5, 6 or 8"));
        }
        if ![32, 64, 128].contains(&self.kv_group_size) {
            return Err(ConfigError::invalid("engine.kv_group_size", "must be 32, 64 or 128"));
        }
        Ok(())
    }
}

/// The decoder's activation and cache dtype (a real Mac keeps bf16 or fp16; x86 CPUs emulate fp16).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CacheDtype {
    #[default]
    Float32,
    Bfloat16,
    Float16,
}

impl CacheDtype {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheDtype::Float32 => "float32",
            CacheDtype::Bfloat16 => "bfloat16",
            CacheDtype::Float16 => "float16",
        }
    }
}

fn default_python() -> PathBuf {
    ".venv/bin/python".into()
}
fn default_adapter_dir() -> PathBuf {
    "decoded/engine".into()
}
fn default_socket() -> PathBuf {
    "var/decoded/engine.sock".into()
}
fn default_start_timeout() -> Duration {
    Duration::from_secs(300)
}
fn default_restart_backoff() -> Duration {
    Duration::from_secs(2)
}
fn default_kv_group_size() -> u32 {
    64
}

/// The OpenAI-compatible front door and its bridge-or-native policy.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FrontConfig {
    /// HTTP listener for `/v1/...`.
    pub listen: SocketAddr,
    /// The model name `/v1/models` lists and responses carry.
    pub model_name: String,
    /// prefilld's gRPC address; without it every answer is native.
    pub prefilld: Option<String>,
    /// How prefilld reaches this decoder's CacheStore (default: the gRPC
    /// listener, with an unspecified IP replaced by 127.0.0.1).
    pub advertise_addr: Option<String>,
    /// Bridge at all (false: every answer is native, reason `disabled`).
    pub bridge: bool,
    /// Smallest uncached run of whole blocks, in tokens, worth bridging.
    pub min_bridge_tokens: u32,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: u32,
    /// Longest wait for prefilld's outcome: base plus a share per 1,000 tokens.
    #[serde(with = "humantime_serde")]
    pub prefill_deadline_base: Duration,
    #[serde(with = "humantime_serde")]
    pub prefill_deadline_per_1k_tokens: Duration,
    /// Requests inside the front door at once (tokenizing, bridging, waiting
    /// for the engine or generating); one more is answered 429 with
    /// `Retry-After` instead of queueing without bound.
    pub max_pending_requests: usize,
    /// A request not finished within this long ends with 504 (or, once
    /// streaming, an error event); its bridge and generation are cancelled.
    #[serde(with = "humantime_serde")]
    pub request_timeout: Duration,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            model_name: "smollm2".into(),
            prefilld: None,
            advertise_addr: None,
            bridge: true,
            min_bridge_tokens: 256,
            default_max_tokens: 256,
            prefill_deadline_base: Duration::from_secs(60),
            prefill_deadline_per_1k_tokens: Duration::from_secs(30),
            max_pending_requests: 64,
            request_timeout: Duration::from_secs(900),
        }
    }
}

impl Validate for FrontConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.default_max_tokens == 0 {
            return Err(ConfigError::invalid("front.default_max_tokens", "must be at least 1"));
        }
        if self.max_pending_requests == 0 {
            return Err(ConfigError::invalid("front.max_pending_requests", "must be at least 1"));
        }
        if self.request_timeout.is_zero() {
            return Err(ConfigError::invalid("front.request_timeout", "must be greater than zero"));
        }
        for (key, addr) in [("front.prefilld", &self.prefilld), ("front.advertise_addr", &self.advertise_addr)] {
            if let Some(addr) = addr
                && !(addr.starts_with("http://") || addr.starts_with("https://"))
            {
                return Err(ConfigError::invalid(key, "must be a URI such as http://host:port"));
            }
        }
        Ok(())
    }
}
