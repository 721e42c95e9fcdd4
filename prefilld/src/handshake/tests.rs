use pdbridge_common::proto::{LayerSpec, Rope};

use crate::engine::HfRope;

use super::*;

fn profile() -> ModelProfile {
    ModelProfile {
        architecture: "LlamaForCausalLM".into(),
        num_layers: 2,
        hidden_size: 576,
        vocab_size: 49152,
        ropes: vec![HfRope { kind: "default".into(), theta: 1e5, scaling: Default::default() }; 2],
        tokenizer_fingerprint: "tok".into(),
        per_head_kv: true,
    }
}

fn matching_spec() -> CacheSpec {
    CacheSpec {
        architecture: "LlamaForCausalLM".into(),
        num_layers: 2,
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
    spec.hidden_size = 640;
    spec.tokenizer_fingerprint = "other".into();
    spec.layers[1].rope.as_mut().unwrap().base = 1e4;
    let found = mismatches(&profile(), &spec);
    let joined = found.join("\n");
    for needle in ["hidden size", "tokenizer", "layer 1 rope base"] {
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

/// A decoder that lies: the spec and bundle chunks it serves are the test's.
mod hostile {
    use std::pin::Pin;

    use pdbridge_common::proto::{
        BundleChunk, CacheKind, DecoderCode, Dtype, Extent, LookupRequest, LookupResponse, PushFrame, PushReceipt,
        TensorSpec,
        cache_store_server::{CacheStore, CacheStoreServer},
    };
    use tokio_stream::Stream;
    use tonic::{Request, Response, Status, Streaming};

    use super::*;

    pub struct Hostile {
        pub spec: CacheSpec,
        pub chunks: Vec<BundleChunk>,
        /// Never end the bundle stream after the chunks.
        pub stall: bool,
    }

    type Chunks = Pin<Box<dyn Stream<Item = Result<BundleChunk, Status>> + Send>>;

    #[tonic::async_trait]
    impl CacheStore for Hostile {
        async fn get_spec(&self, _: Request<GetSpecRequest>) -> Result<Response<CacheSpec>, Status> {
            Ok(Response::new(self.spec.clone()))
        }
        type GetBundleStream = Chunks;
        async fn get_bundle(&self, _: Request<GetBundleRequest>) -> Result<Response<Chunks>, Status> {
            let chunks = tokio_stream::iter(self.chunks.clone().into_iter().map(Ok));
            let stream: Chunks = if self.stall {
                Box::pin(tokio_stream::StreamExt::chain(chunks, tokio_stream::pending()))
            } else {
                Box::pin(chunks)
            };
            Ok(Response::new(stream))
        }
        async fn lookup(&self, _: Request<LookupRequest>) -> Result<Response<LookupResponse>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
        async fn push(&self, _: Request<Streaming<PushFrame>>) -> Result<Response<PushReceipt>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    /// A spec prefilld would accept, for `weights` as the bundle's fingerprint.
    pub fn spec(weights: &str) -> CacheSpec {
        let mut spec = matching_spec();
        spec.decoder_code = Some(DecoderCode::default());
        spec.block_tokens = 16;
        for layer in &mut spec.layers {
            layer.set_kind(CacheKind::Rows);
            (layer.rewindable, layer.takes_tail, layer.from_inputs) = (true, true, true);
            layer.tensors = vec![TensorSpec {
                name: "keys".into(),
                dtype: Dtype::F32 as i32,
                shape: vec![1, 3, 1, 64],
                token_axis: 2,
                extent: Extent::PerToken as i32,
            }];
        }
        spec.weights_fingerprint = weights.to_owned();
        spec.spec_fingerprint = spec::fingerprint(&spec);
        spec
    }

    /// Serves `hostile` on a loopback port; its address.
    pub async fn serve(hostile: Hostile) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(CacheStoreServer::new(hostile))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
        );
        format!("http://{addr}")
    }
}

struct Meeting {
    decoders: Decoders,
    addr: String,
    dir: PathBuf,
}

impl Drop for Meeting {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Meeting {
    fn files(&self) -> Vec<String> {
        let listing = std::fs::read_dir(self.dir.join("bundles"))
            .map(|entries| entries.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).collect::<Vec<_>>());
        listing.unwrap_or_default()
    }
}

async fn meet(hostile: hostile::Hostile, limits: HandshakeConfig) -> (Meeting, Result<(), HandshakeError>) {
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("pdb-handshake-{}-{n}", std::process::id()));
    let addr = hostile::serve(hostile).await;
    let dial = DialConfig {
        bundle_dir: dir.join("bundles"),
        http2: Http2Config::default(),
        connections: 1,
        tls: None,
        limits,
        decoders: vec![DecoderConfig { addr: addr.clone(), name: None }],
    };
    let meeting = Meeting { decoders: Decoders::new(profile(), dial), addr, dir };
    let met = meeting.decoders.get(&meeting.addr).await.map(drop);
    (meeting, met)
}

fn chunk(offset: u64, total_bytes: u64, data: &[u8]) -> BundleChunk {
    BundleChunk { offset, total_bytes, data: data.to_vec().into(), sha256: String::new() }
}

fn sha(data: &[u8]) -> String {
    spec::hex(&Sha256::digest(data))
}

use pdbridge_common::proto::BundleChunk;

#[tokio::test]
async fn a_path_in_the_weights_fingerprint_is_refused_before_any_file_is_written() {
    let escape = std::env::temp_dir().join(format!("pdb-escape-{}", std::process::id()));
    let weights = format!("../../../../../../..{}", escape.display());
    let hostile = hostile::Hostile { spec: hostile::spec(&weights), chunks: vec![chunk(0, 3, b"bad")], stall: false };
    let (meeting, met) = meet(hostile, HandshakeConfig::default()).await;
    let err = met.unwrap_err();
    assert!(err.to_string().contains("not 64 hex digits"), "{err}");
    assert!(meeting.files().is_empty());
    assert!(!escape.exists() && !escape.with_extension("partial").exists());
}

#[tokio::test]
async fn a_bundle_over_the_cap_or_its_announced_size_leaves_no_file() {
    let data = vec![7u8; 1000];
    let limits = HandshakeConfig { max_bundle_bytes: 999, ..Default::default() };
    let oversized =
        hostile::Hostile { spec: hostile::spec(&sha(&data)), chunks: vec![chunk(0, 1000, &data)], stall: false };
    let (meeting, met) = meet(oversized, limits).await;
    assert!(met.unwrap_err().to_string().contains("exceeds handshake.max_bundle_bytes"));
    assert!(meeting.files().is_empty(), "{:?}", meeting.files());

    let overflowing = hostile::Hostile {
        spec: hostile::spec(&sha(&data)),
        chunks: vec![chunk(0, 600, &data[..600]), chunk(600, 600, &data[600..])],
        stall: false,
    };
    let (meeting, met) = meet(overflowing, HandshakeConfig::default()).await;
    assert!(met.unwrap_err().to_string().contains("more than the announced 600 bytes"));
    assert!(meeting.files().is_empty(), "{:?}", meeting.files());

    let short =
        hostile::Hostile { spec: hostile::spec(&sha(&data)), chunks: vec![chunk(0, 1000, &data[..10])], stall: false };
    let (meeting, met) = meet(short, HandshakeConfig::default()).await;
    assert!(met.unwrap_err().to_string().contains("10 bytes received of 1000"));
    assert!(meeting.files().is_empty(), "{:?}", meeting.files());

    let forged =
        hostile::Hostile { spec: hostile::spec(&sha(b"other")), chunks: vec![chunk(0, 1000, &data)], stall: false };
    let (meeting, met) = meet(forged, HandshakeConfig::default()).await;
    assert!(met.unwrap_err().to_string().contains("does not match the spec's"));
    assert!(meeting.files().is_empty(), "{:?}", meeting.files());

    let honest =
        hostile::Hostile { spec: hostile::spec(&sha(&data)), chunks: vec![chunk(0, 1000, &data)], stall: false };
    let (meeting, met) = meet(honest, HandshakeConfig::default()).await;
    met.unwrap();
    assert_eq!(meeting.files(), [format!("{}.safetensors", sha(&data))]);
}

#[tokio::test]
async fn a_decoder_that_stalls_the_handshake_is_given_up_on() {
    let data = vec![7u8; 100];
    let limits = HandshakeConfig { timeout: std::time::Duration::from_millis(300), ..Default::default() };
    let stalling =
        hostile::Hostile { spec: hostile::spec(&sha(&data)), chunks: vec![chunk(0, 100, &data[..50])], stall: true };
    let (meeting, met) = meet(stalling, limits).await;
    assert!(met.unwrap_err().to_string().contains("handshake.timeout"));
    assert!(meeting.files().is_empty(), "{:?}", meeting.files());
    // Only configured decoders are ever dialed.
    let err = meeting.decoders.get("http://127.0.0.1:9").await.err().unwrap();
    assert!(err.to_string().contains("not a configured decoder"), "{err}");
}
