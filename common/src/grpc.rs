//! The gRPC side every daemon shares: a server tuned for large streams, health
//! that mirrors engine readiness, and reflection over `bridge.proto` and
//! `grpc.health.v1`.

use tokio::net::TcpListener;
use tonic::transport::{Server, server::TcpIncoming};
use tonic_health::ServingStatus;

use crate::{config::Http2Config, readiness::Readiness};

/// A server builder with the HTTP/2 windows and frame size of `http2`.
pub fn server(http2: &Http2Config) -> Server {
    Server::builder()
        .initial_stream_window_size(http2.stream_window_bytes)
        .initial_connection_window_size(http2.connection_window_bytes)
        .max_frame_size(http2.max_frame_bytes)
        .tcp_nodelay(true)
}

/// Accepted sockets get `TCP_NODELAY`: shards are latency-sensitive and already
/// large, so Nagle would only add delay.
pub fn incoming(listener: TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}

/// The `grpc.health.v1` service, kept in step with `readiness`: every service
/// in `services` (and the empty name, for the whole server) is SERVING exactly
/// while the engine is ready.
pub fn health(
    readiness: &Readiness,
    services: &'static [&'static str],
) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (reporter, service) = tonic_health::server::health_reporter();
    let mut ready = readiness.subscribe();
    tokio::spawn(async move {
        loop {
            let status = if *ready.borrow_and_update() { ServingStatus::Serving } else { ServingStatus::NotServing };
            for name in std::iter::once("").chain(services.iter().copied()) {
                reporter.set_service_status(name, status).await;
            }
            if ready.changed().await.is_err() {
                break;
            }
        }
    });
    service
}

/// Server reflection (v1 and v1alpha, for older grpcurl) over both services.
pub fn reflection() -> (
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    tonic_reflection::server::v1alpha::ServerReflectionServer<impl tonic_reflection::server::v1alpha::ServerReflection>,
) {
    let builder = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    (
        builder().build_v1().expect("descriptor sets are compiled in"),
        builder().build_v1alpha().expect("descriptor sets are compiled in"),
    )
}
