//! The gRPC side every daemon shares: a server tuned for large streams, health
//! that mirrors engine readiness, and reflection over `bridge.proto` and
//! `grpc.health.v1`.

use tokio::net::TcpListener;
use tonic::transport::{Server, server::TcpIncoming};
use tonic_health::{
    ServingStatus,
    server::{HealthReporter, HealthService},
};

use crate::{config::Http2Config, readiness::Readiness};

/// A server builder with the HTTP/2 windows and frame size of `http2`.
pub fn server(http2: &Http2Config) -> Server {
    Server::builder()
        .initial_stream_window_size(http2.stream_window_bytes)
        .initial_connection_window_size(http2.connection_window_bytes)
        .max_frame_size(http2.max_frame_bytes)
        .max_concurrent_streams(http2.max_concurrent_streams)
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
pub async fn health(
    readiness: &Readiness,
    services: &'static [&'static str],
) -> tonic_health::pb::health_server::HealthServer<HealthService> {
    tonic_health::pb::health_server::HealthServer::new(health_service(readiness, services).await)
}

/// `tonic_health`'s reporter starts the empty name as SERVING, so the first
/// status is written here, before the service exists, not by the task that
/// follows readiness: a check can never see SERVING ahead of the engine.
async fn health_service(readiness: &Readiness, services: &'static [&'static str]) -> HealthService {
    let reporter = HealthReporter::new();
    let publish = move |reporter: HealthReporter, ready: bool| async move {
        let status = if ready { ServingStatus::Serving } else { ServingStatus::NotServing };
        for name in std::iter::once("").chain(services.iter().copied()) {
            reporter.set_service_status(name, status).await;
        }
    };
    let mut ready = readiness.subscribe();
    let now = *ready.borrow_and_update();
    publish(reporter.clone(), now).await;
    let service = HealthService::from_health_reporter(reporter.clone());
    tokio::spawn(async move {
        while ready.changed().await.is_ok() {
            let now = *ready.borrow_and_update();
            publish(reporter.clone(), now).await;
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

#[cfg(test)]
mod tests {
    use tokio_stream::StreamExt;
    use tonic_health::pb::{
        HealthCheckRequest,
        health_check_response::ServingStatus::{self as Status, NotServing, Serving},
        health_server::Health,
    };

    use super::*;

    const NAMES: [&str; 2] = ["", "pdbridge.v1.Test"];

    fn request(name: &str) -> tonic::Request<HealthCheckRequest> {
        tonic::Request::new(HealthCheckRequest { service: name.into() })
    }

    async fn status(service: &HealthService, name: &str) -> Status {
        service.check(request(name)).await.expect("known service").into_inner().status()
    }

    /// On a current-thread runtime nothing spawned runs until the test yields,
    /// so a status that only the follower task sets would be seen wrong here.
    #[tokio::test]
    async fn health_follows_readiness_from_its_first_answer() {
        let readiness = Readiness::new();
        let service = health_service(&readiness, &["pdbridge.v1.Test"]).await;
        for name in NAMES {
            assert_eq!(status(&service, name).await, NotServing, "{name:?} before the engine is ready");
        }
        readiness.set(true);
        for name in NAMES {
            let mut updates = service.watch(request(name)).await.unwrap().into_inner();
            while updates.next().await.unwrap().unwrap().status() != Serving {}
        }
        readiness.set(false);
        for name in NAMES {
            let mut updates = service.watch(request(name)).await.unwrap().into_inner();
            while updates.next().await.unwrap().unwrap().status() != NotServing {}
        }
    }
}
