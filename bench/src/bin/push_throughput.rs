//! The shard path alone: `CacheStore.Push` → verify → commit (fsync per
//! block) on loopback, against a real decoded with its real engine (for the
//! spec). Reports GB/s and CPU-seconds per GB on both sides, for HTTP/2 at
//! protocol defaults ("before") and at pd-bridge's tuned settings ("after"),
//! across shard sizes. Payload bytes are synthetic: the store does not
//! interpret cache values.
//!
//!     cargo build --release --bins && target/release/push_throughput --out bench/results

use std::{path::PathBuf, time::Instant};

use bytes::Bytes;
use clap::Parser;
use pdbridge_common::{
    proto::{
        CacheSpec, GetSpecRequest, PushFrame, PushOpen, PushSeal, cache_store_client::CacheStoreClient,
        push_frame::Frame,
    },
    shard::{self, TensorId},
    spec,
};
use pdbridge_tests::{Daemon, Engines, Scratch};
use serde_json::json;
use tokio::sync::mpsc;
use tonic::transport::Endpoint;

#[derive(Parser)]
struct Args {
    /// Blocks pushed per measurement.
    #[arg(long, default_value_t = 48)]
    blocks: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 256)]
    block_tokens: u32,
    /// Shard payload sizes to compare, in KiB.
    #[arg(long, value_delimiter = ',', default_value = "256,1024,4096")]
    shard_kib: Vec<usize>,
    /// Where push_throughput.json goes.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Directory for the stores (e.g. /dev/shm to take the disk out of the measurement).
    #[arg(long)]
    store_root: Option<PathBuf>,
    /// Name of the results file.
    #[arg(long, default_value = "push_throughput.json")]
    name: String,
}

/// HTTP/2 settings of one variant: (name, stream window, connection window, max frame).
const VARIANTS: [(&str, u32, u32, u32); 2] =
    [("protocol defaults", 65_535, 65_535, 16_384), ("tuned", 16 << 20, 64 << 20, 1 << 20)];

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces): utime is 14th, stime 15th overall.
    let after = stat.rsplit_once(')').map(|(_, rest)| rest).unwrap_or_default();
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0)
        + fields.get(12).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // SAFETY: sysconf has no preconditions.
    ticks / unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64
}

fn block_data(spec: &CacheSpec, seed: u64) -> Vec<(TensorId, Bytes)> {
    let mut out = Vec::new();
    for layer in &spec.layers {
        for tensor in &layer.tensors {
            let expected = spec::block_tensor(spec, layer.index, &tensor.name).expect("spec tensor");
            let len = expected.byte_len() as usize;
            let data: Vec<u8> =
                (0..len).map(|i| (i as u64).wrapping_mul(2654435761).wrapping_add(seed) as u8).collect();
            let id = TensorId {
                block_index: 0,
                layer: layer.index,
                tensor: tensor.name.clone(),
                dtype: expected.dtype,
                shape: expected.shape,
            };
            out.push((id, Bytes::from(data)));
        }
    }
    out
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let engines = Engines::locate();
    let mut rows = Vec::new();
    for (variant, stream_window, conn_window, frame) in VARIANTS {
        let scratch = Scratch::new("push-bench");
        let store = match &args.store_root {
            Some(root) => root.join(format!("pdb-push-bench-{}", std::process::id())).join(variant.replace(' ', "-")),
            None => scratch.0.join("store"),
        };
        let http2 = format!(
            "[server.http2]\nstream_window_bytes = {stream_window}\nconnection_window_bytes = {conn_window}\nmax_frame_bytes = {frame}\n"
        );
        let config = engines.decoded_config(&store, args.block_tokens, "[front]\nlisten = \"127.0.0.1:0\"\n");
        // The server section comes first in the config; the http2 table must follow it directly.
        let config = config.replacen("[store]", &format!("{http2}[store]"), 1);
        let decoded = Daemon::start("decoded", &config).await;
        decoded.wait_ready(std::time::Duration::from_secs(300)).await;
        let channel = Endpoint::from_shared(decoded.grpc_uri())
            .unwrap()
            .tcp_nodelay(true)
            .initial_stream_window_size(stream_window)
            .initial_connection_window_size(conn_window)
            .connect()
            .await
            .unwrap();
        let mut client = CacheStoreClient::new(channel).max_encoding_message_size(64 << 20);
        let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
        let template = block_data(&spec, 7);
        for &kib in &args.shard_kib {
            let shard_bytes = kib << 10;
            // Fresh token ids per run: nothing is already cached.
            let base = rows.len() as u32 * 1_000_000;
            let tokens: Vec<u32> = (0..args.blocks * args.block_tokens).map(|t| (base + t) % spec.vocab_size).collect();
            let (tx, rx) = mpsc::channel::<PushFrame>(64);
            let decoded_cpu_before = cpu_seconds(decoded.pid() as u32);
            let client_cpu_before = cpu_seconds(std::process::id());
            let started = Instant::now();
            let mut push_client = client.clone();
            let push =
                tokio::spawn(async move { push_client.push(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
            let open = PushOpen {
                request_id: format!("bench-{kib}"),
                spec_fingerprint: spec.spec_fingerprint.clone(),
                token_ids: tokens,
                first_block: 0,
            };
            tx.send(PushFrame { frame: Some(Frame::Open(open)) }).await.unwrap();
            let mut sent = 0u64;
            for block in 0..args.blocks {
                for (id, data) in &template {
                    let id = TensorId { block_index: block, ..id.clone() };
                    for s in shard::split(&id, data.clone(), shard_bytes) {
                        sent += s.payload.len() as u64;
                        tx.send(PushFrame { frame: Some(Frame::Shard(s)) }).await.unwrap();
                    }
                }
            }
            tx.send(PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted: args.blocks })) }).await.unwrap();
            drop(tx);
            let receipt = push.await.unwrap().expect("push succeeds").into_inner();
            let seconds = started.elapsed().as_secs_f64();
            assert_eq!(receipt.blocks_committed, args.blocks, "{}", receipt.reason);
            let gb = sent as f64 / 1e9;
            let row = json!({
                "variant": variant,
                "stream_window_bytes": stream_window,
                "connection_window_bytes": conn_window,
                "max_frame_bytes": frame,
                "shard_bytes": shard_bytes,
                "blocks": args.blocks,
                "payload_bytes": sent,
                "seconds": seconds,
                "gb_per_s": gb / seconds,
                "gbit_per_s": gb * 8.0 / seconds,
                "decoded_cpu_s_per_gb": (cpu_seconds(decoded.pid() as u32) - decoded_cpu_before) / gb,
                "client_cpu_s_per_gb": (cpu_seconds(std::process::id()) - client_cpu_before) / gb,
                "times_10gbe": gb * 8.0 / seconds / 10.0,
            });
            println!("{row}");
            rows.push(row);
        }
    }
    std::fs::create_dir_all(&args.out).unwrap();
    let machine = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| {
        c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
    });
    let result = json!({
        "benchmark": "push_throughput",
        "what": "CacheStore.Push -> verify (CRC32C, spec) -> commit (safetensors, fsync, rename) on loopback",
        "cpu": machine,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "block_bytes": template_bytes(&rows),
        "store": args.store_root.as_ref().map_or("a temp dir on the machine's disk".to_owned(), |r| r.display().to_string()),
        "rows": rows,
    });
    if let Some(root) = &args.store_root {
        let _ = std::fs::remove_dir_all(root.join(format!("pdb-push-bench-{}", std::process::id())));
    }
    let path = args.out.join(&args.name);
    std::fs::write(&path, serde_json::to_string_pretty(&result).unwrap()).unwrap();
    println!("wrote {}", path.display());
}

fn template_bytes(rows: &[serde_json::Value]) -> u64 {
    rows.first().and_then(|r| Some(r["payload_bytes"].as_u64()? / r["blocks"].as_u64()?)).unwrap_or(0)
}
