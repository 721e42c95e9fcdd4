//! What every pd-bridge daemon does the same way: parse flags, load config
//! (exit 2 on a bad value), start logging and metrics, install signal handlers
//! *before* serving, bind, run, and drain on shutdown within a deadline.
//!
//! A daemon crate implements [`Daemon`]; its `main.rs` is one call to [`main`].

use std::{future::Future, path::PathBuf, pin::Pin, process::ExitCode};

use clap::Parser;
use serde::de::DeserializeOwned;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::{
    admin,
    config::{self, LogFormat, ServerConfig, Sources, TelemetryConfig, Validate},
    grpc,
    layers::{
        access::{AccessLayer, Rules},
        grpc_metrics::GrpcMeter,
        metered::MeterLayer,
    },
    telemetry,
    tls::{Peers, Tls},
};

/// Flags both daemons accept. Each overrides the file and the environment.
#[derive(Debug, Parser)]
pub struct Args {
    /// TOML configuration file.
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// gRPC listen address (overrides `server.grpc_listen`).
    #[arg(long, value_name = "ADDR")]
    pub grpc_listen: Option<String>,
    /// Admin HTTP listen address (overrides `server.admin_listen`).
    #[arg(long, value_name = "ADDR")]
    pub admin_listen: Option<String>,
    /// Log format (overrides `log.format`).
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormat>,
    /// Any other key, as `section.key=value` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
}

impl Args {
    fn sources(&self) -> Result<Sources, config::ConfigError> {
        let mut sources = Sources::from_process(self.config.clone());
        for assignment in &self.set {
            let (key, value) = assignment
                .split_once('=')
                .ok_or_else(|| config::ConfigError::invalid(assignment, "--set expects KEY=VALUE"))?;
            sources = sources.set(key.trim(), value.trim());
        }
        if let Some(addr) = &self.grpc_listen {
            sources = sources.set("server.grpc_listen", addr);
        }
        if let Some(addr) = &self.admin_listen {
            sources = sources.set("server.admin_listen", addr);
        }
        if let Some(format) = self.log_format {
            let name = if format == LogFormat::Json { "json" } else { "human" };
            sources = sources.set("log.format", name);
        }
        Ok(sources)
    }
}

/// The shutdown signal a daemon's `serve` receives.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// One daemon: its config, its listeners and how it serves.
pub trait Daemon {
    /// Name in logs, metrics and `pdbridge_build_info`.
    const NAME: &'static str;
    type Config: DeserializeOwned + Validate;
    type Listeners;

    /// How it logs, and where its traces go.
    fn observability(config: &Self::Config) -> (LogFormat, &TelemetryConfig);
    fn bind(config: &Self::Config) -> impl Future<Output = std::io::Result<Self::Listeners>>;
    fn serve(
        listeners: Self::Listeners,
        config: Self::Config,
        shutdown: Shutdown,
    ) -> impl Future<Output = anyhow::Result<()>>;
}

/// The whole life of a daemon process.
pub async fn main<D: Daemon>() -> ExitCode {
    let args = Args::parse();
    let config = match args.sources().and_then(config::load::<D::Config>) {
        Ok(config) => config,
        Err(err) => {
            eprintln!("{}: {err}", D::NAME);
            return ExitCode::from(2);
        }
    };
    let (log_format, traces) = D::observability(&config);
    let traces = match telemetry::init(log_format, traces, D::NAME) {
        Ok(traces) => traces,
        Err(err) => {
            eprintln!("{}: {err}", D::NAME);
            return ExitCode::from(2);
        }
    };
    let shutdown = match crate::shutdown::signal() {
        Ok(signal) => signal,
        Err(err) => {
            tracing::error!(error = %err, "cannot install signal handlers");
            return ExitCode::FAILURE;
        }
    };
    let listeners = match D::bind(&config).await {
        Ok(listeners) => listeners,
        Err(err) => {
            tracing::error!(error = %err, "cannot bind listeners");
            return ExitCode::FAILURE;
        }
    };
    let served = D::serve(listeners, config, Box::pin(shutdown)).await;
    // The last spans (the drain's included) leave before the process does.
    traces.shutdown().await;
    match served {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!(error = format!("{err:#}"), "{} failed", D::NAME);
            ExitCode::FAILURE
        }
    }
}

/// Binds a listener, naming the config key when it fails.
pub async fn bind(key: &str, addr: std::net::SocketAddr) -> std::io::Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| std::io::Error::new(e.kind(), format!("{key} = {addr}: {e}")))
}

/// What a daemon hands the shared runtime.
pub struct Rpc {
    pub grpc: TcpListener,
    pub admin: TcpListener,
    /// The daemon's gRPC services (health and reflection are added here).
    pub routes: tonic::service::Routes,
    /// Extra admin routes merged beside `/metrics`, `/healthz` and `/readyz`.
    pub admin_routes: axum::Router,
    /// Serve gRPC over mutual TLS (`[tls]`); plain HTTP/2 when absent.
    pub tls: Option<crate::tls::Tls>,
    /// Who may call each of the daemon's RPCs (with `[tls]`; without it, anyone may).
    pub access: Rules,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("gRPC server: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("admin server: {0}")]
    Admin(#[from] std::io::Error),
    #[error("server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Serves gRPC (with health and reflection) and the admin listener until
/// `stop` is cancelled, then stops accepting and gives in-flight streams up to
/// `server.drain_timeout` to finish.
pub async fn serve_rpc(
    rpc: Rpc,
    server: &ServerConfig,
    readiness: &crate::readiness::Readiness,
    services: &'static [&'static str],
    stop: CancellationToken,
) -> Result<(), ServeError> {
    let (reflection_v1, reflection_v1alpha) = grpc::reflection();
    let routes = rpc
        .routes
        .add_service(grpc::health(readiness, services).await)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha);
    let mut builder = grpc::server(&server.http2);
    if let Some(tls) = &rpc.tls {
        builder = builder.tls_config(tls.server())?;
    }
    let peers = rpc.tls.as_ref().map_or_else(Peers::open, Tls::peers);
    // Metrics outermost: an RPC the access rules refuse is counted under the code it got.
    let layers = tower::ServiceBuilder::new().layer(MeterLayer(GrpcMeter)).layer(AccessLayer::new(peers, rpc.access));
    let mut grpc_task = tokio::spawn(
        builder
            .layer(layers)
            .add_routes(routes)
            .serve_with_incoming_shutdown(grpc::incoming(rpc.grpc), stop.clone().cancelled_owned()),
    );
    let admin_router = admin::router(telemetry::metrics_handle(), readiness.clone()).merge(rpc.admin_routes);
    let mut admin_task = tokio::spawn(admin::serve(rpc.admin, admin_router, stop.clone().cancelled_owned()));
    tokio::spawn(notify_service_manager(readiness.subscribe(), stop.clone()));

    // A listener that dies early takes the daemon down rather than leaving it
    // half-alive.
    // Biased: once shutdown is requested the listeners finish on purpose;
    // that must lead to the drain, not look like a listener dying.
    tokio::select! {
        biased;
        _ = stop.cancelled() => {}
        r = &mut grpc_task => { stop.cancel(); return flatten(r); }
        r = &mut admin_task => { stop.cancel(); return flatten(r); }
    }
    tracing::info!(deadline = ?server.drain_timeout, "draining");
    let drained = tokio::time::timeout(server.drain_timeout, async {
        let grpc = flatten(grpc_task.await);
        let admin = flatten(admin_task.await);
        (grpc, admin)
    })
    .await;
    match drained {
        Ok((grpc, admin)) => {
            grpc?;
            admin?;
            tracing::info!("drained");
        }
        Err(_) => tracing::warn!("drain deadline passed with streams still open; closing them"),
    }
    Ok(())
}

/// Tells systemd (`Type=notify`) when the daemon is first ready and when it
/// starts stopping; a no-op when not started by a service manager.
async fn notify_service_manager(mut ready: tokio::sync::watch::Receiver<bool>, stop: CancellationToken) {
    use sd_notify::NotifyState;
    let became_ready = async {
        while !*ready.borrow_and_update() {
            if ready.changed().await.is_err() {
                return false;
            }
        }
        true
    };
    // Biased: once shutdown is requested the listeners finish on purpose;
    // that must lead to the drain, not look like a listener dying.
    tokio::select! {
        biased;
        _ = stop.cancelled() => {}
        ready = became_ready => {
            if ready {
                let _ = sd_notify::notify(false, &[NotifyState::Ready]);
            }
            stop.cancelled().await;
        }
    }
    let _ = sd_notify::notify(false, &[NotifyState::Stopping]);
}

fn flatten<E: Into<ServeError>>(r: Result<Result<(), E>, tokio::task::JoinError>) -> Result<(), ServeError> {
    r?.map_err(Into::into)
}

/// Cancels `token` when `shutdown` resolves.
pub fn cancel_on(shutdown: Shutdown) -> CancellationToken {
    let token = CancellationToken::new();
    let trigger = token.clone();
    tokio::spawn(async move {
        shutdown.await;
        trigger.cancel();
    });
    token
}
