//! A trace collector for the tests: OTLP/gRPC's `TraceService`, built on the published OTLP
//! protobufs, on a loopback port, keeping every span the daemons (and vLLM) export to it.

use std::time::Duration;

use opentelemetry_proto::tonic::{
    collector::trace::v1::{
        ExportTraceServiceRequest, ExportTraceServiceResponse,
        trace_service_server::{TraceService, TraceServiceServer},
    },
    common::v1::{AnyValue, KeyValue, any_value::Value},
};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

/// One span as received: who sent it, its place in its trace, and its attributes.
#[derive(Clone, Debug)]
pub struct ReceivedSpan {
    /// The exporting process's `service.name`.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a trace's root.
    pub parent_id: String,
    pub attributes: Vec<(String, String)>,
    pub events: Vec<String>,
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

/// One trace's spans, asserted on as a tree (a failed assertion prints the tree).
pub struct Trace(Vec<ReceivedSpan>);

impl Trace {
    pub fn of(spans: &[ReceivedSpan], trace_id: &str) -> Trace {
        Trace(spans.iter().filter(|s| s.trace_id == trace_id).cloned().collect())
    }

    /// Whether `spans` hold a span `name` that `service` sent in trace `trace_id`.
    pub fn holds(spans: &[ReceivedSpan], trace_id: &str, service: &str, name: &str) -> bool {
        spans.iter().any(|s| s.trace_id == trace_id && s.service == service && s.name == name)
    }

    pub fn spans(&self) -> impl Iterator<Item = &ReceivedSpan> {
        self.0.iter()
    }

    /// The spans `name` that `service` sent.
    pub fn all(&self, service: &str, name: &str) -> Vec<&ReceivedSpan> {
        self.0.iter().filter(|s| s.service == service && s.name == name).collect()
    }

    /// The one span `name` that `service` sent.
    pub fn one(&self, service: &str, name: &str) -> &ReceivedSpan {
        let found = self.all(service, name);
        assert_eq!(found.len(), 1, "one {service}:{name} in {}", self.tree());
        found[0]
    }

    pub fn assert_under(&self, child: &ReceivedSpan, parent: &ReceivedSpan) {
        assert_eq!(child.parent_id, parent.span_id, "{} under {} in {}", child.name, parent.name, self.tree());
    }

    pub fn tree(&self) -> String {
        let lines: Vec<String> =
            self.0.iter().map(|s| format!("{}:{} {} <- {}", s.service, s.name, s.span_id, s.parent_id)).collect();
        lines.join("\n")
    }
}

pub struct OtlpReceiver {
    /// What a daemon's `telemetry.otlp_endpoint` names.
    pub endpoint: String,
    received: watch::Receiver<Vec<ReceivedSpan>>,
    _server: tokio::task::JoinHandle<()>,
}

struct Collector(watch::Sender<Vec<ReceivedSpan>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: Request<ExportTraceServiceRequest>,
    ) -> Result<Response<ExportTraceServiceResponse>, Status> {
        let spans = received(request.into_inner());
        self.0.send_modify(|all| all.extend(spans));
        Ok(Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

fn received(request: ExportTraceServiceRequest) -> Vec<ReceivedSpan> {
    let mut out = Vec::new();
    for resource_spans in request.resource_spans {
        let resource = resource_spans.resource.map(|r| r.attributes).unwrap_or_default();
        let service = text_attributes(&resource).into_iter().find(|(k, _)| k == "service.name").map(|(_, v)| v);
        for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
            out.push(ReceivedSpan {
                service: service.clone().unwrap_or_default(),
                name: span.name,
                trace_id: hex(&span.trace_id),
                span_id: hex(&span.span_id),
                parent_id: hex(&span.parent_span_id),
                attributes: text_attributes(&span.attributes),
                events: span.events.into_iter().map(|e| e.name).collect(),
                start_unix_nano: span.start_time_unix_nano,
                end_unix_nano: span.end_time_unix_nano,
            });
        }
    }
    out
}

fn text_attributes(attributes: &[KeyValue]) -> Vec<(String, String)> {
    attributes.iter().map(|kv| (kv.key.clone(), kv.value.as_ref().map(text).unwrap_or_default())).collect()
}

fn text(value: &AnyValue) -> String {
    match &value.value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        other => format!("{other:?}"),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        OtlpReceiver::start_on("127.0.0.1:0".parse().unwrap()).await
    }

    /// A receiver on `addr` (a collector that comes up where the daemons already export to).
    pub async fn start_on(addr: std::net::SocketAddr) -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind the OTLP receiver");
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let (sender, received) = watch::channel(Vec::new());
        let service = TraceServiceServer::new(Collector(sender));
        let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
        let server = tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming);
        let server = tokio::spawn(async move { server.await.expect("the OTLP receiver serves") });
        OtlpReceiver { endpoint, received, _server: server }
    }

    /// The spans received once `done` holds of them; panics with what did arrive after `timeout`.
    pub async fn wait_for(&self, timeout: Duration, done: impl Fn(&[ReceivedSpan]) -> bool) -> Vec<ReceivedSpan> {
        let mut received = self.received.clone();
        let waited = tokio::time::timeout(timeout, received.wait_for(|spans| done(spans))).await;
        match waited {
            Ok(Ok(spans)) => spans.clone(),
            _ => {
                let names: Vec<String> =
                    self.received.borrow().iter().map(|s| format!("{}:{}", s.service, s.name)).collect();
                panic!("the spans awaited did not arrive within {timeout:?}; received {names:?}")
            }
        }
    }
}
