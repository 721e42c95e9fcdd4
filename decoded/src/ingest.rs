//! Assembling pushed shards into verified blocks.
//!
//! A Push stream opens with the prompt's token ids, then carries shards in any
//! order. Every shard is checked on arrival (spec, range, checksum, overlap);
//! a block is committed to the store the moment its last byte verifies, so a
//! cut stream leaves every completed block valid and nothing partial. Memory
//! is bounded to `max_open_blocks` partially assembled blocks per stream.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Arc,
};

use pdbridge_common::{
    block::{self, BlockKey},
    proto::{CacheSpec, Dtype, PushOpen, PushReceipt, PushSeal, Shard},
    shard::{ShardError, TensorAssembly},
    spec,
};

use crate::store::{BlockIdentity, BlockTensor, Store, StoreError};

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
    #[error("store: {0}")]
    Store(#[from] StoreError),
}

struct OpenBlock {
    tensors: HashMap<(u32, String), TensorAssembly>,
    complete: usize,
}

pub struct Ingest {
    spec: Arc<CacheSpec>,
    store: Arc<Store>,
    request_id: String,
    token_ids: Vec<u32>,
    keys: Vec<BlockKey>,
    first_block: u32,
    max_open_blocks: usize,
    tensors_per_block: usize,
    open: HashMap<u32, OpenBlock>,
    committed: BTreeSet<u32>,
    bytes: u64,
}

impl Ingest {
    pub fn open(
        spec: Arc<CacheSpec>,
        store: Arc<Store>,
        open: PushOpen,
        max_open_blocks: usize,
    ) -> Result<Self, IngestError> {
        if open.spec_fingerprint != spec.spec_fingerprint {
            return Err(IngestError::SpecMismatch { got: open.spec_fingerprint, want: spec.spec_fingerprint.clone() });
        }
        let keys = block::keys(&spec.spec_fingerprint, &open.token_ids, spec.block_tokens as usize);
        let tensors_per_block = spec.layers.iter().map(|l| l.tensors.len()).sum();
        Ok(Ingest {
            spec,
            store,
            request_id: open.request_id,
            token_ids: open.token_ids,
            keys,
            first_block: open.first_block,
            max_open_blocks,
            tensors_per_block,
            open: HashMap::new(),
            committed: BTreeSet::new(),
            bytes: 0,
        })
    }

    pub fn request_id(&self) -> &str {
        &self.request_id
    }

    /// Verifies one shard and, when it completes its block, commits the block.
    pub async fn accept(&mut self, shard: Shard) -> Result<(), IngestError> {
        let block = shard.block_index;
        let end = self.keys.len() as u32;
        if block < self.first_block || block >= end {
            return Err(IngestError::BlockOutOfRange { block, first: self.first_block, end });
        }
        if self.committed.contains(&block) {
            return Err(IngestError::AlreadyCommitted { block });
        }
        let expected = spec::block_tensor(&self.spec, shard.layer, &shard.tensor)
            .ok_or_else(|| IngestError::UnknownTensor { layer: shard.layer, tensor: shard.tensor.clone() })?;
        let shard_err = |source| IngestError::Shard { block, layer: shard.layer, tensor: shard.tensor.clone(), source };
        expected.check(&shard).map_err(shard_err)?;

        if !self.open.contains_key(&block) && self.open.len() >= self.max_open_blocks {
            return Err(IngestError::TooManyOpenBlocks { limit: self.max_open_blocks });
        }
        let open = self.open.entry(block).or_insert_with(|| OpenBlock { tensors: HashMap::new(), complete: 0 });
        let assembly = open
            .tensors
            .entry((shard.layer, shard.tensor.clone()))
            .or_insert_with(|| TensorAssembly::new(expected.byte_len()));
        assembly.insert(shard.byte_offset, shard.payload.clone()).map_err(shard_err)?;
        if assembly.is_complete() {
            open.complete += 1;
        }
        if open.complete == self.tensors_per_block {
            let open = self.open.remove(&block).expect("present");
            self.commit(block, open).await?;
        }
        Ok(())
    }

    async fn commit(&mut self, block: u32, open: OpenBlock) -> Result<(), IngestError> {
        let b = self.spec.block_tokens as usize;
        let index = block as usize;
        let identity = BlockIdentity {
            key: self.keys[index],
            parent: if index == 0 { BlockKey::ROOT } else { self.keys[index - 1] },
            spec_fingerprint: self.spec.spec_fingerprint.clone(),
            index: block,
            token_ids: self.token_ids[index * b..(index + 1) * b].to_vec(),
        };
        let tensors: Vec<BlockTensor> = open
            .tensors
            .into_iter()
            .map(|((layer, name), assembly)| {
                let expected = spec::block_tensor(&self.spec, layer, &name).expect("checked on arrival");
                BlockTensor {
                    name: format!("{layer}.{name}"),
                    dtype: safetensors_dtype(expected.dtype),
                    shape: expected.shape.iter().map(|&d| d as usize).collect(),
                    parts: assembly.parts().cloned().collect(),
                }
            })
            .collect();
        let store = self.store.clone();
        let bytes = tokio::task::spawn_blocking(move || store.commit(&identity, &tensors)).await.map_err(|e| {
            StoreError::Io { op: "commit", path: Default::default(), source: std::io::Error::other(e) }
        })??;
        self.committed.insert(block);
        self.bytes += bytes;
        metrics::counter!("pdbridge_store_blocks_committed_total").increment(1);
        metrics::counter!("pdbridge_push_bytes_total").increment(bytes);
        Ok(())
    }

    /// What this stream achieved. `seal` is None when the stream ended without
    /// one (then nothing the sender promised can be taken for granted).
    pub fn receipt(&self, seal: Option<PushSeal>) -> PushReceipt {
        let first_missing = (self.first_block as usize..self.keys.len())
            .find(|&i| !self.store.contains(&self.keys[i]))
            .unwrap_or(self.keys.len()) as u32;
        let committed = self.committed.len() as u32;
        let reason = match seal {
            None => "stream ended without a seal".to_owned(),
            Some(seal) if committed < seal.blocks_emitted => {
                let incomplete: Vec<_> = self.open.keys().collect();
                format!("{} of {} emitted blocks committed; incomplete: {incomplete:?}", committed, seal.blocks_emitted)
            }
            Some(_) => String::new(),
        };
        PushReceipt { blocks_committed: committed, bytes: self.bytes, first_missing_block: first_missing, reason }
    }
}

fn safetensors_dtype(dtype: Dtype) -> safetensors::Dtype {
    match dtype {
        Dtype::F32 => safetensors::Dtype::F32,
        Dtype::F16 => safetensors::Dtype::F16,
        Dtype::Bf16 => safetensors::Dtype::BF16,
        Dtype::U32 => safetensors::Dtype::U32,
        Dtype::I32 => safetensors::Dtype::I32,
        Dtype::U8 | Dtype::Unspecified => safetensors::Dtype::U8,
    }
}
