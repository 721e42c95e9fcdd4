//! decoded's configuration (see `deploy/examples/decoded.toml`).

use std::{collections::BTreeMap, net::SocketAddr, path::PathBuf, time::Duration};

use pdbridge_common::{
    config::{ConfigError, LogConfig, ServerConfig, TelemetryConfig, Validate},
    liveness::LivenessConfig,
    proto::Payload,
    tls::{self, TlsConfig},
};
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
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
    /// Mutual TLS for CacheStore (and for dialing prefilld); `tls.peers` are
    /// the prefillers allowed to Push, Lookup and read the bundle.
    pub tls: Option<TlsConfig>,
}

impl Config {
    /// Config keys of listeners other hosts can reach with nothing checking
    /// who calls (only possible with `server.insecure`).
    pub fn insecure_listeners(&self) -> Vec<&'static str> {
        self.exposure().map(|exposed| exposed.into_iter().flatten().collect()).unwrap_or_default()
    }

    fn exposure(&self) -> Result<[Option<&'static str>; 2], ConfigError> {
        let server = &self.server;
        let grpc = server.check_exposure(
            "server.grpc_listen",
            server.grpc_listen,
            self.tls.is_some(),
            "no [tls] is configured (see `pdbridge certs`)",
        )?;
        let front = server.check_exposure(
            "front.listen",
            self.front.listen,
            self.front.has_api_keys(),
            "no front.api_keys are configured",
        )?;
        Ok([grpc.then_some("server.grpc_listen"), front.then_some("front.listen")])
    }
}

impl Validate for Config {
    fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.telemetry.validate()?;
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        self.exposure()?;
        let front = &self.front;
        for (key, addr) in [("front.prefilld", &front.prefilld), ("front.advertise_addr", &front.advertise_addr)] {
            if let Some(addr) = addr {
                tls::check_scheme(key, addr, self.tls.is_some())?;
            }
        }
        for prefiller in &front.prefillers {
            tls::check_scheme("front.prefillers.addr", &prefiller.addr, self.tls.is_some())?;
        }
        for peer in &front.peers {
            tls::check_scheme("front.peers.addr", &peer.addr, self.tls.is_some())?;
        }
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
    /// Bytes of blocks all Push streams together may hold assembling or committing: a block
    /// reserves its size when its first shard arrives; a stream that cannot, and has no commit of
    /// its own to wait for, is refused with RESOURCE_EXHAUSTED.
    pub max_push_bytes: u64,
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
            max_push_bytes: 1 << 30,
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
        if self.max_push_bytes == 0 {
            return Err(ConfigError::invalid("store.max_push_bytes", "must be greater than zero"));
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
    /// Generations decoded together in one continuous batch (mlx-lm's `BatchGenerator`);
    /// 1: one at a time. Restored store blocks join as per-request caches.
    #[serde(default = "default_max_batch")]
    pub max_batch: u32,
    /// A Jinja chat template replacing the model's own, as mlx_lm.server's
    /// `--chat-template` (e.g. `deploy/templates/smollm2-tools.jinja`, which renders tools);
    /// mlx-lm picks its tool-call parser from the template.
    pub chat_template: Option<PathBuf>,
    /// Extra environment for the adapter (e.g. `LD_PRELOAD` of an optimized BLAS for MLX's CPU
    /// backend, `MLX_*` settings).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// How the running adapter is probed (its `info`): while it does not answer, decoded is not
    /// ready.
    #[serde(default)]
    pub liveness: LivenessConfig,
}

impl Validate for EngineConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.liveness.validate()?;
        // What MLX's affine quantization accepts.
        if self.kv_bits.is_some_and(|bits| ![2, 3, 4, 5, 6, 8].contains(&bits)) {
            return Err(ConfigError::invalid("engine.kv_bits", "must be 2, 3, 4, 5, 6 or 8"));
        }
        if ![32, 64, 128].contains(&self.kv_group_size) {
            return Err(ConfigError::invalid("engine.kv_group_size", "must be 32, 64 or 128"));
        }
        if !(1..=MAX_BATCH).contains(&self.max_batch) {
            return Err(ConfigError::invalid("engine.max_batch", format!("must be from 1 to {MAX_BATCH}")));
        }
        if let Some(template) = &self.chat_template
            && !template.is_file()
        {
            return Err(ConfigError::invalid("engine.chat_template", format!("{} is not a file", template.display())));
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
fn default_max_batch() -> u32 {
    8
}
/// Most generations one batch may hold: each holds its whole cache in memory.
const MAX_BATCH: u32 = 256;

/// The OpenAI-compatible front door and its bridge-or-native policy.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FrontConfig {
    /// HTTP listener for `/v1/...`.
    pub listen: SocketAddr,
    /// The model name `/v1/models` lists and responses carry.
    pub model_name: String,
    /// prefilld's gRPC address; without it every answer is native. With
    /// `[tls]` it must be `https://`.
    pub prefilld: Option<String>,
    /// The identity prefilld's certificate must hold (default: the host of
    /// `prefilld`).
    pub prefilld_name: Option<String>,
    /// Several prefilld instances (`[[front.prefillers]]`, each `addr` and
    /// optional `name`): a bridge goes to a healthy one with the fewest bridges
    /// in flight, and what is left of it to another when one fails mid-way.
    /// `front.prefilld` is the one-instance form; give one or the other.
    pub prefillers: Vec<PrefillerConfig>,
    /// API keys clients send as `Authorization: Bearer <key>`: a TOML list, or
    /// one comma-separated string (e.g. from `PDB_FRONT__API_KEYS`). With none
    /// here nor in `api_keys_file`, the front door is open to whoever reaches it.
    #[serde(deserialize_with = "api_keys")]
    pub api_keys: Vec<ApiKey>,
    /// A file of API keys, one per line (blank lines and `#` comments skipped).
    pub api_keys_file: Option<PathBuf>,
    /// Largest request body (413 beyond). A 128K-token prompt is ~0.5 MB of text.
    pub max_body_bytes: usize,
    /// How prefilld reaches this decoder's CacheStore (default: the gRPC
    /// listener, with an unspecified IP replaced by 127.0.0.1).
    pub advertise_addr: Option<String>,
    /// Bridge at all (false: every answer is native, reason `disabled`).
    pub bridge: bool,
    /// Where a bridged block's cache is computed: `prefiller` (prefilld
    /// ships the cache, computed there with this decoder's code on the
    /// prefiller's backend: another backend's kernels round differently) or
    /// `decoder` (prefilld ships each layer's input and this decoder computes
    /// its cache with its own kernels: its exact bits, several times the
    /// bytes on the wire, and the decoder's time).
    pub reconstruct_on: ReconstructOn,
    /// Smallest uncached run of whole blocks, in tokens, worth bridging.
    pub min_bridge_tokens: u32,
    /// How an `auto` request past `min_bridge_tokens` is decided: `threshold` (bridge it) or
    /// `cost` (bridge it when the cost model predicts a bridge answers sooner than the decoder
    /// alone by `cost_margin`, else `not_worth_it`). The verdict carries the prediction either way.
    pub policy: BridgePolicy,
    /// How much sooner a bridge must be predicted to answer (0.1: 10 % sooner).
    pub cost_margin: f64,
    /// The cost model's starting rates, before the first answers teach it (prompt tokens per
    /// second): the decoder computing a prompt alone, and a bridge end to end. Unset: learned.
    pub cold_here_tokens_per_s: Option<f64>,
    pub cold_bridge_tokens_per_s: Option<f64>,
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
    /// A client must have sent a request's headers this long after connecting (or after its
    /// previous answer, on a kept-alive connection); the connection is closed otherwise.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// Connections one client address may hold open at once; one more is closed on accept.
    pub max_connections_per_peer: usize,
    /// Special-token text in a chat's messages (and tool definitions) becomes those special
    /// tokens, as the chat template's own do. Off: it is text, as OpenAI's API reads it, so a
    /// message cannot write a turn of another role (`<|im_start|>system`).
    pub allow_special_tokens_in_content: bool,
    /// The other decoders of this model (`[[front.peers]]`): before bridging, their stores are
    /// asked for the prompt (`Lookup`, mutual TLS with `[tls]`), and a request one of them holds
    /// more of is forwarded to its front door rather than prefilled here again.
    pub peers: Vec<PeerConfig>,
    /// Longest wait for a peer's `Lookup`; a peer that has not answered holds nothing.
    #[serde(with = "humantime_serde")]
    pub peer_lookup_timeout: Duration,
}

impl Default for FrontConfig {
    fn default() -> Self {
        FrontConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            model_name: "smollm2".into(),
            prefilld: None,
            prefilld_name: None,
            prefillers: Vec::new(),
            api_keys: Vec::new(),
            api_keys_file: None,
            max_body_bytes: 16 << 20,
            advertise_addr: None,
            bridge: true,
            reconstruct_on: ReconstructOn::Prefiller,
            min_bridge_tokens: 256,
            policy: BridgePolicy::Threshold,
            cost_margin: 0.1,
            cold_here_tokens_per_s: None,
            cold_bridge_tokens_per_s: None,
            default_max_tokens: 256,
            prefill_deadline_base: Duration::from_secs(60),
            prefill_deadline_per_1k_tokens: Duration::from_secs(30),
            max_pending_requests: 64,
            request_timeout: Duration::from_secs(900),
            header_read_timeout: Duration::from_secs(10),
            max_connections_per_peer: 128,
            allow_special_tokens_in_content: false,
            peers: Vec::new(),
            peer_lookup_timeout: Duration::from_millis(500),
        }
    }
}

/// How an `auto` request is decided (`front.policy`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum BridgePolicy {
    #[default]
    Threshold,
    Cost,
}

/// Where a bridged block's cache is computed (`front.reconstruct_on`).
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum ReconstructOn {
    #[default]
    Prefiller,
    Decoder,
}

impl ReconstructOn {
    /// What prefilld pushes for it.
    pub fn payload(self) -> Payload {
        match self {
            ReconstructOn::Prefiller => Payload::Cache,
            ReconstructOn::Decoder => Payload::LayerInputs,
        }
    }
}

/// An API key: never printed, compared by digest.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl ApiKey {
    pub fn expose(&self) -> &str {
        &self.0
    }
}

fn api_keys<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<ApiKey>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Keys {
        List(Vec<String>),
        Joined(String),
    }
    let keys = match Keys::deserialize(deserializer)? {
        Keys::List(keys) => keys,
        Keys::Joined(joined) => joined.split(',').map(str::to_owned).collect(),
    };
    Ok(keys.into_iter().map(|k| k.trim().to_owned()).filter(|k| !k.is_empty()).map(ApiKey).collect())
}

impl FrontConfig {
    /// Every configured API key: `api_keys` plus the lines of `api_keys_file`.
    pub fn load_api_keys(&self) -> Result<Vec<ApiKey>, ConfigError> {
        let mut keys = self.api_keys.clone();
        if let Some(path) = &self.api_keys_file {
            let text = std::fs::read_to_string(path)
                .map_err(|e| ConfigError::invalid("front.api_keys_file", format!("{}: {e}", path.display())))?;
            keys.extend(
                text.lines()
                    .map(str::trim)
                    .filter(|line| !line.is_empty() && !line.starts_with('#'))
                    .map(|line| ApiKey(line.to_owned())),
            );
        }
        Ok(keys)
    }

    fn has_api_keys(&self) -> bool {
        !self.api_keys.is_empty() || self.api_keys_file.is_some()
    }
}

/// One prefilld instance the front door may bridge through.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefillerConfig {
    /// Its gRPC address (`https://` with `[tls]`).
    pub addr: String,
    /// The identity its certificate must hold (default: the host of `addr`).
    pub name: Option<String>,
}

/// Another decoder of the same model whose store this front door may send requests to.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PeerConfig {
    /// Its gRPC address, where its store answers `Lookup` (`https://` with `[tls]`).
    pub addr: String,
    /// The identity its certificate must hold (default: the host of `addr`); verdicts name it.
    pub name: Option<String>,
    /// Its front door (`http://host:port`), where a request is forwarded with the client's own
    /// headers (its API key included: peers share their keys).
    pub front: String,
}

impl FrontConfig {
    /// Every configured prefilld, from `[[front.prefillers]]` or `front.prefilld`.
    pub fn prefillers(&self) -> Vec<PrefillerConfig> {
        match &self.prefilld {
            Some(addr) => vec![PrefillerConfig { addr: addr.clone(), name: self.prefilld_name.clone() }],
            None => self.prefillers.clone(),
        }
    }
}

impl Validate for FrontConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.prefilld.is_some() && !self.prefillers.is_empty() {
            return Err(ConfigError::invalid(
                "front.prefillers",
                "give either front.prefilld (one instance) or [[front.prefillers]], not both",
            ));
        }
        if self.prefilld.is_none() && self.prefilld_name.is_some() {
            return Err(ConfigError::invalid("front.prefilld_name", "names front.prefilld, which is not set"));
        }
        if self.api_keys_file.is_some() && self.load_api_keys()?.is_empty() {
            return Err(ConfigError::invalid("front.api_keys_file", "holds no key"));
        }
        if self.max_body_bytes < 1024 {
            return Err(ConfigError::invalid("front.max_body_bytes", "must be at least 1024"));
        }
        if self.default_max_tokens == 0 {
            return Err(ConfigError::invalid("front.default_max_tokens", "must be at least 1"));
        }
        if self.max_pending_requests == 0 {
            return Err(ConfigError::invalid("front.max_pending_requests", "must be at least 1"));
        }
        if self.header_read_timeout.is_zero() {
            return Err(ConfigError::invalid("front.header_read_timeout", "must be greater than zero"));
        }
        if self.max_connections_per_peer == 0 {
            return Err(ConfigError::invalid("front.max_connections_per_peer", "must be at least 1"));
        }
        if self.request_timeout.is_zero() {
            return Err(ConfigError::invalid("front.request_timeout", "must be greater than zero"));
        }
        if !(0.0..=10.0).contains(&self.cost_margin) {
            return Err(ConfigError::invalid("front.cost_margin", "must be between 0 and 10"));
        }
        for (key, rate) in [
            ("front.cold_here_tokens_per_s", self.cold_here_tokens_per_s),
            ("front.cold_bridge_tokens_per_s", self.cold_bridge_tokens_per_s),
        ] {
            if rate.is_some_and(|r| !(r.is_finite() && r > 0.0)) {
                return Err(ConfigError::invalid(key, "must be a positive number of tokens per second"));
            }
        }
        for peer in &self.peers {
            if !peer.front.starts_with("http://") || peer.front.parse::<axum::http::Uri>().is_err() {
                let problem = format!("{:?} is not an http://host:port address", peer.front);
                return Err(ConfigError::invalid("front.peers.front", problem));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
