use pdbridge_common::proto::{self, CacheKind, LayerSpec, PushReceipt};

use super::{transfer::settle, *};

/// Blocks 2..6 of a 27-token prompt in 4-token blocks, and its 2-token tail.
const PLAN: Plan = Plan { block_tokens: 4, whole_blocks: 6, first_block: 2, tail_tokens: 2 };

fn receipt(committed: u32, tail_committed: bool) -> PushReceipt {
    PushReceipt {
        blocks_committed: committed,
        bytes: u64::from(committed) * 100,
        first_missing_block: PLAN.first_block + committed,
        tail_committed,
        ..Default::default()
    }
}

/// The outcome's status, reason and blocks committed (Failed, the failure's reason and 0 for an Err).
fn settled(end: Result<u32, Failure>, receipt: Result<PushReceipt, Failure>) -> (OutcomeStatus, Option<Reason>, u32) {
    match settle(&PLAN, end, receipt) {
        Ok(o) => (o.status(), Reason::from_proto(o.reason()), o.blocks_committed),
        Err(failure) => (OutcomeStatus::Failed, Some(failure.reason), 0),
    }
}

#[test]
fn every_block_emitted_and_committed_is_bridged_with_its_tail() {
    let outcome = settle(&PLAN, Ok(4), Ok(receipt(4, true))).unwrap();
    assert_eq!(outcome.status(), OutcomeStatus::Bridged);
    assert_eq!(outcome.reason(), proto::Reason::Unspecified);
    assert_eq!((outcome.blocks_committed, outcome.tokens_covered, outcome.tail_tokens, outcome.bytes), (4, 24, 2, 400));
    // No tail delivered, none claimed.
    assert_eq!(settle(&PLAN, Ok(4), Ok(receipt(4, false))).unwrap().tail_tokens, 0);
}

#[test]
fn blocks_the_decoder_did_not_commit_make_a_partial_with_its_reason() {
    let short =
        PushReceipt { reason: Reason::Evicted.to_proto() as i32, detail: "gap at 4".into(), ..receipt(2, true) };
    let outcome = settle(&PLAN, Ok(4), Ok(short)).unwrap();
    assert_eq!((outcome.status(), outcome.reason()), (OutcomeStatus::Partial, proto::Reason::Evicted));
    assert_eq!((outcome.tokens_covered, outcome.tail_tokens), (16, 0), "a tail after a gap is of no use");
    assert_eq!(outcome.detail, "emitted 4 of 4 blocks; gap at 4");
    // A receipt that names no reason: the transfer's.
    assert_eq!(settled(Ok(4), Ok(receipt(3, false))), (OutcomeStatus::Partial, Some(Reason::TransferFailed), 3));
}

#[test]
fn a_plugin_that_emitted_fewer_blocks_makes_a_partial() {
    assert_eq!(settled(Ok(3), Ok(receipt(3, false))), (OutcomeStatus::Partial, Some(Reason::TransferFailed), 3));
    // Even when it emitted none and none were committed (as before: partial, zero blocks).
    assert_eq!(settled(Ok(0), Ok(receipt(0, false))), (OutcomeStatus::Partial, Some(Reason::TransferFailed), 0));
}

#[test]
fn what_stopped_the_transfer_is_the_reason_partial_or_failed_by_what_was_committed() {
    for reason in [Reason::PrefillFailed, Reason::Timeout, Reason::Cancelled, Reason::TransferFailed] {
        let outcome = settle(&PLAN, Err(fail(reason, "why")), Ok(receipt(1, false))).unwrap();
        assert_eq!((outcome.status(), outcome.reason()), (OutcomeStatus::Partial, reason.to_proto()));
        assert_eq!((outcome.blocks_committed, outcome.detail.as_str()), (1, "why"));
        let failure = settle(&PLAN, Err(fail(reason, "why")), Ok(receipt(0, false))).unwrap_err();
        assert_eq!((failure.reason, failure.detail.as_str()), (reason, "why"));
    }
}

#[test]
fn a_failed_seal_fails_the_transfer_whatever_the_plugin_did() {
    let sealing = || Err(fail(Reason::SpecMismatch, "spec changed"));
    assert_eq!(settled(Ok(4), sealing()), (OutcomeStatus::Failed, Some(Reason::SpecMismatch), 0));
    assert_eq!(settled(Err(fail(Reason::Timeout, "late")), sealing()).1, Some(Reason::SpecMismatch));
}

#[test]
fn a_plan_covers_the_storable_whole_blocks_and_the_tail_it_may_carry() {
    // What a plan reads is the layer's traits: rows are rewindable and take a tail, pools neither.
    let spec = |kind: CacheKind| {
        let rows = kind == CacheKind::Rows;
        let layer = LayerSpec { rewindable: rows, takes_tail: rows, from_inputs: true, ..Default::default() };
        CacheSpec { block_tokens: 4, layers: vec![LayerSpec { kind: kind as i32, ..layer }], ..Default::default() }
    };
    let tokens: Vec<u32> = (0..27).collect();
    let rows = Plan::new(&spec(CacheKind::Rows), &tokens, 2, true);
    assert_eq!(rows, PLAN);
    assert_eq!((rows.num_blocks(), rows.prompt_tokens()), (4, 26), "all but the last token");
    assert_eq!(Plan::new(&spec(CacheKind::Rows), &tokens, 2, false).tail_tokens, 0);
    // A pooled layer stores no tail, and no block ends with the prompt's last token.
    let (tokens, pooled) = (&tokens[..24], spec(CacheKind::Pooled));
    assert_eq!(Plan::new(&pooled, tokens, 0, true), Plan { whole_blocks: 5, first_block: 0, tail_tokens: 0, ..PLAN });
    assert_eq!(Plan::new(&spec(CacheKind::Rows), tokens, 0, true).whole_blocks, 6);
}

#[test]
fn a_plan_the_decoder_holds_is_already_bridged() {
    assert_eq!(PLAN.already_cached(), None);
    let cached = Plan { first_block: 6, ..PLAN }.already_cached().unwrap();
    assert_eq!((cached.status(), cached.tokens_covered, cached.blocks_committed), (OutcomeStatus::Bridged, 24, 0));
    assert!(Plan { first_block: 9, ..PLAN }.already_cached().is_some());
}

#[test]
fn only_planned_blocks_and_the_tail_are_accepted_from_the_plugin() {
    assert!(!PLAN.is_tail(2).unwrap());
    assert!(!PLAN.is_tail(5).unwrap());
    assert!(PLAN.is_tail(6).unwrap());
    for outside in [0, 1, 7] {
        assert_eq!(PLAN.is_tail(outside).unwrap_err().reason, Reason::PrefillFailed, "block {outside}");
    }
    assert!(Plan { tail_tokens: 0, ..PLAN }.is_tail(6).is_err());
}

#[test]
fn a_decoders_reason_comes_from_its_status_else_from_the_code() {
    use tonic::{Code, Status};
    let named = Reason::UnsupportedModel.status(Code::FailedPrecondition, "no tail");
    assert_eq!(decoder_reason(&named, Reason::TransferFailed), Reason::UnsupportedModel);
    let named = Reason::SpecMismatch.status(Code::FailedPrecondition, "fingerprint");
    assert_eq!(decoder_reason(&named, Reason::DecoderUnreachable), Reason::SpecMismatch);
    // A decoder that predates reasons in statuses.
    let old = Status::failed_precondition("payload");
    assert_eq!(decoder_reason(&old, Reason::TransferFailed), Reason::SpecMismatch);
    // A failure of the call alone: what the call was for.
    assert_eq!(decoder_reason(&Status::unavailable("down"), Reason::DecoderUnreachable), Reason::DecoderUnreachable);
    assert_eq!(decoder_reason(&Status::data_loss("crc"), Reason::TransferFailed), Reason::TransferFailed);
}
