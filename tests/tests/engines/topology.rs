//! Beyond one prefiller beside one decoder, on real engines: a decoder bridging through two
//! prefilld instances (concurrent bridges spread over them by load; when the one bridging a
//! prompt dies mid-way, the blocks it committed stay and the other bridges the rest, which the
//! verdict says), and one prefilld bridging for two decoders of different specs at once.

use std::{process::Stdio, time::Duration};

use pdbridge_tests::{Daemon, Engines, Pki, Reserved, Scratch, binary, decoders, hosts::Host, license_text};

use crate::answers::{chat, chat_at, chat_url, native_text, native_text_over, shared_prompt, user};

const BLOCK_TOKENS: u32 = 64;
/// On a busy two-core machine a bridge here can take minutes (two vLLM processes' first forward, an
/// emulated slow link); what these tests are about is not the default prefill deadline (bridge.rs
/// tests that).
const BUSY_MACHINE_DEADLINE: &str = "prefill_deadline_base = \"600s\"\n";

#[tokio::test]
async fn bridges_spread_over_prefillers_and_survive_one_dying_mid_bridge() {
    let scratch = Scratch::new("prefillers");
    let engines = Engines::dense();
    let port = Reserved::new();
    let decoder = decoders(&[format!("http://{}", port.addr())]);
    // prefill-a sends over an emulated slow link (a block of the test model in ~2 s), so it is
    // still mid-bridge when it is killed below, however fast this machine prefills.
    let slow_link = format!("{decoder}[stream]\nlink_gbps = 0.01\n");
    let a = Daemon::start("prefilld", &engines.prefilld_config(&scratch.0.join("a"), &slow_link)).await;
    // prefill-b's vLLM starts once prefill-a's is up: two starting at once beside the other lanes'
    // engines can starve a two-core machine past vLLM's start timeout.
    let b_port = Reserved::new();
    let front = format!(
        "[front]\nlisten = \"127.0.0.1:0\"\nmin_bridge_tokens = {BLOCK_TOKENS}\n{BUSY_MACHINE_DEADLINE}\
         [[front.prefillers]]\naddr = \"http://{}\"\nname = \"prefill-a\"\n\
         [[front.prefillers]]\naddr = \"http://{}\"\nname = \"prefill-b\"\n",
        a.grpc,
        b_port.addr()
    );
    let config = engines.decoded_config(&scratch.0.join("store"), BLOCK_TOKENS, &front);
    let decoded = Daemon::start("decoded", &port.release_into(&config)).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    a.wait_ready(Duration::from_secs(900)).await;
    let b_config = b_port.release_into(&engines.prefilld_config(&scratch.0.join("b"), &decoder));
    let b = Daemon::start("prefilld", &b_config).await;
    b.wait_ready(Duration::from_secs(900)).await;
    let license = license_text();

    // Two bridges at once: one on each prefilld (prompts that share no block with the one below).
    let (first, second) = (user(&license[3000..4500]), user(&license[4500..6000]));
    let (one, two) = tokio::join!(chat(&decoded, &first, "auto"), chat(&decoded, &second, "auto"));
    let mut used: Vec<String> = [&one, &two]
        .iter()
        .map(|answer| {
            assert_eq!(answer.verdict["outcome"], "bridged", "{}", answer.verdict);
            answer.verdict["prefillers"][0].as_str().unwrap().to_owned()
        })
        .collect();
    used.sort();
    let log = decoded.log_text();
    let skipped: Vec<&str> = log.lines().filter(|line| line.contains("prefilld skipped")).collect();
    assert_eq!(used, ["prefill-a", "prefill-b"], "{} / {}; {skipped:?}", one.verdict, two.verdict);

    // A prompt of several blocks goes to prefill-a (both idle: the first listed); it dies once
    // blocks landed.
    let long = shared_prompt();
    let committed = decoded.metric("pdbridge_store_blocks").await.unwrap_or(0.0);
    let asked = tokio::spawn({
        let (url, messages) = (chat_url(&decoded), long.clone());
        async move { chat_at(&url, &messages, "auto").await }
    });
    decoded
        .wait_metric_where(
            "pdbridge_store_blocks",
            "two more blocks",
            |blocks| blocks >= committed + 2.0,
            Duration::from_secs(300),
        )
        .await;
    a.kill();
    let answer = asked.await.unwrap();
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let verdict = &answer.verdict;
    assert_eq!(verdict["outcome"], "bridged", "{verdict}");
    assert_eq!(verdict["prefillers"], serde_json::json!(["prefill-a", "prefill-b"]), "{verdict}");
    assert!(verdict["detail"].as_str().unwrap().contains("finished by prefill-b"), "{verdict}");
    assert_eq!(answer.cached_tokens(), answer.prompt_tokens() - 1, "{verdict}");
    let whole = answer.prompt_tokens() / u64::from(BLOCK_TOKENS);
    assert_eq!(verdict["blocks"].as_u64(), Some(whole), "every block counted once: {verdict}");
    assert_eq!(answer.text(), native_text(&decoded, &long).await, "the answer after a failover differs");
}

/// One prefilld of the test model and a decoded per entry of `decoders` (its engines, block size,
/// extra `[front]` keys and the earlier decoders it lists as `[[front.peers]]`, named
/// `decoder-{i}`), each bridging through that prefilld into its own store (`store-{i}` under
/// `scratch`), all ready.
async fn one_prefiller_and_decoders(
    scratch: &Scratch,
    decoders_: &[(Engines, u32, String, &[usize])],
) -> (Daemon, Vec<(Daemon, std::path::PathBuf)>) {
    let ports: Vec<Reserved> = decoders_.iter().map(|_| Reserved::new()).collect();
    let addrs: Vec<String> = ports.iter().map(|p| format!("http://{}", p.addr())).collect();
    let prefilld_config = Engines::locate().prefilld_config(&scratch.0.join("prefilld"), &decoders(&addrs));
    let prefilld = Daemon::start("prefilld", &prefilld_config).await;
    let mut started: Vec<(Daemon, std::path::PathBuf)> = Vec::new();
    for (i, (port, (engines, block_tokens, extra, peers))) in ports.into_iter().zip(decoders_).enumerate() {
        let mut front = format!(
            "[front]\nlisten = \"127.0.0.1:0\"\nprefilld = \"http://{}\"\nmin_bridge_tokens = {block_tokens}\n{extra}\n",
            prefilld.grpc
        );
        for &peer in *peers {
            let decoded = &started[peer].0;
            let (grpc, front_door) = (decoded.grpc, decoded.front.expect("front door"));
            front += &format!(
                "[[front.peers]]\naddr = \"http://{grpc}\"\nname = \"decoder-{peer}\"\nfront = \"http://{front_door}\"\n"
            );
        }
        let store = scratch.0.join(format!("store-{i}"));
        let config = engines.decoded_config(&store, *block_tokens, &front);
        started.push((Daemon::start("decoded", &port.release_into(&config)).await, store));
    }
    for (decoded, _) in &started {
        decoded.wait_ready(Duration::from_secs(300)).await;
    }
    prefilld.wait_ready(Duration::from_secs(900)).await;
    (prefilld, started)
}

/// One prefilld (one vLLM) for three decoders: two of different specs (the test model's dense
/// decoder in 64-token blocks, its 4-bit one in 32: the engines tier's 4-bit decoder end to end,
/// its bundle's quantized projections reconstructing on the prefill side), bridged at once, each
/// get their own spec's blocks, in their own store only, and answer as they do natively. The
/// third shares the first's spec and lists it as a peer: the prompt sent there
/// is answered by the first from its store; asked to bridge it itself, the third computes its own
/// cache from the layer inputs and stores what prefilld computed for the first
/// ([`exact`](crate::exact)).
#[tokio::test]
async fn one_prefiller_serves_decoders_of_two_specs_at_once_peers_share_and_one_computes_its_own_cache() {
    let scratch = Scratch::new("decoders");
    // A peer that is down is passed over.
    let down = Reserved::new().addr();
    let third =
        format!("reconstruct_on = \"decoder\"\n[[front.peers]]\naddr = \"http://{down}\"\nfront = \"http://{down}\"\n");
    let decoders = [
        (Engines::dense(), 64, String::new(), &[][..]),
        (Engines::locate(), 32, String::new(), &[]),
        (Engines::dense(), 64, third, &[0]),
    ];
    let (_prefilld, started) = one_prefiller_and_decoders(&scratch, &decoders).await;
    // The same prompt for both at once: two prefills of the same tokens, each for its own spec.
    let prompt = shared_prompt();
    let (one, two) = tokio::join!(chat(&started[0].0, &prompt, "auto"), chat(&started[1].0, &prompt, "auto"));
    for (((decoded, _), block_tokens), answer) in started.iter().zip([64, 32]).zip([&one, &two]) {
        assert_eq!(answer.verdict["outcome"], "bridged", "{}", answer.verdict);
        assert_eq!(answer.verdict["block_tokens"].as_u64(), Some(block_tokens), "{}", answer.verdict);
        assert_eq!(answer.cached_tokens(), answer.prompt_tokens() - 1, "{}", answer.verdict);
        // Its own spec's whole blocks and nothing of the other decoder's.
        let stored = decoded.metric("pdbridge_store_blocks").await;
        assert_eq!(stored, Some((answer.prompt_tokens() / block_tokens) as f64), "{}", answer.verdict);
        assert_eq!(answer.text(), native_text(decoded, &prompt).await, "bridged and native differ");
    }
    let (peer, holder) = (&started[2], &started[0]);
    let forwarded = chat(&peer.0, &prompt, "auto").await;
    assert_eq!(forwarded.status, 200, "{:?}", forwarded.body);
    assert_eq!(forwarded.verdict["served_by"], "decoder-0", "{}", forwarded.verdict);
    assert_eq!(forwarded.verdict["outcome"], "cached", "{}", forwarded.verdict);
    assert_eq!(forwarded.text(), one.text(), "the peer answered otherwise than before");
    assert_eq!(peer.0.metric("pdbridge_store_blocks").await.unwrap_or(0.0), 0.0, "a forwarded prompt stored");
    crate::exact::computes_the_blocks_prefilld_computes(peer, holder, &prompt).await;
}

/// vLLM spread over two processes as `engine_keys` say bridges a cold prompt, every block once, as
/// the decoder (its `[engine]` given `decoder_keys`) answers natively.
async fn parallel_prefill_bridges_as_the_decoder_answers(
    name: &str,
    engines: Engines,
    engine_keys: &str,
    decoder_keys: &str,
) {
    let scratch = Scratch::new(name);
    let port = Reserved::new();
    let config = engines.prefilld_config_parallel(
        &scratch.0.join("prefilld"),
        engine_keys,
        &decoders(&[format!("http://{}", port.addr())]),
    );
    let prefilld = Daemon::start("prefilld", &config).await;
    let front = format!(
        "{decoder_keys}\n[front]\nlisten = \"127.0.0.1:0\"\nprefilld = \"http://{}\"\nmin_bridge_tokens = {BLOCK_TOKENS}\n",
        prefilld.grpc
    );
    let config = engines.decoded_config(&scratch.0.join("store"), BLOCK_TOKENS, &front);
    let decoded = Daemon::start("decoded", &port.release_into(&config)).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    prefilld.wait_ready(Duration::from_secs(900)).await;

    let prompt = shared_prompt();
    let bridged = chat(&decoded, &prompt, "auto").await;
    if bridged.verdict["outcome"] != "bridged" {
        panic!("not bridged: {}\nprefilld's log:\n{}", bridged.verdict, prefilld.log_text());
    }
    assert_eq!(bridged.cached_tokens(), bridged.prompt_tokens() - 1, "{}", bridged.verdict);
    let whole = bridged.prompt_tokens() / u64::from(BLOCK_TOKENS);
    assert_eq!(bridged.verdict["blocks"].as_u64(), Some(whole), "each block once: {}", bridged.verdict);
    assert_eq!(bridged.text(), native_text(&decoded, &prompt).await, "bridged and native differ");
}

/// Tensor parallelism: every rank holds the whole residual stream after its all-reduce, so rank 0
/// alone reconstructs and streams. The decoder keeps a 4-bit quantized KV cache of Llama 3.1 (rope
/// scaling).
#[tokio::test]
async fn tensor_parallel_prefill_bridges_as_the_decoder_answers() {
    // The test model's 9 attention heads do not split over two ranks; the generated Llama 3's 4 do.
    let engines = Engines::family("llama3");
    let tp2 = r#"extra_args = ["--tensor-parallel-size", "2"]"#;
    parallel_prefill_bridges_as_the_decoder_answers("tp2", engines, tp2, "kv_bits = 4\nkv_group_size = 32").await;
}

/// Pipeline parallelism over two hosts: the test's own, beside prefilld, and a network namespace
/// joined to it by a veth pair, whose vLLM workers `prefilld node` starts (vLLM's own multi-node
/// launch; torch.distributed and vLLM's messages cross the veth pair). Each stage captures its own
/// layers and sends its part of every block: the first on prefilld's unix socket, the other host's
/// over mutual TLS to prefilld's stage listener, after fetching the decoder's bundle from it there.
/// prefilld pushes a block once both parts have arrived, and the bridged answer is the decoder's
/// native one. The test model: a stage needs two layers or more, the generated Llama 3 has two.
#[tokio::test]
async fn pipeline_stages_on_another_host_stream_over_mutual_tls() {
    let scratch = Scratch::new("pp2-hosts");
    let engines = Engines::dense();
    let pki = Pki::new(&["prefill-a", "prefill-b", "mac-1"]).await;
    let other = Host::create("pp2");
    let head = other.local_addr;
    let free_port = || std::net::TcpListener::bind((head, 0)).unwrap().local_addr().unwrap().port();
    let decoder_port = Reserved::new();
    let nodes = format!(
        "[engine.nodes]\ncount = 2\nhead = \"{head}\"\nhead_identity = \"prefill-a\"\nmaster_port = {}\n\
         stage_listen = \"{head}:{}\"\nstage_peers = [\"prefill-b\"]\n\
         [[decoders]]\naddr = \"https://{}\"\nname = \"mac-1\"\n",
        free_port(),
        free_port(),
        decoder_port.addr(),
    );
    // Each host's vLLM on its own core, its collectives on the link between the hosts.
    let host_config = |name: &str, core: u32, iface: &str, addr: std::net::Ipv4Addr| {
        let env = format!(
            "VLLM_CPU_OMP_THREADS_BIND = \"{core}\"\nGLOO_SOCKET_IFNAME = \"{iface}\"\nVLLM_HOST_IP = \"{addr}\"\n"
        );
        let extra = format!("{nodes}{}", pki.section(name, &["mac-1"]));
        engines.prefilld_config_with(&scratch.0.join(name), "pipeline_parallel_size = 2", &env, &extra)
    };
    let prefilld = Daemon::start("prefilld", &host_config("prefill-a", 0, &other.local_iface, head)).await;
    let node_config = scratch.write("prefill-b.toml", &host_config("prefill-b", 1, &other.iface, other.addr));
    let node_log = std::fs::File::create(scratch.0.join("prefill-b.log")).unwrap();
    let mut node = other
        .command(binary("prefilld"))
        .args(["node", "--rank", "1", "--config"])
        .arg(&node_config)
        .stdin(Stdio::null())
        .stdout(node_log.try_clone().unwrap())
        .stderr(node_log)
        .kill_on_drop(true)
        .spawn()
        .expect("prefilld node on the other host");
    let front = format!(
        "[front]\nlisten = \"127.0.0.1:0\"\nprefilld = \"https://{}\"\nprefilld_name = \"prefill-a\"\n\
         min_bridge_tokens = {BLOCK_TOKENS}\n{BUSY_MACHINE_DEADLINE}{}",
        prefilld.grpc,
        pki.section("mac-1", &["prefill-a"]),
    );
    let config = engines.decoded_config(&scratch.0.join("store"), BLOCK_TOKENS, &front);
    let decoded = Daemon::start("decoded", &decoder_port.release_into(&config)).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let node_log = || std::fs::read_to_string(scratch.0.join("prefill-b.log")).unwrap_or_default();
    tokio::select! {
        () = prefilld.wait_ready(Duration::from_secs(900)) => {}
        exited = node.wait() => panic!("prefilld node exited: {exited:?}\n{}", node_log()),
    }

    let prompt = shared_prompt();
    let bridged = chat(&decoded, &prompt, "auto").await;
    if bridged.verdict["outcome"] != "bridged" {
        panic!(
            "not bridged: {}\nprefilld's log:\n{}\nthe other host's:\n{}",
            bridged.verdict,
            prefilld.log_text(),
            node_log()
        );
    }
    let whole = bridged.prompt_tokens() / u64::from(BLOCK_TOKENS);
    assert_eq!(bridged.verdict["blocks"].as_u64(), Some(whole), "each block once: {}", bridged.verdict);
    let peer = decoded.channel_as(Some(&pki.client("prefill-a")), "mac-1").await.unwrap();
    assert_eq!(bridged.text(), native_text_over(peer, &decoded, &prompt).await, "bridged and native differ");
    // The other host's stage read the bundle from prefilld, over the link, into its own folder.
    let fetched: Vec<_> = std::fs::read_dir(scratch.0.join("prefill-b/bundles")).unwrap().flatten().collect();
    assert_eq!(fetched.len(), 1, "the other host's bundle folder: {fetched:?}");
    assert!(prefilld.log_text().contains("bundle served to a stage on another box"), "{}", prefilld.log_text());
    // SAFETY: kill(2) on the child we spawned: `prefilld node` stops vLLM's workers and exits.
    unsafe { libc::kill(node.id().expect("running") as i32, libc::SIGTERM) };
    let stopped = tokio::time::timeout(Duration::from_secs(60), node.wait()).await;
    assert!(matches!(stopped, Ok(Ok(status)) if status.success()), "prefilld node's stop: {stopped:?}\n{}", node_log());
}
