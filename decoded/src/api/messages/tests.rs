use serde_json::{Value, json};

use super::*;
use crate::api::answer::{Choice, names, told};

fn parsed(body: Value) -> Result<Request, InvalidRequest> {
    parse(body.to_string().as_bytes())
}

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
    let request = parsed(body).unwrap();
    let (messages, tools) = chat::as_template_sees(request.input);
    assert_eq!(
        messages,
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
            {"role": "user", "content": "And tomorrow?"},
        ])
    );
    assert_eq!(
        tools[0]["function"],
        json!({"name": "get_weather", "description": "d", "parameters": {"type": "object"}})
    );
    let asked = request.asked;
    assert_eq!((asked.sampling.stop, asked.sampling.max_tokens, asked.stream), (vec!["END".into()], Some(64), true));
}

#[test]
fn what_this_server_cannot_do_is_refused_by_name() {
    let turn = json!([{"role": "user", "content": "hi"}]);
    for (body, needle) in [
        (json!({"messages": turn}), "`max_tokens` is required"),
        (json!({"max_tokens": 5, "messages": turn, "top_k": 5}), "top_k"),
        (json!({"max_tokens": 5, "messages": turn, "thinking": {"type": "enabled", "budget_tokens": 9}}), "thinking"),
        (json!({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}), "messages[0].role"),
        (
            json!({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]}),
            "messages[0].content[0]",
        ),
        (
            json!({"max_tokens": 5, "messages": turn, "tools": [{"type": "web_search_20250305", "name": "w"}]}),
            "tools[0]",
        ),
        (json!({"max_tokens": 5, "messages": turn, "tool_choice": {"type": "any"}}), "cannot force a tool call"),
        (json!({"max_tokens": 0, "messages": turn}), "`max_tokens` must be a positive integer"),
    ] {
        let refused = parsed(body).unwrap_err().0;
        assert!(refused.contains(needle), "{refused:?} lacks {needle:?}");
    }
}

#[test]
fn counting_tokens_asks_for_no_max_tokens() {
    let (model, input) = parse_count(br#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#).unwrap();
    assert_eq!(
        (model, input),
        (Some("m".into()), Input::Chat { messages: vec![Message::new(Role::User, "hi")], tools: None })
    );
}

#[test]
fn a_streamed_answer_is_told_in_content_blocks() {
    let got = told(&mut Events::new(names()));
    let names: Vec<&str> = got.iter().map(|e| e.name.unwrap()).collect();
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
    let data: Vec<Value> = got.iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    assert!(data.iter().zip(&names).all(|(d, name)| d["type"] == *name));
    assert_eq!(data[0]["message"]["id"], "msg-1");
    assert_eq!(data[5]["content_block"], json!({"type": "tool_use", "id": "c1", "name": "f", "input": {}}));
    assert_eq!(data[6]["delta"], json!({"type": "input_json_delta", "partial_json": "{\"a\":1}"}));
    assert_eq!(data[8]["delta"]["stop_reason"], "tool_use");
    assert_eq!(
        data[8]["usage"],
        json!({"input_tokens": 2, "output_tokens": 4, "cache_read_input_tokens": 8, "cache_creation_input_tokens": 0})
    );
}

#[test]
fn a_whole_answer_is_a_message_with_its_blocks() {
    let choice = Choice { text: "Hi".into(), finish_reason: "length".into(), ..Choice::default() };
    let mut answer =
        Whole { names: names(), choices: vec![choice], usage: Usage { prompt: 3, cached: 0, completion: 1 } };
    let message = whole(&answer);
    assert_eq!(message["content"], json!([{"type": "text", "text": "Hi"}]));
    assert_eq!((&message["stop_reason"], &message["id"]), (&json!("max_tokens"), &json!("msg-1")));
    // A stop sequence is named; the EOS is the turn's end.
    answer.choices[0].finish_reason = "stop".into();
    assert_eq!(whole(&answer)["stop_reason"], "end_turn");
    answer.choices[0].stop_sequence = "END".into();
    let stopped = whole(&answer);
    assert_eq!((&stopped["stop_reason"], &stopped["stop_sequence"]), (&json!("stop_sequence"), &json!("END")));
}
