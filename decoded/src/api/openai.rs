//! OpenAI's chat completions and legacy completions: a request parsed once into the one typed
//! request, every field checked before anything reaches the engine (a client's mistake is a 400
//! that names the field, never an engine error), and answers rendered as OpenAI's objects and
//! chunks. Unknown fields are ignored, as vLLM's server ignores them.

use serde::{Deserialize, Deserializer};
use serde_json::{Value, json};

use super::answer::{Choice, Event, Names, Render, SseEvent, Usage, Whole};
use super::chat::{self, Asked, Call, Content, Input, Message, Part, Request, Role, Tool, ToolChoice};
use super::{Api, InvalidRequest, invalid};
use crate::engine::{Logprob, ToolCall};

/// Most answers (`n`) one request may ask for.
pub const MAX_CHOICES: u64 = 16;

/// A chat completions or legacy completions request as sent.
#[derive(Deserialize)]
#[serde(expecting = "a request object")]
struct Sent {
    model: Option<String>,
    messages: Option<Vec<SentMessage>>,
    prompt: Option<String>,
    #[serde(default, deserialize_with = "choices")]
    n: Option<u32>,
    #[serde(default, deserialize_with = "chat::boolean")]
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    #[serde(default, deserialize_with = "chat::positive_u32")]
    max_tokens: Option<u32>,
    #[serde(default, deserialize_with = "chat::positive_u32")]
    max_completion_tokens: Option<u32>,
    #[serde(default, deserialize_with = "chat::temperature")]
    temperature: Option<f64>,
    #[serde(default, deserialize_with = "chat::top_p")]
    top_p: Option<f64>,
    #[serde(default, deserialize_with = "seed")]
    seed: Option<u64>,
    #[serde(default, deserialize_with = "chat::stop")]
    stop: Vec<String>,
    #[serde(default, deserialize_with = "penalty")]
    presence_penalty: Option<f64>,
    #[serde(default, deserialize_with = "penalty")]
    frequency_penalty: Option<f64>,
    #[serde(default, deserialize_with = "logprobs_field")]
    logprobs: Option<Logprobs>,
    #[serde(default, deserialize_with = "top_logprobs")]
    top_logprobs: Option<u32>,
    tools: Option<Vec<Tool>>,
    tool_choice: Option<SentToolChoice>,
    // The legacy API's, refused unless at their defaults.
    echo: Option<bool>,
    suffix: Option<String>,
}

#[derive(Deserialize)]
#[serde(expecting = "a message object")]
struct SentMessage {
    role: Role,
    content: Option<Content<Part>>,
    name: Option<String>,
    tool_calls: Option<Vec<Call>>,
    tool_call_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(expecting = "an object")]
struct StreamOptions {
    #[serde(default, deserialize_with = "chat::boolean")]
    include_usage: Option<bool>,
}

/// `logprobs` as each API spells it: chat's switch, the legacy API's number of alternatives.
#[derive(Clone, Copy, Deserialize)]
#[serde(untagged)]
enum Logprobs {
    On(bool),
    Alternatives(u64),
}

/// `tool_choice`: "auto", "none", or a call forced ("required", a named function).
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum SentToolChoice {
    Mode(String),
    Named(serde::de::IgnoredAny),
}

impl From<SentToolChoice> for ToolChoice {
    fn from(choice: SentToolChoice) -> ToolChoice {
        match choice {
            SentToolChoice::Mode(mode) if mode == "auto" => ToolChoice::Auto,
            SentToolChoice::Mode(mode) if mode == "none" => ToolChoice::None,
            _ => ToolChoice::Forced,
        }
    }
}

fn choices<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let what = format!("an integer from 1 to {MAX_CHOICES}");
    Ok(chat::checked(d, |n: &u64| (1..=MAX_CHOICES).contains(n), &what)?.map(|n| n as u32))
}

fn seed<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    chat::checked(d, |_: &u64| true, "a non-negative integer")
}

fn penalty<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    chat::checked(d, |p: &f64| (-2.0..=2.0).contains(p), "between -2 and 2")
}

fn logprobs_field<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Logprobs>, D::Error> {
    chat::checked(d, |_: &Logprobs| true, "a boolean (chat) or an integer from 0 to 5 (completions)")
}

fn top_logprobs<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    Ok(chat::checked(d, |n: &u64| *n <= 20, "an integer from 0 to 20")?.map(|n| n as u32))
}

/// The request `body` of `api` (chat or the legacy completions) asks for.
pub fn parse(api: Api, body: &[u8]) -> Result<Request, InvalidRequest> {
    let mut sent: Sent = super::parse(body)?;
    let input = match api {
        Api::Completions => {
            refuse_unimplemented(&sent)?;
            Input::Text(sent.prompt.take().ok_or_else(|| invalid("`prompt` must be a string"))?)
        }
        _ => sent.chat()?,
    };
    let model = sent.model.take();
    Ok(Request { model, input, asked: sent.asked(api)? })
}

/// What the decoder's tokenizer reads for a pre-warm client: `messages` (with its `tools`) or
/// `prompt`, as chat and the legacy API send them.
pub fn tokenize_input(body: &[u8]) -> Result<Input, InvalidRequest> {
    let mut sent: Sent = super::parse(body)?;
    match (&sent.messages, sent.prompt.take()) {
        (Some(_), None) => sent.chat(),
        (None, Some(prompt)) => Ok(Input::Text(prompt)),
        _ => Err(invalid("give either `messages` (an array) or `prompt` (a string)")),
    }
}

/// Parameters of OpenAI's legacy completions that the front door does not implement: refused by
/// name rather than ignored (the answer would not be what the caller asked for).
fn refuse_unimplemented(sent: &Sent) -> Result<(), InvalidRequest> {
    if sent.echo == Some(true) {
        return Err(invalid("`echo` is not supported: answers never repeat the prompt"));
    }
    if sent.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(invalid("`suffix` is not supported: completions only continue the prompt"));
    }
    Ok(())
}

impl Sent {
    /// The chat: its messages in the form chat templates take (list-form content becomes the
    /// concatenation of its text parts, as mlx-lm's own server does), the tools offered.
    fn chat(&mut self) -> Result<Input, InvalidRequest> {
        let sent = self.messages.take().ok_or_else(|| invalid("`messages` must be an array"))?;
        if sent.is_empty() {
            return Err(invalid("`messages` must not be empty"));
        }
        let messages = sent.into_iter().enumerate().map(|(i, m)| m.into_message(i)).collect::<Result<_, _>>()?;
        let tools = chat::offered(self.tools.take(), self.tool_choice.take().map(ToolChoice::from))?;
        Ok(Input::Chat { messages, tools })
    }

    /// What the request asks of its answers.
    fn asked(self, api: Api) -> Result<Asked, InvalidRequest> {
        let stream = self.stream.unwrap_or(false);
        let include_usage = match &self.stream_options {
            Some(_) if !stream => return Err(invalid("`stream_options` is only allowed with `stream: true`")),
            Some(options) => options.include_usage.unwrap_or(false),
            None => false,
        };
        let logprobs = self.logprobs_asked(api)?;
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        let mut sampling = chat::sampling(self.temperature, self.top_p, max_tokens, self.stop);
        sampling.seed = self.seed;
        sampling.presence_penalty = self.presence_penalty.unwrap_or(0.0);
        sampling.frequency_penalty = self.frequency_penalty.unwrap_or(0.0);
        sampling.logprobs = logprobs;
        Ok(Asked { sampling, stream, n: self.n.unwrap_or(1), include_usage })
    }

    /// Log probabilities asked for, as each API spells them: chat's `logprobs` + `top_logprobs`,
    /// the legacy API's `logprobs` (the number of alternatives, up to 5).
    fn logprobs_asked(&self, api: Api) -> Result<Option<u32>, InvalidRequest> {
        match (api, self.logprobs) {
            (Api::Completions, None) => Ok(None),
            (Api::Completions, Some(Logprobs::Alternatives(n))) if n <= 5 => Ok(Some(n as u32)),
            (Api::Completions, Some(_)) => Err(invalid("`logprobs` must be an integer from 0 to 5")),
            (_, Some(Logprobs::Alternatives(_))) => Err(invalid("`logprobs` must be a boolean")),
            (_, on) => match (matches!(on, Some(Logprobs::On(true))), self.top_logprobs) {
                (true, top) => Ok(Some(top.unwrap_or(0))),
                (false, Some(_)) => Err(invalid("`top_logprobs` needs `logprobs: true`")),
                (false, None) => Ok(None),
            },
        }
    }
}

impl SentMessage {
    fn into_message(self, i: usize) -> Result<Message, InvalidRequest> {
        let content = match self.content {
            // An assistant turn that only called tools; templates take "", as in mlx-lm's server.
            None if self.role == Role::Assistant => String::new(),
            None => return Err(invalid(format!("`messages[{i}].content` must be a string or a list of text parts"))),
            Some(content) => content.text(&format!("messages[{i}].content"), &["text"])?,
        };
        let SentMessage { role, name, tool_calls, tool_call_id, .. } = self;
        Ok(Message { role, content, name, tool_calls, tool_call_id })
    }
}

// ---------------------------------------------------------------------------
// Answers. Every API but the legacy completions answers in chat's objects, so `Api::Completions`
// is the one whose objects here are text ones.
// ---------------------------------------------------------------------------

/// The whole answers: `chat.completion` (or `text_completion`) with the usage.
pub fn whole(api: Api, whole: &Whole) -> Value {
    let Names { id, created, model } = &whole.names;
    let object = if api == Api::Completions { "text_completion" } else { "chat.completion" };
    let choices: Vec<Value> = whole.choices.iter().map(|c| choice(api, c)).collect();
    json!({"id": id, "object": object, "created": created, "model": model, "choices": choices,
           "usage": usage(whole.usage)})
}

/// One choice of a whole answer; a chat answer that only called tools has no content.
fn choice(api: Api, c: &Choice) -> Value {
    let mut choice = match api {
        Api::Completions => json!({"index": c.index, "text": c.text, "finish_reason": c.finish_reason}),
        _ if !c.tool_calls.is_empty() => json!({
            "index": c.index,
            "message": {
                "role": "assistant",
                "content": Some(&c.text).filter(|t| !t.is_empty()),
                "tool_calls": c.tool_calls.iter().map(|c| tool_call(c, None)).collect::<Vec<_>>(),
            },
            "finish_reason": c.finish_reason,
        }),
        _ => {
            json!({"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason})
        }
    };
    if let Some(entries) = &c.logprobs {
        choice["logprobs"] = logprobs(api, entries);
    }
    add_stop_reason(&mut choice, &c.stop_sequence);
    choice
}

/// vLLM's extension of a choice: `stop_reason`, the stop sequence that ended the answer.
fn add_stop_reason(choice: &mut Value, stop_sequence: &str) {
    if !stop_sequence.is_empty() {
        choice["stop_reason"] = stop_sequence.into();
    }
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

/// OpenAI's entry for a token: every key present, `top_logprobs` a list even when empty.
fn entry(l: &Logprob) -> Value {
    let alternative = |a: &Logprob| json!({"token": a.token, "logprob": a.logprob, "bytes": a.bytes});
    let top: Vec<Value> = l.top_logprobs.iter().map(alternative).collect();
    json!({"token": l.token, "logprob": l.logprob, "bytes": l.bytes, "top_logprobs": top})
}

/// `choices[].logprobs` for these tokens: chat's `content` list, or the legacy completions'
/// parallel lists.
fn logprobs(api: Api, entries: &[Logprob]) -> Value {
    if api != Api::Completions {
        return json!({"content": entries.iter().map(entry).collect::<Vec<_>>()});
    }
    let mut offset = 0;
    let mut text_offset = Vec::with_capacity(entries.len());
    for entry in entries {
        text_offset.push(offset);
        offset += entry.token.len();
    }
    let top: Vec<Value> = entries
        .iter()
        .map(|e| Value::Object(e.top_logprobs.iter().map(|a| (a.token.clone(), json!(a.logprob))).collect()))
        .collect();
    json!({
        "tokens": entries.iter().map(|e| &e.token).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": text_offset,
    })
}

fn usage(usage: Usage) -> Value {
    json!({
        "prompt_tokens": usage.prompt,
        "completion_tokens": usage.completion,
        "total_tokens": usage.prompt + usage.completion,
        "prompt_tokens_details": {"cached_tokens": usage.cached},
    })
}

/// A streamed answer as OpenAI's chunks: a chunk per token, one that ends each answer, the usage
/// chunk when asked for (`stream_options.include_usage`), then `[DONE]`.
pub struct Chunks {
    api: Api,
    names: Names,
    include_usage: bool,
    /// The current answer's tool calls so far: a delta's calls are numbered within its choice.
    calls_sent: usize,
}

impl Chunks {
    pub fn new(api: Api, names: Names, include_usage: bool) -> Chunks {
        Chunks { api, names, include_usage, calls_sent: 0 }
    }

    /// A chunk of choice `index`: a piece of text, or its end with its finish reason.
    fn chunk(&self, index: u32, text: Option<&str>, finish: Option<&str>) -> Value {
        let Names { id, created, model } = &self.names;
        match self.api {
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

    /// Adds tool calls to a chunk's delta, numbered after the choice's calls so far.
    fn add_tool_calls(&mut self, chunk: &mut Value, calls: &[ToolCall]) {
        let first = self.calls_sent;
        let calls: Vec<Value> = calls.iter().enumerate().map(|(i, c)| tool_call(c, Some(first + i))).collect();
        self.calls_sent += calls.len();
        chunk["choices"][0]["delta"]["tool_calls"] = Value::Array(calls);
    }
}

impl Render for Chunks {
    fn render(&mut self, event: Event<'_>) -> Vec<SseEvent> {
        let chunk = match event {
            Event::Token { index, text, logprob, tool_calls } => {
                let text = Some(text).filter(|t| !t.is_empty() || tool_calls.is_empty());
                let mut chunk = self.chunk(index, text, None);
                if !tool_calls.is_empty() {
                    self.add_tool_calls(&mut chunk, tool_calls);
                }
                if let Some(entry) = logprob {
                    chunk["choices"][0]["logprobs"] = logprobs(self.api, std::slice::from_ref(entry));
                }
                chunk
            }
            Event::Done { index, text, tool_calls, finish, engine_timings_ms } => {
                // Text the adapter held back to the end (a partial character, a possible stop
                // sequence that never completed) ends the answer.
                let mut chunk = self.chunk(index, Some(text).filter(|t| !t.is_empty()), Some(finish.reason));
                add_stop_reason(&mut chunk["choices"][0], finish.stop_sequence);
                if !tool_calls.is_empty() {
                    self.add_tool_calls(&mut chunk, tool_calls);
                }
                self.calls_sent = 0;
                if let Some(timings) = engine_timings_ms {
                    // The verdict header left before the engine ran: its stages ride here.
                    chunk["pd_bridge"] = json!({"engine_timings_ms": timings});
                }
                chunk
            }
            Event::Usage(counted) if self.include_usage => {
                let mut last = self.chunk(0, None, None);
                last["choices"] = json!([]);
                last["usage"] = usage(counted);
                last
            }
            Event::Usage(_) => return Vec::new(),
            Event::End => return vec![SseEvent { name: None, data: "[DONE]".into() }],
            Event::Error(message) => json!({"error": {"message": message, "type": "engine_error"}}),
        };
        vec![SseEvent { name: None, data: chunk.to_string() }]
    }
}

/// A prompt (and `max_tokens`) the model's context cannot hold: OpenAI's `context_length_exceeded`.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct ContextLengthExceeded(pub String);

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
