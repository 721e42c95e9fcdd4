//! The daemons as processes: config errors, admin endpoints, gRPC health and
//! reflection over the wire, and shutdown on SIGTERM.

use std::time::Duration;

use pdbridge_tests::{Daemon, loopback_config, run_to_exit};
use tokio_stream::StreamExt;
use tonic_health::pb::{HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient};
use tonic_reflection::pb::v1::{
    ServerReflectionRequest, server_reflection_client::ServerReflectionClient,
    server_reflection_request::MessageRequest, server_reflection_response::MessageResponse,
};

const DAEMONS: [(&str, &str); 2] = [("prefilld", "pdbridge.v1.Prefiller"), ("decoded", "pdbridge.v1.CacheStore")];

async fn get(url: &str) -> (u16, String) {
    let response = reqwest::get(url).await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    (response.status().as_u16(), response.text().await.expect("body"))
}

#[tokio::test]
async fn admin_endpoints_report_alive_not_ready_and_metrics() {
    for (name, _) in DAEMONS {
        let daemon = Daemon::start(name, &loopback_config(name, "5s")).await;

        let (status, _) = get(&daemon.admin_url("/healthz")).await;
        assert_eq!(status, 200, "{name} /healthz");

        let (status, body) = get(&daemon.admin_url("/readyz")).await;
        assert_eq!(status, 503, "{name} /readyz must refuse while no engine is ready: {body}");

        let (status, body) = get(&daemon.admin_url("/metrics")).await;
        assert_eq!(status, 200);
        let build_info =
            format!("pdbridge_build_info{{daemon=\"{name}\",version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"));
        assert!(body.contains(&build_info), "{name} /metrics lacks `{build_info}`:\n{body}");
        assert!(body.contains("# TYPE pdbridge_build_info gauge"), "{body}");

        let (status, _) = get(&daemon.admin_url("/nope")).await;
        assert_eq!(status, 404);
    }
}

#[tokio::test]
async fn grpc_health_is_not_serving_until_the_engine_is_ready() {
    for (name, service) in DAEMONS {
        let daemon = Daemon::start(name, &loopback_config(name, "5s")).await;
        let mut health = HealthClient::new(daemon.channel().await);
        for probe in ["", service] {
            let reply = health.check(HealthCheckRequest { service: probe.into() }).await.expect("check").into_inner();
            assert_eq!(reply.status(), ServingStatus::NotServing, "{name} health of {probe:?}");
        }
        let unknown = health.check(HealthCheckRequest { service: "no.such.Service".into() }).await;
        assert_eq!(unknown.unwrap_err().code(), tonic::Code::NotFound);
    }
}

#[tokio::test]
async fn reflection_lists_both_services_and_health() {
    for (name, _) in DAEMONS {
        let daemon = Daemon::start(name, &loopback_config(name, "5s")).await;
        let mut client = ServerReflectionClient::new(daemon.channel().await);
        let request = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut replies =
            client.server_reflection_info(tokio_stream::iter([request])).await.expect("reflect").into_inner();
        let reply = replies.next().await.expect("one reply").expect("ok");
        let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
            panic!("{name}: unexpected reflection reply {reply:?}");
        };
        let names: Vec<_> = list.service.into_iter().map(|s| s.name).collect();
        for want in ["pdbridge.v1.CacheStore", "pdbridge.v1.Prefiller", "grpc.health.v1.Health"] {
            assert!(names.iter().any(|n| n == want), "{name} reflection lacks {want}: {names:?}");
        }
    }
}

#[tokio::test]
async fn rpcs_refuse_with_unavailable_while_the_engine_is_not_ready() {
    use pdbridge_common::proto::{
        GetSpecRequest, PrefillRequest, cache_store_client::CacheStoreClient, prefiller_client::PrefillerClient,
    };
    let decoded = Daemon::start("decoded", &loopback_config("decoded", "5s")).await;
    let err =
        CacheStoreClient::connect(decoded.grpc_uri()).await.unwrap().get_spec(GetSpecRequest {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");

    let config = loopback_config("prefilld", "5s") + &pdbridge_tests::decoders(&[decoded.grpc_uri()]);
    let prefilld = Daemon::start("prefilld", &config).await;
    let request = PrefillRequest { token_ids: vec![1, 2, 3], decoder_addr: decoded.grpc_uri(), ..Default::default() };
    let err = PrefillerClient::connect(prefilld.grpc_uri()).await.unwrap().prefill(request).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err:?}");
}

#[tokio::test]
async fn invalid_config_exits_2_naming_the_key() {
    let scratch = pdbridge_tests::Scratch::new("badconfig");
    let bad_addr =
        scratch.write("bad.toml", "[server]\ngrpc_listen = \"not-an-address\"\nadmin_listen = \"127.0.0.1:0\"\n");
    // The server section both daemons share.
    let server = loopback_config("prefilld", "1s");
    let typo = scratch.write("typo.toml", &format!("{server}grpc_lisen = 1\n"));
    let good = scratch.write("good.toml", &server);
    let bad_addr = bad_addr.to_str().unwrap();
    let good = good.to_str().unwrap();

    /// Flags, environment, and the key the error must name.
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (vec!["--config", bad_addr], vec![], "server.grpc_listen"),
        (vec!["--config", typo.to_str().unwrap()], vec![], "grpc_lisen"),
        (vec!["--config", "/nonexistent/pdb.toml"], vec![], "/nonexistent/pdb.toml"),
        (vec![], vec![], "server"),
        (vec!["--config", good], vec![("PDB_SERVER__DRAIN_TIMEOUT", "soon")], "server.drain_timeout"),
        (vec!["--config", good, "--set", "server.http2.max_frame_bytes=7"], vec![], "server.http2.max_frame_bytes"),
    ];
    // decoded: an engine and a fixed spec at once.
    let decoded_server = loopback_config("decoded", "1s");
    let both =
        scratch.write("both.toml", &format!("spec_file = \"/spec.json\"\n{decoded_server}[engine]\nmodel = \"m\"\n"));
    let (status, stderr) = run_to_exit("decoded", &["--config", both.to_str().unwrap()], &[]).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("spec_file"), "{stderr}");
    for (name, _) in DAEMONS {
        for (args, env, key) in &cases {
            let (status, stderr) = run_to_exit(name, args, env).await;
            assert_eq!(status.code(), Some(2), "{name} {args:?} {env:?}: {stderr}");
            assert_eq!(stderr.trim().lines().count(), 1, "one line: {stderr}");
            assert!(stderr.contains(key), "{name} {args:?}: `{key}` not named in: {stderr}");
        }
    }
}

#[tokio::test]
async fn sigterm_exits_0_after_draining_within_the_deadline() {
    for (name, _) in DAEMONS {
        // An idle daemon exits at once.
        let mut daemon = Daemon::start(name, &loopback_config(name, "20s")).await;
        daemon.terminate();
        let status = daemon.wait(Duration::from_secs(15)).await;
        assert_eq!(status.code(), Some(0), "{name}: {}", daemon.log_text());

        // A stream that never ends (a health Watch) is cut at the drain deadline.
        let mut daemon = Daemon::start(name, &loopback_config(name, "2s")).await;
        let mut health = HealthClient::new(daemon.channel().await);
        let mut watch = health.watch(HealthCheckRequest { service: String::new() }).await.unwrap().into_inner();
        assert!(watch.next().await.is_some(), "first watch update");
        daemon.terminate();
        let status = daemon.wait(Duration::from_secs(10)).await;
        assert_eq!(status.code(), Some(0), "{name}: {}", daemon.log_text());
        assert!(daemon.log_text().contains("drain deadline passed"), "{name}: {}", daemon.log_text());
    }
}
