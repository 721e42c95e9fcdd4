//! OpenTelemetry traces: the OTLP/gRPC pipeline `[telemetry]` configures, and the W3C trace
//! context a request carries across every hop — HTTP headers (the front door's clients, vLLM's
//! server), gRPC metadata (`Prefill`, `Push`) and the vLLM plugin's parameters (`traceparent`).
//!
//! Spans are `tracing` spans; the layer made here turns them into OpenTelemetry spans. Work another
//! process timed (the decode engine's stages, which its adapter measures) is recorded after the
//! fact with its own start and end ([`PastSpan`]). Without a collector every call here is a no-op.

use std::{
    collections::HashMap,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, SystemTime},
};

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use opentelemetry::{
    Context, KeyValue, global,
    propagation::TextMapPropagator,
    trace::{SpanKind, TraceContextExt, Tracer, TracerProvider as _},
};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::{
    Resource,
    error::OTelSdkResult,
    propagation::TraceContextPropagator,
    trace::{BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracerProvider, SpanData, SpanExporter},
};
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::{Span, Subscriber};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::{Layer, filter::LevelFilter, registry::LookupSpan};

use crate::{config::TelemetryConfig, metric};

/// The instrumentation scope of every span pd-bridge makes.
const SCOPE: &str = "pd-bridge";
/// What W3C trace context travels in.
const FIELDS: [&str; 2] = ["traceparent", "tracestate"];

#[derive(Debug, thiserror::Error)]
#[error("telemetry.otlp_endpoint {endpoint:?}: {source}")]
pub struct TracesError {
    endpoint: String,
    source: opentelemetry_otlp::ExporterBuildError,
}

/// The traces pipeline of a running daemon (none when `[telemetry]` names no collector).
pub struct Exporting(Option<SdkTracerProvider>);

impl Exporting {
    /// Starts exporting to `telemetry.otlp_endpoint`, as `service` (the resource's
    /// `service.name`). Must run inside the tokio runtime the exporter's channel lives on.
    pub fn start(config: &TelemetryConfig, service: &'static str) -> Result<Exporting, TracesError> {
        let Some(endpoint) = &config.otlp_endpoint else { return Ok(Exporting(None)) };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .build()
            .map_err(|source| TracesError { endpoint: endpoint.clone(), source })?;
        let batch = BatchConfigBuilder::default().with_scheduled_delay(config.export_delay).build();
        let resource = Resource::builder()
            .with_service_name(service)
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
            .build();
        let exporter = Counted { inner: exporter, failing: AtomicBool::new(false) };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(BatchSpanProcessor::builder(exporter).with_batch_config(batch).build())
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(config.sample_ratio))))
            .with_resource(resource)
            .build();
        global::set_tracer_provider(provider.clone());
        Ok(Exporting(Some(provider)))
    }

    /// The layer that turns the daemon's spans (`info` and above, whatever `RUST_LOG` says of
    /// logs) into OpenTelemetry spans.
    pub fn layer<S>(&self) -> Option<impl Layer<S> + use<S>>
    where
        S: Subscriber + for<'span> LookupSpan<'span>,
    {
        let provider = self.0.as_ref()?;
        Some(tracing_opentelemetry::layer().with_tracer(provider.tracer(SCOPE)).with_filter(LevelFilter::INFO))
    }

    /// Exports what is left and stops (off the runtime's threads: the export needs them).
    pub async fn shutdown(self) {
        let Some(provider) = self.0 else { return };
        match tokio::task::spawn_blocking(move || provider.shutdown()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "the last spans were not exported"),
            Err(e) => tracing::warn!(error = %e, "the last spans were not exported"),
        }
    }
}

/// An exporter that counts the spans it sends and those lost to a collector that did not take
/// them (otherwise silent), and logs when exporting starts failing and when it recovers.
#[derive(Debug)]
struct Counted<E> {
    inner: E,
    failing: AtomicBool,
}

impl<E: SpanExporter> SpanExporter for Counted<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len() as u64;
        let result = self.inner.export(batch).await;
        let outcome = if result.is_ok() { "exported" } else { "failed" };
        metrics::counter!(metric::TRACE_SPANS.name, "outcome" => outcome).increment(spans);
        let was_failing = self.failing.swap(result.is_err(), Ordering::Relaxed);
        match &result {
            Err(e) if !was_failing => tracing::warn!(error = %e, "spans are not reaching telemetry.otlp_endpoint"),
            Ok(()) if was_failing => tracing::info!("spans reach telemetry.otlp_endpoint again"),
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

/// Continues the trace of a request that arrived with these HTTP headers in `span`.
pub fn continue_http(span: &Span, headers: &HeaderMap) {
    continue_from(span, |field| headers.get(field).and_then(|v| v.to_str().ok()));
}

/// Continues the trace of an RPC that arrived with this metadata in `span`.
pub fn continue_grpc(span: &Span, metadata: &MetadataMap) {
    continue_from(span, |field| metadata.get(field).and_then(|v| v.to_str().ok()));
}

fn continue_from<'a>(span: &Span, get: impl Fn(&str) -> Option<&'a str>) {
    let carrier: HashMap<String, String> =
        FIELDS.iter().filter_map(|&field| Some((field.to_owned(), get(field)?.to_owned()))).collect();
    let parent = TraceContextPropagator::new().extract(&carrier);
    if parent.span().span_context().is_valid() {
        // Fails only without the layer (telemetry off), when there is nothing to continue.
        let _ = span.set_parent(parent);
    }
}

/// `span`'s trace context as W3C fields (none when it is not recorded).
fn context_fields(span: &Span) -> HashMap<String, String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier
}

/// Adds `span`'s trace context to an outgoing HTTP request's headers.
pub fn inject_http(span: &Span, headers: &mut HeaderMap) {
    for (field, value) in context_fields(span) {
        if let (Ok(name), Ok(value)) = (HeaderName::try_from(field), HeaderValue::try_from(value)) {
            headers.insert(name, value);
        }
    }
}

/// Adds `span`'s trace context to an outgoing RPC's metadata.
pub fn inject_grpc(span: &Span, metadata: &mut MetadataMap) {
    for (field, value) in context_fields(span) {
        if let (Ok(key), Ok(value)) = (MetadataKey::from_bytes(field.as_bytes()), MetadataValue::try_from(value)) {
            metadata.insert(key, value);
        }
    }
}

/// `span`'s W3C `traceparent`, for a process that continues the trace from a parameter; empty when
/// the span is not recorded.
pub fn traceparent(span: &Span) -> String {
    context_fields(span).remove("traceparent").unwrap_or_default()
}

/// A span of work timed elsewhere, recorded with the times it was measured at: under a live span
/// ([`PastSpan::under`]) or another past one ([`PastSpan::child`]).
pub struct PastSpan(Context);

impl PastSpan {
    /// A span that began at `start`, under `parent`.
    pub fn under(parent: &Span, name: &'static str, start: SystemTime, attributes: Vec<KeyValue>) -> PastSpan {
        PastSpan::starting(&parent.context(), name, start, attributes)
    }

    fn starting(parent: &Context, name: &'static str, start: SystemTime, attributes: Vec<KeyValue>) -> PastSpan {
        let tracer = global::tracer(SCOPE);
        let span = tracer
            .span_builder(name)
            .with_kind(SpanKind::Internal)
            .with_start_time(start)
            .with_attributes(attributes)
            .start_with_context(&tracer, parent);
        PastSpan(parent.with_span(span))
    }

    /// A child from `start` to `end`.
    pub fn child(&self, name: &'static str, start: SystemTime, end: SystemTime) {
        PastSpan::starting(&self.0, name, start, Vec::new()).end(end);
    }

    /// Something that happened at `at`.
    pub fn event(&self, name: &'static str, at: SystemTime) {
        self.0.span().add_event_with_timestamp(name, at, Vec::new());
    }

    pub fn end(self, at: SystemTime) {
        self.0.span().end_with_timestamp(at);
    }
}

#[cfg(test)]
mod tests {
    use tracing_subscriber::layer::SubscriberExt;

    use super::*;

    const CALLER: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    /// A caller's trace continues through a span, out in gRPC metadata and back in on the other
    /// side: one trace id all along, each hop a new span.
    #[test]
    fn a_callers_trace_continues_across_http_and_grpc() {
        let provider = SdkTracerProvider::builder().build();
        let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer(SCOPE));
        tracing::subscriber::with_default(tracing_subscriber::registry().with(layer), || {
            let mut headers = HeaderMap::new();
            headers.insert("traceparent", HeaderValue::from_static(CALLER));
            let request = tracing::info_span!("request");
            continue_http(&request, &headers);
            let sent = traceparent(&request);
            let (trace, caller_span) = (&CALLER[3..35], &CALLER[36..52]);
            assert!(sent.starts_with(&format!("00-{trace}-")) && !sent.contains(caller_span), "{sent}");

            let mut metadata = MetadataMap::new();
            inject_grpc(&request, &mut metadata);
            assert_eq!(metadata.get("traceparent").unwrap().to_str().unwrap(), sent);
            let served = tracing::info_span!("served");
            continue_grpc(&served, &metadata);
            let served = traceparent(&served);
            assert!(served.starts_with(&format!("00-{trace}-")) && served != sent, "{served}");
        });
    }

    /// Without the layer (no collector) nothing is sent: no header, no metadata, no traceparent.
    #[test]
    fn without_a_collector_nothing_travels() {
        let span = tracing::info_span!("request");
        let mut headers = HeaderMap::new();
        headers.insert("traceparent", HeaderValue::from_static(CALLER));
        continue_http(&span, &headers);
        let mut out = HeaderMap::new();
        inject_http(&span, &mut out);
        let mut metadata = MetadataMap::new();
        inject_grpc(&span, &mut metadata);
        assert!(out.is_empty() && metadata.is_empty());
        assert_eq!(traceparent(&span), "");
    }
}
