//! Whether a running engine still answers. A frozen engine (stopped, wedged)
//! keeps its processes and its sockets, so supervision alone would call it
//! up: a cheap probe every `engine.liveness.interval`, each given
//! `engine.liveness.timeout`, tells. `engine.liveness.failures` unanswered in
//! a row make the engine stalled, one answer alive again. The probe must be
//! one the engine answers while it computes (vLLM's HTTP server, the
//! adapter's connection threads), so a long prefill or generation is never a
//! stall.

use std::{convert::Infallible, future::Future, time::Duration};

use serde::Deserialize;

use crate::{
    config::{ConfigError, Validate},
    metric,
};

/// `[engine.liveness]` of either daemon.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LivenessConfig {
    /// Pause between one probe's end and the next probe.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Longest wait for one answer.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
    /// Unanswered probes in a row that make the engine stalled.
    pub failures: u32,
}

impl Default for LivenessConfig {
    /// A frozen engine is reported within about 3 × (2 s + 5 s); a busy one
    /// still answers in milliseconds.
    fn default() -> Self {
        LivenessConfig { interval: Duration::from_secs(2), timeout: Duration::from_secs(5), failures: 3 }
    }
}

impl Validate for LivenessConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        if self.interval.is_zero() {
            return Err(ConfigError::invalid("engine.liveness.interval", "must be greater than zero"));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::invalid("engine.liveness.timeout", "must be greater than zero"));
        }
        if self.failures == 0 {
            return Err(ConfigError::invalid("engine.liveness.failures", "must be at least 1"));
        }
        Ok(())
    }
}

/// Unanswered probes in a row against the limit: the decision of [`watch`].
#[derive(Debug)]
pub struct Stall {
    limit: u32,
    missed: u32,
}

impl Stall {
    /// Alive: it starts once the engine has said it is ready.
    pub fn new(limit: u32) -> Self {
        Stall { limit: limit.max(1), missed: 0 }
    }

    pub fn alive(&self) -> bool {
        self.missed < self.limit
    }

    /// Counts one probe; the engine's liveness when this probe changed it.
    pub fn record(&mut self, answered: bool) -> Option<bool> {
        let was = self.alive();
        self.missed = if answered { 0 } else { self.missed.saturating_add(1) };
        (self.alive() != was).then_some(self.alive())
    }
}

/// Sets `pdbridge_engine_alive{engine}`: 1 while the engine is up and answers.
pub fn mark(engine: &'static str, alive: bool) {
    metrics::gauge!(metric::ENGINE_ALIVE.name, "engine" => engine).set(if alive { 1.0 } else { 0.0 });
}

/// Probes a ready engine until dropped (it never returns), calling
/// `on_change` whenever its liveness changes and keeping
/// `pdbridge_engine_alive` in step.
pub async fn watch<F, Fut, T, E>(
    engine: &'static str,
    config: &LivenessConfig,
    mut probe: F,
    mut on_change: impl FnMut(bool),
) -> Infallible
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    E: std::fmt::Display,
{
    let mut stall = Stall::new(config.failures);
    mark(engine, true);
    loop {
        tokio::time::sleep(config.interval).await;
        let problem = match tokio::time::timeout(config.timeout, probe()).await {
            Ok(Ok(_)) => None,
            Ok(Err(e)) => Some(e.to_string()),
            Err(_) => Some(format!("no answer within {:?}", config.timeout)),
        };
        let was_alive = stall.alive();
        match (stall.record(problem.is_none()), problem) {
            (Some(alive), problem) => {
                match problem {
                    Some(problem) => tracing::error!(engine, problem, "engine stopped answering: not ready"),
                    None => tracing::info!(engine, "engine answers again: ready"),
                }
                mark(engine, alive);
                on_change(alive);
            }
            // Each miss before the stall; not every one after it.
            (None, Some(problem)) if was_alive => tracing::warn!(engine, problem, "engine liveness probe unanswered"),
            (None, _) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    };

    use super::*;

    #[test]
    fn failures_in_a_row_stall_and_one_answer_revives() {
        let mut stall = Stall::new(3);
        assert!(stall.alive());
        assert_eq!([stall.record(false), stall.record(false)], [None, None]);
        // An answer in between starts the count again.
        assert_eq!(stall.record(true), None);
        assert_eq!([stall.record(false), stall.record(false)], [None, None]);
        assert_eq!(stall.record(false), Some(false));
        assert!(!stall.alive());
        assert_eq!(stall.record(false), None, "still stalled, no new change");
        assert_eq!(stall.record(true), Some(true));
        assert_eq!(stall.record(true), None);
        // One failure is a stall when the limit is one (and a limit of 0 is one).
        let mut strict = Stall::new(0);
        assert_eq!(strict.record(false), Some(false));
    }

    #[test]
    fn the_defaults_validate_and_zeros_name_their_key() {
        assert!(LivenessConfig::default().validate().is_ok());
        let zero = |config: LivenessConfig| config.validate().unwrap_err().to_string();
        let interval = LivenessConfig { interval: Duration::ZERO, ..Default::default() };
        assert!(zero(interval).contains("engine.liveness.interval"));
        let timeout = LivenessConfig { timeout: Duration::ZERO, ..Default::default() };
        assert!(zero(timeout).contains("engine.liveness.timeout"));
        let failures = LivenessConfig { failures: 0, ..Default::default() };
        assert!(zero(failures).contains("engine.liveness.failures"));
    }

    /// A probe that hangs counts as unanswered (its timeout), and the watch
    /// reports the stall and the recovery once each.
    #[tokio::test]
    async fn a_hanging_probe_is_a_stall_until_it_answers_again() {
        let config =
            LivenessConfig { interval: Duration::from_millis(5), timeout: Duration::from_millis(20), failures: 2 };
        let frozen = Arc::new(AtomicBool::new(false));
        let (changes_tx, mut changes) = tokio::sync::mpsc::unbounded_channel();
        let probe = {
            let frozen = frozen.clone();
            move || {
                let frozen = frozen.load(Ordering::SeqCst);
                async move {
                    if frozen {
                        std::future::pending::<()>().await;
                    }
                    Ok::<(), String>(())
                }
            }
        };
        let watching = tokio::spawn(async move {
            watch("test", &config, probe, |alive| changes_tx.send(alive).unwrap()).await;
        });
        frozen.store(true, Ordering::SeqCst);
        assert_eq!(changes.recv().await, Some(false));
        frozen.store(false, Ordering::SeqCst);
        assert_eq!(changes.recv().await, Some(true));
        assert!(changes.try_recv().is_err(), "one change each way");
        watching.abort();
    }
}
