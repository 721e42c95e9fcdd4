//! OpenAI's Responses API (`/v1/responses`): text in and out, `instructions`, function tools and
//! their calls, streamed as its typed events. Stateless: a response is never stored, so
//! `previous_response_id` is refused and the conversation travels whole in `input`.

use serde::{Deserialize, de::IgnoredAny};
use serde_json::{Value, json};

use super::answer::{Event, Names, Render, SseEvent, Usage, Whole};
use super::chat::{self, Asked, Call, Content, FlatTool, Input, Message, Part, Request, Role};
use super::{InvalidRequest, invalid, parse as parse_json};
use crate::engine::ToolCall;

/// A Responses request as sent, its fields in the API reference's order (unknown ones ignored).
/// Refused: what a stateless text server cannot do (`background`, `previous_response_id`,
/// `reasoning`, a `text.format` other than text).
#[derive(Deserialize)]
#[serde(expecting = "a request object")]
struct Sent {
    background: Option<bool>,
    input: Option<Content<Item>>,
    instructions: Option<String>,
    #[serde(default, deserialize_with = "chat::positive_u32")]
    max_output_tokens: Option<u32>,
    model: Option<String>,
    previous_response_id: Option<IgnoredAny>,
    reasoning: Option<IgnoredAny>,
    #[serde(default, deserialize_with = "chat::boolean")]
    stream: Option<bool>,
    #[serde(default, deserialize_with = "chat::temperature")]
    temperature: Option<f64>,
    text: Option<TextOptions>,
    tool_choice: Option<super::openai::SentToolChoice>,
    tools: Option<Vec<FlatTool>>,
    #[serde(default, deserialize_with = "chat::top_p")]
    top_p: Option<f64>,
}

/// An item of `input`: a message, a function call the model made, or a call's output.
#[derive(Deserialize)]
#[serde(expecting = "an input item")]
struct Item {
    #[serde(rename = "type")]
    kind: Option<String>,
    role: Option<Role>,
    content: Option<Content<Part>>,
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<String>,
    output: Option<String>,
}

#[derive(Deserialize)]
struct TextOptions {
    format: Option<Format>,
}

#[derive(Deserialize)]
struct Format {
    #[serde(rename = "type")]
    kind: String,
}

/// The request a Responses request asks for.
pub fn parse(body: &[u8]) -> Result<Request, InvalidRequest> {
    let sent: Sent = parse_json(body)?;
    refuse_unimplemented(&sent)?;
    let mut messages = Vec::new();
    if let Some(instructions) = sent.instructions {
        messages.push(Message::new(Role::System, instructions));
    }
    match sent.input {
        Some(Content::Text(text)) => messages.push(Message::new(Role::User, text)),
        Some(Content::Parts(items)) => {
            for (i, item) in items.into_iter().enumerate() {
                item.append_to(i, &mut messages)?;
            }
        }
        None => return Err(invalid("`input` must be a string or a list of input items")),
    }
    let function = |kind: Option<&str>| kind == Some("function");
    let tools = sent.tools.map(|tools| chat::function_tools(tools, function, "function tools")).transpose()?;
    let tools = chat::offered(tools, sent.tool_choice.map(Into::into))?;
    let sampling = chat::sampling(sent.temperature, sent.top_p, sent.max_output_tokens, Vec::new());
    Ok(Request { model: sent.model, input: Input::Chat { messages, tools }, asked: Asked::one(sampling, sent.stream) })
}

/// What the front door cannot do as asked is refused by name, never ignored.
fn refuse_unimplemented(sent: &Sent) -> Result<(), InvalidRequest> {
    if sent.previous_response_id.is_some() {
        return Err(invalid(
            "`previous_response_id` is not supported: this server keeps no responses; send the whole conversation in `input`",
        ));
    }
    if sent.background == Some(true) {
        return Err(invalid("`background` is not supported: answers are given while the request waits"));
    }
    if sent.reasoning.is_some() {
        return Err(invalid("`reasoning` is not supported by this model"));
    }
    match sent.text.as_ref().and_then(|t| t.format.as_ref()).map(|f| f.kind.as_str()) {
        None | Some("text") => Ok(()),
        Some(other) => Err(invalid(format!("`text.format` {other:?} is not supported: answers are plain text"))),
    }
}

impl Item {
    /// Appended to the chat's messages: a message, a function call (joined to the assistant turn
    /// before it), or a call's output.
    fn append_to(self, i: usize, messages: &mut Vec<Message>) -> Result<(), InvalidRequest> {
        let at = format!("input[{i}]");
        let required =
            |value: Option<String>, key: &str| value.ok_or_else(|| invalid(format!("`{at}.{key}` must be a string")));
        match self.kind.as_deref() {
            None | Some("message") => {
                let role = self.role.ok_or_else(|| invalid(format!("`{at}.role` must be a role")))?;
                let content = self
                    .content
                    .ok_or_else(|| invalid(format!("`{at}.content` must be a string or a list of text parts")))?;
                let text = content.text(&format!("{at}.content"), &["input_text", "output_text", "text"])?;
                messages.push(Message::new(role, text));
            }
            Some("function_call") => {
                let call = Call::new(
                    required(self.call_id, "call_id")?,
                    required(self.name, "name")?,
                    required(self.arguments, "arguments")?,
                );
                match messages.last_mut() {
                    Some(Message { role: Role::Assistant, tool_calls: Some(calls), .. }) => calls.push(call),
                    _ => messages.push(Message::calling("", vec![call])),
                }
            }
            Some("function_call_output") => messages
                .push(Message::tool_output(required(self.call_id, "call_id")?, required(self.output, "output")?)),
            Some(other) => {
                return Err(invalid(format!(
                    "`{at}` is a {other:?} item; this server takes messages, function calls and their outputs"
                )));
            }
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Answers.
// ---------------------------------------------------------------------------

/// The whole answer as a response.
pub fn whole(whole: &Whole) -> Value {
    let mut output = Vec::new();
    let first = whole.first();
    if let Some(text) = first.map(|c| c.text.as_str()).filter(|t| !t.is_empty()) {
        output.push(message_item(&new_id("msg"), text, "completed"));
    }
    output.extend(first.into_iter().flat_map(|c| &c.tool_calls).map(|call| function_call_item(call, "completed")));
    let status = status(first.map(|c| c.finish_reason.as_str()));
    response(&whole.names, status, output, Some(whole.usage))
}

fn new_id(prefix: &str) -> String {
    pdbridge_common::request_id::new(prefix)
}

/// A finished answer's status: `incomplete` when it ran out of `max_output_tokens`.
fn status(finish_reason: Option<&str>) -> &'static str {
    if finish_reason == Some("length") { "incomplete" } else { "completed" }
}

fn message_item(id: &str, text: &str, status: &str) -> Value {
    json!({
        "type": "message", "id": id, "status": status, "role": "assistant",
        "content": if status == "in_progress" { json!([]) } else { json!([output_text(text)]) },
    })
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

fn function_call_item(call: &ToolCall, status: &str) -> Value {
    let arguments = if status == "in_progress" { "" } else { &call.arguments };
    json!({"type": "function_call", "id": format!("fc-{}", call.id), "call_id": call.id, "name": call.name,
           "arguments": arguments, "status": status})
}

fn response(names: &Names, status: &str, output: Vec<Value>, usage: Option<Usage>) -> Value {
    json!({
        "id": names.id_as("resp"), "object": "response", "created_at": names.created, "model": names.model,
        "status": status,
        "incomplete_details": (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
        "error": null, "instructions": null, "metadata": {}, "output": output,
        "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
        "text": {"format": {"type": "text"}},
        "usage": usage.map(|u| json!({
            "input_tokens": u.prompt, "input_tokens_details": {"cached_tokens": u.cached},
            "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt + u.completion,
        })),
    })
}

/// A message item being streamed: its id, place among the outputs, and text so far.
struct OpenMessage {
    id: String,
    index: usize,
    text: String,
}

/// A streamed answer as the Responses API's events: `response.created`, each output item added,
/// its text or arguments in deltas and done, then `response.completed` (or `.incomplete`) with
/// the whole response and its usage.
pub struct Events {
    names: Names,
    started: bool,
    sequence: u64,
    message: Option<OpenMessage>,
    /// The finished output items.
    output: Vec<Value>,
    finish_reason: Option<String>,
    usage: Option<Usage>,
}

impl Events {
    pub fn new(names: Names) -> Events {
        Events {
            names,
            started: false,
            sequence: 0,
            message: None,
            output: Vec::new(),
            finish_reason: None,
            usage: None,
        }
    }

    fn event(&mut self, name: &'static str, mut data: Value) -> SseEvent {
        data["type"] = name.into();
        data["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        SseEvent { name: Some(name), data: data.to_string() }
    }

    fn start(&mut self, out: &mut Vec<SseEvent>) {
        if std::mem::replace(&mut self.started, true) {
            return;
        }
        let created = json!({"response": response(&self.names, "in_progress", Vec::new(), None)});
        out.push(self.event("response.created", created.clone()));
        out.push(self.event("response.in_progress", created));
    }

    fn text(&mut self, text: &str, out: &mut Vec<SseEvent>) {
        if self.message.is_none() {
            let message = OpenMessage { id: new_id("msg"), index: self.output.len(), text: String::new() };
            let item = message_item(&message.id, "", "in_progress");
            out.push(self.event("response.output_item.added", json!({"output_index": message.index, "item": item})));
            let part = json!({"item_id": message.id, "output_index": message.index, "content_index": 0,
                              "part": output_text("")});
            out.push(self.event("response.content_part.added", part));
            self.message = Some(message);
        }
        let message = self.message.as_mut().expect("opened");
        message.text.push_str(text);
        let delta = json!({"item_id": message.id, "output_index": message.index, "content_index": 0, "delta": text});
        out.push(self.event("response.output_text.delta", delta));
    }

    fn close_message(&mut self, out: &mut Vec<SseEvent>) {
        let Some(OpenMessage { id, index, text }) = self.message.take() else { return };
        let at = json!({"item_id": id, "output_index": index, "content_index": 0});
        let mut done = at.clone();
        done["text"] = text.as_str().into();
        out.push(self.event("response.output_text.done", done));
        let mut part = at;
        part["part"] = output_text(&text);
        out.push(self.event("response.content_part.done", part));
        let item = message_item(&id, &text, "completed");
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.output.push(item);
    }

    fn function_call(&mut self, call: &ToolCall, out: &mut Vec<SseEvent>) {
        let index = self.output.len();
        let item = function_call_item(call, "completed");
        let at = json!({"item_id": item["id"], "output_index": index});
        let added = json!({"output_index": index, "item": function_call_item(call, "in_progress")});
        out.push(self.event("response.output_item.added", added));
        let mut delta = at.clone();
        delta["delta"] = item["arguments"].clone();
        out.push(self.event("response.function_call_arguments.delta", delta));
        let mut done = at;
        done["arguments"] = item["arguments"].clone();
        out.push(self.event("response.function_call_arguments.done", done));
        out.push(self.event("response.output_item.done", json!({"output_index": index, "item": item})));
        self.output.push(item);
    }

    fn end(&mut self, out: &mut Vec<SseEvent>) {
        self.close_message(out);
        let status = status(self.finish_reason.as_deref());
        let response = response(&self.names, status, std::mem::take(&mut self.output), self.usage);
        let name = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
        out.push(self.event(name, json!({"response": response})));
    }
}

impl Render for Events {
    fn render(&mut self, event: Event<'_>) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if let Event::Error(message) = event {
            out.push(self.event("error", json!({"code": "engine_error", "message": message, "param": null})));
            return out;
        }
        self.start(&mut out);
        match event {
            Event::Usage(usage) => self.usage = Some(usage),
            Event::End => self.end(&mut out),
            _ => {
                let said = event.said().expect("a token or an answer's end");
                if !said.text.is_empty() {
                    self.text(said.text, &mut out);
                }
                if !said.tool_calls.is_empty() {
                    self.close_message(&mut out);
                    for call in said.tool_calls {
                        self.function_call(call, &mut out);
                    }
                }
                if let Some(finish) = said.finish {
                    self.close_message(&mut out);
                    self.finish_reason = Some(finish.reason.to_owned());
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests;
