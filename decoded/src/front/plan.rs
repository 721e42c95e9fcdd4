//! How a prompt is served — natively, from the store, or after a bridge — and the bridge itself:
//! waiting for another request's bridge of the same blocks, then failing over from prefilld to
//! prefilld. The decisions are `policy` and `failover`; this is their I/O.

use pdbridge_common::{
    block::{self, BlockKey},
    metric,
    proto::CacheSpec,
    reason::Reason,
    spec,
};
use tokio::time::Instant;
use tracing::Instrument;

use super::{
    Front,
    failover::{Ended, Failover, Next},
    ms,
    policy::{self, Decision, Mode, Situation, Step},
    verdict::{Outcome, Plan},
};
use crate::{
    api::error::FrontError,
    inflight::{Claim, Producing},
};

/// A request's prompt: its tokens and the keys of its whole blocks under the engine's spec.
pub struct Prompt {
    pub tokens: Vec<u32>,
    pub keys: Vec<BlockKey>,
    pub spec_fingerprint: String,
    pub block_tokens: usize,
}

impl Prompt {
    /// One spec for the whole request: its keys plan the bridge and pick the blocks to restore.
    pub fn new(spec: &CacheSpec, tokens: Vec<u32>) -> Prompt {
        let keys = spec::block_keys(spec, &tokens);
        Prompt {
            tokens,
            keys,
            spec_fingerprint: spec.spec_fingerprint.clone(),
            block_tokens: spec.block_tokens as usize,
        }
    }

    fn plan(&self, outcome: Outcome, reason: Option<Reason>, restored: usize) -> Plan {
        Plan::new(outcome, reason, self.tokens.len(), restored, self.block_tokens)
    }
}

/// The store's whole blocks of a prompt, once no other request is bridging the first missing one.
struct Held {
    cached: usize,
    /// The blocks still missing, claimed while this request bridges them.
    _claim: Option<Producing>,
    /// When this request began waiting for another's bridge, if it did.
    waited: Option<Instant>,
}

impl Front {
    /// Decides how this prompt is served and, when bridging, runs the bridge.
    pub(super) async fn plan(&self, prompt: &Prompt, mode: Mode) -> Result<Plan, FrontError> {
        if mode == Mode::Native {
            return Ok(prompt.plan(Outcome::Native, Some(Reason::Requested), 0));
        }
        let held = self.held(&prompt.keys).await;
        let lookup = if held.cached > 0 { "hit" } else { "miss" };
        metrics::counter!(metric::STORE_LOOKUPS.name, "outcome" => lookup).increment(1);
        let situation = Situation {
            mode,
            cached_blocks: held.cached,
            total_blocks: prompt.keys.len(),
            block_tokens: prompt.block_tokens,
            bridge_enabled: self.config.bridge,
            min_bridge_tokens: self.config.min_bridge_tokens as usize,
            policy: self.config.policy,
            cost_margin: self.config.cost_margin,
        };
        let mut prediction = None;
        let decision = match policy::decide(&situation) {
            Step::Decided(decision) => decision,
            Step::AskPrefilld => {
                let cached_tokens = held.cached * prompt.block_tokens;
                prediction = self.costs.predict(prompt.tokens.len(), cached_tokens, self.prefiller.least_busy());
                match policy::weigh(&situation, prediction) {
                    Some(decision) => decision,
                    None => policy::with_prefilld(&situation, self.prefiller.serving().await),
                }
            }
        };
        let mut plan = match decision {
            Decision::Serve { outcome, reason } => prompt.plan(outcome, reason, held.cached),
            Decision::Refuse(reason) => return Err(FrontError::BridgeRequired { reason, detail: String::new() }),
            Decision::Bridge => {
                let span = tracing::info_span!("front.bridge", pdbridge.cached_blocks = held.cached);
                self.bridge(prompt, mode, held.cached).instrument(span).await?
            }
        };
        if let Some(since) = held.waited {
            plan.verdict.timings_ms.insert("shared_bridge_wait".into(), ms(since));
        }
        plan.verdict.prediction_ms = prediction;
        Ok(plan)
    }

    /// A request bridging our first missing block right now is waited for, not duplicated; then
    /// the store is asked again.
    async fn held(&self, keys: &[BlockKey]) -> Held {
        let mut waited = None;
        loop {
            let cached = self.store.longest_prefix(keys);
            if cached == keys.len() {
                return Held { cached, _claim: None, waited };
            }
            match self.bridges.claim(&keys[cached..]) {
                Claim::Produce(claim) => return Held { cached, _claim: Some(claim), waited },
                Claim::Wait(ended) => {
                    waited.get_or_insert_with(Instant::now);
                    ended.wait().await;
                }
            }
        }
    }

    /// Bridges the blocks after the `cached` ones and plans from what landed.
    async fn bridge(&self, prompt: &Prompt, mode: Mode, cached: usize) -> Result<Plan, FrontError> {
        let (started, busy) = (Instant::now(), self.prefiller.least_busy());
        let ended = self.fail_over(prompt).await;
        // Blocks that landed before a fault count too: the store says which.
        let now = self.store.longest_prefix(&prompt.keys);
        let report = ended.report(mode, cached, now, prompt.keys.len());
        if let Err(failure) = &ended.last {
            let outcome = report.outcome.label();
            tracing::warn!(reason = %failure.reason, detail = failure.detail, outcome, "bridge fell short");
        }
        if let Some((reason, detail)) = report.refused {
            return Err(FrontError::BridgeRequired { reason, detail });
        }
        let mut plan = prompt.plan(report.outcome, report.reason, now);
        let verdict = &mut plan.verdict;
        let bridge_ms = ms(started);
        verdict.timings_ms.insert("bridge".into(), bridge_ms);
        (verdict.blocks, verdict.bytes) = (report.blocks, report.bytes);
        (verdict.prefillers, verdict.detail) = (report.prefillers, report.detail);
        if let Ok((_, outcome)) = ended.last {
            verdict.route = Some(outcome.route().label()).filter(|label| !label.is_empty());
            for (stage, value) in outcome.stage_ms {
                verdict.timings_ms.insert(format!("prefill_{stage}"), value);
            }
            self.take_tail(prompt, now, outcome.tail_tokens, &mut plan);
        }
        if plan.verdict.outcome == Outcome::Bridged {
            let bridged = (plan.verdict.cached_tokens as usize).saturating_sub(cached * prompt.block_tokens);
            self.costs.learn_bridge(prompt.tokens.len(), bridged, bridge_ms, busy);
        }
        Ok(plan)
    }

    /// Asks one healthy prefilld after another until one finishes the bridge or fails in a way
    /// another would repeat.
    async fn fail_over(&self, prompt: &Prompt) -> Ended {
        let mut failover = Failover::default();
        loop {
            // A prefilld that failed mid-way left its committed blocks: the next starts after them.
            let from = self.store.longest_prefix(&prompt.keys) as u32;
            let attempt = self.prefiller.bridge(&prompt.tokens, from, &failover.tried()).await;
            match failover.after(attempt) {
                Next::AskAnother(f) => {
                    let (prefiller, reason, detail) = (&f.prefiller, f.reason, &f.detail);
                    tracing::warn!(prefiller, %reason, detail, "bridge failed on a prefilld; asking another");
                }
                Next::Over(ended) => return ended,
            }
        }
    }

    /// Restores the `rows` of the prompt's tail prefilld pushed for this request, when every whole
    /// block before it is in the store (`now`): the tail continues the last one.
    fn take_tail(&self, prompt: &Prompt, now: usize, rows: u32, plan: &mut Plan) {
        if rows == 0 || now != prompt.keys.len() {
            return;
        }
        let start = prompt.keys.len() * prompt.block_tokens;
        // A count from the peer: one past the prompt finds no tail rather than a panic.
        let Some(tail_ids) = prompt.tokens.get(start..start + rows as usize) else { return };
        let key = block::tail_key(&prompt.spec_fingerprint, &prompt.keys, tail_ids);
        if let Some(tail) = self.store.take_tail(&key) {
            plan.with_tail(tail, rows);
        }
    }
}
