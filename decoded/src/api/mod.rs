//! The front door's APIs, each parsed and answered in its own wire format: OpenAI's chat and
//! legacy completions ([`openai`]), OpenAI's Responses API ([`responses`]) and Anthropic's Messages
//! API ([`messages`]), their errors ([`error`]) and API keys ([`auth`]). A Responses or Messages
//! request becomes a chat request (checked by [`openai`] like any other), and the chat answer —
//! whole, or its chunks as they stream — becomes the API's answer, so every API takes the same
//! engine path, verdict header and admission (`crate::front`, which decides how to serve).

pub mod auth;
pub mod error;
pub mod messages;
pub mod openai;
pub mod responses;

use std::borrow::Cow;

use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use error::FrontError;
use openai::InvalidRequest;

/// The API a request came in on: its path, the shape of its answers and of its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI's `/v1/chat/completions`.
    Chat,
    /// OpenAI's legacy `/v1/completions`: a prompt, answered as text choices.
    Completions,
    /// OpenAI's `/v1/responses`, a translation of a chat.
    Responses,
    /// Anthropic's `/v1/messages` (and its `count_tokens`), a translation of a chat.
    Messages,
}

impl Api {
    /// Where the API is served (a forwarded request goes to the same path on a peer).
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// The API whose shape a request to `path` is answered in: Anthropic's under `/v1/messages`,
    /// OpenAI's chat everywhere else (the front door's other routes speak OpenAI's errors).
    pub fn at(path: &str) -> Api {
        match path.starts_with(Api::Messages.path()) {
            true => Api::Messages,
            false => Api::Chat,
        }
    }

    /// The chat completions request that `body`, a request of this API, asks for: chat's is the
    /// body itself (as is the legacy API's, which is no chat and never asked).
    pub fn chat_request(self, body: &Value) -> Result<Cow<'_, Value>, InvalidRequest> {
        match self {
            Api::Chat | Api::Completions => Ok(Cow::Borrowed(body)),
            Api::Responses => responses::chat_request(body).map(Cow::Owned),
            Api::Messages => messages::chat_request(body).map(Cow::Owned),
        }
    }

    /// A whole chat completion (`chat.completion` with its usage, or `text_completion` for the
    /// legacy API) as this API answers it.
    pub fn whole(self, completion: Value) -> Value {
        match self {
            Api::Chat | Api::Completions => completion,
            Api::Responses => responses::whole(&completion),
            Api::Messages => messages::whole(&completion),
        }
    }

    /// The translator of a streamed answer; none for OpenAI's chat and completions, whose chunks
    /// go out as they are.
    pub fn stream(self) -> Option<Box<dyn Stream>> {
        match self {
            Api::Chat | Api::Completions => None,
            Api::Responses => Some(Box::new(responses::Events::default())),
            Api::Messages => Some(Box::new(messages::Events::default())),
        }
    }

    /// A handler's answer, its error told in this API's shape and status.
    pub fn respond(self, answer: Result<Response, FrontError>) -> Response {
        answer.unwrap_or_else(|e| match self {
            Api::Messages => e.into_anthropic_response(),
            Api::Chat | Api::Completions | Api::Responses => e.into_response(),
        })
    }
}

/// One server-sent event: its name (`event:`) and data.
#[derive(Debug, PartialEq)]
pub struct SseEvent {
    pub name: &'static str,
    pub data: Value,
}

/// A streamed chat answer told in another API: every `chat.completion.chunk` of one answer in
/// turn, the usage chunk (`choices: []`) last, then the end or an error.
pub trait Stream: Send + Sync {
    /// The events one chat chunk makes.
    fn chunk(&mut self, chunk: &Value) -> Vec<SseEvent>;
    /// The events that end a stream whose answer is whole.
    fn end(&mut self) -> Vec<SseEvent>;
    /// The event that ends a stream cut by an error.
    fn error(&mut self, message: &str) -> Vec<SseEvent>;
}

fn invalid(message: impl Into<String>) -> InvalidRequest {
    InvalidRequest(message.into())
}

/// A request's field, `null` as absent.
fn field<'a>(body: &'a Value, key: &str) -> Option<&'a Value> {
    body.get(key).filter(|v| !v.is_null())
}

/// The chat request of `messages` with the fields `copied` from `body` as they are; a stream
/// ends with the usage chunk, which the API's last event carries.
fn chat_with(body: &Value, messages: Vec<Value>, copied: &[&str]) -> Value {
    let mut chat = json!({"messages": messages});
    for key in copied {
        if let Some(value) = field(body, key) {
            chat[*key] = value.clone();
        }
    }
    if chat["stream"] == true {
        chat["stream_options"] = json!({"include_usage": true});
    }
    chat
}

/// `tools` as chat's function tools: each tool whose `type` `is_function` says is a client
/// function (its name, description and, under `schema`, its arguments' JSON schema); any other is
/// refused, `offered` naming what is supported.
fn chat_tools(
    tools: &Value,
    is_function: impl Fn(Option<&str>) -> bool,
    schema: &str,
    offered: &str,
) -> Result<Value, InvalidRequest> {
    let list = tools.as_array().ok_or_else(|| invalid("`tools` must be an array"))?;
    let function = |(i, tool): (usize, &Value)| {
        let kind = tool.get("type").and_then(Value::as_str);
        if !is_function(kind) {
            return Err(invalid(format!("`tools[{i}]` is a {kind:?} tool; only {offered} are supported")));
        }
        let mut function = json!({"name": tool.get("name").cloned().unwrap_or(Value::Null)});
        for (from, to) in [("description", "description"), (schema, "parameters")] {
            if let Some(value) = field(tool, from) {
                function[to] = value.clone();
            }
        }
        Ok(json!({"type": "function", "function": function}))
    };
    list.iter().enumerate().map(function).collect::<Result<Vec<_>, _>>().map(Value::Array)
}

/// One streamed chat answer, told by a dialect's translator: "Hel" and "lo", then a call of `f`
/// with `{"a":1}` that ends it, then its usage (10 prompt tokens, 8 of them cached, 4 generated).
#[cfg(test)]
fn told(stream: &mut dyn Stream) -> Vec<SseEvent> {
    let chunk = |delta: Value, finish: Option<&str>| {
        json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let call = json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}, "index": 0});
    let usage = json!({"prompt_tokens": 10, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 8}});
    let mut events = Vec::new();
    for c in [
        chunk(json!({"content": "Hel"}), None),
        chunk(json!({"content": "lo"}), None),
        chunk(json!({"tool_calls": [call]}), None),
        chunk(json!({}), Some("tool_calls")),
        json!({"id": "chatcmpl-1", "created": 7, "model": "m", "choices": [], "usage": usage}),
    ] {
        events.extend(stream.chunk(&c));
    }
    events.extend(stream.end());
    events
}

/// What a chat answer's chunk or message says, read once for every dialect.
struct Said<'a> {
    text: &'a str,
    tool_calls: &'a [Value],
    finish_reason: Option<&'a str>,
    /// The stop sequence that ended the answer (vLLM's `stop_reason`).
    stop_sequence: Option<&'a str>,
}

impl<'a> Said<'a> {
    /// Choice 0 of a chunk (`delta`) or of a whole completion (`message`).
    fn of(choice: &'a Value) -> Said<'a> {
        let said = choice.get("delta").or_else(|| choice.get("message")).unwrap_or(&Value::Null);
        Said {
            text: said.get("content").and_then(Value::as_str).unwrap_or(""),
            tool_calls: said.get("tool_calls").and_then(Value::as_array).map_or(&[], Vec::as_slice),
            finish_reason: choice.get("finish_reason").and_then(Value::as_str),
            stop_sequence: choice.get("stop_reason").and_then(Value::as_str),
        }
    }
}

/// A tool call of a chat answer: its id, function name and arguments (JSON text).
fn call_parts(call: &Value) -> (&str, &str, &str) {
    let field = |pointer: &str| call.pointer(pointer).and_then(Value::as_str).unwrap_or("");
    (field("/id"), field("/function/name"), field("/function/arguments"))
}

/// A chat answer's usage: prompt, completion and cached tokens.
fn usage_parts(usage: &Value) -> (u64, u64, u64) {
    let count = |pointer: &str| usage.pointer(pointer).and_then(Value::as_u64).unwrap_or(0);
    (count("/prompt_tokens"), count("/completion_tokens"), count("/prompt_tokens_details/cached_tokens"))
}

/// The text of a message's content: a string, or the concatenated `text` of its parts of the
/// given types (any other part is refused by name).
fn content_text(content: &Value, at: &str, text_types: &[&str]) -> Result<String, InvalidRequest> {
    let invalid = |part: String, what: &str| InvalidRequest(format!("`{at}{part}`{what}"));
    match content {
        Value::String(text) => Ok(text.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (i, part) in parts.iter().enumerate() {
                match part.get("type").and_then(Value::as_str) {
                    Some(kind) if text_types.contains(&kind) => text.push_str(
                        part.get("text")
                            .and_then(Value::as_str)
                            .ok_or_else(|| invalid(format!("[{i}].text"), " must be a string"))?,
                    ),
                    Some(other) => {
                        let what = format!(" is a {other:?} part; only text parts are supported");
                        return Err(invalid(format!("[{i}]"), &what));
                    }
                    None => return Err(invalid(format!("[{i}].type"), " must be a string")),
                }
            }
            Ok(text)
        }
        _ => Err(invalid(String::new(), " must be a string or a list of text parts")),
    }
}
