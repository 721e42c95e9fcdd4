//! `prefilld node --config FILE --rank N`: vLLM's workers on another box of
//! `[engine.nodes]`, which join the head's vLLM (its pipeline stages or
//! tensor-parallel ranks on this box).
//!
//! The box runs no daemon of its own: this command builds the same vLLM
//! command line prefilld builds on the head (from the same `[engine]`), adds
//! the node's rank, and tells the plugin in those workers to stream to the
//! head's stage listener over mutual TLS with this box's `[tls]` certificate.
//! It runs vLLM as its child and ends with it (a service manager restarts
//! both); a stop signal stops vLLM's whole process group.

use std::{ffi::OsString, path::PathBuf, process::ExitCode};

use clap::Parser;
use pdbridge_common::{
    config::{self, Sources},
    process,
};

use crate::{
    config::Config,
    engine::{self, ModelProfile, Role},
};

/// How long vLLM's workers get to stop after SIGTERM.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(30);

/// `prefilld node`'s flags.
#[derive(Debug, Parser)]
#[command(name = "prefilld node", about = "Runs vLLM's workers on another box of [engine.nodes]")]
pub struct NodeArgs {
    /// The same TOML as the head's prefilld (this box's own `[tls]`).
    #[arg(long, short = 'c', value_name = "FILE")]
    pub config: PathBuf,
    /// This box's node rank: 1 .. engine.nodes.count - 1.
    #[arg(long)]
    pub rank: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error("{0}")]
    Unfit(String),
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
}

/// Whether the command line asks for `prefilld node`.
pub fn requested(args: &[OsString]) -> bool {
    args.get(1).is_some_and(|arg| arg == "node")
}

/// The whole life of `prefilld node`.
pub async fn main(args: Vec<OsString>) -> ExitCode {
    let args = NodeArgs::parse_from(args.into_iter().skip(1));
    let mut command = match node_command(&args) {
        Ok(command) => command,
        Err(e) => {
            eprintln!("prefilld node: {e}");
            return ExitCode::from(2);
        }
    };
    let stop = match pdbridge_common::shutdown::signal() {
        Ok(stop) => stop,
        Err(e) => {
            eprintln!("prefilld node: cannot install signal handlers: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("prefilld node: cannot start vLLM: {e}");
            return ExitCode::FAILURE;
        }
    };
    tokio::select! {
        status = child.wait() => {
            eprintln!("prefilld node: vLLM exited: {status:?}");
            ExitCode::FAILURE
        }
        () = stop => {
            let _ = process::terminate(&mut child, STOP_GRACE).await;
            ExitCode::SUCCESS
        }
    }
}

/// vLLM's headless command line for node `rank`, with the plugin's link to the head.
pub fn node_command(args: &NodeArgs) -> Result<tokio::process::Command, NodeError> {
    let config: Config = config::load(Sources::from_process(Some(args.config.clone())))?;
    let unfit = |why: &str| NodeError::Unfit(format!("{}: {why}", args.config.display()));
    let engine = config.engine.as_ref().ok_or_else(|| unfit("no [engine]"))?;
    let nodes = engine.nodes.as_ref().ok_or_else(|| unfit("no [engine.nodes]"))?;
    let tls = config.tls.as_ref().ok_or_else(|| unfit("no [tls]"))?;
    if !(1..nodes.count).contains(&args.rank) {
        return Err(unfit(&format!("--rank {} is not in 1..{}: rank 0 is the head", args.rank, nodes.count)));
    }
    let profile = ModelProfile::read(&engine.model)?;
    let mut command = engine::command(engine, &profile, 0, Role::Node(args.rank));
    engine::trace_to(&mut command, &config.telemetry);
    let absolute = |path: &PathBuf| std::path::absolute(path).unwrap_or_else(|_| path.clone());
    command
        .env("PDBRIDGE_STAGE_LINK", nodes.stage_addr())
        .env("PDBRIDGE_STAGE_SERVER", &nodes.head_identity)
        .env("PDBRIDGE_TLS_CERT", absolute(&tls.cert))
        .env("PDBRIDGE_TLS_KEY", absolute(&tls.key))
        .env("PDBRIDGE_TLS_CA", absolute(&tls.ca))
        .env("PDBRIDGE_BUNDLE_DIR", absolute(&engine.bundle_dir));
    Ok(command)
}
