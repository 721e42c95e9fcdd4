//! The prefix store: content-addressed cache blocks on disk.
//!
//! One safetensors file per block holds every layer's cache tensors for its
//! tokens, in the decoder's dtype and layout (`"{layer}.{tensor}"`), plus its
//! `BlockMetadata` (proto/engine.proto: its key, its parent's key, the spec
//! fingerprint, its token ids and the digest of its bytes), so every file can
//! prove its own name. A block becomes visible
//! only after it is written to a temp name, fsynced and renamed; the index is
//! rebuilt from disk at start and files that disagree with their names are
//! moved to `quarantine/`, never served. Eviction is LRU within a byte budget;
//! blocks leased to a running generation are never evicted.

use std::{
    borrow::Cow,
    collections::{BTreeMap, HashMap},
    fs,
    io::Read,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex, MutexGuard,
        atomic::{AtomicU64, Ordering},
    },
};

use bytes::Bytes;
use pdbridge_common::{
    block::{self, BlockKey},
    metric,
    proto::{Dtype, engine::BlockMetadata},
};
use safetensors::{Dtype as StDtype, tensor::Metadata};
use sha2::{Digest, Sha256};

/// Format tag in every block file's metadata (its "format").
pub const BLOCK_FORMAT: &str = "pdbridge-block-v2";
/// The metadata key holding the file's `BlockMetadata` in proto3 JSON.
const METADATA_KEY: &str = "pdbridge";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("block of {bytes} bytes exceeds the store budget of {budget} bytes")]
    TooLarge { bytes: u64, budget: u64 },
    #[error("no space left for block {key}")]
    NoSpace { key: BlockKey },
    #[error("encode block {key}: {message}")]
    Encode { key: BlockKey, message: String },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io { op, path: path.to_owned(), source }
}

/// Identity of a block: what its key is computed from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockIdentity {
    pub key: BlockKey,
    pub parent: BlockKey,
    pub spec_fingerprint: String,
    pub index: u32,
    pub token_ids: Vec<u32>,
}

impl BlockIdentity {
    /// True when `key` really is the chain hash of the rest.
    pub fn is_consistent(&self) -> bool {
        block::chain(&self.spec_fingerprint, &self.parent, &self.token_ids) == self.key
    }

    /// The file's metadata; `data_sha256`: the digest of its tensors' bytes, taken tensor by tensor
    /// in name order, so whoever reads the data can tell bit rot from a block (the adapter checks
    /// it before restoring).
    fn to_metadata(&self, data_sha256: String) -> HashMap<String, String> {
        let block = BlockMetadata {
            index: self.index,
            token_ids: self.token_ids.clone(),
            spec_fingerprint: self.spec_fingerprint.clone(),
            key: self.key.to_hex(),
            parent: self.parent.to_hex(),
            data_sha256,
        };
        let json = serde_json::to_string(&block).expect("a BlockMetadata prints as JSON");
        HashMap::from([("format".to_owned(), BLOCK_FORMAT.to_owned()), (METADATA_KEY.to_owned(), json)])
    }

    fn from_metadata(md: &HashMap<String, String>) -> Option<Self> {
        if md.get("format")? != BLOCK_FORMAT {
            return None;
        }
        let block: BlockMetadata = serde_json::from_str(md.get(METADATA_KEY)?).ok()?;
        Some(BlockIdentity {
            key: BlockKey::from_hex(&block.key)?,
            parent: BlockKey::from_hex(&block.parent)?,
            spec_fingerprint: block.spec_fingerprint,
            index: block.index,
            token_ids: block.token_ids,
        })
    }
}

/// One tensor of a block, as verified shards in byte order.
pub struct BlockTensor {
    /// Name in the file, `"{layer}.{tensor}"`.
    pub name: String,
    pub dtype: StDtype,
    pub shape: Vec<usize>,
    pub parts: Vec<Bytes>,
}

impl safetensors::View for &BlockTensor {
    fn dtype(&self) -> StDtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match self.parts.as_slice() {
            [one] => Cow::Borrowed(one),
            parts => Cow::Owned(parts.concat()),
        }
    }

    fn data_len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }
}

struct Entry {
    bytes: u64,
    /// LRU position (larger = more recent).
    tick: u64,
    /// Generations currently reading this block.
    leases: u32,
}

#[derive(Default)]
struct Index {
    entries: HashMap<BlockKey, Entry>,
    /// Keys some thread is writing now: a second commit of one of them waits
    /// for the first instead of racing it to the same file.
    committing: std::collections::HashSet<BlockKey>,
    /// Blocks with at least one lease (`pdbridge_store_leased_blocks`).
    leased_blocks: usize,
    by_tick: BTreeMap<u64, BlockKey>,
    next_tick: u64,
    total_bytes: u64,
}

impl Index {
    fn touch(&mut self, key: &BlockKey) {
        if let Some(entry) = self.entries.get_mut(key) {
            self.by_tick.remove(&entry.tick);
            self.next_tick += 1;
            entry.tick = self.next_tick;
            self.by_tick.insert(entry.tick, *key);
        }
    }

    fn insert(&mut self, key: BlockKey, bytes: u64) {
        if self.entries.contains_key(&key) {
            self.touch(&key);
            return;
        }
        self.next_tick += 1;
        self.entries.insert(key, Entry { bytes, tick: self.next_tick, leases: 0 });
        self.by_tick.insert(self.next_tick, key);
        self.total_bytes += bytes;
    }

    /// The least recently used block nobody is reading.
    fn coldest_unleased(&self) -> Option<BlockKey> {
        self.by_tick.values().find(|k| self.entries[*k].leases == 0).copied()
    }

    fn remove(&mut self, key: &BlockKey) -> Option<u64> {
        let entry = self.entries.remove(key)?;
        if entry.leases > 0 {
            self.leased_blocks -= 1;
        }
        self.by_tick.remove(&entry.tick);
        self.total_bytes -= entry.bytes;
        Some(entry.bytes)
    }
}

/// What [`Store::open`] found on disk.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OpenReport {
    pub blocks: usize,
    pub bytes: u64,
    pub quarantined: usize,
}

pub struct Store {
    root: PathBuf,
    budget_bytes: u64,
    index: Mutex<Index>,
    /// Signalled whenever a commit ends, for commits of the same key waiting
    /// on `Index::committing`.
    commit_ended: Condvar,
    /// Makes every temp file name unique within this process.
    next_temp: AtomicU64,
}

impl Store {
    /// Opens (creating if needed) the store under `root` and rebuilds the
    /// index from the block files found there.
    pub fn open(root: &Path, budget_bytes: u64) -> Result<(Store, OpenReport), StoreError> {
        for dir in ["blocks", "tmp", "quarantine", "tails"] {
            let path = root.join(dir);
            fs::create_dir_all(&path).map_err(io_err("create", &path))?;
        }
        // Leftovers of writes cut short by a crash were never visible, and the
        // requests the tails were for are gone.
        for dir in ["tmp", "tails"].map(|d| root.join(d)) {
            for entry in fs::read_dir(&dir).map_err(io_err("list", &dir))?.flatten() {
                let _ = fs::remove_file(entry.path());
            }
        }
        let store = Store {
            root: root.to_owned(),
            budget_bytes,
            index: Mutex::new(Index::default()),
            commit_ended: Condvar::new(),
            next_temp: AtomicU64::new(0),
        };
        let mut report = OpenReport::default();
        let mut found = Vec::new();
        let blocks = root.join("blocks");
        for shard_dir in fs::read_dir(&blocks).map_err(io_err("list", &blocks))?.flatten() {
            // Anything but a directory here is not ours (a Mac's Finder drops
            // `.DS_Store` files): set it aside rather than refuse to start.
            if !shard_dir.file_type().is_ok_and(|t| t.is_dir()) {
                tracing::warn!(path = %shard_dir.path().display(), "quarantining a stray entry in the block directory");
                store.quarantine(&shard_dir.path())?;
                report.quarantined += 1;
                continue;
            }
            for file in fs::read_dir(shard_dir.path()).map_err(io_err("list", &shard_dir.path()))?.flatten() {
                let path = file.path();
                match verify_file(&path) {
                    Ok((key, bytes, modified)) => found.push((modified, key, bytes)),
                    Err(problem) => {
                        tracing::warn!(path = %path.display(), problem, "quarantining block file");
                        store.quarantine(&path)?;
                        report.quarantined += 1;
                    }
                }
            }
        }
        // Oldest first, so recency survives a restart approximately.
        found.sort();
        let mut index = store.index.lock().unwrap();
        for (_, key, bytes) in found {
            index.insert(key, bytes);
            report.blocks += 1;
            report.bytes += bytes;
        }
        store.publish_usage(&index);
        drop(index);
        metrics::gauge!(metric::STORE_BUDGET.name).set(budget_bytes as f64);
        Ok((store, report))
    }

    fn path_of(&self, key: &BlockKey) -> PathBuf {
        let hex = key.to_hex();
        self.root.join("blocks").join(&hex[..2]).join(format!("{hex}.safetensors"))
    }

    fn quarantine(&self, path: &Path) -> Result<(), StoreError> {
        let name = path.file_name().map(|n| n.to_owned()).unwrap_or_default();
        let dest = self.root.join("quarantine").join(name);
        fs::rename(path, &dest).map_err(io_err("quarantine", path))
    }

    /// Whether the store's directory accepts new files (asked of the kernel,
    /// which also knows a read-only mount; nothing is written), and the bytes
    /// free on its file system (for health checks such as `pdbridge doctor`).
    pub fn probe(&self) -> (bool, Option<u64>) {
        (writable(&self.root.join("tmp")), free_bytes(&self.root))
    }

    pub fn budget_bytes(&self) -> u64 {
        self.budget_bytes
    }

    /// (blocks, bytes) currently stored.
    pub fn usage(&self) -> (usize, u64) {
        let index = self.index.lock().unwrap();
        (index.entries.len(), index.total_bytes)
    }

    /// Drops from the index every block whose file is no longer on disk (removed from outside the
    /// daemon: a cleaned directory, an operator's `rm`), so usage, the budget and lookups say what
    /// the disk holds. Blocking I/O (a `stat` per block). Returns how many were dropped.
    pub fn forget_missing(&self) -> usize {
        let keys: Vec<BlockKey> = self.index.lock().unwrap().entries.keys().copied().collect();
        let missing: Vec<BlockKey> = keys.into_iter().filter(|k| !self.path_of(k).exists()).collect();
        if missing.is_empty() {
            return 0;
        }
        let mut index = self.index.lock().unwrap();
        // A block committed again meanwhile has its file back.
        let gone: Vec<&BlockKey> = missing.iter().filter(|k| !self.path_of(k).exists()).collect();
        for key in &gone {
            index.remove(key);
        }
        self.publish_usage(&index);
        tracing::warn!(blocks = gone.len(), "block files removed from outside the daemon: forgotten");
        gone.len()
    }

    pub fn contains(&self, key: &BlockKey) -> bool {
        self.index.lock().unwrap().entries.contains_key(key)
    }

    /// How many of `keys` are stored from the first without a gap; marks them
    /// recently used.
    pub fn longest_prefix(&self, keys: &[BlockKey]) -> usize {
        let mut index = self.index.lock().unwrap();
        let n = keys.iter().take_while(|k| index.entries.contains_key(k)).count();
        for key in &keys[..n] {
            index.touch(key);
        }
        n
    }

    /// Leases the longest stored prefix of `keys` for reading: those blocks
    /// cannot be evicted until the lease is dropped.
    pub fn lease(self: &Arc<Self>, keys: &[BlockKey]) -> Lease {
        let mut index = self.index.lock().unwrap();
        let mut leased = Vec::new();
        for key in keys {
            let Some(entry) = index.entries.get_mut(key) else { break };
            entry.leases += 1;
            if entry.leases == 1 {
                index.leased_blocks += 1;
            }
            leased.push(*key);
        }
        for key in &leased {
            index.touch(key);
        }
        metrics::gauge!(metric::STORE_LEASED_BLOCKS.name).set(index.leased_blocks as f64);
        let paths = leased.iter().map(|k| self.path_of(k)).collect();
        Lease { store: self.clone(), keys: leased, paths }
    }

    /// Writes a verified block durably and makes it visible. Blocking I/O:
    /// call from a blocking thread. Returns the file's size in bytes, or 0
    /// when the block was already stored. Commits of one key are serialized;
    /// a failed commit leaves nothing behind (no temp file, no unindexed block).
    pub fn commit(&self, identity: &BlockIdentity, tensors: &[BlockTensor]) -> Result<u64, StoreError> {
        let key = identity.key;
        let data_bytes: u64 = tensors.iter().map(|t| t.parts.iter().map(|p| p.len() as u64).sum::<u64>()).sum();
        if data_bytes > self.budget_bytes {
            return Err(StoreError::TooLarge { bytes: data_bytes, budget: self.budget_bytes });
        }
        {
            let mut index = self.index.lock().unwrap();
            while index.committing.contains(&key) {
                index = self.commit_ended.wait(index).unwrap();
            }
            if index.entries.contains_key(&key) {
                index.touch(&key);
                return Ok(0);
            }
            index.committing.insert(key);
        }
        let result = self.write_block(identity, tensors, data_bytes);
        let mut index = self.index.lock().unwrap();
        index.committing.remove(&key);
        if let Ok(bytes) = result {
            index.insert(key, bytes);
            self.evict_over_budget(&mut index);
            self.publish_usage(&index);
        }
        drop(index);
        self.commit_ended.notify_all();
        result
    }

    /// Temp file, fsync, rename, directory fsync. The caller holds the key's
    /// commit slot.
    fn write_block(
        &self,
        identity: &BlockIdentity,
        tensors: &[BlockTensor],
        data_bytes: u64,
    ) -> Result<u64, StoreError> {
        let key = identity.key;
        self.make_room(data_bytes, &key)?;
        let tmp = self.serialize_to_temp(identity, tensors)?;
        let file = fs::File::open(tmp.path()).map_err(io_err("open", tmp.path()))?;
        file.sync_all()
            .map_err(|e| if no_space(&e) { StoreError::NoSpace { key } } else { io_err("fsync", tmp.path())(e) })?;
        let bytes = file.metadata().map_err(io_err("stat", tmp.path()))?.len();
        let dest = self.path_of(&key);
        let dir = dest.parent().expect("block paths have a parent");
        fs::create_dir_all(dir).map_err(io_err("create", dir))?;
        tmp.rename_to(&dest)?;
        // The rename is durable only once its directory is; a block that may
        // not survive a crash is taken back rather than served.
        if let Err(e) = fs::File::open(dir).and_then(|d| d.sync_all()) {
            let _ = fs::remove_file(&dest);
            return Err(io_err("fsync", dir)(e));
        }
        Ok(bytes)
    }

    /// A unique path under `tmp/` for work on block `key` (the file is removed
    /// when the handle drops; opening the store clears what a crash left).
    pub fn temp_file(&self, key: &BlockKey, suffix: &str) -> TempFile {
        let serial = self.next_temp.fetch_add(1, Ordering::Relaxed);
        let name = format!("{}.{}.{serial}.{suffix}", key.to_hex(), std::process::id());
        TempFile(Some(self.root.join("tmp").join(name)))
    }

    /// The block file of `identity` in a unique temp file (removed if dropped).
    fn serialize_to_temp(&self, identity: &BlockIdentity, tensors: &[BlockTensor]) -> Result<TempFile, StoreError> {
        let key = identity.key;
        let tmp = self.temp_file(&key, "partial");
        let metadata = identity.to_metadata(data_digest(tensors));
        safetensors::serialize_to_file(tensors.iter().map(|t| (t.name.as_str(), t)), Some(metadata), tmp.path())
            .map_err(|err| match err {
                safetensors::SafeTensorError::IoError(e) if no_space(&e) => StoreError::NoSpace { key },
                other => StoreError::Encode { key, message: other.to_string() },
            })?;
        Ok(tmp)
    }

    /// Writes a prompt's tail for the one request about to use it: in the
    /// block file format, under `tails/`, neither indexed nor in the budget nor
    /// fsynced (it lives for one generation; opening the store clears them).
    /// Tails older than [`TAIL_MAX_AGE`] (their request never came) go first.
    /// Returns the file's size.
    pub fn commit_tail(&self, identity: &BlockIdentity, tensors: &[BlockTensor]) -> Result<u64, StoreError> {
        self.prune_tails();
        let tmp = self.serialize_to_temp(identity, tensors)?;
        let bytes = fs::metadata(tmp.path()).map_err(io_err("stat", tmp.path()))?.len();
        tmp.rename_to(&self.tail_path(&identity.key))?;
        Ok(bytes)
    }

    /// The tail with `key`, handed to one request: deleted when it drops.
    pub fn take_tail(&self, key: &BlockKey) -> Option<Tail> {
        let path = self.tail_path(key);
        path.is_file().then_some(Tail { path })
    }

    fn tail_path(&self, key: &BlockKey) -> PathBuf {
        self.root.join("tails").join(format!("{}.safetensors", key.to_hex()))
    }

    fn prune_tails(&self) {
        let Ok(entries) = fs::read_dir(self.root.join("tails")) else { return };
        for entry in entries.flatten() {
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > TAIL_MAX_AGE));
            if stale {
                let _ = fs::remove_file(entry.path());
            }
        }
    }

    /// Evicts cold blocks until the file system has room for `bytes` more
    /// (the byte budget alone does not know what else fills the disk).
    fn make_room(&self, bytes: u64, key: &BlockKey) -> Result<(), StoreError> {
        // Headroom for the header and for whatever else writes meanwhile.
        let needed = bytes + bytes / 16 + (1 << 20);
        loop {
            match free_bytes(&self.root) {
                Some(free) if free < needed => {}
                _ => return Ok(()),
            }
            let mut index = self.index.lock().unwrap();
            let Some(cold) = index.coldest_unleased() else { return Err(StoreError::NoSpace { key: *key }) };
            self.evict(&mut index, &cold);
            self.publish_usage(&index);
        }
    }

    /// Forgets a block and deletes its file, under the index lock so a
    /// concurrent commit of the same key cannot have its fresh file deleted.
    fn evict(&self, index: &mut MutexGuard<'_, Index>, key: &BlockKey) {
        index.remove(key);
        metrics::counter!(metric::STORE_EVICTIONS.name).increment(1);
        let path = self.path_of(key);
        if let Err(err) = fs::remove_file(&path) {
            tracing::warn!(path = %path.display(), error = %err, "cannot remove evicted block");
        }
    }

    /// Takes a stored block out of service (its file failed a reader's
    /// checks): forgotten by the index, its file moved to `quarantine/` for a
    /// post-mortem. The next request for it bridges it again.
    pub fn quarantine_block(&self, key: &BlockKey) -> Result<(), StoreError> {
        let mut index = self.index.lock().unwrap();
        index.remove(key);
        self.publish_usage(&index);
        metrics::counter!(metric::STORE_QUARANTINED.name).increment(1);
        let path = self.path_of(key);
        match self.quarantine(&path) {
            Err(StoreError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// `pdbridge_store_blocks` and `pdbridge_store_bytes`.
    fn publish_usage(&self, index: &Index) {
        metrics::gauge!(metric::STORE_BLOCKS.name).set(index.entries.len() as f64);
        metrics::gauge!(metric::STORE_BYTES.name).set(index.total_bytes as f64);
    }

    fn evict_over_budget(&self, index: &mut MutexGuard<'_, Index>) {
        while index.total_bytes > self.budget_bytes {
            let Some(key) = index.coldest_unleased() else { break };
            self.evict(index, &key);
        }
    }
}

/// `BlockMetadata.data_sha256` of these tensors.
fn data_digest(tensors: &[BlockTensor]) -> String {
    let mut by_name: Vec<&BlockTensor> = tensors.iter().collect();
    by_name.sort_by(|a, b| a.name.cmp(&b.name));
    let mut hasher = Sha256::new();
    for part in by_name.iter().flat_map(|t| &t.parts) {
        hasher.update(part);
    }
    hex::encode(hasher.finalize())
}

/// A temp file removed on drop unless it was renamed into place, so no
/// error path leaves one behind.
/// A file under the store's `tmp/`, removed when dropped unless renamed.
pub struct TempFile(Option<PathBuf>);

impl TempFile {
    pub fn path(&self) -> &Path {
        self.0.as_deref().expect("a temp file has its path until renamed")
    }

    fn rename_to(mut self, dest: &Path) -> Result<(), StoreError> {
        fs::rename(self.path(), dest).map_err(io_err("rename", self.path()))?;
        self.0 = None;
        Ok(())
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = fs::remove_file(path);
        }
    }
}

fn c_path(path: &Path) -> Option<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes()).ok()
}

/// Whether this process may create files in the directory `path`.
fn writable(path: &Path) -> bool {
    // SAFETY: a valid NUL-terminated path; access() only reads it.
    c_path(path).is_some_and(|c_path| unsafe { libc::access(c_path.as_ptr(), libc::W_OK | libc::X_OK) } == 0)
}

/// Bytes available to unprivileged users on the file system holding `path`.
fn free_bytes(path: &Path) -> Option<u64> {
    let c_path = c_path(path)?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: a valid NUL-terminated path and a pointer to writable statvfs storage.
    if unsafe { libc::statvfs(c_path.as_ptr(), stat.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled the struct.
    let stat = unsafe { stat.assume_init() };
    #[allow(clippy::unnecessary_cast)] // the field types differ between Linux and macOS
    Some(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// How long an unclaimed tail is kept: longer than any request's bridge.
const TAIL_MAX_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// A prompt's tail held for one request; its file is deleted on drop.
pub struct Tail {
    path: PathBuf,
}

impl Tail {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for Tail {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

fn no_space(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::StorageFull
}

/// Blocks held for a reader; see [`Store::lease`].
pub struct Lease {
    store: Arc<Store>,
    keys: Vec<BlockKey>,
    paths: Vec<PathBuf>,
}

impl Lease {
    /// Files of the leased blocks, in prompt order.
    pub fn paths(&self) -> &[PathBuf] {
        &self.paths
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut index = self.store.index.lock().unwrap();
        for key in &self.keys {
            if let Some(entry) = index.entries.get_mut(key) {
                entry.leases -= 1;
                if entry.leases == 0 {
                    index.leased_blocks -= 1;
                }
            }
        }
        metrics::gauge!(metric::STORE_LEASED_BLOCKS.name).set(index.leased_blocks as f64);
    }
}

/// Checks a block file's header against its name and size without reading
/// its tensors. Returns (key, size, mtime) or what is wrong.
fn verify_file(path: &Path) -> Result<(BlockKey, u64, std::time::SystemTime), String> {
    let stem = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_suffix(".safetensors"));
    let named = stem.and_then(BlockKey::from_hex).ok_or("name is not <key>.safetensors")?;
    let mut file = fs::File::open(path).map_err(|e| e.to_string())?;
    let stat = file.metadata().map_err(|e| e.to_string())?;
    let mut len = [0u8; 8];
    file.read_exact(&mut len).map_err(|_| "shorter than a safetensors header")?;
    let header_len = u64::from_le_bytes(len);
    if header_len > 100 << 20 || 8 + header_len > stat.len() {
        return Err("header length out of range".into());
    }
    let mut header = vec![0u8; header_len as usize];
    file.read_exact(&mut header).map_err(|e| e.to_string())?;
    let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| format!("bad header: {e}"))?;
    let data_end = metadata.tensors().values().map(|t| t.data_offsets.1).max().unwrap_or(0) as u64;
    if 8 + header_len + data_end != stat.len() {
        return Err(format!("size {} disagrees with header ({} bytes)", stat.len(), 8 + header_len + data_end));
    }
    let identity = metadata
        .metadata()
        .as_ref()
        .and_then(BlockIdentity::from_metadata)
        .ok_or("missing or malformed pdbridge metadata")?;
    if identity.key != named {
        return Err(format!("embedded key {} disagrees with the name", identity.key));
    }
    if !identity.is_consistent() {
        return Err("key is not the chain hash of its spec, parent and tokens".into());
    }
    let modified = stat.modified().unwrap_or(std::time::UNIX_EPOCH);
    Ok((named, stat.len(), modified))
}

/// The safetensors element type of a spec dtype.
pub fn safetensors_dtype(dtype: Dtype) -> StDtype {
    match dtype {
        Dtype::F32 => StDtype::F32,
        Dtype::F16 => StDtype::F16,
        Dtype::Bf16 => StDtype::BF16,
        Dtype::U32 => StDtype::U32,
        Dtype::I32 => StDtype::I32,
        Dtype::U8 | Dtype::Unspecified => StDtype::U8,
    }
}

#[cfg(test)]
mod tests;
