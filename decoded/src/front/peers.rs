//! The other decoders of this model (`[[front.peers]]`): which of them holds more of a prompt
//! than this store (their `Lookup`, the RPC prefilld asks), and a request forwarded to that one's
//! front door, its answer passed back as it streams with the verdict naming where it was served.
//! Several Macs so share their stores: a conversation's next turn that lands on the other Mac is
//! answered from the blocks its peer holds instead of being prefilled again.

use std::time::Duration;

use axum::{
    body::{Body, Bytes},
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header::CONTENT_TYPE},
    response::Response,
};
use pdbridge_common::{
    metric,
    proto::{LookupRequest, cache_store_client::CacheStoreClient},
    tls::{self, Tls},
    traces,
};
use serde_json::Value;
use tokio::{task::JoinSet, time::Instant};
use tonic::transport::Channel;

use super::verdict::VERDICT_HEADER;
use crate::config::FrontConfig;

/// Set on a forwarded request: its receiver serves it, never forwards it again.
pub const FORWARDED_HEADER: &str = "x-pd-bridge-forwarded";

/// What a client sent that a peer needs to answer it as this front door would.
const PASSED_HEADERS: [&str; 6] =
    ["authorization", "x-api-key", "anthropic-version", "x-pd-bridge-mode", "traceparent", "tracestate"];

/// What a peer's answer keeps on its way back.
const RETURNED_HEADERS: [&str; 3] = ["content-type", "cache-control", "retry-after"];

struct Peer {
    /// How verdicts and logs name it: its certificate identity, or its address.
    name: String,
    store: Channel,
    front: String,
}

pub struct Peers {
    peers: Vec<Peer>,
    http: reqwest::Client,
    lookup_timeout: Duration,
}

/// The peer that holds the most of a prompt, and how many of its whole blocks.
pub struct Holder<'a> {
    peer: &'a Peer,
    pub blocks: u32,
    asked: Instant,
}

#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    #[error("{0}")]
    Unreachable(#[from] reqwest::Error),
    /// Overloaded or failing: this decoder serves the request itself.
    #[error("answered {0}")]
    Declined(StatusCode),
}

impl Peers {
    pub fn new(config: &FrontConfig, tls: Option<&Tls>) -> Self {
        let peers = config
            .peers
            .iter()
            .filter_map(|p| match tls::endpoint(&p.addr, tls, p.name.as_deref()) {
                Ok(endpoint) => Some(Peer {
                    name: p.name.clone().unwrap_or_else(|| p.addr.clone()),
                    store: endpoint.tcp_nodelay(true).connect_lazy(),
                    front: p.front.trim_end_matches('/').to_owned(),
                }),
                Err(e) => {
                    tracing::error!(addr = p.addr, error = %e, "a peer cannot be dialed; not asking it");
                    None
                }
            })
            .collect();
        Peers { peers, http: reqwest::Client::new(), lookup_timeout: config.peer_lookup_timeout }
    }

    pub fn is_empty(&self) -> bool {
        self.peers.is_empty()
    }

    /// The peer holding the longest prefix of `tokens` (whole blocks of the spec
    /// `spec_fingerprint`), when it is longer than `cached`. A peer that fails or does not answer
    /// within `front.peer_lookup_timeout` holds nothing.
    pub async fn holding_more(&self, tokens: &[u32], spec_fingerprint: &str, cached: usize) -> Option<Holder<'_>> {
        let asked = Instant::now();
        let mut lookups = JoinSet::new();
        for (index, peer) in self.peers.iter().enumerate() {
            let request = LookupRequest { token_ids: tokens.to_vec(), spec_fingerprint: spec_fingerprint.to_owned() };
            let mut client = CacheStoreClient::new(peer.store.clone()).max_encoding_message_size(64 << 20);
            let timeout = self.lookup_timeout;
            lookups.spawn(async move { (index, tokio::time::timeout(timeout, client.lookup(request)).await) });
        }
        let mut best: Option<(usize, u32)> = None;
        while let Some(joined) = lookups.join_next().await {
            // A lookup task cannot panic short of a bug in tonic; the others still count.
            let Ok((index, answer)) = joined else { continue };
            let name = &self.peers[index].name;
            match answer {
                Ok(Ok(reply)) => {
                    let blocks = reply.get_ref().cached_blocks;
                    if blocks as usize > cached && best.is_none_or(|(_, most)| blocks > most) {
                        best = Some((index, blocks));
                    }
                }
                Ok(Err(status)) => tracing::warn!(peer = name, error = status.message(), "peer lookup failed"),
                Err(_) => tracing::warn!(peer = name, "peer lookup unanswered within front.peer_lookup_timeout"),
            }
        }
        best.map(|(index, blocks)| Holder { peer: &self.peers[index], blocks, asked })
    }

    /// Sends the client's request (`path`, its `headers`, its `body` as sent) to `holder`'s front
    /// door and returns its answer, streamed as it comes, its verdict saying where it was served.
    pub async fn forward(
        &self,
        holder: &Holder<'_>,
        path: &str,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> Result<Response, ForwardError> {
        let request = self.http.post(format!("{}{path}", holder.peer.front)).body(body.clone());
        let mut request = request.header(CONTENT_TYPE, "application/json");
        for name in PASSED_HEADERS {
            if let Some(value) = headers.get(name) {
                request = request.header(name, value);
            }
        }
        // With tracing on, the peer continues this request's span rather than the client's.
        let mut trace = HeaderMap::new();
        traces::inject_http(&tracing::Span::current(), &mut trace);
        let answer = request.headers(trace).header(FORWARDED_HEADER, "1").send().await?;
        let status = answer.status();
        if status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error() {
            return Err(ForwardError::Declined(status));
        }
        let mut response = Response::builder().status(status);
        for name in RETURNED_HEADERS {
            if let Some(value) = answer.headers().get(name) {
                response = response.header(name, value);
            }
        }
        let verdict = answer.headers().get(VERDICT_HEADER);
        if let Some(verdict) = verdict.and_then(|v| served_by(v, &holder.peer.name, holder.asked.elapsed())) {
            response = response.header(HeaderName::from_static(VERDICT_HEADER), verdict);
        }
        metrics::counter!(metric::FRONT_FORWARDED.name, "peer" => holder.peer.name.clone()).increment(1);
        let response = response.body(Body::new(reqwest::Body::from(answer)));
        Ok(response.expect("a status and headers taken from a valid response"))
    }
}

impl Holder<'_> {
    pub fn name(&self) -> &str {
        &self.peer.name
    }
}

/// The peer's verdict, naming the peer that served it and the time this front door spent asking
/// it until its answer began (`peer_forward`).
fn served_by(verdict: &HeaderValue, peer: &str, forwarding: Duration) -> Option<HeaderValue> {
    let mut verdict: Value = serde_json::from_slice(verdict.as_bytes()).ok()?;
    let fields = verdict.as_object_mut()?;
    fields.insert("served_by".into(), peer.into());
    if let Some(timings) = fields.get_mut("timings_ms").and_then(Value::as_object_mut) {
        timings.insert("peer_forward".into(), (forwarding.as_secs_f64() * 1e3).into());
    }
    HeaderValue::from_str(&verdict.to_string()).ok()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_forwarded_verdict_names_its_peer_and_keeps_the_peers_fields() {
        let verdict = json!({"outcome": "cached", "cached_tokens": 640, "timings_ms": {"tokenize": 2.0}});
        let header = HeaderValue::from_str(&verdict.to_string()).unwrap();
        let named = served_by(&header, "mac-2", Duration::from_millis(12)).unwrap();
        let named: Value = serde_json::from_slice(named.as_bytes()).unwrap();
        assert_eq!(named["served_by"], "mac-2");
        assert_eq!((&named["outcome"], &named["cached_tokens"]), (&json!("cached"), &json!(640)));
        assert_eq!(named["timings_ms"], json!({"tokenize": 2.0, "peer_forward": 12.0}));
        // What is not a verdict is not passed on as one.
        assert!(served_by(&HeaderValue::from_static("bridged"), "mac-2", Duration::ZERO).is_none());
    }
}
