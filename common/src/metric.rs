//! Every metric the daemons export, declared once: its name, type, labels and help text. Code
//! records a metric by its constant here (`metrics::counter!(STORE_EVICTIONS.name)`), each daemon
//! describes its list at start ([`describe`]), and `deploy/check.py` reads this file for the names
//! and labels a dashboard panel or a rule may use.

use metrics::Unit;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    Counter,
    Gauge,
    Histogram,
}

#[derive(Clone, Copy, Debug)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Type,
    /// The labels every series of it carries (none: one series).
    pub labels: &'static [&'static str],
    pub help: &'static str,
}

impl Metric {
    const fn counter(name: &'static str, labels: &'static [&'static str], help: &'static str) -> Metric {
        Metric { name, kind: Type::Counter, labels, help }
    }

    const fn gauge(name: &'static str, labels: &'static [&'static str], help: &'static str) -> Metric {
        Metric { name, kind: Type::Gauge, labels, help }
    }

    const fn histogram(name: &'static str, labels: &'static [&'static str], help: &'static str) -> Metric {
        Metric { name, kind: Type::Histogram, labels, help }
    }

    /// Its unit, by Prometheus's naming rule (the unit is the name's last word).
    fn unit(&self) -> Option<Unit> {
        if self.name.ends_with("_seconds") {
            Some(Unit::Seconds)
        } else if self.name.contains("_bytes") {
            Some(Unit::Bytes)
        } else {
            None
        }
    }
}

/// Describes `metrics` (their help text and unit on `/metrics`).
pub fn describe(metrics: &[Metric]) {
    metrics::with_recorder(|recorder| {
        for m in metrics {
            let (name, unit, help) = (m.name.into(), m.unit(), m.help.into());
            match m.kind {
                Type::Counter => recorder.describe_counter(name, unit, help),
                Type::Gauge => recorder.describe_gauge(name, unit, help),
                Type::Histogram => recorder.describe_histogram(name, unit, help),
            }
        }
    });
}

// ---- Both daemons -----------------------------------------------------------------------------

pub const BUILD_INFO: Metric =
    Metric::gauge("pdbridge_build_info", &["daemon", "version"], "Build of the running daemon (always 1).");
pub const ENGINE_UP: Metric = Metric::gauge("pdbridge_engine_up", &["engine"], "1 while the engine child is ready.");
pub const ENGINE_RESTARTS: Metric =
    Metric::counter("pdbridge_engine_restarts_total", &["engine"], "Engine child restarts after a crash.");
pub const ENGINE_ALIVE: Metric = Metric::gauge(
    "pdbridge_engine_alive",
    &["engine"],
    "1 while the engine is up and answers its liveness probe (engine.liveness); 0 while down or stalled.",
);
pub const INSECURE_LISTENERS: Metric = Metric::gauge(
    "pdbridge_insecure_listeners",
    &[],
    "Listeners reachable from other hosts with nothing authenticating callers (allowed by server.insecure).",
);
pub const TRACE_SPANS: Metric = Metric::counter(
    "pdbridge_trace_spans_total",
    &["outcome"],
    "Spans sent to telemetry.otlp_endpoint, by outcome (exported, failed: lost with the collector down).",
);
pub const STAGE_SECONDS: Metric =
    Metric::histogram("pdbridge_stage_seconds", &["stage"], "Duration of one stage of a request.");
pub const TLS_CERT_EXPIRY: Metric = Metric::gauge(
    "pdbridge_tls_cert_expiry_timestamp_seconds",
    &[],
    "When the certificate this daemon serves (tls.cert) expires, in seconds since the epoch.",
);
/// Per-RPC metrics, in the family the gRPC ecosystem charts (`common::layers::grpc_metrics`).
pub const GRPC_STARTED: Metric = Metric::counter(
    "grpc_server_started_total",
    &["grpc_service", "grpc_method", "grpc_type"],
    "RPCs started on the server.",
);
pub const GRPC_HANDLED: Metric = Metric::counter(
    "grpc_server_handled_total",
    &["grpc_service", "grpc_method", "grpc_type", "grpc_code"],
    "RPCs completed on the server, by gRPC status code.",
);
pub const GRPC_HANDLING: Metric = Metric::histogram(
    "grpc_server_handling_seconds",
    &["grpc_service", "grpc_method", "grpc_type"],
    "Time from an RPC's request to the end of its answer (a stream's whole length).",
);

pub const COMMON: &[Metric] = &[
    BUILD_INFO,
    ENGINE_UP,
    ENGINE_RESTARTS,
    ENGINE_ALIVE,
    INSECURE_LISTENERS,
    TRACE_SPANS,
    STAGE_SECONDS,
    TLS_CERT_EXPIRY,
    GRPC_STARTED,
    GRPC_HANDLED,
    GRPC_HANDLING,
];

// ---- prefilld ---------------------------------------------------------------------------------

pub const PREFILL_REQUESTS: Metric = Metric::counter(
    "pdbridge_prefill_requests_total",
    &["outcome", "reason"],
    "Prefill requests by outcome and reason.",
);
pub const PLUGIN_FAILURES: Metric = Metric::counter(
    "pdbridge_plugin_failures_total",
    &["failure"],
    "Requests the vLLM plugin failed, by its reason (proto/engine.proto's PluginFailure).",
);
pub const PREFILL_DURATION: Metric =
    Metric::histogram("pdbridge_prefill_duration_seconds", &[], "Prefill request duration, end to end.");
pub const PREFILL_IN_FLIGHT: Metric = Metric::gauge("pdbridge_prefill_in_flight", &[], "Prefill requests in progress.");
pub const STREAM_PAYLOAD_BYTES_PER_TOKEN: Metric =
    Metric::gauge("pdbridge_stream_payload_bytes_per_token", &[], "Cache bytes per token of the last bridged request.");
pub const STREAM_BYTES: Metric =
    Metric::counter("pdbridge_stream_bytes_total", &[], "Payload bytes streamed to decoders.");
pub const STREAM_BLOCKS: Metric = Metric::counter("pdbridge_stream_blocks_total", &[], "Blocks streamed to decoders.");
pub const STAGE_CONNECTIONS: Metric = Metric::counter(
    "pdbridge_stage_connections_total",
    &["outcome"],
    "Connections to the stage listener (engine.nodes) by outcome: admitted, or refused (no certificate of the CA, or an identity not in stage_peers).",
);

pub const PREFILLD: &[Metric] = &[
    PREFILL_REQUESTS,
    PLUGIN_FAILURES,
    PREFILL_DURATION,
    PREFILL_IN_FLIGHT,
    STREAM_PAYLOAD_BYTES_PER_TOKEN,
    STREAM_BYTES,
    STREAM_BLOCKS,
    STAGE_CONNECTIONS,
];

// ---- decoded ----------------------------------------------------------------------------------

pub const BRIDGE_OUTCOMES: Metric = Metric::counter(
    "pdbridge_bridge_outcomes_total",
    &["outcome", "reason"],
    "Front-door answers by verdict outcome and reason.",
);
pub const TTFT: Metric =
    Metric::histogram("pdbridge_ttft_seconds", &["outcome"], "Time to first token at the front door.");
pub const FRONT_IN_FLIGHT: Metric =
    Metric::gauge("pdbridge_front_requests_in_flight", &[], "Front-door requests in progress.");
pub const FRONT_UNAUTHORIZED: Metric = Metric::counter(
    "pdbridge_front_unauthorized_total",
    &[],
    "Front-door requests refused for a missing or wrong API key.",
);
pub const FRONT_FORWARDED: Metric = Metric::counter(
    "pdbridge_front_forwarded_total",
    &["peer"],
    "Front-door requests forwarded to the peer decoder holding their prompt (front.peers).",
);
pub const FRONT_CONNECTIONS_OPEN: Metric =
    Metric::gauge("pdbridge_front_connections_open", &[], "Front-door connections open now.");
pub const FRONT_CONNECTIONS_REFUSED: Metric = Metric::counter(
    "pdbridge_front_connections_refused_total",
    &[],
    "Front-door connections closed on accept: their address held front.max_connections_per_peer.",
);
/// Per-request metrics of the front door, in OpenTelemetry's HTTP conventions
/// (`common::layers::http_metrics`).
pub const HTTP_REQUEST_DURATION: Metric = Metric::histogram(
    "http_server_request_duration_seconds",
    &["http_request_method", "http_route", "http_response_status_code"],
    "Time from an HTTP request to the end of its answer (a stream's whole length), by route and status.",
);
pub const PUSH_STREAMS_IN_FLIGHT: Metric =
    Metric::gauge("pdbridge_push_streams_in_flight", &[], "Push streams in progress.");
pub const PUSH_BYTES: Metric =
    Metric::counter("pdbridge_push_bytes_total", &[], "Bytes of blocks committed from Push streams.");
pub const PUSH_MEMORY: Metric =
    Metric::gauge("pdbridge_push_memory_bytes", &[], "Memory held by Push streams' blocks not yet committed.");
pub const PUSH_MEMORY_LIMIT: Metric = Metric::gauge(
    "pdbridge_push_memory_limit_bytes",
    &[],
    "The most memory Push streams' uncommitted blocks may hold (store.max_push_bytes).",
);
pub const STORE_BLOCKS: Metric = Metric::gauge("pdbridge_store_blocks", &[], "Blocks in the store.");
pub const STORE_BYTES: Metric = Metric::gauge("pdbridge_store_bytes", &[], "Bytes of the blocks in the store.");
pub const STORE_BUDGET: Metric = Metric::gauge("pdbridge_store_budget_bytes", &[], "Byte budget of the block store.");
pub const STORE_LEASED_BLOCKS: Metric =
    Metric::gauge("pdbridge_store_leased_blocks", &[], "Blocks held for running generations (never evicted).");
pub const STORE_LOOKUPS: Metric =
    Metric::counter("pdbridge_store_lookups_total", &["outcome"], "Prefix lookups, by hit or miss.");
pub const STORE_EVICTIONS: Metric = Metric::counter(
    "pdbridge_store_evictions_total",
    &[],
    "Blocks evicted to stay within the store budget or free space.",
);
pub const STORE_QUARANTINED: Metric = Metric::counter(
    "pdbridge_store_quarantined_total",
    &[],
    "Block files quarantined (name, contents or checksum disagree).",
);
pub const STORE_BLOCKS_COMMITTED: Metric =
    Metric::counter("pdbridge_store_blocks_committed_total", &[], "Blocks committed from Push streams.");
pub const RECONSTRUCT_SECONDS: Metric = Metric::histogram(
    "pdbridge_reconstruct_seconds",
    &[],
    "The decoder computing one pushed block's cache from its layer inputs.",
);

pub const DECODED: &[Metric] = &[
    BRIDGE_OUTCOMES,
    TTFT,
    FRONT_IN_FLIGHT,
    FRONT_UNAUTHORIZED,
    FRONT_FORWARDED,
    FRONT_CONNECTIONS_OPEN,
    FRONT_CONNECTIONS_REFUSED,
    HTTP_REQUEST_DURATION,
    PUSH_STREAMS_IN_FLIGHT,
    PUSH_BYTES,
    PUSH_MEMORY,
    PUSH_MEMORY_LIMIT,
    STORE_BLOCKS,
    STORE_BYTES,
    STORE_BUDGET,
    STORE_LEASED_BLOCKS,
    STORE_LOOKUPS,
    STORE_EVICTIONS,
    STORE_QUARANTINED,
    STORE_BLOCKS_COMMITTED,
    RECONSTRUCT_SECONDS,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_metric_is_in_one_list_once_and_a_counter_exactly_when_named_total() {
        let all = [COMMON, PREFILLD, DECODED].concat();
        let mut names: Vec<&str> = all.iter().map(|m| m.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), all.len(), "a metric listed twice");
        for m in &all {
            assert_eq!(m.kind == Type::Counter, m.name.ends_with("_total"), "{}", m.name);
            assert!(!m.help.is_empty() && m.labels.iter().all(|l| !l.is_empty()), "{}", m.name);
        }
    }

    #[test]
    fn described_metrics_are_exported_with_their_help() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe(COMMON);
            metrics::counter!(ENGINE_RESTARTS.name, "engine" => "mlx").increment(1);
            metrics::histogram!(STAGE_SECONDS.name, "stage" => "bridge").record(0.5);
        });
        let text = handle.render();
        for m in [ENGINE_RESTARTS, STAGE_SECONDS] {
            assert!(text.contains(&format!("# HELP {} {}\n", m.name, m.help)), "{text}");
        }
    }
}
