//! Anthropic's Messages API (`/v1/messages`): a system prompt, text and tool-use turns, tool
//! results, `stop_sequences`, streamed as its events (`message_start`, content blocks and their
//! deltas, `message_delta` with the stop reason and usage, `message_stop`).

use serde_json::{Value, json};

use super::openai::InvalidRequest;
use super::{Said, SseEvent, call_parts, chat_tools, chat_with, content_text, field, invalid, usage_parts};

/// The chat request a Messages request asks for (checked further as any chat request is).
pub fn chat_request(body: &Value) -> Result<Value, InvalidRequest> {
    refuse_unimplemented(body)?;
    let max_tokens = field(body, "max_tokens").ok_or_else(|| invalid("`max_tokens` is required"))?;
    let mut messages = Vec::new();
    if let Some(system) = field(body, "system") {
        messages.push(json!({"role": "system", "content": content_text(system, "system", &["text"])?}));
    }
    let turns = body.get("messages").and_then(Value::as_array).ok_or_else(|| invalid("`messages` must be an array"))?;
    for (i, turn) in turns.iter().enumerate() {
        chat_turn(i, turn, &mut messages)?;
    }
    let mut chat = chat_with(body, messages, &["model", "temperature", "top_p", "stream"]);
    chat["max_tokens"] = max_tokens.clone();
    if let Some(stop) = field(body, "stop_sequences") {
        chat["stop"] = stop.clone();
    }
    if let Some(tools) = field(body, "tools") {
        // Anthropic's client tools have no type or "custom"; its server tools another.
        let client_tool = |kind: Option<&str>| matches!(kind, None | Some("custom"));
        chat["tools"] = chat_tools(tools, client_tool, "input_schema", "client tools")?;
    }
    if let Some(choice) = field(body, "tool_choice") {
        chat["tool_choice"] = match choice.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("none") => json!("none"),
            // Forcing a call: refused by the chat checks, which say why.
            _ => json!("required"),
        };
    }
    Ok(chat)
}

/// What the front door cannot do as asked is refused by name, never ignored.
fn refuse_unimplemented(body: &Value) -> Result<(), InvalidRequest> {
    if field(body, "top_k").is_some() {
        return Err(invalid("`top_k` is not supported: sample with `temperature` and `top_p`"));
    }
    match body.pointer("/thinking/type").and_then(Value::as_str) {
        None | Some("disabled") => Ok(()),
        Some(_) => Err(invalid("`thinking` is not supported by this model")),
    }
}

/// One turn appended to the chat's messages: a user turn's tool results become tool messages
/// (before its text), an assistant turn's tool uses its tool calls.
fn chat_turn(i: usize, turn: &Value, messages: &mut Vec<Value>) -> Result<(), InvalidRequest> {
    let at = format!("messages[{i}]");
    let role = turn.get("role").and_then(Value::as_str);
    let role = role.filter(|r| ["user", "assistant"].contains(r)).ok_or_else(|| {
        invalid(format!("`{at}.role` must be \"user\" or \"assistant\" (the system prompt is `system`)"))
    })?;
    let blocks = match turn.get("content") {
        Some(Value::String(text)) => {
            messages.push(json!({"role": role, "content": text}));
            return Ok(());
        }
        Some(Value::Array(blocks)) => blocks,
        _ => return Err(invalid(format!("`{at}.content` must be a string or a list of content blocks"))),
    };
    let (mut text, mut calls) = (String::new(), Vec::new());
    for (j, block) in blocks.iter().enumerate() {
        let at = format!("{at}.content[{j}]");
        let str_field = |key: &str| {
            block.get(key).and_then(Value::as_str).ok_or_else(|| invalid(format!("`{at}.{key}` must be a string")))
        };
        match (role, block.get("type").and_then(Value::as_str)) {
            (_, Some("text")) => text.push_str(str_field("text")?),
            ("assistant", Some("tool_use")) => calls.push(json!({
                "id": str_field("id")?, "type": "function",
                "function": {"name": str_field("name")?, "arguments": block.get("input").unwrap_or(&json!({})).to_string()},
            })),
            ("user", Some("tool_result")) => {
                let output = block.get("content").map_or(Ok(String::new()), |c| content_text(c, &at, &["text"]))?;
                messages.push(json!({"role": "tool", "tool_call_id": str_field("tool_use_id")?, "content": output}));
            }
            (_, other) => {
                return Err(invalid(format!("`{at}` is a {other:?} block; {role} turns here take text{}", match role {
                    "user" => " and tool_result blocks",
                    _ => " and tool_use blocks",
                })));
            }
        }
    }
    if !calls.is_empty() {
        messages.push(json!({"role": role, "content": text, "tool_calls": calls}));
    } else if !text.is_empty() || role == "assistant" {
        messages.push(json!({"role": role, "content": text}));
    }
    Ok(())
}

/// Why the answer stopped, in Anthropic's words, and the stop sequence when one did.
fn stop_reason<'a>(
    finish_reason: Option<&str>,
    stop_sequence: Option<&'a str>,
) -> (Option<&'static str>, Option<&'a str>) {
    let reason = finish_reason.map(|finish| match (finish, stop_sequence) {
        ("length", _) => "max_tokens",
        ("tool_calls", _) => "tool_use",
        (_, Some(_)) => "stop_sequence",
        _ => "end_turn",
    });
    (reason, stop_sequence.filter(|_| reason == Some("stop_sequence")))
}

/// A chat usage as Anthropic counts it: `input_tokens` are those computed, cached ones apart.
fn usage(chat: &Value) -> Value {
    let (prompt, completion, cached) = usage_parts(chat);
    json!({"input_tokens": prompt - cached.min(prompt), "output_tokens": completion,
           "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0})
}

fn tool_use(call: &Value) -> Value {
    let (id, name, arguments) = call_parts(call);
    let input: Value = serde_json::from_str(arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": id, "name": name, "input": input})
}

fn message_id(chat: &Value) -> String {
    chat["id"].as_str().unwrap_or_default().replacen("chatcmpl", "msg", 1)
}

/// A whole chat completion as a message.
pub fn whole(completion: &Value) -> Value {
    let said = Said::of(&completion["choices"][0]);
    let mut content = Vec::new();
    if !said.text.is_empty() {
        content.push(json!({"type": "text", "text": said.text}));
    }
    content.extend(said.tool_calls.iter().map(tool_use));
    let (stop_reason, stop_sequence) = stop_reason(said.finish_reason, said.stop_sequence);
    json!({
        "id": message_id(completion), "type": "message", "role": "assistant", "model": completion["model"],
        "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": usage(&completion["usage"]),
    })
}

/// The content block being streamed: its index, and whether it is text.
struct OpenBlock {
    index: usize,
    text: bool,
}

/// A chat stream as the Messages API's events.
#[derive(Default)]
pub struct Events {
    started: bool,
    block: Option<OpenBlock>,
    blocks: usize,
    finish_reason: Option<String>,
    stop_sequence: Option<String>,
    usage: Option<Value>,
}

fn event(name: &'static str, mut data: Value) -> SseEvent {
    data["type"] = name.into();
    SseEvent { name, data }
}

impl Events {
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
}

impl super::Stream for Events {
    fn chunk(&mut self, chunk: &Value) -> Vec<SseEvent> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            let message = json!({
                "id": message_id(chunk), "type": "message", "role": "assistant", "model": chunk["model"],
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            });
            out.push(event("message_start", json!({"message": message})));
        }
        if chunk["usage"].is_object() {
            self.usage = Some(chunk["usage"].clone());
        }
        let Some(choice) = chunk["choices"].get(0) else { return out };
        let said = Said::of(choice);
        if !said.text.is_empty() {
            let index = match &self.block {
                Some(OpenBlock { index, text: true }) => *index,
                _ => self.open(json!({"type": "text", "text": ""}), &mut out),
            };
            out.push(event(
                "content_block_delta",
                json!({"index": index, "delta": {"type": "text_delta", "text": said.text}}),
            ));
        }
        for call in said.tool_calls {
            let mut block = tool_use(call);
            let (_, _, arguments) = call_parts(call);
            block["input"] = json!({});
            let index = self.open(block, &mut out);
            let delta = json!({"type": "input_json_delta", "partial_json": arguments});
            out.push(event("content_block_delta", json!({"index": index, "delta": delta})));
            self.close(&mut out);
        }
        if let Some(finish) = said.finish_reason {
            self.close(&mut out);
            self.finish_reason = Some(finish.to_owned());
            self.stop_sequence = said.stop_sequence.map(str::to_owned);
        }
        out
    }

    fn end(&mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        self.close(&mut out);
        let (stop_reason, stop_sequence) = stop_reason(self.finish_reason.as_deref(), self.stop_sequence.as_deref());
        let delta = json!({"stop_reason": stop_reason, "stop_sequence": stop_sequence});
        let usage = usage(self.usage.as_ref().unwrap_or(&Value::Null));
        out.push(event("message_delta", json!({"delta": delta, "usage": usage})));
        out.push(event("message_stop", json!({})));
        out
    }

    fn error(&mut self, message: &str) -> Vec<SseEvent> {
        vec![event("error", json!({"error": {"type": "api_error", "message": message}}))]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turns_with_tool_use_and_results_become_the_chat_they_are() {
        let body = json!({
            "model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
            "stop_sequences": ["END"], "stream": true,
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                    {"type": "text", "text": "And tomorrow?"}]},
            ],
            "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
        });
        let chat = chat_request(&body).unwrap();
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "sunny"},
                {"role": "user", "content": "And tomorrow?"},
            ])
        );
        assert_eq!(
            chat["tools"][0]["function"],
            json!({"name": "get_weather", "description": "d", "parameters": {"type": "object"}})
        );
        assert_eq!(
            (&chat["stop"], &chat["max_tokens"], &chat["tool_choice"]),
            (&json!(["END"]), &json!(64), &json!("auto"))
        );
        assert_eq!(chat["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn what_this_server_cannot_do_is_refused_by_name() {
        let turn = json!([{"role": "user", "content": "hi"}]);
        for (body, needle) in [
            (json!({"messages": turn}), "`max_tokens` is required"),
            (json!({"max_tokens": 5, "messages": turn, "top_k": 5}), "top_k"),
            (
                json!({"max_tokens": 5, "messages": turn, "thinking": {"type": "enabled", "budget_tokens": 9}}),
                "thinking",
            ),
            (json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
            (
                json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
                "messages[0].content[0]",
            ),
            (
                json!({"max_tokens": 5, "messages": turn, "tools": [{"type": "web_search_20250305", "name": "w"}]}),
                "tools[0]",
            ),
        ] {
            let refused = chat_request(&body).unwrap_err().0;
            assert!(refused.contains(needle), "{refused:?} lacks {needle:?}");
        }
    }

    #[test]
    fn a_streamed_answer_is_told_in_content_blocks() {
        let got = crate::api::told(&mut Events::default());
        let names: Vec<&str> = got.iter().map(|e| e.name).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop",
            ]
        );
        assert_eq!(got[5].data["content_block"], json!({"type": "tool_use", "id": "c1", "name": "f", "input": {}}));
        assert_eq!(got[6].data["delta"], json!({"type": "input_json_delta", "partial_json": "{\"a\":1}"}));
        assert_eq!(got[8].data["delta"]["stop_reason"], "tool_use");
        assert_eq!(
            got[8].data["usage"],
            json!({"input_tokens": 2, "output_tokens": 4, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0})
        );
    }

    #[test]
    fn a_whole_answer_is_a_message_with_its_blocks() {
        let mut completion = json!({
            "id": "chatcmpl-3", "model": "m",
            "choices": [{"index": 0, "finish_reason": "length", "message": {"role": "assistant", "content": "Hi"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
        });
        let message = whole(&completion);
        assert_eq!(message["content"], json!([{"type": "text", "text": "Hi"}]));
        assert_eq!((&message["stop_reason"], &message["id"]), (&json!("max_tokens"), &json!("msg-3")));
        // A stop sequence is named (vLLM's `stop_reason` in the chat choice); the EOS is the turn's end.
        completion["choices"][0]["finish_reason"] = "stop".into();
        assert_eq!(whole(&completion)["stop_reason"], "end_turn");
        completion["choices"][0]["stop_reason"] = "END".into();
        let stopped = whole(&completion);
        assert_eq!((&stopped["stop_reason"], &stopped["stop_sequence"]), (&json!("stop_sequence"), &json!("END")));
    }
}
