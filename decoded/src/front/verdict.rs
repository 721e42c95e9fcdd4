//! What an answer says about the bridge: the `X-PD-Bridge` verdict, and the
//! metrics counted from it.

use std::collections::BTreeMap;

use axum::{http::HeaderValue, response::Response};
use pdbridge_common::{metric, reason::Reason, telemetry};
use serde::Serialize;
use tokio::time::Instant;

use super::costs::Prediction;
use crate::{engine::GenerateSummary, store::Tail};

/// The response header carrying the verdict.
pub const VERDICT_HEADER: &str = "x-pd-bridge";

/// How much of the prompt came from the store, and from where.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    /// Every whole block came over the bridge for this request.
    Bridged,
    /// A prefix did.
    Partial,
    /// The store already had them.
    Cached,
    /// Nothing was restored.
    Native,
}

impl Outcome {
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Bridged => "bridged",
            Outcome::Partial => "partial",
            Outcome::Cached => "cached",
            Outcome::Native => "native",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub outcome: Outcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    /// What prefilld said when the bridge fell short (e.g. which layer of an unsupported model, and why).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    pub prompt_tokens: u32,
    /// Prompt tokens restored from the store (whole blocks, and the tail when bridged).
    pub cached_tokens: u32,
    /// Of those, the prompt's tail after its last whole block, bridged for this request.
    pub tail_tokens: u32,
    /// Blocks this request pushed through the bridge, of `block_tokens` each.
    pub blocks: u32,
    pub block_tokens: u32,
    pub bytes: u64,
    /// How the prefiller made what it pushed: `kv` (vLLM's own K/V), `reconstruct` (the decoder's
    /// modules over captured layer inputs) or `exact` (the inputs; the decoder computed the cache).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub route: Option<&'static str>,
    /// The prefilld instances that worked on this request's bridge, in order (more than one when
    /// one failed mid-way and another took the rest).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub prefillers: Vec<String>,
    /// The cost model's time to first token for the prompt served here and bridged, when a bridge
    /// was weighed and the model had learned both.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prediction_ms: Option<Prediction>,
    pub timings_ms: BTreeMap<String, f64>,
}

/// The plan for one request, before generation.
pub struct Plan {
    pub verdict: Verdict,
    /// Store blocks the engine restores (a prefix of the prompt's keys).
    pub blocks: usize,
    /// The prompt's tail after every whole block, bridged for this request.
    pub tail: Option<Tail>,
}

impl Plan {
    /// Restoring `restored` whole blocks of `b` tokens of a prompt of `prompt_tokens`.
    pub fn new(outcome: Outcome, reason: Option<Reason>, prompt_tokens: usize, restored: usize, b: usize) -> Plan {
        let verdict = Verdict {
            outcome,
            reason,
            detail: None,
            prompt_tokens: prompt_tokens as u32,
            // The engine computes the last token itself, to have its logits.
            cached_tokens: (restored * b).min(prompt_tokens - 1) as u32,
            tail_tokens: 0,
            blocks: 0,
            block_tokens: b as u32,
            bytes: 0,
            route: None,
            prefillers: Vec::new(),
            prediction_ms: None,
            timings_ms: BTreeMap::new(),
        };
        Plan { verdict, blocks: restored, tail: None }
    }

    /// Restores `tail` (`rows` tokens) after the whole blocks too.
    pub fn with_tail(&mut self, tail: Tail, rows: u32) {
        self.tail = Some(tail);
        self.verdict.tail_tokens = rows;
        self.verdict.cached_tokens += rows;
    }

    /// Restores only the first `leased` blocks (the rest were evicted since
    /// planning), saying so in the verdict.
    pub fn restrict_to(&mut self, leased: usize, total: usize, b: usize) {
        if leased >= self.blocks {
            return;
        }
        self.blocks = leased;
        // The tail continues the last block: without every block it is of no use.
        self.tail = None;
        let verdict = &mut self.verdict;
        verdict.tail_tokens = 0;
        verdict.cached_tokens = (leased * b).min(verdict.prompt_tokens as usize - 1) as u32;
        verdict.outcome = match leased {
            0 => Outcome::Native,
            n if n < total && verdict.outcome == Outcome::Bridged => Outcome::Partial,
            _ => verdict.outcome,
        };
        verdict.reason = verdict.reason.or(Some(Reason::Evicted));
    }
}

/// `text` as it can travel in a header: printable ASCII, at most 400 characters.
pub fn header_safe(text: &str) -> String {
    const MAX: usize = 400;
    let mut out: String = text.chars().map(|c| if c == ' ' || c.is_ascii_graphic() { c } else { '?' }).collect();
    if out.len() > MAX {
        out.truncate(MAX - 3);
        out.push_str("...");
    }
    out
}

/// Puts `verdict` in the response's `X-PD-Bridge` header.
pub fn set(response: &mut Response, verdict: &impl Serialize) {
    match header_json(verdict) {
        Some(value) => {
            response.headers_mut().insert(VERDICT_HEADER, value);
        }
        // Unreachable (escaped JSON is visible ASCII), but an answer never fails over its header.
        None => tracing::error!("a verdict could not be written as a header"),
    }
}

/// `value` as JSON fit for a header, whatever its strings hold: a peer's `detail`, a prefilld's
/// name or stage, a configured name may carry any character, and a header only visible ASCII.
pub fn header_json(value: &impl Serialize) -> Option<HeaderValue> {
    let mut json = Vec::new();
    value.serialize(&mut serde_json::Serializer::with_formatter(&mut json, VisibleAscii)).ok()?;
    HeaderValue::from_bytes(&json).ok()
}

/// serde_json's compact output with every character outside visible ASCII and space escaped
/// (`\u2192`; beyond the BMP as a surrogate pair): the same JSON value, readable by any parser.
struct VisibleAscii;

impl serde_json::ser::Formatter for VisibleAscii {
    fn write_string_fragment<W: ?Sized + std::io::Write>(
        &mut self,
        out: &mut W,
        fragment: &str,
    ) -> std::io::Result<()> {
        for c in fragment.chars() {
            if c == ' ' || c.is_ascii_graphic() {
                out.write_all(&[c as u8])?;
            } else {
                for unit in c.encode_utf16(&mut [0; 2]) {
                    write!(out, "\\u{unit:04x}")?;
                }
            }
        }
        Ok(())
    }
}

/// Stages of a front-door request, as `pdbridge_stage_seconds{stage}`.
pub fn record_stages(verdict: &Verdict, summary: &GenerateSummary) {
    let ms = |key: &str| verdict.timings_ms.get(key).copied();
    for (stage, value) in [
        ("tokenize", ms("tokenize")),
        ("bridge", ms("bridge")),
        ("restore", summary.timings_ms.get("restore").copied()),
        ("tail_prefill", summary.timings_ms.get("prefill").copied()),
        ("first_token", summary.timings_ms.get("first_token").copied()),
    ] {
        if let Some(value) = value {
            telemetry::record_stage(stage, value / 1e3);
        }
    }
}

pub fn record_outcome(verdict: &Verdict) {
    metrics::counter!(
        metric::BRIDGE_OUTCOMES.name,
        "outcome" => verdict.outcome.label(),
        "reason" => verdict.reason.map_or("none", Reason::label)
    )
    .increment(1);
}

pub fn record_ttft(verdict: &Verdict, started: Instant) {
    metrics::histogram!(metric::TTFT.name, "outcome" => verdict.outcome.label())
        .record(started.elapsed().as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_verdict_detail_always_fits_in_a_header() {
        let said = "layer 1: ArraysCache: recurrent state → not rows\n";
        let safe = header_safe(said);
        assert_eq!(safe, "layer 1: ArraysCache: recurrent state ? not rows?");
        let long = header_safe(&"x".repeat(1000));
        assert_eq!(long.len(), 400);
        assert!(long.ends_with("..."));
        let mut plan = Plan::new(Outcome::Native, Some(Reason::UnsupportedModel), 1, 0, 16);
        plan.verdict.detail = Some(safe);
        let json = serde_json::to_string(&plan.verdict).unwrap();
        assert!(HeaderValue::from_str(&json).is_ok());
        assert!(json.contains(r#""outcome":"native","reason":"unsupported_model""#), "{json}");
    }

    #[test]
    fn any_text_from_a_peer_makes_a_valid_header() {
        let mut plan = Plan::new(Outcome::Partial, Some(Reason::TransferFailed), 100, 2, 16);
        // Not through header_safe: the header must hold whatever reaches the verdict.
        let detail = "é → \u{1F600}\n\t\r\u{7f}\u{0}\"quoted\" \\ end";
        plan.verdict.detail = Some(detail.to_owned());
        plan.verdict.prefillers = vec!["préfill-ü".into(), "b\u{85}".into()];
        plan.verdict.timings_ms.insert("prefill_ステージ".into(), 1.5);
        let value = header_json(&plan.verdict).expect("a header value");
        assert!(value.as_bytes().iter().all(|&b| b == b' ' || b.is_ascii_graphic()), "{value:?}");
        let back: serde_json::Value = serde_json::from_slice(value.as_bytes()).unwrap();
        assert_eq!(back["detail"], detail);
        assert_eq!(back["prefillers"], serde_json::json!(["préfill-ü", "b\u{85}"]));
        assert_eq!(back["timings_ms"]["prefill_ステージ"], 1.5);
        let mut response = Response::new(axum::body::Body::empty());
        set(&mut response, &plan.verdict);
        assert_eq!(response.headers()[VERDICT_HEADER], value);
        // What was ASCII already is written as serde_json writes it.
        plan.verdict.detail = Some("plain: ascii".into());
        plan.verdict.prefillers.clear();
        plan.verdict.timings_ms.clear();
        let plain = serde_json::to_string(&plan.verdict).unwrap();
        assert_eq!(header_json(&plan.verdict).unwrap().to_str().unwrap(), plain);
    }

    #[test]
    fn blocks_evicted_before_generation_are_owned_up_to() {
        let mut plan = Plan::new(Outcome::Bridged, None, 100, 6, 16);
        plan.restrict_to(6, 6, 16);
        assert_eq!((plan.blocks, plan.verdict.outcome, plan.verdict.reason), (6, Outcome::Bridged, None));
        plan.restrict_to(4, 6, 16);
        assert_eq!((plan.blocks, plan.verdict.cached_tokens), (4, 64));
        assert_eq!((plan.verdict.outcome, plan.verdict.reason), (Outcome::Partial, Some(Reason::Evicted)));
        plan.restrict_to(0, 6, 16);
        assert_eq!((plan.verdict.outcome, plan.verdict.cached_tokens), (Outcome::Native, 0));
        // A prompt of exactly one block restores all but its last token.
        assert_eq!(Plan::new(Outcome::Cached, None, 16, 1, 16).verdict.cached_tokens, 15);
    }
}
