//! The shard path alone: `CacheStore.Push` → verify → commit (fsync per
//! block) on loopback, against a real decoded with its real engine (for the
//! spec). Reports GB/s and CPU-seconds per GB on both sides, for HTTP/2 at
//! protocol defaults ("before") and at pd-bridge's tuned settings ("after"),
//! the tuned settings again over mutual TLS (the cost of `[tls]` on the shard
//! path, side by side in one run), across shard sizes and the number of
//! connections a transfer is striped over (prefilld's `stream.connections`).
//! Payload bytes are synthetic: the store does not interpret cache values.
//!
//!     cargo build --release --bins && target/release/push_throughput --out bench/results
//!
//! On a machine without the engines, `bench/twin_model.py` makes a model with
//! the same cache shape (see BENCHMARKS.md).

use std::{
    fs::File,
    io::Write,
    path::{Path, PathBuf},
    time::Instant,
};

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
use pdbridge_tests::{Daemon, Engines, Pki, Scratch};
use serde_json::json;
use tokio::sync::mpsc;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Blocks pushed per measurement (one transfer's tokens must fit the decoder's context).
    #[arg(long, default_value_t = 32)]
    blocks: u32,
    /// Tokens per block.
    #[arg(long, default_value_t = 256)]
    block_tokens: u32,
    /// Shard payload sizes to compare, in KiB (a shard never spans tensors).
    #[arg(long, value_delimiter = ',', default_value = "64,1024")]
    shard_kib: Vec<usize>,
    /// Connections to stripe each transfer over, to compare.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    connections: Vec<usize>,
    /// Where push_throughput.json goes.
    #[arg(long, default_value = "bench/results")]
    out: PathBuf,
    /// Directory for the stores (e.g. /dev/shm to take the disk out of the measurement).
    #[arg(long)]
    store_root: Option<PathBuf>,
    /// Rounds over every variant, shard size and connection count.
    #[arg(long, default_value_t = 2)]
    repeats: u32,
    /// Unrecorded rounds first (the first writes to a fresh store run measurably slower).
    #[arg(long, default_value_t = 1)]
    warmup: u32,
    /// Name of the results file.
    #[arg(long, default_value = "push_throughput.json")]
    name: String,
}

/// One variant: (name, stream window, connection window, max frame, mutual TLS).
type Variant = (&'static str, u32, u32, u32, bool);

const VARIANTS: [Variant; 3] = [
    ("protocol defaults", 65_535, 65_535, 16_384, false),
    ("tuned", 16 << 20, 64 << 20, 1 << 20, false),
    ("tuned + mutual TLS", 16 << 20, 64 << 20, 1 << 20, true),
];

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
    let pki = Pki::new(&["prefill-1", "mac-1"]).await;
    // One decoded per variant, all up at once, measured in turn for every shard size and
    // connection count (and `--repeats` rounds): a machine that slows down over the run slows
    // every variant alike, so the ratios between them hold.
    let scratch = Scratch::new("push-bench");
    let mut setups = Vec::new();
    for variant in VARIANTS {
        setups.push(Setup::start(variant, &args, &engines, &pki, &scratch).await);
    }
    let spec = setups[0].spec.clone();
    assert!(
        args.blocks * spec.block_tokens <= spec.max_context,
        "--blocks {} of {} tokens exceed the decoder's context of {}: decoded refuses such a Push",
        args.blocks,
        spec.block_tokens,
        spec.max_context
    );
    let template = block_data(&spec, 7);
    let mut rows = Vec::new();
    // Every transfer pushes fresh token ids: nothing is already cached.
    let mut transfers = 0u32;
    for round in 0..args.warmup + args.repeats {
        let recorded = round >= args.warmup;
        for &kib in &args.shard_kib {
            for &connections in &args.connections {
                for setup in &setups {
                    let (variant, stream_window, conn_window, frame, tls) = setup.variant;
                    let run =
                        Run { spec: &setup.spec, template: &template, blocks: args.blocks, shard_bytes: kib << 10 };
                    let mut row = run.measure(&setup.clients[..connections], transfers, &setup.decoded).await;
                    transfers += 1;
                    row["variant"] = json!(variant);
                    row["tls"] = json!(tls);
                    row["repeat"] = json!(round.saturating_sub(args.warmup));
                    row["stream_window_bytes"] = json!(stream_window);
                    row["connection_window_bytes"] = json!(conn_window);
                    row["max_frame_bytes"] = json!(frame);
                    if recorded {
                        println!("{row}");
                        rows.push(row);
                    }
                }
            }
        }
    }
    drop(setups);
    std::fs::create_dir_all(&args.out).unwrap();
    let machine = std::fs::read_to_string("/proc/cpuinfo").ok().and_then(|c| {
        c.lines().find(|l| l.starts_with("model name")).map(|l| l.split(':').nth(1).unwrap_or("").trim().to_owned())
    });
    // The same write pattern without decoded: what the store's file system allows.
    let floor_dir =
        args.store_root.clone().unwrap_or_else(std::env::temp_dir).join(format!("pdb-floor-{}", std::process::id()));
    let block_bytes = template_bytes(&rows) as usize;
    let floor: serde_json::Map<_, _> = [1, 8]
        .into_iter()
        .map(|threads| {
            (threads.to_string(), json!(store_floor(&floor_dir, block_bytes, args.blocks as usize, threads)))
        })
        .collect();
    println!("store floor GB/s by writer threads: {floor:?}");
    let result = json!({
        "benchmark": "push_throughput",
        "what": "CacheStore.Push -> verify (CRC32C, spec) -> commit (safetensors, fsync, rename) on loopback",
        "cpu": machine,
        "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        "block_bytes": template_bytes(&rows),
        "store": args.store_root.as_ref().map_or("a temp dir on the machine's disk".to_owned(), |r| r.display().to_string()),
        "store_floor_gb_per_s_by_threads": floor,
        "rows": rows,
    });
    if let Some(root) = &args.store_root {
        let _ = std::fs::remove_dir_all(root.join(format!("pdb-push-bench-{}", std::process::id())));
    }
    let path = args.out.join(&args.name);
    std::fs::write(&path, serde_json::to_string_pretty(&result).unwrap()).unwrap();
    println!("wrote {}", path.display());
}

/// A decoded configured for one variant, and clients on every connection a row may use.
struct Setup {
    variant: Variant,
    decoded: Daemon,
    clients: Vec<CacheStoreClient<Channel>>,
    spec: CacheSpec,
}

impl Setup {
    async fn start(variant: Variant, args: &Args, engines: &Engines, pki: &Pki, scratch: &Scratch) -> Setup {
        let (name, stream_window, conn_window, frame, tls) = variant;
        let dir_name = name.replace([' ', '+'], "-");
        let store = match &args.store_root {
            Some(root) => root.join(format!("pdb-push-bench-{}", std::process::id())).join(&dir_name),
            None => scratch.0.join(&dir_name),
        };
        let http2 = format!(
            "[server.http2]\nstream_window_bytes = {stream_window}\nconnection_window_bytes = {conn_window}\nmax_frame_bytes = {frame}\n"
        );
        let tls_section = if tls { pki.section("mac-1", &["prefill-1"]) } else { String::new() };
        let front = format!("[front]\nlisten = \"127.0.0.1:0\"\n{tls_section}");
        let config = engines.decoded_config(&store, args.block_tokens, &front);
        // The server section comes first in the config; the http2 table must follow it directly.
        // 2 GiB per store: three stores of a whole run would not fit a small machine's tmpfs.
        let config = config.replacen("[store]", &format!("{http2}[store]\nbudget_bytes = {}", 2u64 << 30), 1);
        let decoded = Daemon::start("decoded", &config).await;
        decoded.wait_ready(std::time::Duration::from_secs(300)).await;
        let mut clients = Vec::new();
        for _ in 0..args.connections.iter().copied().max().unwrap_or(1) {
            let client_tls = tls.then(|| pki.client("prefill-1"));
            let channel = pdbridge_common::tls::endpoint(&decoded.grpc_uri(), client_tls.as_ref(), Some("mac-1"))
                .unwrap()
                .tcp_nodelay(true)
                .initial_stream_window_size(stream_window)
                .initial_connection_window_size(conn_window)
                .connect()
                .await
                .unwrap();
            clients.push(CacheStoreClient::new(channel).max_encoding_message_size(64 << 20));
        }
        let spec = clients[0].get_spec(GetSpecRequest {}).await.unwrap().into_inner();
        Setup { variant, decoded, clients, spec }
    }
}

/// One measured transfer of `blocks` fresh blocks.
struct Run<'a> {
    spec: &'a CacheSpec,
    template: &'a [(TensorId, Bytes)],
    blocks: u32,
    shard_bytes: usize,
}

impl Run<'_> {
    /// Pushes the blocks striped over `clients` the way prefilld does (block
    /// i on connection i mod n, one producer) and measures it.
    async fn measure(&self, clients: &[CacheStoreClient<Channel>], run: u32, decoded: &Daemon) -> serde_json::Value {
        let block_tokens = self.spec.block_tokens;
        // Fresh token ids per run: nothing is already cached.
        let tokens: Vec<u32> =
            (0..self.blocks * block_tokens).map(|t| (run * 1_000_000 + t) % self.spec.vocab_size).collect();
        let open = PushOpen {
            request_id: format!("bench-{run}"),
            spec_fingerprint: self.spec.spec_fingerprint.clone(),
            token_ids: tokens,
            first_block: 0,
            tail_tokens: 0,
            ..Default::default()
        };
        let decoded_cpu_before = cpu_seconds(decoded.pid() as u32);
        let client_cpu_before = cpu_seconds(std::process::id());
        let started = Instant::now();
        let mut senders = Vec::new();
        let mut pushes = Vec::new();
        for client in clients {
            let (tx, rx) = mpsc::channel::<PushFrame>(64);
            let mut client = client.clone();
            pushes
                .push(tokio::spawn(async move { client.push(tokio_stream::wrappers::ReceiverStream::new(rx)).await }));
            tx.send(PushFrame { frame: Some(Frame::Open(open.clone())) }).await.unwrap();
            senders.push(tx);
        }
        let mut sent = 0u64;
        for block in 0..self.blocks {
            let tx = &senders[block as usize % senders.len()];
            for (id, data) in self.template {
                let id = TensorId { block_index: block, ..id.clone() };
                for s in shard::split(&id, data.clone(), self.shard_bytes) {
                    sent += s.payload.len() as u64;
                    tx.send(PushFrame { frame: Some(Frame::Shard(s)) }).await.unwrap();
                }
            }
        }
        for (i, tx) in senders.into_iter().enumerate() {
            let blocks_emitted = (i as u32..self.blocks).step_by(clients.len()).count() as u32;
            tx.send(PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted })) }).await.unwrap();
        }
        let mut committed = 0;
        for push in pushes {
            let receipt = push.await.unwrap().expect("push succeeds").into_inner();
            assert!(receipt.detail.is_empty(), "{}", receipt.detail);
            committed += receipt.blocks_committed;
        }
        let seconds = started.elapsed().as_secs_f64();
        assert_eq!(committed, self.blocks);
        let gb = sent as f64 / 1e9;
        json!({
            "connections": clients.len(),
            "shard_bytes": self.shard_bytes,
            "blocks": self.blocks,
            "payload_bytes": sent,
            "seconds": seconds,
            "gb_per_s": gb / seconds,
            "gbit_per_s": gb * 8.0 / seconds,
            "decoded_cpu_s_per_gb": (cpu_seconds(decoded.pid() as u32) - decoded_cpu_before) / gb,
            "client_cpu_s_per_gb": (cpu_seconds(std::process::id()) - client_cpu_before) / gb,
            "times_10gbe": gb * 8.0 / seconds / 10.0,
        })
    }
}

/// The file system's own rate for the store's write pattern, no daemon:
/// `blocks` files of `block_bytes`, each written, fsynced, renamed and its
/// directory fsynced, by `threads` writers. No Push can beat it.
fn store_floor(dir: &Path, block_bytes: usize, blocks: usize, threads: usize) -> f64 {
    let (tmp, done) = (dir.join("tmp"), dir.join("blocks"));
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::create_dir_all(&done).unwrap();
    let data = vec![0x5au8; block_bytes];
    let started = Instant::now();
    std::thread::scope(|scope| {
        for t in 0..threads {
            let (data, tmp, done) = (&data, &tmp, &done);
            scope.spawn(move || {
                for i in (t..blocks).step_by(threads) {
                    let (partial, dest) = (tmp.join(i.to_string()), done.join(i.to_string()));
                    let mut file = File::create(&partial).unwrap();
                    file.write_all(data).unwrap();
                    file.sync_all().unwrap();
                    std::fs::rename(&partial, &dest).unwrap();
                    File::open(done).and_then(|d| d.sync_all()).unwrap();
                }
            });
        }
    });
    let gb_per_s = (block_bytes * blocks) as f64 / 1e9 / started.elapsed().as_secs_f64();
    let _ = std::fs::remove_dir_all(dir);
    gb_per_s
}

fn template_bytes(rows: &[serde_json::Value]) -> u64 {
    rows.first().and_then(|r| Some(r["payload_bytes"].as_u64()? / r["blocks"].as_u64()?)).unwrap_or(0)
}
