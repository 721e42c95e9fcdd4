//! The OpenAI request wire format: what the front door accepts, checked
//! before anything reaches the engine, so a client's mistake is a 400 that
//! names the field, never an engine error.
//!
//! Every API but the legacy completions answers through chat's objects (the Responses and Messages
//! APIs translate them), so `Api::Completions` is the one whose objects here are text ones.

use serde_json::{Map, Value, json};

use super::Api;
use crate::engine::{Sampling, ToolCall};

/// One choice of a whole (non-streamed) answer; a chat answer that only called tools has no content.
pub fn choice(api: Api, index: u32, text: &str, finish: &str, logprobs: Option<Value>, calls: &[ToolCall]) -> Value {
    let mut choice = match api {
        Api::Completions => json!({"index": index, "text": text, "finish_reason": finish}),
        _ if !calls.is_empty() => json!({
            "index": index,
            "message": {
                "role": "assistant",
                "content": Some(text).filter(|t| !t.is_empty()),
                "tool_calls": calls.iter().map(|c| tool_call(c, None)).collect::<Vec<_>>(),
            },
            "finish_reason": finish,
        }),
        _ => json!({"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish}),
    };
    if let Some(logprobs) = logprobs {
        choice["logprobs"] = logprobs;
    }
    choice
}

/// vLLM's extension of a choice: `stop_reason`, the stop sequence that ended the answer.
pub fn add_stop_reason(choice: &mut Value, stop_sequence: &str) {
    if !stop_sequence.is_empty() {
        choice["stop_reason"] = stop_sequence.into();
    }
}

/// A whole (non-streamed) answer, without `usage`.
pub fn completion(api: Api, id: &str, created: u64, model: &str, choices: Vec<Value>) -> Value {
    let object = match api {
        Api::Completions => "text_completion",
        _ => "chat.completion",
    };
    json!({"id": id, "object": object, "created": created, "model": model, "choices": choices})
}

/// One streamed chunk of choice `index`: a piece of text, or its end with its finish reason.
pub fn chunk(
    api: Api,
    (id, created, model): (&str, u64, &str),
    index: u32,
    text: Option<&str>,
    finish: Option<&str>,
) -> Value {
    match api {
        Api::Completions => json!({
            "id": id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text.unwrap_or(""), "finish_reason": finish}],
        }),
        _ => json!({
            "id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": text.map_or(json!({}), |t| json!({"content": t})), "finish_reason": finish}],
        }),
    }
}

/// The chunk that ends a stream asked for `stream_options.include_usage`: no choices, the usage.
pub fn usage_chunk(api: Api, names: (&str, u64, &str), usage: Value) -> Value {
    let mut last = chunk(api, names, 0, None, None);
    last["choices"] = json!([]);
    last["usage"] = usage;
    last
}

/// Adds tool calls to a streamed chat chunk's delta; `first` is the index of the first of them
/// among the choice's calls so far.
pub fn add_tool_calls(chunk: &mut Value, calls: &[ToolCall], first: usize) {
    let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| tool_call(c, Some(first + i))).collect();
    chunk["choices"][0]["delta"]["tool_calls"] = Value::Array(calls);
}

fn tool_call(call: &ToolCall, index: Option<usize>) -> Value {
    let mut out = json!({
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    });
    if let Some(index) = index {
        out["index"] = index.into();
    }
    out
}

/// The request's tools when the model may call them, checked: a list of functions, each with a
/// name. `tool_choice` may be "auto" (the default) or "none" (the tools are not offered); forcing
/// a call ("required", a named function) is refused, as mlx-lm cannot constrain generation to one.
pub fn tools(body: &Value) -> Result<Option<&Value>, InvalidRequest> {
    let Some(tools) = body.get("tools").filter(|t| !t.is_null()) else { return Ok(None) };
    let list = tools.as_array().ok_or_else(|| invalid("`tools` must be an array"))?;
    for (i, tool) in list.iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(format!("`tools[{i}].type` must be \"function\"")));
        }
        if tool.pointer("/function/name").and_then(Value::as_str).is_none_or(str::is_empty) {
            return Err(invalid(format!("`tools[{i}].function.name` must be a non-empty string")));
        }
    }
    match body.get("tool_choice").filter(|c| !c.is_null()) {
        None => Ok(Some(tools).filter(|_| !list.is_empty())),
        Some(Value::String(choice)) if choice == "auto" => Ok(Some(tools).filter(|_| !list.is_empty())),
        Some(Value::String(choice)) if choice == "none" => Ok(None),
        Some(_) => Err(invalid("`tool_choice` must be \"auto\" or \"none\": this server cannot force a tool call")),
    }
}

/// `choices[].logprobs` for these tokens' entries (`token`, `logprob`,
/// `bytes`, `top_logprobs`, as the adapter sends them): chat's `content`
/// list, or the legacy completions' parallel lists.
pub fn logprobs(api: Api, entries: &[Value]) -> Value {
    match api {
        Api::Completions => {
            let mut offset = 0;
            let mut text_offset = Vec::with_capacity(entries.len());
            for entry in entries {
                text_offset.push(offset);
                offset += entry["token"].as_str().map_or(0, str::len);
            }
            let top: Vec<Value> = entries
                .iter()
                .map(|e| {
                    let alternatives = e["top_logprobs"].as_array().into_iter().flatten();
                    Value::Object(
                        alternatives
                            .filter_map(|a| Some((a["token"].as_str()?.to_owned(), a["logprob"].clone())))
                            .collect(),
                    )
                })
                .collect();
            json!({
                "tokens": entries.iter().map(|e| e["token"].clone()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| e["logprob"].clone()).collect::<Vec<_>>(),
                "top_logprobs": top,
                "text_offset": text_offset,
            })
        }
        _ => json!({"content": entries}),
    }
}

pub fn usage(prompt_tokens: u32, completion_tokens: u32, cached_tokens: u32) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    })
}

/// A request the front door refuses; the message names the field.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

/// A prompt (and `max_tokens`) the model's context cannot hold: OpenAI's `context_length_exceeded`.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct ContextLengthExceeded(pub String);

fn invalid(message: impl Into<String>) -> InvalidRequest {
    InvalidRequest(message.into())
}

/// The refusal of field `key`, which `must be` `what`.
fn must_be(key: &str, what: &str) -> InvalidRequest {
    invalid(format!("`{key}` must be {what}"))
}

/// Roles the chat templates know.
const ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Checks a chat's `messages` and returns them in the form chat templates
/// take: list-form content (`[{"type": "text", "text": …}, …]`) becomes the
/// concatenation of its text parts, as mlx-lm's own server does.
pub fn chat_messages(body: &Value) -> Result<Value, InvalidRequest> {
    let messages =
        body.get("messages").and_then(Value::as_array).ok_or_else(|| invalid("`messages` must be an array"))?;
    if messages.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    messages.iter().enumerate().map(|(i, m)| message(i, m)).collect::<Result<Vec<_>, _>>().map(Value::Array)
}

fn message(i: usize, message: &Value) -> Result<Value, InvalidRequest> {
    let at = |what: &str| invalid(format!("`messages[{i}]`{what}"));
    let object = message.as_object().ok_or_else(|| at(" must be an object"))?;
    let role = object.get("role").and_then(Value::as_str).ok_or_else(|| at(".role must be a string"))?;
    if !ROLES.contains(&role) {
        return Err(at(&format!(".role must be one of {}, not {role:?}", ROLES.join(", "))));
    }
    let content = match object.get("content") {
        // An assistant turn that only called tools; templates take "", as in mlx-lm's server.
        None | Some(Value::Null) if role == "assistant" => Value::String(String::new()),
        Some(Value::String(text)) => Value::String(text.clone()),
        Some(Value::Array(parts)) => Value::String(text_parts(i, parts)?),
        _ => return Err(at(".content must be a string or a list of text parts")),
    };
    let mut normalized: Map<String, Value> = object.clone();
    normalized.insert("content".into(), content);
    Ok(Value::Object(normalized))
}

fn text_parts(i: usize, parts: &[Value]) -> Result<String, InvalidRequest> {
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let at = |what: &str| invalid(format!("`messages[{i}].content[{j}]`{what}"));
        match part.get("type").and_then(Value::as_str) {
            Some("text") => {
                text.push_str(part.get("text").and_then(Value::as_str).ok_or_else(|| at(".text must be a string"))?)
            }
            Some(other) => return Err(at(&format!(" is a {other:?} part; only text parts are supported"))),
            None => return Err(at(".type must be a string")),
        }
    }
    Ok(text)
}

/// What a request asks of its answers: how the adapter samples each (`engine.proto`'s
/// `Sampling`, declared once for both languages), how many there are, streamed or whole.
#[derive(Debug, PartialEq)]
pub struct Asked {
    /// As the client asked: `max_tokens` unset means as many as the context leaves, up to the
    /// configured default; `stop`, up to 4 sequences that end the answer, never part of it;
    /// `logprobs`, the alternatives per token (chat: `logprobs` + `top_logprobs`; completions:
    /// `logprobs`).
    pub sampling: Sampling,
    pub stream: bool,
    /// Answers to generate for the prompt (`n`), one after another from the same restored cache.
    pub n: u32,
    /// `stream_options.include_usage`: a last chunk with `choices: []` and the usage, as OpenAI
    /// streams it (no usage otherwise).
    pub include_usage: bool,
}

/// Parameters of OpenAI's legacy completions that the front door does not implement: refused by
/// name rather than ignored (the answer would not be what the caller asked for).
fn refuse_unimplemented(body: &Value, api: Api) -> Result<(), InvalidRequest> {
    if api != Api::Completions {
        return Ok(());
    }
    if body.get("echo").is_some_and(|v| v != &Value::Bool(false) && !v.is_null()) {
        return Err(invalid("`echo` is not supported: answers never repeat the prompt"));
    }
    if body.get("suffix").is_some_and(|v| v.as_str() != Some("") && !v.is_null()) {
        return Err(invalid("`suffix` is not supported: completions only continue the prompt"));
    }
    Ok(())
}

/// `stream_options` (only with `stream: true`, as OpenAI has it): whether to send the usage chunk.
fn include_usage(body: &Value, stream: bool) -> Result<bool, InvalidRequest> {
    let Some(options) = body.get("stream_options").filter(|v| !v.is_null()) else {
        return Ok(false);
    };
    if !stream {
        return Err(invalid("`stream_options` is only allowed with `stream: true`"));
    }
    let options = options.as_object().ok_or_else(|| invalid("`stream_options` must be an object"))?;
    match options.get("include_usage") {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(on)) => Ok(*on),
        Some(_) => Err(invalid("`stream_options.include_usage` must be a boolean")),
    }
}

/// Most answers (`n`) one request may ask for.
pub const MAX_CHOICES: u64 = 16;

/// Log probabilities asked for, as each API spells them: chat's `logprobs` + `top_logprobs`, the
/// legacy API's `logprobs` (the number of alternatives, up to 5).
fn logprobs_asked(body: &Value, api: Api) -> Result<Option<u32>, InvalidRequest> {
    let field = |key: &str| super::field(body, key);
    Ok(match api {
        // The legacy API: `logprobs` is the number of alternatives, up to 5.
        Api::Completions => field("logprobs")
            .map(|v| {
                v.as_u64()
                    .filter(|n| *n <= 5)
                    .map(|n| n as u32)
                    .ok_or_else(|| must_be("logprobs", "an integer from 0 to 5"))
            })
            .transpose()?,
        _ => {
            let on =
                field("logprobs").map(|v| v.as_bool().ok_or_else(|| must_be("logprobs", "a boolean"))).transpose()?;
            let top = field("top_logprobs")
                .map(|v| {
                    v.as_u64().filter(|n| *n <= 20).ok_or_else(|| must_be("top_logprobs", "an integer from 0 to 20"))
                })
                .transpose()?;
            match (on.unwrap_or(false), top) {
                (true, top) => Some(top.unwrap_or(0) as u32),
                (false, Some(_)) => return Err(invalid("`top_logprobs` needs `logprobs: true`")),
                (false, None) => None,
            }
        }
    })
}

/// What `body` asks of its answers, each field checked.
pub fn asked(body: &Value, api: Api) -> Result<Asked, InvalidRequest> {
    refuse_unimplemented(body, api)?;
    let field = |key: &str| super::field(body, key);
    let n = match field("n") {
        Some(v) => v
            .as_u64()
            .filter(|n| (1..=MAX_CHOICES).contains(n))
            .ok_or_else(|| must_be("n", &format!("an integer from 1 to {MAX_CHOICES}")))? as u32,
        None => 1,
    };
    let stream = field("stream")
        .map(|v| v.as_bool().ok_or_else(|| must_be("stream", "a boolean")))
        .transpose()?
        .unwrap_or(false);
    Ok(Asked { sampling: sampling(body, api)?, stream, n, include_usage: include_usage(body, stream)? })
}

/// How `body` asks its answers to be sampled.
fn sampling(body: &Value, api: Api) -> Result<Sampling, InvalidRequest> {
    let field = |key: &str| super::field(body, key);
    let penalty = |key: &str| match field(key) {
        Some(v) => v.as_f64().filter(|p| (-2.0..=2.0).contains(p)).ok_or_else(|| must_be(key, "between -2 and 2")),
        None => Ok(0.0),
    };
    let max_tokens = match field("max_completion_tokens")
        .map(|v| ("max_completion_tokens", v))
        .or(field("max_tokens").map(|v| ("max_tokens", v)))
    {
        Some((key, v)) => Some(
            v.as_u64()
                .filter(|n| *n > 0)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| must_be(key, "a positive integer below 2^32"))?,
        ),
        None => None,
    };
    let temperature = match field("temperature") {
        Some(v) => {
            v.as_f64().filter(|t| (0.0..=2.0).contains(t)).ok_or_else(|| must_be("temperature", "between 0 and 2"))?
        }
        None => 1.0,
    };
    let top_p = match field("top_p") {
        Some(v) => v.as_f64().filter(|p| *p > 0.0 && *p <= 1.0).ok_or_else(|| must_be("top_p", "in (0, 1]"))?,
        None => 1.0,
    };
    let seed =
        field("seed").map(|v| v.as_u64().ok_or_else(|| must_be("seed", "a non-negative integer"))).transpose()?;
    let stop_shape = || must_be("stop", "a non-empty string or a list of up to 4 of them");
    let stop = match field("stop") {
        None => Vec::new(),
        Some(Value::String(one)) if !one.is_empty() => vec![one.clone()],
        Some(Value::Array(many)) if many.len() <= 4 => many
            .iter()
            .map(|v| v.as_str().filter(|s| !s.is_empty()).map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(stop_shape)?,
        Some(_) => return Err(stop_shape()),
    };
    Ok(Sampling {
        max_tokens,
        temperature,
        top_p: Some(top_p),
        seed,
        stop,
        presence_penalty: penalty("presence_penalty")?,
        frequency_penalty: penalty("frequency_penalty")?,
        logprobs: logprobs_asked(body, api)?,
    })
}

/// The tokens to generate for a prompt of `prompt_tokens` in a context of
/// `max_context`: the request's own `max_tokens` if the context holds it (a
/// 400 otherwise, as OpenAI answers), else the default clipped to the room left.
pub fn generation_budget(
    requested: Option<u32>,
    default: u32,
    prompt_tokens: usize,
    max_context: u32,
) -> Result<u32, ContextLengthExceeded> {
    let room = (max_context as usize).saturating_sub(prompt_tokens);
    if room == 0 {
        return Err(ContextLengthExceeded(format!(
            "the prompt is {prompt_tokens} tokens; this model's context is {max_context} tokens"
        )));
    }
    match requested {
        Some(n) if n as usize > room => Err(ContextLengthExceeded(format!(
            "the prompt ({prompt_tokens} tokens) plus `max_tokens` ({n}) exceeds this model's context of {max_context} tokens"
        ))),
        Some(n) => Ok(n),
        None => Ok(default.min(room as u32)),
    }
}

#[cfg(test)]
mod tests;
