//! A decoder that computes its own cache (`front.reconstruct_on = "decoder"`), on real engines:
//! prefilld ships each layer's input and decoded's engine computes every block with its own
//! kernels. Both sides run MLX on this CPU, so those blocks must hold, byte for byte, what
//! prefilld computes for a decoder that leaves it the work — and the answers the native ones.

use std::{collections::BTreeMap, path::Path};

use pdbridge_tests::Scratch;
use safetensors::SafeTensors;

use crate::{
    answers::{chat, native_text, shared_prompt},
    topology::one_prefiller_and_decoders,
};

const BLOCK_TOKENS: u32 = 64;

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

#[tokio::test]
async fn a_decoder_computing_its_own_cache_stores_the_same_bytes_and_answers_natively() {
    let scratch = Scratch::new("exact");
    let modes = [(BLOCK_TOKENS, "reconstruct_on = \"prefiller\""), (BLOCK_TOKENS, "reconstruct_on = \"decoder\"")];
    let (_prefilld, started) = one_prefiller_and_decoders(&scratch, &modes).await;

    // One after the other: the same prompt, the same prefill, the same layer inputs.
    let prompt = shared_prompt();
    let mut answers = Vec::new();
    for (decoded, _) in &started {
        let answer = chat(decoded, &prompt, "auto").await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.verdict["outcome"], "bridged", "{}", answer.verdict);
        assert_eq!(answer.cached_tokens(), answer.prompt_tokens() - 1, "{}", answer.verdict);
        answers.push(answer);
    }
    // The decoder computed every whole block and the tail itself.
    let (exact, exact_store) = &started[1];
    let blocks = answers[1].verdict["blocks"].as_u64().unwrap();
    assert!(blocks >= 4, "{}", answers[1].verdict);
    assert_eq!(exact.metric("pdbridge_reconstruct_seconds_count").await, Some((blocks + 1) as f64));
    assert_eq!(started[0].0.metric("pdbridge_reconstruct_seconds_count").await.unwrap_or(0.0), 0.0);

    let (computed_here, computed_there) = (blocks_in(exact_store), blocks_in(&started[0].1));
    assert_eq!(computed_here.len() as u64, blocks);
    assert!(computed_here == computed_there, "the decoder's blocks differ from prefilld's");
    let native = native_text(exact, &prompt).await;
    assert_eq!(answers[1].text(), native, "the decoder's own cache answers otherwise than native");
    assert_eq!(answers[0].text(), native);
}
