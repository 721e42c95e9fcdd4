//! One bridged prefill, end to end: ask the decoder what it already has, run
//! the prompt through vLLM with the capture plugin, turn each finished block
//! into shards as it arrives and stream them into the decoder's `Push`, and
//! report progress and exactly one outcome.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use bytes::Bytes;
use pdbridge_common::{
    proto::{
        Dtype, LookupRequest, Outcome, Payload, PrefillEvent, Progress, PushFrame, PushOpen, PushReceipt, PushSeal,
        outcome::Status as OutcomeStatus, prefill_event::Event, push_frame::Frame,
    },
    reason::Reason,
    shard::{self, TensorId},
    spec, telemetry,
};
use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tokio_stream::wrappers::ReceiverStream;

use crate::{
    capture::{PluginEvent, Registration, Router, Stages, TensorSlice},
    config::StreamConfig,
    engine::Vllm,
    handshake::{Decoder, Decoders},
};

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

/// A failure that ends a prefill with an outcome rather than a gRPC error.
struct Failure {
    reason: Reason,
    message: String,
}

fn fail(reason: Reason, message: impl Into<String>) -> Failure {
    Failure { reason, message: message.into() }
}

impl Bridge {
    /// Runs `job`, sending progress and then one outcome to `events`.
    pub async fn run(self: Arc<Self>, mut job: Job, events: mpsc::Sender<PrefillEvent>) {
        let started = Instant::now();
        let _in_flight = telemetry::InFlight::enter("pdbridge_prefill_in_flight");
        let outcome = match self.bridge(&mut job, &events).await {
            Ok(outcome) => outcome,
            Err(failure) => {
                tracing::warn!(
                    request_id = job.request_id,
                    reason = failure.reason.label(),
                    message = failure.message,
                    "prefill failed"
                );
                Outcome {
                    status: OutcomeStatus::Failed as i32,
                    reason: failure.reason.to_proto() as i32,
                    detail: failure.message,
                    ..Default::default()
                }
            }
        };
        let status = outcome.status();
        let label = match status {
            OutcomeStatus::Bridged => "bridged",
            OutcomeStatus::Partial => "partial",
            _ => "failed",
        };
        let reason = Reason::from_proto(outcome.reason()).map_or("none", Reason::label);
        metrics::counter!("pdbridge_prefill_requests_total", "outcome" => label, "reason" => reason).increment(1);
        metrics::histogram!("pdbridge_prefill_duration_seconds").record(started.elapsed().as_secs_f64());
        tracing::info!(request_id = job.request_id, outcome = label, blocks = outcome.blocks_committed, bytes = outcome.bytes, elapsed = ?started.elapsed(), "prefill done");
        for (stage, key) in
            [("prefill", "prefill"), ("capture", "capture"), ("reconstruct", "reconstruct"), ("wire", "wire")]
        {
            if let Some(ms) = outcome.stage_ms.get(key) {
                telemetry::record_stage(stage, ms / 1e3);
            }
        }
        let _ = events.send(PrefillEvent { event: Some(Event::Outcome(outcome)) }).await;
    }

    async fn bridge(&self, job: &mut Job, events: &mpsc::Sender<PrefillEvent>) -> Result<Outcome, Failure> {
        let decoder = self.decoders.get(&job.decoder_addr).await.map_err(|e| fail(e.reason(), e.to_string()))?;
        spec::check_tokens(&decoder.spec, &job.token_ids).map_err(|problem| fail(Reason::BadRequest, problem))?;
        if let Some(problem) = spec::payload_unsupported(&decoder.spec, job.payload) {
            return Err(fail(Reason::UnsupportedModel, format!("layer inputs: {problem}")));
        }
        let b = decoder.spec.block_tokens;
        let whole_blocks = spec::storable(&decoder.spec, &job.token_ids).len() as u32 / b;
        let first_block = match job.first_block {
            Some(first) => first,
            None => self.cached_blocks(&decoder, job).await?,
        };
        if first_block >= whole_blocks {
            return Ok(Outcome {
                status: OutcomeStatus::Bridged as i32,
                tokens_covered: whole_blocks * b,
                detail: "already cached".into(),
                ..Default::default()
            });
        }
        let num_blocks = whole_blocks - first_block;
        // The tail after the last whole block, all but the prompt's last token:
        // shorter than a block by construction. A pooled layer stores none; the
        // decoder computes those tokens itself.
        let tail = job.tail && spec::tail_unsupported(&decoder.spec).is_none();
        let tail_tokens = if tail { (job.token_ids.len() as u32 - 1).saturating_sub(whole_blocks * b) } else { 0 };
        let prompt = &job.token_ids[..(whole_blocks * b + tail_tokens) as usize];
        let registration = &mut job.registration;
        registration.expect_blocks(spec::block_bytes(&decoder.spec, job.payload, b) as usize);

        // The Push streams to the decoder, fed as blocks arrive.
        let open = PushOpen {
            request_id: job.request_id.clone(),
            spec_fingerprint: decoder.spec.spec_fingerprint.clone(),
            token_ids: job.token_ids.clone(),
            first_block,
            tail_tokens,
            payload: job.payload as i32,
        };
        let mut stripes = Stripes::open(&decoder, open, self.stream.queue_frames).await?;

        let params = serde_json::json!({
            "request_id": job.request_id,
            "socket": self.router_socket(),
            "bundle_path": decoder.bundle_path,
            "bundle_sha256": decoder.spec.weights_fingerprint,
            "spec_fingerprint": decoder.spec.spec_fingerprint,
            "block_tokens": b,
            "first_block": first_block,
            // A recurrent state after a block scans every block before it: the plugin runs them all.
            "from_block": if spec::has_snapshots(&decoder.spec) { 0 } else { first_block },
            "num_blocks": num_blocks,
            "tail_tokens": tail_tokens,
            "payload": match job.payload {
                Payload::Cache => "cache",
                Payload::LayerInputs => "layer_inputs",
            },
        });
        let vllm = self.vllm.clone();
        let prompt_owned = prompt.to_vec();
        let prefill_started = Instant::now();
        let mut prefill = tokio::spawn(async move { vllm.prefill(&prompt_owned, params).await });
        let deadline = Instant::now()
            + Duration::from_secs(60)
            + self.stream.deadline_per_1k_tokens * (prompt.len() as u32).div_ceil(1000);

        let mut stage_ms = BTreeMap::new();
        let mut sent_blocks = 0u32;
        let mut tail_sent = 0u32;
        let mut bytes_sent = 0u64;
        let mut prefill_done_at: Option<Instant> = None;
        let mut first_block_at: Option<Instant> = None;
        let mut stages = Stages::default();
        let end = 'events: loop {
            let grace = prefill_done_at.map(|t| t + END_EVENT_GRACE).unwrap_or(deadline).min(deadline);
            tokio::select! {
                event = registration.events.recv() => match event {
                    Some(PluginEvent::Block { index, part, stage }) => {
                        // Block `whole_blocks` is the tail, when one was asked for.
                        let tail = index == whole_blocks && tail_tokens > 0;
                        if index < first_block || (index >= whole_blocks && !tail) {
                            break Err(fail(Reason::PrefillFailed, format!("plugin sent block {index} outside {first_block}..{whole_blocks}")));
                        }
                        let parts = match stages.block(stage, index, part) {
                            Ok(Some(parts)) => parts,
                            Ok(None) => continue,
                            Err(e) => break Err(fail(Reason::PrefillFailed, format!("plugin: {e}"))),
                        };
                        first_block_at.get_or_insert_with(Instant::now);
                        for part in parts {
                            match self.send_block(stripes.sender(index), index, &part.tensors, part.payload).await {
                                Ok(bytes) => bytes_sent += bytes,
                                Err(failure) => break 'events Err(failure),
                            }
                        }
                        if tail {
                            tail_sent = tail_tokens;
                            continue;
                        }
                        stripes.sent(index);
                        sent_blocks += 1;
                        let elapsed = prefill_started.elapsed().as_secs_f64();
                        let eta = elapsed / sent_blocks as f64 * (num_blocks - sent_blocks) as f64;
                        let progress = Progress { blocks_done: sent_blocks, blocks_total: num_blocks, bytes_sent, eta_seconds: eta };
                        let _ = events.send(PrefillEvent { event: Some(Event::Progress(progress)) }).await;
                    }
                    Some(PluginEvent::Done { end, stage }) => {
                        let end = match stages.end(stage, end) {
                            Ok(Some(end)) => end,
                            Ok(None) => continue,
                            Err(e) => break Err(fail(Reason::PrefillFailed, format!("plugin: {e}"))),
                        };
                        stage_ms.extend(end.timings_ms);
                        if end.num_tokens as usize != prompt.len() {
                            break Err(fail(Reason::PrefillFailed, format!("captured {} tokens of {}", end.num_tokens, prompt.len())));
                        }
                        break Ok(end.blocks_emitted);
                    }
                    Some(PluginEvent::Error { reason, message }) => break Err(fail(Reason::PrefillFailed, format!("plugin: {reason}: {message}"))),
                    None => break Err(fail(Reason::PrefillFailed, "plugin channel closed")),
                },
                result = &mut prefill, if prefill_done_at.is_none() => {
                    prefill_done_at = Some(Instant::now());
                    stage_ms.insert("prefill".into(), prefill_started.elapsed().as_secs_f64() * 1e3);
                    match result {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => break Err(fail(Reason::PrefillFailed, e.to_string())),
                        Err(e) => break Err(fail(Reason::PrefillFailed, e.to_string())),
                    }
                }
                // The caller went away (its deadline passed, its client left): stop
                // prefilling for nobody; blocks already sent are still sealed below.
                _ = events.closed() => break Err(fail(Reason::Cancelled, "the caller went away")),
                _ = tokio::time::sleep_until(grace) => {
                    let what = if prefill_done_at.is_some() { "no end-of-prefill event from the plugin" } else { "prefill deadline passed" };
                    break Err(fail(Reason::Timeout, what));
                }
            }
        };
        if prefill_done_at.is_none() {
            prefill.abort();
        }
        // Seal with what was actually sent, whatever happened; the decoder
        // keeps every complete block and reports the first gap.
        let receipt = stripes.finish().await.map_err(|s| {
            if s.code() == tonic::Code::FailedPrecondition {
                self.decoders.forget(&decoder.addr);
            }
            fail(
                if s.code() == tonic::Code::FailedPrecondition { Reason::SpecMismatch } else { Reason::TransferFailed },
                s.message().to_owned(),
            )
        })?;
        if let Some(t) = first_block_at {
            stage_ms.insert("wire".into(), t.elapsed().as_secs_f64() * 1e3);
        }
        stage_ms.insert("total".into(), prefill_started.elapsed().as_secs_f64() * 1e3);
        metrics::counter!("pdbridge_stream_bytes_total").increment(bytes_sent);
        metrics::counter!("pdbridge_stream_blocks_total").increment(sent_blocks as u64);
        let tokens_sent = sent_blocks * b + tail_sent;
        if tokens_sent > 0 {
            let per_token = bytes_sent as f64 / f64::from(tokens_sent);
            metrics::gauge!("pdbridge_stream_payload_bytes_per_token").set(per_token);
        }

        let committed = receipt.blocks_committed;
        let (status, reason, detail) = match end {
            Ok(emitted) if committed == num_blocks && emitted == num_blocks => {
                (OutcomeStatus::Bridged, None, receipt.detail)
            }
            Ok(emitted) => (
                OutcomeStatus::Partial,
                Some(Reason::from_proto(receipt.reason()).unwrap_or(Reason::TransferFailed)),
                format!("emitted {emitted} of {num_blocks} blocks; {}", receipt.detail),
            ),
            Err(failure) if committed > 0 => (OutcomeStatus::Partial, Some(failure.reason), failure.message),
            Err(failure) => return Err(failure),
        };
        Ok(Outcome {
            status: status as i32,
            blocks_committed: committed,
            tokens_covered: receipt.first_missing_block * b,
            // A tail is only of use after every block before it.
            tail_tokens: if receipt.tail_committed && committed == num_blocks { tail_tokens } else { 0 },
            bytes: receipt.bytes,
            reason: reason.map_or(pdbridge_common::proto::Reason::Unspecified, Reason::to_proto) as i32,
            detail,
            stage_ms: stage_ms.into_iter().collect(),
        })
    }

    fn router_socket(&self) -> String {
        self.router.socket_path().display().to_string()
    }

    async fn cached_blocks(&self, decoder: &Decoder, job: &Job) -> Result<u32, Failure> {
        let request =
            LookupRequest { token_ids: job.token_ids.clone(), spec_fingerprint: decoder.spec.spec_fingerprint.clone() };
        let reply = decoder.client.clone().lookup(request).await.map_err(|s| {
            if s.code() == tonic::Code::FailedPrecondition {
                self.decoders.forget(&decoder.addr);
                fail(Reason::SpecMismatch, s.message().to_owned())
            } else {
                fail(Reason::DecoderUnreachable, s.message().to_owned())
            }
        })?;
        Ok(reply.into_inner().cached_blocks)
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
            let dtype = Dtype::from_safetensors_name(&t.dtype)
                .ok_or_else(|| fail(Reason::PrefillFailed, format!("dtype {}", t.dtype)))?;
            let id =
                TensorId { block_index: index, layer: t.layer, tensor: t.name.clone(), dtype, shape: t.shape.clone() };
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
            stripes.pushes.push(tokio::spawn(async move { client.push(ReceiverStream::new(rx)).await }));
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
    async fn finish(self) -> Result<PushReceipt, tonic::Status> {
        for (tx, &blocks_emitted) in self.senders.iter().zip(&self.sent) {
            let _ = tx.send(PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted })) }).await;
        }
        drop(self.senders);
        let mut merged = PushReceipt::default();
        let mut details = Vec::new();
        let mut failed = None;
        for push in self.pushes {
            match push.await.map_err(|e| tonic::Status::internal(e.to_string())).and_then(|r| r) {
                Ok(receipt) => {
                    let receipt = receipt.into_inner();
                    merged.blocks_committed += receipt.blocks_committed;
                    merged.bytes += receipt.bytes;
                    // Each stream looks at the store when it ends; the last sees the most.
                    merged.first_missing_block = merged.first_missing_block.max(receipt.first_missing_block);
                    merged.tail_committed |= receipt.tail_committed;
                    if receipt.reason() != pdbridge_common::proto::Reason::Unspecified {
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
