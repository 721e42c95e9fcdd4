//! A request's answers once its first generation has started: one event loop
//! ([`Answers::run`]) feeding one of two sinks, server-sent events ([`Streamed`]) or one JSON
//! completion ([`Collected`]), so both check what the engine restored and count the request's
//! metrics in the same place.

use std::{
    convert::Infallible,
    path::PathBuf,
    sync::Arc,
    time::{Duration, SystemTime},
};

use axum::{
    Json,
    response::{IntoResponse, Response, Sse, sse::Event},
};
use opentelemetry::KeyValue;
use pdbridge_common::traces::PastSpan;
use serde_json::{Value, json};
use tokio::{sync::mpsc, time::Instant};
use tracing::{Instrument, Span};

use super::{
    Admitted,
    costs::{Costs, EngineSample},
    ms,
    plan::Prompt,
    verdict::{self, Verdict, record_outcome, record_stages, record_ttft},
};
use crate::{
    api::{self, Api, error::FrontError, openai},
    engine::{Engine, EngineError, GenerateEvent, GenerateRequest, GenerateSummary, Generation, ToolCall},
    store::{Lease, Tail},
};

/// What each answer of a request generates from, owned, so a streamed answer's task can start
/// one after another (`n` > 1).
pub struct Choices {
    pub engine: Engine,
    pub prompt: Prompt,
    /// The leased store blocks the engine restores.
    pub blocks: Vec<PathBuf>,
    /// Held (its file kept) until the last answer has started.
    pub tail: Option<Tail>,
    /// Its sampling's `max_tokens` fit to the context.
    pub asked: openai::Asked,
    pub tools: Option<Value>,
}

impl Choices {
    /// The adapter's request for answer `index`; sampled answers differ by seed (`seed + index`).
    fn request(&self, index: u32) -> GenerateRequest<'_> {
        let mut sampling = self.asked.sampling.clone();
        sampling.seed = sampling.seed.map(|seed| seed + u64::from(index));
        GenerateRequest {
            tokens: &self.prompt.tokens,
            blocks: &self.blocks,
            tail: self.tail.as_ref().map(Tail::path),
            spec_fingerprint: &self.prompt.spec_fingerprint,
            sampling,
            tools: self.tools.as_ref(),
        }
    }

    /// Answer `index`, once the adapter has restored its cache and prefilled the rest of the
    /// prompt (an unusable block fails here, while the request can still be served another way).
    pub async fn start(&self, index: u32) -> Result<Generation, EngineError> {
        let mut generation = self.engine.generate(self.request(index)).await?;
        generation.started().await?;
        Ok(generation)
    }
}

/// What names a completion.
pub struct Names {
    id: String,
    created: u64,
    model: String,
}

impl Names {
    pub fn new(model: String) -> Names {
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_secs();
        Names { id: pdbridge_common::request_id::new("chatcmpl"), created, model }
    }

    fn ids(&self) -> (&str, u64, &str) {
        (&self.id, self.created, &self.model)
    }
}

/// A request's answers, the first already started.
pub struct Answers {
    pub api: Api,
    /// When the request came in.
    pub started: Instant,
    pub verdict: Verdict,
    pub choices: Choices,
    /// Held until the last answer ends: the adapter reads the block files on its own schedule.
    pub lease: Lease,
    /// The first answer, started while the request was planned.
    pub first: Option<Generation>,
    /// Taught by the first answer's engine timings.
    pub costs: Arc<Costs>,
}

/// Why a request's answers ended before the last one did.
#[derive(Debug, thiserror::Error)]
enum Cut {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Front(#[from] FrontError),
    /// A streamed answer's client went away: nobody is left to tell.
    #[error("the client left")]
    Left,
}

impl From<Cut> for FrontError {
    fn from(cut: Cut) -> FrontError {
        match cut {
            Cut::Engine(e) => e.into(),
            Cut::Front(e) => e,
            Cut::Left => FrontError::Engine(cut.to_string()),
        }
    }
}

/// A piece of an answer: a token's text (empty when it completed tool calls instead), its log
/// probability when asked for, and the calls it completed.
struct Piece {
    text: String,
    logprob: Option<Value>,
    tool_calls: Vec<ToolCall>,
}

/// Where the event loop puts the answers.
trait Sink {
    /// A piece of answer `index`, as it comes.
    async fn token(&mut self, index: u32, piece: Piece) -> Result<(), Cut>;
    /// Answer `index` is whole; `last`: it is the request's last.
    async fn done(&mut self, index: u32, summary: GenerateSummary, last: bool) -> Result<(), Cut>;
}

impl Answers {
    /// Headers now, with the verdict as planned; the events (chat chunks, or told in the request's
    /// API) follow from a task that holds the lease and the admission until the last one, within the
    /// request's deadline.
    pub fn stream(mut self, names: Names, admitted: Admitted) -> Response {
        let (tx, rx) = mpsc::channel::<Event>(16);
        let events = tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok::<_, Infallible>);
        let mut response = Sse::new(events).into_response();
        verdict::set(&mut response, &self.verdict);
        tokio::spawn(
            async move {
                let Admitted { permit: _permit, deadline } = admitted;
                let include_usage = self.choices.asked.include_usage;
                let mut sink = Streamed {
                    tx,
                    api: self.api,
                    names,
                    calls_sent: 0,
                    completion_tokens: 0,
                    usage: None,
                    include_usage,
                    told: self.api.stream(),
                };
                let answered = tokio::time::timeout_at(deadline, self.run(&mut sink)).await.unwrap_or_else(|_| {
                    // Worded as the deadline's error event always was.
                    Err(EngineError::Internal("front.request_timeout passed".into()).into())
                });
                sink.end(answered).await;
            }
            .instrument(Span::current()),
        );
        response
    }

    /// One completion with every answer (in the request's API); the verdict, final, in its header.
    pub async fn collect(mut self, names: &Names) -> Result<Response, FrontError> {
        let mut sink = Collected::new(self.api, self.choices.asked.sampling.logprobs.is_some());
        self.run(&mut sink).await?;
        drop(self.lease);
        self.verdict.timings_ms.insert("total".into(), ms(self.started));
        sink.respond(names, self.verdict)
    }

    /// The event loop: every answer in turn, each event into `sink`. What the engine restored is
    /// checked and the request counted here, the same for both sinks.
    async fn run(&mut self, sink: &mut impl Sink) -> Result<(), Cut> {
        let n = self.choices.asked.n;
        let mut first_summary = None;
        for index in 0..n {
            let mut generation = match self.first.take() {
                Some(started) => started,
                None => self.choices.start(index).await?,
            };
            let summary = self.events(index, &mut generation, sink).await?;
            trace_engine(generation.sent_at, &summary, index);
            check_restored(&self.verdict, &summary)?;
            let first_summary = first_summary.get_or_insert_with(|| summary.clone());
            let last = index + 1 == n;
            if last {
                // Before the last event leaves: a client gone by then was answered all the same.
                record_outcome(&self.verdict);
                record_stages(&self.verdict, first_summary);
                if let Some(sample) = EngineSample::of(first_summary) {
                    self.costs.learn_engine(&sample);
                }
            }
            sink.done(index, summary, last).await?;
        }
        Ok(())
    }

    /// Answer `index`'s tokens into `sink`, up to its summary.
    async fn events(
        &mut self,
        index: u32,
        generation: &mut Generation,
        sink: &mut impl Sink,
    ) -> Result<GenerateSummary, Cut> {
        loop {
            match generation.next().await {
                Some(Ok(GenerateEvent::Token { text, logprob, tool_calls, .. })) => {
                    if !self.verdict.timings_ms.contains_key("first_token") {
                        record_ttft(&self.verdict, self.started);
                        self.verdict.timings_ms.insert("first_token".into(), ms(self.started));
                    }
                    sink.token(index, Piece { text, logprob, tool_calls }).await?;
                }
                Some(Ok(GenerateEvent::Done(summary))) => return Ok(summary),
                Some(Err(e)) => return Err(e.into()),
                None => return Err(FrontError::Engine("generation ended without a summary".into()).into()),
            }
        }
    }
}

/// Answer `index`'s stages in the decode engine as spans under the request's, placed from when it
/// was sent by the times the adapter measured from its arrival: queued, restoring the blocks and
/// the tail, computing the rest of the prompt (to the first token), decoding.
fn trace_engine(sent_at: SystemTime, summary: &GenerateSummary, index: u32) {
    let at =
        |stage: &str| summary.timings_ms.get(stage).map(|&ms| sent_at + Duration::from_secs_f64(ms.max(0.0) / 1e3));
    let (Some(admitted), Some(first_token), Some(end)) = (at("queue"), at("first_token"), at("total")) else {
        return;
    };
    let restored = admitted + Duration::from_secs_f64(summary.timings_ms.get("restore").copied().unwrap_or(0.0) / 1e3);
    let attributes = vec![
        KeyValue::new("pdbridge.answer", i64::from(index)),
        KeyValue::new("pdbridge.cached_tokens", i64::from(summary.cached_tokens)),
        KeyValue::new("pdbridge.completion_tokens", i64::from(summary.completion_tokens)),
    ];
    let generate = PastSpan::under(&Span::current(), "engine.generate", sent_at, attributes);
    generate.child("engine.queue", sent_at, admitted);
    generate.child("engine.restore", admitted, restored);
    generate.child("engine.tail", restored, first_token);
    generate.event("first_token", first_token);
    generate.child("engine.decode", first_token, end);
    generate.end(end);
}

/// The engine must have restored exactly the tokens the verdict claims.
fn check_restored(verdict: &Verdict, summary: &GenerateSummary) -> Result<(), FrontError> {
    if summary.cached_tokens != verdict.cached_tokens {
        return Err(FrontError::Engine(format!(
            "engine restored {} tokens, the verdict says {}",
            summary.cached_tokens, verdict.cached_tokens
        )));
    }
    Ok(())
}

/// Server-sent events: a chunk per token as it comes (the headers left before the first).
struct Streamed {
    tx: mpsc::Sender<Event>,
    api: Api,
    names: Names,
    /// The current answer's tool calls so far: a delta's calls are numbered within its choice.
    calls_sent: usize,
    /// Over every answer, for the usage chunk.
    completion_tokens: u32,
    /// `stream_options.include_usage`: the usage, once the last answer is whole, for the chunk
    /// that ends the stream.
    usage: Option<Value>,
    include_usage: bool,
    /// Another API's events for the chunks; none: the chunks as they are.
    told: Option<Box<dyn api::Stream>>,
}

impl Streamed {
    /// A chat chunk, or the events it makes in the request's API.
    async fn send(&mut self, chunk: &Value) -> Result<(), Cut> {
        let events = match self.told.as_mut() {
            Some(told) => told.chunk(chunk).into_iter().map(sse).collect(),
            None => vec![Event::default().data(chunk.to_string())],
        };
        self.send_events(events).await
    }

    async fn send_events(&self, events: Vec<Event>) -> Result<(), Cut> {
        for event in events {
            self.tx.send(event).await.map_err(|_| Cut::Left)?;
        }
        Ok(())
    }

    /// The usage chunk (when asked for) and `[DONE]` after the last answer (or the API's
    /// last events); after a failure its error, and no `[DONE]`.
    async fn end(mut self, answered: Result<(), Cut>) {
        let last = match answered {
            Ok(()) => {
                if let Some(usage) = self.usage.clone().filter(|_| self.include_usage)
                    && self.send(&openai::usage_chunk(self.api, self.names.ids(), usage)).await.is_err()
                {
                    return;
                }
                match self.told.as_mut() {
                    Some(told) => told.end().into_iter().map(sse).collect(),
                    None => vec![Event::default().data("[DONE]")],
                }
            }
            Err(Cut::Left) => return,
            Err(e) => match self.told.as_mut() {
                Some(told) => told.error(&e.to_string()).into_iter().map(sse).collect(),
                None => vec![Event::default().data(stream_error(e).to_string())],
            },
        };
        let _ = self.send_events(last).await;
    }
}

impl Sink for Streamed {
    async fn token(&mut self, index: u32, Piece { text, logprob, tool_calls }: Piece) -> Result<(), Cut> {
        let text = Some(text.as_str()).filter(|t| !t.is_empty() || tool_calls.is_empty());
        let mut chunk = openai::chunk(self.api, self.names.ids(), index, text, None);
        if !tool_calls.is_empty() {
            openai::add_tool_calls(&mut chunk, &tool_calls, self.calls_sent);
            self.calls_sent += tool_calls.len();
        }
        if let Some(entry) = logprob {
            chunk["choices"][0]["logprobs"] = openai::logprobs(self.api, &[entry]);
        }
        self.send(&chunk).await
    }

    async fn done(&mut self, index: u32, summary: GenerateSummary, last: bool) -> Result<(), Cut> {
        self.completion_tokens += summary.completion_tokens;
        // Text the adapter held back to the end (a partial character, a possible stop sequence
        // that never completed) ends the answer.
        let held = Some(summary.text.as_str()).filter(|t| !t.is_empty());
        let mut chunk = openai::chunk(self.api, self.names.ids(), index, held, Some(&summary.finish_reason));
        openai::add_stop_reason(&mut chunk["choices"][0], &summary.stop_sequence);
        if !summary.tool_calls.is_empty() {
            openai::add_tool_calls(&mut chunk, &summary.tool_calls, self.calls_sent);
        }
        self.calls_sent = 0;
        if last {
            self.usage = Some(openai::usage(summary.prompt_tokens, self.completion_tokens, summary.cached_tokens));
            // The header left before the engine ran: its stages ride here.
            chunk["pd_bridge"] = json!({"engine_timings_ms": summary.timings_ms});
        }
        self.send(&chunk).await
    }
}

/// Another API's event as a server-sent event.
fn sse(event: api::SseEvent) -> Event {
    Event::default().event(event.name).data(event.data.to_string())
}

/// An error event ending a streamed answer (its headers have already left).
fn stream_error(e: impl std::fmt::Display) -> Value {
    json!({"error": {"message": e.to_string(), "type": "engine_error"}})
}

/// One JSON completion: the answers collected, then sent whole.
struct Collected {
    api: Api,
    logprobs: bool,
    /// The current answer so far.
    text: String,
    entries: Vec<Value>,
    calls: Vec<ToolCall>,
    choices: Vec<Value>,
    /// The first answer's, for the usage and the engine's stages.
    first: Option<GenerateSummary>,
    completion_tokens: u32,
}

impl Collected {
    fn new(api: Api, logprobs: bool) -> Collected {
        Collected {
            api,
            logprobs,
            text: String::new(),
            entries: Vec::new(),
            calls: Vec::new(),
            choices: Vec::new(),
            first: None,
            completion_tokens: 0,
        }
    }

    fn respond(self, names: &Names, mut verdict: Verdict) -> Result<Response, FrontError> {
        let first = self.first.ok_or_else(|| FrontError::Engine("no answer was generated".into()))?;
        for (stage, value) in &first.timings_ms {
            verdict.timings_ms.insert(format!("engine_{stage}"), *value);
        }
        let mut body = openai::completion(self.api, &names.id, names.created, &names.model, self.choices);
        body["usage"] = openai::usage(first.prompt_tokens, self.completion_tokens, first.cached_tokens);
        let mut response = Json(self.api.whole(body)).into_response();
        verdict::set(&mut response, &verdict);
        Ok(response)
    }
}

impl Sink for Collected {
    async fn token(&mut self, _index: u32, piece: Piece) -> Result<(), Cut> {
        self.text.push_str(&piece.text);
        self.entries.extend(piece.logprob);
        self.calls.extend(piece.tool_calls);
        Ok(())
    }

    async fn done(&mut self, index: u32, summary: GenerateSummary, _last: bool) -> Result<(), Cut> {
        let mut text = std::mem::take(&mut self.text);
        text.push_str(&summary.text);
        let mut calls = std::mem::take(&mut self.calls);
        calls.extend(summary.tool_calls.iter().cloned());
        let entries = std::mem::take(&mut self.entries);
        let logprobs = self.logprobs.then(|| openai::logprobs(self.api, &entries));
        let mut choice = openai::choice(self.api, index, &text, &summary.finish_reason, logprobs, &calls);
        openai::add_stop_reason(&mut choice, &summary.stop_sequence);
        self.choices.push(choice);
        self.completion_tokens += summary.completion_tokens;
        self.first.get_or_insert(summary);
        Ok(())
    }
}
