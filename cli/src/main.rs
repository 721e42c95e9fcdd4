use std::process::ExitCode;

use clap::Parser;

#[tokio::main]
async fn main() -> ExitCode {
    pdbridge::run(pdbridge::Cli::parse()).await
}
