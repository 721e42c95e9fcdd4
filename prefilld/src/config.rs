//! prefilld's configuration (see `deploy/examples/prefilld.toml`).

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use pdbridge_common::config::{ConfigError, LogConfig, ServerConfig, Validate};
use serde::Deserialize;

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    pub server: ServerConfig,
    #[serde(default)]
    pub log: LogConfig,
    /// The prefill engine. Without it prefilld serves nothing but health,
    /// which stays NOT_SERVING.
    pub engine: Option<EngineConfig>,
    /// The decoder whose spec prefilld loads at start (health is SERVING only
    /// once it is loaded). Prefill requests may name other decoders.
    pub decoder: Option<DecoderConfig>,
    #[serde(default)]
    pub stream: StreamConfig,
}

impl Validate for Config {
    fn validate(&self) -> Result<(), ConfigError> {
        self.server.validate()?;
        self.stream.validate()?;
        if let Some(engine) = &self.engine {
            engine.validate()?;
        }
        Ok(())
    }
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
    /// Extra arguments appended to vLLM's command line.
    #[serde(default)]
    pub extra_args: Vec<String>,
    /// Extra environment for vLLM (e.g. `VLLM_CPU_KVCACHE_SPACE`).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(with = "humantime_serde", default = "default_start_timeout")]
    pub start_timeout: Duration,
    #[serde(with = "humantime_serde", default = "default_restart_backoff")]
    pub restart_backoff: Duration,
}

impl Validate for EngineConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if !["float32", "bfloat16", "float16"].contains(&self.dtype.as_str()) {
            return Err(ConfigError::invalid("engine.dtype", "must be float32, bfloat16 or float16"));
        }
        Ok(())
    }
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
    /// gRPC address of decoded's CacheStore, e.g. "http://mac.lan:7070".
    pub addr: String,
}

/// The shard stream to decoders.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamConfig {
    /// Largest shard payload.
    pub max_shard_bytes: usize,
    /// Frames buffered between the plugin and the Push stream.
    pub queue_frames: usize,
    /// Longest a prefill may take, per 1,000 prompt tokens (plus a minute).
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
        Ok(())
    }
}
