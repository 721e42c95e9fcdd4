use super::*;

struct TempDir(PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}
fn temp_dir(tag: &str) -> TempDir {
    let dir = std::env::temp_dir().join(format!("pdb-store-{tag}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    TempDir(dir)
}

#[test]
fn a_tail_is_kept_for_one_request_then_gone() {
    let dir = temp_dir("tail");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (mut tail, tensors) = block("spec", BlockKey::ROOT, 0, 3);
    tail.token_ids.truncate(3);
    tail.key = block::chain("spec", &tail.parent, &tail.token_ids);
    let tensors: Vec<BlockTensor> = tensors
        .into_iter()
        .map(|t| BlockTensor { shape: vec![1, 1, 3, 2], parts: vec![Bytes::from(vec![3u8; 24])], ..t })
        .collect();
    assert!(store.commit_tail(&tail, &tensors).unwrap() > 0);
    assert!(!store.contains(&tail.key), "a tail is not a stored block");
    assert_eq!(store.usage(), (0, 0), "nor counted in the budget");
    let held = store.take_tail(&tail.key).expect("the tail is there");
    let (key, _, _) = verify_file(held.path()).unwrap();
    assert_eq!(key, tail.key, "a tail file proves its name like a block");
    let path = held.path().to_owned();
    drop(held);
    assert!(!path.exists() && store.take_tail(&tail.key).is_none(), "gone once its request is done");

    store.commit_tail(&tail, &tensors).unwrap();
    drop(store);
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    assert!(store.take_tail(&tail.key).is_none(), "a restart drops tails whose requests are gone");
}

#[test]
fn blocks_whose_files_vanished_are_forgotten() {
    let dir = temp_dir("vanished");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (first, tensors) = block("spec", BlockKey::ROOT, 0, 1);
    store.commit(&first, &tensors).unwrap();
    let (second, tensors) = block("spec", first.key, 1, 1);
    store.commit(&second, &tensors).unwrap();
    assert_eq!(store.forget_missing(), 0, "nothing is missing");
    fs::remove_file(store.path_of(&second.key)).unwrap();
    assert_eq!(store.forget_missing(), 1);
    assert!(store.contains(&first.key) && !store.contains(&second.key));
    fs::remove_dir_all(dir.0.join("blocks")).unwrap();
    assert_eq!(store.forget_missing(), 1);
    assert_eq!(store.usage(), (0, 0));
}

#[test]
fn the_status_probe_writes_nothing() {
    let dir = temp_dir("probe");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (writable, free) = store.probe();
    assert!(writable && free.is_some());
    assert_eq!(fs::read_dir(dir.0.join("tmp")).unwrap().count(), 0, "a GET of /store creates no file");
}

fn block(spec: &str, parent: BlockKey, index: u32, fill: u8) -> (BlockIdentity, Vec<BlockTensor>) {
    let token_ids: Vec<u32> = (0..4).map(|t| t + 4 * index + fill as u32).collect();
    let key = block::chain(spec, &parent, &token_ids);
    let tensors = (0..2)
        .flat_map(|layer| ["keys", "values"].map(move |name| (layer, name)))
        .map(|(layer, name)| BlockTensor {
            name: format!("{layer}.{name}"),
            dtype: StDtype::F32,
            shape: vec![1, 1, 4, 2],
            parts: vec![Bytes::from(vec![fill; 16]), Bytes::from(vec![fill.wrapping_add(1); 16])],
        })
        .collect();
    (BlockIdentity { key, parent, spec_fingerprint: spec.into(), index, token_ids }, tensors)
}

#[test]
fn committed_blocks_survive_a_reopen_and_bad_files_are_quarantined() {
    let dir = temp_dir("reopen");
    let (store, report) = Store::open(&dir.0, 1 << 20).unwrap();
    assert_eq!(report, OpenReport::default());
    let (b0, t0) = block("spec", BlockKey::ROOT, 0, 1);
    let (b1, t1) = block("spec", b0.key, 1, 2);
    store.commit(&b0, &t0).unwrap();
    store.commit(&b1, &t1).unwrap();
    assert_eq!(store.longest_prefix(&[b0.key, b1.key]), 2);
    let good = store.path_of(&b1.key);

    // A file renamed to another key, and a truncated one.
    let (b2, _) = block("spec", b1.key, 2, 3);
    fs::create_dir_all(store.path_of(&b2.key).parent().unwrap()).unwrap();
    fs::copy(&good, store.path_of(&b2.key)).unwrap();
    let (b3, _) = block("spec", b1.key, 2, 4);
    let bytes = fs::read(&good).unwrap();
    fs::create_dir_all(store.path_of(&b3.key).parent().unwrap()).unwrap();
    fs::write(store.path_of(&b3.key), &bytes[..bytes.len() - 5]).unwrap();
    drop(store);

    let (store, report) = Store::open(&dir.0, 1 << 20).unwrap();
    assert_eq!((report.blocks, report.quarantined), (2, 2));
    assert_eq!(store.longest_prefix(&[b0.key, b1.key, b2.key]), 2);
    assert_eq!(fs::read_dir(dir.0.join("quarantine")).unwrap().count(), 2);

    // The file is a valid safetensors that mlx / the adapter can read.
    let data = fs::read(&good).unwrap();
    let st = safetensors::SafeTensors::deserialize(&data).unwrap();
    let keys = st.tensor("1.keys").unwrap();
    assert_eq!(keys.shape(), &[1, 1, 4, 2]);
    assert_eq!(&keys.data()[..16], &[2u8; 16]);
    assert_eq!(&keys.data()[16..], &[3u8; 16]);
}

#[test]
fn eviction_is_lru_and_spares_leased_blocks() {
    let dir = temp_dir("evict");
    let (b0, t0) = block("s", BlockKey::ROOT, 0, 1);
    let probe_size = {
        let (store, _) = Store::open(&dir.0.join("probe"), 1 << 20).unwrap();
        store.commit(&b0, &t0).unwrap()
    };
    let (store, _) = Store::open(&dir.0.join("main"), 2 * probe_size + probe_size / 2).unwrap();
    let store = Arc::new(store);
    let (b1, t1) = block("s", b0.key, 1, 2);
    let (b2, t2) = block("s", b1.key, 2, 3);
    store.commit(&b0, &t0).unwrap();
    store.commit(&b1, &t1).unwrap();
    let lease = store.lease(&[b0.key]);
    store.commit(&b2, &t2).unwrap();
    assert!(store.contains(&b0.key), "leased block survives");
    assert!(!store.contains(&b1.key), "coldest unleased block is evicted");
    assert!(!store.path_of(&b1.key).exists());
    assert_eq!(lease.paths(), &[store.path_of(&b0.key)]);
    drop(lease);
    assert_eq!(store.usage().0, 2);
}

#[test]
fn a_block_larger_than_the_budget_is_refused() {
    let dir = temp_dir("budget");
    let (store, _) = Store::open(&dir.0, 10).unwrap();
    let (b0, t0) = block("s", BlockKey::ROOT, 0, 1);
    assert!(matches!(store.commit(&b0, &t0), Err(StoreError::TooLarge { .. })));
    assert_eq!(store.usage(), (0, 0));
}

#[test]
fn concurrent_commits_of_one_block_all_succeed_and_store_it_once() {
    let dir = temp_dir("race");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (b0, t0) = block("s", BlockKey::ROOT, 0, 1);
    let sizes: Vec<u64> = std::thread::scope(|scope| {
        let commits: Vec<_> = (0..24).map(|_| scope.spawn(|| store.commit(&b0, &t0).unwrap())).collect();
        commits.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(sizes.iter().filter(|&&n| n > 0).count(), 1, "exactly one commit writes: {sizes:?}");
    assert_eq!(store.usage(), (1, sizes.iter().sum()));
    assert_eq!(fs::read_dir(dir.0.join("tmp")).unwrap().count(), 0, "no temp file left");
    drop(store);
    let (_, report) = Store::open(&dir.0, 1 << 20).unwrap();
    assert_eq!((report.blocks, report.quarantined), (1, 0));
}

#[test]
fn a_failed_commit_leaves_no_temp_file_and_indexes_nothing() {
    let dir = temp_dir("failed");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (b0, t0) = block("s", BlockKey::ROOT, 0, 1);
    // The block's fan-out directory cannot be created: a file holds its name.
    let fan_out = store.path_of(&b0.key).parent().unwrap().to_owned();
    fs::write(&fan_out, b"in the way").unwrap();
    assert!(matches!(store.commit(&b0, &t0), Err(StoreError::Io { op: "create", .. })));
    assert_eq!(store.usage(), (0, 0));
    assert_eq!(fs::read_dir(dir.0.join("tmp")).unwrap().count(), 0, "no temp file left");
    // Once the obstacle is gone the same block commits.
    fs::remove_file(&fan_out).unwrap();
    assert!(store.commit(&b0, &t0).unwrap() > 0);
}

#[test]
fn stray_files_in_the_block_directory_do_not_stop_the_store() {
    let dir = temp_dir("stray");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (b0, t0) = block("s", BlockKey::ROOT, 0, 1);
    store.commit(&b0, &t0).unwrap();
    let fan_out = store.path_of(&b0.key).parent().unwrap().to_owned();
    drop(store);
    fs::write(dir.0.join("blocks").join(".DS_Store"), b"finder").unwrap();
    fs::write(fan_out.join(".DS_Store"), b"finder").unwrap();
    let (store, report) = Store::open(&dir.0, 1 << 20).unwrap();
    assert_eq!((report.blocks, report.quarantined), (1, 2));
    assert!(store.contains(&b0.key));
}

/// proto/golden/BlockMetadata.json, as the adapter writes it into an exported file, reads as
/// the identity it names; a file of the old format or another metadata key reads as none.
#[test]
fn block_metadata_is_the_schemas() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto/golden/BlockMetadata.json");
    let golden = fs::read_to_string(path).unwrap();
    let block: BlockMetadata = serde_json::from_str(&golden).unwrap();
    let md = HashMap::from([("format".to_owned(), BLOCK_FORMAT.to_owned()), (METADATA_KEY.to_owned(), golden)]);
    let identity = BlockIdentity::from_metadata(&md).unwrap();
    assert_eq!((identity.key.to_hex(), identity.parent.to_hex()), (block.key.clone(), block.parent.clone()));
    assert_eq!((identity.index, &identity.token_ids), (block.index, &block.token_ids));
    assert_eq!(identity.to_metadata(block.data_sha256.clone())[METADATA_KEY], serde_json::to_string(&block).unwrap());
    let old = HashMap::from([("format".to_owned(), "pdbridge-block-v1".to_owned()), ("pdb_key".to_owned(), block.key)]);
    assert_eq!(BlockIdentity::from_metadata(&old), None);
}

#[test]
fn block_files_carry_the_digest_of_their_tensor_bytes() {
    let dir = temp_dir("digest");
    let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
    let (b0, t0) = block("s", BlockKey::ROOT, 0, 1);
    store.commit(&b0, &t0).unwrap();
    let data = fs::read(store.path_of(&b0.key)).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&data).unwrap();
    let block: BlockMetadata = serde_json::from_str(&header.metadata().as_ref().unwrap()[METADATA_KEY]).unwrap();
    let recorded = block.data_sha256;
    let file = safetensors::SafeTensors::deserialize(&data).unwrap();
    let mut names = file.names();
    names.sort();
    let mut hasher = Sha256::new();
    for name in names {
        hasher.update(file.tensor(name).unwrap().data());
    }
    assert_eq!(recorded, hex::encode(hasher.finalize()));
}

/// Fuzzing index rebuild with a hostile file in the store directory: a valid block file
/// with bytes flipped, cut short or grown. Opening the store never fails or panics; the
/// file is either indexed because it still proves its name, or quarantined.
mod fuzz {
    use proptest::{prelude::*, sample::Index as At};

    use super::*;

    proptest! {
        // At least this many cases; PROPTEST_CASES asks for more.
        #![proptest_config(ProptestConfig { cases: ProptestConfig::default().cases.max(512), ..ProptestConfig::default() })]

        #[test]
        fn a_damaged_block_file_is_quarantined_or_proves_its_name(
            flips in prop::collection::vec((any::<At>(), 1u8..), 0..6),
            cut in prop::option::of(any::<At>()),
            grown in prop::collection::vec(any::<u8>(), 0..24),
        ) {
            static CASE: AtomicU64 = AtomicU64::new(0);
            let dir = temp_dir(&format!("fuzz-{}", CASE.fetch_add(1, Ordering::Relaxed)));
            let (b0, t0) = block("spec", BlockKey::ROOT, 0, 1);
            let path = {
                let (store, _) = Store::open(&dir.0, 1 << 20).unwrap();
                store.commit(&b0, &t0).unwrap();
                store.path_of(&b0.key)
            };
            let mut bytes = fs::read(&path).unwrap();
            for (at, mask) in &flips {
                let i = at.index(bytes.len());
                bytes[i] ^= mask;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len()));
            }
            bytes.extend(&grown);
            fs::write(&path, &bytes).unwrap();

            let (store, report) = Store::open(&dir.0, 1 << 20).unwrap();
            prop_assert_eq!(report.blocks + report.quarantined, 1);
            let proven = verify_file(&path).map(|(key, _, _)| key);
            if report.blocks == 1 {
                prop_assert_eq!(proven.ok(), Some(b0.key));
                prop_assert!(store.contains(&b0.key));
            } else {
                prop_assert!(!path.exists() && !store.contains(&b0.key));
                prop_assert_eq!(fs::read_dir(dir.0.join("quarantine")).unwrap().count(), 1);
            }
        }
    }
}
