//! A decoder that computes its own cache (`front.reconstruct_on = "decoder"`), on real engines:
//! prefilld ships each layer's input and decoded's engine computes every block with its own
//! kernels. Both sides run MLX on this CPU, so those blocks must hold, byte for byte, what
//! prefilld computes for a decoder that leaves it the work — and the answers the native ones.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use pdbridge_tests::Daemon;
use safetensors::SafeTensors;
use serde_json::Value;

use crate::answers::{chat, native_text};

/// What a block file holds: its metadata, and each tensor's dtype, shape and bytes — whatever
/// order the header lists them in (the store writes its metadata from a hash map).
type BlockContent = (BTreeMap<String, String>, BTreeMap<String, (String, Vec<usize>, Vec<u8>)>);

/// Every block file under `store`, by its path below `blocks/`.
fn blocks_in(store: &Path) -> BTreeMap<String, BlockContent> {
    let mut blocks = BTreeMap::new();
    let root = store.join("blocks");
    let mut dirs = vec![root.clone()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            let file = std::fs::read(&path).unwrap();
            let (_, header) = SafeTensors::read_metadata(&file).unwrap();
            let metadata = header.metadata().clone().unwrap_or_default().into_iter().collect();
            let tensors = SafeTensors::deserialize(&file)
                .unwrap()
                .tensors()
                .into_iter()
                .map(|(name, view)| {
                    (name, (format!("{:?}", view.dtype()), view.shape().to_vec(), view.data().to_vec()))
                })
                .collect();
            blocks.insert(path.strip_prefix(&root).unwrap().display().to_string(), (metadata, tensors));
        }
    }
    blocks
}

/// `exact`, a decoder computing its own cache (`front.reconstruct_on = "decoder"`), bridges
/// `prompt` (required: a peer holding it is not asked), which `reference` (the same spec, prefilld
/// computing its cache) bridged already: it
/// computed every whole block and the tail itself, stored the bytes `reference` stored, and answers
/// as it does natively.
pub(crate) async fn computes_the_blocks_prefilld_computes(
    (exact, exact_store): &(Daemon, PathBuf),
    (reference, reference_store): &(Daemon, PathBuf),
    prompt: &Value,
) {
    let answer = chat(exact, prompt, "bridge").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.verdict["outcome"], "bridged", "{}", answer.verdict);
    assert_eq!(answer.cached_tokens(), answer.prompt_tokens() - 1, "{}", answer.verdict);
    let blocks = answer.verdict["blocks"].as_u64().unwrap();
    assert!(blocks >= 4, "{}", answer.verdict);
    assert_eq!(exact.metric("pdbridge_reconstruct_seconds_count").await, Some((blocks + 1) as f64));
    assert_eq!(reference.metric("pdbridge_reconstruct_seconds_count").await.unwrap_or(0.0), 0.0);

    let (computed_here, computed_there) = (blocks_in(exact_store), blocks_in(reference_store));
    assert_eq!(computed_here.len() as u64, blocks);
    assert!(computed_here == computed_there, "the decoder's blocks differ from prefilld's");
    let native = native_text(exact, prompt).await;
    assert_eq!(answer.text(), native, "the decoder's own cache answers otherwise than native");
}
