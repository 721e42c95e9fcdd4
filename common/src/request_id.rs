//! Request ids unique within a process and across restarts.

use std::sync::atomic::{AtomicU64, Ordering};

/// `"<prefix>-<unix nanos hex>-<counter>"`.
pub fn new(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{prefix}-{nanos:x}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}
