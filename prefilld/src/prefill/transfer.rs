//! One transfer in flight: the Push streams, vLLM's request and the plugin's blocks relayed
//! between them, and [`settle`], which decides the outcome.

use std::{collections::BTreeMap, time::Duration};

use pdbridge_common::{
    metric,
    proto::{
        self, Outcome, PrefillEvent, Progress, PushFrame, PushOpen, PushReceipt, PushSeal, Route,
        outcome::Status as OutcomeStatus, prefill_event::Event, push_frame::Frame,
    },
    reason::Reason,
    traces,
};
use tokio::{
    sync::mpsc,
    task::{JoinError, JoinHandle},
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{Instrument, Span};

use crate::{
    capture::{End, Part, PluginEvent, Stage, Stages},
    engine::EngineError,
    handshake::Decoder,
};

use super::{Bridge, END_EVENT_GRACE, Failure, Job, STALLED, fail, plan::Plan, plugin_error, plugin_failed};

/// One transfer in flight: its Push streams, vLLM's request, and what has
/// gone on the wire so far. Each step is a method; [`settle`] decides the
/// outcome.
pub(super) struct Transfer<'a> {
    bridge: &'a Bridge,
    decoder: &'a Decoder,
    plan: Plan,
    stripes: Stripes,
    /// vLLM's answer, which comes once the whole prompt is prefilled.
    prefill: JoinHandle<Result<(), EngineError>>,
    /// Holds each block's parts (and the end) until every pipeline stage's has arrived.
    stages: Stages,
    deadline: Instant,
    sent: Sent,
    started: Instant,
    /// When vLLM answered: from then only the plugin's end event is owed.
    prefilled_at: Option<Instant>,
    /// The plugin's last frame since vLLM answered (or the answer itself): a plugin still sending
    /// blocks (a slow link, a busy reconstruction) is not waiting on a lost end event.
    heard_at: Option<Instant>,
    /// When the first block went on the wire.
    first_block_at: Option<Instant>,
    /// Milliseconds per stage, for `Outcome.stage_ms`.
    stage_ms: BTreeMap<String, f64>,
    /// How the plugin makes the blocks, for `Outcome.route`.
    route: Route,
}

/// What has gone on the Push streams.
#[derive(Debug, Default)]
pub(super) struct Sent {
    blocks: u32,
    tail_tokens: u32,
    bytes: u64,
}

impl<'a> Transfer<'a> {
    /// Opens the Push streams (each with the whole prompt), then posts the
    /// prompt to vLLM.
    pub(super) async fn start(
        bridge: &'a Bridge,
        decoder: &'a Decoder,
        job: &Job,
        plan: Plan,
    ) -> Result<Self, Failure> {
        let open = PushOpen {
            request_id: job.request_id.clone(),
            spec_fingerprint: decoder.spec.spec_fingerprint.clone(),
            token_ids: job.token_ids.clone(),
            first_block: plan.first_block,
            tail_tokens: plan.tail_tokens,
            payload: job.payload as i32,
        };
        let stripes = Stripes::open(decoder, open, bridge.stream.queue_frames).await?;
        let prompt = job.token_ids[..plan.prompt_tokens()].to_vec();
        // vLLM's request and the plugin's work on it, both continuing this span.
        let span = tracing::info_span!("vllm.request", otel.kind = "client", pdbridge.prompt_tokens = prompt.len());
        let params = bridge.plugin_params(decoder, job, &plan, traces::traceparent(&span));
        let deadline = Instant::now() + bridge.stream.prefill_deadline(prompt.len());
        let vllm = bridge.vllm.clone();
        let started = Instant::now();
        let prefill = tokio::spawn(async move { vllm.prefill(&prompt, params).await.map(drop) }.instrument(span));
        Ok(Transfer {
            bridge,
            decoder,
            plan,
            stripes,
            prefill,
            stages: Stages::default(),
            deadline,
            sent: Sent::default(),
            started,
            prefilled_at: None,
            heard_at: None,
            first_block_at: None,
            stage_ms: BTreeMap::new(),
            route: bridge.route(job.payload),
        })
    }

    /// Relays the plugin's blocks onto the Push streams until the plugin's
    /// end (the blocks it emitted) or the first thing that goes wrong.
    pub(super) async fn relay(
        &mut self,
        plugin: &mut mpsc::Receiver<PluginEvent>,
        events: &mpsc::Sender<PrefillEvent>,
    ) -> Result<u32, Failure> {
        let mut stalled = self.bridge.vllm.stalled_changes();
        loop {
            let wake_at = self.wake_at();
            let ended = tokio::select! {
                event = plugin.recv() => {
                    self.heard_at = self.prefilled_at.map(|_| Instant::now());
                    self.on_plugin(event, events).await?
                }
                answer = &mut self.prefill, if self.prefilled_at.is_none() => {
                    self.on_prefilled(answer)?;
                    None
                }
                // The caller went away (its deadline passed, its client left): stop
                // prefilling for nobody; blocks already sent are still sealed.
                _ = events.closed() => return Err(fail(Reason::Cancelled, "the caller went away")),
                // A frozen engine sends nothing more: cut now, not at the deadline, so the
                // caller can go elsewhere (prefilld reports NOT_SERVING meanwhile).
                Ok(()) = async { stalled.wait_for(|stalled| *stalled).await.map(drop) } => {
                    return Err(fail(Reason::PrefillUnavailable, STALLED));
                }
                _ = tokio::time::sleep_until(wake_at) => return Err(self.timed_out()),
            };
            if let Some(emitted) = ended {
                return Ok(emitted);
            }
        }
    }

    /// One message from the plugin; the blocks it emitted once it has ended.
    pub(super) async fn on_plugin(
        &mut self,
        event: Option<PluginEvent>,
        events: &mpsc::Sender<PrefillEvent>,
    ) -> Result<Option<u32>, Failure> {
        match event {
            Some(PluginEvent::Block { index, part, stage }) => {
                self.on_block(index, part, stage, events).await?;
                Ok(None)
            }
            Some(PluginEvent::Done { end, stage }) => self.on_end(stage, end),
            Some(PluginEvent::Error { failure, message }) => Err(plugin_error(failure, &message)),
            None => Err(fail(Reason::PrefillFailed, "plugin channel closed")),
        }
    }

    /// Sends a block once every stage's part of it has arrived, and reports
    /// progress (not for the tail).
    pub(super) async fn on_block(
        &mut self,
        index: u32,
        part: Part,
        stage: Stage,
        events: &mpsc::Sender<PrefillEvent>,
    ) -> Result<(), Failure> {
        let tail = self.plan.is_tail(index)?;
        let Some(parts) = self.stages.block(stage, index, part).map_err(plugin_failed)? else {
            return Ok(());
        };
        self.first_block_at.get_or_insert_with(Instant::now);
        let span = tracing::info_span!("push.block", pdbridge.block = index, pdbridge.tail = tail);
        for part in parts {
            let frames = self.stripes.sender(index);
            let sent = self.bridge.send_block(frames, index, &part.tensors, part.payload);
            self.sent.bytes += sent.instrument(span.clone()).await?;
        }
        if tail {
            self.sent.tail_tokens = self.plan.tail_tokens;
            return Ok(());
        }
        self.stripes.sent(index);
        self.sent.blocks += 1;
        let _ = events.send(PrefillEvent { event: Some(Event::Progress(self.progress())) }).await;
        Ok(())
    }

    /// The plugin's end once every stage has sent its own: the blocks it
    /// emitted, if it captured the whole prompt.
    pub(super) fn on_end(&mut self, stage: Stage, end: End) -> Result<Option<u32>, Failure> {
        let Some(end) = self.stages.end(stage, end).map_err(plugin_failed)? else {
            return Ok(None);
        };
        self.stage_ms.extend(end.timings_ms);
        let prompt = self.plan.prompt_tokens();
        if end.num_tokens as usize != prompt {
            return Err(fail(Reason::PrefillFailed, format!("captured {} tokens of {prompt}", end.num_tokens)));
        }
        Ok(Some(end.blocks_emitted))
    }

    /// vLLM's answer: the prompt is prefilled, or the engine failed.
    pub(super) fn on_prefilled(&mut self, answer: Result<Result<(), EngineError>, JoinError>) -> Result<(), Failure> {
        self.prefilled_at = Some(Instant::now());
        self.heard_at = self.prefilled_at;
        self.stage_ms.insert("prefill".into(), millis(self.started.elapsed()));
        match answer {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(fail(Reason::PrefillFailed, e.to_string())),
            Err(e) => Err(fail(Reason::PrefillFailed, e.to_string())),
        }
    }

    /// When to give up: the deadline, or sooner once vLLM has answered and
    /// the plugin has sent nothing for END_EVENT_GRACE.
    pub(super) fn wake_at(&self) -> Instant {
        self.heard_at.map_or(self.deadline, |t| (t + END_EVENT_GRACE).min(self.deadline))
    }

    pub(super) fn timed_out(&self) -> Failure {
        match self.prefilled_at {
            Some(_) => fail(Reason::Timeout, "vLLM answered, then the plugin sent nothing more and no end event"),
            None => fail(Reason::Timeout, "prefill deadline passed"),
        }
    }

    pub(super) fn progress(&self) -> Progress {
        let (done, total) = (self.sent.blocks, self.plan.num_blocks());
        let eta = self.started.elapsed().as_secs_f64() / f64::from(done) * f64::from(total.saturating_sub(done));
        Progress { blocks_done: done, blocks_total: total, bytes_sent: self.sent.bytes, eta_seconds: eta }
    }

    /// Seals the Push streams with what was actually sent, whatever happened
    /// (the decoder keeps every complete block and reports the first gap),
    /// and settles the outcome.
    pub(super) async fn finish(mut self, end: Result<u32, Failure>) -> Result<Outcome, Failure> {
        if self.prefilled_at.is_none() {
            self.prefill.abort();
        }
        let receipt = self.stripes.finish().instrument(tracing::info_span!("push.seal")).await;
        let receipt = receipt.map_err(|s| self.bridge.decoder_failed(self.decoder, &s, Reason::TransferFailed));
        self.sent.record(self.plan.block_tokens);
        if let Some(t) = self.first_block_at {
            self.stage_ms.insert("wire".into(), millis(t.elapsed()));
        }
        self.stage_ms.insert("total".into(), millis(self.started.elapsed()));
        let outcome = settle(&self.plan, end, receipt)?;
        Ok(Outcome { stage_ms: self.stage_ms, route: self.route as i32, ..outcome })
    }
}

impl Sent {
    /// Counts what went on the wire.
    pub(super) fn record(&self, block_tokens: u32) {
        metrics::counter!(metric::STREAM_BYTES.name).increment(self.bytes);
        metrics::counter!(metric::STREAM_BLOCKS.name).increment(u64::from(self.blocks));
        let tokens = self.blocks * block_tokens + self.tail_tokens;
        if tokens > 0 {
            metrics::gauge!(metric::STREAM_PAYLOAD_BYTES_PER_TOKEN.name).set(self.bytes as f64 / f64::from(tokens));
        }
    }
}

fn millis(elapsed: Duration) -> f64 {
    elapsed.as_secs_f64() * 1e3
}

/// A transfer's outcome, from `end` (the blocks the plugin emitted, or what
/// stopped it) and the decoder's merged receipt (or why sealing failed).
/// Bridged: every planned block emitted and committed. Partial: short of
/// that, with the reason that stopped the transfer, else the decoder's.
/// Failed (Err): the seal failed, or the transfer stopped with nothing
/// committed.
pub(super) fn settle(
    plan: &Plan,
    end: Result<u32, Failure>,
    receipt: Result<PushReceipt, Failure>,
) -> Result<Outcome, Failure> {
    let receipt = receipt?;
    let (planned, committed) = (plan.num_blocks(), receipt.blocks_committed);
    let (status, reason, detail) = match end {
        Ok(emitted) if emitted == planned && committed == planned => (OutcomeStatus::Bridged, None, receipt.detail),
        Ok(emitted) => (
            OutcomeStatus::Partial,
            Some(Reason::from_proto(receipt.reason()).unwrap_or(Reason::TransferFailed)),
            format!("emitted {emitted} of {planned} blocks; {}", receipt.detail),
        ),
        Err(failure) if committed > 0 => (OutcomeStatus::Partial, Some(failure.reason), failure.detail),
        Err(failure) => return Err(failure),
    };
    Ok(Outcome {
        status: status as i32,
        blocks_committed: committed,
        tokens_covered: receipt.first_missing_block * plan.block_tokens,
        // A tail is only of use after every block before it.
        tail_tokens: if receipt.tail_committed && committed == planned { plan.tail_tokens } else { 0 },
        bytes: receipt.bytes,
        reason: reason.map_or(proto::Reason::Unspecified, Reason::to_proto) as i32,
        detail,
        stage_ms: BTreeMap::new(),
        route: Route::Unspecified as i32,
    })
}

/// One transfer's Push streams, one per connection to the decoder: block i
/// travels on stream i mod n. Each stream opens with the whole prompt, so
/// the decoder verifies every block's key on whichever stream it arrives.
pub(super) struct Stripes {
    senders: Vec<mpsc::Sender<PushFrame>>,
    /// Blocks sent on each stream, for its seal.
    sent: Vec<u32>,
    pushes: Vec<JoinHandle<Result<tonic::Response<PushReceipt>, tonic::Status>>>,
}

impl Stripes {
    pub(super) async fn open(decoder: &Decoder, open: PushOpen, queue_frames: usize) -> Result<Stripes, Failure> {
        let n = decoder.push_clients.len();
        let mut stripes = Stripes { senders: Vec::with_capacity(n), sent: vec![0; n], pushes: Vec::with_capacity(n) };
        for client in &decoder.push_clients {
            let (tx, rx) = mpsc::channel::<PushFrame>(queue_frames);
            let mut client = client.clone();
            let mut push = tonic::Request::new(ReceiverStream::new(rx));
            traces::inject_grpc(&Span::current(), push.metadata_mut());
            stripes.pushes.push(tokio::spawn(async move { client.push(push).await }));
            send(&tx, Frame::Open(open.clone())).await?;
            stripes.senders.push(tx);
        }
        Ok(stripes)
    }

    pub(super) fn sender(&self, block: u32) -> &mpsc::Sender<PushFrame> {
        &self.senders[block as usize % self.senders.len()]
    }

    pub(super) fn sent(&mut self, block: u32) {
        let n = self.sent.len();
        self.sent[block as usize % n] += 1;
    }

    /// Seals every stream with what it carried and merges the receipts; the
    /// first failed stream's status otherwise (the others still finish).
    pub(super) async fn finish(&mut self) -> Result<PushReceipt, tonic::Status> {
        for (tx, &blocks_emitted) in self.senders.iter().zip(&self.sent) {
            let _ = tx.send(PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted })) }).await;
        }
        // Closing the streams lets the decoder answer.
        self.senders.clear();
        let mut merged = PushReceipt::default();
        let mut details = Vec::new();
        let mut failed = None;
        for push in std::mem::take(&mut self.pushes) {
            match push.await.map_err(|e| tonic::Status::internal(e.to_string())).and_then(|r| r) {
                Ok(receipt) => {
                    let receipt = receipt.into_inner();
                    merged.blocks_committed += receipt.blocks_committed;
                    merged.bytes += receipt.bytes;
                    // Each stream looks at the store when it ends; the last sees the most.
                    merged.first_missing_block = merged.first_missing_block.max(receipt.first_missing_block);
                    merged.tail_committed |= receipt.tail_committed;
                    if receipt.reason() != proto::Reason::Unspecified {
                        merged.reason = receipt.reason;
                    }
                    details.extend((!receipt.detail.is_empty()).then_some(receipt.detail));
                }
                Err(status) => {
                    failed.get_or_insert(status);
                }
            }
        }
        merged.detail = details.join("; ");
        failed.map_or(Ok(merged), Err)
    }
}

pub(super) async fn send(frames: &mpsc::Sender<PushFrame>, frame: Frame) -> Result<(), Failure> {
    frames
        .send(PushFrame { frame: Some(frame) })
        .await
        .map_err(|_| fail(Reason::TransferFailed, "the decoder closed the Push stream"))
}
