//! Model families other than the test model, end to end on the real engines, one per cache kind
//! and capture route beyond the test model's (the codec's own suite holds every family's
//! reconstruction to the decoder's, tensor by tensor): sliding windows (Gemma 3, whose vLLM class
//! gets its capture hooks from the plugin), a latent cache (DeepSeek-V3 MLA, vLLM in bf16),
//! recurrent states (Qwen3-Next's gated delta-net, vLLM in bf16; a follow-up turn restores a
//! stored state), a window and pools (DeepSeek-V4.1, on the plugin's own vLLM class); and a cache
//! class without a codec is refused at the handshake with its reason. A quantized KV cache
//! (Llama 3.1, rope scaling) is bridged under tensor parallelism (`topology`).

use std::time::Duration;

use pdbridge_common::proto::{
    PrefillRequest, outcome::Status, prefill_event::Event, prefiller_client::PrefillerClient,
};
use pdbridge_tests::{Daemon, Engines, Reserved, Scratch, decoders, fixed_spec_config, license_text};

use crate::answers::{chat, user};

const BLOCK_TOKENS: u32 = 64;

/// prefilld and decoded on `family`'s generated checkpoint, the decoder's `[engine]` given
/// `engine_keys`; a cold prompt bridged, then served natively: the same greedy answer. prefilld
/// may also push to the decoder at `also`.
async fn bridges_as_the_decoder_answers(
    family: &str,
    engine_keys: &str,
    scratch: &Scratch,
    also: Option<&Reserved>,
) -> Daemon {
    let engines = Engines::family(family);
    let port = Reserved::new();
    let addrs: Vec<String> =
        std::iter::once(port.addr()).chain(also.map(Reserved::addr)).map(|addr| format!("http://{addr}")).collect();
    let prefilld =
        Daemon::start("prefilld", &engines.prefilld_config(&scratch.0.join(family), &decoders(&addrs))).await;
    let extra = format!(
        "{engine_keys}\n[front]\nlisten = \"127.0.0.1:0\"\nprefilld = \"http://{}\"\nmin_bridge_tokens = {BLOCK_TOKENS}\n",
        prefilld.grpc
    );
    let store = scratch.0.join(format!("{family}-store"));
    let mut decoded =
        Daemon::start("decoded", &port.release_into(&engines.decoded_config(&store, BLOCK_TOKENS, &extra))).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    prefilld.wait_ready(Duration::from_secs(900)).await;

    let license = license_text();
    let prompt = user(&format!("{}\n\nWhat is this text?", &license[..2400]));
    let bridged = chat(&decoded, &prompt, "auto").await;
    assert_eq!(bridged.status, 200, "{family}: {:?}", bridged.body);
    assert_eq!(bridged.verdict["outcome"], "bridged", "{family}: {}", bridged.verdict);
    let blocks = bridged.prompt_tokens() / u64::from(BLOCK_TOKENS);
    // Every whole block and the tail after them: the decoder computes one prompt token. A
    // pooled cache (DeepSeek-V4.1) stores whole blocks only, of all but the last token.
    let cached = match family {
        "deepseek_v41" | "deepseek_v41_flash" => {
            (bridged.prompt_tokens() - 1) / u64::from(BLOCK_TOKENS) * u64::from(BLOCK_TOKENS)
        }
        _ => bridged.prompt_tokens() - 1,
    };
    assert!(blocks >= 4 && bridged.cached_tokens() == cached, "{family}: {}", bridged.verdict);
    let native = chat(&decoded, &prompt, "native").await;
    assert_eq!(native.cached_tokens(), 0);
    assert!(!native.text().is_empty());
    assert_eq!(native.text(), bridged.text(), "{family}: bridged and native greedy answers differ");
    if family == "qwen3_next" {
        // The next turn extends the conversation: its first blocks, recurrent states included,
        // come from the store; the rest is bridged (prefilld's plugin runs the known blocks only
        // to carry the state to the new ones) and the answer is the native one.
        let mut turn = prompt.clone();
        let messages = turn.as_array_mut().unwrap();
        messages.push(serde_json::json!({"role": "assistant", "content": bridged.text()}));
        messages.push(user(&format!("And this one?\n\n{}", &license[2400..3400]))[0].clone());
        let next = chat(&decoded, &turn, "auto").await;
        assert_eq!(next.status, 200, "{:?}", next.body);
        let bridged_now = next.verdict["blocks"].as_u64().unwrap();
        let whole = (next.prompt_tokens() - 1) / u64::from(BLOCK_TOKENS);
        assert!(bridged_now > 0 && bridged_now < whole, "{}", next.verdict);
        assert_eq!(next.cached_tokens(), next.prompt_tokens() - 1, "{}", next.verdict);
        assert_eq!(next.text(), chat(&decoded, &turn, "native").await.text(), "follow-up turn differs");
    }
    decoded.terminate();
    decoded.wait(Duration::from_secs(60)).await;
    prefilld
}

#[tokio::test]
async fn generated_families_bridge_as_their_decoder_answers() {
    let scratch = Scratch::new("families");
    // Gemma 3: sliding-window layers (RotatingKVCache) beside a global one, (1+w) norms; vLLM's
    // class gets its capture from the plugin's hooks.
    let mut prefilld = bridges_as_the_decoder_answers("gemma3", "", &scratch, None).await;
    prefilld.terminate();
    prefilld.wait(Duration::from_secs(120)).await;
    // Qwen3-Next: three gated delta-net layers (a recurrent state each) and a full-attention one.
    let mut prefilld = bridges_as_the_decoder_answers("qwen3_next", "", &scratch, None).await;
    prefilld.terminate();
    prefilld.wait(Duration::from_secs(120)).await;
    // DeepSeek-V3: multi-head latent attention, MoE; vLLM in bf16, the decoder in fp32.
    let listed_port = Reserved::new();
    let prefilld = bridges_as_the_decoder_answers("deepseek_v3", "", &scratch, Some(&listed_port)).await;

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
    let mut events =
        PrefillerClient::connect(prefilld.grpc_uri()).await.unwrap().prefill(request).await.unwrap().into_inner();
    let mut outcome = None;
    while let Some(event) = events.message().await.unwrap() {
        if let Some(Event::Outcome(o)) = event.event {
            outcome = Some(o);
        }
    }
    let outcome = outcome.expect("an outcome");
    assert_eq!(outcome.status(), Status::Failed, "{outcome:?}");
    assert_eq!(outcome.blocks_committed, 0);
    assert_eq!(outcome.reason(), pdbridge_common::proto::Reason::UnsupportedModel, "{}", outcome.detail);
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
    let mut prefilld = bridges_as_the_decoder_answers("deepseek_v41_flash", "", &scratch, None).await;
    prefilld.terminate();
    prefilld.wait(Duration::from_secs(120)).await;
}
