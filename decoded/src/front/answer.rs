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

use axum::response::{IntoResponse, Response, Sse, sse::Event};
use opentelemetry::KeyValue;
use pdbridge_common::traces::PastSpan;
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
    api::{
        Api,
        answer::{Choice, Event as Told, Finish, Names, Render, SseEvent, Usage, Whole},
        chat::{Asked, Tool},
        error::FrontError,
    },
    engine::{Engine, EngineError, GenerateEvent, GenerateRequest, GenerateSummary, Generation, Logprob, ToolCall},
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
    pub asked: Asked,
    pub tools: Option<Vec<Tool>>,
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
            tools: self.tools.as_deref(),
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
    logprob: Option<Logprob>,
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
    /// Headers now, with the verdict as planned; the events, told in the request's API, follow from a task that holds the lease and the admission until the last one, within the
    /// request's deadline.
    pub fn stream(mut self, names: Names, admitted: Admitted) -> Response {
        let (tx, rx) = mpsc::channel::<Event>(16);
        let events = tokio_stream::StreamExt::map(tokio_stream::wrappers::ReceiverStream::new(rx), Ok::<_, Infallible>);
        let mut response = Sse::new(events).into_response();
        verdict::set(&mut response, &self.verdict);
        tokio::spawn(
            async move {
                let Admitted { permit: _permit, deadline } = admitted;
                let render = self.api.renderer(names, self.choices.asked.include_usage);
                let mut sink = Streamed { tx, render, completion_tokens: 0, usage: None };
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
    pub async fn collect(mut self, names: Names) -> Result<Response, FrontError> {
        let mut sink = Collected { logprobs: self.choices.asked.sampling.logprobs.is_some(), ..Collected::default() };
        self.run(&mut sink).await?;
        drop(self.lease);
        self.verdict.timings_ms.insert("total".into(), ms(self.started));
        sink.respond(self.api, names, self.verdict)
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

/// Server-sent events: each event of the answers as the request's API tells it, as it comes (the
/// headers left before the first).
struct Streamed {
    tx: mpsc::Sender<Event>,
    render: Box<dyn Render>,
    /// Over every answer, for the usage.
    completion_tokens: u32,
    /// Once the last answer is whole: what the request counted, told before the stream ends.
    usage: Option<Usage>,
}

impl Streamed {
    async fn send(&mut self, event: Told<'_>) -> Result<(), Cut> {
        for event in self.render.render(event) {
            self.tx.send(sse(event)).await.map_err(|_| Cut::Left)?;
        }
        Ok(())
    }

    /// The usage and the end after the last answer; after a failure its error.
    async fn end(mut self, answered: Result<(), Cut>) {
        let _ = match answered {
            Ok(()) => {
                if let Some(usage) = self.usage.take()
                    && self.send(Told::Usage(usage)).await.is_err()
                {
                    return;
                }
                self.send(Told::End).await
            }
            Err(Cut::Left) => return,
            Err(e) => self.send(Told::Error(&e.to_string())).await,
        };
    }
}

impl Sink for Streamed {
    async fn token(&mut self, index: u32, Piece { text, logprob, tool_calls }: Piece) -> Result<(), Cut> {
        self.send(Told::Token { index, text: &text, logprob: logprob.as_ref(), tool_calls: &tool_calls }).await
    }

    async fn done(&mut self, index: u32, summary: GenerateSummary, last: bool) -> Result<(), Cut> {
        self.completion_tokens += summary.completion_tokens;
        if last {
            self.usage = Some(usage(&summary, self.completion_tokens));
        }
        self.send(Told::Done {
            index,
            text: &summary.text,
            tool_calls: &summary.tool_calls,
            finish: Finish { reason: &summary.finish_reason, stop_sequence: &summary.stop_sequence },
            engine_timings_ms: last.then_some(&summary.timings_ms),
        })
        .await
    }
}

/// What a request counted: the first answer's prompt, the tokens of all its answers.
fn usage(first: &GenerateSummary, completion_tokens: u32) -> Usage {
    Usage { prompt: first.prompt_tokens, cached: first.cached_tokens, completion: completion_tokens }
}

fn sse(event: SseEvent) -> Event {
    let sse = Event::default().data(event.data);
    match event.name {
        Some(name) => sse.event(name),
        None => sse,
    }
}

/// One body with every answer: the answers collected, then sent whole.
#[derive(Default)]
struct Collected {
    logprobs: bool,
    /// The current answer so far.
    text: String,
    entries: Vec<Logprob>,
    calls: Vec<ToolCall>,
    choices: Vec<Choice>,
    /// The first answer's, for the usage and the engine's stages.
    first: Option<GenerateSummary>,
    completion_tokens: u32,
}

impl Collected {
    fn respond(self, api: Api, names: Names, mut verdict: Verdict) -> Result<Response, FrontError> {
        let first = self.first.ok_or_else(|| FrontError::Engine("no answer was generated".into()))?;
        for (stage, value) in &first.timings_ms {
            verdict.timings_ms.insert(format!("engine_{stage}"), *value);
        }
        let whole = Whole { names, choices: self.choices, usage: usage(&first, self.completion_tokens) };
        let mut response = api.whole(&whole);
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
        let mut tool_calls = std::mem::take(&mut self.calls);
        tool_calls.extend(summary.tool_calls.iter().cloned());
        let entries = std::mem::take(&mut self.entries);
        self.choices.push(Choice {
            index,
            text,
            tool_calls,
            finish_reason: summary.finish_reason.clone(),
            stop_sequence: summary.stop_sequence.clone(),
            logprobs: self.logprobs.then_some(entries),
        });
        self.completion_tokens += summary.completion_tokens;
        self.first.get_or_insert(summary);
        Ok(())
    }
}
