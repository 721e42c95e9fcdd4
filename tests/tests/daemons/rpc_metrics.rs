//! Every RPC and every front-door request is counted and timed by the servers' shared layers, under
//! the names operators already chart: `grpc_server_handled_total` by method and code (a refusal by
//! the access rules under the code it got), `grpc_server_handling_seconds`, and
//! `http_server_request_duration_seconds` by route and status.

use std::time::Duration;

use pdbridge_common::proto::{GetSpecRequest, LookupRequest, PushOpen, cache_store_client::CacheStoreClient};
use pdbridge_tests::{
    Daemon, Pki, Scratch,
    cache_store::{block_shards, frames, push},
    fixed_spec_config,
};
use tonic_health::pb::{HealthCheckRequest, health_client::HealthClient};

const BLOCK_TOKENS: u32 = 16;
const STORE: &str = "pdbridge.v1.CacheStore";

/// The series of `metric` for one RPC, with more labels after the RPC's own.
fn rpc_series(metric: &str, service: &str, method: &str, kind: &str, more: &str) -> String {
    format!("{metric}{{grpc_service=\"{service}\",grpc_method=\"{method}\",grpc_type=\"{kind}\"{more}}}")
}

fn handled(service: &str, method: &str, kind: &str, code: &str) -> String {
    rpc_series("grpc_server_handled_total", service, method, kind, &format!(",grpc_code=\"{code}\""))
}

fn handling_count(service: &str, method: &str, kind: &str) -> String {
    rpc_series("grpc_server_handling_seconds_count", service, method, kind, "")
}

fn front_count(route: &str, status: u16) -> String {
    format!(
        "http_server_request_duration_seconds_count{{http_request_method=\"GET\",http_route=\"{route}\",\
         http_response_status_code=\"{status}\"}}"
    )
}

#[tokio::test]
async fn rpcs_and_front_door_requests_are_counted_by_method_and_code() {
    let scratch = Scratch::new("rpc-metrics");
    let pki = Pki::new(&["prefill-1", "mac-1", "intruder"]).await;
    let key_file = scratch.write("keys", "sk-metrics-5c2e\n");
    let extra = format!("[front]\nlisten = \"127.0.0.1:0\"\napi_keys_file = {key_file:?}\n");
    let config = fixed_spec_config(
        &scratch.0.join("spec"),
        &scratch.0.join("store"),
        BLOCK_TOKENS,
        &pki.section("mac-1", &["prefill-1"]),
    )
    .replace("[front]\nlisten = \"127.0.0.1:0\"\n", &extra);
    let decoded = Daemon::start("decoded", &config).await;

    // A successful Push and Lookup from the configured prefiller; a Push the access rules refuse.
    let prefiller = decoded.channel_as(Some(&pki.client("prefill-1")), "mac-1").await.unwrap();
    let mut client = CacheStoreClient::new(prefiller.clone());
    let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let tokens: Vec<u32> = (0..BLOCK_TOKENS).collect();
    let push_frames = || {
        let open = PushOpen {
            request_id: "metered".into(),
            spec_fingerprint: spec.spec_fingerprint.clone(),
            token_ids: tokens.clone(),
            ..Default::default()
        };
        frames(open, block_shards(&spec, 0, 7), Some(1))
    };
    assert_eq!(push(&mut client, push_frames()).await.unwrap().blocks_committed, 1);
    let lookup = client.lookup(LookupRequest { token_ids: tokens.clone(), ..Default::default() }).await.unwrap();
    assert_eq!(lookup.into_inner().cached_blocks, 1);
    let intruder = decoded.channel_as(Some(&pki.client("intruder")), "mac-1").await.unwrap();
    let refused = push(&mut CacheStoreClient::new(intruder), push_frames()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::PermissionDenied);
    let health = HealthClient::new(prefiller).check(HealthCheckRequest { service: STORE.into() }).await;
    assert!(health.is_ok(), "{health:?}");

    // The front door: 401 without the key, 200 with it.
    let models = format!("http://{}/v1/models", decoded.front.unwrap());
    let http = reqwest::Client::new();
    assert_eq!(http.get(&models).send().await.unwrap().status().as_u16(), 401);
    let answered = http.get(&models).bearer_auth("sk-metrics-5c2e").send().await.unwrap();
    assert_eq!(answered.status().as_u16(), 200);
    let request_id = answered.headers().get("x-request-id").map(|id| id.to_str().unwrap().to_owned());
    assert!(request_id.is_some_and(|id| id.starts_with("req-")), "{:?}", answered.headers());
    let echoed = http.get(&models).bearer_auth("sk-metrics-5c2e").header("x-request-id", "client-chose-this");
    let echoed = echoed.send().await.unwrap();
    assert_eq!(echoed.headers()["x-request-id"], "client-chose-this");

    // Each counted once under its method or route and code, and timed. A series is written when
    // its answer's body ends, just after the client has it: wait for each.
    let limit = Duration::from_secs(10);
    for (series, count) in [
        (handled(STORE, "Push", "client_stream", "OK"), 1.0),
        (handled(STORE, "Push", "client_stream", "PermissionDenied"), 1.0),
        (handling_count(STORE, "Push", "client_stream"), 2.0),
        (handled(STORE, "Lookup", "unary", "OK"), 1.0),
        (handling_count(STORE, "Lookup", "unary"), 1.0),
        (handled(STORE, "GetSpec", "unary", "OK"), 1.0),
        (handled("grpc.health.v1.Health", "Check", "unary", "OK"), 1.0),
        (front_count("/v1/models", 401), 1.0),
        (front_count("/v1/models", 200), 2.0),
    ] {
        decoded.wait_metric_where(&series, &format!("{count}"), |v| v == count, limit).await;
    }
    let started = rpc_series("grpc_server_started_total", STORE, "Push", "client_stream", "");
    assert_eq!(decoded.metric(&started).await, Some(2.0));
    let text = reqwest::get(decoded.admin_url("/metrics")).await.unwrap().text().await.unwrap();
    let bucket = "grpc_server_handling_seconds_bucket{grpc_service=\"pdbridge.v1.CacheStore\",grpc_method=\"Push\"";
    assert!(text.contains(bucket), "Push's latency histogram has buckets:\n{text}");
}
