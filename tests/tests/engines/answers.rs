//! Chats through decoded's front door, and the decoder's native answers they are held to.

use pdbridge_common::{
    proto::{GetSpecRequest, cache_store_client::CacheStoreClient},
    spec,
};
use pdbridge_tests::{Daemon, license_text};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tonic::transport::Channel;

pub(crate) struct Answer {
    pub status: u16,
    pub verdict: Value,
    pub body: Value,
}

impl Answer {
    /// A chat's message, or a completion's text.
    pub fn text(&self) -> &str {
        let choice = &self.body["choices"][0];
        choice["message"]["content"].as_str().or(choice["text"].as_str()).unwrap_or_default()
    }
    pub fn cached_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("usage.cached_tokens")
    }
    pub fn prompt_tokens(&self) -> u64 {
        self.body["usage"]["prompt_tokens"].as_u64().expect("usage.prompt_tokens")
    }
}

pub(crate) fn chat_url(decoded: &Daemon) -> String {
    format!("http://{}/v1/chat/completions", decoded.front.expect("front door"))
}

pub(crate) async fn chat(decoded: &Daemon, messages: &Value, mode: &str) -> Answer {
    chat_at(&chat_url(decoded), messages, mode).await
}

/// [`chat`] by URL, for a task that does not hold the daemon.
pub(crate) async fn chat_at(url: &str, messages: &Value, mode: &str) -> Answer {
    chat_with(url, messages, &[("x-pd-bridge-mode", mode)]).await
}

/// [`chat_at`] with these request headers.
pub(crate) async fn chat_with(url: &str, messages: &Value, headers: &[(&str, &str)]) -> Answer {
    ask(url, json!({"messages": messages, "max_tokens": 8, "temperature": 0}), headers).await
}

/// A base model's plain `prompt` continued through the front door's `/v1/completions`.
pub(crate) async fn complete(decoded: &Daemon, prompt: &str, mode: &str) -> Answer {
    let url = format!("http://{}/v1/completions", decoded.front.expect("front door"));
    let body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
    ask(&url, body, &[("x-pd-bridge-mode", mode)]).await
}

async fn ask(url: &str, body: Value, headers: &[(&str, &str)]) -> Answer {
    let mut request = reqwest::Client::new().post(url).json(&body);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let response = request.send().await.expect("front door answers");
    let status = response.status().as_u16();
    let verdict = response
        .headers()
        .get("x-pd-bridge")
        .map(|v| serde_json::from_str(v.to_str().unwrap()).expect("verdict is JSON"))
        .unwrap_or(Value::Null);
    let body = response.json().await.unwrap_or(Value::Null);
    Answer { status, verdict, body }
}

pub(crate) fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// The prompt most tests bridge and hold to the decoder's native answer: one prompt of a few
/// blocks, so the test model's slow CPU prefill computes that answer once a run ([`native_text`]).
pub(crate) fn shared_prompt() -> Value {
    user(&format!("{}\n\nWhat is this text?", &license_text()[..1500]))
}

/// The decoder's native greedy answer to `messages` (plaintext gRPC: its spec is read with
/// `GetSpec`). Computed once per test run and decoder: kept under nextest's run id, keyed by the
/// decoder's spec without its block size (a native answer does not depend on it) and the prompt's
/// token ids; outside nextest, computed every time.
pub(crate) async fn native_text(decoded: &Daemon, messages: &Value) -> String {
    native_text_over(decoded.channel().await, decoded, messages).await
}

/// [`native_text`], reading the spec over `channel` (e.g. with a peer's certificate).
pub(crate) async fn native_text_over(channel: Channel, decoded: &Daemon, messages: &Value) -> String {
    let mut spec = CacheStoreClient::new(channel).get_spec(GetSpecRequest {}).await.expect("GetSpec").into_inner();
    spec.block_tokens = 0;
    let mut key = Sha256::new();
    key.update(spec::fingerprint(&spec));
    for token in decoded.tokenize_chat(messages).await {
        key.update(token.to_le_bytes());
    }
    let cached = std::env::var("NEXTEST_RUN_ID").ok().map(|run| {
        let dir = std::env::temp_dir().join(format!("pdb-native-answers-{run}"));
        std::fs::create_dir_all(&dir).expect("native answers dir");
        dir.join(format!("{:x}", key.finalize()))
    });
    if let Some(text) = cached.as_ref().and_then(|path| std::fs::read_to_string(path).ok()) {
        return text;
    }
    let native = chat(decoded, messages, "native").await;
    assert_eq!((native.status, &native.verdict["outcome"]), (200, &json!("native")), "{}", native.verdict);
    assert_eq!(native.cached_tokens(), 0, "a native answer restores nothing");
    if let Some(path) = cached {
        let partial = path.with_extension("partial");
        std::fs::write(&partial, native.text()).expect("write a native answer");
        std::fs::rename(&partial, &path).expect("keep a native answer");
    }
    native.text().to_owned()
}
