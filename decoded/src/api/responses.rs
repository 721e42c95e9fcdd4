//! OpenAI's Responses API (`/v1/responses`): text in and out, `instructions`, function tools and
//! their calls, streamed as its typed events. Stateless: a response is never stored, so
//! `previous_response_id` is refused and the conversation travels whole in `input`.

use serde_json::{Value, json};

use super::openai::InvalidRequest;
use super::{Said, SseEvent, call_parts, chat_tools, chat_with, content_text, field, invalid, usage_parts};

/// The chat request a Responses request asks for (checked further as any chat request is).
pub fn chat_request(body: &Value) -> Result<Value, InvalidRequest> {
    refuse_unimplemented(body)?;
    let mut messages = Vec::new();
    if let Some(instructions) = field(body, "instructions") {
        let text = instructions.as_str().ok_or_else(|| invalid("`instructions` must be a string"))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    match field(body, "input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                input_item(i, item, &mut messages)?;
            }
        }
        _ => return Err(invalid("`input` must be a string or a list of input items")),
    }
    let mut chat = chat_with(body, messages, &["model", "temperature", "top_p", "stream", "tool_choice"]);
    if let Some(max) = field(body, "max_output_tokens") {
        chat["max_tokens"] = max.clone();
    }
    if let Some(tools) = field(body, "tools") {
        chat["tools"] = chat_tools(tools, |kind| kind == Some("function"), "parameters", "function tools")?;
    }
    Ok(chat)
}

/// What the front door cannot do as asked is refused by name, never ignored.
fn refuse_unimplemented(body: &Value) -> Result<(), InvalidRequest> {
    if field(body, "previous_response_id").is_some() {
        return Err(invalid(
            "`previous_response_id` is not supported: this server keeps no responses; send the whole conversation in `input`",
        ));
    }
    if field(body, "background").is_some_and(|b| b != &Value::Bool(false)) {
        return Err(invalid("`background` is not supported: answers are given while the request waits"));
    }
    if field(body, "reasoning").is_some() {
        return Err(invalid("`reasoning` is not supported by this model"));
    }
    match body.pointer("/text/format/type").and_then(Value::as_str) {
        None | Some("text") => Ok(()),
        Some(other) => Err(invalid(format!("`text.format` {other:?} is not supported: answers are plain text"))),
    }
}

/// One item of `input` appended to the chat's messages: a message, a function call the model made
/// (joined to the assistant turn before it), or a call's output.
fn input_item(i: usize, item: &Value, messages: &mut Vec<Value>) -> Result<(), InvalidRequest> {
    let at = format!("input[{i}]");
    let str_field = |key: &str| {
        item.get(key).and_then(Value::as_str).ok_or_else(|| invalid(format!("`{at}.{key}` must be a string")))
    };
    match item.get("type").and_then(Value::as_str) {
        None | Some("message") => {
            let role = str_field("role")?;
            let content = content_text(
                item.get("content").unwrap_or(&Value::Null),
                &format!("{at}.content"),
                &["input_text", "output_text", "text"],
            )?;
            messages.push(json!({"role": role, "content": content}));
        }
        Some("function_call") => {
            let call = json!({"id": str_field("call_id")?, "type": "function",
                              "function": {"name": str_field("name")?, "arguments": str_field("arguments")?}});
            match messages.last_mut() {
                Some(turn) if turn["role"] == "assistant" && turn["tool_calls"].is_array() => {
                    turn["tool_calls"].as_array_mut().expect("an array").push(call);
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        Some("function_call_output") => {
            messages
                .push(json!({"role": "tool", "tool_call_id": str_field("call_id")?, "content": str_field("output")?}));
        }
        Some(other) => {
            return Err(invalid(format!(
                "`{at}` is a {other:?} item; this server takes messages, function calls and their outputs"
            )));
        }
    }
    Ok(())
}

/// A whole chat completion as a response.
pub fn whole(completion: &Value) -> Value {
    let said = Said::of(&completion["choices"][0]);
    let mut output = Vec::new();
    if !said.text.is_empty() {
        output.push(message_item(&new_id("msg"), said.text, "completed"));
    }
    output.extend(said.tool_calls.iter().map(|call| function_call_item(call, "completed")));
    let head = Head::of(completion);
    head.response(status(said.finish_reason), output, Some(&completion["usage"]))
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

fn function_call_item(call: &Value, status: &str) -> Value {
    let (call_id, name, arguments) = call_parts(call);
    let arguments = if status == "in_progress" { "" } else { arguments };
    json!({"type": "function_call", "id": format!("fc-{call_id}"), "call_id": call_id, "name": name,
           "arguments": arguments, "status": status})
}

/// What names a response.
struct Head {
    id: String,
    created: u64,
    model: String,
}

impl Head {
    fn of(chat: &Value) -> Head {
        let id = chat["id"].as_str().unwrap_or_default().replacen("chatcmpl", "resp", 1);
        Head { id, created: chat["created"].as_u64().unwrap_or(0), model: chat["model"].as_str().unwrap_or("").into() }
    }

    fn response(&self, status: &str, output: Vec<Value>, usage: Option<&Value>) -> Value {
        json!({
            "id": self.id, "object": "response", "created_at": self.created, "model": self.model,
            "status": status,
            "incomplete_details": (status == "incomplete").then(|| json!({"reason": "max_output_tokens"})),
            "error": null, "instructions": null, "metadata": {}, "output": output,
            "parallel_tool_calls": true, "tool_choice": "auto", "tools": [],
            "text": {"format": {"type": "text"}},
            "usage": usage.filter(|u| u.is_object()).map(|usage| {
                let (prompt, completion, cached) = usage_parts(usage);
                json!({
                    "input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
                    "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                    "total_tokens": prompt + completion,
                })
            }),
        })
    }
}

/// A message item being streamed: its id, place among the outputs, and text so far.
struct OpenMessage {
    id: String,
    index: usize,
    text: String,
}

/// A chat stream as the Responses API's events: `response.created`, each output item added, its
/// text or arguments in deltas and done, then `response.completed` (or `.incomplete`) with the
/// whole response and its usage.
#[derive(Default)]
pub struct Events {
    sequence: u64,
    head: Option<Head>,
    message: Option<OpenMessage>,
    /// The finished output items.
    output: Vec<Value>,
    finish_reason: Option<String>,
    usage: Option<Value>,
}

impl Events {
    fn event(&mut self, name: &'static str, mut data: Value) -> SseEvent {
        data["type"] = name.into();
        data["sequence_number"] = self.sequence.into();
        self.sequence += 1;
        SseEvent { name, data }
    }

    fn open_message(&mut self, out: &mut Vec<SseEvent>) {
        if self.message.is_some() {
            return;
        }
        let message = OpenMessage { id: new_id("msg"), index: self.output.len(), text: String::new() };
        let item = message_item(&message.id, "", "in_progress");
        out.push(self.event("response.output_item.added", json!({"output_index": message.index, "item": item})));
        let part = json!({"item_id": message.id, "output_index": message.index, "content_index": 0,
                          "part": output_text("")});
        out.push(self.event("response.content_part.added", part));
        self.message = Some(message);
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

    fn function_call(&mut self, call: &Value, out: &mut Vec<SseEvent>) {
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
}

impl super::Stream for Events {
    fn chunk(&mut self, chunk: &Value) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if self.head.is_none() {
            let head = Head::of(chunk);
            let created = json!({"response": head.response("in_progress", Vec::new(), None)});
            self.head = Some(head);
            out.push(self.event("response.created", created.clone()));
            out.push(self.event("response.in_progress", created));
        }
        if chunk["usage"].is_object() {
            self.usage = Some(chunk["usage"].clone());
        }
        let Some(choice) = chunk["choices"].get(0) else { return out };
        let said = Said::of(choice);
        if !said.text.is_empty() {
            self.open_message(&mut out);
            let message = self.message.as_mut().expect("opened");
            message.text.push_str(said.text);
            let delta =
                json!({"item_id": message.id, "output_index": message.index, "content_index": 0, "delta": said.text});
            out.push(self.event("response.output_text.delta", delta));
        }
        if !said.tool_calls.is_empty() {
            self.close_message(&mut out);
            for call in said.tool_calls {
                self.function_call(call, &mut out);
            }
        }
        if let Some(finish) = said.finish_reason {
            self.close_message(&mut out);
            self.finish_reason = Some(finish.to_owned());
        }
        out
    }

    fn end(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        self.close_message(&mut out);
        let status = status(self.finish_reason.as_deref());
        let Some(head) = &self.head else { return out };
        let response = head.response(status, std::mem::take(&mut self.output), self.usage.as_ref());
        let name = if status == "incomplete" { "response.incomplete" } else { "response.completed" };
        out.push(self.event(name, json!({"response": response})));
        out
    }

    fn error(&mut self, message: &str) -> Vec<SseEvent> {
        vec![self.event("error", json!({"code": "engine_error", "message": message, "param": null}))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conversation_with_calls_becomes_the_chat_it_is() {
        let body = json!({
            "model": "m", "instructions": "Be brief.", "max_output_tokens": 9, "stream": true,
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Oslo?"}]},
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            ],
            "tools": [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}],
        });
        let chat = chat_request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": null, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ])
        );
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
        );
        assert_eq!((&chat["max_tokens"], &chat["stream_options"]), (&json!(9), &json!({"include_usage": true})));
        assert_eq!(
            chat_request(&json!({"input": "hi"})).unwrap(),
            json!({"messages": [{"role": "user", "content": "hi"}]})
        );
    }

    #[test]
    fn what_a_stateless_text_server_cannot_do_is_refused_by_name() {
        for (body, needle) in [
            (json!({"input": "hi", "previous_response_id": "resp_1"}), "previous_response_id"),
            (json!({"input": "hi", "reasoning": {"effort": "high"}}), "reasoning"),
            (json!({"input": "hi", "text": {"format": {"type": "json_schema"}}}), "text.format"),
            (json!({"input": "hi", "tools": [{"type": "web_search"}]}), "tools[0]"),
            (json!({"input": [{"type": "input_image"}]}), "input[0]"),
            (json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "input[0].content[0]"),
            (json!({}), "`input`"),
        ] {
            let refused = chat_request(&body).unwrap_err().0;
            assert!(refused.contains(needle), "{refused:?} lacks {needle:?}");
        }
    }

    #[test]
    fn a_streamed_answer_is_told_in_typed_events_in_order() {
        let got = crate::api::told(&mut Events::default());
        let names: Vec<&str> = got.iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert!(got.iter().enumerate().all(|(i, e)| e.data["sequence_number"] == i && e.data["type"] == e.name));
        let done = &got.last().unwrap().data["response"];
        assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
        assert_eq!(
            (&done["output"][1]["call_id"], &done["output"][1]["arguments"]),
            (&json!("c1"), &json!("{\"a\":1}"))
        );
        assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 8);
        assert_eq!(done["id"], "resp-1");
    }

    #[test]
    fn an_answer_cut_by_max_output_tokens_is_incomplete() {
        let completion = json!({
            "id": "chatcmpl-2", "created": 7, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
        });
        let response = whole(&completion);
        assert_eq!(
            (&response["status"], &response["incomplete_details"]["reason"]),
            (&json!("incomplete"), &json!("max_output_tokens"))
        );
        assert_eq!(
            response["output"][0]["content"][0],
            json!({"type": "output_text", "text": "Hi", "annotations": []})
        );
        assert_eq!(response["usage"]["total_tokens"], 4);
    }
}
