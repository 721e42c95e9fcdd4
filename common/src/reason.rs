//! Why a bridge fell short or was not tried: the one vocabulary of both
//! daemons. Each reason maps, here and nowhere else, to its proto value, its
//! label (the `X-PD-Bridge` verdict's `reason` and the metrics' `reason`
//! label), and the HTTP status the front door answers with when a client
//! required the bridge (`X-PD-Bridge-Mode: bridge`) and this reason stopped it.
//!
//! A gRPC status names its reason in its details (`grpc-status-details-bin`):
//! an encoded `StatusDetails` (the proto documents it); the code alone cannot
//! say which of several refusals a status is.

use bytes::Bytes;
use prost::Message;

use crate::proto;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    Requested,
    Disabled,
    ShortPrompt,
    PrefillUnavailable,
    DecoderUnreachable,
    SpecMismatch,
    UnsupportedModel,
    PrefillFailed,
    TransferFailed,
    Timeout,
    Evicted,
    BadRequest,
    Cancelled,
    NotWorthIt,
}

impl Reason {
    pub const ALL: [Reason; 14] = [
        Reason::Requested,
        Reason::Disabled,
        Reason::ShortPrompt,
        Reason::PrefillUnavailable,
        Reason::DecoderUnreachable,
        Reason::SpecMismatch,
        Reason::UnsupportedModel,
        Reason::PrefillFailed,
        Reason::TransferFailed,
        Reason::Timeout,
        Reason::Evicted,
        Reason::BadRequest,
        Reason::Cancelled,
        Reason::NotWorthIt,
    ];

    /// As the verdict and the metrics say it: the proto name, lower-case,
    /// without its prefix.
    pub fn label(self) -> &'static str {
        match self {
            Reason::Requested => "requested",
            Reason::Disabled => "disabled",
            Reason::ShortPrompt => "short_prompt",
            Reason::PrefillUnavailable => "prefill_unavailable",
            Reason::DecoderUnreachable => "decoder_unreachable",
            Reason::SpecMismatch => "spec_mismatch",
            Reason::UnsupportedModel => "unsupported_model",
            Reason::PrefillFailed => "prefill_failed",
            Reason::TransferFailed => "transfer_failed",
            Reason::Timeout => "timeout",
            Reason::Evicted => "evicted",
            Reason::BadRequest => "bad_request",
            Reason::Cancelled => "cancelled",
            Reason::NotWorthIt => "not_worth_it",
        }
    }

    pub fn to_proto(self) -> proto::Reason {
        match self {
            Reason::Requested => proto::Reason::Requested,
            Reason::Disabled => proto::Reason::Disabled,
            Reason::ShortPrompt => proto::Reason::ShortPrompt,
            Reason::PrefillUnavailable => proto::Reason::PrefillUnavailable,
            Reason::DecoderUnreachable => proto::Reason::DecoderUnreachable,
            Reason::SpecMismatch => proto::Reason::SpecMismatch,
            Reason::UnsupportedModel => proto::Reason::UnsupportedModel,
            Reason::PrefillFailed => proto::Reason::PrefillFailed,
            Reason::TransferFailed => proto::Reason::TransferFailed,
            Reason::Timeout => proto::Reason::Timeout,
            Reason::Evicted => proto::Reason::Evicted,
            Reason::BadRequest => proto::Reason::BadRequest,
            Reason::Cancelled => proto::Reason::Cancelled,
            Reason::NotWorthIt => proto::Reason::NotWorthIt,
        }
    }

    /// None for `REASON_UNSPECIFIED` (nothing fell short).
    pub fn from_proto(reason: proto::Reason) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.to_proto() == reason)
    }

    /// A gRPC status whose details carry this reason.
    pub fn status(self, code: tonic::Code, message: impl Into<String>) -> tonic::Status {
        tonic::Status::with_details(code, message, self.to_details())
    }

    /// The reason a gRPC status carries in its details; None without one (a
    /// peer that predates them, or a failure of the call alone).
    pub fn of_status(status: &tonic::Status) -> Option<Reason> {
        Reason::from_details(status.details())
    }

    fn to_details(self) -> Bytes {
        proto::StatusDetails { reason: self.to_proto() as i32 }.encode_to_vec().into()
    }

    /// None for empty or foreign details and for values this build does not know.
    fn from_details(details: &[u8]) -> Option<Reason> {
        let details = proto::StatusDetails::decode(details).ok()?;
        Reason::from_proto(proto::Reason::try_from(details.reason).ok()?)
    }

    /// The front door's status when the client required the bridge and this
    /// reason stopped it: the client's own mistake is a 400, a deadline a
    /// 504, anything upstream a 502.
    pub fn http_status(self) -> u16 {
        match self {
            Reason::BadRequest => 400,
            Reason::Timeout => 504,
            _ => 502,
        }
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.label())
    }
}

impl serde::Serialize for Reason {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.label())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips_and_speaks_the_protos_name() {
        let mut labels = std::collections::HashSet::new();
        for reason in Reason::ALL {
            assert_eq!(Reason::from_proto(reason.to_proto()), Some(reason));
            assert!(labels.insert(reason.label()), "{reason:?}: label used twice");
            // The label is the proto value's name without its prefix, lower-case.
            let name = reason.to_proto().as_str_name();
            assert_eq!(name.strip_prefix("REASON_").unwrap().to_ascii_lowercase(), reason.label());
            assert!((400..600).contains(&reason.http_status()));
            assert_eq!(serde_json::to_value(reason).unwrap(), reason.label());
        }
        assert_eq!(Reason::from_proto(proto::Reason::Unspecified), None);
        // Every proto value but UNSPECIFIED has its Reason.
        let values = (0..64).filter_map(|n| proto::Reason::try_from(n).ok()).count();
        assert_eq!(values, Reason::ALL.len() + 1);
    }

    #[test]
    fn a_status_carries_its_reason_across_the_wire() {
        for reason in Reason::ALL {
            let sent = reason.status(tonic::Code::FailedPrecondition, "refused");
            // Through the trailers a peer reads, not just the struct.
            let mut trailers = tonic::metadata::MetadataMap::new().into_headers();
            sent.add_header(&mut trailers).unwrap();
            let received = tonic::Status::from_header_map(&trailers).unwrap();
            assert_eq!((received.code(), received.message()), (tonic::Code::FailedPrecondition, "refused"));
            assert_eq!(Reason::of_status(&received), Some(reason));
        }
        assert_eq!(Reason::SpecMismatch.to_details().as_ref(), [0x08, 6], "the encoding is the contract");
    }

    #[test]
    fn a_status_without_a_known_reason_carries_none() {
        assert_eq!(Reason::of_status(&tonic::Status::failed_precondition("old decoder")), None);
        // Details of another shape (a google.rpc.Status: field 2 a string), an unspecified or an
        // unknown value.
        let foreign = tonic::Status::with_details(tonic::Code::Internal, "x", Bytes::from_static(&[0x12, 1, b'x']));
        assert_eq!(Reason::of_status(&foreign), None);
        assert_eq!(Reason::from_details(&[0x08, 0]), None);
        assert_eq!(Reason::from_details(&[0x08, 63]), None);
        assert_eq!(Reason::from_details(&[0xff]), None);
    }
}
