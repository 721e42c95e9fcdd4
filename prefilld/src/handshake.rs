//! Meeting a decoder: fetch its cache spec and reconstruction bundle, and
//! refuse to bridge unless the prefill engine's model agrees with it.
//!
//! A silent mismatch (another RoPE base, another tokenizer, another layer
//! count) would produce wrong answers, not errors, so every field the
//! reconstruction depends on is compared and every disagreement is named.

use std::{
    collections::HashMap,
    path::PathBuf,
    sync::{Arc, Mutex},
};

use pdbridge_common::{
    config::Http2Config,
    proto::{CacheSpec, GetBundleRequest, GetSpecRequest, cache_store_client::CacheStoreClient},
    reason::Reason,
    spec,
    tls::{self, Tls},
};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tonic::transport::Channel;

use crate::{
    config::{DecoderConfig, HandshakeConfig},
    engine::ModelProfile,
};

#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("decoder {addr} unreachable: {message}")]
    Unreachable { addr: String, message: String },
    #[error("decoder {addr} disagrees with the prefill model: {}", mismatches.join("; "))]
    SpecMismatch { addr: String, mismatches: Vec<String> },
    #[error("decoder {addr} runs a model whose cache cannot be bridged: {}", layers.join("; "))]
    Unsupported { addr: String, layers: Vec<String> },
    #[error("decoder {addr} bundle: {message}")]
    Bundle { addr: String, message: String },
}

impl HandshakeError {
    pub fn reason(&self) -> Reason {
        match self {
            HandshakeError::Unreachable { .. } | HandshakeError::Bundle { .. } => Reason::DecoderUnreachable,
            HandshakeError::SpecMismatch { .. } => Reason::SpecMismatch,
            HandshakeError::Unsupported { .. } => Reason::UnsupportedModel,
        }
    }
}

/// A decoder prefilld has met.
pub struct Decoder {
    pub addr: String,
    pub spec: CacheSpec,
    pub bundle_path: PathBuf,
    pub client: CacheStoreClient<Channel>,
    /// Clients on separate connections (the first is `client`'s) that Push
    /// streams are striped over: one HTTP/2 connection is read by one task
    /// at each end, so one connection caps a transfer at one core's rate.
    pub push_clients: Vec<CacheStoreClient<Channel>>,
}

/// Every disagreement between the prefill model and a decoder's spec.
pub fn mismatches(profile: &ModelProfile, spec: &CacheSpec) -> Vec<String> {
    fn differ(out: &mut Vec<String>, what: &str, ours: impl ToString, theirs: impl ToString) {
        let (ours, theirs) = (ours.to_string(), theirs.to_string());
        if ours != theirs {
            out.push(format!("{what}: prefill {ours}, decoder {theirs}"));
        }
    }
    let mut out = Vec::new();
    differ(&mut out, "architecture", &profile.architecture, &spec.architecture);
    differ(&mut out, "layers", profile.num_layers, spec.num_layers);
    differ(&mut out, "hidden size", profile.hidden_size, spec.hidden_size);
    differ(&mut out, "vocab", profile.vocab_size, spec.vocab_size);
    differ(&mut out, "tokenizer", &profile.tokenizer_fingerprint, &spec.tokenizer_fingerprint);
    // The decoder's rope is what its instantiated modules apply; an engine that
    // ignores a config key it does not know would otherwise run another model.
    for layer in &spec.layers {
        let (Some(rope), Some(ours)) = (&layer.rope, profile.ropes.get(layer.index as usize)) else { continue };
        let what = |field: &str| format!("layer {} rope {field}", layer.index);
        differ(&mut out, &what("base"), ours.theta, rope.base);
        differ(&mut out, &what("type"), &ours.kind, &rope.kind);
        if rope.kind != "default" {
            differ(&mut out, &what("scaling"), format!("{:?}", ours.scaling), format!("{:?}", rope.scaling));
        }
    }
    out
}

/// The configured decoders, and those met so far.
pub struct Decoders {
    profile: ModelProfile,
    bundle_dir: PathBuf,
    http2: Http2Config,
    connections: usize,
    tls: Option<Tls>,
    limits: HandshakeConfig,
    /// Every decoder prefilld may dial, by address, each with the lock that
    /// lets one meeting at a time talk to it.
    configured: HashMap<String, (DecoderConfig, tokio::sync::Mutex<()>)>,
    met: Mutex<HashMap<String, Arc<Decoder>>>,
}

/// What the handshake needs besides the model: where bundles go, how to dial.
pub struct DialConfig {
    pub bundle_dir: PathBuf,
    pub http2: Http2Config,
    /// How many connections each decoder's Push streams are striped over.
    pub connections: usize,
    pub tls: Option<Tls>,
    pub limits: HandshakeConfig,
    pub decoders: Vec<DecoderConfig>,
}

impl Decoders {
    pub fn new(profile: ModelProfile, dial: DialConfig) -> Self {
        let configured =
            dial.decoders.into_iter().map(|d| (d.addr.clone(), (d, tokio::sync::Mutex::new(())))).collect();
        Decoders {
            profile,
            bundle_dir: dial.bundle_dir,
            http2: dial.http2,
            connections: dial.connections,
            tls: dial.tls,
            limits: dial.limits,
            configured,
            met: Mutex::new(HashMap::new()),
        }
    }

    /// The decoder at `addr`, meeting it first if needed. Only configured
    /// decoders are ever dialed; one meeting per decoder runs at a time.
    pub async fn get(&self, addr: &str) -> Result<Arc<Decoder>, HandshakeError> {
        if let Some(decoder) = self.met.lock().unwrap().get(addr) {
            return Ok(decoder.clone());
        }
        let Some((config, meeting)) = self.configured.get(addr) else {
            return Err(HandshakeError::Unreachable {
                addr: addr.to_owned(),
                message: "not a configured decoder".into(),
            });
        };
        let _meeting = meeting.lock().await;
        // Whoever held the lock may have met it meanwhile.
        if let Some(decoder) = self.met.lock().unwrap().get(addr) {
            return Ok(decoder.clone());
        }
        let met = tokio::time::timeout(self.limits.timeout, self.meet(config)).await.unwrap_or_else(|_| {
            Err(HandshakeError::Unreachable {
                addr: addr.to_owned(),
                message: format!("no spec and bundle within handshake.timeout ({:?})", self.limits.timeout),
            })
        });
        let decoder = Arc::new(met?);
        self.met.lock().unwrap().insert(addr.to_owned(), decoder.clone());
        Ok(decoder)
    }

    /// Meets the decoder at `addr` if needed, or checks that the one already
    /// met still publishes the same spec (forgetting it when not).
    pub async fn recheck(&self, addr: &str) -> Result<(), HandshakeError> {
        let known = self.met.lock().unwrap().get(addr).cloned();
        let Some(decoder) = known else { return self.get(addr).await.map(drop) };
        let current = decoder.client.clone().get_spec(GetSpecRequest {}).await;
        match current {
            Ok(spec) if spec.get_ref().spec_fingerprint == decoder.spec.spec_fingerprint => Ok(()),
            Ok(_) => {
                self.forget(addr);
                self.get(addr).await.map(drop)
            }
            Err(status) => {
                self.forget(addr);
                Err(HandshakeError::Unreachable { addr: addr.to_owned(), message: status.message().to_owned() })
            }
        }
    }

    /// Forgets a decoder whose spec changed (a Push or Lookup refused with `spec_mismatch`).
    pub fn forget(&self, addr: &str) {
        self.met.lock().unwrap().remove(addr);
    }

    async fn meet(&self, config: &DecoderConfig) -> Result<Decoder, HandshakeError> {
        let addr = config.addr.as_str();
        let unreachable = |message: String| HandshakeError::Unreachable { addr: addr.to_owned(), message };
        let endpoint = tls::endpoint(addr, self.tls.as_ref(), config.name.as_deref())
            .map_err(unreachable)?
            .tcp_nodelay(true)
            .initial_stream_window_size(self.http2.stream_window_bytes)
            .initial_connection_window_size(self.http2.connection_window_bytes);
        let mut push_clients = Vec::with_capacity(self.connections);
        for _ in 0..self.connections {
            let channel = endpoint.connect().await.map_err(|e| unreachable(pdbridge_common::error_chain(&e)))?;
            push_clients.push(
                CacheStoreClient::new(channel)
                    .max_decoding_message_size(self.http2.max_message_bytes)
                    .max_encoding_message_size(self.http2.max_message_bytes),
            );
        }
        let mut client = push_clients[0].clone();
        let spec =
            client.get_spec(GetSpecRequest {}).await.map_err(|s| unreachable(s.message().to_owned()))?.into_inner();
        let malformed =
            |what: &str| HandshakeError::SpecMismatch { addr: addr.to_owned(), mismatches: vec![what.into()] };
        if !spec::is_fingerprint(&spec.spec_fingerprint) || !spec::is_fingerprint(&spec.weights_fingerprint) {
            return Err(malformed("spec or weights fingerprint is not 64 hex digits"));
        }
        if spec::fingerprint(&spec) != spec.spec_fingerprint {
            return Err(malformed("spec fingerprint does not match its contents"));
        }
        let layers = spec::unsupported(&spec);
        if !layers.is_empty() {
            return Err(HandshakeError::Unsupported { addr: addr.to_owned(), layers });
        }
        let mismatches = mismatches(&self.profile, &spec);
        if !mismatches.is_empty() {
            return Err(HandshakeError::SpecMismatch { addr: addr.to_owned(), mismatches });
        }
        let bundle_path = self
            .fetch_bundle(&mut client, &spec)
            .await
            .map_err(|message| HandshakeError::Bundle { addr: addr.to_owned(), message })?;
        tracing::info!(decoder = addr, spec = %spec.spec_fingerprint, bundle = %bundle_path.display(), "decoder met");
        Ok(Decoder { addr: addr.to_owned(), spec, bundle_path, client, push_clients })
    }

    /// Streams the bundle to `<bundle_dir>/<sha256>.safetensors` (kept across
    /// restarts: the name is its checksum) and verifies it. The size is
    /// announced up front and held to `handshake.max_bundle_bytes`; whatever
    /// goes wrong, no partial file stays behind.
    async fn fetch_bundle(&self, client: &mut CacheStoreClient<Channel>, spec: &CacheSpec) -> Result<PathBuf, String> {
        // `weights_fingerprint` is 64 hex digits (checked by the caller): a plain file name.
        let path = self.bundle_dir.join(format!("{}.safetensors", spec.weights_fingerprint));
        if path.is_file() {
            return Ok(path);
        }
        tokio::fs::create_dir_all(&self.bundle_dir).await.map_err(|e| e.to_string())?;
        let request = GetBundleRequest { spec_fingerprint: spec.spec_fingerprint.clone() };
        let mut chunks = client.get_bundle(request).await.map_err(|s| s.message().to_owned())?.into_inner();
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        let mut total = None;
        // Created once the first chunk's announced size is accepted.
        let mut out: Option<(Partial, tokio::io::BufWriter<tokio::fs::File>)> = None;
        while let Some(chunk) = chunks.message().await.map_err(|s| s.message().to_owned())? {
            let announced = *total.get_or_insert(chunk.total_bytes);
            if chunk.total_bytes != announced {
                return Err(format!("total_bytes changed from {announced} to {}", chunk.total_bytes));
            }
            if announced > self.limits.max_bundle_bytes {
                return Err(format!(
                    "bundle of {announced} bytes exceeds handshake.max_bundle_bytes ({})",
                    self.limits.max_bundle_bytes
                ));
            }
            if chunk.offset != written {
                return Err(format!("chunk at {} where {written} was expected", chunk.offset));
            }
            if written + chunk.data.len() as u64 > announced {
                return Err(format!("more than the announced {announced} bytes"));
            }
            let (_, file) = match &mut out {
                Some(out) => out,
                None => {
                    let (partial, file) = Partial::create(path.with_extension("partial")).await?;
                    out.insert((partial, tokio::io::BufWriter::new(file)))
                }
            };
            hasher.update(&chunk.data);
            file.write_all(&chunk.data).await.map_err(|e| e.to_string())?;
            written += chunk.data.len() as u64;
        }
        let (Some((partial, mut file)), Some(total)) = (out, total) else { return Err("an empty bundle".into()) };
        if written != total {
            return Err(format!("{written} bytes received of {total}"));
        }
        file.flush().await.map_err(|e| e.to_string())?;
        file.get_ref().sync_all().await.map_err(|e| e.to_string())?;
        let digest = spec::hex(&hasher.finalize());
        if digest != spec.weights_fingerprint {
            return Err(format!("checksum {digest} does not match the spec's {}", spec.weights_fingerprint));
        }
        partial.commit(&path).await?;
        Ok(path)
    }
}

/// A download in progress, removed unless committed under its final name.
struct Partial {
    path: PathBuf,
    committed: bool,
}

impl Partial {
    /// Truncates a leftover of a crashed run.
    async fn create(path: PathBuf) -> Result<(Self, tokio::fs::File), String> {
        let file = tokio::fs::File::create(&path).await.map_err(|e| format!("{}: {e}", path.display()))?;
        Ok((Partial { path, committed: false }, file))
    }

    async fn commit(mut self, to: &std::path::Path) -> Result<(), String> {
        tokio::fs::rename(&self.path, to).await.map_err(|e| e.to_string())?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests;
