//! `pdbridge warm`: bridge a document into the decoder's store ahead of time.

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use pdbridge_common::proto::{
    PrefillRequest, outcome::Status as OutcomeStatus, prefill_event::Event, prefiller_client::PrefillerClient,
};
use serde_json::{Value, json};

use crate::{connect, reason_label};

#[derive(Debug, Args)]
pub struct WarmArgs {
    /// The document to pre-warm.
    #[arg(long)]
    file: PathBuf,
    /// Treat the document as a plain completion prompt instead of a chat's first user message.
    #[arg(long)]
    plain: bool,
    /// Print the outcome as one JSON line (tokens, blocks, bytes, seconds, the prefiller's stage
    /// milliseconds) instead of a sentence: for scripts and benchmarks.
    #[arg(long)]
    json: bool,
    /// decoded's front door (it tokenizes exactly as a request would).
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    front: String,
    /// prefilld's gRPC address.
    #[arg(long, default_value = "http://127.0.0.1:7071")]
    prefilld: String,
    /// Which of prefilld's `[[decoders]]` receives the blocks (default: its first).
    #[arg(long, default_value = "")]
    decoder_addr: String,
    /// An API key of decoded's front door (`front.api_keys`).
    #[arg(long, env = "PDBRIDGE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    tls: crate::TlsArgs,
}

pub async fn run(args: &WarmArgs) -> ExitCode {
    match warm(args).await {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(problem) => {
            eprintln!("pdbridge warm: {problem}");
            ExitCode::FAILURE
        }
    }
}

async fn warm(args: &WarmArgs) -> Result<String, String> {
    let text = std::fs::read_to_string(&args.file).map_err(|e| format!("{}: {e}", args.file.display()))?;
    let body =
        if args.plain { json!({"prompt": text}) } else { json!({"messages": [{"role": "user", "content": text}]}) };
    let mut tokenize = reqwest::Client::new().post(format!("{}/pd/v1/tokenize", args.front)).json(&body);
    if let Some(key) = &args.api_key {
        tokenize = tokenize.bearer_auth(key);
    }
    let tokenized: Value = tokenize
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| format!("tokenize: {e}"))?
        .json()
        .await
        .map_err(|e| format!("tokenize: {e}"))?;
    let tokens: Vec<u32> = serde_json::from_value(tokenized["tokens"].clone()).map_err(|e| format!("tokenize: {e}"))?;
    let tls = args.tls.load()?;
    let started = std::time::Instant::now();
    let channel = connect(&args.prefilld, tls.as_ref(), args.tls.prefilld_name.as_deref()).await?;
    let request =
        PrefillRequest { token_ids: tokens.clone(), decoder_addr: args.decoder_addr.clone(), ..Default::default() };
    let mut events = PrefillerClient::new(channel)
        .prefill(request)
        .await
        .map_err(|s| format!("Prefill: {}", s.message()))?
        .into_inner();

    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("{spinner} [{bar:40}] {pos}/{len} blocks  {msg}").expect("static template"),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    bar.set_message(format!("{} tokens", tokens.len()));
    while let Some(event) = events.message().await.map_err(|s| format!("Prefill stream: {}", s.message()))? {
        match event.event {
            Some(Event::Progress(p)) => {
                bar.set_length(p.blocks_total as u64);
                bar.set_position(p.blocks_done as u64);
                bar.set_message(format!("{:.1} MB sent, ETA {:.0} s", p.bytes_sent as f64 / 1e6, p.eta_seconds));
            }
            Some(Event::Outcome(outcome)) => {
                bar.finish_and_clear();
                let covered = format!("{} of {} tokens in the store", outcome.tokens_covered, tokens.len());
                return match outcome.status() {
                    OutcomeStatus::Bridged if args.json => Ok(json!({
                        "outcome": "bridged",
                        "tokens": tokens.len(),
                        "tokens_covered": outcome.tokens_covered,
                        "blocks": outcome.blocks_committed,
                        "bytes": outcome.bytes,
                        "seconds": started.elapsed().as_secs_f64(),
                        "stage_ms": outcome.stage_ms,
                    })
                    .to_string()),
                    OutcomeStatus::Bridged => Ok(format!(
                        "warm: bridged {} blocks ({} bytes); {covered}",
                        outcome.blocks_committed, outcome.bytes
                    )),
                    OutcomeStatus::Partial => Err(format!(
                        "partial: {} blocks; {covered}; {}: {}",
                        outcome.blocks_committed,
                        reason_label(&outcome),
                        outcome.detail
                    )),
                    _ => Err(format!("failed: {}: {}", reason_label(&outcome), outcome.detail)),
                };
            }
            None => {}
        }
    }
    Err("the Prefill stream ended without an outcome".into())
}
