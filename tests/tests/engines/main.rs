//! The daemons on the real engines (vLLM for prefill, mlx-lm for decode): in two
//! lanes of one test at a time (the `vllm` and `decoder` test groups), minutes in
//! all; the engines tier.

mod answers;
mod bridge;
mod exact;
mod families;
mod load;
mod ops;
mod topology;
