//! One bridged prefill, end to end: ask the decoder what it already has, run
//! the prompt through vLLM with the capture plugin, turn each finished block
//! into shards as it arrives and stream them into the decoder's `Push`, and
//! report progress and exactly one outcome.
//!
//! [`Bridge::run`] (here) meets the decoder and makes a `Plan` (`plan`: which
//! blocks, which tail); a `Transfer` (`transfer`) opens the Push streams, posts
//! the prompt to vLLM and relays the plugin's blocks until its end or the first
//! failure, then seals the streams; `transfer::settle`, a pure function, decides
//! the outcome from what the plugin emitted and what the decoder committed.
//! `link` paces the streams to an emulated link rate.

use std::{sync::Arc, time::Duration};

use bytes::Bytes;
use pdbridge_common::{
    metric,
    proto::{
        CacheSpec, LookupRequest, Outcome, Payload, PrefillEvent, PushFrame, Route,
        engine::{PluginFailure, PluginParams},
        outcome::Status as OutcomeStatus,
        prefill_event::Event,
        push_frame::Frame,
    },
    reason::Reason,
    shard::{self, TensorId},
    spec, telemetry, traces,
};
use tokio::{sync::mpsc, time::Instant};
use tracing::{Instrument, Span};

use crate::{
    capture::{Registration, Router, StageError, TensorSlice},
    config::StreamConfig,
    engine::Vllm,
    handshake::{Decoder, Decoders},
};

/// A bridge's detail when vLLM stopped answering its liveness probe mid-way.
const STALLED: &str = "the prefill engine stopped answering (engine.liveness)";

/// Longest the plugin may stay silent once vLLM has answered (its end event or more blocks owed).
const END_EVENT_GRACE: Duration = Duration::from_secs(30);

mod link;
mod plan;
mod transfer;

pub use link::Link;
use plan::Plan;
use transfer::{Transfer, send};

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
        let _in_flight = telemetry::InFlight::enter(metric::PREFILL_IN_FLIGHT.name);
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
        self.route_problem(&decoder.spec, job.payload).map_err(|problem| fail(Reason::UnsupportedModel, problem))?;
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

    /// How a job asking for `payload` is served: the layer inputs themselves (exact), or vLLM's
    /// route.
    fn route(&self, payload: Payload) -> Route {
        if payload == Payload::LayerInputs { Route::Exact } else { self.vllm.route }
    }

    /// Why this vLLM cannot serve the decoder's spec with `payload`: the exact route needs the
    /// capture, which a vLLM started for the kv route does not run; the kv route needs layers
    /// that cache per-head K/V.
    fn route_problem(&self, spec: &CacheSpec, payload: Payload) -> Result<(), String> {
        if self.vllm.route != Route::Kv {
            return Ok(());
        }
        if payload == Payload::LayerInputs {
            return Err("layer inputs need the capture, which vLLM runs on the reconstruct route \
                        (engine.route = \"reconstruct\"); this one runs the kv route"
                .into());
        }
        match spec::kv_unsupported(spec) {
            problems if problems.is_empty() => Ok(()),
            problems => Err(format!("the kv route (engine.route) cannot serve {}", problems.join("; "))),
        }
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
            route: self.route(job.payload) as i32,
            // What the kv route lays vLLM's K/V out as.
            spec: (self.vllm.route == Route::Kv).then(|| decoder.spec.clone()),
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
    metrics::counter!(metric::PLUGIN_FAILURES.name, "failure" => name.clone()).increment(1);
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
    metrics::counter!(metric::PREFILL_REQUESTS.name, "outcome" => label, "reason" => reason).increment(1);
    metrics::histogram!(metric::PREFILL_DURATION.name).record(elapsed.as_secs_f64());
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
    // `ring_wait`: the plugin's steps held back by a full ring, the link slower than the prefill.
    for stage in ["prefill", "capture", "reconstruct", "ring_wait", "wire"] {
        if let Some(ms) = outcome.stage_ms.get(stage) {
            telemetry::record_stage(stage, ms / 1e3);
        }
    }
}

#[cfg(test)]
mod tests;
