//! Per-request metrics for an HTTP server clients reach, in OpenTelemetry's HTTP semantic
//! conventions as Prometheus names them (`http_server_request_duration_seconds`, labelled
//! `http_request_method` / `http_route` / `http_response_status_code`; its `_count` is the request
//! counter). Applied with `Router::layer`, it runs after routing, so the route is the pattern
//! matched (`/v1/chat/completions`), never a client's path; a streamed answer lasts until its end.

use axum::extract::MatchedPath;
use http::{HeaderMap, Method, Request, StatusCode};

use super::metered::{End, Meter};
use crate::metric;

/// The method as a label: the standard ones by name, any other as `_OTHER` (the convention's
/// bound on what clients can make up).
fn method_label(method: &Method) -> &'static str {
    const KNOWN: [Method; 9] = [
        Method::GET,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::HEAD,
        Method::OPTIONS,
        Method::PATCH,
        Method::CONNECT,
        Method::TRACE,
    ];
    KNOWN.iter().find(|known| *known == method).map_or("_OTHER", |known| known.as_str())
}

/// Times every request of the router it is layered on (`MeterLayer(HttpMeter)`).
#[derive(Clone, Copy, Debug, Default)]
pub struct HttpMeter;

impl Meter for HttpMeter {
    /// The method's label and the matched route.
    type Call = (&'static str, String);
    type Answer = (&'static str, String, StatusCode);

    fn start<B>(&self, request: &Request<B>) -> Self::Call {
        let route = request.extensions().get::<MatchedPath>().map_or("unmatched".to_owned(), |m| m.as_str().to_owned());
        (method_label(request.method()), route)
    }

    fn answered((method, route): Self::Call, status: StatusCode, _: &HeaderMap) -> Self::Answer {
        (method, route, status)
    }

    fn finished((method, route, status): Self::Answer, _: End<'_>, seconds: f64) {
        let labels = [
            ("http_request_method", method.to_owned()),
            ("http_route", route),
            ("http_response_status_code", status.as_u16().to_string()),
        ];
        metrics::histogram!(metric::HTTP_REQUEST_DURATION.name, &labels).record(seconds);
    }
}
