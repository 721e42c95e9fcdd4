//! Configuration: a TOML file, then `PDB_…` environment overrides, then flags,
//! deserialized into each daemon's typed config and validated.
//!
//! Environment keys are `PDB_<SECTION>__<KEY>`, e.g. `PDB_SERVER__GRPC_LISTEN`.
//! Sources are passed in (not read from the process) so tests inject maps
//! instead of mutating the environment.

use std::{collections::HashMap, net::SocketAddr, path::PathBuf, time::Duration};

use serde::{Deserialize, de::DeserializeOwned};

/// A configuration problem, always naming the key at fault. Daemons print it as
/// one line and exit with status 2.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config file {path}: {problem}")]
    File { path: PathBuf, problem: String },
    #[error("config key `{key}`: {problem}")]
    Invalid { key: String, problem: String },
}

impl ConfigError {
    pub fn invalid(key: &str, problem: impl Into<String>) -> Self {
        ConfigError::Invalid { key: key.to_owned(), problem: problem.into() }
    }
}

/// Checks a deserialized config for what types cannot express.
pub trait Validate {
    fn validate(&self) -> Result<(), ConfigError>;
}

/// Where a daemon's settings come from, lowest precedence first.
#[derive(Debug, Default)]
pub struct Sources {
    /// The `--config` file, if any.
    pub file: Option<PathBuf>,
    /// The process environment (only `PDB_*` entries are read).
    pub env: HashMap<String, String>,
    /// Dotted keys set by command-line flags, e.g. `("server.grpc_listen", "…")`.
    pub overrides: Vec<(String, String)>,
}

impl Sources {
    /// The file named by `--config` plus the real process environment.
    pub fn from_process(file: Option<PathBuf>) -> Self {
        Sources { file, env: std::env::vars().collect(), overrides: Vec::new() }
    }

    pub fn set(mut self, key: &str, value: impl ToString) -> Self {
        self.overrides.push((key.to_owned(), value.to_string()));
        self
    }
}

pub fn load<T: DeserializeOwned + Validate>(sources: Sources) -> Result<T, ConfigError> {
    let mut builder = config::Config::builder();
    if let Some(path) = &sources.file {
        if !path.is_file() {
            return Err(ConfigError::File { path: path.clone(), problem: "not found".into() });
        }
        builder = builder.add_source(config::File::from(path.as_path()).format(config::FileFormat::Toml));
    }
    let env: config::Map<String, String> = sources.env.into_iter().filter(|(k, _)| k.starts_with("PDB_")).collect();
    builder = builder.add_source(
        config::Environment::with_prefix("PDB")
            .prefix_separator("_")
            .separator("__")
            .try_parsing(true)
            .source(Some(env)),
    );
    for (key, value) in sources.overrides {
        builder = builder.set_override(key.as_str(), value).map_err(|e| ConfigError::invalid(&key, e.to_string()))?;
    }
    let settings = builder.build().map_err(|e| translate(e, sources.file.as_ref()))?;
    let typed: T = settings.try_deserialize().map_err(|e| translate(e, sources.file.as_ref()))?;
    typed.validate()?;
    Ok(typed)
}

/// Turns the `config` crate's errors into one line that names the key.
fn translate(err: config::ConfigError, file: Option<&PathBuf>) -> ConfigError {
    use config::ConfigError as E;
    match err {
        E::FileParse { cause, .. } => {
            ConfigError::File { path: file.cloned().unwrap_or_default(), problem: one_line(&cause.to_string()) }
        }
        E::Type { key: Some(key), unexpected, expected, .. } => {
            ConfigError::Invalid { key, problem: format!("expected {expected}, found {unexpected}") }
        }
        E::At { error, key: Some(key), .. } => {
            ConfigError::Invalid { key, problem: strip_location(&error.to_string()) }
        }
        E::NotFound(key) => ConfigError::Invalid { key, problem: "missing".into() },
        other => {
            // serde reports missing/unknown fields as messages without a path.
            let message = other.to_string();
            let key = message.split('`').nth(1).unwrap_or("<root>").to_owned();
            ConfigError::Invalid { key, problem: message }
        }
    }
}

/// A multi-line parser report (position, excerpt, caret, message) as one line.
fn one_line(report: &str) -> String {
    let mut lines = report.lines().map(str::trim).filter(|l| !l.is_empty());
    let first = lines.next().unwrap_or_default();
    match lines.next_back() {
        Some(last) => format!("{first}: {last}"),
        None => first.to_owned(),
    }
}

fn strip_location(message: &str) -> String {
    message.split(" for key").next().unwrap_or(message).to_owned()
}

// ---------------------------------------------------------------------------
// Sections both daemons share.
// ---------------------------------------------------------------------------

/// Listeners and the shutdown budget.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// The gRPC listener.
    pub grpc_listen: SocketAddr,
    /// The admin HTTP listener (`/metrics`, `/healthz`, `/readyz`); unauthenticated, so
    /// on loopback unless set (each daemon has its own default port).
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    /// How long in-flight streams may run after SIGTERM before the process exits.
    #[serde(with = "humantime_serde", default = "default_drain_timeout")]
    pub drain_timeout: Duration,
    #[serde(default)]
    pub http2: Http2Config,
    /// Allows a listener on a non-loopback address with nothing checking who
    /// calls (no `[tls]` for gRPC, no API key for the front door). Logged as a
    /// warning at start and counted in `pdbridge_insecure_listeners`.
    #[serde(default)]
    pub insecure: bool,
}

fn default_drain_timeout() -> Duration {
    Duration::from_secs(30)
}

impl ServerConfig {
    /// `admin_listen`, or 127.0.0.1 on the daemon's `default_port`.
    pub fn admin_addr(&self, default_port: u16) -> SocketAddr {
        self.admin_listen.unwrap_or(SocketAddr::from(([127, 0, 0, 1], default_port)))
    }

    /// Refuses `addr` (the value of `key`) when other hosts can reach it and
    /// nothing authenticates callers, unless `server.insecure` allows it.
    /// Returns whether the listener is exposed that way.
    pub fn check_exposure(&self, key: &str, addr: SocketAddr, protected: bool, fix: &str) -> Result<bool, ConfigError> {
        let exposed = !protected && !addr.ip().is_loopback();
        if exposed && !self.insecure {
            return Err(ConfigError::invalid(
                key,
                format!(
                    "{addr} is reachable from other hosts and {fix}; do that, bind a loopback address, or set server.insecure = true"
                ),
            ));
        }
        Ok(exposed)
    }
}

impl Validate for ServerConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.drain_timeout.is_zero() {
            return Err(ConfigError::invalid("server.drain_timeout", "must be greater than zero"));
        }
        self.http2.validate()
    }
}

/// HTTP/2 settings for streams of cache shards. The defaults let one stream
/// keep a 10 GbE link full across a LAN round trip (16 MiB window ≫ 1.2 GB/s ×
/// 1 ms) and carry the largest shard (4 MiB) in few frames.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Http2Config {
    /// Largest gRPC message either side accepts or sends.
    pub max_message_bytes: usize,
    /// Per-stream flow-control window.
    pub stream_window_bytes: u32,
    /// Per-connection flow-control window (shared by all its streams).
    pub connection_window_bytes: u32,
    /// Largest HTTP/2 DATA frame (16 KiB to 16 MiB − 1).
    pub max_frame_bytes: u32,
    /// Streams one client connection may have open at once (prefilld stripes
    /// a transfer's Push streams over a few connections; more is a flood).
    pub max_concurrent_streams: u32,
}

impl Default for Http2Config {
    fn default() -> Self {
        Http2Config {
            max_message_bytes: 64 << 20,
            stream_window_bytes: 16 << 20,
            connection_window_bytes: 64 << 20,
            max_frame_bytes: 1 << 20,
            max_concurrent_streams: 128,
        }
    }
}

impl Validate for Http2Config {
    fn validate(&self) -> Result<(), ConfigError> {
        if !(16_384..=16_777_215).contains(&self.max_frame_bytes) {
            return Err(ConfigError::invalid("server.http2.max_frame_bytes", "must be between 16384 and 16777215"));
        }
        if self.stream_window_bytes < 65_535 || self.connection_window_bytes < self.stream_window_bytes {
            return Err(ConfigError::invalid(
                "server.http2.connection_window_bytes",
                "windows must be at least 65535 and the connection's at least the stream's",
            ));
        }
        if self.max_concurrent_streams == 0 {
            return Err(ConfigError::invalid("server.http2.max_concurrent_streams", "must be at least 1"));
        }
        if self.max_message_bytes < 1 << 20 {
            return Err(ConfigError::invalid("server.http2.max_message_bytes", "must be at least 1 MiB"));
        }
        Ok(())
    }
}

/// How logs are written.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Human,
    Json,
}

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    #[serde(default)]
    pub format: LogFormat,
}

/// `[telemetry]`: OpenTelemetry traces over OTLP/gRPC, off unless `otlp_endpoint` is set.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// A collector's OTLP/gRPC endpoint, e.g. `http://127.0.0.1:4317` (plain gRPC: a collector
    /// agent on this host, or across a trusted link).
    pub otlp_endpoint: Option<String>,
    /// The fraction of the traces this daemon starts that are recorded. A request that arrives
    /// in a trace (a `traceparent` header or gRPC metadata) follows its caller's choice.
    pub sample_ratio: f64,
    /// Longest a finished span waits before it is exported (in a batch).
    #[serde(with = "humantime_serde")]
    pub export_delay: Duration,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig { otlp_endpoint: None, sample_ratio: 1.0, export_delay: Duration::from_secs(5) }
    }
}

impl Validate for TelemetryConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(endpoint) = &self.otlp_endpoint {
            let uri: axum::http::Uri = endpoint
                .parse()
                .map_err(|e| ConfigError::invalid("telemetry.otlp_endpoint", format!("{endpoint:?}: {e}")))?;
            if uri.scheme_str() != Some("http") || uri.host().is_none() {
                return Err(ConfigError::invalid(
                    "telemetry.otlp_endpoint",
                    format!(
                        "{endpoint:?} is not an http:// address (spans leave in plain gRPC: point it at a collector \
                         on this host or a trusted link, which forwards them over TLS)"
                    ),
                ));
            }
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err(ConfigError::invalid("telemetry.sample_ratio", "must be between 0 and 1"));
        }
        if self.export_delay.is_zero() {
            return Err(ConfigError::invalid("telemetry.export_delay", "must be greater than zero"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Example {
        server: ServerConfig,
        #[serde(default)]
        log: LogConfig,
        #[serde(default)]
        telemetry: TelemetryConfig,
    }

    impl Validate for Example {
        fn validate(&self) -> Result<(), ConfigError> {
            self.server.validate()?;
            self.telemetry.validate()
        }
    }

    /// A TOML file that is removed when dropped.
    struct TempToml(PathBuf);

    impl Drop for TempToml {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn write(toml: &str) -> TempToml {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = std::env::temp_dir().join(format!("pdb-config-{}-{n}.toml", std::process::id()));
        std::fs::write(&path, toml).unwrap();
        TempToml(path)
    }

    const BASE: &str = "[server]\ngrpc_listen = \"127.0.0.1:7070\"\nadmin_listen = \"127.0.0.1:9090\"\n";

    fn sources(path: PathBuf) -> Sources {
        Sources { file: Some(path), ..Default::default() }
    }

    #[test]
    fn file_then_env_then_flags() {
        let file = write(&format!("{BASE}drain_timeout = \"5s\"\n"));
        let path = file.0.clone();
        let c: Example = load(sources(path.clone())).unwrap();
        assert_eq!(c.server.drain_timeout, Duration::from_secs(5));
        assert_eq!(c.server.http2.max_frame_bytes, 1 << 20);
        assert_eq!(c.log.format, LogFormat::Human);

        let mut s = sources(path.clone());
        s.env.insert("PDB_SERVER__GRPC_LISTEN".into(), "127.0.0.1:1".into());
        s.env.insert("PDB_LOG__FORMAT".into(), "json".into());
        s.env.insert("UNRELATED".into(), "x".into());
        let c: Example = load(s).unwrap();
        assert_eq!(c.server.grpc_listen.port(), 1);
        assert_eq!(c.log.format, LogFormat::Json);

        let mut s = sources(path).set("server.grpc_listen", "127.0.0.1:2");
        s.env.insert("PDB_SERVER__GRPC_LISTEN".into(), "127.0.0.1:1".into());
        let c: Example = load(s).unwrap();
        assert_eq!(c.server.grpc_listen.port(), 2, "flags win over the environment");
    }

    fn error_of(toml: &str) -> String {
        let file = write(toml);
        load::<Example>(sources(file.0.clone())).unwrap_err().to_string()
    }

    #[test]
    fn errors_name_the_key() {
        let e = error_of("[server]\ngrpc_listen = \"nope\"\nadmin_listen = \"127.0.0.1:9090\"\n");
        assert!(e.contains("server.grpc_listen"), "{e}");

        let e = error_of(&format!("{BASE}drain_timeout = \"0s\"\n"));
        assert!(e.contains("server.drain_timeout"), "{e}");

        let e = error_of(&format!("{BASE}[server.http2]\nmax_frame_bytes = 12\n"));
        assert!(e.contains("server.http2.max_frame_bytes"), "{e}");

        let e = error_of("[server]\nadmin_listen = \"127.0.0.1:9090\"\n");
        assert!(e.contains("grpc_listen"), "{e}");

        let e = error_of(&format!("{BASE}grpc_lisen = \"x\"\n"));
        assert!(e.contains("grpc_lisen"), "{e}");

        let e = error_of("[server\n");
        assert!(e.starts_with("config file"), "{e}");

        assert!(!e.contains('\n'), "one line: {e}");
    }

    #[test]
    fn the_admin_listener_is_on_loopback_unless_set() {
        let file = write("[server]\ngrpc_listen = \"127.0.0.1:7070\"\n");
        let c: Example = load(sources(file.0.clone())).unwrap();
        assert_eq!(c.server.admin_addr(9470), SocketAddr::from(([127, 0, 0, 1], 9470)));
        let c: Example = load(sources(write(BASE).0.clone())).unwrap();
        assert_eq!(c.server.admin_addr(9470).port(), 9090);
    }

    /// `[telemetry]` is off by default; a collector is a plain gRPC address, a ratio a fraction.
    #[test]
    fn telemetry_names_a_plain_grpc_collector_and_a_ratio() {
        let telemetry = |section: &str| -> Result<TelemetryConfig, String> {
            let file = write(&format!("{BASE}[telemetry]\n{section}\n"));
            load::<Example>(sources(file.0.clone())).map(|c| c.telemetry).map_err(|e| e.to_string())
        };
        let off = telemetry("").unwrap();
        assert_eq!((off.otlp_endpoint, off.sample_ratio, off.export_delay), (None, 1.0, Duration::from_secs(5)));
        let on =
            telemetry("otlp_endpoint = \"http://10.0.0.9:4317\"\nsample_ratio = 0.25\nexport_delay = \"1s\"").unwrap();
        assert_eq!(on.otlp_endpoint.as_deref(), Some("http://10.0.0.9:4317"));
        for (bad, key) in [
            ("otlp_endpoint = \"https://collector:4317\"", "telemetry.otlp_endpoint"),
            ("otlp_endpoint = \"collector:4317\"", "telemetry.otlp_endpoint"),
            ("sample_ratio = 1.5", "telemetry.sample_ratio"),
            ("export_delay = \"0s\"", "telemetry.export_delay"),
        ] {
            let e = telemetry(bad).unwrap_err();
            assert!(e.contains(key), "{bad}: {e}");
        }
    }

    #[test]
    fn a_missing_file_is_named() {
        let e = load::<Example>(sources("/nonexistent/pdb.toml".into())).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/pdb.toml"), "{e}");
    }
}
