use serde_json::json;

use super::*;

#[test]
fn client_mistakes_in_messages_are_named() {
    let cases = [
        (json!({}), "`messages` must be an array"),
        (json!({"messages": []}), "must not be empty"),
        (json!({"messages": ["hi"]}), "`messages[0]` must be an object"),
        (json!({"messages": [{"content": "hi"}]}), "`messages[0]`.role"),
        (json!({"messages": [{"role": "wizard", "content": "hi"}]}), "not \"wizard\""),
        (json!({"messages": [{"role": "user", "content": 7}]}), "`messages[0]`.content"),
        (json!({"messages": [{"role": "user"}]}), "`messages[0]`.content"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "`messages[0].content[0]` is a \"image_url\" part",
        ),
        (json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}), "content[0]`.text"),
    ];
    for (body, want) in cases {
        let err = chat_messages(&body).unwrap_err();
        assert!(err.0.contains(want), "{body}: {err} lacks {want:?}");
    }
}

#[test]
fn list_form_content_becomes_its_text() {
    let body = json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}], "name": "x"},
        {"role": "assistant", "content": null, "tool_calls": []},
    ]});
    assert_eq!(
        chat_messages(&body).unwrap(),
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello, world", "name": "x"},
            {"role": "assistant", "content": "", "tool_calls": []},
        ])
    );
}

#[test]
fn max_tokens_out_of_range_is_refused_not_truncated() {
    for bad in [json!(0), json!(-1), json!(1.5), json!("8"), json!(4_294_967_299u64)] {
        let err = asked_of(&json!({"max_tokens": bad})).unwrap_err();
        assert!(err.0.contains("`max_tokens`"), "{bad}: {err}");
    }
    let err = asked_of(&json!({"max_completion_tokens": 0})).unwrap_err();
    assert!(err.0.contains("`max_completion_tokens`"), "{err}");
    assert_eq!(asked_of(&json!({"max_tokens": 7})).unwrap().sampling.max_tokens, Some(7));
    assert_eq!(asked_of(&json!({"max_tokens": null})).unwrap().sampling.max_tokens, None);
}

#[test]
fn stop_is_a_string_or_up_to_four() {
    assert_eq!(asked_of(&json!({"stop": "5"})).unwrap().sampling.stop, ["5"]);
    assert_eq!(asked_of(&json!({"stop": ["a", "b"]})).unwrap().sampling.stop, ["a", "b"]);
    assert!(asked_of(&json!({"stop": null})).unwrap().sampling.stop.is_empty());
    for bad in [json!(""), json!(["a", ""]), json!(["a", "b", "c", "d", "e"]), json!(5), json!([1])] {
        let err = asked_of(&json!({"stop": bad})).unwrap_err();
        assert!(err.0.contains("`stop`"), "{bad}: {err}");
    }
}

fn asked_of(body: &Value) -> Result<Asked, InvalidRequest> {
    asked(body, Api::Chat)
}

#[test]
fn what_clients_send_by_default_is_accepted_and_n_is_bounded() {
    let defaults =
        json!({"n": 1, "logprobs": false, "presence_penalty": 0, "frequency_penalty": 0.0, "top_logprobs": null});
    let s = asked_of(&defaults).unwrap();
    assert_eq!((s.sampling.logprobs, s.n), (None, 1));
    assert_eq!(asked_of(&json!({"n": 3})).unwrap().n, 3);
    for bad in [json!(0), json!(17), json!(1.5), json!("2")] {
        let err = asked_of(&json!({"n": bad})).unwrap_err();
        assert!(err.0.contains("`n` must be an integer from 1 to 16"), "{bad}: {err}");
    }
}

#[test]
fn logprobs_and_penalties_as_each_api_spells_them() {
    assert_eq!(asked_of(&json!({"logprobs": true})).unwrap().sampling.logprobs, Some(0));
    assert_eq!(asked_of(&json!({"logprobs": true, "top_logprobs": 3})).unwrap().sampling.logprobs, Some(3));
    assert_eq!(asked(&json!({"logprobs": 2}), Api::Completions).unwrap().sampling.logprobs, Some(2));
    let s = asked_of(&json!({"presence_penalty": 0.5, "frequency_penalty": -1})).unwrap();
    assert_eq!((s.sampling.presence_penalty, s.sampling.frequency_penalty), (0.5, -1.0));
    for (body, kind, needle) in [
        (json!({"top_logprobs": 3}), Api::Chat, "needs `logprobs: true`"),
        (json!({"logprobs": true, "top_logprobs": 21}), Api::Chat, "`top_logprobs`"),
        (json!({"logprobs": 5}), Api::Chat, "`logprobs` must be a boolean"),
        (json!({"logprobs": true}), Api::Completions, "`logprobs` must be an integer"),
        (json!({"logprobs": 6}), Api::Completions, "from 0 to 5"),
        (json!({"presence_penalty": 2.5}), Api::Chat, "`presence_penalty`"),
        (json!({"frequency_penalty": "x"}), Api::Completions, "`frequency_penalty`"),
    ] {
        let err = asked(&body, kind).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
}

#[test]
fn the_usage_chunk_is_asked_for_with_stream_options_and_stands_alone() {
    let include_usage = |body: Value| asked_of(&body).map(|s| s.include_usage);
    assert_eq!(include_usage(json!({"stream": true, "stream_options": {"include_usage": true}})), Ok(true));
    assert_eq!(include_usage(json!({"stream": true, "stream_options": {}})), Ok(false));
    assert_eq!(include_usage(json!({"stream": true})), Ok(false));
    assert_eq!(include_usage(json!({"stream": false, "stream_options": null})), Ok(false));
    for (body, needle) in [
        (json!({"stream_options": {"include_usage": true}}), "only allowed with `stream: true`"),
        (json!({"stream": true, "stream_options": true}), "`stream_options` must be an object"),
        (json!({"stream": true, "stream_options": {"include_usage": "yes"}}), "`stream_options.include_usage`"),
    ] {
        let err = asked_of(&body).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
    let last = usage_chunk(Api::Chat, ("id", 7, "m"), usage(10, 3, 8));
    assert_eq!(last["choices"], json!([]));
    assert_eq!((&last["object"], &last["usage"]["total_tokens"]), (&json!("chat.completion.chunk"), &json!(13)));
}

#[test]
fn legacy_parameters_the_front_door_does_not_implement_are_refused_by_name() {
    for (body, needle) in
        [(json!({"echo": true}), "`echo` is not supported"), (json!({"suffix": " end"}), "`suffix` is not supported")]
    {
        let err = asked(&body, Api::Completions).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
    // Their defaults are what the front door does anyway; chat has no such fields.
    for body in [json!({"echo": false}), json!({"suffix": ""}), json!({"suffix": null})] {
        assert!(asked(&body, Api::Completions).is_ok(), "{body}");
    }
    assert!(asked(&json!({"echo": true}), Api::Chat).is_ok());
}

#[test]
fn tools_are_functions_offered_unless_the_client_says_none() {
    let weather = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]);
    assert_eq!(tools(&json!({"tools": weather})).unwrap(), Some(&weather));
    assert_eq!(tools(&json!({"tools": weather, "tool_choice": "auto"})).unwrap(), Some(&weather));
    assert_eq!(tools(&json!({"tools": weather, "tool_choice": "none"})).unwrap(), None);
    assert_eq!(tools(&json!({"tools": []})).unwrap(), None);
    assert_eq!(tools(&json!({"tools": null})).unwrap(), None);
    for (body, needle) in [
        (json!({"tools": {"name": "x"}}), "`tools` must be an array"),
        (json!({"tools": [{"type": "retrieval"}]}), "`tools[0].type`"),
        (json!({"tools": [{"type": "function", "function": {}}]}), "`tools[0].function.name`"),
        (json!({"tools": weather, "tool_choice": "required"}), "cannot force a tool call"),
        (
            json!({"tools": weather, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            "cannot force a tool call",
        ),
    ] {
        let err = tools(&body).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
}

#[test]
fn tool_calls_render_as_openai_renders_them() {
    let call = ToolCall { id: "call_1".into(), name: "get_weather".into(), arguments: r#"{"city":"Oslo"}"#.into() };
    let whole = choice(Api::Chat, 0, "", "tool_calls", None, std::slice::from_ref(&call));
    assert_eq!(
        whole["message"],
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": r#"{"city":"Oslo"}"#}}
        ]})
    );
    let mut streamed = chunk(Api::Chat, ("id", 0, "m"), 0, None, None);
    add_tool_calls(&mut streamed, &[call], 2);
    assert_eq!(streamed["choices"][0]["delta"]["tool_calls"][0]["index"], 2);
    assert_eq!(streamed["choices"][0]["delta"]["tool_calls"][0]["function"]["name"], "get_weather");
}

#[test]
fn the_context_bounds_prompt_and_generation() {
    assert_eq!(generation_budget(None, 256, 100, 8192), Ok(256));
    assert_eq!(generation_budget(None, 256, 8000, 8192), Ok(192));
    assert_eq!(generation_budget(Some(192), 256, 8000, 8192), Ok(192));
    let err = generation_budget(Some(193), 256, 8000, 8192).unwrap_err();
    assert!(err.0.contains("plus `max_tokens` (193)"), "{err}");
    let err = generation_budget(None, 256, 11_117, 8192).unwrap_err();
    assert!(err.0.contains("11117 tokens"), "{err}");
    assert!(generation_budget(Some(1), 256, 8192, 8192).is_err());
}
