//! Per-RPC metrics for every gRPC server, in the family the gRPC ecosystem has charted for years
//! (go-grpc-prometheus, now go-grpc-middleware's Prometheus provider): `grpc_server_started_total`,
//! `grpc_server_handled_total` by `grpc_code`, and `grpc_server_handling_seconds`, labelled
//! `grpc_service` / `grpc_method` / `grpc_type`, so the dashboards operators already have work
//! unchanged. The layer sits outside every other, so a refusal by a layer is counted like a
//! handler's; a streamed RPC lasts until its body ends, its code read from its trailers.

use std::{collections::HashMap, sync::OnceLock};

use http::{HeaderMap, Request, StatusCode};
use prost::Message;
use tonic::Code;

use super::metered::{End, Meter};
use crate::metric;

/// Publishes `service`'s RPCs at zero (started, and handled under every code, as gRPC's other
/// implementations do), so a dashboard or an alert finds their series before the first call.
pub fn register(service: &str) {
    for path in paths_of(service) {
        let rpc = rpc(&path);
        metrics::counter!(metric::GRPC_STARTED.name, &rpc.labels()).absolute(0);
        for code in (0..=16).map(Code::from_i32) {
            metrics::counter!(metric::GRPC_HANDLED.name, &rpc.with_code(code)).absolute(0);
        }
    }
}

/// One RPC's labels (the descriptors' names, kept for the process's life: no RPC allocates them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rpc {
    pub service: &'static str,
    pub method: &'static str,
    /// `unary`, `client_stream`, `server_stream` or `bidi_stream`.
    pub kind: &'static str,
}

/// Every RPC this crate's descriptors declare (pd-bridge's, health's and reflection's), by path.
fn rpcs() -> &'static HashMap<String, Rpc> {
    static RPCS: OnceLock<HashMap<String, Rpc>> = OnceLock::new();
    RPCS.get_or_init(|| {
        let sets = [
            crate::proto::FILE_DESCRIPTOR_SET,
            tonic_health::pb::FILE_DESCRIPTOR_SET,
            tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET,
            tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET,
        ];
        let files = sets
            .into_iter()
            .flat_map(|set| prost_types::FileDescriptorSet::decode(set).expect("descriptor sets are compiled in").file);
        let mut rpcs = HashMap::new();
        for file in files {
            for service in &file.service {
                let service_name: &'static str =
                    Box::leak(format!("{}.{}", file.package(), service.name()).into_boxed_str());
                for method in &service.method {
                    let kind = match (method.client_streaming(), method.server_streaming()) {
                        (false, false) => "unary",
                        (true, false) => "client_stream",
                        (false, true) => "server_stream",
                        (true, true) => "bidi_stream",
                    };
                    let rpc = Rpc { service: service_name, method: Box::leak(method.name().into()), kind };
                    rpcs.insert(format!("/{service_name}/{}", method.name()), rpc);
                }
            }
        }
        rpcs
    })
}

/// The RPC at `path`; one label set for every path no descriptor declares, so that callers cannot
/// make up series.
pub fn rpc(path: &str) -> Rpc {
    rpcs().get(path).copied().unwrap_or(Rpc { service: "unknown", method: "unknown", kind: "unknown" })
}

/// The paths of `service`'s RPCs (`pdbridge.v1.CacheStore`), for holding access rules to them.
pub fn paths_of(service: &str) -> Vec<String> {
    let mut paths: Vec<String> =
        rpcs().iter().filter(|(_, rpc)| rpc.service == service).map(|(path, _)| path.clone()).collect();
    paths.sort();
    paths
}

/// A code as gRPC's other implementations name it in these metrics (`OK`, `Canceled`, ...).
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "Canceled",
        Code::Unknown => "Unknown",
        Code::InvalidArgument => "InvalidArgument",
        Code::DeadlineExceeded => "DeadlineExceeded",
        Code::NotFound => "NotFound",
        Code::AlreadyExists => "AlreadyExists",
        Code::PermissionDenied => "PermissionDenied",
        Code::ResourceExhausted => "ResourceExhausted",
        Code::FailedPrecondition => "FailedPrecondition",
        Code::Aborted => "Aborted",
        Code::OutOfRange => "OutOfRange",
        Code::Unimplemented => "Unimplemented",
        Code::Internal => "Internal",
        Code::Unavailable => "Unavailable",
        Code::DataLoss => "DataLoss",
        Code::Unauthenticated => "Unauthenticated",
    }
}

fn grpc_status(headers: &HeaderMap) -> Option<Code> {
    let value = headers.get("grpc-status")?.to_str().ok()?.parse::<i32>().ok()?;
    Some(Code::from_i32(value))
}

impl Rpc {
    fn labels(&self) -> [(&'static str, &'static str); 3] {
        [("grpc_service", self.service), ("grpc_method", self.method), ("grpc_type", self.kind)]
    }

    fn with_code(&self, code: Code) -> [(&'static str, &'static str); 4] {
        let [service, method, kind] = self.labels();
        [service, method, kind, ("grpc_code", code_name(code))]
    }

    fn handled(&self, code: Code, seconds: f64) {
        metrics::counter!(metric::GRPC_HANDLED.name, &self.with_code(code)).increment(1);
        metrics::histogram!(metric::GRPC_HANDLING.name, &self.labels()).record(seconds);
    }
}

/// Counts and times every RPC of the server it is layered on (`MeterLayer(GrpcMeter)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct GrpcMeter;

impl Meter for GrpcMeter {
    type Call = Rpc;
    /// The RPC, and its code when the head has it (a trailers-only answer: an error before any
    /// message).
    type Answer = (Rpc, Option<Code>);

    fn start<B>(&self, request: &Request<B>) -> Rpc {
        let rpc = rpc(request.uri().path());
        metrics::counter!(metric::GRPC_STARTED.name, &rpc.labels()).increment(1);
        rpc
    }

    fn answered(rpc: Rpc, _: StatusCode, headers: &HeaderMap) -> (Rpc, Option<Code>) {
        (rpc, grpc_status(headers))
    }

    fn finished((rpc, early): (Rpc, Option<Code>), end: End<'_>, seconds: f64) {
        let code = early.or_else(|| match end {
            End::Finished(trailers) => trailers.and_then(grpc_status),
            End::Failed => None,
            End::Dropped => Some(Code::Cancelled),
        });
        rpc.handled(code.unwrap_or(Code::Unknown), seconds);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rpcs_are_named_and_typed_from_their_descriptors() {
        let push = rpc("/pdbridge.v1.CacheStore/Push");
        assert_eq!((push.service, push.method, push.kind), ("pdbridge.v1.CacheStore", "Push", "client_stream"));
        assert_eq!(rpc("/pdbridge.v1.Prefiller/Prefill").kind, "server_stream");
        assert_eq!(rpc("/grpc.health.v1.Health/Check").kind, "unary");
        assert_eq!(rpc("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo").kind, "bidi_stream");
        assert_eq!(rpc("/made.Up/Series").method, "unknown");
        assert_eq!(paths_of("pdbridge.v1.Prefiller"), ["/pdbridge.v1.Prefiller/Prefill"]);
    }
}
