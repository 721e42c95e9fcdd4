//! Process signals as a shutdown future.
//!
//! The handlers are registered when [`signal`] is *called*, not when the future
//! is first polled, so a daemon installs them before it announces readiness and
//! a SIGTERM that arrives during start-up is not lost.

use std::future::Future;

use tokio::signal::unix::{SignalKind, signal as unix_signal};

/// Resolves on the first SIGTERM or SIGINT.
pub fn signal() -> std::io::Result<impl Future<Output = ()> + Send + 'static> {
    let mut term = unix_signal(SignalKind::terminate())?;
    let mut int = unix_signal(SignalKind::interrupt())?;
    Ok(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        tracing::info!(signal = name, "shutdown requested");
    })
}
