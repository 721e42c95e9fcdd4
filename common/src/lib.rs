//! Shared by both pd-bridge daemons: the wire contract, block keys and shard
//! framing, configuration loading, telemetry, and the serving runtime (gRPC with
//! health and reflection, the admin HTTP listener, graceful shutdown).
//!
//! Nothing here knows about either engine; the daemons bring those.

pub mod admin;
pub mod block;
pub mod config;
pub mod daemon;
pub mod grpc;
pub mod http;
pub mod layers;
pub mod liveness;
pub mod metric;
pub mod process;
pub mod proto;
pub mod readiness;
pub mod reason;
pub mod request_id;
pub mod shard;
pub mod shutdown;
pub mod spec;
pub mod telemetry;
pub mod tls;
pub mod traces;

/// An error with its causes, `outer: inner: …` (tonic's transport errors say
/// just "transport error"; the reason, a refused TLS handshake say, is in the
/// source chain).
pub fn error_chain(error: &dyn std::error::Error) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
