//! Supervising an engine child process: restart it with the same parameters
//! whenever it exits, until shutdown; stop it with SIGTERM, then SIGKILL.

use std::{future::Future, time::Duration};

use tokio::process::Child;
use tokio_util::sync::CancellationToken;

use crate::metric;

/// Runs `run_once` (start the child, wait for it to be ready, serve until it
/// exits) again and again until `stop`, pausing `backoff` between runs.
/// `on_down` runs after every run, so readiness never outlives the child.
pub async fn supervise<F, Fut, E>(
    engine: &'static str,
    backoff: Duration,
    stop: CancellationToken,
    mut run_once: F,
    on_down: impl Fn(),
) where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    loop {
        let outcome = run_once().await;
        on_down();
        metrics::gauge!(metric::ENGINE_UP.name, "engine" => engine).set(0.0);
        crate::liveness::mark(engine, false);
        if stop.is_cancelled() {
            tracing::info!(engine, "engine stopped");
            return;
        }
        metrics::counter!(metric::ENGINE_RESTARTS.name, "engine" => engine).increment(1);
        match outcome {
            Ok(()) => tracing::error!(engine, "engine exited; restarting"),
            Err(e) => tracing::error!(engine, error = %e, "engine failed; restarting"),
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
    }
}

/// Runs the child in a process group of its own, so that [`terminate`]
/// reaches every process the engine starts (vLLM forks an engine core and
/// workers), and makes the child receive SIGTERM when this process dies,
/// however it dies (Linux; elsewhere only the process group applies).
pub fn contain(cmd: &mut tokio::process::Command) {
    cmd.process_group(0);
    #[cfg(target_os = "linux")]
    // SAFETY: prctl(2) is async-signal-safe and touches only the child's own state.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Marks the engine up in metrics (the supervisor marks it down).
pub fn mark_up(engine: &'static str) {
    metrics::gauge!(metric::ENGINE_UP.name, "engine" => engine).set(1.0);
}

/// SIGKILL to whatever is left of our child's process group (`leader` is
/// the child's pid, read while it was running): after a crash too, an
/// engine's workers must not outlive their leader and hold memory beside its
/// replacement.
pub fn kill_group(leader: Option<u32>) {
    if let Some(pid) = leader {
        // SAFETY: kill(2) on the process group we created for our own child.
        unsafe { libc::kill(-(pid as i32), libc::SIGKILL) };
    }
}

/// SIGTERM to the child's process group, up to `grace` for a clean exit,
/// then SIGKILL to whatever is left of the group.
pub async fn terminate(child: &mut Child, grace: Duration) -> std::io::Result<()> {
    let Some(pid) = child.id() else { return Ok(()) };
    let group = -(pid as i32);
    // SAFETY: kill(2) on the process group we created for our own child.
    unsafe { libc::kill(group, libc::SIGTERM) };
    let exited = tokio::time::timeout(grace, child.wait()).await.is_ok();
    // Processes of the group may outlive its leader.
    kill_group(Some(pid));
    if !exited {
        child.wait().await?;
    }
    Ok(())
}
