//! The daemons on the real engines (vLLM for prefill, mlx-lm for decode): one
//! at a time (the `engines` test group), minutes in all; the engines tier.

mod answers;
mod bridge;
mod exact;
mod families;
mod load;
mod ops;
mod topology;
