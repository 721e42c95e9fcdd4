//! `pdbridge`: the operator's CLI for a pd-bridge deployment.
//!
//! - `doctor` checks a deployment end to end and prints one PASS/FAIL line per
//!   check; the exit status is 0 only when every check passed.
//! - `warm` pre-warms a decoder with a document through the bridge, showing
//!   progress as the blocks land.
//! - `certs` creates the deployment's private CA and a certificate per daemon.

mod certs;
mod doctor;
mod warm;

use std::{path::PathBuf, process::ExitCode};

use pdbridge_common::tls::{self, Tls, TlsConfig};

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
    /// Create a private CA and a certificate per daemon identity (reusing the CA in --out).
    Certs(certs::CertsArgs),
}

/// How the CLI talks to the daemons' gRPC listeners when they use mutual TLS:
/// with a certificate of the deployment's CA (on a decoder host, the
/// decoder's own: prefilld lets decoders start a prefill).
#[derive(Debug, Clone, Args)]
pub struct TlsArgs {
    /// The deployment's CA certificate (PEM); with --cert and --key, dial over mutual TLS.
    #[arg(long, requires_all = ["cert", "key"])]
    ca: Option<PathBuf>,
    /// Certificate (PEM) to present.
    #[arg(long, requires = "ca")]
    cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires = "ca")]
    key: Option<PathBuf>,
    /// The identity decoded's certificate must hold (default: the host of --decoded).
    #[arg(long)]
    decoded_name: Option<String>,
    /// The identity prefilld's certificate must hold (default: the host of --prefilld).
    #[arg(long)]
    prefilld_name: Option<String>,
}

impl TlsArgs {
    fn load(&self) -> Result<Option<Tls>, String> {
        let (Some(ca), Some(cert), Some(key)) = (&self.ca, &self.cert, &self.key) else { return Ok(None) };
        let config = TlsConfig { cert: cert.clone(), key: key.clone(), ca: ca.clone(), peers: Vec::new() };
        Tls::load(&config).map(Some).map_err(|e| e.to_string())
    }
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
    /// Which of prefilld's `[[decoders]]` the test bridge pushes to (default: its first).
    #[arg(long, default_value = "")]
    decoder_addr: String,
    #[command(flatten)]
    tls: TlsArgs,
}

pub async fn run(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Doctor(endpoints) => doctor::run(&endpoints).await,
        Command::Warm(args) => warm::run(&args).await,
        Command::Certs(args) => certs::run(&args),
    }
}

/// An outcome's reason as the verdict and metrics name it.
fn reason_label(outcome: &pdbridge_common::proto::Outcome) -> &'static str {
    pdbridge_common::reason::Reason::from_proto(outcome.reason()).map_or("none", |r| r.label())
}

/// A gRPC channel that fails fast when nothing listens; over mutual TLS
/// (expecting the server to hold `identity`) when `tls` is given.
async fn connect(addr: &str, tls: Option<&Tls>, identity: Option<&str>) -> Result<tonic::transport::Channel, String> {
    let endpoint = tls::endpoint(addr, tls, identity)?;
    endpoint
        .connect_timeout(std::time::Duration::from_secs(3))
        .connect()
        .await
        .map_err(|e| format!("cannot connect: {}", pdbridge_common::error_chain(&e)))
}
