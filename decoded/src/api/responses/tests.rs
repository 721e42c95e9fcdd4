use serde_json::{Value, json};

use super::*;
use crate::api::answer::{Choice, names, told};

fn parsed(body: Value) -> Result<Request, InvalidRequest> {
    parse(body.to_string().as_bytes())
}

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
    let request = parsed(body).unwrap();
    let Input::Chat { messages, tools } = request.input else { panic!("a chat") };
    let call = Call::new("c1".into(), "get_weather".into(), "{\"city\":\"Oslo\"}".into());
    let conversation = [
        Message::new(Role::System, "Be brief."),
        Message::new(Role::User, "Weather in Oslo?"),
        Message::calling("", vec![call]),
        Message::tool_output("c1".into(), "sunny".into()),
    ];
    assert_eq!(messages, conversation);
    assert_eq!(
        serde_json::to_value(tools).unwrap(),
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}])
    );
    assert_eq!(
        (request.asked.sampling.max_tokens, request.asked.stream, request.model),
        (Some(9), true, Some("m".into()))
    );
    assert_eq!(
        parsed(json!({"input": "hi"})).unwrap().input,
        Input::Chat { messages: vec![Message::new(Role::User, "hi")], tools: None }
    );
}

#[test]
fn what_a_stateless_text_server_cannot_do_is_refused_by_name() {
    for (body, needle) in [
        (json!({"input": "hi", "previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"input": "hi", "reasoning": {"effort": "high"}}), "reasoning"),
        (json!({"input": "hi", "text": {"format": {"type": "json_schema"}}}), "text.format"),
        (json!({"input": "hi", "tools": [{"type": "web_search"}]}), "tools[0]"),
        (json!({"input": "hi", "tools": [{"type": "function"}]}), "`tools[0].name`"),
        (json!({"input": [{"type": "input_image"}]}), "input[0]"),
        (json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}), "input[0].content[0]"),
        (json!({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}), "`input[0].call_id`"),
        (json!({"input": "hi", "max_output_tokens": 0}), "`max_output_tokens` must be a positive integer"),
        (json!({}), "`input`"),
    ] {
        let refused = parsed(body).unwrap_err().0;
        assert!(refused.contains(needle), "{refused:?} lacks {needle:?}");
    }
}

#[test]
fn a_streamed_answer_is_told_in_typed_events_in_order() {
    let got = told(&mut Events::new(names()));
    let names: Vec<&str> = got.iter().map(|e| e.name.unwrap()).collect();
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
    let data: Vec<Value> = got.iter().map(|e| serde_json::from_str(&e.data).unwrap()).collect();
    assert!(data.iter().enumerate().all(|(i, d)| d["sequence_number"] == i && d["type"] == names[i]));
    let done = &data.last().unwrap()["response"];
    assert_eq!(done["output"][0]["content"][0]["text"], "Hello");
    assert_eq!((&done["output"][1]["call_id"], &done["output"][1]["arguments"]), (&json!("c1"), &json!("{\"a\":1}")));
    assert_eq!(done["usage"]["input_tokens_details"]["cached_tokens"], 8);
    assert_eq!(done["id"], "resp-1");
}

#[test]
fn an_answer_cut_by_max_output_tokens_is_incomplete() {
    let choice = Choice { text: "Hi".into(), finish_reason: "length".into(), ..Choice::default() };
    let answer = Whole { names: names(), choices: vec![choice], usage: Usage { prompt: 3, cached: 0, completion: 1 } };
    let response = whole(&answer);
    assert_eq!(
        (&response["status"], &response["incomplete_details"]["reason"]),
        (&json!("incomplete"), &json!("max_output_tokens"))
    );
    assert_eq!(response["output"][0]["content"][0], json!({"type": "output_text", "text": "Hi", "annotations": []}));
    assert_eq!(response["usage"]["total_tokens"], 4);
}
