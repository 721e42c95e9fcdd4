//! Failover among prefilld instances, as a value: a bridge's attempts (one prefilld failing
//! mid-way, the next taking over from the first block still missing) and the verdict on what
//! they achieved. Pure, so every case is a unit test; `plan` runs the attempts.

use pdbridge_common::{
    proto::{self, outcome::Status},
    reason::Reason,
};

use super::{
    policy::{self, Mode},
    prefiller::BridgeFailure,
    verdict::{Outcome, header_safe},
};

/// One attempt's result: the prefilld's name and its outcome (bridged or partial), or why there
/// is none.
pub type Attempt = Result<(String, proto::Outcome), BridgeFailure>;

/// A bridge in progress: the attempts that failed so far.
#[derive(Debug, Default)]
pub struct Failover {
    failed: Vec<BridgeFailure>,
}

/// What to do after an attempt.
#[derive(Debug)]
pub enum Next<'a> {
    /// This prefilld failed in a way another may not repeat: ask one not tried yet.
    AskAnother(&'a BridgeFailure),
    Over(Ended),
}

/// A bridge's attempts once it is over.
#[derive(Debug)]
pub struct Ended {
    /// Attempts another prefilld took over from, in order.
    pub failed: Vec<BridgeFailure>,
    pub last: Attempt,
}

/// What the verdict says about a bridge.
#[derive(Debug, PartialEq)]
pub struct Report {
    pub outcome: Outcome,
    pub reason: Option<Reason>,
    /// Blocks the bridge landed, those before a fault included.
    pub blocks: u32,
    pub bytes: u64,
    /// Every prefilld that worked on it, in order.
    pub prefillers: Vec<String>,
    pub detail: Option<String>,
    /// Why the request fails instead: the client required the bridge and it fell short.
    pub refused: Option<(Reason, String)>,
}

impl Failover {
    /// The prefillers not to ask again.
    pub fn tried(&self) -> Vec<String> {
        self.failed.iter().filter_map(|f| f.prefiller.clone()).collect()
    }

    /// Takes an attempt's result: ask another prefilld, or the bridge is over.
    pub fn after(&mut self, attempt: Attempt) -> Next<'_> {
        let last = match attempt {
            Err(failure) if failure.another_may_succeed() => {
                self.failed.push(failure);
                return Next::AskAnother(self.failed.last().expect("just pushed"));
            }
            // None left to ask: the last one's failure says more than "none is serving".
            Err(none_left) if none_left.prefiller.is_none() => Err(self.failed.pop().unwrap_or(none_left)),
            last => last,
        };
        Next::Over(Ended { failed: std::mem::take(&mut self.failed), last })
    }
}

impl Ended {
    /// The verdict, from the whole blocks the store held from the prompt's start `before` the
    /// bridge and `now`, of the prompt's `total`: the store, not the attempts, says what landed.
    pub fn report(&self, mode: Mode, before: usize, now: usize, total: usize) -> Report {
        // Who worked last, what it sent, why it fell short (if it said), and its last word.
        let (name, bytes, shortfall, end) = match &self.last {
            Ok((name, outcome)) => {
                let partial = outcome.status() == Status::Partial;
                let why = partial.then(|| Reason::from_proto(outcome.reason()).unwrap_or(Reason::TransferFailed));
                (Some(name), outcome.bytes, why, format!("finished by {name}"))
            }
            Err(failure) => {
                (failure.prefiller.as_ref(), failure.bytes_sent, Some(failure.reason), failure.detail.clone())
            }
        };
        let (outcome, reason) = policy::after_bridge(before, now, total, shortfall);
        let failure = self.last.as_ref().err();
        let refused = failure.filter(|_| mode == Mode::Bridge && outcome != Outcome::Bridged);
        Report {
            outcome,
            reason,
            blocks: now.saturating_sub(before) as u32,
            bytes: self.failed.iter().map(|f| f.bytes_sent).sum::<u64>() + bytes,
            prefillers: self.failed.iter().filter_map(|f| f.prefiller.clone()).chain(name.cloned()).collect(),
            // One prefilld that finished alone leaves nothing to explain.
            detail: (failure.is_some() || !self.failed.is_empty()).then(|| header_safe(&self.failovers(&end))),
            refused: refused.map(|f| (f.reason, f.detail.clone())),
        }
    }

    /// Each failed-over attempt ("name: reason: detail"), then `end`, joined by "; ".
    fn failovers(&self, end: &str) -> String {
        let failed = self
            .failed
            .iter()
            .map(|f| format!("{}: {}: {}", f.prefiller.as_deref().unwrap_or("?"), f.reason, f.detail));
        failed.chain([end.to_owned()]).collect::<Vec<_>>().join("; ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(on: Option<&str>, reason: Reason, detail: &str, bytes_sent: u64) -> Attempt {
        Err(BridgeFailure { reason, detail: detail.into(), bytes_sent, prefiller: on.map(str::to_owned) })
    }

    fn outcome(on: &str, status: Status, reason: proto::Reason, bytes: u64) -> Attempt {
        let mut outcome = proto::Outcome { bytes, ..Default::default() };
        outcome.set_status(status);
        outcome.set_reason(reason);
        Ok((on.to_owned(), outcome))
    }

    /// Feeds `attempts` until the failover is over; returns it and how many prefillers were asked.
    fn run(attempts: Vec<Attempt>) -> (Ended, usize) {
        let mut failover = Failover::default();
        for (asked, attempt) in attempts.into_iter().enumerate() {
            let tried = failover.tried();
            assert_eq!(tried.len(), asked, "every failed prefilld is skipped next: {tried:?}");
            if let Next::Over(ended) = failover.after(attempt) {
                return (ended, asked + 1);
            }
        }
        panic!("the failover never ended");
    }

    #[test]
    fn a_prefilld_cut_mid_way_is_finished_by_another() {
        let (ended, asked) = run(vec![
            failure(Some("a"), Reason::TransferFailed, "stream broken", 100),
            failure(Some("b"), Reason::Timeout, "no outcome within 1s", 50),
            outcome("c", Status::Bridged, proto::Reason::Unspecified, 200),
        ]);
        assert_eq!(asked, 3);
        let report = ended.report(Mode::Bridge, 1, 8, 8);
        assert_eq!(
            report,
            Report {
                outcome: Outcome::Bridged,
                reason: None,
                blocks: 7,
                bytes: 350,
                prefillers: vec!["a".into(), "b".into(), "c".into()],
                detail: Some(
                    "a: transfer_failed: stream broken; b: timeout: no outcome within 1s; finished by c".into()
                ),
                refused: None,
            }
        );
    }

    #[test]
    fn a_refusal_every_prefilld_would_repeat_ends_the_bridge() {
        let (ended, asked) = run(vec![failure(Some("a"), Reason::SpecMismatch, "rope base differs", 0)]);
        assert_eq!(asked, 1);
        let report = ended.report(Mode::Auto, 0, 0, 8);
        assert_eq!((report.outcome, report.reason), (Outcome::Native, Some(Reason::SpecMismatch)));
        assert_eq!((report.prefillers, report.detail), (vec!["a".to_owned()], Some("rope base differs".into())));
        // Required: the request fails with the prefilld's own words.
        let required = ended.report(Mode::Bridge, 0, 0, 8).refused;
        assert_eq!(required, Some((Reason::SpecMismatch, "rope base differs".into())));
    }

    #[test]
    fn with_none_left_to_ask_the_last_failure_is_the_verdict() {
        let (ended, asked) = run(vec![
            failure(Some("a"), Reason::Timeout, "no outcome within 2s", 70),
            failure(None, Reason::PrefillUnavailable, "no prefilld is serving", 0),
        ]);
        assert_eq!(asked, 2);
        assert!(ended.failed.is_empty(), "{ended:?}");
        let report = ended.report(Mode::Auto, 0, 3, 8);
        assert_eq!((report.outcome, report.reason, report.blocks), (Outcome::Partial, Some(Reason::Timeout), 3));
        assert_eq!((report.bytes, report.prefillers), (70, vec!["a".to_owned()]));
        assert_eq!(report.detail.as_deref(), Some("no outcome within 2s"));
        // Required but partial: the request fails, with the reason that stopped it.
        assert_eq!(ended.report(Mode::Bridge, 0, 3, 8).refused.map(|r| r.0), Some(Reason::Timeout));
    }

    #[test]
    fn no_prefilld_at_all() {
        let (ended, _) = run(vec![failure(None, Reason::PrefillUnavailable, "no prefilld configured", 0)]);
        let report = ended.report(Mode::Auto, 2, 2, 8);
        assert_eq!((report.outcome, report.reason), (Outcome::Cached, Some(Reason::PrefillUnavailable)));
        assert!(report.prefillers.is_empty());
        assert_eq!(report.detail.as_deref(), Some("no prefilld configured"));
    }

    #[test]
    fn outcomes_on_one_prefilld() {
        let (ended, _) = run(vec![outcome("a", Status::Bridged, proto::Reason::Unspecified, 10)]);
        let report = ended.report(Mode::Auto, 0, 4, 4);
        assert_eq!((report.outcome, report.detail, report.bytes), (Outcome::Bridged, None, 10));
        // A partial outcome names prefilld's reason; served even when the bridge was required.
        let (ended, _) = run(vec![outcome("a", Status::Partial, proto::Reason::Timeout, 10)]);
        let report = ended.report(Mode::Bridge, 0, 2, 4);
        assert_eq!((report.outcome, report.reason, report.refused), (Outcome::Partial, Some(Reason::Timeout), None));
        // A failure after the last block landed: every block was bridged, nothing to refuse.
        let (ended, _) = run(vec![failure(Some("a"), Reason::SpecMismatch, "late", 5)]);
        assert_eq!(ended.report(Mode::Bridge, 0, 4, 4).refused, None);
    }

    #[test]
    fn a_peers_words_are_made_fit_for_the_header() {
        let (ended, _) = run(vec![failure(Some("a"), Reason::UnsupportedModel, "layer 1 → nope\n", 0)]);
        assert_eq!(ended.report(Mode::Auto, 0, 0, 4).detail.as_deref(), Some("layer 1 ? nope?"));
    }
}
