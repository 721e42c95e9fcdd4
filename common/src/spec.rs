//! The decoder's cache spec: its fingerprint and what it says one block
//! tensor must look like.

use prost::Message;
use sha2::{Digest, Sha256};

use crate::{
    block::{self, BlockKey},
    proto::{CacheKind, CacheSpec, Extent, LayerSpec, Payload},
    shard::Expected,
};

/// Hex SHA-256 over the spec's protobuf encoding with `spec_fingerprint`
/// cleared. Maps are ordered (`build.rs`), so the encoding is deterministic.
pub fn fingerprint(spec: &CacheSpec) -> String {
    let mut unsigned = spec.clone();
    unsigned.spec_fingerprint.clear();
    hex(&Sha256::digest(unsigned.encode_to_vec()))
}

/// Lower-case hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `fingerprint` has the form of one: 64 lower-case hex digits (a
/// peer's value is joined into file names and compared as text).
pub fn is_fingerprint(fingerprint: &str) -> bool {
    fingerprint.len() == 64 && fingerprint.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Refuses a prompt the decoder could never hold: more tokens than its
/// context, or an id outside its vocabulary.
pub fn check_tokens(spec: &CacheSpec, token_ids: &[u32]) -> Result<(), String> {
    if token_ids.len() > spec.max_context as usize {
        return Err(format!("{} tokens exceed the decoder's context of {}", token_ids.len(), spec.max_context));
    }
    if let Some((at, id)) = token_ids.iter().enumerate().find(|(_, id)| **id >= spec.vocab_size) {
        return Err(format!("id {id} at {at} is outside the vocabulary of {}", spec.vocab_size));
    }
    Ok(())
}

/// The dtype and full shape of tensor `name` of `layer` in one block, or
/// `None` when the spec has no such tensor.
pub fn block_tensor(spec: &CacheSpec, layer: u32, name: &str) -> Option<Expected> {
    rows_tensor(spec, layer, name, spec.block_tokens)
}

/// [`block_tensor`] for `rows` tokens (a prompt's tail is shorter than a block), as the tensor's
/// extent says: `rows` along the token axis, the same shape whatever the rows, or a whole block's
/// only (`None` for any other `rows`).
pub fn rows_tensor(spec: &CacheSpec, layer: u32, name: &str, rows: u32) -> Option<Expected> {
    let layer = spec.layers.get(layer as usize)?;
    let tensor = layer.tensors.iter().find(|t| t.name == name)?;
    let mut shape = tensor.shape.clone();
    match tensor.extent() {
        Extent::PerToken => *shape.get_mut(tensor.token_axis as usize)? = rows as u64,
        Extent::Fixed => {}
        Extent::PerBlock if rows == spec.block_tokens => {}
        Extent::PerBlock | Extent::Unspecified => return None,
    }
    Some(Expected { dtype: tensor.dtype(), shape })
}

/// A layer's tensor in a [`Payload::LayerInputs`] block: its attention input.
pub const LAYER_INPUT: &str = "input";

/// Tensor `name` of `layer` in a block of `rows` tokens as `payload` carries
/// it: a cache tensor ([`rows_tensor`]), or the input of a layer that is computed from its
/// block's inputs alone (`from_inputs`), `[rows, hidden_size]` in the decoder's activation dtype.
pub fn payload_tensor(spec: &CacheSpec, payload: Payload, layer: u32, name: &str, rows: u32) -> Option<Expected> {
    match payload {
        Payload::Cache => rows_tensor(spec, layer, name, rows),
        Payload::LayerInputs => (name == LAYER_INPUT && spec.layers.get(layer as usize)?.from_inputs)
            .then(|| Expected { dtype: spec.input_dtype(), shape: vec![u64::from(rows), u64::from(spec.hidden_size)] }),
    }
}

/// Tensors in one block as `payload` carries it.
pub fn tensors_per_block(spec: &CacheSpec, payload: Payload) -> usize {
    match payload {
        Payload::Cache => spec.layers.iter().map(|l| l.tensors.len()).sum(),
        Payload::LayerInputs => spec.layers.iter().filter(|l| l.from_inputs).count(),
    }
}

/// Why `payload` cannot carry this spec's blocks; None when it can.
pub fn payload_unsupported(spec: &CacheSpec, payload: Payload) -> Option<String> {
    if payload == Payload::Cache {
        return None;
    }
    if let Some(layer) = spec.layers.iter().find(|l| !l.from_inputs && bridged(l)) {
        return Some(format!(
            "layer {} keeps a recurrent state ({}), which chains every block before it: the decoder cannot \
             compute it from one block's layer inputs",
            layer.index, layer.cache_class
        ));
    }
    (spec.input_dtype().size_bytes().is_none()).then(|| "the decoder's spec names no activation dtype".to_owned())
}

/// Whether a layer is one a prefiller reconstructs: it has a kind, and not the unsupported one.
fn bridged(layer: &LayerSpec) -> bool {
    !matches!(CacheKind::try_from(layer.kind), Ok(CacheKind::Unsupported | CacheKind::Unspecified))
}

/// Whether a layer of the spec carries a state from block to block (not `from_inputs`): a
/// reconstruction must then run every block from the first, known ones included.
pub fn chains_blocks(spec: &CacheSpec) -> bool {
    spec.layers.iter().any(|l| !l.from_inputs && bridged(l))
}

/// Why a prompt's tail (a partial block) cannot be stored for this spec; None when it can.
pub fn tail_unsupported(spec: &CacheSpec) -> Option<String> {
    spec.layers.iter().find(|l| !l.takes_tail && bridged(l)).map(|layer| {
        format!("layer {} ({}) stores whole blocks only: a partial block has none", layer.index, layer.cache_class)
    })
}

/// The prompt tokens whose whole blocks are stored. A layer that cannot be rewound (a recurrent
/// state, a pooled layer's blocks) cannot drop the prompt's last token, which the decoder must
/// process itself, so with such a layer no stored block ends with it: the blocks are those of all
/// but the last token.
pub fn storable<'t>(spec: &CacheSpec, tokens: &'t [u32]) -> &'t [u32] {
    let unrewindable = spec.layers.iter().any(|l| !l.rewindable && bridged(l));
    match tokens.split_last() {
        Some((_, before_last)) if unrewindable => before_last,
        _ => tokens,
    }
}

/// The chained keys of a prompt's whole blocks (of its [`storable`] tokens).
pub fn block_keys(spec: &CacheSpec, tokens: &[u32]) -> Vec<BlockKey> {
    block::keys(&spec.spec_fingerprint, storable(spec, tokens), spec.block_tokens as usize)
}

/// Why a prefiller cannot reconstruct this spec's blocks, one line per layer
/// (empty when it can). The one place that decides what is bridgeable: the
/// decoder describes each layer (its traits, its tensors' extents), and a layer
/// it calls unsupported, or one that is malformed, is refused here.
pub fn unsupported(spec: &CacheSpec) -> Vec<String> {
    let mut out = Vec::new();
    if spec.layers.len() as u32 != spec.num_layers {
        out.push(format!("the spec lists {} layers of {}", spec.layers.len(), spec.num_layers));
    }
    if spec.decoder_code.is_none() {
        out.push("the spec does not name the decoder's code (mlx-lm model type and versions)".into());
    }
    for layer in &spec.layers {
        // A kind this build has no name for is read like any other: by its traits and extents.
        let problem = match CacheKind::try_from(layer.kind) {
            Ok(CacheKind::Unsupported) => Some(layer.unsupported_reason.clone()),
            Ok(CacheKind::Unspecified) => Some(format!("{}: no cache kind", layer.cache_class)),
            _ => layer_problem(layer),
        };
        if let Some(problem) = problem {
            out.push(format!("layer {}: {problem}", layer.index));
        }
    }
    out
}

/// What is malformed in a bridgeable layer: no tensors, a tensor without an element size or an
/// extent, a per-token tensor without a token axis of size 1, a fixed or per-block one that
/// holds nothing, or a tail promised by a layer with a per-block tensor.
fn layer_problem(layer: &LayerSpec) -> Option<String> {
    if layer.tensors.is_empty() {
        return Some(format!("{} lists no tensors", layer.cache_class));
    }
    layer.tensors.iter().find_map(|t| {
        let axis = t.token_axis as usize;
        if t.dtype().size_bytes().is_none() {
            return Some(format!("tensor {}: no element size for {:?}", t.name, t.dtype()));
        }
        match t.extent() {
            Extent::Unspecified => Some(format!("tensor {}: no extent", t.name)),
            Extent::PerToken => (t.shape.get(axis) != Some(&1))
                .then(|| format!("tensor {}: shape {:?} has no token axis {axis} of size 1", t.name, t.shape)),
            Extent::Fixed | Extent::PerBlock if t.shape.is_empty() || t.shape.contains(&0) => {
                Some(format!("tensor {}: shape {:?} holds nothing", t.name, t.shape))
            }
            Extent::PerBlock if layer.takes_tail => {
                Some(format!("tensor {}: a whole block's only, but the layer takes a tail", t.name))
            }
            Extent::Fixed | Extent::PerBlock => None,
        }
    })
}

/// The cache classes whose tensors hold what a prefill engine's paged cache holds: post-RoPE
/// keys and values, one row per token (a quantized cache, those rows quantized), so the `kv` route
/// lays the engine's own K/V out as them instead of recomputing anything.
const KV_CLASSES: &[(&str, &[&str])] = &[
    ("KVCache", &["keys", "values"]),
    ("RotatingKVCache", &["keys", "values"]),
    ("QuantizedKVCache", &["keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases"]),
];

/// Why the `kv` route (the prefill engine's own K/V as the decoder's cache) cannot serve this
/// spec: one line per layer whose cache is not keys and values of one width per token (a latent
/// cache, a recurrent state, pools), or whose quantization has no packing of 32-bit words. Empty
/// when it can.
pub fn kv_unsupported(spec: &CacheSpec) -> Vec<String> {
    spec.layers
        .iter()
        .filter_map(|layer| {
            kv_layer_problem(layer).map(|p| format!("layer {} ({}): {p}", layer.index, layer.cache_class))
        })
        .collect()
}

fn kv_layer_problem(layer: &LayerSpec) -> Option<String> {
    let Some((_, names)) = KV_CLASSES.iter().find(|(class, _)| *class == layer.cache_class) else {
        return Some("not keys and values per token; it needs the reconstruct route".into());
    };
    let have: Vec<&str> = layer.tensors.iter().map(|t| t.name.as_str()).collect();
    if have != *names || layer.tensors.iter().any(|t| t.extent() != Extent::PerToken || t.shape.len() != 4) {
        return Some(format!("tensors {have:?} are not {names:?}, per token, of 4 axes"));
    }
    let (keys, values) = (&layer.tensors[0], &layer.tensors[names.len() / 2]);
    if keys.shape != values.shape || keys.dtype != values.dtype {
        return Some(format!("keys {:?} and values {:?} differ (a latent cache)", keys.shape, values.shape));
    }
    if layer.kv_bits != 0 && (!layer.kv_bits.is_power_of_two() || layer.kv_bits > 8 || layer.kv_group_size == 0) {
        return Some(format!(
            "{}-bit groups of {} have no packing in 32-bit words",
            layer.kv_bits, layer.kv_group_size
        ));
    }
    None
}

/// Bytes of the spec's tensors whose extent `per_token` says: per token, or per block (fixed and
/// per-block tensors).
fn bytes_of(spec: &CacheSpec, per_token: bool) -> u64 {
    spec.layers
        .iter()
        .flat_map(|l| &l.tensors)
        .filter(|t| (t.extent() == Extent::PerToken) == per_token)
        .map(|t| t.shape.iter().product::<u64>() * t.dtype().size_bytes().unwrap_or(0) as u64)
        .sum()
}

/// Bytes of cache one token costs in the per-token tensors.
pub fn bytes_per_token(spec: &CacheSpec) -> u64 {
    bytes_of(spec, true)
}

/// Bytes of one block of `rows` tokens as `payload` carries it: the per-token tensors' rows plus
/// every fixed and per-block tensor, or the layers' inputs.
pub fn block_bytes(spec: &CacheSpec, payload: Payload, rows: u32) -> u64 {
    match payload {
        Payload::Cache => u64::from(rows) * bytes_per_token(spec) + bytes_of(spec, false),
        Payload::LayerInputs => u64::from(rows) * layer_input_bytes_per_token(spec),
    }
}

/// Bytes of layer inputs one token costs ([`Payload::LayerInputs`]).
pub fn layer_input_bytes_per_token(spec: &CacheSpec) -> u64 {
    let layers = tensors_per_block(spec, Payload::LayerInputs) as u64;
    layers * u64::from(spec.hidden_size) * spec.input_dtype().size_bytes().unwrap_or(0) as u64
}

#[cfg(test)]
mod tests;
