//! The daemons on loopback without an engine (`fixed_spec_config`: the store
//! and `CacheStore` work, the front door answers 503): foundation, security,
//! Push and the deployment files. Seconds each; the fast tier runs them.

mod foundation;
mod ops;
mod push;
mod rpc_metrics;
mod security;
