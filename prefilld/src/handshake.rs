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
    spec,
};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tonic::transport::{Channel, Endpoint};

use crate::engine::ModelProfile;

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
    /// Machine-readable reason for verdicts and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Unreachable { .. } => "decoder_unavailable",
            HandshakeError::SpecMismatch { .. } => "spec_mismatch",
            HandshakeError::Unsupported { .. } => "unsupported_model",
            HandshakeError::Bundle { .. } => "bundle_failed",
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
    differ(&mut out, "attention heads", profile.num_attention_heads, spec.num_attention_heads);
    differ(&mut out, "kv heads", profile.num_kv_heads, spec.num_kv_heads);
    differ(&mut out, "head dim", profile.head_dim, spec.head_dim);
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

/// Decoders met so far, by address.
pub struct Decoders {
    profile: ModelProfile,
    bundle_dir: PathBuf,
    http2: Http2Config,
    connections: usize,
    met: Mutex<HashMap<String, Arc<Decoder>>>,
}

impl Decoders {
    /// `connections`: how many connections each decoder's Push streams are
    /// striped over.
    pub fn new(profile: ModelProfile, bundle_dir: PathBuf, http2: Http2Config, connections: usize) -> Self {
        Decoders { profile, bundle_dir, http2, connections, met: Mutex::new(HashMap::new()) }
    }

    /// The decoder at `addr`, meeting it first if needed.
    pub async fn get(&self, addr: &str) -> Result<Arc<Decoder>, HandshakeError> {
        if let Some(decoder) = self.met.lock().unwrap().get(addr) {
            return Ok(decoder.clone());
        }
        let decoder = Arc::new(self.meet(addr).await?);
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

    /// Forgets a decoder whose spec changed (it answered FAILED_PRECONDITION).
    pub fn forget(&self, addr: &str) {
        self.met.lock().unwrap().remove(addr);
    }

    async fn meet(&self, addr: &str) -> Result<Decoder, HandshakeError> {
        let unreachable = |message: String| HandshakeError::Unreachable { addr: addr.to_owned(), message };
        let endpoint = Endpoint::from_shared(addr.to_owned())
            .map_err(|e| unreachable(e.to_string()))?
            .tcp_nodelay(true)
            .initial_stream_window_size(self.http2.stream_window_bytes)
            .initial_connection_window_size(self.http2.connection_window_bytes);
        let mut push_clients = Vec::with_capacity(self.connections);
        for _ in 0..self.connections {
            let channel = endpoint.connect().await.map_err(|e| unreachable(e.to_string()))?;
            push_clients.push(
                CacheStoreClient::new(channel)
                    .max_decoding_message_size(self.http2.max_message_bytes)
                    .max_encoding_message_size(self.http2.max_message_bytes),
            );
        }
        let mut client = push_clients[0].clone();
        let spec =
            client.get_spec(GetSpecRequest {}).await.map_err(|s| unreachable(s.message().to_owned()))?.into_inner();
        if spec::fingerprint(&spec) != spec.spec_fingerprint {
            return Err(HandshakeError::SpecMismatch {
                addr: addr.to_owned(),
                mismatches: vec!["spec fingerprint does not match its contents".into()],
            });
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
    /// restarts: the name is its checksum) and verifies it.
    async fn fetch_bundle(&self, client: &mut CacheStoreClient<Channel>, spec: &CacheSpec) -> Result<PathBuf, String> {
        let path = self.bundle_dir.join(format!("{}.safetensors", spec.weights_fingerprint));
        if path.is_file() {
            return Ok(path);
        }
        tokio::fs::create_dir_all(&self.bundle_dir).await.map_err(|e| e.to_string())?;
        let request = GetBundleRequest { spec_fingerprint: spec.spec_fingerprint.clone() };
        let mut chunks = client.get_bundle(request).await.map_err(|s| s.message().to_owned())?.into_inner();
        let tmp = path.with_extension("partial");
        let mut file = tokio::fs::File::create(&tmp).await.map_err(|e| e.to_string())?;
        let mut hasher = Sha256::new();
        let mut written = 0u64;
        while let Some(chunk) = chunks.message().await.map_err(|s| s.message().to_owned())? {
            if chunk.offset != written {
                return Err(format!("chunk at {} where {written} was expected", chunk.offset));
            }
            hasher.update(&chunk.data);
            file.write_all(&chunk.data).await.map_err(|e| e.to_string())?;
            written += chunk.data.len() as u64;
        }
        file.sync_all().await.map_err(|e| e.to_string())?;
        let digest = spec::hex(&hasher.finalize());
        if digest != spec.weights_fingerprint {
            let _ = tokio::fs::remove_file(&tmp).await;
            return Err(format!("checksum {digest} does not match the spec's {}", spec.weights_fingerprint));
        }
        tokio::fs::rename(&tmp, &path).await.map_err(|e| e.to_string())?;
        Ok(path)
    }
}

#[cfg(test)]
mod tests {
    use pdbridge_common::proto::{LayerSpec, Rope};

    use crate::engine::HfRope;

    use super::*;

    fn profile() -> ModelProfile {
        ModelProfile {
            architecture: "LlamaForCausalLM".into(),
            num_layers: 2,
            num_attention_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            hidden_size: 576,
            vocab_size: 49152,
            ropes: vec![HfRope { kind: "default".into(), theta: 1e5, scaling: Default::default() }; 2],
            tokenizer_fingerprint: "tok".into(),
        }
    }

    fn matching_spec() -> CacheSpec {
        CacheSpec {
            architecture: "LlamaForCausalLM".into(),
            num_layers: 2,
            num_attention_heads: 9,
            num_kv_heads: 3,
            head_dim: 64,
            hidden_size: 576,
            vocab_size: 49152,
            tokenizer_fingerprint: "tok".into(),
            layers: (0..2)
                .map(|index| LayerSpec {
                    index,
                    cache_class: "KVCache".into(),
                    rope: Some(Rope { kind: "default".into(), base: 1e5, dims: 64, ..Default::default() }),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_matching_spec_has_no_mismatches() {
        assert_eq!(mismatches(&profile(), &matching_spec()), Vec::<String>::new());
    }

    #[test]
    fn every_disagreement_is_named() {
        let mut spec = matching_spec();
        spec.num_kv_heads = 4;
        spec.tokenizer_fingerprint = "other".into();
        spec.layers[1].rope.as_mut().unwrap().base = 1e4;
        let found = mismatches(&profile(), &spec);
        let joined = found.join("\n");
        for needle in ["kv heads", "tokenizer", "layer 1 rope base"] {
            assert!(joined.contains(needle), "{needle} not reported in:\n{joined}");
        }
        assert_eq!(found.len(), 3, "{joined}");
    }

    #[test]
    fn a_decoder_that_ignores_rope_scaling_is_refused() {
        // vLLM applies llama3 scaling; the decoder's modules apply plain RoPE (an engine that
        // does not know a config key): two different models, so the handshake must say so.
        let mut scaled = profile();
        for rope in &mut scaled.ropes {
            rope.kind = "llama3".into();
            rope.scaling = [("factor".to_owned(), 8.0), ("low_freq_factor".to_owned(), 1.0)].into();
        }
        let found = mismatches(&scaled, &matching_spec());
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found[0].contains("layer 0 rope type: prefill llama3, decoder default"), "{found:?}");

        let mut spec = matching_spec();
        for layer in &mut spec.layers {
            let rope = layer.rope.as_mut().unwrap();
            rope.kind = "llama3".into();
            rope.scaling = scaled.ropes[0].scaling.clone();
        }
        assert_eq!(mismatches(&scaled, &spec), Vec::<String>::new());
        spec.layers[1].rope.as_mut().unwrap().scaling.insert("factor".into(), 4.0);
        let found = mismatches(&scaled, &spec);
        assert!(found.len() == 1 && found[0].starts_with("layer 1 rope scaling"), "{found:?}");
    }
}
