//! The front door's APIs, each parsed and answered in its own wire format: OpenAI's chat and
//! legacy completions ([`openai`]), OpenAI's Responses API ([`responses`]) and Anthropic's Messages
//! API ([`messages`]), their errors ([`error`]) and API keys ([`auth`]).
//!
//! Parse once, then serve: each API's request is read into its own typed request and becomes the
//! one typed [`chat::Request`]; the front door (`crate::front`, which decides how to serve) says
//! what the engine generated as typed events ([`answer`]), and the API renders them. So every API
//! takes the same engine path, verdict header and admission, and no API's JSON reaches the front
//! door.

pub mod answer;
pub mod auth;
pub mod chat;
pub mod error;
pub mod messages;
pub mod openai;
pub mod responses;

use axum::{
    Json,
    response::{IntoResponse, Response},
};
use serde::de::DeserializeOwned;

use answer::{Names, Render, Whole};
use error::FrontError;

/// The API a request came in on: its path, the shape of its answers and of its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// OpenAI's `/v1/chat/completions`.
    Chat,
    /// OpenAI's legacy `/v1/completions`: a prompt, answered as text choices.
    Completions,
    /// OpenAI's `/v1/responses`.
    Responses,
    /// Anthropic's `/v1/messages` (and its `count_tokens`).
    Messages,
}

impl Api {
    /// Where the API is served (a forwarded request goes to the same path on a peer).
    pub fn path(self) -> &'static str {
        match self {
            Api::Chat => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Responses => "/v1/responses",
            Api::Messages => "/v1/messages",
        }
    }

    /// The API whose shape a request to `path` is answered in: Anthropic's under `/v1/messages`,
    /// OpenAI's chat everywhere else (the front door's other routes speak OpenAI's errors).
    pub fn at(path: &str) -> Api {
        match path.starts_with(Api::Messages.path()) {
            true => Api::Messages,
            false => Api::Chat,
        }
    }

    /// The request `body`, a request of this API, asks for: parsed once, every field checked.
    pub fn parse(self, body: &[u8]) -> Result<chat::Request, InvalidRequest> {
        match self {
            Api::Chat | Api::Completions => openai::parse(self, body),
            Api::Responses => responses::parse(body),
            Api::Messages => messages::parse(body),
        }
    }

    /// The renderer of a streamed answer in this API.
    pub fn renderer(self, names: Names, include_usage: bool) -> Box<dyn Render> {
        match self {
            Api::Chat | Api::Completions => Box::new(openai::Chunks::new(self, names, include_usage)),
            Api::Responses => Box::new(responses::Events::new(names)),
            Api::Messages => Box::new(messages::Events::new(names)),
        }
    }

    /// The whole answers as this API answers them.
    pub fn whole(self, whole: &Whole) -> Response {
        let body = match self {
            Api::Chat | Api::Completions => openai::whole(self, whole),
            Api::Responses => responses::whole(whole),
            Api::Messages => messages::whole(whole),
        };
        Json(body).into_response()
    }

    /// A handler's answer, its error told in this API's shape and status.
    pub fn respond(self, answer: Result<Response, FrontError>) -> Response {
        answer.unwrap_or_else(|e| match self {
            Api::Messages => e.into_anthropic_response(),
            Api::Chat | Api::Completions | Api::Responses => e.into_response(),
        })
    }
}

/// A request the front door refuses; the message names the field.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("{0}")]
pub struct InvalidRequest(pub String);

fn invalid(message: impl Into<String>) -> InvalidRequest {
    InvalidRequest(message.into())
}

/// `body` as `T`; what does not parse is refused naming the field by its path (`messages[0].role`)
/// and what it must be.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, InvalidRequest> {
    let mut json = serde_json::Deserializer::from_slice(body);
    let parsed = serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let (path, inner) = (e.path().to_string(), e.inner());
        if !inner.is_data() || path == "." {
            return InvalidRequest(format!("request body: {inner}"));
        }
        // serde_json says where in the text; the field's path says it better.
        let inner = inner.to_string();
        let message = inner.rsplit_once(" at line ").map_or(inner.as_str(), |(message, _)| message);
        InvalidRequest(match message.starts_with("must ") {
            true => format!("`{path}` {message}"),
            false => format!("`{path}`: {message}"),
        })
    })?;
    json.end().map_err(|e| InvalidRequest(format!("request body: {e}")))?;
    Ok(parsed)
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    struct Sent {
        #[allow(dead_code)]
        messages: Vec<chat::Part>,
        #[serde(default, deserialize_with = "chat::temperature")]
        #[allow(dead_code)]
        temperature: Option<f64>,
    }

    #[test]
    fn what_does_not_parse_is_named_by_its_path() {
        for (body, want) in [
            (r#"{"messages": [{"text": "hi"}]}"#, "`messages[0]`: missing field `type`"),
            (r#"{"messages": [], "temperature": 3}"#, "`temperature` must be between 0 and 2"),
            (r#"{"messages": [], "temperature": "hot"}"#, "`temperature` must be between 0 and 2"),
            (r#"{"messages": "#, "request body: EOF while parsing a value at line 1 column 13"),
            (r#"{"messages": []} {}"#, "request body: trailing characters at line 1 column 18"),
            ("7", "request body: invalid type: integer `7`, expected struct Sent at line 1 column 1"),
        ] {
            assert_eq!(parse::<Sent>(body.as_bytes()).unwrap_err().0, want, "{body}");
        }
        assert!(parse::<Sent>(br#"{"messages": [], "temperature": null, "user": "u"}"#).is_ok());
    }
}
