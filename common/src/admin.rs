//! The admin HTTP listener: `/metrics` (Prometheus text), `/healthz` (the
//! process is alive) and `/readyz` (its engine is ready).

use std::future::Future;

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;

use crate::readiness::Readiness;

#[derive(Clone)]
struct AdminState {
    metrics: PrometheusHandle,
    readiness: Readiness,
}

pub fn router(metrics: PrometheusHandle, readiness: Readiness) -> Router {
    Router::new()
        .route("/metrics", get(render_metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(ready))
        .with_state(AdminState { metrics, readiness })
}

async fn render_metrics(State(state): State<AdminState>) -> impl IntoResponse {
    state.metrics.run_upkeep();
    ([("content-type", "text/plain; version=0.0.4")], state.metrics.render())
}

async fn ready(State(state): State<AdminState>) -> impl IntoResponse {
    if state.readiness.is_ready() {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "engine not ready\n")
    }
}

/// Serves the admin router on an already-bound listener until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router).with_graceful_shutdown(shutdown).await
}
