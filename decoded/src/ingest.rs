//! Assembling pushed shards into verified blocks.
//!
//! A Push stream opens with the prompt's token ids, then carries shards in any
//! order. Every shard is checked on arrival (spec, range, checksum, overlap);
//! a block is handed to the store the moment its last byte verifies (a block
//! of layer inputs to the engine first, which computes its cache), so a cut
//! stream leaves every completed block valid and nothing partial. Commits run
//! on blocking threads while the stream keeps being read (a block's fsync
//! overlaps the next block's bytes on the wire); [`Ingest::finish`] waits for
//! them. Memory is bounded to `max_open_blocks` blocks per stream, assembling
//! and committing together: a sender that outruns the disk is slowed down by
//! HTTP/2 flow control, not buffered; and for every stream together by
//! [`PushMemory`], in bytes.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

use tokio::{
    sync::{OwnedSemaphorePermit, Semaphore},
    task::JoinSet,
};
use tracing::Instrument;

use pdbridge_common::{
    block::{self, BlockKey},
    metric,
    proto::{self, CacheSpec, Payload, PushOpen, PushReceipt, PushSeal, Shard},
    reason::Reason,
    shard::{ShardError, TensorAssembly},
    spec,
};

use crate::{
    engine::{Engine, EngineError},
    reconstruct::{self, ReconstructError},
    store::{BlockIdentity, BlockTensor, Store, StoreError, safetensors_dtype},
};

#[derive(Debug, thiserror::Error)]
pub enum IngestError {
    #[error("spec fingerprint {got:?} does not match the decoder's {want:?}")]
    SpecMismatch { got: String, want: String },
    #[error("block {block} is outside the pushable blocks {first}..{end} of this prompt")]
    BlockOutOfRange { block: u32, first: u32, end: u32 },
    #[error("layer {layer} has no tensor {tensor:?} in the decoder's spec")]
    UnknownTensor { layer: u32, tensor: String },
    #[error("block {block} layer {layer} {tensor}: {source}")]
    Shard { block: u32, layer: u32, tensor: String, source: ShardError },
    #[error("block {block} was already committed by this stream")]
    AlreadyCommitted { block: u32 },
    #[error("more than {limit} blocks open at once")]
    TooManyOpenBlocks { limit: usize },
    #[error("block {block} needs {bytes} bytes; the Push streams hold all of store.max_push_bytes ({limit})")]
    PushMemorySpent { block: u32, bytes: u64, limit: u64 },
    #[error(
        "a tail of {tail_tokens} tokens must be shorter than a block and end before the last of {prompt_tokens} tokens"
    )]
    BadTail { tail_tokens: u32, prompt_tokens: usize },
    #[error("no tail can be stored: {0}")]
    TailUnsupported(String),
    #[error("payload {0} is not a Payload")]
    UnknownPayload(i32),
    #[error("layer inputs: {0}")]
    PayloadUnsupported(String),
    #[error("layer inputs need the decode engine: {0}")]
    NoEngine(EngineError),
    #[error("block {block}: {source}")]
    Reconstruct { block: u32, source: ReconstructError },
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

struct OpenBlock {
    tensors: HashMap<(u32, String), TensorAssembly>,
    complete: usize,
    /// Its bytes of [`PushMemory`], held until its commit ends.
    memory: Reserved,
}

/// The memory of the blocks every Push stream holds (assembling or committing), bounded in bytes
/// (`store.max_push_bytes`): a block reserves its whole size when its first shard arrives and
/// gives it back when its commit ends or its stream drops it. Kept in KiB permits.
#[derive(Clone)]
pub struct PushMemory {
    permits: Arc<Semaphore>,
    limit: u64,
}

/// A block's share of [`PushMemory`].
struct Reserved {
    permit: Option<OwnedSemaphorePermit>,
    memory: PushMemory,
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.permit.take(); // first: the gauge reads the semaphore
        self.memory.publish();
    }
}

impl PushMemory {
    pub fn new(limit: u64) -> Self {
        let kib = limit.div_ceil(1024).min(Semaphore::MAX_PERMITS as u64) as usize;
        metrics::gauge!(metric::PUSH_MEMORY_LIMIT.name).set(limit as f64);
        let memory = PushMemory { permits: Arc::new(Semaphore::new(kib)), limit };
        memory.publish();
        memory
    }

    /// `bytes` of it, if that many are free.
    fn reserve(&self, bytes: u64) -> Option<Reserved> {
        let kib = u32::try_from(bytes.div_ceil(1024)).ok()?;
        let permit = self.permits.clone().try_acquire_many_owned(kib).ok()?;
        let reserved = Reserved { permit: Some(permit), memory: self.clone() };
        self.publish();
        Some(reserved)
    }

    fn publish(&self) {
        let free = self.permits.available_permits() as u64 * 1024;
        metrics::gauge!(metric::PUSH_MEMORY.name).set(self.limit.saturating_sub(free) as f64);
    }
}

/// A commit's outcome: the block and the bytes its file holds.
type Committed = Result<(u32, u64), IngestError>;

pub struct Ingest {
    spec: Arc<CacheSpec>,
    store: Arc<Store>,
    request_id: String,
    token_ids: Vec<u32>,
    keys: Vec<BlockKey>,
    first_block: u32,
    max_open_blocks: usize,
    memory: PushMemory,
    payload: Payload,
    /// Computes each block's cache from its layer inputs (`Payload::LayerInputs`).
    engine: Option<Engine>,
    tensors_per_block: usize,
    open: HashMap<u32, OpenBlock>,
    /// Blocks handed to the store whose commit has not been reaped yet.
    committing: JoinSet<Committed>,
    /// Blocks complete on the wire: committed or being committed.
    complete: BTreeSet<u32>,
    committed: u32,
    bytes: u64,
    /// Rows of the prompt's tail this stream may carry as block `keys.len()`.
    tail_tokens: u32,
    tail_committed: bool,
}

impl Ingest {
    /// `engine` computes the cache of a stream of layer inputs.
    pub fn open(
        spec: Arc<CacheSpec>,
        store: Arc<Store>,
        open: PushOpen,
        max_open_blocks: usize,
        memory: PushMemory,
        engine: Option<Engine>,
    ) -> Result<Self, IngestError> {
        if open.spec_fingerprint != spec.spec_fingerprint {
            return Err(IngestError::SpecMismatch { got: open.spec_fingerprint, want: spec.spec_fingerprint.clone() });
        }
        let payload = Payload::try_from(open.payload).map_err(|_| IngestError::UnknownPayload(open.payload))?;
        let engine = match payload {
            Payload::Cache => None,
            Payload::LayerInputs => {
                if let Some(problem) = spec::payload_unsupported(&spec, payload) {
                    return Err(IngestError::PayloadUnsupported(problem));
                }
                let engine = engine.ok_or(IngestError::NoEngine(EngineError::NotReady))?;
                engine.can_compute().map_err(IngestError::NoEngine)?;
                Some(engine)
            }
        };
        let keys = spec::block_keys(&spec, &open.token_ids);
        // A tail is shorter than a block and leaves the prompt's last token to the decoder.
        let tail_end = keys.len() * spec.block_tokens as usize + open.tail_tokens as usize;
        if open.tail_tokens >= spec.block_tokens || (open.tail_tokens > 0 && tail_end >= open.token_ids.len()) {
            return Err(IngestError::BadTail { tail_tokens: open.tail_tokens, prompt_tokens: open.token_ids.len() });
        }
        if let Some(problem) = spec::tail_unsupported(&spec).filter(|_| open.tail_tokens > 0) {
            return Err(IngestError::TailUnsupported(problem));
        }
        let tensors_per_block = spec::tensors_per_block(&spec, payload);
        Ok(Ingest {
            spec,
            store,
            request_id: open.request_id,
            token_ids: open.token_ids,
            keys,
            first_block: open.first_block,
            max_open_blocks,
            memory,
            payload,
            engine,
            tensors_per_block,
            open: HashMap::new(),
            committing: JoinSet::new(),
            complete: BTreeSet::new(),
            committed: 0,
            bytes: 0,
            tail_tokens: open.tail_tokens,
            tail_committed: false,
        })
    }

    /// Rows of block `block` on the token axis: a whole block, or the tail.
    fn rows(&self, block: u32) -> u32 {
        if block as usize == self.keys.len() { self.tail_tokens } else { self.spec.block_tokens }
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Verifies one shard and, when it completes its block, starts committing
    /// the block. Reports a failed commit of an earlier block.
    pub async fn accept(&mut self, shard: Shard) -> Result<(), IngestError> {
        while let Some(done) = self.committing.try_join_next() {
            self.reap(done)?;
        }
        let block = shard.block_index;
        // One past the whole blocks when a tail may follow them.
        let end = self.keys.len() as u32 + u32::from(self.tail_tokens > 0);
        if block < self.first_block || block >= end {
            return Err(IngestError::BlockOutOfRange { block, first: self.first_block, end });
        }
        if self.complete.contains(&block) {
            return Err(IngestError::AlreadyCommitted { block });
        }
        let expected = spec::payload_tensor(&self.spec, self.payload, shard.layer, &shard.tensor, self.rows(block))
            .ok_or_else(|| IngestError::UnknownTensor { layer: shard.layer, tensor: shard.tensor.clone() })?;
        let shard_err = |source| IngestError::Shard { block, layer: shard.layer, tensor: shard.tensor.clone(), source };
        expected.check(&shard).map_err(shard_err)?;

        if !self.open.contains_key(&block) {
            // Room for one more block: wait for commits first, refuse only a
            // sender that keeps too many blocks half-sent.
            while self.open.len() + self.committing.len() >= self.max_open_blocks {
                match self.committing.join_next().await {
                    Some(done) => self.reap(done)?,
                    None => return Err(IngestError::TooManyOpenBlocks { limit: self.max_open_blocks }),
                }
            }
            let memory = self.reserve(block).await?;
            self.open.insert(block, OpenBlock { tensors: HashMap::new(), complete: 0, memory });
        }
        let open = self.open.get_mut(&block).expect("opened above");
        let assembly = open
            .tensors
            .entry((shard.layer, shard.tensor.clone()))
            .or_insert_with(|| TensorAssembly::new(expected.byte_len()));
        assembly.insert(shard.byte_offset, shard.payload).map_err(shard_err)?;
        if assembly.is_complete() {
            open.complete += 1;
        }
        if open.complete == self.tensors_per_block {
            let open = self.open.remove(&block).expect("present");
            self.start_commit(block, open);
        }
        Ok(())
    }

    /// Block `block`'s bytes of the Push memory: waits for this stream's own commits to give
    /// theirs back, refuses once it holds nothing and other streams hold it all.
    async fn reserve(&mut self, block: u32) -> Result<Reserved, IngestError> {
        let bytes = spec::block_bytes(&self.spec, self.payload, self.rows(block));
        loop {
            if let Some(reserved) = self.memory.reserve(bytes) {
                return Ok(reserved);
            }
            match self.committing.join_next().await {
                Some(done) => self.reap(done)?,
                None => return Err(IngestError::PushMemorySpent { block, bytes, limit: self.memory.limit }),
            }
        }
    }

    fn start_commit(&mut self, block: u32, open: OpenBlock) {
        let b = self.spec.block_tokens as usize;
        let index = block as usize;
        let rows = self.rows(block);
        let token_ids = self.token_ids[index * b..index * b + rows as usize].to_vec();
        let parent = if index == 0 { BlockKey::ROOT } else { self.keys[index - 1] };
        let tail = index == self.keys.len();
        let identity = BlockIdentity {
            key: if tail {
                block::tail_key(&self.spec.spec_fingerprint, &self.keys, &token_ids)
            } else {
                self.keys[index]
            },
            parent,
            spec_fingerprint: self.spec.spec_fingerprint.clone(),
            index: block,
            token_ids,
        };
        let OpenBlock { tensors, memory, .. } = open;
        let tensors: Vec<BlockTensor> = tensors
            .into_iter()
            .map(|((layer, name), assembly)| {
                let expected =
                    spec::payload_tensor(&self.spec, self.payload, layer, &name, rows).expect("checked on arrival");
                BlockTensor {
                    name: format!("{layer}.{name}"),
                    dtype: safetensors_dtype(expected.dtype),
                    shape: expected.shape.iter().map(|&d| d as usize).collect(),
                    parts: assembly.into_parts(),
                }
            })
            .collect();
        let store = self.store.clone();
        self.complete.insert(block);
        let span = tracing::info_span!("store.commit", pdbridge.block = block, pdbridge.tail = tail);
        let committing = span.clone();
        let commit = move |store: Arc<Store>, identity: BlockIdentity, tensors: Vec<BlockTensor>| {
            let _committing = committing.enter();
            let bytes =
                if tail { store.commit_tail(&identity, &tensors)? } else { store.commit(&identity, &tensors)? };
            drop(memory);
            Ok((block, bytes))
        };
        let Some(engine) = self.engine.clone() else {
            self.committing.spawn_blocking(move || commit(store, identity, tensors));
            return;
        };
        let spec = self.spec.clone();
        self.committing.spawn(
            async move {
                let cache = reconstruct::cache_from_inputs(&engine, &store, &spec, &identity, tensors)
                    .await
                    .map_err(|source| IngestError::Reconstruct { block, source })?;
                tokio::task::spawn_blocking(move || commit(store, identity, cache)).await.map_err(join_error)?
            }
            .instrument(span),
        );
    }

    /// Accounts for one finished commit.
    fn reap(&mut self, done: Result<Committed, tokio::task::JoinError>) -> Result<(), IngestError> {
        let (block, bytes) = done.map_err(join_error)??;
        self.bytes += bytes;
        if block as usize == self.keys.len() {
            self.tail_committed = true;
            return Ok(());
        }
        self.committed += 1;
        metrics::counter!(metric::STORE_BLOCKS_COMMITTED.name).increment(1);
        metrics::counter!(metric::PUSH_BYTES.name).increment(bytes);
        Ok(())
    }

    /// Waits for every commit started, then reports what this stream achieved.
    /// `seal` is None when the stream ended without one (then nothing the
    /// sender promised can be taken for granted). A failed commit is an error,
    /// after the others have finished: what did commit stays.
    pub async fn finish(mut self, seal: Option<PushSeal>) -> Result<PushReceipt, IngestError> {
        let mut first_error = None;
        while let Some(done) = self.committing.join_next().await {
            if let Err(e) = self.reap(done) {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        let first_missing = (self.first_block as usize..self.keys.len())
            .find(|&i| !self.store.contains(&self.keys[i]))
            .unwrap_or(self.keys.len()) as u32;
        let committed = self.committed;
        let detail = match seal {
            None => "stream ended without a seal".to_owned(),
            Some(seal) if committed < seal.blocks_emitted => {
                let incomplete: Vec<_> = self.open.keys().collect();
                format!("{} of {} emitted blocks committed; incomplete: {incomplete:?}", committed, seal.blocks_emitted)
            }
            Some(_) => String::new(),
        };
        let reason = if detail.is_empty() { proto::Reason::Unspecified } else { Reason::TransferFailed.to_proto() };
        Ok(PushReceipt {
            blocks_committed: committed,
            bytes: self.bytes,
            first_missing_block: first_missing,
            detail,
            reason: reason as i32,
            tail_committed: self.tail_committed,
        })
    }
}

impl Drop for Ingest {
    /// A Push cancelled mid-stream (the client reset it) still lands the
    /// blocks that arrived whole: their commits are detached, not aborted.
    fn drop(&mut self) {
        self.committing.detach_all();
    }
}

fn join_error(e: tokio::task::JoinError) -> StoreError {
    StoreError::Io { op: "commit", path: Default::default(), source: std::io::Error::other(e) }
}
