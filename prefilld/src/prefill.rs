//! One bridged prefill, end to end: ask the decoder what it already has, run
//! the prompt through vLLM with the capture plugin, turn each finished block
//! into shards as it arrives and stream them into the decoder's `Push`, and
//! report progress and exactly one outcome.
//!
//! [`Bridge::run`] meets the decoder and makes a [`Plan`] (which blocks, which
//! tail); a [`Transfer`] opens the Push streams, posts the prompt to vLLM and
//! relays the plugin's blocks until its end or the first failure, then seals
//! the streams; [`settle`], a pure function, decides the outcome from what the
//! plugin emitted and what the decoder committed.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use bytes::Bytes;
use pdbridge_common::{
    proto::{
        self, CacheSpec, LookupRequest, Outcome, Payload, PrefillEvent, Progress, PushFrame, PushOpen, PushReceipt,
        PushSeal,
        engine::{PluginFailure, PluginParams},
        outcome::Status as OutcomeStatus,
        prefill_event::Event,
        push_frame::Frame,
    },
    reason::Reason,
    shard::{self, TensorId},
    spec, telemetry, traces,
};
use tokio::{
    sync::mpsc,
    task::{JoinError, JoinHandle},
    time::Instant,
};
use tokio_stream::wrappers::ReceiverStream;
use tracing::{Instrument, Span};

use crate::{
    capture::{End, Part, PluginEvent, Registration, Router, Stage, StageError, Stages, TensorSlice},
    config::StreamConfig,
    engine::{EngineError, Vllm},
    handshake::{Decoder, Decoders},
};

/// A bridge's detail when vLLM stopped answering its liveness probe mid-way.
const STALLED: &str = "the prefill engine stopped answering (engine.liveness)";

/// Longest wait for the plugin's end-of-prefill event once vLLM has answered.
const END_EVENT_GRACE: Duration = Duration::from_secs(30);

/// Paces sends to an emulated link rate: each send waits until the link
/// would have finished the bytes before it. Shared by every stream, like a
/// real link.
pub struct Link {
    bytes_per_second: f64,
    free_at: tokio::sync::Mutex<Instant>,
}

impl Link {
    /// None when `gbps` is 0 (no emulation).
    pub fn new(gbps: f64) -> Option<Link> {
        (gbps > 0.0)
            .then(|| Link { bytes_per_second: gbps * 1e9 / 8.0, free_at: tokio::sync::Mutex::new(Instant::now()) })
    }

    async fn send(&self, bytes: usize) {
        let done = {
            let mut free_at = self.free_at.lock().await;
            let start = (*free_at).max(Instant::now());
            *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_second);
            *free_at
        };
        tokio::time::sleep_until(done).await;
    }
}

/// Everything a prefill needs, shared by all requests.
pub struct Bridge {
    pub vllm: Vllm,
    pub decoders: Decoders,
    pub router: Arc<Router>,
    pub stream: StreamConfig,
    /// The emulated link, when `stream.link_gbps` is set.
    pub link: Option<Link>,
}

/// A validated Prefill request.
pub struct Job {
    pub request_id: String,
    pub token_ids: Vec<u32>,
    /// One of the configured decoders.
    pub decoder_addr: String,
    pub first_block: Option<u32>,
    /// Also bridge the prompt's tail, all but its last token (`PrefillRequest.tail`).
    pub tail: bool,
    /// What the blocks carry: the decoder's cache, or its layers' inputs.
    pub payload: Payload,
    /// The plugin's messages for `request_id`, reserved for this job alone.
    pub registration: Registration,
}

/// A failure that ends a prefill with an outcome rather than a gRPC error:
/// its reason, and what went wrong for people (the outcome's `detail`).
#[derive(Debug, thiserror::Error)]
#[error("{reason}: {detail}")]
struct Failure {
    reason: Reason,
    detail: String,
}

fn fail(reason: Reason, detail: impl Into<String>) -> Failure {
    Failure { reason, detail: detail.into() }
}

fn plugin_failed(e: StageError) -> Failure {
    fail(Reason::PrefillFailed, format!("plugin: {e}"))
}

impl Failure {
    /// The outcome of a prefill that committed nothing usable.
    fn into_outcome(self) -> Outcome {
        Outcome {
            status: OutcomeStatus::Failed as i32,
            reason: self.reason.to_proto() as i32,
            detail: self.detail,
            ..Default::default()
        }
    }
}

impl Bridge {
    /// Runs `job`, sending progress and then one outcome to `events`.
    pub async fn run(self: Arc<Self>, mut job: Job, events: mpsc::Sender<PrefillEvent>) {
        let started = Instant::now();
        let _in_flight = telemetry::InFlight::enter("pdbridge_prefill_in_flight");
        let outcome = self.bridge(&mut job, &events).await.unwrap_or_else(|failure| {
            tracing::warn!(
                request_id = job.request_id,
                reason = failure.reason.label(),
                message = failure.detail,
                "prefill failed"
            );
            failure.into_outcome()
        });
        record(&job.request_id, &outcome, started.elapsed());
        let _ = events.send(PrefillEvent { event: Some(Event::Outcome(outcome)) }).await;
    }

    /// Meets the decoder, plans the job's blocks and transfers those the
    /// decoder does not hold yet.
    async fn bridge(&self, job: &mut Job, events: &mpsc::Sender<PrefillEvent>) -> Result<Outcome, Failure> {
        let decoder = self.decoders.get(&job.decoder_addr).await.map_err(|e| fail(e.reason(), e.to_string()))?;
        spec::check_tokens(&decoder.spec, &job.token_ids).map_err(|problem| fail(Reason::BadRequest, problem))?;
        if let Some(problem) = spec::payload_unsupported(&decoder.spec, job.payload) {
            return Err(fail(Reason::UnsupportedModel, format!("layer inputs: {problem}")));
        }
        let first_block = match job.first_block {
            Some(first) => first,
            None => self.cached_blocks(&decoder, &job.token_ids).await?,
        };
        let plan = Plan::new(&decoder.spec, &job.token_ids, first_block, job.tail);
        if let Some(outcome) = plan.already_cached() {
            return Ok(outcome);
        }
        job.registration.expect_blocks(spec::block_bytes(&decoder.spec, job.payload, plan.block_tokens) as usize);
        let mut transfer = Transfer::start(self, &decoder, job, plan).await?;
        let end = transfer.relay(&mut job.registration.events, events).await;
        transfer.finish(end).await
    }

    /// Whole blocks of the prompt the decoder already holds (`Lookup`).
    async fn cached_blocks(&self, decoder: &Decoder, token_ids: &[u32]) -> Result<u32, Failure> {
        let request =
            LookupRequest { token_ids: token_ids.to_vec(), spec_fingerprint: decoder.spec.spec_fingerprint.clone() };
        let span = tracing::info_span!("decoder.lookup", otel.kind = "client");
        let mut request = tonic::Request::new(request);
        traces::inject_grpc(&span, request.metadata_mut());
        let reply = decoder
            .client
            .clone()
            .lookup(request)
            .instrument(span)
            .await
            .map_err(|s| self.decoder_failed(decoder, &s, Reason::DecoderUnreachable))?;
        Ok(reply.into_inner().cached_blocks)
    }

    /// A decoder's refusal as a prefill's failure. A decoder whose spec
    /// changed is forgotten, so the next prefill meets it again.
    fn decoder_failed(&self, decoder: &Decoder, status: &tonic::Status, otherwise: Reason) -> Failure {
        let reason = decoder_reason(status, otherwise);
        if reason == Reason::SpecMismatch {
            self.decoders.forget(&decoder.addr);
        }
        fail(reason, status.message())
    }

    /// The plugin's parameters for one request (`kv_transfer_params.pdbridge`), in proto3 JSON.
    fn plugin_params(&self, decoder: &Decoder, job: &Job, plan: &Plan, traceparent: String) -> serde_json::Value {
        let params = PluginParams {
            request_id: job.request_id.clone(),
            socket: self.router.socket_path().display().to_string(),
            bundle_path: decoder.bundle_path.display().to_string(),
            bundle_sha256: decoder.spec.weights_fingerprint.clone(),
            block_tokens: plan.block_tokens,
            first_block: plan.first_block,
            // A state carried from block to block scans every block before it: the plugin runs them all.
            from_block: Some(if spec::chains_blocks(&decoder.spec) { 0 } else { plan.first_block }),
            num_blocks: plan.num_blocks(),
            tail_tokens: plan.tail_tokens,
            payload: job.payload as i32,
            traceparent,
        };
        serde_json::to_value(&params).expect("the plugin's parameters are JSON")
    }

    /// Cuts one block's tensors into shards (slices of `payload`, no copies)
    /// and queues them on the Push stream. Returns the payload bytes sent.
    async fn send_block(
        &self,
        frames: &mpsc::Sender<PushFrame>,
        index: u32,
        tensors: &[TensorSlice],
        payload: Bytes,
    ) -> Result<u64, Failure> {
        let mut bytes = 0;
        for t in tensors {
            let id = TensorId {
                block_index: index,
                layer: t.layer,
                tensor: t.name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
            };
            let data = payload.slice(t.offset..t.offset + t.nbytes);
            for shard in shard::split(&id, data, self.stream.max_shard_bytes) {
                bytes += shard.payload.len() as u64;
                if let Some(link) = &self.link {
                    link.send(shard.payload.len()).await;
                }
                send(frames, Frame::Shard(shard)).await?;
            }
        }
        Ok(bytes)
    }
}

/// The plugin's failure of the request as a bridge's: a bundle that does not fit this engine's
/// model is a mismatch between the boxes, anything else the prefill's own failure. The detail
/// names the plugin's reason as the proto does.
fn plugin_error(failure: PluginFailure, message: &str) -> Failure {
    let reason = match failure {
        PluginFailure::BundleMismatch => Reason::SpecMismatch,
        _ => Reason::PrefillFailed,
    };
    let name = failure.as_str_name().trim_start_matches("PLUGIN_FAILURE_").to_ascii_lowercase();
    metrics::counter!("pdbridge_plugin_failures_total", "failure" => name.clone()).increment(1);
    fail(reason, format!("plugin: {name}: {message}"))
}

/// Why a call to a decoder failed: the reason its status carries; from a
/// decoder that predates them, FAILED_PRECONDITION read as a spec mismatch
/// (what it almost always was); otherwise `otherwise`, the call's own.
fn decoder_reason(status: &tonic::Status, otherwise: Reason) -> Reason {
    Reason::of_status(status).unwrap_or(match status.code() {
        tonic::Code::FailedPrecondition => Reason::SpecMismatch,
        _ => otherwise,
    })
}

/// Counts and logs a prefill's outcome.
fn record(request_id: &str, outcome: &Outcome, elapsed: Duration) {
    let label = match outcome.status() {
        OutcomeStatus::Bridged => "bridged",
        OutcomeStatus::Partial => "partial",
        _ => "failed",
    };
    let reason = Reason::from_proto(outcome.reason()).map_or("none", Reason::label);
    metrics::counter!("pdbridge_prefill_requests_total", "outcome" => label, "reason" => reason).increment(1);
    metrics::histogram!("pdbridge_prefill_duration_seconds").record(elapsed.as_secs_f64());
    let span = Span::current();
    span.record("pdbridge.outcome", label);
    span.record("pdbridge.blocks", outcome.blocks_committed);
    tracing::info!(
        request_id,
        outcome = label,
        blocks = outcome.blocks_committed,
        bytes = outcome.bytes,
        ?elapsed,
        "prefill done"
    );
    for stage in ["prefill", "capture", "reconstruct", "wire"] {
        if let Some(ms) = outcome.stage_ms.get(stage) {
            telemetry::record_stage(stage, ms / 1e3);
        }
    }
}

/// Which blocks of a prompt a transfer computes and pushes, decided before
/// anything runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Plan {
    block_tokens: u32,
    /// Whole blocks of the prompt the decoder can store.
    whole_blocks: u32,
    /// The first block to push; the decoder holds those before it.
    first_block: u32,
    /// Rows after the last whole block, all but the prompt's last token
    /// (shorter than a block by construction); 0 for none.
    tail_tokens: u32,
}

impl Plan {
    fn new(spec: &CacheSpec, token_ids: &[u32], first_block: u32, tail: bool) -> Plan {
        let block_tokens = spec.block_tokens;
        let whole_blocks = spec::storable(spec, token_ids).len() as u32 / block_tokens;
        // A pooled layer stores no tail; the decoder computes those tokens itself.
        let tail = tail && spec::tail_unsupported(spec).is_none();
        let tail_tokens =
            if tail { (token_ids.len() as u32 - 1).saturating_sub(whole_blocks * block_tokens) } else { 0 };
        Plan { block_tokens, whole_blocks, first_block, tail_tokens }
    }

    fn num_blocks(&self) -> u32 {
        self.whole_blocks.saturating_sub(self.first_block)
    }

    /// The tokens vLLM prefills: the whole blocks, then the tail.
    fn prompt_tokens(&self) -> usize {
        (self.whole_blocks * self.block_tokens + self.tail_tokens) as usize
    }

    /// The outcome when the decoder holds every whole block already.
    fn already_cached(&self) -> Option<Outcome> {
        (self.num_blocks() == 0).then(|| Outcome {
            status: OutcomeStatus::Bridged as i32,
            tokens_covered: self.whole_blocks * self.block_tokens,
            detail: "already cached".into(),
            ..Default::default()
        })
    }

    /// Whether block `index` from the plugin is the tail (block
    /// `whole_blocks`, when one was asked for); a failure outside the plan.
    fn is_tail(&self, index: u32) -> Result<bool, Failure> {
        let tail = index == self.whole_blocks && self.tail_tokens > 0;
        if index < self.first_block || (index >= self.whole_blocks && !tail) {
            let range = format!("{}..{}", self.first_block, self.whole_blocks);
            return Err(fail(Reason::PrefillFailed, format!("plugin sent block {index} outside {range}")));
        }
        Ok(tail)
    }
}

/// One transfer in flight: its Push streams, vLLM's request, and what has
/// gone on the wire so far. Each step is a method; [`settle`] decides the
/// outcome.
struct Transfer<'a> {
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
    /// When the first block went on the wire.
    first_block_at: Option<Instant>,
    /// Milliseconds per stage, for `Outcome.stage_ms`.
    stage_ms: BTreeMap<String, f64>,
}

/// What has gone on the Push streams.
#[derive(Debug, Default)]
struct Sent {
    blocks: u32,
    tail_tokens: u32,
    bytes: u64,
}

impl<'a> Transfer<'a> {
    /// Opens the Push streams (each with the whole prompt), then posts the
    /// prompt to vLLM.
    async fn start(bridge: &'a Bridge, decoder: &'a Decoder, job: &Job, plan: Plan) -> Result<Self, Failure> {
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
            first_block_at: None,
            stage_ms: BTreeMap::new(),
        })
    }

    /// Relays the plugin's blocks onto the Push streams until the plugin's
    /// end (the blocks it emitted) or the first thing that goes wrong.
    async fn relay(
        &mut self,
        plugin: &mut mpsc::Receiver<PluginEvent>,
        events: &mpsc::Sender<PrefillEvent>,
    ) -> Result<u32, Failure> {
        let mut stalled = self.bridge.vllm.stalled_changes();
        loop {
            let wake_at = self.wake_at();
            let ended = tokio::select! {
                event = plugin.recv() => self.on_plugin(event, events).await?,
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
    async fn on_plugin(
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
    async fn on_block(
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
    fn on_end(&mut self, stage: Stage, end: End) -> Result<Option<u32>, Failure> {
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
    fn on_prefilled(&mut self, answer: Result<Result<(), EngineError>, JoinError>) -> Result<(), Failure> {
        self.prefilled_at = Some(Instant::now());
        self.stage_ms.insert("prefill".into(), millis(self.started.elapsed()));
        match answer {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(fail(Reason::PrefillFailed, e.to_string())),
            Err(e) => Err(fail(Reason::PrefillFailed, e.to_string())),
        }
    }

    /// When to give up: the deadline, or sooner once vLLM has answered and
    /// only the plugin's end event is owed.
    fn wake_at(&self) -> Instant {
        self.prefilled_at.map_or(self.deadline, |t| (t + END_EVENT_GRACE).min(self.deadline))
    }

    fn timed_out(&self) -> Failure {
        match self.prefilled_at {
            Some(_) => fail(Reason::Timeout, "no end-of-prefill event from the plugin"),
            None => fail(Reason::Timeout, "prefill deadline passed"),
        }
    }

    fn progress(&self) -> Progress {
        let (done, total) = (self.sent.blocks, self.plan.num_blocks());
        let eta = self.started.elapsed().as_secs_f64() / f64::from(done) * f64::from(total.saturating_sub(done));
        Progress { blocks_done: done, blocks_total: total, bytes_sent: self.sent.bytes, eta_seconds: eta }
    }

    /// Seals the Push streams with what was actually sent, whatever happened
    /// (the decoder keeps every complete block and reports the first gap),
    /// and settles the outcome.
    async fn finish(mut self, end: Result<u32, Failure>) -> Result<Outcome, Failure> {
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
        Ok(Outcome { stage_ms: self.stage_ms, ..outcome })
    }
}

impl Sent {
    /// Counts what went on the wire.
    fn record(&self, block_tokens: u32) {
        metrics::counter!("pdbridge_stream_bytes_total").increment(self.bytes);
        metrics::counter!("pdbridge_stream_blocks_total").increment(u64::from(self.blocks));
        let tokens = self.blocks * block_tokens + self.tail_tokens;
        if tokens > 0 {
            metrics::gauge!("pdbridge_stream_payload_bytes_per_token").set(self.bytes as f64 / f64::from(tokens));
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
fn settle(plan: &Plan, end: Result<u32, Failure>, receipt: Result<PushReceipt, Failure>) -> Result<Outcome, Failure> {
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
    })
}

/// One transfer's Push streams, one per connection to the decoder: block i
/// travels on stream i mod n. Each stream opens with the whole prompt, so
/// the decoder verifies every block's key on whichever stream it arrives.
struct Stripes {
    senders: Vec<mpsc::Sender<PushFrame>>,
    /// Blocks sent on each stream, for its seal.
    sent: Vec<u32>,
    pushes: Vec<JoinHandle<Result<tonic::Response<PushReceipt>, tonic::Status>>>,
}

impl Stripes {
    async fn open(decoder: &Decoder, open: PushOpen, queue_frames: usize) -> Result<Stripes, Failure> {
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

    fn sender(&self, block: u32) -> &mpsc::Sender<PushFrame> {
        &self.senders[block as usize % self.senders.len()]
    }

    fn sent(&mut self, block: u32) {
        let n = self.sent.len();
        self.sent[block as usize % n] += 1;
    }

    /// Seals every stream with what it carried and merges the receipts; the
    /// first failed stream's status otherwise (the others still finish).
    async fn finish(&mut self) -> Result<PushReceipt, tonic::Status> {
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

async fn send(frames: &mpsc::Sender<PushFrame>, frame: Frame) -> Result<(), Failure> {
    frames
        .send(PushFrame { frame: Some(frame) })
        .await
        .map_err(|_| fail(Reason::TransferFailed, "the decoder closed the Push stream"))
}

#[cfg(test)]
mod tests {
    use pdbridge_common::proto::{CacheKind, LayerSpec};

    use super::*;

    /// Blocks 2..6 of a 27-token prompt in 4-token blocks, and its 2-token tail.
    const PLAN: Plan = Plan { block_tokens: 4, whole_blocks: 6, first_block: 2, tail_tokens: 2 };

    fn receipt(committed: u32, tail_committed: bool) -> PushReceipt {
        PushReceipt {
            blocks_committed: committed,
            bytes: u64::from(committed) * 100,
            first_missing_block: PLAN.first_block + committed,
            tail_committed,
            ..Default::default()
        }
    }

    /// The outcome's status, reason and blocks committed (Failed, the failure's reason and 0 for an Err).
    fn settled(
        end: Result<u32, Failure>,
        receipt: Result<PushReceipt, Failure>,
    ) -> (OutcomeStatus, Option<Reason>, u32) {
        match settle(&PLAN, end, receipt) {
            Ok(o) => (o.status(), Reason::from_proto(o.reason()), o.blocks_committed),
            Err(failure) => (OutcomeStatus::Failed, Some(failure.reason), 0),
        }
    }

    #[test]
    fn every_block_emitted_and_committed_is_bridged_with_its_tail() {
        let outcome = settle(&PLAN, Ok(4), Ok(receipt(4, true))).unwrap();
        assert_eq!(outcome.status(), OutcomeStatus::Bridged);
        assert_eq!(outcome.reason(), proto::Reason::Unspecified);
        assert_eq!(
            (outcome.blocks_committed, outcome.tokens_covered, outcome.tail_tokens, outcome.bytes),
            (4, 24, 2, 400)
        );
        // No tail delivered, none claimed.
        assert_eq!(settle(&PLAN, Ok(4), Ok(receipt(4, false))).unwrap().tail_tokens, 0);
    }

    #[test]
    fn blocks_the_decoder_did_not_commit_make_a_partial_with_its_reason() {
        let short =
            PushReceipt { reason: Reason::Evicted.to_proto() as i32, detail: "gap at 4".into(), ..receipt(2, true) };
        let outcome = settle(&PLAN, Ok(4), Ok(short)).unwrap();
        assert_eq!((outcome.status(), outcome.reason()), (OutcomeStatus::Partial, proto::Reason::Evicted));
        assert_eq!((outcome.tokens_covered, outcome.tail_tokens), (16, 0), "a tail after a gap is of no use");
        assert_eq!(outcome.detail, "emitted 4 of 4 blocks; gap at 4");
        // A receipt that names no reason: the transfer's.
        assert_eq!(settled(Ok(4), Ok(receipt(3, false))), (OutcomeStatus::Partial, Some(Reason::TransferFailed), 3));
    }

    #[test]
    fn a_plugin_that_emitted_fewer_blocks_makes_a_partial() {
        assert_eq!(settled(Ok(3), Ok(receipt(3, false))), (OutcomeStatus::Partial, Some(Reason::TransferFailed), 3));
        // Even when it emitted none and none were committed (as before: partial, zero blocks).
        assert_eq!(settled(Ok(0), Ok(receipt(0, false))), (OutcomeStatus::Partial, Some(Reason::TransferFailed), 0));
    }

    #[test]
    fn what_stopped_the_transfer_is_the_reason_partial_or_failed_by_what_was_committed() {
        for reason in [Reason::PrefillFailed, Reason::Timeout, Reason::Cancelled, Reason::TransferFailed] {
            let outcome = settle(&PLAN, Err(fail(reason, "why")), Ok(receipt(1, false))).unwrap();
            assert_eq!((outcome.status(), outcome.reason()), (OutcomeStatus::Partial, reason.to_proto()));
            assert_eq!((outcome.blocks_committed, outcome.detail.as_str()), (1, "why"));
            let failure = settle(&PLAN, Err(fail(reason, "why")), Ok(receipt(0, false))).unwrap_err();
            assert_eq!((failure.reason, failure.detail.as_str()), (reason, "why"));
        }
    }

    #[test]
    fn a_failed_seal_fails_the_transfer_whatever_the_plugin_did() {
        let sealing = || Err(fail(Reason::SpecMismatch, "spec changed"));
        assert_eq!(settled(Ok(4), sealing()), (OutcomeStatus::Failed, Some(Reason::SpecMismatch), 0));
        assert_eq!(settled(Err(fail(Reason::Timeout, "late")), sealing()).1, Some(Reason::SpecMismatch));
    }

    #[test]
    fn a_plan_covers_the_storable_whole_blocks_and_the_tail_it_may_carry() {
        // What a plan reads is the layer's traits: rows are rewindable and take a tail, pools neither.
        let spec = |kind: CacheKind| {
            let rows = kind == CacheKind::Rows;
            let layer = LayerSpec { rewindable: rows, takes_tail: rows, from_inputs: true, ..Default::default() };
            CacheSpec { block_tokens: 4, layers: vec![LayerSpec { kind: kind as i32, ..layer }], ..Default::default() }
        };
        let tokens: Vec<u32> = (0..27).collect();
        let rows = Plan::new(&spec(CacheKind::Rows), &tokens, 2, true);
        assert_eq!(rows, PLAN);
        assert_eq!((rows.num_blocks(), rows.prompt_tokens()), (4, 26), "all but the last token");
        assert_eq!(Plan::new(&spec(CacheKind::Rows), &tokens, 2, false).tail_tokens, 0);
        // A pooled layer stores no tail, and no block ends with the prompt's last token.
        let (tokens, pooled) = (&tokens[..24], spec(CacheKind::Pooled));
        assert_eq!(
            Plan::new(&pooled, tokens, 0, true),
            Plan { whole_blocks: 5, first_block: 0, tail_tokens: 0, ..PLAN }
        );
        assert_eq!(Plan::new(&spec(CacheKind::Rows), tokens, 0, true).whole_blocks, 6);
    }

    #[test]
    fn a_plan_the_decoder_holds_is_already_bridged() {
        assert_eq!(PLAN.already_cached(), None);
        let cached = Plan { first_block: 6, ..PLAN }.already_cached().unwrap();
        assert_eq!((cached.status(), cached.tokens_covered, cached.blocks_committed), (OutcomeStatus::Bridged, 24, 0));
        assert!(Plan { first_block: 9, ..PLAN }.already_cached().is_some());
    }

    #[test]
    fn only_planned_blocks_and_the_tail_are_accepted_from_the_plugin() {
        assert!(!PLAN.is_tail(2).unwrap());
        assert!(!PLAN.is_tail(5).unwrap());
        assert!(PLAN.is_tail(6).unwrap());
        for outside in [0, 1, 7] {
            assert_eq!(PLAN.is_tail(outside).unwrap_err().reason, Reason::PrefillFailed, "block {outside}");
        }
        assert!(Plan { tail_tokens: 0, ..PLAN }.is_tail(6).is_err());
    }

    #[test]
    fn a_decoders_reason_comes_from_its_status_else_from_the_code() {
        use tonic::{Code, Status};
        let named = Reason::UnsupportedModel.status(Code::FailedPrecondition, "no tail");
        assert_eq!(decoder_reason(&named, Reason::TransferFailed), Reason::UnsupportedModel);
        let named = Reason::SpecMismatch.status(Code::FailedPrecondition, "fingerprint");
        assert_eq!(decoder_reason(&named, Reason::DecoderUnreachable), Reason::SpecMismatch);
        // A decoder that predates reasons in statuses.
        let old = Status::failed_precondition("payload");
        assert_eq!(decoder_reason(&old, Reason::TransferFailed), Reason::SpecMismatch);
        // A failure of the call alone: what the call was for.
        assert_eq!(
            decoder_reason(&Status::unavailable("down"), Reason::DecoderUnreachable),
            Reason::DecoderUnreachable
        );
        assert_eq!(decoder_reason(&Status::data_loss("crc"), Reason::TransferFailed), Reason::TransferFailed);
    }
}
