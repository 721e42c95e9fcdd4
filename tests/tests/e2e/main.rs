//! One test binary for every end-to-end concern; each module starts the real
//! daemon binaries on loopback.

mod bridge;
mod exact;
mod families;
mod foundation;
mod load;
mod ops;
mod push;
mod security;
mod topology;
