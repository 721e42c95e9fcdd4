//! The front door under load, on the real decode engine: admission control
//! (429 with `Retry-After` beyond `front.max_pending_requests`), the request
//! deadline (`front.request_timeout`: 504, or an error event once streaming),
//! and cancellation: a request that is cut or whose client leaves stops its
//! generation, so the next request is served at once.

use std::time::Duration;

use pdbridge_tests::{Daemon, Engines, Scratch};
use serde_json::{Value, json};

/// Greedy decoding continues this for far longer than any deadline below.
const ENDLESS: &str = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,";
/// Long enough for any short request (5 prompt tokens, 2 answered) on a busy CI machine once the
/// engine is warm (its first answer reads the weights), far shorter than an endless generation
/// (thousands of tokens at ~10 tokens/s); each deadline below is waited out twice, the endless
/// answer generating all the while.
const REQUEST_TIMEOUT_S: u64 = 15;

/// decoded with its real engine, a store under `scratch`, blocks of 32 and
/// `front` (more `[front]` keys); ready.
async fn decoded_with_engine(scratch: &Scratch, engine: &str, front: &str) -> Daemon {
    decoded_on(&Engines::locate(), scratch, engine, front).await
}

/// [`decoded_with_engine`] on `engines`' decoder.
async fn decoded_on(engines: &Engines, scratch: &Scratch, engine: &str, front: &str) -> Daemon {
    let config = engines.decoded_config(
        &scratch.0.join("store"),
        32,
        &format!("{engine}[front]\nlisten = \"127.0.0.1:0\"\n{front}"),
    );
    let decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    decoded
}

fn completion(prompt: &str, max_tokens: u32, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream})
}

#[tokio::test]
async fn admission_deadline_and_cancellation() {
    let scratch = Scratch::new("load");
    let front = format!("max_pending_requests = 1\nrequest_timeout = \"{REQUEST_TIMEOUT_S}s\"\n");
    let decoded = decoded_with_engine(&scratch, "", &front).await;
    let url = format!("http://{}/v1/completions", decoded.front.unwrap());
    let client = reqwest::Client::new();
    let short = || client.post(&url).json(&completion("The capital of France is", 2, false)).send();
    // A warm engine first: the load below is what is tested, not the first answer's page faults.
    let warm = client.post(&url).json(&completion(ENDLESS, 1, false)).send().await.unwrap();
    assert_eq!(warm.status().as_u16(), 200, "{:?}", warm.text().await);

    // A streamed answer holds the one admission slot while it streams.
    let mut endless = client.post(&url).json(&completion(ENDLESS, 4000, true)).send().await.unwrap();
    assert_eq!(endless.status().as_u16(), 200);
    let first = endless.chunk().await.unwrap().expect("a first event");
    assert!(String::from_utf8_lossy(&first).contains("data:"), "{first:?}");
    let refused = short().await.unwrap();
    assert_eq!(refused.status().as_u16(), 429);
    assert_eq!(refused.headers().get("retry-after").map(|v| v.to_str().unwrap()), Some("1"));

    // At the deadline the stream ends with an error event and no [DONE].
    let mut rest = String::new();
    while let Some(chunk) = endless.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(
        rest.contains("request_timeout"),
        "no deadline error event in: {}",
        &rest[rest.len().saturating_sub(400)..]
    );
    assert!(!rest.contains("[DONE]"));

    // Its generation was cancelled: a short request is answered within its own deadline.
    let answered = short().await.unwrap();
    assert_eq!(answered.status().as_u16(), 200, "{:?}", answered.text().await);

    // A non-streamed request past the deadline is a 504, and its generation stops too.
    let cut = client.post(&url).json(&completion(ENDLESS, 4000, false)).send().await.unwrap();
    assert_eq!(cut.status().as_u16(), 504);
    let body: Value = cut.json().await.unwrap();
    assert_eq!(body["error"]["type"], "timeout", "{body}");
    let answered = short().await.unwrap();
    assert_eq!(answered.status().as_u16(), 200, "{:?}", answered.text().await);

    // A client that leaves mid-stream frees its slot and its generation.
    let mut leaving = client.post(&url).json(&completion(ENDLESS, 4000, true)).send().await.unwrap();
    leaving.chunk().await.unwrap().expect("a first event");
    drop(leaving);
    let mut answered = None;
    for _ in 0..100 {
        // The slot is freed when the server notices the client is gone (its
        // next event fails to send): a 429 or two, then the answer.
        let response = short().await.unwrap();
        if response.status().as_u16() != 429 {
            answered = Some(response);
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let answered = answered.expect("the slot of a client that left is freed");
    assert_eq!(answered.status().as_u16(), 200, "{:?}", answered.text().await);
    // The adapter logs each cancellation; its lines reach the test through a pipe, so wait for them.
    let cancelled = || decoded.log_text().matches("op=generate cancelled").count();
    for _ in 0..100 {
        if cancelled() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(cancelled() >= 3, "every cut generation is cancelled:\n{}", decoded.log_text());
}

/// Liveness probes of the adapter: a frozen one is reported within about 5 s.
const LIVENESS: &str = "[engine.liveness]\ninterval = \"500ms\"\ntimeout = \"2s\"\nfailures = 2\n";
/// Longer than LIVENESS takes to call an engine that does not answer stalled.
const STALL_WINDOW: Duration = Duration::from_secs(6);

/// A busy adapter is alive; a frozen one (SIGSTOP) is not ready until it answers again, and its
/// answer goes on; a crashed one ends its answer with an error and is restarted.
#[tokio::test]
async fn a_decode_engine_frozen_or_crashed_mid_answer_is_told_and_returns() {
    const CACHE_STORE: &str = "pdbridge.v1.CacheStore";
    let scratch = Scratch::new("crash");
    let decoded = decoded_with_engine(&scratch, LIVENESS, "").await;
    let url = format!("http://{}/v1/completions", decoded.front.unwrap());
    let client = reqwest::Client::new();
    let health = decoded.channel().await;
    let alive = "pdbridge_engine_alive{engine=\"mlx\"}";

    let mut streaming = client.post(&url).json(&completion(ENDLESS, 4000, true)).send().await.unwrap();
    streaming.chunk().await.unwrap().expect("a first event");
    // Generating is not stalling: the adapter answers its probe between tokens all along.
    let busy_until = std::time::Instant::now() + STALL_WINDOW;
    while std::time::Instant::now() < busy_until {
        streaming.chunk().await.unwrap().expect("tokens keep coming");
        let ready = reqwest::get(decoded.admin_url("/readyz")).await.unwrap().status();
        assert_eq!(ready.as_u16(), 200, "a generating adapter was called stalled");
    }
    let frozen = decoded.freeze_engine();
    decoded.wait_serving(&health, CACHE_STORE, false, Duration::from_secs(60)).await;
    assert_eq!(decoded.metric(alive).await, Some(0.0));
    drop(frozen);
    decoded.wait_serving(&health, CACHE_STORE, true, Duration::from_secs(60)).await;
    assert_eq!(decoded.metric(alive).await, Some(1.0));
    streaming.chunk().await.unwrap().expect("the answer goes on after the thaw");

    let engine = decoded.children();
    assert_eq!(engine.len(), 1, "one engine process: {engine:?}");
    // SAFETY: kill(2) on the daemon's engine child, found a moment ago.
    assert_eq!(unsafe { libc::kill(engine[0], libc::SIGKILL) }, 0);

    // The answer ends with an error event instead of hanging or claiming success.
    let mut rest = String::new();
    while let Some(chunk) = streaming.chunk().await.unwrap() {
        rest.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(rest.contains("\"error\""), "no error event in: {}", &rest[rest.len().saturating_sub(400)..]);
    assert!(!rest.contains("[DONE]"));

    // The supervisor restarts the engine; then requests are answered again.
    decoded.wait_metric("pdbridge_engine_restarts_total{engine=\"mlx\"}", 1.0, Duration::from_secs(60)).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let answered = client.post(&url).json(&completion("The capital of France is", 2, false)).send().await.unwrap();
    assert_eq!(answered.status().as_u16(), 200, "{:?}", answered.text().await);
    assert_ne!(decoded.children(), engine, "a new engine process");
}

/// The store lease of a request lasts until its generation ends, not just until the request is
/// handed to the engine: blocks that wait in the engine's queue cannot be evicted under them.
#[tokio::test]
async fn blocks_waiting_in_the_engine_queue_are_not_evicted() {
    use pdbridge_common::proto::{GetSpecRequest, PushOpen, cache_store_client::CacheStoreClient};
    use pdbridge_tests::cache_store::{block_shards, frames, push};

    let engines = Engines::locate();
    let scratch = Scratch::new("lease");
    let store = scratch.0.join("store");
    // The prompt's whole blocks, of 16 tokens.
    let messages = json!([{"role": "user", "content": "Count the blocks: one, two, three, four, five."}]);
    let whole: u32 = 2;
    // Room for the prompt's blocks (16 tokens x 46,080 B each) and their headers, no more.
    let budget = whole as usize * 16 * 46_080 + 64 * 1024;
    let config = engines.decoded_config(&store, 16, "[front]\nlisten = \"127.0.0.1:0\"\n").replacen(
        "[engine]",
        &format!("budget_bytes = {budget}\n[engine]"),
        1,
    );
    let decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let front = decoded.front.unwrap();
    let client = reqwest::Client::new();
    let mut grpc = CacheStoreClient::new(decoded.channel().await);
    let spec = grpc.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let push_blocks = |tokens: Vec<u32>| {
        let mut grpc = grpc.clone();
        let open = PushOpen {
            request_id: "lease".into(),
            spec_fingerprint: spec.spec_fingerprint.clone(),
            token_ids: tokens,
            first_block: 0,
            tail_tokens: 0,
            ..Default::default()
        };
        let shards = (0..whole).flat_map(|b| block_shards(&spec, b, 9)).collect();
        async move { push(&mut grpc, frames(open, shards, Some(whole))).await.unwrap() }
    };

    // The prompt's whole blocks are stored (as a prefiller would push them).
    let tokens = decoded.tokenize_chat(&messages).await;
    assert_eq!(tokens.len() as u32 / 16, whole, "{} tokens: {whole} whole blocks and a tail", tokens.len());
    assert_eq!(push_blocks(tokens).await.blocks_committed, whole);

    // The engine is busy with an endless answer, so the next request waits in its queue.
    let url = format!("http://{front}/v1/completions");
    let mut busy = client.post(&url).json(&completion(ENDLESS, 4000, true)).send().await.unwrap();
    busy.chunk().await.unwrap().expect("a first event");
    let queued = tokio::spawn({
        let request = client
            .post(format!("http://{front}/v1/chat/completions"))
            .json(&json!({"messages": messages, "max_tokens": 2, "temperature": 0}));
        async move { request.send().await.unwrap() }
    });
    decoded.wait_metric("pdbridge_store_leased_blocks", whole as f64, Duration::from_secs(60)).await;

    // New blocks overflow the budget while the queued request holds its lease: eviction
    // must pick the new blocks, not the leased ones.
    let evicted_before = decoded.metric("pdbridge_store_evictions_total").await.unwrap();
    push_blocks((7000..7000 + whole * 16).collect()).await;
    assert!(decoded.metric("pdbridge_store_evictions_total").await.unwrap() > evicted_before);

    drop(busy);
    let answered = queued.await.unwrap();
    assert_eq!(answered.status().as_u16(), 200);
    let verdict: Value = serde_json::from_str(answered.headers()["x-pd-bridge"].to_str().unwrap()).unwrap();
    assert_eq!((&verdict["outcome"], &verdict["cached_tokens"]), (&json!("cached"), &json!(whole * 16)), "{verdict}");
    assert_eq!(std::fs::read_dir(store.join("quarantine")).unwrap().count(), 0, "no block went missing");
}

/// `stop` ends an answer before the stop sequence, streamed or not, and says so (whatever the
/// model: the generated Llama 3 answers).
/// Under the cost policy, starting from configured rates (the decoder alone fast, a bridge slow),
/// the decoder's own answer is predicted sooner: no bridge (`not_worth_it`, even with no prefilld to
/// ask), the prediction in the verdict; the answer teaches the model the decoder's real rate.
const COST_POLICY: &str = "policy = \"cost\"\nmin_bridge_tokens = 64\n\
                           cold_here_tokens_per_s = 1000000.0\ncold_bridge_tokens_per_s = 10.0\n";

/// One decoder (the generated Llama 3) for two things: stop sequences end answers before them, and
/// the cost policy weighs a bridge.
#[tokio::test]
async fn stop_sequences_end_answers_before_them_and_the_cost_policy_weighs_bridges() {
    let scratch = Scratch::new("stop");
    let decoded = decoded_on(&Engines::family("llama3"), &scratch, "", COST_POLICY).await;
    let url = format!("http://{}/v1/completions", decoded.front.unwrap());
    let client = reqwest::Client::new();
    let complete = |body: Value| {
        let request = client.post(&url).json(&body);
        async move { request.send().await.unwrap().json::<Value>().await.unwrap() }
    };

    // First: the cost model's rates are the configured ones until an answer teaches it.
    weighs_bridges_by_cost(&client, &url).await;

    let full = complete(completion(ENDLESS, 24, false)).await;
    let full = full["choices"][0]["text"].as_str().unwrap().to_owned();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 10, "{full:?}");
    // From the middle of a greedy answer, so it is bound to come; the answer ends just before it.
    let stop: String = chars[5..8].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];

    let mut body = completion(ENDLESS, 24, false);
    body["stop"] = json!(["never in this answer", stop]);
    let stopped = complete(body.clone()).await;
    assert_eq!(stopped["choices"][0]["text"], expected, "stop {stop:?} in {full:?}");
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");

    body["stream"] = json!(true);
    let events = client.post(&url).json(&body).send().await.unwrap().text().await.unwrap();
    let chunks: Vec<Value> = events
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .map(|data| serde_json::from_str(data).unwrap())
        .collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, expected);
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
}

async fn weighs_bridges_by_cost(client: &reqwest::Client, url: &str) {
    let verdict_of = |prompt: String| {
        let request = client.post(url).json(&completion(&prompt, 1, false));
        async move {
            let answer = request.send().await.unwrap();
            assert_eq!(answer.status().as_u16(), 200);
            let verdict: Value = serde_json::from_str(answer.headers()["x-pd-bridge"].to_str().unwrap()).unwrap();
            assert_eq!((&verdict["outcome"], &verdict["reason"]), (&json!("native"), &json!("not_worth_it")));
            verdict
        }
    };
    let cold = verdict_of("A prompt of a few blocks, longer than min_bridge_tokens. ".repeat(12)).await;
    let tokens = cold["prompt_tokens"].as_f64().unwrap();
    assert!(tokens >= 64.0, "{cold}");
    // Every token computed: at a millionth of a second here, a tenth bridged.
    let predicted = &cold["prediction_ms"];
    assert!((predicted["here_ms"].as_f64().unwrap() - tokens / 1e3).abs() < 1e-9, "{cold}");
    assert!((predicted["bridge_ms"].as_f64().unwrap() - tokens * 1e2).abs() < 1e-6, "{cold}");
    // That answer took the decoder far longer than a microsecond a token: its rate moved.
    let taught = verdict_of("Another prompt of a few blocks, longer than min_bridge_tokens. ".repeat(12)).await;
    let tokens = taught["prompt_tokens"].as_f64().unwrap();
    assert!(taught["prediction_ms"]["here_ms"].as_f64().unwrap() > 10.0 * tokens / 1e3, "{taught}");
}

/// The official SDKs against the front door (behind an API key). OpenAI's: models, chat,
/// streaming with and without the usage chunk, completions (`echo` and `suffix` refused by name),
/// the context-length error's code, `stop`, list-form content, logprobs (chat, streamed, legacy),
/// a reproducible seed, penalties, `n` answers (streamed too), its exception types; the Responses
/// API whole and as typed events, a function call's output, `previous_response_id` refused.
/// Anthropic's: messages whole and streamed, `stop_sequences`, `system`, usage, errors in its
/// shape. None of it depends on what the model says: the generated Llama 3 answers (SmolLM2's
/// tokenizer and chat template, ~100x faster on this CPU).
#[tokio::test]
async fn the_official_sdks_are_answered_as_their_apis_answer() {
    let said = sdk_checks(Engines::family("llama3"), "", "chat,responses,messages").await;
    assert_eq!(said.lines().filter(|l| l.starts_with("ok ")).count(), 33, "{said}");
}

/// Tool calls SmolLM2 makes, through the SDKs: parsed, never shown as text, in chat (streamed),
/// Responses (whole: made from chat's whole answer) and Anthropic's Messages (streamed); decoded
/// serves a chat template that renders tools.
#[tokio::test]
async fn tool_calls_the_model_makes_reach_the_sdks_parsed() {
    let template = pdbridge_tests::workspace_root().join("deploy/templates/smollm2-tools.jinja");
    // The tools' long prompts are prefilled natively: the dense decoder (what is tested is the
    // tool calls' way to the SDKs, not the 4-bit kernels).
    let said = sdk_checks(Engines::dense(), &format!("chat_template = {template:?}\n"), "tool-calls").await;
    assert_eq!(said.lines().filter(|l| l.starts_with("ok ")).count(), 3, "{said}");
}

/// `tests/sdk/clients.py --checks checks` against decoded on `engines` (its `[engine]` given
/// `engine_keys`) behind an API key; what the script said, once it passed.
async fn sdk_checks(engines: Engines, engine_keys: &str, checks: &str) -> String {
    let scratch = Scratch::new("sdk");
    let key = "sk-sdk-test-4f1c";
    let front = format!("api_keys = [{key:?}]\nmodel_name = \"smollm2\"\n");
    let decoded = decoded_on(&engines, &scratch, engine_keys, &front).await;
    let script = pdbridge_tests::workspace_root().join("tests/sdk/clients.py");
    let output = tokio::process::Command::new(&engines.python)
        .arg(script)
        .args(["--url", &format!("http://{}", decoded.front.unwrap()), "--model", "smollm2", "--api-key", key])
        .args(["--checks", checks])
        .output()
        .await
        .expect("run the SDKs' script");
    let said = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(output.status.success(), "{said}\ndecoded's log:\n{}", decoded.log_text());
    said
}
