//! Beyond one prefiller beside one decoder, on real engines: a decoder bridging through two
//! prefilld instances (concurrent bridges spread over them by load; when the one bridging a
//! prompt dies mid-way, the blocks it committed stay and the other bridges the rest, which the
//! verdict says), and one prefilld bridging for two decoders of different specs at once.

use std::time::Duration;

use pdbridge_tests::{Daemon, Engines, Reserved, Scratch, decoders, license_text};

use crate::answers::{chat, chat_at, chat_url, native_text, shared_prompt, user};

const BLOCK_TOKENS: u32 = 64;

#[tokio::test]
async fn bridges_spread_over_prefillers_and_survive_one_dying_mid_bridge() {
    let scratch = Scratch::new("prefillers");
    let engines = Engines::locate();
    let port = Reserved::new();
    let decoder = decoders(&[format!("http://{}", port.addr())]);
    // prefill-a sends over an emulated slow link (a block of the test model in ~2 s), so it is
    // still mid-bridge when it is killed below, however fast this machine prefills.
    let slow_link = format!("{decoder}[stream]\nlink_gbps = 0.01\n");
    let a = Daemon::start("prefilld", &engines.prefilld_config(&scratch.0.join("a"), &slow_link)).await;
    let b = Daemon::start("prefilld", &engines.prefilld_config(&scratch.0.join("b"), &decoder)).await;
    let front = format!(
        "[front]\nlisten = \"127.0.0.1:0\"\nmin_bridge_tokens = {BLOCK_TOKENS}\n\
         [[front.prefillers]]\naddr = \"http://{}\"\nname = \"prefill-a\"\n\
         [[front.prefillers]]\naddr = \"http://{}\"\nname = \"prefill-b\"\n",
        a.grpc, b.grpc
    );
    let config = engines.decoded_config(&scratch.0.join("store"), BLOCK_TOKENS, &front);
    let decoded = Daemon::start("decoded", &port.release_into(&config)).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    a.wait_ready(Duration::from_secs(900)).await;
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

/// One prefilld and a decoded per entry of `decoders` (its block size, extra `[front]` keys and
/// the earlier decoders it lists as `[[front.peers]]`, named `decoder-{i}`), each bridging through
/// that prefilld into its own store (`store-{i}` under `scratch`), all ready.
pub(crate) async fn one_prefiller_and_decoders(
    scratch: &Scratch,
    decoders_: &[(u32, String, &[usize])],
) -> (Daemon, Vec<(Daemon, std::path::PathBuf)>) {
    let engines = Engines::locate();
    let ports: Vec<Reserved> = decoders_.iter().map(|_| Reserved::new()).collect();
    let addrs: Vec<String> = ports.iter().map(|p| format!("http://{}", p.addr())).collect();
    let prefilld =
        Daemon::start("prefilld", &engines.prefilld_config(&scratch.0.join("prefilld"), &decoders(&addrs))).await;
    let mut started: Vec<(Daemon, std::path::PathBuf)> = Vec::new();
    for (i, (port, (block_tokens, extra, peers))) in ports.into_iter().zip(decoders_).enumerate() {
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

/// One prefilld (one vLLM) for three decoders: two of different specs (64- and 32-token blocks),
/// bridged at once, each get their own spec's blocks, in their own store only, and answer as they
/// do natively. The third shares the first's spec and lists it as a peer: the prompt sent there
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
    let decoders = [(64, String::new(), &[][..]), (32, String::new(), &[]), (64, third, &[0])];
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

/// Pipeline parallelism: each stage captures its own layers and sends its part of every block;
/// prefilld pushes a block once every stage's part has arrived. The test model: a stage needs two
/// layers or more, the generated Llama 3 has two in all.
#[tokio::test]
async fn pipeline_parallel_prefill_bridges_as_the_decoder_answers() {
    parallel_prefill_bridges_as_the_decoder_answers("pp2", Engines::locate(), "pipeline_parallel_size = 2", "").await;
}
