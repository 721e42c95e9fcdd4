//! `pdbridge doctor`: one line per check, PASS or FAIL with the reason.

use std::{
    process::ExitCode,
    time::{Duration, SystemTime},
};

use pdbridge_common::{
    proto::{
        GetSpecRequest, PrefillRequest, cache_store_client::CacheStoreClient, outcome::Status as OutcomeStatus,
        prefill_event::Event, prefiller_client::PrefillerClient,
    },
    spec, tls,
};
use serde_json::Value;
use tonic::transport::Channel;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};

use crate::{Endpoints, connect, reason_label};

/// Largest clock difference between the hosts that still passes.
const MAX_SKEW: Duration = Duration::from_secs(2);

struct Report {
    failed: usize,
}

impl Report {
    fn line(&mut self, name: &str, result: Result<String, String>) -> bool {
        match result {
            Ok(detail) => {
                println!("PASS  {name}: {detail}");
                true
            }
            Err(problem) => {
                println!("FAIL  {name}: {problem}");
                self.failed += 1;
                false
            }
        }
    }
}

pub async fn run(endpoints: &Endpoints) -> ExitCode {
    let mut report = Report { failed: 0 };

    let tls = match endpoints.tls.load() {
        Ok(tls) => tls,
        Err(problem) => {
            report.line("certificate", Err(problem));
            None
        }
    };
    if tls.is_some() {
        report.line("certificate", certificate(&endpoints.tls));
    }
    let names = &endpoints.tls;
    let decoded = connect(&endpoints.decoded, tls.as_ref(), names.decoded_name.as_deref()).await;
    let decoded_ok =
        report.line("decoded reachable", decoded.as_ref().map(|_| endpoints.decoded.clone()).map_err(Clone::clone));
    let prefilld = connect(&endpoints.prefilld, tls.as_ref(), names.prefilld_name.as_deref()).await;
    let prefilld_ok =
        report.line("prefilld reachable", prefilld.as_ref().map(|_| endpoints.prefilld.clone()).map_err(Clone::clone));

    if let Ok(channel) = &decoded {
        report.line("decode engine ready", serving(channel, "pdbridge.v1.CacheStore").await);
        report.line("decoder spec", decoder_spec(channel).await);
    }
    if let Ok(channel) = &prefilld {
        report.line("prefill engine ready", serving(channel, "pdbridge.v1.Prefiller").await);
    }
    report.line("store writable", store(&endpoints.decoded_admin).await);
    report.line("clock skew", skew(&endpoints.decoded_admin, &endpoints.prefilld_admin).await);
    match (decoded, prefilld) {
        (Ok(decoded), Ok(prefilld)) => {
            report.line("test bridge", test_bridge(decoded, prefilld, &endpoints.decoder_addr).await);
        }
        _ => {
            let missing = if decoded_ok {
                "prefilld"
            } else if prefilld_ok {
                "decoded"
            } else {
                "both daemons"
            };
            report.line("test bridge", Err(format!("not attempted: {missing} unreachable")));
        }
    }
    if report.failed == 0 {
        println!("all checks passed");
        ExitCode::SUCCESS
    } else {
        println!("{} check(s) failed", report.failed);
        ExitCode::FAILURE
    }
}

/// Days left below which a certificate fails the check: time to renew.
const RENEW_DAYS: i64 = 14;

/// The CLI's certificate: signed by the CA, holding an identity, and not
/// about to expire. (That each daemon accepts the other's shows in the test
/// bridge: prefilld pushes to decoded over mutual TLS.)
fn certificate(args: &crate::TlsArgs) -> Result<String, String> {
    let read = |path: &Option<std::path::PathBuf>| {
        let path = path.as_ref().expect("clap requires --ca, --cert and --key together");
        std::fs::read(path)
            .map_err(|e| format!("{}: {e}", path.display()))
            .and_then(|pem| tls::first_pem_der(&pem).ok_or_else(|| format!("{}: no PEM certificate", path.display())))
    };
    let (ca_der, cert_der) = (read(&args.ca)?, read(&args.cert)?);
    let (_, ca) = x509_parser::parse_x509_certificate(&ca_der).map_err(|e| format!("CA: {e}"))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&cert_der).map_err(|e| format!("certificate: {e}"))?;
    cert.verify_signature(Some(ca.public_key())).map_err(|_| "not signed by the given CA".to_owned())?;
    let names = tls::identities(&cert_der)?;
    let left = cert.validity().time_to_expiration().map(|d| d.whole_days());
    match left {
        None => Err(format!("{} expired on {}", names.join(", "), cert.validity().not_after)),
        Some(days) if days < RENEW_DAYS => {
            Err(format!("{} expires in {days} days: renew it (`pdbridge certs`)", names.join(", ")))
        }
        Some(days) => Ok(format!("{}, signed by the CA, expires in {days} days", names.join(", "))),
    }
}

async fn serving(channel: &Channel, service: &str) -> Result<String, String> {
    let reply = HealthClient::new(channel.clone())
        .check(HealthCheckRequest { service: service.into() })
        .await
        .map_err(|s| format!("health check failed: {}", s.message()))?;
    match reply.get_ref().status() {
        ServingStatus::Serving => Ok(format!("{service} SERVING")),
        other => Err(format!("{service} is {other:?} (engine not ready, or the decoder's spec not loaded)")),
    }
}

async fn decoder_spec(channel: &Channel) -> Result<String, String> {
    let spec = CacheStoreClient::new(channel.clone())
        .get_spec(GetSpecRequest {})
        .await
        .map_err(|s| format!("GetSpec: {}", s.message()))?
        .into_inner();
    if spec::fingerprint(&spec) != spec.spec_fingerprint {
        return Err("the published fingerprint does not match the spec".into());
    }
    let rope = spec.layers.first().and_then(|l| l.rope.clone()).unwrap_or_default();
    Ok(format!(
        "{} ({} layers, {} B of cache per token), tokenizer {}, rope {} base {}, block {} tokens, spec {}",
        spec.model_id,
        spec.num_layers,
        spec::bytes_per_token(&spec),
        &spec.tokenizer_fingerprint[..12.min(spec.tokenizer_fingerprint.len())],
        rope.kind,
        rope.base,
        spec.block_tokens,
        &spec.spec_fingerprint[..12.min(spec.spec_fingerprint.len())],
    ))
}

async fn store(admin: &str) -> Result<String, String> {
    let status: Value = reqwest::get(format!("{admin}/store"))
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| format!("{admin}/store: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{admin}/store: {e}"))?;
    let writable = status["writable"].as_bool().unwrap_or(false);
    let free = status["free_bytes"].as_u64();
    let budget = status["budget_bytes"].as_u64().unwrap_or(0);
    let used = status["bytes"].as_u64().unwrap_or(0);
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    if !writable {
        return Err("the store directory is not writable".into());
    }
    match free {
        Some(free) if free < budget.saturating_sub(used) => Err(format!(
            "{:.1} GiB free but the budget allows {:.1} GiB more",
            gib(free),
            gib(budget.saturating_sub(used))
        )),
        Some(free) => Ok(format!(
            "{} blocks, {:.2} of {:.1} GiB used, {:.1} GiB free",
            status["blocks"],
            gib(used),
            gib(budget),
            gib(free)
        )),
        None => Err("free space unknown".into()),
    }
}

/// Compares each daemon's HTTP `Date` with this host's clock.
async fn skew(decoded_admin: &str, prefilld_admin: &str) -> Result<String, String> {
    let mut worst = Duration::ZERO;
    for admin in [decoded_admin, prefilld_admin] {
        let before = SystemTime::now();
        let response = reqwest::get(format!("{admin}/healthz")).await.map_err(|e| format!("{admin}: {e}"))?;
        let after = SystemTime::now();
        let date = response
            .headers()
            .get("date")
            .and_then(|d| d.to_str().ok())
            .and_then(|d| httpdate::parse_http_date(d).ok())
            .ok_or_else(|| format!("{admin} sent no Date header"))?;
        // The Date header has one-second resolution: compare with the window.
        let lo = before - Duration::from_secs(1);
        let off = if date < lo {
            lo.duration_since(date).unwrap_or_default()
        } else {
            date.duration_since(after).unwrap_or_default()
        };
        worst = worst.max(off);
    }
    if worst > MAX_SKEW {
        Err(format!("{:.1} s apart (more than {MAX_SKEW:?})", worst.as_secs_f64()))
    } else {
        Ok(format!("within {MAX_SKEW:?}"))
    }
}

/// Bridges one block of fresh token ids and checks the decoder stored it.
async fn test_bridge(decoded: Channel, prefilld: Channel, decoder_addr: &str) -> Result<String, String> {
    let spec = CacheStoreClient::new(decoded)
        .get_spec(GetSpecRequest {})
        .await
        .map_err(|s| format!("GetSpec: {}", s.message()))?
        .into_inner();
    // Ids no earlier run has used (so the block is not already cached), all
    // valid in the decoder's vocabulary.
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_nanos() as u64;
    let vocab = spec.vocab_size.max(2) as u64;
    let mut state = nanos;
    let tokens: Vec<u32> = (0..spec.block_tokens)
        .map(|_| {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((state >> 33) % vocab) as u32
        })
        .collect();
    let request = PrefillRequest {
        request_id: format!("doctor-{nanos:x}"),
        token_ids: tokens,
        decoder_addr: decoder_addr.to_owned(),
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let mut events = PrefillerClient::new(prefilld)
        .prefill(request)
        .await
        .map_err(|s| format!("Prefill: {}", s.message()))?
        .into_inner();
    while let Some(event) = events.message().await.map_err(|s| format!("Prefill stream: {}", s.message()))? {
        if let Some(Event::Outcome(outcome)) = event.event {
            return match outcome.status() {
                OutcomeStatus::Bridged if outcome.blocks_committed == 1 => Ok(format!(
                    "1 block ({} bytes) prefilled, reconstructed and committed in {:.1} s",
                    outcome.bytes,
                    started.elapsed().as_secs_f64()
                )),
                status => Err(format!("{status:?}: {}: {}", reason_label(&outcome), outcome.detail)),
            };
        }
    }
    Err("the Prefill stream ended without an outcome".into())
}
