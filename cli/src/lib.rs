//! `pdbridge`: the operator's CLI for a pd-bridge deployment.
//!
//! - `doctor` checks a deployment end to end and prints one PASS/FAIL line per
//!   check; the exit status is 0 only when every check passed.
//! - `warm` pre-warms a decoder with a document through the bridge, showing
//!   progress as the blocks land.

mod doctor;
mod warm;

use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "pdbridge", version, about)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Check both daemons, their engines, the decoder's spec and store, the clocks, and a test bridge.
    Doctor(Endpoints),
    /// Bridge a document into the decoder's store ahead of the requests that will use it.
    Warm(warm::WarmArgs),
}

/// Where the daemons are (defaults: the example configs on one host).
#[derive(Debug, Clone, Args)]
pub struct Endpoints {
    /// decoded's gRPC (CacheStore) address.
    #[arg(long, default_value = "http://127.0.0.1:7070")]
    decoded: String,
    /// decoded's admin HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:9470")]
    decoded_admin: String,
    /// prefilld's gRPC (Prefiller) address.
    #[arg(long, default_value = "http://127.0.0.1:7071")]
    prefilld: String,
    /// prefilld's admin HTTP address.
    #[arg(long, default_value = "http://127.0.0.1:9471")]
    prefilld_admin: String,
    /// How prefilld reaches decoded's CacheStore, when that differs from `--decoded`.
    #[arg(long)]
    decoder_addr: Option<String>,
}

impl Endpoints {
    fn decoder_addr(&self) -> &str {
        self.decoder_addr.as_deref().unwrap_or(&self.decoded)
    }
}

pub async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Doctor(endpoints) => doctor::run(&endpoints).await,
        Command::Warm(args) => warm::run(&args).await,
    }
}

/// A gRPC channel that fails fast when nothing listens.
async fn connect(addr: &str) -> Result<tonic::transport::Channel, String> {
    let endpoint = tonic::transport::Endpoint::from_shared(addr.to_owned()).map_err(|e| format!("bad address: {e}"))?;
    endpoint.connect_timeout(std::time::Duration::from_secs(3)).connect().await.map_err(|e| {
        format!("cannot connect: {}", std::error::Error::source(&e).map_or(e.to_string(), |s| s.to_string()))
    })
}
