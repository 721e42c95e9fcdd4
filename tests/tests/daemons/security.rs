//! Who may do what, tried as an attacker on the LAN would: without a certificate, with one
//! of the right CA but the wrong identity, with one of another CA, in plain text. Each is
//! refused with its status and leaves the store as it was; the configured peer gets through.
//! The front door wants an API key when one is configured, and no listener is exposed to
//! other hosts unauthenticated unless `server.insecure` says so.

use std::{path::Path, time::Duration};

use pdbridge_common::proto::{
    GetBundleRequest, GetSpecRequest, LookupRequest, PrefillRequest, PushOpen, cache_store_client::CacheStoreClient,
    prefiller_client::PrefillerClient,
};
use pdbridge_tests::{
    Daemon, Pki, Reserved, Scratch,
    cache_store::{block_shards, frames, push},
    decoders, fixed_spec_config, loopback_config, run_to_exit,
};
use serde_json::Value;
use tonic::{
    Code,
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint},
};

const BLOCK_TOKENS: u32 = 16;

/// Block files in the store (committed or not).
fn files_under(dir: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries.flatten().map(|entry| if entry.path().is_dir() { files_under(&entry.path()) } else { 1 }).sum()
}

/// A TLS client that trusts the CA but presents no certificate of its own.
async fn anonymous(daemon: &Daemon, pki: &Pki, identity: &str) -> Channel {
    let ca = Certificate::from_pem(std::fs::read(pki.dir.join("ca.pem")).unwrap());
    let tls = ClientTlsConfig::new().ca_certificate(ca).domain_name(identity);
    Endpoint::from_shared(daemon.grpc_uri()).unwrap().tls_config(tls).unwrap().connect().await.unwrap()
}

#[tokio::test]
async fn only_the_configured_prefiller_may_write_or_read_the_decoders_cache() {
    let scratch = Scratch::new("security-store");
    let pki = Pki::new(&["prefill-1", "mac-1", "intruder"]).await;
    let store = scratch.0.join("store");
    let tls = pki.section("mac-1", &["prefill-1"]);
    let decoded =
        Daemon::start("decoded", &fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, &tls)).await;
    let prefiller = decoded.channel_as(Some(&pki.client("prefill-1")), "mac-1").await.unwrap();
    let spec = CacheStoreClient::new(prefiller.clone()).get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let tokens: Vec<u32> = (0..BLOCK_TOKENS).collect();
    // A fabricated block with valid CRCs for a prompt whose keys anyone can compute.
    let poison = || {
        let open = PushOpen {
            request_id: "poison".into(),
            spec_fingerprint: spec.spec_fingerprint.clone(),
            token_ids: tokens.clone(),
            first_block: 0,
            tail_tokens: 0,
            ..Default::default()
        };
        frames(open, block_shards(&spec, 0, 66), Some(1))
    };
    let all_rpcs = |channel: Channel| {
        let (tokens, poison) = (tokens.clone(), poison());
        async move {
            let mut client = CacheStoreClient::new(channel);
            let push = push(&mut client, poison).await.map(drop);
            let lookup = client.lookup(LookupRequest { token_ids: tokens, ..Default::default() }).await.map(drop);
            let bundle = client.get_bundle(GetBundleRequest::default()).await.map(drop);
            [("Push", push), ("Lookup", lookup), ("GetBundle", bundle)]
        }
    };

    // No client certificate: UNAUTHENTICATED; the spec is readable by certified peers only.
    let anonymous = anonymous(&decoded, &pki, "mac-1").await;
    for (rpc, result) in all_rpcs(anonymous.clone()).await {
        assert_eq!(result.unwrap_err().code(), Code::Unauthenticated, "{rpc}");
    }
    let spec_err = CacheStoreClient::new(anonymous).get_spec(GetSpecRequest {}).await.unwrap_err();
    assert_eq!(spec_err.code(), Code::Unauthenticated);

    // The deployment's CA, but not a configured prefiller: PERMISSION_DENIED (the spec it may read).
    let intruder = decoded.channel_as(Some(&pki.client("intruder")), "mac-1").await.unwrap();
    for (rpc, result) in all_rpcs(intruder.clone()).await {
        let err = result.unwrap_err();
        assert_eq!(err.code(), Code::PermissionDenied, "{rpc}: {err:?}");
        assert!(err.message().contains("intruder"), "{rpc}: {}", err.message());
    }
    assert!(CacheStoreClient::new(intruder).get_spec(GetSpecRequest {}).await.is_ok());

    // A certificate with the right name from another CA: no connection at all.
    let forger = Pki::new(&["prefill-1"]).await;
    let forged = decoded.channel_as(Some(&forger.client("prefill-1")), "mac-1").await;
    assert!(forged.is_err(), "a certificate of another CA must not connect");
    // Plain HTTP/2 to the TLS port: nothing is served.
    let plain = Endpoint::from_shared(format!("http://{}", decoded.grpc)).unwrap().connect_lazy();
    assert!(CacheStoreClient::new(plain).get_spec(GetSpecRequest {}).await.is_err());

    assert_eq!(files_under(&store.join("blocks")), 0, "no refused Push wrote anything");
    let mut client = CacheStoreClient::new(prefiller);
    let lookup = client.lookup(LookupRequest { token_ids: tokens.clone(), ..Default::default() }).await.unwrap();
    assert_eq!(lookup.into_inner().cached_blocks, 0);

    // The configured prefiller writes; token ids outside the vocabulary are refused first.
    let mut bad = poison();
    if let Some(pdbridge_common::proto::push_frame::Frame::Open(open)) = &mut bad[0].frame {
        open.token_ids[3] = spec.vocab_size;
    }
    let err = push(&mut client, bad).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("outside the vocabulary"), "{}", err.message());
    let receipt = push(&mut client, poison()).await.unwrap();
    assert_eq!(receipt.blocks_committed, 1, "{}", receipt.detail);
    for (rpc, kind) in [("Push", "client_stream"), ("Lookup", "unary"), ("GetBundle", "server_stream")] {
        let refusals = format!(
            "grpc_server_handled_total{{grpc_service=\"pdbridge.v1.CacheStore\",grpc_method=\"{rpc}\",\
             grpc_type=\"{kind}\",grpc_code=\"PermissionDenied\"}}"
        );
        assert_eq!(decoded.metric(&refusals).await, Some(1.0), "{refusals}");
    }
}

#[tokio::test]
async fn only_configured_decoders_may_start_a_prefill_and_only_to_themselves() {
    let pki = Pki::new(&["prefill-1", "mac-1", "intruder"]).await;
    let decoder = "https://127.0.0.1:1";
    let config = loopback_config("prefilld", "5s")
        + &format!("[[decoders]]\naddr = {decoder:?}\nname = \"mac-1\"\n")
        + &pki.section("prefill-1", &["mac-1"]);
    let prefilld = Daemon::start("prefilld", &config).await;
    let request = |decoder_addr: &str| PrefillRequest {
        token_ids: vec![1, 2, 3],
        decoder_addr: decoder_addr.into(),
        ..Default::default()
    };
    let call = |channel: Channel, decoder_addr: &str| {
        let request = request(decoder_addr);
        async move { PrefillerClient::new(channel).prefill(request).await.map(drop).unwrap_err() }
    };
    let anonymous = anonymous(&prefilld, &pki, "prefill-1").await;
    assert_eq!(call(anonymous, "").await.code(), Code::Unauthenticated);
    let intruder = prefilld.channel_as(Some(&pki.client("intruder")), "prefill-1").await.unwrap();
    assert_eq!(call(intruder, "").await.code(), Code::PermissionDenied);

    // The configured decoder may not point prefilld anywhere else (it would dial it).
    let decoder_channel = prefilld.channel_as(Some(&pki.client("mac-1")), "prefill-1").await.unwrap();
    let err = call(decoder_channel.clone(), "http://10.0.0.9:7070").await;
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("not one of prefilld's [[decoders]]"), "{}", err.message());
    // Authorized and pointing at itself: past every check, to the engine (none here).
    assert_eq!(call(decoder_channel.clone(), decoder).await.code(), Code::Unavailable);
    assert_eq!(call(decoder_channel, "").await.code(), Code::Unavailable);
    // Each counted under the code it got, whether the access rules or the handler refused it.
    for (code, count) in [("Unauthenticated", 1.0), ("PermissionDenied", 2.0), ("Unavailable", 2.0)] {
        let series = format!(
            "grpc_server_handled_total{{grpc_service=\"pdbridge.v1.Prefiller\",grpc_method=\"Prefill\",\
             grpc_type=\"server_stream\",grpc_code=\"{code}\"}}"
        );
        prefilld.wait_metric_where(&series, &format!("{count}"), |v| v == count, Duration::from_secs(10)).await;
    }
}

#[tokio::test]
async fn the_front_door_wants_an_api_key_when_configured() {
    let scratch = Scratch::new("security-keys");
    let key_file = scratch.write("keys", "# one key per line\nsk-from-file-7b1d\n");
    let extra = format!("[front]\nlisten = \"127.0.0.1:0\"\napi_keys_file = {key_file:?}\nmax_body_bytes = 4096\n");
    let config = fixed_spec_config(&scratch.0.join("spec"), &scratch.0.join("store"), BLOCK_TOKENS, "")
        .replace("[front]\nlisten = \"127.0.0.1:0\"\n", &extra);
    let env_key = "sk-from-env-93fa";
    let decoded = Daemon::start_with_env("decoded", &config, &[("PDB_FRONT__API_KEYS", env_key)]).await;
    let base = format!("http://{}", decoded.front.unwrap());
    let client = reqwest::Client::new();
    let models = |key: Option<&str>| {
        let mut request = client.get(format!("{base}/v1/models"));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send()
    };
    for key in [None, Some("sk-wrong"), Some("")] {
        let response = models(key).await.unwrap();
        assert_eq!(response.status().as_u16(), 401, "{key:?}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key", "{body}");
        assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    }
    for key in [env_key, "sk-from-file-7b1d"] {
        assert_eq!(models(Some(key)).await.unwrap().status().as_u16(), 200, "{key}");
    }
    // Tokenize sits behind the same key (past it: 503, this decoded has no engine).
    let tokenize = |key: Option<&str>| {
        let mut request = client.post(format!("{base}/pd/v1/tokenize")).json(&serde_json::json!({"prompt": "hi"}));
        if let Some(key) = key {
            request = request.bearer_auth(key);
        }
        request.send()
    };
    assert_eq!(tokenize(None).await.unwrap().status().as_u16(), 401);
    // On Anthropic's Messages API the refusal is in Anthropic's shape, which its SDK reads.
    for path in ["/v1/messages", "/v1/messages/count_tokens"] {
        let response =
            client.post(format!("{base}{path}")).header("x-api-key", "sk-wrong").json(&serde_json::json!({}));
        let response = response.send().await.unwrap();
        assert_eq!(response.status().as_u16(), 401, "{path}");
        let body: Value = response.json().await.unwrap();
        assert_eq!(
            (&body["type"], &body["error"]["type"]),
            (&"error".into(), &"authentication_error".into()),
            "{body}"
        );
    }
    assert_eq!(tokenize(Some(env_key)).await.unwrap().status().as_u16(), 503);
    // Bodies beyond front.max_body_bytes: 413 in OpenAI's error shape.
    let huge = serde_json::json!({"messages": [{"role": "user", "content": "x".repeat(8192)}]});
    let response =
        client.post(format!("{base}/v1/chat/completions")).bearer_auth(env_key).json(&huge).send().await.unwrap();
    assert_eq!(response.status().as_u16(), 413);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    decoded.wait_metric("pdbridge_front_unauthorized_total", 6.0, Duration::from_secs(10)).await;
    assert!(!decoded.log_text().contains("sk-from"), "a key reached the log");
}

/// Slow clients are cut: a connection whose request headers have not all come within
/// `front.header_read_timeout` (one that sends nothing, one that dribbles them, one kept alive
/// after its answer) is closed; beyond `front.max_connections_per_peer` a connection is closed on
/// accept, and a place freed is taken again; a normal client is served after each.
#[tokio::test]
async fn slow_clients_are_cut_and_one_peer_holds_a_bounded_number_of_connections() {
    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpStream,
    };

    let scratch = Scratch::new("security-slow");
    // Two front doors, so that neither bound races the other on a busy machine: one cuts slow
    // headers after 3 s, one holds connections for 2 minutes but only 3 of them.
    let start = |name: &str, keys: &str| {
        let extra = format!("[front]\nlisten = \"127.0.0.1:0\"\n{keys}");
        let config =
            fixed_spec_config(&scratch.0.join(name), &scratch.0.join(format!("{name}-store")), BLOCK_TOKENS, "")
                .replace("[front]\nlisten = \"127.0.0.1:0\"\n", &extra);
        async move { Daemon::start("decoded", &config).await }
    };
    let cutting = start("cutting", "header_read_timeout = \"3s\"\n").await;
    let bounded = start("bounded", "header_read_timeout = \"120s\"\nmax_connections_per_peer = 3\n").await;
    let request = |front, extra: &'static str| async move {
        let mut conn = TcpStream::connect(front).await.unwrap();
        conn.write_all(format!("GET /v1/models HTTP/1.1\r\nhost: x\r\n{extra}\r\n").as_bytes()).await.unwrap();
        conn
    };
    // Closed by the server: the read ends (after whatever answer it was owed). A guard of 20
    // timeouts, so a daemon that never cuts fails the test instead of hanging it.
    let closed = |mut conn: TcpStream| async move {
        let mut seen = Vec::new();
        let started = std::time::Instant::now();
        let ended = tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut seen)).await;
        assert!(ended.is_ok(), "the connection stayed open for 20 s");
        (started.elapsed(), String::from_utf8_lossy(&seen).into_owned())
    };
    let served = |front| async move {
        let (_, answer) = closed(request(front, "connection: close\r\n").await).await;
        assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    };

    // Slow headers: a silent client, a dribbling one, and one kept alive after its answer.
    let front = cutting.front.unwrap();
    let silent = TcpStream::connect(front).await.unwrap();
    let mut dribbling = TcpStream::connect(front).await.unwrap();
    dribbling.write_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let kept_alive = request(front, "").await;
    for (name, conn) in [("silent", silent), ("dribbling", dribbling)] {
        let (after, answer) = closed(conn).await;
        assert!(after < Duration::from_secs(15), "{name}: closed after {after:?}");
        assert!(!answer.contains("200 OK"), "{name}: {answer}");
    }
    let (_, answer) = closed(kept_alive).await;
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "the kept-alive client had its answer first: {answer}");
    cutting.wait_metric_where("pdbridge_front_connections_open", "0", |n| n == 0.0, Duration::from_secs(10)).await;
    served(front).await;

    // The bound: three held, a fourth closed at once, answered nothing; a place freed is taken.
    let front = bounded.front.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(front).await.unwrap());
    }
    bounded.wait_metric("pdbridge_front_connections_open", 3.0, Duration::from_secs(10)).await;
    let (_, answer) = closed(TcpStream::connect(front).await.unwrap()).await;
    assert_eq!(answer, "", "a connection past the bound got an answer");
    bounded.wait_metric("pdbridge_front_connections_refused_total", 1.0, Duration::from_secs(10)).await;
    held.pop();
    bounded.wait_metric_where("pdbridge_front_connections_open", "2", |n| n == 2.0, Duration::from_secs(10)).await;
    served(front).await;
}

#[tokio::test]
async fn a_listener_open_to_other_hosts_needs_tls_or_an_explicit_insecure() {
    let scratch = Scratch::new("security-exposed");
    let exposed = |daemon: &str, key: &str| loopback_config(daemon, "5s").replacen(key, "0.0.0.0:0", 1);
    for (daemon, config, key) in [
        ("decoded", exposed("decoded", "127.0.0.1:0"), "server.grpc_listen"),
        ("prefilld", exposed("prefilld", "127.0.0.1:0"), "server.grpc_listen"),
        (
            "decoded",
            loopback_config("decoded", "5s").replace("\nlisten = \"127.0.0.1:0\"", "\nlisten = \"0.0.0.0:0\""),
            "front.listen",
        ),
    ] {
        let path = scratch.write(&format!("{daemon}-{key}.toml"), &config);
        let (status, stderr) = run_to_exit(daemon, &["--config", path.to_str().unwrap()], &[]).await;
        assert_eq!(status.code(), Some(2), "{daemon} {key}: {stderr}");
        assert!(stderr.contains(key) && stderr.contains("server.insecure"), "{daemon}: {stderr}");
    }
    let insecure = exposed("decoded", "127.0.0.1:0").replace("[server]\n", "[server]\ninsecure = true\n");
    let decoded = Daemon::start("decoded", &insecure).await;
    decoded.wait_metric("pdbridge_insecure_listeners", 1.0, Duration::from_secs(10)).await;
    assert!(decoded.log_text().contains("server.grpc_listen"), "{}", decoded.log_text());
}

#[tokio::test]
async fn decoders_listed_for_prefilld_need_their_scheme() {
    let scratch = Scratch::new("security-scheme");
    let pki = Pki::new(&["prefill-1"]).await;
    let plain_with_tls = loopback_config("prefilld", "5s")
        + &decoders(&["http://127.0.0.1:7070".to_owned()])
        + &pki.section("prefill-1", &["mac-1"]);
    let path = scratch.write("p.toml", &plain_with_tls);
    let (status, stderr) = run_to_exit("prefilld", &["--config", path.to_str().unwrap()], &[]).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("decoders.addr") && stderr.contains("https://"), "{stderr}");
}

/// A TLS connection to prefilld's stage listener as `client`, and `frame` sent on it as the plugin
/// frames it.
async fn stage_sends(
    client: tokio_rustls::TlsConnector,
    listener: std::net::SocketAddr,
    frame: pdbridge_common::proto::engine::PluginFrame,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    use prost::Message;
    use tokio::io::AsyncWriteExt;
    let tcp = tokio::net::TcpStream::connect(listener).await.map_err(|e| e.to_string())?;
    let name = tokio_rustls::rustls::pki_types::ServerName::try_from("prefill-a").unwrap();
    let mut tls = client.connect(name, tcp).await.map_err(|e| e.to_string())?;
    let header = frame.encode_to_vec();
    let mut bytes = (header.len() as u32).to_le_bytes().to_vec();
    bytes.extend(header);
    tls.write_all(&bytes).await.map_err(|e| e.to_string())?;
    tls.flush().await.map_err(|e| e.to_string())?;
    Ok(tls)
}

/// What a client of prefilld's stage listener got for a bundle request: the bundle's bytes or
/// prefilld's reason; Err when the connection itself was refused. Reads to prefilld's end of the
/// connection either way, so it closes with nothing unread.
async fn fetch_bundle(
    client: tokio_rustls::TlsConnector,
    listener: std::net::SocketAddr,
    sha256: &str,
) -> Result<Result<Vec<u8>, String>, String> {
    use pdbridge_common::proto::engine::{BundleReply, BundleRequest, PluginFrame, plugin_frame::Frame};
    use prost::Message;
    use tokio::io::AsyncReadExt;
    let request =
        PluginFrame { frame: Some(Frame::Bundle(BundleRequest { sha256: sha256.into() })), ..Default::default() };
    let mut tls = stage_sends(client, listener, request).await?;
    let mut len = [0u8; 4];
    tls.read_exact(&mut len).await.map_err(|e| e.to_string())?;
    let mut header = vec![0u8; u32::from_le_bytes(len) as usize];
    tls.read_exact(&mut header).await.map_err(|e| e.to_string())?;
    let reply = BundleReply::decode(header.as_slice()).map_err(|e| e.to_string())?;
    let mut bundle = Vec::new();
    tls.read_to_end(&mut bundle).await.map_err(|e| e.to_string())?;
    if !reply.error.is_empty() {
        return Ok(Err(reply.error));
    }
    assert_eq!(bundle.len() as u64, reply.size, "the bundle's announced size");
    Ok(Ok(bundle))
}

/// Sends a `done` for a request nobody waits for, reads nothing, and drops the connection.
async fn stage_writes_and_leaves(client: tokio_rustls::TlsConnector, listener: std::net::SocketAddr) {
    use pdbridge_common::proto::engine::{PluginDone, PluginFrame, plugin_frame::Frame};
    let done = PluginFrame {
        request_id: "nobody".into(),
        frame: Some(Frame::Done(PluginDone::default())),
        ..Default::default()
    };
    stage_sends(client, listener, done).await.unwrap();
}

/// prefilld's stage listener (`engine.nodes`), which pipeline stages on other boxes stream to: a
/// client needs a certificate of the deployment's CA that names one of `stage_peers`, and such a
/// stage may read a bundle prefilld holds by its SHA-256, and nothing else. The engine is a command
/// that fails (a fault: no vLLM is needed for the listener, which serves regardless).
#[tokio::test]
async fn only_the_named_boxes_may_stream_stages_or_fetch_bundles() {
    use sha2::Digest;
    let scratch = Scratch::new("security-stages");
    let pki = Pki::new(&["prefill-a", "prefill-b", "mac-1"]).await;
    let model = scratch.0.join("model");
    std::fs::create_dir_all(&model).unwrap();
    let profile = r#"{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "num_attention_heads": 2,
                      "hidden_size": 64, "vocab_size": 32}"#;
    for (name, text) in [("config.json", profile), ("tokenizer.json", "{}"), ("tokenizer_config.json", "{}")] {
        std::fs::write(model.join(name), text).unwrap();
    }
    let bundles = scratch.0.join("bundles");
    std::fs::create_dir_all(&bundles).unwrap();
    let bundle: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    let sha: String = sha2::Sha256::digest(&bundle).iter().map(|b| format!("{b:02x}")).collect();
    std::fs::write(bundles.join(format!("{sha}.safetensors")), &bundle).unwrap();
    std::fs::write(scratch.0.join("secret.safetensors"), b"not a bundle").unwrap();
    let reserved = Reserved::new();
    let stage_listen = reserved.addr();
    let engine = format!(
        "[engine]\npython = \"/bin/false\"\nmodel = {model:?}\nbundle_dir = {bundles:?}\nplugin_socket = {socket:?}\n\
         [engine.nodes]\ncount = 2\nhead = \"127.0.0.1\"\nhead_identity = \"prefill-a\"\n\
         stage_listen = \"{stage_listen}\"\nstage_peers = [\"prefill-b\"]\n",
        socket = scratch.0.join("plugin.sock"),
    );
    let without_tls = scratch.write("no-tls.toml", &(loopback_config("prefilld", "5s") + &engine));
    let (status, stderr) = run_to_exit("prefilld", &["--config", without_tls.to_str().unwrap()], &[]).await;
    assert_eq!(status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("engine.nodes") && stderr.contains("[tls]"), "{stderr}");

    let config = loopback_config("prefilld", "5s") + &engine + &pki.section("prefill-a", &["mac-1"]);
    drop(reserved); // held until now: prefilld binds it
    let prefilld = Daemon::start("prefilld", &config).await;
    let stage_box = || pki.rustls_client(Some("prefill-b"));
    assert_eq!(fetch_bundle(stage_box(), stage_listen, &sha).await, Ok(Ok(bundle)), "the stage box's bundle");
    for (asked, why) in
        [("../secret", "not a SHA-256"), (&"0".repeat(64), "no bundle"), (&sha.to_uppercase(), "not a SHA-256")]
    {
        let refused = fetch_bundle(stage_box(), stage_listen, asked).await.unwrap().unwrap_err();
        assert!(refused.contains(why), "{asked}: {refused}");
    }
    // A stage writes and never reads, then closes without a TLS goodbye, as the plugin does: every
    // frame it sent is read (one for a request nobody waits for is logged), and its connection
    // ends cleanly. Anything unread on its side (TLS session tickets) would make its kernel reset
    // the connection instead, which can lose the last frames.
    stage_writes_and_leaves(stage_box(), stage_listen).await;
    let dropped = |line: &str| line.contains("plugin message for a request nobody waits for");
    prefilld.wait_log("the stage's last frame", dropped, Duration::from_secs(10)).await;
    assert_eq!(fetch_bundle(stage_box(), stage_listen, &sha).await.map(|b| b.is_ok()), Ok(true));
    assert!(!prefilld.log_text().contains("stage connection failed"), "{}", prefilld.log_text());
    // The CA's certificate of a decoder, which may call Prefill but is no stage; then none at all.
    for (client, who) in [(Some("mac-1"), "mac-1"), (None, "sent no certificates")] {
        let refused = fetch_bundle(pki.rustls_client(client), stage_listen, &sha).await;
        assert!(refused.is_err(), "{who}: {refused:?}");
        let refusal = |line: &str| line.contains("stage listener: a connection refused") && line.contains(who);
        prefilld.wait_log(&format!("refusal of {who}"), refusal, Duration::from_secs(10)).await;
    }
    let refused = r#"pdbridge_stage_connections_total{outcome="refused"}"#;
    assert_eq!(prefilld.metric(refused).await, Some(2.0), "the two refusals, counted");
}
