//! Whether a daemon's engine is ready to serve, observed by gRPC health and by
//! the admin `/readyz` endpoint so the two can never disagree.

use tokio::sync::watch;

/// A cloneable switch the engine supervisor flips; everyone else watches it.
#[derive(Clone, Debug)]
pub struct Readiness {
    tx: watch::Sender<bool>,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    /// Starts not ready: nothing serves before its engine says so.
    pub fn new() -> Self {
        Self { tx: watch::Sender::new(false) }
    }

    pub fn set(&self, ready: bool) {
        self.tx.send_if_modified(|now| std::mem::replace(now, ready) != ready);
    }

    pub fn is_ready(&self) -> bool {
        *self.tx.borrow()
    }

    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }
}
