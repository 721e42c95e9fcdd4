//! The tower layers both daemons' servers are built through, one per concern: per-RPC and
//! per-route metrics, access rules for RPCs, and request ids on the front door. Each server applies
//! them in one place (`daemon::serve_rpc` for gRPC, [`front`] for the HTTP door clients reach).

pub mod access;
pub mod grpc_metrics;
pub mod http_metrics;
pub mod metered;

use http::{HeaderValue, Request};
use tower_http::request_id::{MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer};

/// A request id for a request that came without `x-request-id`.
#[derive(Clone, Copy, Debug, Default)]
struct NewRequestId;

impl MakeRequestId for NewRequestId {
    fn make_request_id<B>(&mut self, _request: &Request<B>) -> Option<RequestId> {
        HeaderValue::from_str(&crate::request_id::new("req")).ok().map(RequestId::new)
    }
}

/// An HTTP router clients reach, with its layers: per-route metrics, and an `x-request-id` on
/// every request (the client's own, else a new one) echoed on its answer.
pub fn front(router: axum::Router) -> axum::Router {
    router
        .layer(metered::MeterLayer(http_metrics::HttpMeter))
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(NewRequestId))
}
