//! The one request every API's request becomes: a chat (messages as chat templates take them, the
//! tools offered) or a plain prompt, and what the client asks of its answers. Each API parses its
//! own wire format once ([`super::openai`], [`super::responses`], [`super::messages`]) into this;
//! the front door serves nothing else.
//!
//! The fields every API shares are parsed here, each checked as it is read, so a client's mistake
//! is refused with the field's name and what it must be.

use serde::{Deserialize, Deserializer, Serialize, de};

use super::{InvalidRequest, invalid};
use crate::engine::Sampling;

/// A request as the front door serves it, whatever API it came in on.
#[derive(Debug, PartialEq)]
pub struct Request {
    /// The model the client asked for (none: whichever this server serves).
    pub model: Option<String>,
    pub input: Input,
    pub asked: Asked,
}

/// What the decoder reads.
#[derive(Debug, PartialEq)]
pub enum Input {
    /// A conversation through the chat template, with the tools the model may call.
    Chat { messages: Vec<Message>, tools: Option<Vec<Tool>> },
    /// The legacy completions' prompt, continued as it is.
    Text(String),
}

/// What a request asks of its answers: how the adapter samples each (`engine.proto`'s
/// `Sampling`, declared once for both languages), how many there are, streamed or whole.
#[derive(Debug, PartialEq)]
pub struct Asked {
    /// As the client asked: `max_tokens` unset means as many as the context leaves, up to the
    /// configured default; `stop`, up to 4 sequences that end the answer, never part of it;
    /// `logprobs`, the alternatives per token.
    pub sampling: Sampling,
    pub stream: bool,
    /// Answers to generate for the prompt (`n`), one after another from the same restored cache.
    pub n: u32,
    /// OpenAI's `stream_options.include_usage`: a last chunk with `choices: []` and the usage.
    pub include_usage: bool,
}

impl Asked {
    /// One answer, sampled as `sampling` says; streamed when `stream`.
    pub fn one(sampling: Sampling, stream: Option<bool>) -> Asked {
        Asked { sampling, stream: stream.unwrap_or(false), n: 1, include_usage: false }
    }
}

/// The adapter's sampling as asked: `temperature` and `top_p` 1 unless set, the rest as each API
/// spells it.
pub fn sampling(temperature: Option<f64>, top_p: Option<f64>, max_tokens: Option<u32>, stop: Vec<String>) -> Sampling {
    Sampling {
        max_tokens,
        temperature: temperature.unwrap_or(1.0),
        top_p: Some(top_p.unwrap_or(1.0)),
        stop,
        ..Sampling::default()
    }
}

/// Roles the chat templates know.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// A chat message as chat templates take it: its content as text.
#[derive(Debug, PartialEq, Serialize)]
pub struct Message {
    pub role: Role,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Call>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl Message {
    pub fn new(role: Role, content: impl Into<String>) -> Message {
        Message { role, content: content.into(), name: None, tool_calls: None, tool_call_id: None }
    }

    /// An assistant turn that called tools (its text, if any, before the calls).
    pub fn calling(content: impl Into<String>, calls: Vec<Call>) -> Message {
        Message { tool_calls: Some(calls), ..Message::new(Role::Assistant, content) }
    }

    /// A tool's output for call `id`.
    pub fn tool_output(id: String, output: String) -> Message {
        Message { tool_call_id: Some(id), ..Message::new(Role::Tool, output) }
    }
}

/// The one kind of tool this server offers and calls.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Function {
    #[default]
    Function,
}

/// A tool call in a conversation, as chat templates render it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Call {
    pub id: String,
    #[serde(rename = "type", default)]
    pub kind: Function,
    pub function: Called,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Called {
    pub name: String,
    /// JSON text, as the model wrote it.
    pub arguments: String,
}

impl Call {
    pub fn new(id: String, name: String, arguments: String) -> Call {
        Call { id, kind: Function::Function, function: Called { name, arguments } }
    }
}

/// A function the model may call, as chat templates render it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Tool {
    #[serde(rename = "type")]
    pub kind: Function,
    pub function: FunctionSpec,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FunctionSpec {
    #[serde(deserialize_with = "name")]
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The arguments' JSON schema, which no API types.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// A tool as the Responses and Messages APIs send it: flat, its arguments' schema under
/// `parameters` (Anthropic's `input_schema`).
#[derive(Deserialize)]
pub struct FlatTool {
    #[serde(rename = "type")]
    kind: Option<String>,
    name: Option<String>,
    description: Option<String>,
    #[serde(alias = "input_schema")]
    parameters: Option<serde_json::Value>,
    strict: Option<bool>,
}

/// Flat tools as chat's function tools: each of a type `is_function` accepts; another is refused,
/// `offered` naming the kind supported.
pub fn function_tools(
    tools: Vec<FlatTool>,
    is_function: impl Fn(Option<&str>) -> bool,
    offered: &str,
) -> Result<Vec<Tool>, InvalidRequest> {
    let function = |(i, tool): (usize, FlatTool)| {
        if !is_function(tool.kind.as_deref()) {
            return Err(invalid(format!("`tools[{i}]` is a {:?} tool; only {offered} are supported", tool.kind)));
        }
        let name = tool.name.filter(|n| !n.is_empty());
        let name = name.ok_or_else(|| invalid(format!("`tools[{i}].name` must be a non-empty string")))?;
        let FlatTool { description, parameters, strict, .. } = tool;
        Ok(Tool { kind: Function::Function, function: FunctionSpec { name, description, parameters, strict } })
    };
    tools.into_iter().enumerate().map(function).collect()
}

/// Whether the model may call the tools offered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// When it decides to (every API's default).
    Auto,
    /// Never: the tools are not offered.
    None,
    /// A call forced (any call, or a named one).
    Forced,
}

/// The tools offered to the model: none when the client says `none` or lists none. Forcing a call
/// is refused: mlx-lm cannot constrain generation to one.
pub fn offered(tools: Option<Vec<Tool>>, choice: Option<ToolChoice>) -> Result<Option<Vec<Tool>>, InvalidRequest> {
    match choice.unwrap_or(ToolChoice::Auto) {
        ToolChoice::Auto => Ok(tools.filter(|t| !t.is_empty())),
        ToolChoice::None => Ok(None),
        ToolChoice::Forced => {
            Err(invalid("`tool_choice` must be \"auto\" or \"none\": this server cannot force a tool call"))
        }
    }
}

/// Content sent as a string or as a list of parts.
#[derive(Debug)]
pub enum Content<P> {
    Text(String),
    Parts(Vec<P>),
}

impl<'de, P: Deserialize<'de>> Deserialize<'de> for Content<P> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor<P>(std::marker::PhantomData<P>);
        impl<'de, P: Deserialize<'de>> de::Visitor<'de> for Visitor<P> {
            type Value = Content<P>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string or a list")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Content<P>, E> {
                Ok(Content::Text(text.to_owned()))
            }

            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<Content<P>, A::Error> {
                let mut parts = Vec::new();
                while let Some(part) = seq.next_element()? {
                    parts.push(part);
                }
                Ok(Content::Parts(parts))
            }
        }
        d.deserialize_any(Visitor(std::marker::PhantomData))
    }
}

/// A part of list-form content: its type, and its text when it is a text part.
#[derive(Debug, Deserialize)]
#[serde(expecting = "a content part")]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

impl Content<Part> {
    /// The text of the content: a string, or the concatenated text of its parts of the given
    /// types (any other part is refused by name, as is a text part without text).
    pub fn text(self, at: &str, text_types: &[&str]) -> Result<String, InvalidRequest> {
        let parts = match self {
            Content::Text(text) => return Ok(text),
            Content::Parts(parts) => parts,
        };
        let mut text = String::new();
        for (i, part) in parts.into_iter().enumerate() {
            if !text_types.contains(&part.kind.as_str()) {
                return Err(invalid(format!("`{at}[{i}]` is a {:?} part; only text parts are supported", part.kind)));
            }
            let piece = part.text.ok_or_else(|| invalid(format!("`{at}[{i}].text` must be a string")))?;
            text.push_str(&piece);
        }
        Ok(text)
    }
}

// ---------------------------------------------------------------------------
// Fields checked as they are read (`deserialize_with`): a value of another type, or out of
// range, is refused as "must be …", which the parse error names with the field's path.
// ---------------------------------------------------------------------------

/// `T`, kept when `ok`; `null` is absent.
pub fn checked<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    ok: impl FnOnce(&T) -> bool,
    what: &str,
) -> Result<Option<T>, D::Error> {
    match Option::<T>::deserialize(d) {
        Ok(Some(value)) if !ok(&value) => Err(de::Error::custom(format!("must be {what}"))),
        Ok(value) => Ok(value),
        Err(_) => Err(de::Error::custom(format!("must be {what}"))),
    }
}

pub fn boolean<'de, D: Deserializer<'de>>(d: D) -> Result<Option<bool>, D::Error> {
    checked(d, |_: &bool| true, "a boolean")
}

pub fn positive_u32<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u32>, D::Error> {
    let ok = |n: &u64| *n > 0 && u32::try_from(*n).is_ok();
    Ok(checked(d, ok, "a positive integer below 2^32")?.map(|n| n as u32))
}

pub fn temperature<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    checked(d, |t: &f64| (0.0..=2.0).contains(t), "between 0 and 2")
}

pub fn top_p<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    checked(d, |p: &f64| *p > 0.0 && *p <= 1.0, "in (0, 1]")
}

fn name<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    checked(d, |n: &String| !n.is_empty(), "a non-empty string")?
        .ok_or_else(|| de::Error::custom("must be a non-empty string"))
}

/// Stop sequences: one, or a list of up to 4; none empty.
pub fn stop<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Stop {
        One(String),
        Many(Vec<String>),
    }
    let ok = |stop: &Stop| match stop {
        Stop::One(one) => !one.is_empty(),
        Stop::Many(many) => many.len() <= 4 && many.iter().all(|s| !s.is_empty()),
    };
    Ok(match checked(d, ok, "a non-empty string or a list of up to 4 of them")? {
        None => Vec::new(),
        Some(Stop::One(one)) => vec![one],
        Some(Stop::Many(many)) => many,
    })
}

/// A chat's messages and tools as the chat template gets them (JSON), for the APIs' tests.
#[cfg(test)]
pub fn as_template_sees(input: Input) -> (serde_json::Value, serde_json::Value) {
    let Input::Chat { messages, tools } = input else { panic!("a chat, not {input:?}") };
    (serde_json::to_value(messages).unwrap(), serde_json::to_value(tools).unwrap())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_chat_message_serializes_as_chat_templates_take_it() {
        let call = Call::new("c1".into(), "f".into(), "{}".into());
        let messages = [
            Message::new(Role::User, "hi"),
            Message::calling("", vec![call]),
            Message::tool_output("c1".into(), "ok".into()),
        ];
        assert_eq!(
            serde_json::to_value(messages).unwrap(),
            json!([
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "ok", "tool_call_id": "c1"},
            ])
        );
    }

    #[test]
    fn forcing_a_call_is_refused_and_none_offers_nothing() {
        let tool: Tool = serde_json::from_value(json!({"type": "function", "function": {"name": "f"}})).unwrap();
        assert_eq!(offered(Some(vec![tool.clone()]), None).unwrap(), Some(vec![tool.clone()]));
        assert_eq!(offered(Some(vec![tool.clone()]), Some(ToolChoice::None)).unwrap(), None);
        assert_eq!(offered(Some(Vec::new()), Some(ToolChoice::Auto)).unwrap(), None);
        assert!(offered(Some(vec![tool]), Some(ToolChoice::Forced)).unwrap_err().0.contains("cannot force"));
    }
}
