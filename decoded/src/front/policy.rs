//! The bridge policy: from what the store holds, what the client asked and
//! what the deployment allows, whether to bridge, and what the verdict says
//! before and after a bridge. Pure: every input is a parameter, so every case
//! is a unit test.

use pdbridge_common::reason::Reason;

use super::{costs::Prediction, verdict::Outcome};
use crate::config::BridgePolicy;

/// `X-PD-Bridge-Mode`: how the client wants this request served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Bridge when it is worth it, else serve natively (the default).
    Auto,
    /// Never bridge.
    Native,
    /// Bridge or fail loudly (502), never fall back.
    Bridge,
}

/// What a decision depends on.
#[derive(Debug, Clone, Copy)]
pub struct Situation {
    pub mode: Mode,
    /// Whole blocks of the prompt already in the store, from its start.
    pub cached_blocks: usize,
    /// Whole blocks in the prompt.
    pub total_blocks: usize,
    pub block_tokens: usize,
    /// `front.bridge`.
    pub bridge_enabled: bool,
    /// `front.min_bridge_tokens`.
    pub min_bridge_tokens: usize,
    /// `front.policy` and `front.cost_margin`.
    pub policy: BridgePolicy,
    pub cost_margin: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Serve from what the store holds; `reason` says why nothing is bridged
    /// (None: nothing was missing).
    Serve {
        outcome: Outcome,
        reason: Option<Reason>,
    },
    /// The client required the bridge and `reason` stops it.
    Refuse(Reason),
    Bridge,
}

/// A decision, or the one input left to ask for: prefilld's health (a network
/// round trip, so asked only when nothing cheaper decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    Decided(Decision),
    AskPrefilld,
}

pub fn decide(s: &Situation) -> Step {
    if s.mode == Mode::Native {
        return Step::Decided(Decision::Serve { outcome: Outcome::Native, reason: Some(Reason::Requested) });
    }
    let missing_tokens = (s.total_blocks - s.cached_blocks) * s.block_tokens;
    let reason = if missing_tokens == 0 {
        // Nothing to bridge: the store has every whole block, or there is none.
        (s.cached_blocks == 0).then_some(Reason::ShortPrompt)
    } else if !s.bridge_enabled {
        Some(Reason::Disabled)
    } else if s.mode == Mode::Auto && missing_tokens < s.min_bridge_tokens {
        Some(Reason::ShortPrompt)
    } else {
        return Step::AskPrefilld;
    };
    Step::Decided(serve_or_refuse(s, reason))
}

/// The cost model's say on a bridge `decide` would ask prefilld for: under `front.policy = "cost"`
/// an `auto` request is served without one (`not_worth_it`) unless a bridge is predicted to
/// answer `cost_margin` sooner. None: the bridge goes on (the model has not learned both ways,
/// the policy is the threshold, or the client required the bridge).
pub fn weigh(s: &Situation, prediction: Option<Prediction>) -> Option<Decision> {
    let prediction = prediction.filter(|_| s.mode == Mode::Auto && s.policy == BridgePolicy::Cost)?;
    let sooner = prediction.bridge_ms * (1.0 + s.cost_margin) < prediction.here_ms;
    (!sooner).then(|| serve_or_refuse(s, Some(Reason::NotWorthIt)))
}

/// The decision once prefilld's health is known.
pub fn with_prefilld(s: &Situation, serving: bool) -> Decision {
    if serving { Decision::Bridge } else { serve_or_refuse(s, Some(Reason::PrefillUnavailable)) }
}

/// Serve what the store holds, unless the client required the bridge that
/// `reason` stops.
fn serve_or_refuse(s: &Situation, reason: Option<Reason>) -> Decision {
    match (s.mode, reason) {
        (Mode::Bridge, Some(reason)) => Decision::Refuse(reason),
        _ => Decision::Serve { outcome: held(s.cached_blocks), reason },
    }
}

/// The verdict once a bridge ended: `before` and `now` whole blocks in the
/// store from the prompt's start, of `total`; `shortfall` is why the bridge
/// fell short, if it said.
pub fn after_bridge(before: usize, now: usize, total: usize, shortfall: Option<Reason>) -> (Outcome, Option<Reason>) {
    if now == total && now > before {
        (Outcome::Bridged, None)
    } else if now > before {
        (Outcome::Partial, shortfall)
    } else {
        (held(before), shortfall.or(Some(Reason::TransferFailed)))
    }
}

/// The outcome of serving what the store already held.
fn held(cached_blocks: usize) -> Outcome {
    if cached_blocks > 0 { Outcome::Cached } else { Outcome::Native }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn situation(mode: Mode, cached_blocks: usize, total_blocks: usize) -> Situation {
        let policy = BridgePolicy::Threshold;
        Situation {
            mode,
            cached_blocks,
            total_blocks,
            block_tokens: 16,
            bridge_enabled: true,
            min_bridge_tokens: 32,
            policy,
            cost_margin: 0.1,
        }
    }

    fn serve(outcome: Outcome, reason: Option<Reason>) -> Step {
        Step::Decided(Decision::Serve { outcome, reason })
    }

    fn refuse(reason: Reason) -> Step {
        Step::Decided(Decision::Refuse(reason))
    }

    #[test]
    fn native_mode_never_bridges() {
        for (cached, total) in [(0, 0), (0, 8), (3, 8), (8, 8)] {
            assert_eq!(
                decide(&situation(Mode::Native, cached, total)),
                serve(Outcome::Native, Some(Reason::Requested))
            );
        }
    }

    #[test]
    fn nothing_missing_is_served_from_the_store() {
        assert_eq!(decide(&situation(Mode::Auto, 8, 8)), serve(Outcome::Cached, None));
        assert_eq!(decide(&situation(Mode::Bridge, 8, 8)), serve(Outcome::Cached, None));
        // Shorter than a block: nothing to bridge, and a required bridge fails.
        assert_eq!(decide(&situation(Mode::Auto, 0, 0)), serve(Outcome::Native, Some(Reason::ShortPrompt)));
        assert_eq!(decide(&situation(Mode::Bridge, 0, 0)), refuse(Reason::ShortPrompt));
    }

    #[test]
    fn a_disabled_bridge_or_a_short_gap_is_not_bridged_unless_required() {
        let off = Situation { bridge_enabled: false, ..situation(Mode::Auto, 2, 8) };
        assert_eq!(decide(&off), serve(Outcome::Cached, Some(Reason::Disabled)));
        assert_eq!(decide(&Situation { mode: Mode::Bridge, ..off }), refuse(Reason::Disabled));
        // One missing block of 16 tokens, below min_bridge_tokens = 32; a required bridge goes ahead.
        assert_eq!(decide(&situation(Mode::Auto, 7, 8)), serve(Outcome::Cached, Some(Reason::ShortPrompt)));
        assert_eq!(decide(&situation(Mode::Bridge, 7, 8)), Step::AskPrefilld);
        assert_eq!(decide(&situation(Mode::Auto, 6, 8)), Step::AskPrefilld);
    }

    #[test]
    fn prefilld_is_asked_last_and_its_health_decides() {
        let cold = situation(Mode::Auto, 0, 8);
        assert_eq!(decide(&cold), Step::AskPrefilld);
        assert_eq!(with_prefilld(&cold, true), Decision::Bridge);
        let unavailable = Some(Reason::PrefillUnavailable);
        assert_eq!(with_prefilld(&cold, false), Decision::Serve { outcome: Outcome::Native, reason: unavailable });
        let warm = situation(Mode::Auto, 3, 8);
        assert_eq!(with_prefilld(&warm, false), Decision::Serve { outcome: Outcome::Cached, reason: unavailable });
        let required = situation(Mode::Bridge, 3, 8);
        assert_eq!(with_prefilld(&required, false), Decision::Refuse(Reason::PrefillUnavailable));
        assert_eq!(with_prefilld(&required, true), Decision::Bridge);
    }

    #[test]
    fn under_the_cost_policy_a_bridge_must_be_predicted_sooner_by_the_margin() {
        let cost = Situation { policy: BridgePolicy::Cost, ..situation(Mode::Auto, 2, 8) };
        let predicted = |here_ms, bridge_ms| Some(Prediction { here_ms, bridge_ms });
        assert_eq!(weigh(&cost, predicted(1000.0, 500.0)), None);
        // 10 % sooner is not enough with a margin of 0.1; nor is a tie.
        let not_worth_it = Some(Decision::Serve { outcome: Outcome::Cached, reason: Some(Reason::NotWorthIt) });
        assert_eq!(weigh(&cost, predicted(1000.0, 910.0)), not_worth_it);
        assert_eq!(weigh(&cost, predicted(1000.0, 1000.0)), not_worth_it);
        assert_eq!(weigh(&cost, predicted(1000.0, 900.0)), None);
        // Nothing learned yet: the threshold's bridge stands.
        assert_eq!(weigh(&cost, None), None);
        // The threshold policy and a required bridge are only told the prediction.
        assert_eq!(weigh(&situation(Mode::Auto, 2, 8), predicted(1000.0, 5000.0)), None);
        assert_eq!(weigh(&Situation { mode: Mode::Bridge, ..cost }, predicted(1000.0, 5000.0)), None);
    }

    #[test]
    fn after_a_bridge_the_store_says_what_happened() {
        assert_eq!(after_bridge(0, 8, 8, None), (Outcome::Bridged, None));
        assert_eq!(after_bridge(3, 8, 8, None), (Outcome::Bridged, None));
        assert_eq!(after_bridge(0, 5, 8, Some(Reason::Timeout)), (Outcome::Partial, Some(Reason::Timeout)));
        assert_eq!(after_bridge(0, 0, 8, Some(Reason::SpecMismatch)), (Outcome::Native, Some(Reason::SpecMismatch)));
        assert_eq!(after_bridge(2, 2, 8, None), (Outcome::Cached, Some(Reason::TransferFailed)));
        assert_eq!(after_bridge(0, 0, 8, None), (Outcome::Native, Some(Reason::TransferFailed)));
    }
}
