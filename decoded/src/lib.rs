//! decoded: the decode side of pd-bridge. It owns the decoder's prefix store,
//! serves `CacheStore` to prefill daemons, and (with its engine) answers the
//! OpenAI-compatible front door.

pub mod api;
pub mod config;
pub mod engine;
pub mod front;
pub mod inflight;
pub mod ingest;
pub mod reconstruct;
pub mod service;
pub mod store;

use pdbridge_common::{
    config::{LogFormat, TelemetryConfig},
    daemon::{self, Daemon, Rpc, Shutdown},
    metric,
    proto::cache_store_server::CacheStoreServer,
    readiness::Readiness,
    telemetry,
    tls::Tls,
};
use std::sync::Arc;

use service::CacheStoreService;
use store::Store;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::Config;

/// The admin listener's port on loopback when `server.admin_listen` is not set.
pub const ADMIN_PORT: u16 = 9470;

/// Listeners bound by the caller of [`serve`] (tests bind `127.0.0.1:0`).
pub struct Listeners {
    pub grpc: TcpListener,
    pub admin: TcpListener,
    /// The OpenAI-compatible front door.
    pub front: TcpListener,
}

/// gRPC services whose health tracks the decode engine.
const SERVICES: &[&str] = &["pdbridge.v1.CacheStore"];

pub struct Decoded;

impl Daemon for Decoded {
    const NAME: &'static str = "decoded";
    type Config = Config;
    type Listeners = Listeners;

    fn observability(config: &Config) -> (LogFormat, &TelemetryConfig) {
        (config.log.format, &config.telemetry)
    }

    async fn bind(config: &Config) -> std::io::Result<Listeners> {
        Ok(Listeners {
            grpc: daemon::bind("server.grpc_listen", config.server.grpc_listen).await?,
            admin: daemon::bind("server.admin_listen", config.server.admin_addr(ADMIN_PORT)).await?,
            front: daemon::bind("front.listen", config.front.listen).await?,
        })
    }

    async fn serve(listeners: Listeners, config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
        serve(listeners, config, shutdown).await
    }
}

/// Runs decoded on already-bound listeners until `shutdown` resolves.
/// The decode engine as configured: the adapter under supervision, a fixed spec (ready at once), or
/// none (never ready); and the supervisor's task.
fn start_engine(
    config: &Config,
    readiness: &Readiness,
    stop: &CancellationToken,
) -> anyhow::Result<(Option<engine::Engine>, Option<tokio::task::JoinHandle<()>>)> {
    Ok(match (config.engine.clone(), &config.spec_file) {
        (Some(engine), _) => {
            let (engine, task) = engine::supervise(engine, config.store.block_tokens, readiness.clone(), stop.clone());
            (Some(engine), Some(task))
        }
        (None, Some(spec_file)) => {
            let engine = engine::Engine::fixed(spec_file, config.store.block_tokens)?;
            tracing::info!(spec_file = %spec_file.display(), "serving a fixed spec without a decode engine");
            readiness.set(true);
            (Some(engine), None)
        }
        (None, None) => {
            tracing::warn!("no [engine] configured: decoded will never be ready");
            (None, None)
        }
    })
}

/// The address prefilld pushes to when `front.advertise_addr` names none: the gRPC listener's,
/// loopback for an unspecified one.
fn advertised(grpc: std::net::SocketAddr, tls: bool) -> String {
    let ip = if grpc.ip().is_unspecified() { [127, 0, 0, 1].into() } else { grpc.ip() };
    let scheme = if tls { "https" } else { "http" };
    format!("{scheme}://{}", std::net::SocketAddr::new(ip, grpc.port()))
}

pub async fn serve(listeners: Listeners, config: Config, shutdown: Shutdown) -> anyhow::Result<()> {
    telemetry::record_build_info(Decoded::NAME);
    register_metrics();
    telemetry::record_insecure(&config.insecure_listeners());
    let tls = config.tls.as_ref().map(Tls::load).transpose()?;
    telemetry::record_certificate(tls.as_ref());
    let api_keys = config.front.load_api_keys()?;
    let stop = daemon::cancel_on(shutdown);
    let readiness = Readiness::new();
    let (store, report) = Store::open(&config.store.dir, config.store.budget_bytes)?;
    tracing::info!(
        dir = %config.store.dir.display(),
        blocks = report.blocks,
        bytes = report.bytes,
        quarantined = report.quarantined,
        "store opened"
    );
    metrics::counter!(metric::STORE_QUARANTINED.name).absolute(report.quarantined as u64);
    let store = Arc::new(store);
    // The engine outlives the drain: in-flight generations still need it.
    let engine_stop = CancellationToken::new();
    let (engine, engine_task) = start_engine(&config, &readiness, &engine_stop)?;
    let grpc_addr = listeners.grpc.local_addr()?;
    let advertise = config.front.advertise_addr.clone().unwrap_or_else(|| advertised(grpc_addr, tls.is_some()));
    let front = front::router(engine.clone(), store.clone(), config.front.clone(), advertise, tls.as_ref(), api_keys);
    let front_limits = pdbridge_common::http::Limits {
        header_read_timeout: config.front.header_read_timeout,
        max_connections_per_peer: config.front.max_connections_per_peer,
    };
    let store_for_admin = store.clone();
    let service = CacheStoreService::new(engine, store, &config.store);
    let cache_store = CacheStoreServer::new(service)
        .max_decoding_message_size(config.server.http2.max_message_bytes)
        .max_encoding_message_size(config.server.http2.max_message_bytes);
    tracing::info!(
        grpc = %grpc_addr,
        admin = %listeners.admin.local_addr()?,
        front = %listeners.front.local_addr()?,
        "decoded listening"
    );
    let front_task = tokio::spawn(pdbridge_common::http::serve(
        listeners.front,
        front,
        front_limits,
        stop.clone().cancelled_owned(),
    ));
    let rpc = Rpc {
        grpc: listeners.grpc,
        admin: listeners.admin,
        routes: tonic::service::Routes::new(cache_store),
        admin_routes: axum::Router::new().route("/store", axum::routing::get(store_status)).with_state(store_for_admin),
        tls,
        access: service::ACCESS,
    };
    daemon::serve_rpc(rpc, &config.server, &readiness, SERVICES, stop).await?;
    // The front door drains within the same deadline the gRPC side had.
    if tokio::time::timeout(config.server.drain_timeout, front_task).await.is_err() {
        tracing::warn!("front door still had requests at the drain deadline");
    }
    engine_stop.cancel();
    if let Some(task) = engine_task {
        let _ = task.await;
    }
    Ok(())
}

/// `GET /store` on the admin listener: usage (of what is on disk now), budget, writability, free
/// space.
async fn store_status(axum::extract::State(store): axum::extract::State<Arc<Store>>) -> axum::Json<serde_json::Value> {
    let (writable, free_bytes) = tokio::task::spawn_blocking({
        let store = store.clone();
        move || {
            store.forget_missing();
            store.probe()
        }
    })
    .await
    .unwrap_or((false, None));
    let (blocks, bytes) = store.usage();
    axum::Json(serde_json::json!({
        "blocks": blocks,
        "bytes": bytes,
        "budget_bytes": store.budget_bytes(),
        "writable": writable,
        "free_bytes": free_bytes,
    }))
}

/// decoded's metrics, registered at zero (see `telemetry::register_common`).
fn register_metrics() {
    telemetry::register_common("mlx", SERVICES[0], metric::DECODED);
    for gauge in [
        metric::FRONT_IN_FLIGHT,
        metric::PUSH_STREAMS_IN_FLIGHT,
        metric::STORE_LEASED_BLOCKS,
        metric::FRONT_CONNECTIONS_OPEN,
    ] {
        metrics::gauge!(gauge.name).set(0.0);
    }
    for counter in [
        metric::STORE_EVICTIONS,
        metric::STORE_QUARANTINED,
        metric::STORE_BLOCKS_COMMITTED,
        metric::PUSH_BYTES,
        metric::FRONT_UNAUTHORIZED,
    ] {
        metrics::counter!(counter.name).absolute(0);
    }
    for outcome in ["hit", "miss"] {
        metrics::counter!(metric::STORE_LOOKUPS.name, "outcome" => outcome).absolute(0);
    }
}
