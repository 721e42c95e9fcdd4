use super::*;

use pdbridge_common::proto::engine::{PluginBlock, PluginDone, PluginError};

/// The next frame, which must be a request's event.
async fn read_message(
    stream: &mut (impl AsyncRead + Unpin),
    max_payload: impl Fn(&str) -> Option<usize>,
) -> Result<Option<(String, PluginEvent)>, CaptureError> {
    Ok(match read_incoming(stream, max_payload, None).await? {
        Some(Incoming::Event { request_id, event }) => Some((request_id, event)),
        Some(other) => panic!("not an event: {other:?}"),
        None => None,
    })
}

fn frame(message: PluginFrame, payload: &[u8]) -> Vec<u8> {
    let header = message.encode_to_vec();
    let mut out = (header.len() as u32).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(payload);
    out
}

fn tensor(offset: u64, nbytes: u64) -> PluginTensor {
    let shape = vec![nbytes / 4];
    PluginTensor { layer: 0, name: "keys".into(), dtype: Dtype::F32 as i32, shape, offset, nbytes }
}

fn message(request_id: &str, frame: Frame) -> PluginFrame {
    PluginFrame { request_id: request_id.into(), frame: Some(frame), ..Default::default() }
}

fn block(request_id: &str, payload_bytes: u64, tensors: Vec<PluginTensor>) -> PluginFrame {
    message(request_id, Frame::Block(PluginBlock { index: 0, payload_bytes, tensors, ring_offset: None }))
}

fn done(request_id: &str, num_tokens: u32) -> PluginFrame {
    message(request_id, Frame::Done(PluginDone { num_tokens, blocks_emitted: 1, timings: None }))
}

#[tokio::test]
async fn parses_block_done_and_error_frames() {
    let third = PluginBlock { index: 3, payload_bytes: 8, tensors: vec![tensor(0, 8)], ring_offset: None };
    let mut bytes = frame(message("r", Frame::Block(third)), &[1, 2, 3, 4, 5, 6, 7, 8]);
    bytes.extend(frame(done("r", 9), &[]));
    let error = PluginError { failure: PluginFailure::BundleMismatch as i32, message: "x".into() };
    bytes.extend(frame(message("r", Frame::Error(error)), &[]));
    let mut reader = bytes.as_slice();
    let (id, event) = read_message(&mut reader, |_| Some(8)).await.unwrap().unwrap();
    assert_eq!(id, "r");
    let whole = Stage { index: 0, count: 1 };
    let PluginEvent::Block { index: 3, part, stage } = event else { panic!("{event:?}") };
    assert_eq!((part.payload.len(), stage, part.tensors[0].dtype), (8, whole, Dtype::F32));
    let (_, event) = read_message(&mut reader, |_| Some(8)).await.unwrap().unwrap();
    assert!(
        matches!(event, PluginEvent::Done { ref end, stage } if (end.num_tokens, end.blocks_emitted) == (9, 1) && stage == whole)
    );
    let (_, event) = read_message(&mut reader, |_| Some(8)).await.unwrap().unwrap();
    assert!(
        matches!(event, PluginEvent::Error { failure: PluginFailure::BundleMismatch, ref message } if message == "x")
    );
    assert!(read_message(&mut reader, |_| Some(8)).await.unwrap().is_none());
}

/// proto/golden's frames, which the plugin's tests also hold to its writer: framed, they read
/// as the events they describe, the plugin's timings under `Outcome.stage_ms`'s stage names.
#[tokio::test]
async fn the_golden_frames_read_as_their_events() {
    let golden = |name: &str| -> PluginFrame {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden").join(name);
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    };
    let block = golden("PluginFrame.json");
    let Some(Frame::Block(ref b)) = block.frame else { panic!("PluginFrame.json is a block") };
    let mut bytes = frame(block.clone(), &vec![0; b.payload_bytes as usize]);
    bytes.extend(frame(golden("PluginFrame.done.json"), &[]));
    bytes.extend(frame(golden("PluginFrame.error.json"), &[]));
    let mut reader = bytes.as_slice();
    let (_, event) = read_message(&mut reader, |_| Some(1 << 20)).await.unwrap().unwrap();
    let PluginEvent::Block { part, stage, .. } = event else { panic!("{event:?}") };
    assert_eq!((part.tensors.len(), stage), (b.tensors.len(), Stage { index: block.stage, count: block.stages }));
    let (_, event) = read_message(&mut reader, |_| None).await.unwrap().unwrap();
    let PluginEvent::Done { end, .. } = event else { panic!("{event:?}") };
    let stages: Vec<_> = end.timings_ms.keys().map(String::as_str).collect();
    assert_eq!(stages, ["capture", "reconstruct", "ring_wait", "send", "to_host", "to_mlx"]);
    assert!(end.timings_ms.values().all(|&ms| ms > 0.0), "every stage's time is read: {:?}", end.timings_ms);
    let (_, event) = read_message(&mut reader, |_| None).await.unwrap().unwrap();
    assert!(matches!(event, PluginEvent::Error { failure, .. } if failure != PluginFailure::Unspecified));
}

fn part(layer: u32) -> Part {
    let tensor = TensorSlice { layer, name: "keys".into(), dtype: Dtype::F32, shape: vec![1], offset: 0, nbytes: 4 };
    Part { tensors: vec![tensor], payload: Bytes::from_static(&[0; 4]) }
}

fn end(num_tokens: u32, blocks_emitted: u32, reconstruct_ms: f64) -> End {
    End { num_tokens, blocks_emitted, timings_ms: [("reconstruct".to_owned(), reconstruct_ms)].into() }
}

#[test]
fn a_whole_engine_passes_blocks_and_its_end_straight_through() {
    let mut stages = Stages::default();
    let whole = Stage { index: 0, count: 1 };
    let parts = stages.block(whole, 0, part(0)).unwrap().unwrap();
    assert_eq!(parts.len(), 1);
    assert_eq!(stages.end(whole, end(512, 2, 7.0)).unwrap(), Some(end(512, 2, 7.0)));
}

#[test]
fn a_block_is_whole_once_every_stage_sent_its_part() {
    let mut stages = Stages::default();
    let (first, second) = (Stage { index: 0, count: 2 }, Stage { index: 1, count: 2 });
    assert!(stages.block(second, 0, part(1)).unwrap().is_none());
    assert!(stages.block(first, 1, part(0)).unwrap().is_none());
    let block0 = stages.block(first, 0, part(0)).unwrap().unwrap();
    assert_eq!(block0.iter().map(|p| p.tensors[0].layer).collect::<Vec<_>>(), [0, 1], "in stage order");
    assert_eq!(stages.block(second, 1, part(1)).unwrap().unwrap().len(), 2);

    assert!(stages.end(first, end(512, 2, 30.0)).unwrap().is_none());
    let merged = stages.end(second, end(512, 1, 20.0)).unwrap().unwrap();
    assert_eq!((merged.num_tokens, merged.blocks_emitted), (512, 1), "what every stage got to");
    let timings: Vec<_> = merged.timings_ms.iter().map(|(k, v)| (k.as_str(), *v)).collect();
    assert_eq!(timings, [("reconstruct", 30.0), ("reconstruct_stage0", 30.0), ("reconstruct_stage1", 20.0)]);
}

#[test]
fn stages_that_contradict_each_other_are_refused() {
    let mut stages = Stages::default();
    let first = Stage { index: 0, count: 2 };
    assert_eq!(
        stages.block(Stage { index: 2, count: 2 }, 0, part(0)).unwrap_err(),
        StageError::OutOfRange { index: 2, count: 2 }
    );
    stages.block(first, 0, part(0)).unwrap();
    assert_eq!(stages.block(first, 0, part(0)).unwrap_err(), StageError::DuplicatePart { stage: 0, block: 0 });
    assert_eq!(
        stages.block(Stage { index: 1, count: 3 }, 0, part(1)).unwrap_err(),
        StageError::Inconsistent { index: 1, count: 3, known: 2 }
    );
    stages.end(first, end(1, 1, 1.0)).unwrap();
    assert_eq!(stages.end(first, end(1, 1, 1.0)).unwrap_err(), StageError::DuplicateEnd { stage: 0 });
}

#[tokio::test]
async fn a_stage_names_itself_in_its_messages() {
    let bytes = frame(PluginFrame { stage: 1, stages: 2, ..done("r", 9) }, &[]);
    let (_, event) = read_message(&mut bytes.as_slice(), |_| Some(8)).await.unwrap().unwrap();
    assert!(matches!(event, PluginEvent::Done { stage: Stage { index: 1, count: 2 }, .. }));
}

#[tokio::test]
async fn refuses_a_tensor_outside_its_payload_or_of_no_known_dtype() {
    for (tensor, why) in [
        (tensor(4, 8), "outside the payload"),
        (tensor(u64::MAX, 2), "outside the payload"),
        (PluginTensor { dtype: 0, ..tensor(0, 8) }, "no known dtype"),
        (PluginTensor { dtype: 99, ..tensor(0, 8) }, "no known dtype"),
    ] {
        let bytes = frame(block("r", 8, vec![tensor]), &[0; 8]);
        let refused = read_message(&mut bytes.as_slice(), |_| Some(8)).await;
        assert!(matches!(refused, Err(CaptureError::Malformed(ref m)) if m.contains(why)), "{refused:?}");
    }
    let empty = frame(PluginFrame { request_id: "r".into(), ..Default::default() }, &[]);
    assert!(matches!(read_message(&mut empty.as_slice(), |_| Some(8)).await, Err(CaptureError::Malformed(_))));
}

#[tokio::test]
async fn refuses_a_block_larger_than_its_request_accepts_before_reading_it() {
    // Only the header is there: a reader that allocated or waited for the payload would fail otherwise.
    let bytes = frame(block("r", 1 << 40, vec![tensor(0, 8)]), &[]);
    let refused = read_message(&mut bytes.as_slice(), |id| (id == "r").then_some(1 << 20)).await;
    assert!(matches!(refused, Err(CaptureError::Malformed(ref m)) if m.contains("at most 1048576")), "{refused:?}");
}

#[test]
fn a_request_id_in_use_cannot_be_registered_again() {
    let router = Router::new("unused.sock".into());
    let first = router.register("r", 1).unwrap();
    assert_eq!(router.register("r", 1).err().as_deref(), Some("r"));
    drop(first);
    assert!(router.register("r", 1).is_ok(), "free again once the first call ends");
}

/// Only the stage listener serves bundles: on the plugin socket the request ends the connection
/// and nothing is written back.
#[tokio::test]
async fn a_bundle_request_on_the_plugin_socket_is_refused() {
    use pdbridge_common::proto::engine::BundleRequest;
    let router = Router::new("unused.sock".into());
    let request =
        PluginFrame { frame: Some(Frame::Bundle(BundleRequest { sha256: "0".repeat(64) })), ..Default::default() };
    let bytes = frame(request, &[]);
    let mut written = Vec::new();
    let ended = router.relay_local(tokio::io::join(bytes.as_slice(), &mut written), None).await;
    assert!(matches!(ended, Err(CaptureError::Malformed(ref why)) if why.contains("bundle")), "{ended:?}");
    assert!(written.is_empty());
}

#[tokio::test]
async fn a_connection_lost_mid_request_ends_that_request() {
    let router = Router::new("unused.sock".into());
    let mut cut = router.register("cut", 4).unwrap();
    let mut finished = router.register("finished", 4).unwrap();
    cut.expect_blocks(4);
    finished.expect_blocks(4);
    let mut bytes = frame(block("cut", 4, vec![tensor(0, 4)]), &[0; 4]);
    bytes.extend(frame(block("finished", 4, vec![tensor(0, 4)]), &[0; 4]));
    bytes.extend(frame(done("finished", 4), &[]));
    router.relay_local(tokio::io::join(bytes.as_slice(), tokio::io::sink()), None).await.unwrap();
    assert!(matches!(cut.events.recv().await, Some(PluginEvent::Block { .. })));
    assert!(
        matches!(cut.events.recv().await, Some(PluginEvent::Error { ref message, .. }) if message.contains("connection closed"))
    );
    assert!(matches!(finished.events.recv().await, Some(PluginEvent::Block { .. })));
    assert!(matches!(finished.events.recv().await, Some(PluginEvent::Done { .. })));
    assert!(finished.events.try_recv().is_err(), "a finished request hears nothing more");
}

/// Fuzzing the plugin frame reader: whatever arrives on the socket, the reader never
/// panics, never hands on a block larger than its request accepts, and never a tensor
/// outside its payload.
mod fuzz {
    use proptest::prelude::*;

    use super::*;

    const LIMIT: usize = 4096;

    /// Reads every message of `bytes` (an in-memory slice: the reader never waits).
    fn check(bytes: &[u8]) -> Result<(), TestCaseError> {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        runtime.block_on(async {
            let mut reader = bytes;
            // Each message either parses within its bounds or ends the connection with an error.
            while let Ok(Some((_, event))) = read_message(&mut reader, |id| (id == "r").then_some(LIMIT)).await {
                if let PluginEvent::Block { part, .. } = event {
                    prop_assert!(part.payload.len() <= LIMIT);
                    for t in part.tensors {
                        prop_assert!(t.offset + t.nbytes <= part.payload.len());
                    }
                }
            }
            Ok(())
        })
    }

    fn block_frame() -> impl Strategy<Value = Vec<u8>> {
        let id = prop_oneof![Just("r".to_owned()), Just("gone".to_owned()), "[a-z]{0,3}"];
        (id, 0usize..2 * LIMIT, 0usize..LIMIT, 0usize..LIMIT, 0usize..64).prop_map(
            |(request_id, payload_bytes, offset, nbytes, sent)| {
                let header = block(&request_id, payload_bytes as u64, vec![tensor(offset as u64, nbytes as u64)]);
                frame(header, &vec![1u8; sent.min(payload_bytes)])
            },
        )
    }

    proptest! {
        // At least this many cases; PROPTEST_CASES asks for more.
        #![proptest_config(ProptestConfig { cases: ProptestConfig::default().cases.max(1024), ..ProptestConfig::default() })]

        #[test]
        fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
            check(&bytes)?;
        }

        #[test]
        fn hostile_block_frames_stay_in_bounds(frames in prop::collection::vec(block_frame(), 1..6), cut in any::<prop::sample::Index>()) {
            let mut bytes: Vec<u8> = frames.concat();
            // A connection may also end anywhere.
            let keep = cut.index(bytes.len() + 1);
            bytes.truncate(keep);
            check(&bytes)?;
        }
    }
}

/// A block in the plugin's ring reaches its request as a view of the ring, not a copy; the plugin
/// hears that its bytes are free only once nothing here holds that view, and the connection ends
/// only after that answer.
#[tokio::test]
async fn a_block_in_the_ring_goes_back_once_nothing_holds_it() {
    use std::os::fd::AsRawFd;

    use pdbridge_common::proto::engine::{PluginRelease, PluginRing};
    use tokio::io::AsyncWriteExt;

    let router = Router::new("unused.sock".into());
    let mut waiting = router.register("ringed", 4).unwrap();
    waiting.expect_blocks(64);
    // The plugin's ring: a file this process holds open, as the plugin holds its memfd.
    let path = std::env::temp_dir().join(format!("pdb-ring-test-{}", std::process::id()));
    std::fs::write(&path, (0..=255u8).collect::<Vec<_>>()).unwrap();
    let ring = std::fs::File::open(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let named = PluginRing { fd: ring.as_raw_fd() as u32, size: 256 };
    let named = PluginFrame { frame: Some(Frame::Ring(named)), ..Default::default() };
    let mut in_ring = block("ringed", 16, vec![tensor(0, 16)]);
    if let Some(Frame::Block(b)) = in_ring.frame.as_mut() {
        b.ring_offset = Some(32);
    }
    let (mut plugin, socket) = tokio::io::duplex(1 << 16);
    let relay = tokio::spawn(async move { router.relay_local(socket, Some(std::process::id() as i32)).await });
    for message in [named, in_ring, done("ringed", 16)] {
        plugin.write_all(&frame(message, &[])).await.unwrap();
    }
    plugin.shutdown().await.unwrap();

    let Some(PluginEvent::Block { part, .. }) = waiting.events.recv().await else { panic!("a block") };
    assert_eq!(part.payload, (32..48).collect::<Vec<u8>>());
    assert!(matches!(waiting.events.recv().await, Some(PluginEvent::Done { .. })));
    // One thread, in-memory streams: once the test yields often enough, the relay has done all it
    // can (read the plugin's end); it still waits, for the block held here.
    for _ in 0..1000 {
        tokio::task::yield_now().await;
    }
    assert!(!relay.is_finished(), "the connection stays open while the block is held");

    drop(part);
    let mut answer = Vec::new();
    plugin.read_to_end(&mut answer).await.unwrap();
    let release = PluginRelease::decode(&answer[4..]).unwrap();
    assert_eq!(
        (u32::from_le_bytes(answer[..4].try_into().unwrap()) as usize, release.ring_offset),
        (answer.len() - 4, 32)
    );
    relay.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_block_in_a_ring_never_named_or_named_from_another_box_is_refused() {
    let mut in_ring = block("r", 16, vec![tensor(0, 16)]);
    if let Some(Frame::Block(b)) = in_ring.frame.as_mut() {
        b.ring_offset = Some(0);
    }
    let bytes = frame(in_ring, &[]);
    let refused = read_message(&mut bytes.as_slice(), |_| Some(64)).await;
    assert!(matches!(refused, Err(CaptureError::Malformed(ref why)) if why.contains("never named")), "{refused:?}");

    let router = Router::new("unused.sock".into());
    let named = PluginFrame { frame: Some(Frame::Ring(Default::default())), ..Default::default() };
    let bytes = frame(named, &[]);
    let ended = router.relay(tokio::io::join(bytes.as_slice(), tokio::io::sink()), Path::new("unused")).await;
    assert!(matches!(ended, Err(CaptureError::Malformed(ref why)) if why.contains("another box")), "{ended:?}");
}
