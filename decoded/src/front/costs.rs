//! What serving a prompt costs, learned from this front door's own answers: the decoder's prefill
//! rate, a bridge's rate (prefill box, wire and commit, end to end) and restoring from the store,
//! each in seconds per token by prompt length (attention's share grows with it). From them, a
//! request's time to first token served here (the decoder computes what the store lacks) and
//! bridged (a prefilld computes it, the decoder restores it), which `policy` compares.
//!
//! A bridge is learned on an idle prefill box and, apart, how much slower a box running 1, 2, 3 or
//! more other bridges makes it (vLLM batches concurrent prefills: less than linearly, which is
//! assumed only until learned); the bridges a box runs now are a live input, not a memory.

use std::sync::Mutex;

use serde::Serialize;

use crate::engine::GenerateSummary;

/// Buckets of prompt length: up to 512 tokens, 1K, 2K, … 128K and beyond.
const BUCKETS: usize = 10;
/// Weight of a new sample in its bucket's moving average.
const ALPHA: f64 = 0.3;
/// Fewer computed tokens than this say more about fixed costs than about a rate.
const MIN_SAMPLE_TOKENS: usize = 32;
/// Load levels learned apart: 1, 2, 3 and 4 or more other bridges on the box.
const LOAD_LEVELS: usize = 4;

/// Predicted milliseconds from the decision to the first token, each way.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Prediction {
    /// The decoder computes what the store lacks.
    pub here_ms: f64,
    /// A prefilld bridges it and the decoder restores it.
    pub bridge_ms: f64,
}

/// Seconds per token, a moving average per bucket of prompt length.
#[derive(Clone, Copy, Debug, Default)]
struct Rates([Option<f64>; BUCKETS]);

fn bucket(prompt_tokens: usize) -> usize {
    let halvings = (prompt_tokens.max(1) - 1) / 512;
    (usize::BITS - halvings.leading_zeros()).min(BUCKETS as u32 - 1) as usize
}

impl Rates {
    fn learn(&mut self, prompt_tokens: usize, seconds_per_token: f64) {
        if !seconds_per_token.is_finite() || seconds_per_token < 0.0 {
            return;
        }
        let rate = &mut self.0[bucket(prompt_tokens)];
        *rate = Some(rate.map_or(seconds_per_token, |old| old + ALPHA * (seconds_per_token - old)));
    }

    /// The rate at this length: its bucket's, else the nearest learned one's.
    fn at(&self, prompt_tokens: usize) -> Option<f64> {
        let at = bucket(prompt_tokens);
        (0..BUCKETS).filter_map(|i| self.0[i].map(|rate| (at.abs_diff(i), rate))).min_by_key(|&(d, _)| d).map(|x| x.1)
    }
}

#[derive(Debug, Default)]
struct Estimates {
    here: Rates,
    /// On an idle prefill box.
    bridge: Rates,
    /// A busy box's time over an idle one's, by load level.
    slowdown: [Option<f64>; LOAD_LEVELS],
    restore: Rates,
}

impl Estimates {
    /// How much slower a bridge is on a box running `busy` other bridges: learned, else 1 + busy.
    fn slowdown(&self, busy: usize) -> f64 {
        match busy {
            0 => 1.0,
            _ => self.slowdown[busy.min(LOAD_LEVELS) - 1].unwrap_or((1 + busy) as f64),
        }
    }
}

/// The rates, shared by every request of the front door.
#[derive(Debug, Default)]
pub struct Costs(Mutex<Estimates>);

/// One answer's engine timings, from the adapter's summary.
pub struct EngineSample {
    pub prompt_tokens: usize,
    pub restored_tokens: usize,
    pub restore_ms: f64,
    /// From admission to the first token: restoring, then computing the rest.
    pub prefill_ms: f64,
}

impl EngineSample {
    /// The sample in an answer's summary, when it has the timings.
    pub fn of(summary: &GenerateSummary) -> Option<EngineSample> {
        let timing = |key: &str| summary.timings_ms.get(key).copied();
        Some(EngineSample {
            prompt_tokens: summary.prompt_tokens as usize,
            restored_tokens: summary.cached_tokens as usize,
            restore_ms: timing("restore").unwrap_or(0.0),
            prefill_ms: timing("prefill")?,
        })
    }
}

impl Costs {
    /// Starting rates from configuration (tokens per second, each way), before any sample.
    pub fn starting_with(here_tokens_per_s: Option<f64>, bridge_tokens_per_s: Option<f64>) -> Costs {
        let mut estimates = Estimates::default();
        for (rates, per_s) in [(&mut estimates.here, here_tokens_per_s), (&mut estimates.bridge, bridge_tokens_per_s)] {
            if let Some(per_s) = per_s.filter(|r| *r > 0.0) {
                rates.0 = [Some(1.0 / per_s); BUCKETS];
            }
        }
        Costs(Mutex::new(estimates))
    }

    /// Time to first token for a prompt of `prompt_tokens` whose first `cached_tokens` the store
    /// holds: served here, or bridged by a prefilld already running `busy` bridges. None until
    /// both rates are known.
    pub fn predict(&self, prompt_tokens: usize, cached_tokens: usize, busy: usize) -> Option<Prediction> {
        let estimates = self.0.lock().expect("costs lock");
        let missing = prompt_tokens.saturating_sub(cached_tokens) as f64;
        let restore = estimates.restore.at(prompt_tokens).unwrap_or(0.0);
        let here = missing * estimates.here.at(prompt_tokens)? + cached_tokens as f64 * restore;
        let bridge =
            missing * estimates.bridge.at(prompt_tokens)? * estimates.slowdown(busy) + prompt_tokens as f64 * restore;
        Some(Prediction { here_ms: here * 1e3, bridge_ms: bridge * 1e3 })
    }

    /// What an answer's engine timings say of the decoder's own prefill and of restoring.
    pub fn learn_engine(&self, sample: &EngineSample) {
        let mut estimates = self.0.lock().expect("costs lock");
        let computed = sample.prompt_tokens.saturating_sub(sample.restored_tokens);
        if computed >= MIN_SAMPLE_TOKENS {
            let seconds = (sample.prefill_ms - sample.restore_ms) / 1e3;
            estimates.here.learn(sample.prompt_tokens, seconds / computed as f64);
        }
        if sample.restored_tokens >= MIN_SAMPLE_TOKENS {
            estimates.restore.learn(sample.prompt_tokens, sample.restore_ms / 1e3 / sample.restored_tokens as f64);
        }
    }

    /// A bridge of `bridged_tokens` of a prompt of `prompt_tokens` that took `bridge_ms` on a
    /// prefilld running `busy` other bridges when it began: the idle rate, or the slowdown at that
    /// load once the idle rate is known (before, the sample counts as an idle one, 1 + busy times
    /// faster).
    pub fn learn_bridge(&self, prompt_tokens: usize, bridged_tokens: usize, bridge_ms: f64, busy: usize) {
        if bridged_tokens < MIN_SAMPLE_TOKENS {
            return;
        }
        let per_token = bridge_ms / 1e3 / bridged_tokens as f64;
        let mut estimates = self.0.lock().expect("costs lock");
        match (busy, estimates.bridge.at(prompt_tokens)) {
            (0, _) => estimates.bridge.learn(prompt_tokens, per_token),
            (_, Some(idle)) if idle > 0.0 => {
                let level = &mut estimates.slowdown[busy.min(LOAD_LEVELS) - 1];
                let sample = per_token / idle;
                *level = Some(level.map_or(sample, |old| old + ALPHA * (sample - old)));
            }
            _ => estimates.bridge.learn(prompt_tokens, per_token / (1 + busy) as f64),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_double_from_512_tokens() {
        let cuts = [(1, 0), (512, 0), (513, 1), (1024, 1), (1025, 2), (2048, 2), (131_072, 8), (131_073, 9)];
        for (tokens, expected) in cuts {
            assert_eq!(bucket(tokens), expected, "{tokens} tokens");
        }
        assert_eq!(bucket(10_000_000), BUCKETS - 1);
    }

    #[test]
    fn nothing_is_predicted_until_both_ways_are_known() {
        let costs = Costs::default();
        assert_eq!(costs.predict(4096, 0, 0), None);
        costs.learn_engine(&EngineSample {
            prompt_tokens: 4096,
            restored_tokens: 0,
            restore_ms: 0.0,
            prefill_ms: 4096.0,
        });
        assert_eq!(costs.predict(4096, 0, 0), None);
        costs.learn_bridge(4096, 4096, 1024.0, 0);
        let predicted = costs.predict(4096, 0, 0).unwrap();
        assert_eq!((predicted.here_ms, predicted.bridge_ms), (4096.0, 1024.0));
    }

    #[test]
    fn before_an_idle_bridge_is_known_a_busy_one_stands_for_one_assumed_linearly_slower() {
        let costs = Costs::starting_with(Some(1000.0), None);
        // Two other bridges were running: an idle box would have taken a third of the time.
        costs.learn_bridge(2048, 2048, 1536.0, 2);
        let idle = costs.predict(2048, 0, 0).unwrap();
        assert!((idle.bridge_ms - 512.0).abs() < 1e-9, "{idle:?}");
        assert!((costs.predict(2048, 0, 3).unwrap().bridge_ms - 2048.0).abs() < 1e-9);
    }

    #[test]
    fn a_busy_box_is_as_slow_as_learned_at_its_load() {
        let costs = Costs::starting_with(Some(1000.0), None);
        costs.learn_bridge(2048, 2048, 512.0, 0);
        // Two other bridges running: assumed three times as slow until a bridge at that load says.
        assert!((costs.predict(2048, 0, 2).unwrap().bridge_ms - 1536.0).abs() < 1e-9);
        costs.learn_bridge(2048, 2048, 1024.0, 2);
        assert!((costs.predict(2048, 0, 2).unwrap().bridge_ms - 1024.0).abs() < 1e-9);
        // Other loads and the idle rate keep theirs.
        assert!((costs.predict(2048, 0, 1).unwrap().bridge_ms - 1024.0).abs() < 1e-9);
        assert!((costs.predict(2048, 0, 0).unwrap().bridge_ms - 512.0).abs() < 1e-9);
        // Ten others count as the highest level learned apart.
        costs.learn_bridge(2048, 2048, 2560.0, 10);
        assert!((costs.predict(2048, 0, 4).unwrap().bridge_ms - 2560.0).abs() < 1e-9);
    }

    #[test]
    fn what_the_store_holds_is_restored_not_computed() {
        let costs = Costs::starting_with(Some(1000.0), Some(4000.0));
        // 1,000 tokens restored in 10 ms, 1,000 computed in 1 s.
        let sample = EngineSample { prompt_tokens: 2000, restored_tokens: 1000, restore_ms: 10.0, prefill_ms: 1010.0 };
        costs.learn_engine(&sample);
        let p = costs.predict(2000, 1000, 0).unwrap();
        // Here: 1,000 computed at the configured 1 ms moved 30 % toward the sample's 1 ms, plus 10 ms.
        assert!((p.here_ms - 1010.0).abs() < 1e-6, "{p:?}");
        // Bridged: 1,000 at 0.25 ms, then the whole prompt restored at 0.01 ms.
        assert!((p.bridge_ms - 270.0).abs() < 1e-6, "{p:?}");
    }

    #[test]
    fn samples_move_their_own_bucket_and_inform_the_unlearned_ones() {
        let mut rates = Rates::default();
        rates.learn(1000, 0.002);
        assert_eq!(rates.at(100_000), Some(0.002));
        rates.learn(100_000, 0.01);
        rates.learn(100_000, 0.02);
        assert!((rates.at(100_000).unwrap() - 0.013).abs() < 1e-12);
        assert_eq!(rates.at(1000), Some(0.002));
        rates.learn(1000, f64::NAN);
        assert_eq!(rates.at(1000), Some(0.002));
    }
}
