//! Model families other than the test model, end to end on the real engines, one per cache kind
//! and capture route beyond the test model's (the codec's own suite holds every family's
//! reconstruction to the decoder's, tensor by tensor): sliding windows (Gemma 3, whose vLLM class
//! gets its capture hooks from the plugin; the real 270M on the kv route), a latent cache
//! (DeepSeek-V3 MLA, vLLM in bf16), recurrent states (Qwen3-Next's gated delta-net, vLLM in bf16;
//! a follow-up turn restores a stored state), a window and pools (DeepSeek-V4.1, on the plugin's
//! own vLLM class);
//! and a cache class without a codec is refused at the handshake with its reason. A quantized KV
//! cache (Llama 3.1, rope scaling) is bridged under tensor parallelism (`topology`).

use std::time::Duration;

use pdbridge_common::proto::{
    Outcome, Payload, PrefillRequest, Reason, outcome::Status, prefill_event::Event, prefiller_client::PrefillerClient,
};
use pdbridge_tests::{Daemon, Engines, Reserved, Scratch, decoders, fixed_spec_config, license_text};
use serde_json::Value;

use crate::answers::{Answer, chat, complete, user};

/// The generated families' store block.
const BLOCK_TOKENS: u32 = 64;

/// What a case asks the front door: a chat, or a base model's plain prompt to continue.
enum Prompt {
    Chat(Value),
    Plain(String),
}

impl Prompt {
    async fn ask(&self, decoded: &Daemon, mode: &str) -> Answer {
        match self {
            Prompt::Chat(messages) => chat(decoded, messages, mode).await,
            Prompt::Plain(prompt) => complete(decoded, prompt, mode).await,
        }
    }
}

/// A checkpoint bridged end to end: its engines, the store's block, the prompt and the whole blocks
/// it must make at least.
struct Case {
    name: &'static str,
    engines: Engines,
    block_tokens: u32,
    prompt: Prompt,
    min_blocks: u64,
}

impl Case {
    /// A generated family's checkpoint, asked about the license's start in blocks of 64 tokens.
    fn family(family: &'static str) -> Case {
        let prompt = Prompt::Chat(user(&format!("{}\n\nWhat is this text?", &license_text()[..2400])));
        Case { name: family, engines: Engines::family(family), block_tokens: BLOCK_TOKENS, prompt, min_blocks: 4 }
    }

    /// The real Gemma 3 270M (a base model: no chat template), half the license to continue in
    /// blocks of its 512-token sliding window (a bridged block holds a window): 2 blocks, the
    /// second past the window, and a tail.
    fn gemma3_270m() -> Case {
        let engines = Engines::checkpoint("gemma3-270m");
        let prompt = Prompt::Plain(format!("{}\n\nIn short, the text above", &license_text()[..5800]));
        Case { name: "gemma3-270m", engines, block_tokens: 512, prompt, min_blocks: 2 }
    }
}

/// prefilld and decoded on `case`'s checkpoint; a cold prompt bridged, then served natively: the
/// same greedy answer. prefilld may also push to the decoder at `also`.
async fn bridges_as_the_decoder_answers(case: Case, scratch: &Scratch, also: Option<&Reserved>) -> Daemon {
    let port = Reserved::new();
    let prefilld =
        start_prefilld(&case, scratch, "", &[Some(&port), also].into_iter().flatten().collect::<Vec<_>>()).await;
    let (decoded, verdict) = decoder_answers_as_natively(&case, &prefilld, port, scratch).await;
    assert_eq!(verdict["route"], "reconstruct", "{}: {verdict}", case.name);
    stop(decoded).await;
    prefilld
}

/// Stops `daemon` as a service manager would (SIGTERM) and waits for it to exit.
async fn stop(mut daemon: Daemon) {
    daemon.terminate();
    daemon.wait(Duration::from_secs(120)).await;
}

/// prefilld on `case`'s checkpoint, its `[engine]` keys `engine_keys`, pushing to the decoders at
/// `decoders` (the first must come up for it to be ready).
async fn start_prefilld(case: &Case, scratch: &Scratch, engine_keys: &str, decoders_at: &[&Reserved]) -> Daemon {
    let addrs: Vec<String> = decoders_at.iter().map(|port| format!("http://{}", port.addr())).collect();
    Daemon::start(
        "prefilld",
        &case.engines.prefilld_config_with(&scratch.0.join(case.name), engine_keys, "", &decoders(&addrs)),
    )
    .await
}

/// A decoder of `case`'s checkpoint on `port` behind `prefilld`: a cold prompt bridged, then served
/// natively: the same greedy answer. Returns the decoder and the bridged answer's verdict.
async fn decoder_answers_as_natively(
    case: &Case,
    prefilld: &Daemon,
    port: Reserved,
    scratch: &Scratch,
) -> (Daemon, Value) {
    let Case { name, engines, block_tokens, prompt, min_blocks } = case;
    let extra = format!(
        "[front]\nlisten = \"127.0.0.1:0\"\nprefilld = \"http://{}\"\nmin_bridge_tokens = {block_tokens}\n",
        prefilld.grpc
    );
    let store = scratch.0.join(format!("{name}-store-{}", port.addr().port()));
    let decoded =
        Daemon::start("decoded", &port.release_into(&engines.decoded_config(&store, *block_tokens, &extra))).await;
    decoded.wait_ready(Duration::from_secs(600)).await;
    prefilld.wait_ready(Duration::from_secs(900)).await;

    let bridged = prompt.ask(&decoded, "auto").await;
    assert_eq!(bridged.status, 200, "{name}: {:?}", bridged.body);
    assert_eq!(bridged.verdict["outcome"], "bridged", "{name}: {}", bridged.verdict);
    let blocks = bridged.prompt_tokens() / u64::from(*block_tokens);
    // Every whole block and the tail after them: the decoder computes one prompt token. A
    // pooled cache (DeepSeek-V4.1) stores whole blocks only, of all but the last token.
    let cached = match *name {
        "deepseek_v41" | "deepseek_v41_flash" => {
            (bridged.prompt_tokens() - 1) / u64::from(*block_tokens) * u64::from(*block_tokens)
        }
        _ => bridged.prompt_tokens() - 1,
    };
    assert!(blocks >= *min_blocks && bridged.cached_tokens() == cached, "{name}: {}", bridged.verdict);
    let native = prompt.ask(&decoded, "native").await;
    assert_eq!(native.cached_tokens(), 0);
    assert!(!native.text().is_empty());
    assert_eq!(native.text(), bridged.text(), "{name}: bridged and native greedy answers differ");
    if let (Prompt::Chat(messages), "qwen3_next") = (prompt, *name) {
        // The next turn extends the conversation: its first blocks, recurrent states included,
        // come from the store; the rest is bridged (prefilld's plugin runs the known blocks only
        // to carry the state to the new ones) and the answer is the native one.
        let mut turn = messages.clone();
        let messages = turn.as_array_mut().unwrap();
        messages.push(serde_json::json!({"role": "assistant", "content": bridged.text()}));
        messages.push(user(&format!("And this one?\n\n{}", &license_text()[2400..3400]))[0].clone());
        let next = chat(&decoded, &turn, "auto").await;
        assert_eq!(next.status, 200, "{:?}", next.body);
        let bridged_now = next.verdict["blocks"].as_u64().unwrap();
        let whole = (next.prompt_tokens() - 1) / u64::from(*block_tokens);
        assert!(bridged_now > 0 && bridged_now < whole, "{}", next.verdict);
        assert_eq!(next.cached_tokens(), next.prompt_tokens() - 1, "{}", next.verdict);
        assert_eq!(next.text(), chat(&decoded, &turn, "native").await.text(), "follow-up turn differs");
    }
    (decoded, bridged.verdict)
}

/// What prefilld answers `request` with, in the end.
async fn prefill_outcome(prefilld: &Daemon, request: PrefillRequest) -> Outcome {
    let mut events =
        PrefillerClient::connect(prefilld.grpc_uri()).await.unwrap().prefill(request).await.unwrap().into_inner();
    let mut outcome = None;
    while let Some(event) = events.message().await.unwrap() {
        if let Some(Event::Outcome(o)) = event.event {
            outcome = Some(o);
        }
    }
    outcome.expect("an outcome")
}

#[tokio::test]
async fn families_bridge_as_their_decoder_answers() {
    let scratch = Scratch::new("families");
    // Gemma 3: sliding-window layers (RotatingKVCache) of 64 tokens beside a global one, (1+w)
    // norms; vLLM's class gets its capture from the plugin's hooks. (The real Gemma 3 270M's
    // windows bridge on the kv route below.)
    stop(bridges_as_the_decoder_answers(Case::family("gemma3"), &scratch, None).await).await;
    // Qwen3-Next: three gated delta-net layers (a recurrent state each) and a full-attention one.
    stop(bridges_as_the_decoder_answers(Case::family("qwen3_next"), &scratch, None).await).await;
    // DeepSeek-V3: multi-head latent attention, MoE; vLLM in bf16, the decoder in fp32.
    let listed_port = Reserved::new();
    let prefilld = bridges_as_the_decoder_answers(Case::family("deepseek_v3"), &scratch, Some(&listed_port)).await;

    // A decoder whose layer 1 keeps a list of caches (no codec): prefilld refuses at the
    // handshake, naming the layer and why, and bridges nothing.
    let config = fixed_spec_config(&scratch.0.join("listed"), &scratch.0.join("listed-store"), 16, "");
    let spec_file = scratch.0.join("listed").join("spec.json");
    let mut info: serde_json::Value = serde_json::from_slice(&std::fs::read(&spec_file).unwrap()).unwrap();
    let layer = &mut info["spec"]["layers"][1];
    layer["cache_class"] = "CacheList".into();
    layer["kind"] = "CACHE_KIND_UNSUPPORTED".into();
    layer["tensors"] = serde_json::json!([]);
    layer["unsupported_reason"] = "CacheList: a list of sub-caches per layer".into();
    std::fs::write(&spec_file, info.to_string()).unwrap();
    let decoder = Daemon::start("decoded", &listed_port.release_into(&config)).await;
    decoder.wait_ready(Duration::from_secs(60)).await;
    let request =
        PrefillRequest { token_ids: (0..48).collect(), decoder_addr: decoder.grpc_uri(), ..Default::default() };
    let outcome = prefill_outcome(&prefilld, request).await;
    assert_eq!(outcome.status(), Status::Failed, "{outcome:?}");
    assert_eq!(outcome.blocks_committed, 0);
    assert_eq!(outcome.reason(), Reason::UnsupportedModel, "{}", outcome.detail);
    assert!(outcome.detail.contains("layer 1: CacheList: a list of sub-caches"), "{}", outcome.detail);
}

/// DeepSeek-V4.1: hyper-connection streams, an fp8 sliding window, fp4 pools and index keys (the
/// pooled kind: whole blocks of all but the last token, no tail); vLLM runs the plugin's own
/// class for it, as prefilld starts it (whole prompts per step). The checkpoint is in DeepSeek's
/// published format (its names, fp8 projections and fp4 experts with ue8m0 scales), one file set
/// both engines load: the decoder's projections stay packed (MLX's mxfp8 and mxfp4).
#[tokio::test]
async fn deepseek_v41_windows_and_pools_bridge_as_the_decoder_answers() {
    let scratch = Scratch::new("families-v41");
    stop(bridges_as_the_decoder_answers(Case::family("deepseek_v41_flash"), &scratch, None).await).await;
}

/// The kv route (`engine.route = "kv"`: vLLM runs no capture; the plugin lays vLLM's own K/V out
/// as the decoder's cache, no MLX on the prefill side) on the real Gemma 3 270M: its global layers'
/// KVCache beside 512-token sliding windows (RotatingKVCache, whose rows are read as vLLM writes
/// them, before it frees a window's blocks) bridge, and the decoder answers as it does natively; a
/// decoder asking for layer inputs (the exact route needs the capture) is refused with the reason,
/// which the front door serves natively. (mlx-lm quantizes no sliding window: the quantized cache's
/// kv route is held to `mx.quantize` tensor by tensor in the plugin's suite, `KvRouteTest`.)
#[tokio::test]
async fn the_kv_route_bridges_plain_and_windowed_caches() {
    let scratch = Scratch::new("families-kv");
    let case = Case::gemma3_270m();
    let port = Reserved::new();
    let prefilld = start_prefilld(&case, &scratch, "route = \"kv\"\n", &[&port]).await;
    let (decoded, verdict) = decoder_answers_as_natively(&case, &prefilld, port, &scratch).await;
    assert_eq!(verdict["route"], "kv", "{verdict}");

    let request = PrefillRequest {
        token_ids: (2..1100).collect(),
        decoder_addr: decoded.grpc_uri(),
        payload: Payload::LayerInputs as i32,
        ..Default::default()
    };
    let outcome = prefill_outcome(&prefilld, request).await;
    assert_eq!((outcome.status(), outcome.reason()), (Status::Failed, Reason::UnsupportedModel), "{outcome:?}");
    assert!(outcome.detail.contains("layer inputs need the capture"), "{}", outcome.detail);
    stop(decoded).await;
    stop(prefilld).await;
}
