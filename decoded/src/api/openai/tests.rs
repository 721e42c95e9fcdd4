use serde_json::json;

use super::*;
use crate::api::answer::{Finish, names};

/// `body` as a request of `api`, with the messages (or prompt) it needs when it names none.
fn parsed(mut body: Value, api: Api) -> Result<Request, InvalidRequest> {
    let needs = if api == Api::Completions {
        ("prompt", json!("One,"))
    } else {
        ("messages", json!([{"role": "user", "content": "hi"}]))
    };
    body.as_object_mut().unwrap().entry(needs.0).or_insert(needs.1);
    parse(api, body.to_string().as_bytes())
}

fn asked_of(body: Value) -> Result<Asked, InvalidRequest> {
    parsed(body, Api::Chat).map(|r| r.asked)
}

fn chat_of(body: Value) -> Result<(Vec<Message>, Option<Vec<Tool>>), InvalidRequest> {
    match parse(Api::Chat, body.to_string().as_bytes())?.input {
        Input::Chat { messages, tools } => Ok((messages, tools)),
        Input::Text(_) => panic!("a chat"),
    }
}

#[test]
fn client_mistakes_in_messages_are_named() {
    let cases = [
        (json!({}), "`messages` must be an array"),
        (json!({"messages": []}), "must not be empty"),
        (json!({"messages": ["hi"]}), "`messages[0]`: invalid type: string \"hi\", expected a message object"),
        (json!({"messages": [{"content": "hi"}]}), "`messages[0]`: missing field `role`"),
        (json!({"messages": [{"role": "wizard", "content": "hi"}]}), "unknown variant `wizard`"),
        (json!({"messages": [{"role": "user", "content": 7}]}), "`messages[0].content`"),
        (json!({"messages": [{"role": "user"}]}), "`messages[0].content` must be a string"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "`messages[0].content[0]` is a \"image_url\" part",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
            "`messages[0].content[0].text` must be",
        ),
    ];
    for (body, want) in cases {
        let err = chat_of(body.clone()).unwrap_err();
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
        serde_json::to_value(chat_of(body).unwrap().0).unwrap(),
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
        let err = asked_of(json!({"max_tokens": bad})).unwrap_err();
        assert!(err.0.contains("`max_tokens` must be a positive integer"), "{bad}: {err}");
    }
    let err = asked_of(json!({"max_completion_tokens": 0})).unwrap_err();
    assert!(err.0.contains("`max_completion_tokens`"), "{err}");
    assert_eq!(asked_of(json!({"max_tokens": 7})).unwrap().sampling.max_tokens, Some(7));
    assert_eq!(asked_of(json!({"max_tokens": null})).unwrap().sampling.max_tokens, None);
}

#[test]
fn stop_is_a_string_or_up_to_four() {
    assert_eq!(asked_of(json!({"stop": "5"})).unwrap().sampling.stop, ["5"]);
    assert_eq!(asked_of(json!({"stop": ["a", "b"]})).unwrap().sampling.stop, ["a", "b"]);
    assert!(asked_of(json!({"stop": null})).unwrap().sampling.stop.is_empty());
    for bad in [json!(""), json!(["a", ""]), json!(["a", "b", "c", "d", "e"]), json!(5), json!([1])] {
        let err = asked_of(json!({"stop": bad})).unwrap_err();
        assert!(err.0.contains("`stop` must be"), "{bad}: {err}");
    }
}

#[test]
fn what_clients_send_by_default_is_accepted_and_n_is_bounded() {
    let defaults = json!({"n": 1, "logprobs": false, "presence_penalty": 0, "frequency_penalty": 0.0,
                          "top_logprobs": null, "user": "u-1", "metadata": {"k": "v"}});
    let s = asked_of(defaults).unwrap();
    assert_eq!((s.sampling.logprobs, s.n), (None, 1));
    assert_eq!(asked_of(json!({"n": 3})).unwrap().n, 3);
    for bad in [json!(0), json!(17), json!(1.5), json!("2")] {
        let err = asked_of(json!({"n": bad})).unwrap_err();
        assert!(err.0.contains("`n` must be an integer from 1 to 16"), "{bad}: {err}");
    }
}

#[test]
fn sampling_parameters_travel_as_the_decimals_the_client_wrote() {
    let asked = asked_of(json!({"temperature": 0.7, "top_p": 0.95, "presence_penalty": 0.1})).unwrap();
    let line = serde_json::to_value(&asked.sampling).unwrap();
    for (key, value) in [("temperature", 0.7), ("top_p", 0.95), ("presence_penalty", 0.1)] {
        assert_eq!(line[key], value, "{line}");
    }
}

#[test]
fn logprobs_and_penalties_as_each_api_spells_them() {
    assert_eq!(asked_of(json!({"logprobs": true})).unwrap().sampling.logprobs, Some(0));
    assert_eq!(asked_of(json!({"logprobs": true, "top_logprobs": 3})).unwrap().sampling.logprobs, Some(3));
    assert_eq!(parsed(json!({"logprobs": 2}), Api::Completions).unwrap().asked.sampling.logprobs, Some(2));
    let s = asked_of(json!({"presence_penalty": 0.5, "frequency_penalty": -1})).unwrap();
    assert_eq!((s.sampling.presence_penalty, s.sampling.frequency_penalty), (0.5, -1.0));
    for (body, api, needle) in [
        (json!({"top_logprobs": 3}), Api::Chat, "needs `logprobs: true`"),
        (json!({"logprobs": true, "top_logprobs": 21}), Api::Chat, "`top_logprobs`"),
        (json!({"logprobs": 5}), Api::Chat, "`logprobs` must be a boolean"),
        (json!({"logprobs": true}), Api::Completions, "`logprobs` must be an integer"),
        (json!({"logprobs": 6}), Api::Completions, "from 0 to 5"),
        (json!({"presence_penalty": 2.5}), Api::Chat, "`presence_penalty` must be between -2 and 2"),
        (json!({"frequency_penalty": "x"}), Api::Completions, "`frequency_penalty`"),
    ] {
        let err = parsed(body.clone(), api).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
}

#[test]
fn the_usage_chunk_is_asked_for_with_stream_options_and_stands_alone() {
    let include_usage = |body: Value| asked_of(body).map(|s| s.include_usage);
    assert_eq!(include_usage(json!({"stream": true, "stream_options": {"include_usage": true}})), Ok(true));
    assert_eq!(include_usage(json!({"stream": true, "stream_options": {}})), Ok(false));
    assert_eq!(include_usage(json!({"stream": true})), Ok(false));
    assert_eq!(include_usage(json!({"stream": false, "stream_options": null})), Ok(false));
    for (body, needle) in [
        (json!({"stream_options": {"include_usage": true}}), "only allowed with `stream: true`"),
        (json!({"stream": true, "stream_options": true}), "`stream_options`"),
        (
            json!({"stream": true, "stream_options": {"include_usage": "yes"}}),
            "`stream_options.include_usage` must be a boolean",
        ),
    ] {
        let err = asked_of(body.clone()).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
    let usage = Usage { prompt: 10, cached: 8, completion: 3 };
    assert!(Chunks::new(Api::Chat, names(), false).render(Event::Usage(usage)).is_empty());
    let last = Chunks::new(Api::Chat, names(), true).render(Event::Usage(usage)).remove(0);
    let last: Value = serde_json::from_str(&last.data).unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!((&last["object"], &last["usage"]["total_tokens"]), (&json!("chat.completion.chunk"), &json!(13)));
}

#[test]
fn legacy_parameters_the_front_door_does_not_implement_are_refused_by_name() {
    for (body, needle) in
        [(json!({"echo": true}), "`echo` is not supported"), (json!({"suffix": " end"}), "`suffix` is not supported")]
    {
        let err = parsed(body.clone(), Api::Completions).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
    // Their defaults are what the front door does anyway; chat has no such fields.
    for body in [json!({"echo": false}), json!({"suffix": ""}), json!({"suffix": null})] {
        assert!(parsed(body.clone(), Api::Completions).is_ok(), "{body}");
    }
    assert!(parsed(json!({"echo": true}), Api::Chat).is_ok());
    let err = parse(Api::Completions, br#"{"prompt": 5}"#).unwrap_err();
    assert!(err.0.contains("`prompt`"), "{err}");
}

#[test]
fn tools_are_functions_offered_unless_the_client_says_none() {
    let weather = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]);
    let offered = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        chat_of(body).map(|(_, tools)| serde_json::to_value(tools).unwrap())
    };
    assert_eq!(offered(json!({"tools": weather})).unwrap(), weather);
    assert_eq!(offered(json!({"tools": weather, "tool_choice": "auto"})).unwrap(), weather);
    assert_eq!(offered(json!({"tools": weather, "tool_choice": "none"})).unwrap(), Value::Null);
    assert_eq!(offered(json!({"tools": []})).unwrap(), Value::Null);
    assert_eq!(offered(json!({"tools": null})).unwrap(), Value::Null);
    for (body, needle) in [
        (json!({"tools": {"name": "x"}}), "`tools`"),
        (json!({"tools": [{"type": "retrieval"}]}), "`tools[0].type`"),
        (json!({"tools": [{"type": "function", "function": {}}]}), "`tools[0].function`: missing field `name`"),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "`tools[0].function.name` must be a non-empty string",
        ),
        (json!({"tools": weather, "tool_choice": "required"}), "cannot force a tool call"),
        (
            json!({"tools": weather, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            "cannot force a tool call",
        ),
    ] {
        let err = offered(body.clone()).unwrap_err();
        assert!(err.0.contains(needle), "{body}: {err}");
    }
}

#[test]
fn tool_calls_render_as_openai_renders_them() {
    let call = ToolCall { id: "call_1".into(), name: "get_weather".into(), arguments: r#"{"city":"Oslo"}"#.into() };
    let answer = Choice { tool_calls: vec![call.clone()], finish_reason: "tool_calls".into(), ..Choice::default() };
    let whole = whole(Api::Chat, &Whole { names: names(), choices: vec![answer], usage: Usage::default() });
    assert_eq!(
        whole["choices"][0]["message"],
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": r#"{"city":"Oslo"}"#}}
        ]})
    );
    // A delta's calls are numbered within its choice, from 0 again in the next answer.
    let mut chunks = Chunks::new(Api::Chat, names(), false);
    let calls = [call.clone(), call.clone()];
    let mut indices = Vec::new();
    for event in [
        Event::Token { index: 0, text: "", logprob: None, tool_calls: &calls },
        Event::Done {
            index: 0,
            text: "",
            tool_calls: &calls[..1],
            finish: Finish { reason: "tool_calls", stop_sequence: "" },
            engine_timings_ms: None,
        },
        Event::Token { index: 1, text: "", logprob: None, tool_calls: &calls[..1] },
    ] {
        let chunk: Value = serde_json::from_str(&chunks.render(event).remove(0).data).unwrap();
        let delta = &chunk["choices"][0]["delta"];
        assert_eq!(delta["tool_calls"][0]["function"]["name"], "get_weather");
        indices.extend(delta["tool_calls"].as_array().unwrap().iter().map(|c| c["index"].as_u64().unwrap()));
    }
    assert_eq!(indices, [0, 1, 2, 0]);
}

#[test]
fn a_logprob_entry_has_every_key_and_its_alternatives_none_of_their_own() {
    let alternative =
        |token: &str, logprob| Logprob { token: token.into(), logprob, bytes: vec![72], top_logprobs: Vec::new() };
    let sampled =
        Logprob { top_logprobs: vec![alternative("H", -0.1), alternative("h", -2.5)], ..alternative("H", -0.1) };
    let chat = logprobs(Api::Chat, std::slice::from_ref(&sampled));
    assert_eq!(
        chat["content"][0],
        json!({"token": "H", "logprob": -0.1, "bytes": [72], "top_logprobs": [
            {"token": "H", "logprob": -0.1, "bytes": [72]}, {"token": "h", "logprob": -2.5, "bytes": [72]}]})
    );
    let legacy = logprobs(Api::Completions, &[sampled.clone(), sampled]);
    assert_eq!(legacy["text_offset"], json!([0, 1]));
    assert_eq!(legacy["top_logprobs"][1], json!({"H": -0.1, "h": -2.5}));
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
