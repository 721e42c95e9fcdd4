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
        metrics::describe_gauge!(
            "pdbridge_store_budget_bytes",
            metrics::Unit::Bytes,
            "Byte budget of the block store."
        );
        metrics::gauge!("pdbridge_store_budget_bytes").set(budget_bytes as f64);
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
        metrics::gauge!("pdbridge_store_leased_blocks").set(index.leased_blocks as f64);
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
        metrics::counter!("pdbridge_store_evictions_total").increment(1);
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
        metrics::counter!("pdbridge_store_quarantined_total").increment(1);
        let path = self.path_of(key);
        match self.quarantine(&path) {
            Err(StoreError::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => Ok(()),
            other => other,
        }
    }

    /// `pdbridge_store_blocks` and `pdbridge_store_bytes`.
    fn publish_usage(&self, index: &Index) {
        metrics::gauge!("pdbridge_store_blocks").set(index.entries.len() as f64);
        metrics::gauge!("pdbridge_store_bytes").set(index.total_bytes as f64);
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
        metrics::gauge!("pdbridge_store_leased_blocks").set(index.leased_blocks as f64);
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
mod tests {
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
        assert_eq!(
            identity.to_metadata(block.data_sha256.clone())[METADATA_KEY],
            serde_json::to_string(&block).unwrap()
        );
        let old =
            HashMap::from([("format".to_owned(), "pdbridge-block-v1".to_owned()), ("pdb_key".to_owned(), block.key)]);
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
}
