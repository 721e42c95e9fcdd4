//! prefilld: the prefill side of pd-bridge. It hosts the prefill engine (vLLM),
//! reconstructs the decoder's own cache from the prefill's attention inputs,
//! and streams it into a decoder's `CacheStore`.

pub mod config;
pub mod service;

use pdbridge_common::{
    config::LogFormat,
    daemon::{self, Daemon, Rpc, Shutdown},
    proto::prefiller_server::PrefillerServer,
    readiness::Readiness,
    telemetry,
};
use tokio::net::TcpListener;

pub use config::Config;

/// Listeners bound by the caller of [`serve`] (tests bind `127.0.0.1:0`).
pub struct Listeners {
    pub grpc: TcpListener,
    pub admin: TcpListener,
}

/// gRPC services whose health tracks the prefill engine.
const SERVICES: &[&str] = &["pdbridge.v1.Prefiller"];

pub struct Prefilld;

impl Daemon for Prefilld {
    const NAME: &'static str = "prefilld";
    type Config = Config;
    type Listeners = Listeners;

    fn log_format(config: &Config) -> LogFormat {
        config.log.format
    }

    async fn bind(config: &Config) -> std::io::Result<Listeners> {
        Ok(Listeners {
            grpc: daemon::bind("server.grpc_listen", config.server.grpc_listen).await?,
            admin: daemon::bind("server.admin_listen", config.server.admin_listen).await?,
        })
    }

    async fn serve(listeners: Listeners, config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
        serve(listeners, config, shutdown).await
    }
}

/// Runs prefilld on already-bound listeners until `shutdown` resolves.
pub async fn serve(listeners: Listeners, config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    telemetry::record_build_info(Prefilld::NAME);
    let stop = daemon::cancel_on(shutdown);
    let readiness = Readiness::new();
    let prefiller = PrefillerServer::new(service::PrefillerService::new(readiness.clone()))
        .max_decoding_message_size(config.server.http2.max_message_bytes)
        .max_encoding_message_size(config.server.http2.max_message_bytes);
    tracing::info!(
        grpc = %listeners.grpc.local_addr()?,
        admin = %listeners.admin.local_addr()?,
        "prefilld listening"
    );
    let rpc = Rpc {
        grpc: listeners.grpc,
        admin: listeners.admin,
        routes: tonic::service::Routes::new(prefiller),
        admin_routes: axum::Router::new(),
    };
    daemon::serve_rpc(rpc, &config.server, &readiness, SERVICES, stop).await?;
    Ok(())
}
