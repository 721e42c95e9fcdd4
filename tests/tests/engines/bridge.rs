//! The bridge end to end on the real engines: vLLM prefills, the plugin
//! reconstructs the decoder's cache, prefilld streams it, decoded stores it,
//! and mlx-lm answers from it — plus every way it must refuse to pretend.

use std::time::Duration;

use pdbridge_tests::{Daemon, Engines, Pki, Reserved, Scratch, binary, license_text, workspace_root};
use serde_json::{Value, json};

use crate::answers::{Answer, chat, chat_at, chat_url, user};

/// Small blocks keep the prompts (and the decoder's slow CPU prefill) short.
const BLOCK_TOKENS: u64 = 32;
/// The decoder's own cache for this model: 30 layers × (K + V) × 3 heads × 64 × fp32.
const CACHE_BYTES_PER_TOKEN: f64 = 46_080.0;

#[tokio::test]
async fn bridged_answers_on_real_engines() {
    let engines = Engines::locate();
    let scratch = Scratch::new("bridge");
    let license = license_text();
    let paragraphs: Vec<&str> = license.split("\n\n").collect();

    // Both daemons speak mutual TLS, each letting only the other's identity in; prefilld pushes
    // only to the decoders in its config (this one, and a second one for 5c).
    let pki = Pki::new(&["prefill-1", "mac-1"]).await;
    let (decoder_port, hasty_port) = (Reserved::new(), Reserved::new());
    let prefilld_extra: String = [decoder_port.addr(), hasty_port.addr()]
        .iter()
        .map(|addr| format!("[[decoders]]\naddr = \"https://{addr}\"\nname = \"mac-1\"\n"))
        .chain([pki.section("prefill-1", &["mac-1"])])
        .collect();
    let mut prefilld =
        Daemon::start("prefilld", &engines.prefilld_config(&scratch.0.join("prefilld"), &prefilld_extra)).await;
    let front = format!(
        "[front]\nlisten = \"127.0.0.1:0\"\nprefilld = \"https://{}\"\nprefilld_name = \"prefill-1\"\n\
         min_bridge_tokens = {BLOCK_TOKENS}\n{}",
        prefilld.grpc,
        pki.section("mac-1", &["prefill-1"]),
    );
    let store = scratch.0.join("store");
    let decoded_config = decoder_port.release_into(&engines.decoded_config(&store, BLOCK_TOKENS as u32, &front));
    let mut decoded = Daemon::start("decoded", &decoded_config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    // prefilld is ready once vLLM is up and it has met its first decoder over mutual TLS.
    prefilld.wait_ready(Duration::from_secs(900)).await;

    // 1. A cold prompt is bridged: the store covers every whole block.
    let first_prompt = format!("{}\n\nWhat is this text?", paragraphs[..3].join("\n\n"));
    let first = user(&first_prompt);
    let bridged = chat(&decoded, &first, "auto").await;
    assert_eq!(bridged.status, 200, "{:?}", bridged.body);
    let v = &bridged.verdict;
    assert_eq!(v["outcome"], "bridged", "{v}");
    let prompt_tokens = bridged.prompt_tokens();
    // The whole blocks and the tail after them came over the bridge: the decoder computed one
    // token of the prompt itself.
    assert_eq!(bridged.cached_tokens(), prompt_tokens - 1, "{v}");
    assert_eq!(v["cached_tokens"].as_u64(), Some(bridged.cached_tokens()), "header and usage agree");
    let blocks = v["blocks"].as_u64().unwrap();
    assert_eq!(blocks, prompt_tokens / BLOCK_TOKENS);
    let tail = v["tail_tokens"].as_u64().unwrap();
    assert_eq!(tail, prompt_tokens - 1 - blocks * BLOCK_TOKENS, "{v}");
    assert!(tail > 0, "this prompt ends mid-block: {v}");
    let per_token = v["bytes"].as_f64().unwrap() / (blocks * BLOCK_TOKENS + tail) as f64;
    assert!((per_token / CACHE_BYTES_PER_TOKEN - 1.0).abs() < 0.01, "payload {per_token} B/token");
    // Striped over prefilld's two connections (stream.connections = 2): decoded finished two
    // Push streams, each with some of the blocks.
    let pushed: Vec<u64> =
        logged(&decoded, "push done", 2).await.iter().filter_map(|fields| fields["blocks"].as_u64()).collect();
    assert_eq!(pushed.len(), 2, "{pushed:?}");
    assert_eq!(pushed.iter().sum::<u64>(), blocks, "{pushed:?}");
    assert!(blocks < 2 || pushed.iter().all(|&n| n > 0), "{pushed:?}");

    // 2. The same prompt served natively gives the same greedy answer.
    let native = chat(&decoded, &first, "native").await;
    assert_eq!(native.verdict["outcome"], "native");
    assert_eq!(native.verdict["reason"], "requested");
    assert_eq!(native.cached_tokens(), 0, "a native answer restores nothing");
    assert_eq!(native.text(), bridged.text(), "bridged and native greedy answers differ");

    // The Grafana dashboard only queries metrics the daemons really publish.
    dashboard_metrics_exist(&decoded, &prefilld).await;

    // `pdbridge doctor` passes on this deployment, run on the decoder's host with its certificate.
    let cli_tls = [
        format!("--ca={}", pki.dir.join("ca.pem").display()),
        format!("--cert={}", pki.dir.join("mac-1.pem").display()),
        format!("--key={}", pki.dir.join("mac-1.key").display()),
        "--decoded-name=mac-1".to_owned(),
        "--prefilld-name=prefill-1".to_owned(),
    ];
    let doctor_args = |decoded: &Daemon, prefilld: &Daemon| {
        let mut args = vec![
            "doctor".to_owned(),
            format!("--decoded={}", decoded.grpc_uri()),
            format!("--decoded-admin=http://{}", decoded.admin),
            format!("--prefilld={}", prefilld.grpc_uri()),
            format!("--prefilld-admin=http://{}", prefilld.admin),
        ];
        args.extend(cli_tls.iter().cloned());
        args
    };
    let (status, out) = run_cli(&doctor_args(&decoded, &prefilld)).await;
    assert!(status.success(), "doctor failed:\n{out}");
    assert!(out.contains("PASS  test bridge") && out.contains("all checks passed"), "{out}");
    assert!(out.contains("PASS  certificate: mac-1, signed by the CA"), "{out}");

    // `pdbridge warm` bridges a document; a chat about it then finds it cached.
    let document = paragraphs[8..11].join("\n\n");
    let doc_file = scratch.0.join("doc.txt");
    std::fs::write(&doc_file, &document).unwrap();
    let mut warm_args = vec![
        "warm".to_owned(),
        format!("--file={}", doc_file.display()),
        format!("--front=http://{}", decoded.front.unwrap()),
        format!("--prefilld={}", prefilld.grpc_uri()),
    ];
    warm_args.extend(cli_tls.iter().cloned());
    let (status, out) = run_cli(&warm_args).await;
    assert!(status.success() && out.contains("warm: bridged"), "warm failed:\n{out}");
    let warmed = chat(&decoded, &user(&document), "auto").await;
    assert_eq!(warmed.verdict["outcome"], "cached", "{}", warmed.verdict);

    // 3. Extending the conversation bridges only the new blocks.
    let extended = json!([
        {"role": "user", "content": first_prompt},
        {"role": "assistant", "content": bridged.text()},
        {"role": "user", "content": format!("{}\n\nAnd this part?", paragraphs[3..5].join("\n\n"))},
    ]);
    let second = chat(&decoded, &extended, "auto").await;
    assert_eq!(second.status, 200, "{:?}", second.body);
    assert_eq!(second.verdict["outcome"], "bridged", "{}", second.verdict);
    let second_blocks = second.prompt_tokens() / BLOCK_TOKENS;
    assert_eq!(second.verdict["blocks"].as_u64(), Some(second_blocks - blocks), "only the new blocks travel");

    // 4. A repeat is served from the store without the bridge.
    let repeat = chat(&decoded, &first, "auto").await;
    assert_eq!(repeat.verdict["outcome"], "cached", "{}", repeat.verdict);
    assert_eq!(repeat.verdict["blocks"], 0);
    assert_eq!(repeat.text(), bridged.text());

    // 4b. Two requests for the same cold prompt at once share one prefill: one bridges, the other
    // waits for that bridge and is served from the store.
    let prefills_before = logged(&prefilld, "prefill done", 0).await.len();
    let twins = user(&format!("{}\n\nList the conditions.", paragraphs[11..14].join("\n\n")));
    let (a, b) = tokio::join!(chat(&decoded, &twins, "auto"), chat(&decoded, &twins, "auto"));
    let (bridger, waiter) = if a.verdict["outcome"] == "bridged" { (&a, &b) } else { (&b, &a) };
    assert_eq!(bridger.verdict["outcome"], "bridged", "{} / {}", a.verdict, b.verdict);
    assert_eq!(waiter.verdict["outcome"], "cached", "{}", waiter.verdict);
    assert!(waiter.verdict["timings_ms"]["shared_bridge_wait"].as_f64().is_some(), "{}", waiter.verdict);
    // The tail was the bridging request's alone; the waiter restores the whole blocks.
    assert_eq!(waiter.cached_tokens() + bridger.verdict["tail_tokens"].as_u64().unwrap(), bridger.cached_tokens());
    assert_eq!(waiter.text(), bridger.text());
    let prefills = logged(&prefilld, "prefill done", prefills_before + 1).await.len();
    assert_eq!(prefills, prefills_before + 1, "one prefill for both requests");

    // 4c. Sixteen chats at once, cold (bridged), warm (cached) and native mixed: every one is
    // answered with its verdict, and decoded's memory stays bounded (blocks stream through it,
    // never pile up in it).
    let cold: Vec<Value> = (0..6)
        // A question first: no block of these is shared with any other prompt of this test.
        .map(|i| user(&format!("Question {i}: who may use this?\n\n{}", paragraphs[4 + i..6 + i].join("\n\n"))))
        .collect();
    let mixed = (0..16).map(|i| match i % 3 {
        0 if i / 3 < cold.len() => (cold[i / 3].clone(), "auto", "bridged"),
        1 => (first.clone(), "auto", "cached"),
        _ => (first.clone(), "native", "native"),
    });
    let url = chat_url(&decoded);
    let in_flight: Vec<_> = mixed
        .map(|(messages, mode, want)| {
            let url = url.clone();
            tokio::spawn(async move { (chat_at(&url, &messages, mode).await, want) })
        })
        .collect();
    let mut answers = Vec::new();
    for request in in_flight {
        answers.push(request.await.unwrap());
    }
    for (answer, want) in &answers {
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.verdict["outcome"], *want, "{}", answer.verdict);
        assert_eq!(answer.verdict["cached_tokens"].as_u64(), Some(answer.cached_tokens()), "{}", answer.verdict);
    }
    let peak_rss_mb = peak_rss_mb(decoded.pid());
    assert!(peak_rss_mb < DECODED_PEAK_RSS_MB, "decoded's peak RSS {peak_rss_mb} MB");

    // 5. A restarted decoded still serves every committed block.
    decoded.terminate();
    assert_eq!(decoded.wait(Duration::from_secs(60)).await.code(), Some(0));
    let mut decoded = Daemon::start("decoded", &decoded_config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    // prefilld is ready only while its decoder is: it met this one again.
    prefilld.wait_ready(Duration::from_secs(60)).await;
    let after_restart = chat(&decoded, &extended, "auto").await;
    assert_eq!(after_restart.verdict["outcome"], "cached", "{}", after_restart.verdict);
    let second_tail = second.verdict["tail_tokens"].as_u64().unwrap();
    assert_eq!(after_restart.cached_tokens(), second.cached_tokens() - second_tail);
    assert_eq!(after_restart.text(), second.text());

    // 5b. A block that rotted on disk is caught by its checksum, quarantined and bridged again;
    // the answer is unchanged.
    let rotten = block_file(&decoded, &pki, &store, &first, 0).await;
    let mut data = std::fs::read(&rotten).unwrap();
    *data.last_mut().unwrap() ^= 0x01;
    std::fs::write(&rotten, &data).unwrap();
    let quarantined = |store: &std::path::Path| std::fs::read_dir(store.join("quarantine")).unwrap().count();
    let quarantined_before = quarantined(&store);
    let healed = chat(&decoded, &first, "auto").await;
    assert_eq!(healed.status, 200, "{:?}", healed.body);
    assert_eq!(healed.verdict["outcome"], "bridged", "{}", healed.verdict);
    // The cached prefix now ends before block 0, so the prompt's blocks travel again.
    assert_eq!(healed.verdict["blocks"].as_u64(), Some(blocks), "{}", healed.verdict);
    assert_eq!(healed.text(), bridged.text());
    assert_eq!(quarantined(&store), quarantined_before + 1);
    assert_ne!(std::fs::read(&rotten).unwrap(), data, "the re-bridged block replaced the rotten file");

    // 5c. A link too slow for the prefill deadline: the bridge is abandoned with reason `timeout`
    // (native here: no block can land within 1 ms), or a loud 502 when the bridge is required.
    let hasty_front = front
        .replace("[front]\n", "[front]\nprefill_deadline_base = \"1ms\"\nprefill_deadline_per_1k_tokens = \"1ms\"\n");
    let hasty_config = hasty_port.release_into(&engines.decoded_config(
        &scratch.0.join("hasty-store"),
        BLOCK_TOKENS as u32,
        &hasty_front,
    ));
    let hasty = Daemon::start("decoded", &hasty_config).await;
    hasty.wait_ready(Duration::from_secs(300)).await;
    let slow = chat(&hasty, &first, "auto").await;
    assert_eq!(slow.status, 200, "{:?}", slow.body);
    assert_eq!(
        (&slow.verdict["outcome"], &slow.verdict["reason"]),
        (&json!("native"), &json!("timeout")),
        "{}",
        slow.verdict
    );
    assert_eq!(slow.text(), bridged.text());
    let required = chat(&hasty, &first, "bridge").await;
    // A required bridge that ran out of time is the gateway's timeout.
    assert_eq!((required.status, &required.verdict["reason"]), (504, &json!("timeout")), "{}", required.verdict);
    drop(hasty);

    // 5d. vLLM crashes mid-prefill: the answer is honest about what landed, and prefilld
    // restarts its engine.
    let vllm = prefilld.children();
    assert_eq!(vllm.len(), 1, "prefilld runs one vLLM server: {vllm:?}");
    let crash_prompt = user(&format!("{}\n\nWhat is licensed?", paragraphs[24..32].join("\n\n")));
    let crashed = chat_with_fault_mid_bridge(&decoded, &crash_prompt, || {
        // SAFETY: kill(2) on prefilld's vLLM child, found a moment ago.
        assert_eq!(unsafe { libc::kill(vllm[0], libc::SIGKILL) }, 0);
    })
    .await;
    assert_fault_verdict(&crashed, &["prefill_failed", "transfer_failed"]);
    let stray = stray_files(&decoded, &store).await;
    assert!(stray.is_empty(), "nothing torn: {stray:?}");
    prefilld.wait_metric("pdbridge_engine_restarts_total{engine=\"vllm\"}", 1.0, Duration::from_secs(60)).await;
    prefilld.wait_ready(Duration::from_secs(900)).await;

    // 6. prefilld dies (SIGKILL) mid-bridge: the blocks that landed stay and are used, the verdict
    // says how far the bridge got, and prefilld's engine processes die with it.
    let long_prompt = user(&format!("{}\n\nWhat does this grant?", paragraphs[14..24].join("\n\n")));
    let vllm = prefilld.children();
    assert!(!vllm.is_empty(), "prefilld runs vLLM");
    let cut = chat_with_fault_mid_bridge(&decoded, &long_prompt, || prefilld.kill()).await;
    prefilld.wait(Duration::from_secs(30)).await;
    assert_fault_verdict(&cut, &["transfer_failed"]);
    let stray = stray_files(&decoded, &store).await;
    assert!(stray.is_empty(), "nothing torn: {stray:?}");
    for pid in vllm {
        let gone = async {
            while std::path::Path::new(&format!("/proc/{pid}")).exists() {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(60), gone).await.expect("vLLM dies with prefilld");
    }

    // With prefilld gone: native with the reason, or a loud failure when the bridge is required.
    let (status, out) = run_cli(&doctor_args(&decoded, &prefilld)).await;
    assert!(!status.success(), "doctor must fail with prefilld down:\n{out}");
    assert!(out.contains("FAIL  prefilld reachable"), "{out}");
    let fresh = user(&format!("{}\n\nSummarize.", paragraphs[6..8].join("\n\n")));
    let required = chat(&decoded, &fresh, "bridge").await;
    assert_eq!(required.status, 502, "{:?}", required.body);
    assert_eq!(required.verdict["outcome"], "failed");
    assert_eq!(required.verdict["reason"], "prefill_unavailable");
    let fallback = chat(&decoded, &fresh, "auto").await;
    assert_eq!(fallback.status, 200);
    assert_eq!(fallback.verdict["outcome"], "native", "{}", fallback.verdict);
    assert_eq!(fallback.verdict["reason"], "prefill_unavailable");
    assert_eq!(fallback.cached_tokens(), 0);

    // 7. Bad requests get 400s and leave the store as it was.
    let url = format!("http://{}/v1/chat/completions", decoded.front.unwrap());
    let client = reqwest::Client::new();
    let bad_mode = client
        .post(&url)
        .header("x-pd-bridge-mode", "sideways")
        .json(&json!({"messages": first}))
        .send()
        .await
        .unwrap();
    assert_eq!(bad_mode.status().as_u16(), 400);
    let bad_body = client.post(&url).json(&json!({"messages": "nope"})).send().await.unwrap();
    assert_eq!(bad_body.status().as_u16(), 400);
    let too_long = user(&license.repeat(4));
    let huge_max_tokens = 4_294_967_299u64; // 2^32 + 3: refused, not truncated to 3
    for (body, needle) in [
        (json!({"messages": first, "max_tokens": -3}), "max_tokens"),
        (json!({"messages": first, "max_tokens": huge_max_tokens}), "max_tokens"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"content": "hi"}]}), "role"),
        (json!({"messages": [{"role": "user", "content": 7}]}), "content"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "image_url",
        ),
        (json!({"messages": too_long}), "context_length_exceeded"),
        (json!({"messages": first, "max_tokens": 8192}), "context_length_exceeded"),
        (json!({"messages": first, "n": 17}), "`n` must be an integer from 1 to 16"),
        (json!({"messages": first, "top_logprobs": 3}), "needs `logprobs: true`"),
        (json!({"messages": first, "presence_penalty": 3}), "`presence_penalty` must be between -2 and 2"),
    ] {
        let response = client.post(&url).json(&body).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 400, "{body}");
        let error = response.json::<Value>().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default().to_owned();
        assert!(message.contains(needle), "{message:?} lacks {needle:?}");
    }
    // Another model than the one served: OpenAI's 404.
    let other_model = client.post(&url).json(&json!({"messages": first, "model": "gpt-4o"})).send().await.unwrap();
    assert_eq!(other_model.status().as_u16(), 404);
    let error = other_model.json::<Value>().await.unwrap();
    assert_eq!(error["error"]["code"], "model_not_found", "{error}");
    let still = chat(&decoded, &first, "auto").await;
    assert_eq!(still.verdict["outcome"], "cached");
    // List-form text content is the same prompt as plain content.
    let parts = json!([{"role": "user", "content": [{"type": "text", "text": first_prompt}]}]);
    let listed = chat(&decoded, &parts, "auto").await;
    assert_eq!(listed.verdict["outcome"], "cached", "{}", listed.verdict);
    assert_eq!(listed.text(), bridged.text());

    // Every verdict above is counted.
    let metrics = reqwest::get(decoded.admin_url("/metrics")).await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("pdbridge_bridge_outcomes_total{outcome=\"native\",reason=\"prefill_unavailable\"} 1"),
        "{metrics}"
    );
    decoded.terminate();
    assert_eq!(decoded.wait(Duration::from_secs(60)).await.code(), Some(0));
}

/// The fields of `daemon`'s log events with this message, once there are at least `at_least`
/// (log lines are read from the daemon's stderr as they come; gives up after 5 s).
async fn logged(daemon: &Daemon, message: &str, at_least: usize) -> Vec<Value> {
    let mut events = Vec::new();
    for _ in 0..50 {
        events = daemon
            .log_text()
            .lines()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|event| event["fields"]["message"] == message)
            .map(|event| event["fields"].clone())
            .collect();
        if events.len() >= at_least {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    events
}

/// The store file of block `index` of a chat's prompt, by the keys decoded computes.
async fn block_file(
    decoded: &Daemon,
    pki: &Pki,
    store: &std::path::Path,
    messages: &Value,
    index: usize,
) -> std::path::PathBuf {
    use pdbridge_common::proto::{GetSpecRequest, cache_store_client::CacheStoreClient};
    let tokens = decoded.tokenize_chat(messages).await;
    let channel = decoded.channel_as(Some(&pki.client("prefill-1")), "mac-1").await.unwrap();
    let spec = CacheStoreClient::new(channel).get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let key = pdbridge_common::block::keys(&spec.spec_fingerprint, &tokens, spec.block_tokens as usize)[index].to_hex();
    let path = store.join("blocks").join(&key[..2]).join(format!("{key}.safetensors"));
    assert!(path.exists(), "{} is not in the store", path.display());
    path
}

/// decoded's peak RSS bound: its own buffers (Push streams of at most `max_open_blocks` blocks
/// each, requests in flight), not the store, which lives on disk.
const DECODED_PEAK_RSS_MB: u64 = 400;

/// A process's peak resident set (VmHWM), from Linux's procfs.
fn peak_rss_mb(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmHWM:")).unwrap().trim().trim_end_matches(" kB");
    kb.trim().parse::<u64>().unwrap() / 1024
}

/// Sends a chat and runs `fault` once the first block of its bridge has been committed.
async fn chat_with_fault_mid_bridge(decoded: &Daemon, messages: &Value, fault: impl FnOnce()) -> Answer {
    let committed = "pdbridge_store_blocks_committed_total";
    let committed_before = decoded.metric(committed).await.unwrap();
    let answer = async { chat(decoded, messages, "auto").await };
    let fault = async {
        decoded.wait_metric(committed, committed_before + 1.0, Duration::from_secs(300)).await;
        fault();
    };
    tokio::join!(answer, fault).0
}

/// A bridge cut by a fault still answers, and its verdict agrees with what the engine restored:
/// usually partial; bridged if the last block beat the fault; native if no block of the
/// contiguous prefix had landed.
fn assert_fault_verdict(answer: &Answer, reasons: &[&str]) {
    let v = &answer.verdict;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(v["cached_tokens"].as_u64(), Some(answer.cached_tokens()), "{v}");
    let reason_ok = || reasons.iter().any(|r| v["reason"] == *r);
    match v["outcome"].as_str().unwrap() {
        "partial" => assert!(reason_ok() && v["blocks"].as_u64().unwrap() >= 1, "{v}"),
        "bridged" => assert!(v["blocks"].as_u64().unwrap() >= 1, "{v}"),
        "native" => assert!(reason_ok(), "{v}"),
        other => panic!("unexpected outcome {other}: {v}"),
    }
}

/// Files in the store's temp directory (torn commits), once no Push stream is open.
async fn stray_files(decoded: &Daemon, store: &std::path::Path) -> Vec<std::path::PathBuf> {
    let streams = "pdbridge_push_streams_in_flight";
    decoded.wait_metric_where(streams, "0", |n| n == 0.0, Duration::from_secs(60)).await;
    std::fs::read_dir(store.join("tmp")).map(|d| d.flatten().map(|e| e.path()).collect()).unwrap_or_default()
}

/// Runs the `pdbridge` CLI; returns its status and stdout + stderr.
async fn run_cli(args: &[String]) -> (std::process::ExitStatus, String) {
    let output = tokio::process::Command::new(binary("pdbridge")).args(args).output().await.expect("run pdbridge");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status, text)
}

/// Every `pdbridge_*` name in every dashboard query appears in a scrape of
/// the two daemons, so no panel can go silently blank.
async fn dashboard_metrics_exist(decoded: &Daemon, prefilld: &Daemon) {
    let mut scrape = String::new();
    for daemon in [decoded, prefilld] {
        scrape += &reqwest::get(daemon.admin_url("/metrics")).await.unwrap().text().await.unwrap();
    }
    let published: std::collections::BTreeSet<&str> =
        scrape.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split(['{', ' ']).next()).collect();
    let dashboards = workspace_root().join("deploy/grafana");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dashboards).expect("deploy/grafana exists") {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let mut exprs = Vec::new();
        collect_exprs(&dashboard, &mut exprs);
        assert!(!exprs.is_empty(), "{} has no queries", path.display());
        for expr in exprs {
            for name in metric_names(&expr) {
                assert!(
                    published.contains(name.as_str()),
                    "{}: `{name}` (in `{expr}`) is not in the scrape",
                    path.display()
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 0, "no dashboard metric names found");
}

fn collect_exprs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            for (key, v) in map {
                match (key.as_str(), v) {
                    ("expr", Value::String(expr)) => out.push(expr.clone()),
                    _ => collect_exprs(v, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut rest = expr;
    while let Some(at) = rest.find("pdbridge_") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        names.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}
