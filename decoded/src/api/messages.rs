//! Anthropic's Messages API (`/v1/messages`): a system prompt, text and tool-use turns, tool
//! results, `stop_sequences`, streamed as its events (`message_start`, content blocks and their
//! deltas, `message_delta` with the stop reason and usage, `message_stop`).

use serde::{Deserialize, de::IgnoredAny};
use serde_json::{Value, json};

use super::answer::{Event, Finish, Names, Render, SseEvent, Usage, Whole};
use super::chat::{self, Asked, Call, Content, FlatTool, Input, Message, Part, Request, Role, ToolChoice};
use super::{InvalidRequest, invalid, parse as parse_json};
use crate::engine::ToolCall;

/// A Messages request as sent, its fields in the API reference's order (unknown ones ignored).
#[derive(Deserialize)]
#[serde(expecting = "a request object")]
struct Sent {
    #[serde(default, deserialize_with = "chat::positive_u32")]
    max_tokens: Option<u32>,
    messages: Option<Vec<Turn>>,
    model: Option<String>,
    #[serde(default, deserialize_with = "chat::stop")]
    stop_sequences: Vec<String>,
    #[serde(default, deserialize_with = "chat::boolean")]
    stream: Option<bool>,
    system: Option<Content<Part>>,
    #[serde(default, deserialize_with = "chat::temperature")]
    temperature: Option<f64>,
    /// Refused unless disabled: the model has no reasoning mode.
    thinking: Option<Thinking>,
    tool_choice: Option<SentToolChoice>,
    tools: Option<Vec<FlatTool>>,
    /// Refused: sampling here has no top-k.
    top_k: Option<IgnoredAny>,
    #[serde(default, deserialize_with = "chat::top_p")]
    top_p: Option<f64>,
}

/// Who speaks a turn; the system prompt is `system`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Speaker {
    User,
    Assistant,
}

#[derive(Deserialize)]
#[serde(expecting = "a message object")]
struct Turn {
    role: Speaker,
    content: Content<Block>,
}

/// A content block: text, a tool use (assistant turns), a tool result (user turns), or another
/// kind this server refuses by name.
#[derive(Deserialize)]
#[serde(expecting = "a content block")]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    id: Option<String>,
    name: Option<String>,
    /// A tool use's arguments, an object of the tool's own schema.
    input: Option<Value>,
    tool_use_id: Option<String>,
    content: Option<Content<Part>>,
}

#[derive(Deserialize)]
struct SentToolChoice {
    #[serde(rename = "type")]
    kind: Option<String>,
}

#[derive(Deserialize)]
struct Thinking {
    #[serde(rename = "type")]
    kind: Option<String>,
}

/// The request a Messages request asks for.
pub fn parse(body: &[u8]) -> Result<Request, InvalidRequest> {
    let sent: Sent = parse_json(body)?;
    let max_tokens = sent.max_tokens.ok_or_else(|| invalid("`max_tokens` is required"))?;
    let sampling = chat::sampling(sent.temperature, sent.top_p, Some(max_tokens), sent.stop_sequences.clone());
    let asked = Asked::one(sampling, sent.stream);
    Ok(Request { model: sent.model.clone(), input: sent.chat()?, asked })
}

/// What `/v1/messages/count_tokens` counts: the request's chat, which asks for no answer (so no
/// `max_tokens`), and the model it names.
pub fn parse_count(body: &[u8]) -> Result<(Option<String>, Input), InvalidRequest> {
    let sent: Sent = parse_json(body)?;
    Ok((sent.model.clone(), sent.chat()?))
}

impl Sent {
    fn chat(self) -> Result<Input, InvalidRequest> {
        if self.top_k.is_some() {
            return Err(invalid("`top_k` is not supported: sample with `temperature` and `top_p`"));
        }
        if !matches!(self.thinking.and_then(|t| t.kind).as_deref(), None | Some("disabled")) {
            return Err(invalid("`thinking` is not supported by this model"));
        }
        let mut messages = Vec::new();
        if let Some(system) = self.system {
            messages.push(Message::new(Role::System, system.text("system", &["text"])?));
        }
        let turns = self.messages.ok_or_else(|| invalid("`messages` must be an array"))?;
        for (i, turn) in turns.into_iter().enumerate() {
            turn.append_to(i, &mut messages)?;
        }
        // Anthropic's client tools have no type or "custom"; its server tools another.
        let client = |kind: Option<&str>| matches!(kind, None | Some("custom"));
        let tools = self.tools.map(|tools| chat::function_tools(tools, client, "client tools")).transpose()?;
        // Anthropic's `auto` and `none`; `any` and a named tool force a call.
        let choice = self.tool_choice.map(|c| match c.kind.as_deref() {
            Some("auto") => ToolChoice::Auto,
            Some("none") => ToolChoice::None,
            _ => ToolChoice::Forced,
        });
        Ok(Input::Chat { messages, tools: chat::offered(tools, choice)? })
    }
}

impl Turn {
    /// Appended to the chat's messages: a user turn's tool results become tool messages (before
    /// its text), an assistant turn's tool uses its tool calls.
    fn append_to(self, i: usize, messages: &mut Vec<Message>) -> Result<(), InvalidRequest> {
        let role = match self.role {
            Speaker::User => Role::User,
            Speaker::Assistant => Role::Assistant,
        };
        let blocks = match self.content {
            Content::Text(text) => {
                messages.push(Message::new(role, text));
                return Ok(());
            }
            Content::Parts(blocks) => blocks,
        };
        let (mut text, mut calls) = (String::new(), Vec::new());
        for (j, block) in blocks.into_iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            let required = |value: Option<String>, key: &str| {
                value.ok_or_else(|| invalid(format!("`{at}.{key}` must be a string")))
            };
            match (self.role, block.kind.as_str()) {
                (_, "text") => text.push_str(&required(block.text, "text")?),
                (Speaker::Assistant, "tool_use") => {
                    let arguments = block.input.unwrap_or_else(|| json!({})).to_string();
                    calls.push(Call::new(required(block.id, "id")?, required(block.name, "name")?, arguments));
                }
                (Speaker::User, "tool_result") => {
                    let output = block.content.map_or(Ok(String::new()), |c| c.text(&at, &["text"]))?;
                    messages.push(Message::tool_output(required(block.tool_use_id, "tool_use_id")?, output));
                }
                (speaker, other) => {
                    let takes = match speaker {
                        Speaker::User => "user turns here take text and tool_result blocks",
                        Speaker::Assistant => "assistant turns here take text and tool_use blocks",
                    };
                    return Err(invalid(format!("`{at}` is a {other:?} block; {takes}")));
                }
            }
        }
        if !calls.is_empty() {
            messages.push(Message::calling(text, calls));
        } else if !text.is_empty() || role == Role::Assistant {
            messages.push(Message::new(role, text));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Answers.
// ---------------------------------------------------------------------------

/// Why the answer stopped, in Anthropic's words, and the stop sequence when one did.
fn stop_reason(finish: Option<Finish<'_>>) -> (Option<&'static str>, Option<&str>) {
    let Some(Finish { reason, stop_sequence }) = finish else { return (None, None) };
    let reason = match (reason, stop_sequence) {
        ("length", _) => "max_tokens",
        ("tool_calls", _) => "tool_use",
        (_, "") => "end_turn",
        _ => "stop_sequence",
    };
    (Some(reason), Some(stop_sequence).filter(|_| reason == "stop_sequence"))
}

/// A usage as Anthropic counts it: `input_tokens` are those computed, cached ones apart.
fn usage(usage: Usage) -> Value {
    json!({"input_tokens": usage.prompt - usage.cached.min(usage.prompt), "output_tokens": usage.completion,
           "cache_read_input_tokens": usage.cached, "cache_creation_input_tokens": 0})
}

fn tool_use(call: &ToolCall) -> Value {
    let input: Value = serde_json::from_str(&call.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": call.id, "name": call.name, "input": input})
}

/// The whole answer as a message.
pub fn whole(whole: &Whole) -> Value {
    let first = whole.first();
    let mut content = Vec::new();
    if let Some(text) = first.map(|c| c.text.as_str()).filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(first.into_iter().flat_map(|c| &c.tool_calls).map(tool_use));
    let (stop_reason, stop_sequence) = stop_reason(first.map(|c| c.finish()));
    json!({
        "id": whole.names.id_as("msg"), "type": "message", "role": "assistant", "model": whole.names.model,
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": usage(whole.usage),
    })
}

/// The content block being streamed: its index, and whether it is text.
struct OpenBlock {
    index: usize,
    text: bool,
}

/// A streamed answer as the Messages API's events.
pub struct Events {
    names: Names,
    started: bool,
    block: Option<OpenBlock>,
    blocks: usize,
    finish_reason: String,
    stop_sequence: String,
    usage: Usage,
}

fn event(name: &'static str, mut data: Value) -> SseEvent {
    data["type"] = name.into();
    SseEvent { name: Some(name), data: data.to_string() }
}

impl Events {
    pub fn new(names: Names) -> Events {
        let (finish_reason, stop_sequence) = (String::new(), String::new());
        Events { names, started: false, block: None, blocks: 0, finish_reason, stop_sequence, usage: Usage::default() }
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let message = json!({
            "id": self.names.id_as("msg"), "type": "message", "role": "assistant", "model": self.names.model,
            "content": [], "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        });
        out.push(event("message_start", json!({"message": message})));
    }

    fn open(&mut self, content_block: Value, out: &mut Vec<SseEvent>) -> usize {
        self.close(out);
        let index = self.blocks;
        self.blocks += 1;
        let text = content_block["type"] == "text";
        out.push(event("content_block_start", json!({"index": index, "content_block": content_block})));
        self.block = Some(OpenBlock { index, text });
        index
    }

    fn close(&mut self, out: &mut Vec<SseEvent>) {
        if let Some(OpenBlock { index, .. }) = self.block.take() {
            out.push(event("content_block_stop", json!({"index": index})));
        }
    }

    fn text(&mut self, text: &str, out: &mut Vec<SseEvent>) {
        let index = match &self.block {
            Some(OpenBlock { index, text: true }) => *index,
            _ => self.open(json!({"type": "text", "text": ""}), out),
        };
        out.push(event("content_block_delta", json!({"index": index, "delta": {"type": "text_delta", "text": text}})));
    }

    fn tool_use(&mut self, call: &ToolCall, out: &mut Vec<SseEvent>) {
        let mut block = tool_use(call);
        block["input"] = json!({});
        let index = self.open(block, out);
        let delta = json!({"type": "input_json_delta", "partial_json": call.arguments});
        out.push(event("content_block_delta", json!({"index": index, "delta": delta})));
        self.close(out);
    }

    fn end(&mut self, out: &mut Vec<SseEvent>) {
        self.close(out);
        let finish = Finish { reason: &self.finish_reason, stop_sequence: &self.stop_sequence };
        let (stop_reason, stop_sequence) = stop_reason(Some(finish).filter(|f| !f.reason.is_empty()));
        let delta = json!({"stop_reason": stop_reason, "stop_sequence": stop_sequence});
        out.push(event("message_delta", json!({"delta": delta, "usage": usage(self.usage)})));
        out.push(event("message_stop", json!({})));
    }
}

impl Render for Events {
    fn render(&mut self, e: Event<'_>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if let Event::Error(message) = e {
            out.push(event("error", json!({"error": {"type": "api_error", "message": message}})));
            return out;
        }
        self.start(&mut out);
        match e {
            Event::Usage(counted) => self.usage = counted,
            Event::End => self.end(&mut out),
            _ => {
                let said = e.said().expect("a token or an answer's end");
                if !said.text.is_empty() {
                    self.text(said.text, &mut out);
                }
                for call in said.tool_calls {
                    self.tool_use(call, &mut out);
                }
                if let Some(finish) = said.finish {
                    self.close(&mut out);
                    self.finish_reason = finish.reason.to_owned();
                    self.stop_sequence = finish.stop_sequence.to_owned();
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
