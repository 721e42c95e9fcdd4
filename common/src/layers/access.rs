//! Who may call each RPC, decided in one layer before any handler runs: a daemon lists every RPC
//! of its services with its [`Access`], and an RPC of those services with no rule is refused, so a
//! new RPC cannot be served without choosing (each daemon's tests also hold its rules to its
//! services' descriptors). Health and reflection are open, for monitors and grpcurl.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::{Request, Response};
use tonic::{
    Status,
    transport::server::{TcpConnectInfo, TlsConnectInfo},
};
use tower::{Layer, Service};

use crate::tls::{AuthError, Peers};

/// Who may call an RPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Anyone who reaches the port.
    Anyone,
    /// A client certificate signed by the deployment's CA, whatever its identity.
    Certified,
    /// A client certificate naming one of `tls.peers`.
    Peer,
}

/// A daemon's RPCs, by full path (`/pdbridge.v1.CacheStore/Push`), with who may call each.
pub type Rules = &'static [(&'static str, Access)];

/// Services every caller may use.
const OPEN_SERVICES: [&str; 3] =
    ["/grpc.health.v1.Health/", "/grpc.reflection.v1.ServerReflection/", "/grpc.reflection.v1alpha.ServerReflection/"];

/// The identity of the caller an RPC admitted (in the request's extensions): `None` without TLS or
/// where the rule asks for none.
#[derive(Clone, Debug)]
pub struct Caller(pub Option<String>);

/// Applies `rules` with `peers` (open without TLS: every caller passes).
#[derive(Clone)]
pub struct AccessLayer {
    peers: Peers,
    rules: Rules,
}

impl AccessLayer {
    pub fn new(peers: Peers, rules: Rules) -> Self {
        AccessLayer { peers, rules }
    }

    /// The rule for `path`: its own, an open service's, or refused (`Err`) when its service is one
    /// of the daemon's but the RPC has none; `Ok(None)` for a path of no service served here.
    fn rule(&self, path: &str) -> Result<Option<Access>, Status> {
        if let Some((_, access)) = self.rules.iter().find(|(rule, _)| *rule == path) {
            return Ok(Some(*access));
        }
        if OPEN_SERVICES.iter().any(|service| path.starts_with(service)) {
            return Ok(Some(Access::Anyone));
        }
        match self.rules.iter().any(|(rule, _)| service_of(rule) == service_of(path)) {
            true => Err(Status::permission_denied(format!("{path} has no access rule"))),
            false => Ok(None),
        }
    }

    fn admit<B>(&self, request: &Request<B>) -> Result<Caller, Status> {
        let certs =
            || request.extensions().get::<TlsConnectInfo<TcpConnectInfo>>().and_then(TlsConnectInfo::peer_certs);
        let checked: Result<Option<String>, AuthError> = match self.rule(request.uri().path())? {
            None | Some(Access::Anyone) => Ok(None),
            Some(Access::Certified) => self.peers.authenticated(certs().as_deref().map(Vec::as_slice)),
            Some(Access::Peer) => self.peers.authorized(certs().as_deref().map(Vec::as_slice)),
        };
        checked.map(Caller).map_err(Status::from)
    }
}

/// `/pdbridge.v1.CacheStore` of `/pdbridge.v1.CacheStore/Push`.
fn service_of(path: &str) -> Option<&str> {
    path.rsplit_once('/').map(|(service, _)| service)
}

/// The RPCs of `service` (`pdbridge.v1.CacheStore`, as its descriptor declares them) that `rules`
/// say nothing about, for each daemon's tests.
pub fn without_rule(rules: Rules, service: &str) -> Vec<String> {
    let ruled = |path: &String| rules.iter().any(|(rule, _)| rule == path);
    super::grpc_metrics::paths_of(service).into_iter().filter(|path| !ruled(path)).collect()
}

impl<S> Layer<S> for AccessLayer {
    type Service = AccessControl<S>;

    fn layer(&self, inner: S) -> AccessControl<S> {
        AccessControl { layer: self.clone(), inner }
    }
}

/// [`AccessLayer`] around a server's routes.
#[derive(Clone)]
pub struct AccessControl<S> {
    layer: AccessLayer,
    inner: S,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for AccessControl<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        match self.layer.admit(&request) {
            Ok(caller) => {
                request.extensions_mut().insert(caller);
                Box::pin(self.inner.call(request))
            }
            Err(refused) => Box::pin(std::future::ready(Ok(refused.into_http()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: Rules = &[("/pdbridge.v1.Test/Write", Access::Peer), ("/pdbridge.v1.Test/Read", Access::Anyone)];

    #[test]
    fn an_rpc_of_a_served_service_without_a_rule_is_refused() {
        let layer = AccessLayer::new(Peers::open(), RULES);
        assert_eq!(layer.rule("/pdbridge.v1.Test/Write").unwrap(), Some(Access::Peer));
        assert_eq!(layer.rule("/grpc.health.v1.Health/Check").unwrap(), Some(Access::Anyone));
        assert_eq!(layer.rule("/other.Service/Call").unwrap(), None);
        let refused = layer.rule("/pdbridge.v1.Test/Erase").unwrap_err();
        assert_eq!(refused.code(), tonic::Code::PermissionDenied);
        assert!(refused.message().contains("no access rule"), "{}", refused.message());
        assert_eq!(without_rule(&[], "pdbridge.v1.Prefiller"), ["/pdbridge.v1.Prefiller/Prefill"]);
    }
}
