//! An emulated link rate for the Push streams (`stream.link_gbps`).

use std::time::Duration;

use tokio::time::Instant;

/// Paces sends to an emulated link rate: each send waits until the link
/// would have finished the bytes before it. Shared by every stream, like a
/// real link.
pub struct Link {
    bytes_per_second: f64,
    free_at: tokio::sync::Mutex<Instant>,
}

impl Link {
    /// None when `gbps` is 0 (no emulation).
    pub fn new(gbps: f64) -> Option<Link> {
        (gbps > 0.0)
            .then(|| Link { bytes_per_second: gbps * 1e9 / 8.0, free_at: tokio::sync::Mutex::new(Instant::now()) })
    }

    pub(super) async fn send(&self, bytes: usize) {
        let done = {
            let mut free_at = self.free_at.lock().await;
            let start = (*free_at).max(Instant::now());
            *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_second);
            *free_at
        };
        tokio::time::sleep_until(done).await;
    }
}
