//! The other chat APIs coding tools speak, served as translations of OpenAI's chat completions:
//! OpenAI's Responses API (`/v1/responses`, [`responses`]) and Anthropic's Messages API
//! (`/v1/messages`, [`messages`]). A request becomes a chat request (checked by `crate::openai`
//! like any other), the chat answer — whole, or its chunks as they stream — becomes the API's
//! answer, so every API takes the same engine path, verdict header and admission.

pub mod messages;
pub mod responses;

use serde_json::{Value, json};

use crate::openai::InvalidRequest;

/// The API a chat request came in on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `/v1/chat/completions` (and `/v1/completions`): answered as they are.
    Chat,
    /// `/v1/responses`
    Responses,
    /// `/v1/messages`
    Messages,
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

impl Dialect {
    /// A whole chat completion (`chat.completion` with its usage) as this API answers it.
    pub fn whole(self, completion: Value) -> Value {
        match self {
            Dialect::Chat => completion,
            Dialect::Responses => responses::whole(&completion),
            Dialect::Messages => messages::whole(&completion),
        }
    }

    /// The translator of a streamed answer; none for the chat API, whose chunks go out as they are.
    pub fn stream(self) -> Option<Box<dyn Stream>> {
        match self {
            Dialect::Chat => None,
            Dialect::Responses => Some(Box::new(responses::Events::default())),
            Dialect::Messages => Some(Box::new(messages::Events::default())),
        }
    }
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
