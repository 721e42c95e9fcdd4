//! Logs (tracing-subscriber), traces (`traces`, over OTLP when configured) and metrics (a
//! Prometheus recorder rendered by the admin listener).

use std::sync::OnceLock;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::{EnvFilter, Layer, fmt, layer::SubscriberExt, util::SubscriberInitExt};

use crate::{
    config::{LogFormat, TelemetryConfig},
    metric,
    traces::{Exporting, TracesError},
};

/// Installs the global subscriber: logs in `format` (`RUST_LOG` wins over the default level,
/// `info`) and, when `[telemetry]` names a collector, the spans as traces of `service`. Safe to
/// call twice (the second subscriber is ignored), so in-process tests can start several daemons.
pub fn init(format: LogFormat, telemetry: &TelemetryConfig, service: &'static str) -> Result<Exporting, TracesError> {
    let exporting = Exporting::start(telemetry, service)?;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = match format {
        LogFormat::Human => fmt::layer().with_writer(std::io::stderr).boxed(),
        LogFormat::Json => fmt::layer().json().with_writer(std::io::stderr).boxed(),
    };
    let registry = tracing_subscriber::registry().with(logs.with_filter(filter));
    let _ = registry.with(exporting.layer()).try_init();
    Ok(exporting)
}

/// Histogram buckets for durations in seconds: 1 ms to ~10 min.
const SECONDS_BUCKETS: &[f64] =
    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 600.0];

/// Installs the process-wide Prometheus recorder once and returns its handle.
/// Metric names carry their unit suffix themselves (`_seconds`, `_bytes`), so
/// the exporter's automatic suffixing stays off.
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            PrometheusBuilder::new()
                .set_buckets(SECONDS_BUCKETS)
                .expect("static bucket list is non-empty")
                .install_recorder()
                .expect("the metrics recorder is installed only here")
        })
        .clone()
}

/// Publishes `pdbridge_build_info{daemon, version} 1`, installing the recorder
/// first so the gauge is never written to the no-op default.
pub fn record_build_info(daemon: &'static str) {
    metrics_handle();
    metrics::gauge!(metric::BUILD_INFO.name, "daemon" => daemon, "version" => env!("CARGO_PKG_VERSION")).set(1.0);
}

/// Describes the metrics both daemons publish and the daemon's `own`, and registers the common
/// ones at zero, so a dashboard query never finds a name missing just because nothing has happened
/// yet.
pub fn register_common(engine: &'static str, service: &'static str, own: &[metric::Metric]) {
    metric::describe(metric::COMMON);
    metric::describe(own);
    metrics::gauge!(metric::ENGINE_UP.name, "engine" => engine).set(0.0);
    metrics::counter!(metric::ENGINE_RESTARTS.name, "engine" => engine).absolute(0);
    crate::liveness::mark(engine, false);
    crate::layers::grpc_metrics::register(service);
    metrics::gauge!(metric::INSECURE_LISTENERS.name).set(0.0);
}

/// Warns about, and counts, listeners that `server.insecure` left open to
/// other hosts (config keys, e.g. `server.grpc_listen`).
pub fn record_insecure(listeners: &[&str]) {
    metrics::gauge!(metric::INSECURE_LISTENERS.name).set(listeners.len() as f64);
    if !listeners.is_empty() {
        tracing::warn!(
            listeners = listeners.join(", "),
            "server.insecure: these listeners accept anyone who can reach them; see SECURITY.md"
        );
    }
}

/// Publishes when the certificate the daemon serves expires (`[tls]`), for an alert well before.
pub fn record_certificate(tls: Option<&crate::tls::Tls>) {
    if let Some(tls) = tls {
        metrics::gauge!(metric::TLS_CERT_EXPIRY.name).set(tls.expires_at() as f64);
    }
}

/// Records one stage's duration in `pdbridge_stage_seconds{stage}`.
pub fn record_stage(stage: &'static str, seconds: f64) {
    metrics::histogram!(metric::STAGE_SECONDS.name, "stage" => stage).record(seconds);
}

/// Holds one unit of an "in flight" gauge for as long as it lives.
pub struct InFlight(&'static str);

impl InFlight {
    pub fn enter(gauge: &'static str) -> Self {
        metrics::gauge!(gauge).increment(1.0);
        InFlight(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        metrics::gauge!(self.0).decrement(1.0);
    }
}
