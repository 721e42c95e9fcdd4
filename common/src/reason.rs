//! Why a bridge fell short or was not tried: the one vocabulary of both
//! daemons. Each reason maps, here and nowhere else, to its proto value, its
//! label (the `X-PD-Bridge` verdict's `reason` and the metrics' `reason`
//! label), and the HTTP status the front door answers with when a client
//! required the bridge (`X-PD-Bridge-Mode: bridge`) and this reason stopped it.

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
}

impl Reason {
    pub const ALL: [Reason; 13] = [
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
        }
    }

    /// None for `REASON_UNSPECIFIED` (nothing fell short).
    pub fn from_proto(reason: proto::Reason) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.to_proto() == reason)
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
}
