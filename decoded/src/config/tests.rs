use pdbridge_common::config::{Sources, load};
use proptest::prelude::*;

use super::*;

fn parse(toml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = std::env::temp_dir().join(format!("pdb-decoded-config-{}-{n}.toml", std::process::id()));
    std::fs::write(&path, toml).unwrap();
    let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    let loaded = load::<Config>(Sources { file: Some(path.clone()), env, overrides: Vec::new() });
    let _ = std::fs::remove_file(&path);
    loaded
}

const SERVER: &str = "[server]\ngrpc_listen = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n";

#[test]
fn engine_liveness_has_defaults_takes_overrides_and_names_a_bad_key() {
    let engine = "[engine]\nmodel = \"m\"\n";
    let default = parse(&format!("{SERVER}{engine}"), &[]).unwrap().engine.unwrap().liveness;
    assert_eq!(
        (default.interval, default.timeout, default.failures),
        (Duration::from_secs(2), Duration::from_secs(5), 3)
    );
    let set = format!("{SERVER}{engine}[engine.liveness]\ninterval = \"500ms\"\n");
    let liveness = parse(&set, &[("PDB_ENGINE__LIVENESS__FAILURES", "5")]).unwrap().engine.unwrap().liveness;
    assert_eq!((liveness.interval, liveness.failures), (Duration::from_millis(500), 5));
    let zero = parse(&format!("{SERVER}{engine}[engine.liveness]\nfailures = 0\n"), &[]).unwrap_err();
    assert!(zero.to_string().contains("engine.liveness.failures"), "{zero}");
}

#[test]
fn api_keys_come_from_a_list_a_joined_string_or_a_file_and_never_print() {
    let listed = parse(&format!("{SERVER}[front]\napi_keys = [\"a\", \" b \"]\n"), &[]).unwrap();
    let joined = parse(SERVER, &[("PDB_FRONT__API_KEYS", "a, b,")]).unwrap();
    for config in [&listed, &joined] {
        let keys: Vec<&str> = config.front.api_keys.iter().map(ApiKey::expose).collect();
        assert_eq!(keys, ["a", "b"]);
        assert!(!format!("{config:?}").contains("\"a\""), "a key in Debug output");
    }
    let err = parse(&format!("{SERVER}[front]\napi_keys_file = \"/nonexistent/keys\"\n"), &[]).unwrap_err();
    assert!(err.to_string().contains("front.api_keys_file"), "{err}");
}

#[test]
fn prefillers_are_one_instance_or_a_list_never_both() {
    let one = parse(&format!("{SERVER}[front]\nprefilld = \"http://a:7071\"\nprefilld_name = \"prefill-1\"\n"), &[]);
    let one = one.unwrap().front.prefillers();
    assert_eq!(one, [PrefillerConfig { addr: "http://a:7071".into(), name: Some("prefill-1".into()) }]);
    let list = format!(
        "{SERVER}[[front.prefillers]]\naddr = \"http://a:7071\"\n[[front.prefillers]]\naddr = \"http://b:7071\"\nname = \"prefill-2\"\n"
    );
    let many = parse(&list, &[]).unwrap().front.prefillers();
    assert_eq!(
        many.iter().map(|p| (p.addr.as_str(), p.name.as_deref())).collect::<Vec<_>>(),
        [("http://a:7071", None), ("http://b:7071", Some("prefill-2"))]
    );
    let both = parse(&format!("{list}[front]\nprefilld = \"http://c:7071\"\n"), &[]).unwrap_err();
    assert!(both.to_string().contains("front.prefillers"), "{both}");
    let orphan = parse(&format!("{SERVER}[front]\nprefilld_name = \"prefill-1\"\n"), &[]).unwrap_err();
    assert!(orphan.to_string().contains("front.prefilld_name"), "{orphan}");
}

#[test]
fn peers_name_a_store_and_a_front_door_and_bad_addresses_are_named() {
    let peer = "[[front.peers]]\naddr = \"http://mac-2:7070\"\nfront = \"http://mac-2:8080\"\n";
    let front = parse(&format!("{SERVER}{peer}"), &[]).unwrap().front;
    assert_eq!(front.peers[0].front, "http://mac-2:8080");
    assert_eq!(front.peer_lookup_timeout, Duration::from_millis(500));
    let https_front = peer.replace("http://mac-2:8080", "https://mac-2:8443");
    let refused = parse(&format!("{SERVER}{https_front}"), &[]).unwrap_err();
    assert!(refused.to_string().contains("front.peers.front"), "{refused}");
    let missing = parse(&format!("{SERVER}[[front.peers]]\naddr = \"http://mac-2:7070\"\n"), &[]).unwrap_err();
    assert!(missing.to_string().contains("front"), "{missing}");
}

/// Lines a config file may hold: every section and key decoded knows, with
/// values of every shape, and some it does not know.
fn line() -> impl Strategy<Value = String> {
    let section = prop::sample::select(vec![
        "[server]",
        "[store]",
        "[engine]",
        "[front]",
        "[tls]",
        "[log]",
        "[server.http2]",
        "[bogus]",
    ]);
    let key = prop::sample::select(vec![
        "grpc_listen",
        "admin_listen",
        "insecure",
        "drain_timeout",
        "dir",
        "budget_bytes",
        "block_tokens",
        "max_open_blocks",
        "max_push_bytes",
        "listen",
        "prefilld",
        "api_keys",
        "api_keys_file",
        "cert",
        "peers",
        "model",
        "kv_bits",
        "max_frame_bytes",
        "spec_file",
        "unknown",
    ]);
    let value = prop::sample::select(vec![
        "0",
        "16",
        "-1",
        "18446744073709551616",
        "true",
        "\"0.0.0.0:0\"",
        "\"127.0.0.1:0\"",
        "\"https://x:1\"",
        "\"http://x:1\"",
        "\"\"",
        "\"5s\"",
        "\"0s\"",
        "[]",
        "[\"a\"]",
        "{}",
        "\"/nonexistent\"",
        "1.5",
    ]);
    prop_oneof![section.prop_map(str::to_owned), (key, value).prop_map(|(k, v)| format!("{k} = {v}")), ".{0,12}"]
}

proptest! {
    // At least this many cases; PROPTEST_CASES asks for more.
        #![proptest_config(ProptestConfig { cases: ProptestConfig::default().cases.max(1024), ..ProptestConfig::default() })]

    /// Fuzzing config parsing: any file loads or is one error naming what is wrong;
    /// nothing panics, and what loads honours every rule `validate` enforces.
    #[test]
    fn fuzz_any_config_file_loads_or_is_refused_in_one_line(lines in prop::collection::vec(line(), 0..24)) {
        let toml = format!("{SERVER}{}", lines.join("\n"));
        match parse(&toml, &[]) {
            Ok(config) => {
                prop_assert!(config.store.block_tokens > 0 && config.store.block_tokens % 16 == 0);
                prop_assert!(config.server.grpc_listen.ip().is_loopback() || config.tls.is_some() || config.server.insecure);
                prop_assert!(config.front.listen.ip().is_loopback() || config.front.has_api_keys() || config.server.insecure);
            }
            Err(e) => prop_assert!(!e.to_string().contains('\n'), "{e}"),
        }
    }
}
