//! Answers as every API is told them: the front door says what the engine generated as typed
//! [`Event`]s, and the request's API renders them: a streamed answer's server-sent events
//! ([`Render`]), or the whole answers ([`Whole`]) as one body.

use std::collections::BTreeMap;

use crate::engine::{Logprob, ToolCall};

/// What names a completion: its id, when it was made, the model.
#[derive(Clone, Debug)]
pub struct Names {
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Names {
    pub fn new(model: String) -> Names {
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        Names { id: pdbridge_common::request_id::new("chatcmpl"), created, model }
    }

    /// The id with another API's prefix (`msg`, `resp`) for `chatcmpl`.
    pub fn id_as(&self, prefix: &str) -> String {
        self.id.replacen("chatcmpl", prefix, 1)
    }
}

/// The tokens a request counted: its prompt's, those of it restored rather than computed, and
/// those generated over every answer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Usage {
    pub prompt: u32,
    pub cached: u32,
    pub completion: u32,
}

/// Why an answer ended, in OpenAI's words (`stop`, `length`, `tool_calls`), and the stop sequence
/// that ended it (empty when the EOS did).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Finish<'a> {
    pub reason: &'a str,
    pub stop_sequence: &'a str,
}

/// What the engine generated, in order: each answer's pieces then its end, after the last
/// answer the usage, then the end or an error.
#[derive(Debug)]
pub enum Event<'a> {
    /// A piece of answer `index`: a token's text (empty when it completed tool calls instead),
    /// its log probability when asked for, the calls it completed.
    Token { index: u32, text: &'a str, logprob: Option<&'a Logprob>, tool_calls: &'a [ToolCall] },
    /// Answer `index` is whole: the text held back to its end, the calls that ended with it, why
    /// it ended; the engine's stages with the request's last answer.
    Done {
        index: u32,
        text: &'a str,
        tool_calls: &'a [ToolCall],
        finish: Finish<'a>,
        engine_timings_ms: Option<&'a BTreeMap<String, f64>>,
    },
    /// After the last answer: what the request counted.
    Usage(Usage),
    /// Every answer is whole.
    End,
    /// The answers were cut by an error.
    Error(&'a str),
}

/// What a token or an answer's end says, as the APIs with one answer tell it: text, the calls
/// made, and at the end why it ended.
#[derive(Debug)]
pub struct Said<'a> {
    pub text: &'a str,
    pub tool_calls: &'a [ToolCall],
    pub finish: Option<Finish<'a>>,
}

impl<'a> Event<'a> {
    /// What the event says of an answer; none for the usage and the stream's end.
    pub fn said(&self) -> Option<Said<'a>> {
        match *self {
            Event::Token { text, tool_calls, .. } => Some(Said { text, tool_calls, finish: None }),
            Event::Done { text, tool_calls, finish, .. } => Some(Said { text, tool_calls, finish: Some(finish) }),
            Event::Usage(_) | Event::End | Event::Error(_) => None,
        }
    }
}

/// A server-sent event: its name (`event:`; OpenAI's have none) and its data.
#[derive(Debug, PartialEq)]
pub struct SseEvent {
    pub name: Option<&'static str>,
    pub data: String,
}

/// A streamed answer told in one API's events.
pub trait Render: Send {
    fn render(&mut self, event: Event<'_>) -> Vec<SseEvent>;
}

/// One answer, whole.
#[derive(Debug, Default)]
pub struct Choice {
    pub index: u32,
    pub text: String,
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: String,
    pub stop_sequence: String,
    /// One entry per generated token, when asked for.
    pub logprobs: Option<Vec<Logprob>>,
}

impl Choice {
    pub fn finish(&self) -> Finish<'_> {
        Finish { reason: &self.finish_reason, stop_sequence: &self.stop_sequence }
    }
}

/// A request's answers, whole.
#[derive(Debug)]
pub struct Whole {
    pub names: Names,
    pub choices: Vec<Choice>,
    pub usage: Usage,
}

impl Whole {
    /// The answer the APIs that have one answer tell (the Responses and Messages APIs).
    pub fn first(&self) -> Option<&Choice> {
        self.choices.first()
    }
}

/// One streamed answer, told by a renderer: "Hel" and "lo", then a call of `f` with `{"a":1}`
/// that ends it, then its usage (10 prompt tokens, 8 of them cached, 4 generated), then the end.
#[cfg(test)]
pub fn told(render: &mut dyn Render) -> Vec<SseEvent> {
    let call = ToolCall { id: "c1".into(), name: "f".into(), arguments: "{\"a\":1}".into() };
    let token = |text| Event::Token { index: 0, text, logprob: None, tool_calls: &[] };
    let finish = Finish { reason: "tool_calls", stop_sequence: "" };
    let mut events = Vec::new();
    for event in [
        token("Hel"),
        token("lo"),
        Event::Token { index: 0, text: "", logprob: None, tool_calls: std::slice::from_ref(&call) },
        Event::Done { index: 0, text: "", tool_calls: &[], finish, engine_timings_ms: None },
        Event::Usage(Usage { prompt: 10, cached: 8, completion: 4 }),
        Event::End,
    ] {
        events.extend(render.render(event));
    }
    events
}

/// Names for the tests' answers: `chatcmpl-1`, made at 7, of model `m`.
#[cfg(test)]
pub fn names() -> Names {
    Names { id: "chatcmpl-1".into(), created: 7, model: "m".into() }
}
