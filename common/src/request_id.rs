//! Request ids unique within a process and across restarts.

use std::sync::atomic::{AtomicU64, Ordering};

/// Longest request id a caller may choose.
pub const MAX_LEN: usize = 128;

/// `"<prefix>-<unix nanos hex>-<counter>"`.
pub fn new(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    format!("{prefix}-{nanos:x}-{}", NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Whether a caller's id is safe to log, pass to the engine and key on:
/// 1 to [`MAX_LEN`] of `[A-Za-z0-9._-]`.
pub fn is_valid(id: &str) -> bool {
    (1..=MAX_LEN).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_valid_and_distinct() {
        let (a, b) = (new("pf"), new("pf"));
        assert!(is_valid(&a) && is_valid(&b) && a != b, "{a} {b}");
        for bad in ["", "a b", "a\nb", "../x", &"x".repeat(MAX_LEN + 1)] {
            assert!(!is_valid(bad), "{bad:?}");
        }
    }
}
