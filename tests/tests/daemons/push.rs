//! `CacheStore.Push` against a real decoded (real store; the decode engine
//! only where it matters, a fixed spec elsewhere): bad shards are refused with
//! precise statuses, completed blocks survive a cut stream, a crash and a
//! restart, and nothing partial ever appears in the store.
//!
//! Shard payloads here are arbitrary bytes of the right size: the store does
//! not interpret cache values, and what is under test is framing, verification
//! and commit.

use std::time::Duration;

use pdbridge_common::{
    proto::{
        GetBundleRequest, GetSpecRequest, Payload, PushFrame, PushOpen, PushSeal, Shard,
        cache_store_client::CacheStoreClient, push_frame::Frame,
    },
    spec,
};
use pdbridge_tests::{
    Daemon, Reserved, Scratch,
    cache_store::{block_shards, cached_blocks, frames, push, rows_shards},
    fixed_spec_config,
    otlp::{OtlpReceiver, Trace},
};
use tokio_stream::StreamExt;
use tonic::{Code, transport::Channel};

const BLOCK_TOKENS: u32 = 16;

/// Files in the store that are not complete blocks (temp or partial files).
fn stray_files(store: &std::path::Path) -> Vec<String> {
    let tmp = store.join("tmp");
    std::fs::read_dir(tmp).map(|d| d.flatten().map(|e| e.path().display().to_string()).collect()).unwrap_or_default()
}

#[tokio::test]
async fn bad_shards_are_refused_and_committed_blocks_survive() {
    let scratch = Scratch::new("push");
    let store = scratch.0.join("store");
    // Three Push streams at once at most, each cut after 3 s without a frame
    // (pushes below send their frames at once, so only the idle ones are cut).
    let limits = "max_push_streams = 3\npush_idle_timeout = \"3s\"\n";
    let config = fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, limits);
    let mut decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await).max_decoding_message_size(64 << 20);
    let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    assert_eq!(spec::fingerprint(&spec), spec.spec_fingerprint, "the published fingerprint covers the spec");
    assert_eq!(spec.block_tokens, BLOCK_TOKENS);

    // The bundle streams whole and matches its fingerprint.
    let mut chunks = client
        .get_bundle(GetBundleRequest { spec_fingerprint: spec.spec_fingerprint.clone() })
        .await
        .unwrap()
        .into_inner();
    let mut bundle = Vec::new();
    while let Some(chunk) = chunks.message().await.unwrap() {
        assert_eq!(chunk.offset as usize, bundle.len());
        bundle.extend_from_slice(&chunk.data);
    }
    use sha2::Digest;
    assert_eq!(spec::hex(&sha2::Sha256::digest(&bundle)), spec.weights_fingerprint);
    let stale = client.get_bundle(GetBundleRequest { spec_fingerprint: "0".repeat(64) }).await;
    assert_eq!(stale.err().map(|s| s.code()), Some(Code::FailedPrecondition));

    let tokens: Vec<u32> = (100..100 + 3 * BLOCK_TOKENS + 5).collect();
    let open = |first_block| PushOpen {
        request_id: "t".into(),
        spec_fingerprint: spec.spec_fingerprint.clone(),
        token_ids: tokens.clone(),
        first_block,
        tail_tokens: 0,
        ..Default::default()
    };

    // Spec mismatch.
    let mut wrong = open(0);
    wrong.spec_fingerprint = "f".repeat(64);
    let err = push(&mut client, frames(wrong, block_shards(&spec, 0, 1), Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    // Layer inputs need an engine to compute the cache from them; a payload kind nobody knows.
    let inputs = PushOpen { payload: Payload::LayerInputs as i32, ..open(0) };
    let err = push(&mut client, frames(inputs, block_shards(&spec, 0, 1), Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("without a decode engine"), "{err:?}");
    let unknown = PushOpen { payload: 7, ..open(0) };
    let err = push(&mut client, frames(unknown, block_shards(&spec, 0, 1), Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // Corrupt payload: checksum fails.
    let mut shards = block_shards(&spec, 0, 1);
    let mut bytes = shards[7].payload.to_vec();
    bytes[0] ^= 0xff;
    shards[7].payload = bytes.into();
    let err = push(&mut client, frames(open(0), shards, Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss, "{err:?}");

    // Duplicated shard.
    let mut shards = block_shards(&spec, 0, 1);
    shards.insert(3, shards[2].clone());
    let err = push(&mut client, frames(open(0), shards, Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // Out of range: a block past the prompt's whole blocks, and bytes past a tensor's end.
    let err = push(&mut client, frames(open(0), block_shards(&spec, 3, 1), Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let mut shards = block_shards(&spec, 0, 1);
    shards[1].byte_offset += 4;
    let err = push(&mut client, frames(open(0), shards, Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // Wrong shape and an unknown tensor.
    let mut shards = block_shards(&spec, 0, 1);
    shards[0].shape[2] += 1;
    let err = push(&mut client, frames(open(0), shards, Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let mut shards = block_shards(&spec, 0, 1);
    shards[0].tensor = "queries".into();
    let err = push(&mut client, frames(open(0), shards, Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // A stream that does not open first.
    let seal_first = vec![PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted: 0 })) }];
    let err =
        push(&mut client, seal_first.into_iter().chain(frames(open(0), Vec::new(), None)).collect()).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // A sender keeping more blocks half-sent than the store's bound
    // (max_open_blocks = 4) is refused; nothing of them is kept.
    let wide: Vec<u32> = (5000..5000 + 6 * BLOCK_TOKENS).collect();
    let half_sent: Vec<Shard> = (0..5).map(|b| block_shards(&spec, b, 4).swap_remove(0)).collect();
    let err = push(&mut client, frames(PushOpen { token_ids: wide.clone(), ..open(0) }, half_sent, Some(5)))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert_eq!(cached_blocks(&mut client, &wide).await, 0);

    // Every refusal above left nothing behind.
    assert_eq!(cached_blocks(&mut client, &tokens).await, 0);
    assert!(stray_files(&store).is_empty(), "{:?}", stray_files(&store));

    // Truncated: block 0 complete, block 1 only half sent, then the seal.
    let mut shards = block_shards(&spec, 0, 1);
    let block1 = block_shards(&spec, 1, 2);
    shards.extend(block1[..block1.len() / 2].iter().cloned());
    let receipt = push(&mut client, frames(open(0), shards, Some(2))).await.unwrap();
    assert_eq!(receipt.blocks_committed, 1);
    assert_eq!(receipt.first_missing_block, 1);
    assert!(!receipt.detail.is_empty(), "a short stream says why");
    assert_eq!(receipt.reason(), pdbridge_common::proto::Reason::TransferFailed);
    assert_eq!(cached_blocks(&mut client, &tokens).await, 1);

    // A corrupt shard in block 2 after a good block 1: block 1 stays committed.
    let mut shards = block_shards(&spec, 1, 2);
    let mut bad = block_shards(&spec, 2, 3);
    let mut bytes = bad[0].payload.to_vec();
    bytes[1] ^= 1;
    bad[0].payload = bytes.into();
    shards.extend(bad);
    let err = push(&mut client, frames(open(1), shards, Some(2))).await.unwrap_err();
    assert_eq!(err.code(), Code::DataLoss);
    assert_eq!(cached_blocks(&mut client, &tokens).await, 2);

    // A re-push of a committed block within one stream is a duplicate.
    let mut shards = block_shards(&spec, 2, 3);
    shards.extend(block_shards(&spec, 2, 3));
    let err = push(&mut client, frames(open(2), shards, Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert_eq!(cached_blocks(&mut client, &tokens).await, 3, "block 2 committed before its duplicate arrived");
    assert!(stray_files(&store).is_empty());

    // Six whole blocks in one stream: more than max_open_blocks, each commit
    // waited for before the next block opens.
    let shards: Vec<Shard> = (0..6).flat_map(|b| block_shards(&spec, b, 5)).collect();
    let receipt =
        push(&mut client, frames(PushOpen { token_ids: wide.clone(), ..open(0) }, shards, Some(6))).await.unwrap();
    assert_eq!((receipt.blocks_committed, receipt.first_missing_block), (6, 6), "{}", receipt.detail);
    assert_eq!(cached_blocks(&mut client, &wide).await, 6);

    // A restart keeps every committed block.
    decoded.terminate();
    assert_eq!(decoded.wait(Duration::from_secs(30)).await.code(), Some(0));
    let mut decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await);
    assert_eq!(cached_blocks(&mut client, &tokens).await, 3);

    // Idle streams cannot hold the daemon: beyond max_push_streams a Push is
    // refused at once, and a stream silent for push_idle_timeout is cut.
    let idle = |client: &CacheStoreClient<Channel>| {
        let mut client = client.clone();
        let opened = frames(open(0), Vec::new(), None);
        tokio::spawn(async move { client.push(tokio_stream::iter(opened).chain(tokio_stream::pending())).await })
    };
    let holders: Vec<_> = (0..3).map(|_| idle(&client)).collect();
    decoded.wait_metric("pdbridge_push_streams_in_flight", 3.0, Duration::from_secs(30)).await;
    let err = push(&mut client, frames(open(0), block_shards(&spec, 0, 1), Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    for holder in holders {
        let err = holder.await.unwrap().unwrap_err();
        assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");
    }
    let receipt = push(&mut client, frames(open(0), block_shards(&spec, 0, 1), Some(1))).await.unwrap();
    assert_eq!(receipt.blocks_committed, 1, "a freed slot takes a new stream: {}", receipt.detail);
    assert!(stray_files(&store).is_empty());

    // decoded killed mid-Push (SIGKILL, no drain): the block committed before the kill is
    // served after a restart, the half-sent one never appears, and no file is torn.
    let crashing: Vec<u32> = (9000..9000 + 3 * BLOCK_TOKENS).collect();
    let committed = "pdbridge_store_blocks_committed_total";
    let committed_before = decoded.metric(committed).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    let pushing = tokio::spawn({
        let mut client = client.clone();
        async move { client.push(tokio_stream::wrappers::ReceiverStream::new(rx)).await }
    });
    let block1 = block_shards(&spec, 1, 7);
    let sent = frames(PushOpen { token_ids: crashing.clone(), ..open(0) }, block_shards(&spec, 0, 7), None)
        .into_iter()
        .chain(block1[..block1.len() / 2].iter().cloned().map(|s| PushFrame { frame: Some(Frame::Shard(s)) }));
    for frame in sent {
        tx.send(frame).await.unwrap();
    }
    decoded.wait_metric(committed, committed_before + 1.0, Duration::from_secs(60)).await;
    decoded.kill();
    decoded.wait(Duration::from_secs(30)).await;
    assert!(pushing.await.unwrap().is_err(), "a Push cut by a crash is not a success");
    let decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await);
    assert_eq!(cached_blocks(&mut client, &crashing).await, 1);
    assert_eq!(cached_blocks(&mut client, &tokens).await, 3, "earlier blocks are untouched");
    let quarantine = std::fs::read_dir(store.join("quarantine")).unwrap().count();
    assert_eq!(quarantine, 0, "no block file was torn");
    assert!(stray_files(&store).is_empty());
}

/// A tmpfs of `bytes` mounted at a directory for the test's life: a disk that
/// really fills up. Mounting needs root, which the test rig and CI have.
struct SmallDisk(std::path::PathBuf);

impl SmallDisk {
    fn mount(dir: std::path::PathBuf, bytes: u64) -> SmallDisk {
        std::fs::create_dir_all(&dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .status()
            .expect("run mount");
        assert!(status.success(), "cannot mount a tmpfs at {} (the disk-full test needs root)", dir.display());
        SmallDisk(dir)
    }

    /// Bytes an unprivileged writer may still use.
    fn free(&self) -> u64 {
        use std::os::unix::ffi::OsStrExt;
        let path = std::ffi::CString::new(self.0.as_os_str().as_bytes()).unwrap();
        let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: a valid NUL-terminated path and writable statvfs storage.
        assert_eq!(unsafe { libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) }, 0);
        // SAFETY: statvfs returned 0, so it filled the struct.
        let stat = unsafe { stat.assume_init() };
        #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
        let free = stat.f_bavail as u64 * stat.f_frsize as u64;
        free
    }

    /// Fills the disk (beside the store) until `left` bytes are free.
    fn fill_to(&self, left: u64) {
        let filler = self.0.join("filler");
        let _ = std::fs::remove_file(&filler);
        std::fs::write(&filler, vec![0u8; (self.free() - left) as usize]).unwrap();
    }

    fn unfill(&self) {
        std::fs::remove_file(self.0.join("filler")).unwrap();
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[tokio::test]
async fn a_full_disk_refuses_blocks_cleanly_then_evicts_to_make_room() {
    // Blocks of 512 KiB (the fixed spec's 256 B a token): the store wants 1 MiB of headroom beyond
    // a block, so making room evicts several.
    const DISK_BLOCK_TOKENS: u32 = 2048;
    let scratch = Scratch::new("diskfull");
    // The store is the small disk itself; the spec and its bundle sit beside it.
    let disk = SmallDisk::mount(scratch.0.join("store"), 4 << 20);
    let store = disk.0.clone();
    let config = fixed_spec_config(&scratch.0.join("spec"), &store, DISK_BLOCK_TOKENS, "");
    let decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(300)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await).max_decoding_message_size(64 << 20);
    let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let tokens: Vec<u32> = (300..300 + 4 * DISK_BLOCK_TOKENS).collect();
    let open = |first_block| PushOpen {
        request_id: "disk".into(),
        spec_fingerprint: spec.spec_fingerprint.clone(),
        token_ids: tokens.clone(),
        first_block,
        tail_tokens: 0,
        ..Default::default()
    };
    let block_bytes: u64 = spec::bytes_per_token(&spec) * DISK_BLOCK_TOKENS as u64;

    // No room and nothing to evict: RESOURCE_EXHAUSTED, nothing stored, nothing left behind.
    disk.fill_to(block_bytes / 2);
    let err = push(&mut client, frames(open(0), block_shards(&spec, 0, 1), Some(1))).await.unwrap_err();
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("no space"), "{err:?}");
    assert_eq!(cached_blocks(&mut client, &tokens).await, 0);
    assert!(stray_files(&store).is_empty(), "{:?}", stray_files(&store));

    // Room again: blocks commit.
    disk.unfill();
    let shards: Vec<Shard> = (0..3).flat_map(|b| block_shards(&spec, b, 1)).collect();
    let receipt = push(&mut client, frames(open(0), shards, Some(3))).await.unwrap();
    assert_eq!(receipt.blocks_committed, 3, "{}", receipt.detail);

    // Full again, but with cold blocks: the coldest is evicted to make room for the new one.
    disk.fill_to(block_bytes / 2);
    let evictions = "pdbridge_store_evictions_total";
    let evicted_before = decoded.metric(evictions).await.unwrap();
    let receipt = push(&mut client, frames(open(3), block_shards(&spec, 3, 1), Some(1))).await.unwrap();
    assert_eq!(receipt.blocks_committed, 1, "{}", receipt.detail);
    assert!(decoded.metric(evictions).await.unwrap() > evicted_before, "a cold block made room");
    assert!(cached_blocks(&mut client, &tokens).await < 4, "a block of the four was evicted");
    assert!(stray_files(&store).is_empty(), "{:?}", stray_files(&store));
}

/// Two dozen senders pushing the same block at once (prefillers racing for one document): every
/// Push succeeds, the block is stored once, and no temp file is left.
#[tokio::test]
async fn concurrent_pushes_of_one_block_all_succeed() {
    let scratch = Scratch::new("race");
    let store = scratch.0.join("store");
    let decoded = Daemon::start("decoded", &fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, "")).await;
    decoded.wait_ready(Duration::from_secs(60)).await;
    let client = CacheStoreClient::new(decoded.channel().await);
    let spec = client.clone().get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let tokens: Vec<u32> = (100..100 + BLOCK_TOKENS).collect();
    let open = PushOpen {
        request_id: "race".into(),
        spec_fingerprint: spec.spec_fingerprint.clone(),
        token_ids: tokens.clone(),
        first_block: 0,
        tail_tokens: 0,
        ..Default::default()
    };
    let racers: Vec<_> = (0..24)
        .map(|_| {
            let mut client = client.clone();
            let sent = frames(open.clone(), block_shards(&spec, 0, 1), Some(1));
            tokio::spawn(async move { push(&mut client, sent).await })
        })
        .collect();
    for racer in racers {
        let receipt = racer.await.unwrap().expect("every racing Push succeeds");
        assert_eq!(receipt.blocks_committed, 1, "{}", receipt.detail);
    }
    assert_eq!(cached_blocks(&mut client.clone(), &tokens).await, 1);
    let files: Vec<_> = std::fs::read_dir(store.join("blocks")).unwrap().flatten().collect();
    assert_eq!(files.len(), 1, "one fan-out directory");
    assert_eq!(std::fs::read_dir(files[0].path()).unwrap().count(), 1, "one block file");
    assert!(stray_files(&store).is_empty());
}

/// Push memory is bounded in bytes for all streams together (`store.max_push_bytes`): a stream
/// holding a half-sent block takes its whole size; another stream whose block does not fit, with
/// no commit of its own to wait for, is refused with RESOURCE_EXHAUSTED; once the first block is
/// committed its bytes are free again, and the dashboard's gauge says so.
#[tokio::test]
async fn push_memory_is_bounded_in_bytes_across_streams() {
    let scratch = Scratch::new("push-memory");
    let store = scratch.0.join("store");
    // The spec's block size, from a decoded without the bound.
    let mut probe =
        Daemon::start("decoded", &fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, "")).await;
    let spec = CacheStoreClient::new(probe.channel().await).get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    probe.terminate();
    probe.wait(Duration::from_secs(30)).await;
    let block_bytes = spec::block_bytes(&spec, Payload::Cache, BLOCK_TOKENS);
    let limit = block_bytes + block_bytes / 2; // one block, not two
    let config =
        fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, &format!("max_push_bytes = {limit}\n"));
    let decoded = Daemon::start("decoded", &config).await;
    decoded.wait_ready(Duration::from_secs(60)).await;
    let client = CacheStoreClient::new(decoded.channel().await);
    let open = |id: &str, first: u32| PushOpen {
        request_id: id.into(),
        spec_fingerprint: spec.spec_fingerprint.clone(),
        token_ids: (first..first + BLOCK_TOKENS).collect(),
        ..Default::default()
    };

    // The holder: its block's first shard, then nothing until told.
    let (tx, rx) = tokio::sync::mpsc::channel::<PushFrame>(8);
    let mut shards = block_shards(&spec, 0, 1).into_iter();
    tx.send(PushFrame { frame: Some(Frame::Open(open("holder", 100))) }).await.unwrap();
    tx.send(PushFrame { frame: Some(Frame::Shard(shards.next().unwrap())) }).await.unwrap();
    let holder = tokio::spawn({
        let mut client = client.clone();
        async move { client.push(tokio_stream::wrappers::ReceiverStream::new(rx)).await.map(|r| r.into_inner()) }
    });
    decoded
        .wait_metric("pdbridge_push_memory_bytes", block_bytes.div_ceil(1024) as f64 * 1024.0, Duration::from_secs(10))
        .await;

    let refused = push(&mut client.clone(), frames(open("other", 500), block_shards(&spec, 0, 2), Some(1))).await;
    let status = refused.expect_err("a block that does not fit is refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("store.max_push_bytes"), "{}", status.message());

    for shard in shards {
        tx.send(PushFrame { frame: Some(Frame::Shard(shard)) }).await.unwrap();
    }
    tx.send(PushFrame { frame: Some(Frame::Seal(PushSeal { blocks_emitted: 1 })) }).await.unwrap();
    drop(tx);
    assert_eq!(holder.await.unwrap().unwrap().blocks_committed, 1);
    decoded.wait_metric("pdbridge_push_memory_bytes", 0.0, Duration::from_secs(10)).await;
    let after = push(&mut client.clone(), frames(open("after", 500), block_shards(&spec, 0, 2), Some(1))).await;
    assert_eq!(after.unwrap().blocks_committed, 1, "its bytes are free again");
}

/// Block files removed from outside the daemon: `/store` says what the disk holds, and so do the
/// lookups after it.
#[tokio::test]
async fn the_store_status_follows_the_disk() {
    let scratch = Scratch::new("vanished");
    let store = scratch.0.join("store");
    let decoded = Daemon::start("decoded", &fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, "")).await;
    decoded.wait_ready(Duration::from_secs(60)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await);
    let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let tokens: Vec<u32> = (100..100 + 2 * BLOCK_TOKENS).collect();
    let open = PushOpen {
        request_id: "vanished".into(),
        spec_fingerprint: spec.spec_fingerprint.clone(),
        token_ids: tokens.clone(),
        ..Default::default()
    };
    let shards = [block_shards(&spec, 0, 1), block_shards(&spec, 1, 1)].concat();
    assert_eq!(push(&mut client, frames(open, shards, Some(2))).await.unwrap().blocks_committed, 2);
    let status = || async {
        let body: serde_json::Value = reqwest::get(decoded.admin_url("/store")).await.unwrap().json().await.unwrap();
        (body["blocks"].as_u64().unwrap(), body["bytes"].as_u64().unwrap())
    };
    assert_eq!(status().await.0, 2);
    std::fs::remove_dir_all(store.join("blocks")).unwrap();
    assert_eq!(status().await, (0, 0));
    assert_eq!(cached_blocks(&mut client, &tokens).await, 0);
}

/// A prompt's tail after its whole blocks rides the Push for the request that asked: kept
/// beside the store for that request, never a block; a tail that is a block long, or that
/// would include the prompt's last token, or whose shards have another shape, is refused.
#[tokio::test]
async fn a_tail_travels_for_its_request_and_is_never_a_block() {
    let scratch = Scratch::new("tail");
    let store = scratch.0.join("store");
    let decoded = Daemon::start("decoded", &fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, "")).await;
    decoded.wait_ready(Duration::from_secs(60)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await);
    let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    // Two whole blocks, then 5 tokens: a tail of 4 leaves the last token to the decoder.
    let tokens: Vec<u32> = (700..700 + 2 * BLOCK_TOKENS + 5).collect();
    let open = |tail_tokens| PushOpen {
        request_id: "tail".into(),
        spec_fingerprint: spec.spec_fingerprint.clone(),
        token_ids: tokens.clone(),
        first_block: 0,
        tail_tokens,
        ..Default::default()
    };
    let tails = || std::fs::read_dir(store.join("tails")).unwrap().count();

    for (tail_tokens, shards) in
        [(5, rows_shards(&spec, 2, 5, 1)), (BLOCK_TOKENS, block_shards(&spec, 2, 1)), (4, rows_shards(&spec, 2, 3, 1))]
    {
        let err = push(&mut client, frames(open(tail_tokens), shards, Some(0))).await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "tail of {tail_tokens}: {err:?}");
    }
    assert_eq!(tails(), 0);

    let mut shards: Vec<Shard> = (0..2).flat_map(|b| block_shards(&spec, b, 9)).collect();
    shards.extend(rows_shards(&spec, 2, 4, 9));
    let receipt = push(&mut client, frames(open(4), shards, Some(2))).await.unwrap();
    assert_eq!((receipt.blocks_committed, receipt.tail_committed), (2, true), "{}", receipt.detail);
    assert!(receipt.detail.is_empty(), "the tail is not a missing block: {}", receipt.detail);
    assert_eq!(cached_blocks(&mut client, &tokens).await, 2, "the tail is no block");
    assert_eq!(tails(), 1);
    assert!(stray_files(&store).is_empty());
}

/// The trace collector going away costs spans, never pushes: with it down a Push is served and its
/// lost span counted (and logged once); once the collector listens, the next Push's span, which
/// continues the caller's trace, arrives there.
#[tokio::test]
async fn a_collector_that_is_down_costs_spans_not_pushes() {
    let scratch = Scratch::new("collector");
    let store = scratch.0.join("store");
    // Nothing listens here until the collector comes up.
    let collector = Reserved::new().addr();
    let telemetry = format!("[telemetry]\notlp_endpoint = \"http://{collector}\"\nexport_delay = \"50ms\"\n");
    let decoded =
        Daemon::start("decoded", &fixed_spec_config(&scratch.0.join("spec"), &store, BLOCK_TOKENS, &telemetry)).await;
    decoded.wait_ready(Duration::from_secs(60)).await;
    let mut client = CacheStoreClient::new(decoded.channel().await);
    let spec = client.get_spec(GetSpecRequest {}).await.unwrap().into_inner();
    let (trace_id, caller) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let traced_push = |client: &mut CacheStoreClient<Channel>, block: u32| {
        let tokens: Vec<u32> = (0..BLOCK_TOKENS * (block + 1)).collect();
        let open = PushOpen {
            request_id: format!("traced-{block}"),
            spec_fingerprint: spec.spec_fingerprint.clone(),
            token_ids: tokens,
            first_block: block,
            ..Default::default()
        };
        let mut request = tonic::Request::new(tokio_stream::iter(frames(open, block_shards(&spec, block, 3), Some(1))));
        request.metadata_mut().insert("traceparent", format!("00-{trace_id}-{caller}-01").parse().unwrap());
        let mut client = client.clone();
        async move { client.push(request).await.map(tonic::Response::into_inner) }
    };

    let receipt = traced_push(&mut client, 0).await.expect("served with the collector down");
    assert_eq!(receipt.blocks_committed, 1);
    let failed = "pdbridge_trace_spans_total{outcome=\"failed\"}";
    decoded.wait_metric(failed, 2.0, Duration::from_secs(30)).await; // store.push and store.commit
    assert!(decoded.log_text().contains("spans are not reaching telemetry.otlp_endpoint"));

    let receiver = OtlpReceiver::start_on(collector).await;
    let receipt = traced_push(&mut client, 1).await.expect("served with the collector up");
    assert_eq!(receipt.blocks_committed, 1);
    // store.push ends after store.commit and may come in a later export batch: wait for both.
    let spans = receiver
        .wait_for(Duration::from_secs(30), |spans| {
            ["store.commit", "store.push"].iter().all(|name| spans.iter().any(|s| s.name == *name))
        })
        .await;
    let trace = Trace::of(&spans, trace_id);
    let push = trace.one("decoded", "store.push");
    assert_eq!(push.parent_id, caller, "{}", trace.tree());
    assert_eq!(push.attribute("pdbridge.request_id"), Some("traced-1"));
    trace.assert_under(trace.one("decoded", "store.commit"), push);
    decoded.wait_metric("pdbridge_trace_spans_total{outcome=\"exported\"}", 2.0, Duration::from_secs(30)).await;
    assert!(decoded.log_text().contains("spans reach telemetry.otlp_endpoint again"));
}
