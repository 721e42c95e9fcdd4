//! prefilld: the prefill side of pd-bridge. It hosts the prefill engine (vLLM),
//! reconstructs the decoder's own cache from the prefill's attention inputs,
//! and streams it into a decoder's `CacheStore`.

pub mod capture;
pub mod config;
pub mod engine;
pub mod handshake;
pub mod node;
pub mod prefill;
pub mod service;
pub mod stage_listener;

use pdbridge_common::{
    config::{LogFormat, TelemetryConfig},
    daemon::{self, Daemon, Rpc, Shutdown},
    metric,
    proto::prefiller_server::PrefillerServer,
    readiness::Readiness,
    telemetry,
    tls::Tls,
};
use std::sync::Arc;

use capture::Router;
use handshake::{Decoders, DialConfig};
use prefill::Bridge;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::Config;

/// The admin listener's port on loopback when `server.admin_listen` is not set.
pub const ADMIN_PORT: u16 = 9471;

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

    fn observability(config: &Config) -> (LogFormat, &TelemetryConfig) {
        (config.log.format, &config.telemetry)
    }

    async fn bind(config: &Config) -> std::io::Result<Listeners> {
        Ok(Listeners {
            grpc: daemon::bind("server.grpc_listen", config.server.grpc_listen).await?,
            admin: daemon::bind("server.admin_listen", config.server.admin_addr(ADMIN_PORT)).await?,
        })
    }

    async fn serve(listeners: Listeners, config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
        serve(listeners, config, shutdown).await
    }
}

/// Runs prefilld on already-bound listeners until `shutdown` resolves.
pub async fn serve(listeners: Listeners, config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    telemetry::record_build_info(Prefilld::NAME);
    register_metrics();
    telemetry::record_insecure(&config.insecure_listeners());
    let tls = config.tls.as_ref().map(Tls::load).transpose()?;
    telemetry::record_certificate(tls.as_ref());
    let stop = daemon::cancel_on(shutdown);
    let readiness = Readiness::new();
    let default_decoder = config.decoders.first().map(|d| d.addr.clone());
    // vLLM and the plugin socket outlive the drain: in-flight prefills need them.
    let engine_stop = CancellationToken::new();
    let mut engine_task = None;
    let bridge = match config.engine.clone() {
        Some(engine) => {
            let router = Router::new(engine.plugin_socket.clone());
            tokio::spawn({
                let (router, stop) = (router.clone(), engine_stop.clone());
                async move {
                    if let Err(e) = router.serve(stop).await {
                        tracing::error!(error = %e, "plugin socket failed");
                    }
                }
            });
            if let (Some(nodes), Some(tls)) = (&engine.nodes, &tls) {
                let listener = stage_listener::StageListener::bind(nodes, tls, engine.bundle_dir.clone()).await?;
                tracing::info!(stage_listen = %listener.local_addr()?, "stage listener for the other boxes' stages");
                tokio::spawn(listener.serve(router.clone(), engine_stop.clone()));
            }
            let bundle_dir = engine.bundle_dir.clone();
            let (vllm, task) = engine::supervise(engine, config.telemetry.clone(), engine_stop.clone())?;
            engine_task = Some(task);
            let dial = DialConfig {
                bundle_dir,
                http2: config.server.http2.clone(),
                connections: config.stream.connections,
                tls: tls.clone(),
                limits: config.handshake.clone(),
                decoders: config.decoders.clone(),
            };
            let decoders = Decoders::new(vllm.profile.clone(), dial);
            let link = prefill::Link::new(config.stream.link_gbps);
            let bridge = Arc::new(Bridge { vllm, decoders, router, stream: config.stream.clone(), link });
            tokio::spawn(track_readiness(bridge.clone(), default_decoder.clone(), readiness.clone(), stop.clone()));
            Some(bridge)
        }
        None => {
            tracing::warn!("no [engine] configured: prefilld will never be ready");
            None
        }
    };
    let addrs = config.decoders.iter().map(|d| d.addr.clone()).collect();
    let prefiller = PrefillerServer::new(service::PrefillerService::new(bridge, addrs))
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
        tls,
        access: service::ACCESS,
    };
    daemon::serve_rpc(rpc, &config.server, &readiness, SERVICES, stop).await?;
    engine_stop.cancel();
    if let Some(task) = engine_task {
        let _ = task.await;
    }
    Ok(())
}

/// How often the default decoder's spec is re-checked while ready.
const DECODER_RECHECK: std::time::Duration = std::time::Duration::from_secs(10);
/// How soon a decoder that was not usable is tried again (a restarted decoder
/// is met again within this, not after a full recheck period).
const DECODER_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// Ready means: vLLM is up and answers its liveness probe, and the default
/// decoder (if any) has been met and still publishes the spec prefilld checked.
async fn track_readiness(bridge: Arc<Bridge>, decoder: Option<String>, readiness: Readiness, stop: CancellationToken) {
    let (mut engine, mut stalled) = (bridge.vllm.ready_changes(), bridge.vllm.stalled_changes());
    loop {
        let engine_ready = engine.borrow_and_update().is_some() && !*stalled.borrow_and_update();
        let decoder_ok = match (&decoder, engine_ready) {
            (_, false) => false,
            (None, true) => true,
            (Some(addr), true) => match bridge.decoders.recheck(addr).await {
                Ok(()) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "default decoder not usable");
                    false
                }
            },
        };
        readiness.set(engine_ready && decoder_ok);
        let next = if decoder_ok { DECODER_RECHECK } else { DECODER_RETRY };
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = engine.changed() => {}
            _ = stalled.changed() => {}
            _ = tokio::time::sleep(next) => {}
        }
    }
}

/// prefilld's metrics, registered at zero (see `telemetry::register_common`).
fn register_metrics() {
    telemetry::register_common("vllm", SERVICES[0], metric::PREFILLD);
    metrics::gauge!(metric::PREFILL_IN_FLIGHT.name).set(0.0);
    for outcome in ["admitted", "refused"] {
        metrics::counter!(metric::STAGE_CONNECTIONS.name, "outcome" => outcome).absolute(0);
    }
    for counter in [metric::STREAM_BYTES, metric::STREAM_BLOCKS] {
        metrics::counter!(counter.name).absolute(0);
    }
}
