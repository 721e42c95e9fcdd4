//! The decoder computing its own cache ([`Payload::LayerInputs`]): a block
//! arrives as each layer's attention input and the decode engine runs its own
//! cache path on it — the same modules and kernels it prefills with, so the
//! cache is this backend's bits whatever backend the prefiller runs. Inputs
//! and result travel through files under the store's `tmp/`; the cache that
//! comes back is held to the spec like any pushed tensor before it is
//! committed.
//!
//! [`Payload::LayerInputs`]: pdbridge_common::proto::Payload::LayerInputs

use std::time::Instant;

use bytes::Bytes;
use pdbridge_common::{
    metric,
    proto::{CacheSpec, Payload},
    spec,
};
use safetensors::SafeTensors;

use crate::{
    engine::{Engine, EngineError},
    store::{BlockIdentity, BlockTensor, Store, safetensors_dtype},
};

#[derive(Debug, thiserror::Error)]
pub enum ReconstructError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{op} {path}: {source}")]
    Io { op: &'static str, path: String, source: std::io::Error },
    #[error("reconstruction task: {0}")]
    Task(#[from] tokio::task::JoinError),
    /// The engine's result does not hold the spec's tensors.
    #[error("the decode engine's cache does not match the spec: {0}")]
    Mismatch(String),
}

/// The cache of the block `identity` names, computed by `engine` from the
/// block's layer inputs (`inputs`, `"{layer}.input"`, verified against the
/// spec).
pub async fn cache_from_inputs(
    engine: &Engine,
    store: &Store,
    spec: &CacheSpec,
    identity: &BlockIdentity,
    inputs: Vec<BlockTensor>,
) -> Result<Vec<BlockTensor>, ReconstructError> {
    let started = Instant::now();
    let rows = identity.token_ids.len() as u32;
    let inputs_file = store.temp_file(&identity.key, "inputs.safetensors");
    let out_file = store.temp_file(&identity.key, "cache.safetensors");
    let inputs_path = inputs_file.path().to_owned();
    blocking(move || {
        safetensors::serialize_to_file(inputs.iter().map(|t| (t.name.as_str(), t)), None, &inputs_path).map_err(|e| {
            ReconstructError::Io {
                op: "write",
                path: inputs_path.display().to_string(),
                source: std::io::Error::other(e),
            }
        })
    })
    .await?;
    let offset = u64::from(identity.index) * u64::from(spec.block_tokens);
    engine.reconstruct(inputs_file.path(), offset, out_file.path()).await?;
    let out_path = out_file.path().to_owned();
    let read = blocking(move || {
        std::fs::read(&out_path).map_err(|source| ReconstructError::Io {
            op: "read",
            path: out_path.display().to_string(),
            source,
        })
    })
    .await?;
    let cache = checked(spec, rows, Bytes::from(read))?;
    metrics::histogram!(metric::RECONSTRUCT_SECONDS.name).record(started.elapsed().as_secs_f64());
    Ok(cache)
}

/// The tensors of a block file the engine wrote, each exactly as the spec
/// says a block of `rows` tokens holds it, as zero-copy slices of `file`.
fn checked(spec: &CacheSpec, rows: u32, file: Bytes) -> Result<Vec<BlockTensor>, ReconstructError> {
    let mismatch = |what: String| ReconstructError::Mismatch(what);
    let parsed = SafeTensors::deserialize(&file).map_err(|e| mismatch(e.to_string()))?;
    let mut tensors = Vec::new();
    for (name, view) in parsed.tensors() {
        let expected = name
            .split_once('.')
            .and_then(|(layer, tensor)| spec::rows_tensor(spec, layer.parse().ok()?, tensor, rows))
            .ok_or_else(|| mismatch(format!("no tensor {name:?} in the spec")))?;
        let shape: Vec<usize> = expected.shape.iter().map(|&d| d as usize).collect();
        if view.dtype() != safetensors_dtype(expected.dtype) || view.shape() != shape {
            return Err(mismatch(format!(
                "{name} is {:?} {:?}, expected {:?} {shape:?}",
                view.dtype(),
                view.shape(),
                expected.dtype
            )));
        }
        tensors.push(BlockTensor { name, dtype: view.dtype(), shape, parts: vec![file.slice_ref(view.data())] });
    }
    let want = spec::tensors_per_block(spec, Payload::Cache);
    if tensors.len() != want {
        return Err(mismatch(format!("{} tensors, expected {want}", tensors.len())));
    }
    Ok(tensors)
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ReconstructError> + Send + 'static,
) -> Result<T, ReconstructError> {
    tokio::task::spawn_blocking(work).await?
}
