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
mod tests {
    use super::*;
    use crate::proto::Dtype;

    #[test]
    fn tokens_must_fit_the_context_and_the_vocabulary() {
        let spec = CacheSpec { max_context: 4, vocab_size: 10, ..Default::default() };
        assert!(check_tokens(&spec, &[0, 9, 3, 3]).is_ok());
        assert!(check_tokens(&spec, &[0; 5]).unwrap_err().contains("context of 4"));
        assert!(check_tokens(&spec, &[1, 10]).unwrap_err().contains("id 10 at 1"));
    }

    #[test]
    fn fingerprints_are_64_lower_hex_digits() {
        assert!(is_fingerprint(&"ab12".repeat(16)));
        for bad in ["", "../../etc/passwd", &"AB12".repeat(16), &"ab12".repeat(15), &format!("{}/", "a".repeat(63))] {
            assert!(!is_fingerprint(bad), "{bad}");
        }
    }
    use crate::proto::{DecoderCode, LayerSpec, Rope, TensorSpec};

    pub fn small_spec() -> CacheSpec {
        let tensor = |name: &str| TensorSpec {
            name: name.into(),
            dtype: Dtype::F32 as i32,
            shape: vec![1, 3, 1, 64],
            token_axis: 2,
            extent: Extent::PerToken as i32,
        };
        let mut spec = CacheSpec {
            model_id: "m".into(),
            num_layers: 2,
            block_tokens: 16,
            hidden_size: 576,
            input_dtype: Dtype::Bf16 as i32,
            layers: (0..2)
                .map(|index| LayerSpec {
                    index,
                    cache_class: "KVCache".into(),
                    kind: CacheKind::Rows as i32,
                    tensors: vec![tensor("keys"), tensor("values")],
                    rope: Some(Rope { kind: "default".into(), base: 1e5, dims: 64, ..Default::default() }),
                    rewindable: true,
                    takes_tail: true,
                    from_inputs: true,
                    ..Default::default()
                })
                .collect(),
            decoder_code: Some(DecoderCode {
                model_type: "llama".into(),
                mlx: "0.32.4".into(),
                mlx_lm: "0.32.2".into(),
            }),
            ..Default::default()
        };
        spec.spec_fingerprint = fingerprint(&spec);
        spec
    }

    #[test]
    fn fingerprint_ignores_itself_and_sees_everything_else() {
        let spec = small_spec();
        assert_eq!(fingerprint(&spec), spec.spec_fingerprint);
        let mut other = spec.clone();
        other.layers[1].rope.as_mut().unwrap().base = 1e4;
        assert_ne!(fingerprint(&other), spec.spec_fingerprint);
        let mut scaled = spec.clone();
        for (k, v) in [("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0)] {
            scaled.layers[0].rope.as_mut().unwrap().scaling.insert(k.into(), v);
        }
        assert_eq!(fingerprint(&scaled), fingerprint(&scaled.clone()), "deterministic with maps");
    }

    /// small_spec with layer 0 a recurrent layer: a conv state and a state matrix per block.
    pub fn hybrid_spec() -> CacheSpec {
        let mut spec = small_spec();
        let state = |name: &str, shape: Vec<u64>| TensorSpec {
            name: name.into(),
            dtype: Dtype::F32 as i32,
            shape,
            token_axis: 0,
            extent: Extent::Fixed as i32,
        };
        spec.layers[0] = LayerSpec {
            index: 0,
            cache_class: "ArraysCache".into(),
            kind: CacheKind::Snapshot as i32,
            tensors: vec![state("state0", vec![1, 3, 32]), state("state1", vec![1, 2, 8, 8])],
            takes_tail: true,
            ..Default::default()
        };
        spec.spec_fingerprint = fingerprint(&spec);
        spec
    }

    #[test]
    fn a_snapshot_layer_holds_one_state_per_block_and_no_block_ends_with_the_last_token() {
        let spec = hybrid_spec();
        assert_eq!(unsupported(&spec), Vec::<String>::new());
        // The state's shape whatever the rows; the attention layer's rows as ever.
        assert_eq!(rows_tensor(&spec, 0, "state1", 5).unwrap().shape, vec![1, 2, 8, 8]);
        assert_eq!(rows_tensor(&spec, 1, "keys", 5).unwrap().shape, vec![1, 3, 5, 64]);
        assert_eq!(bytes_per_token(&spec), 2 * 3 * 64 * 4);
        assert_eq!(block_bytes(&spec, Payload::Cache, 16), 16 * 2 * 3 * 64 * 4 + (3 * 32 + 2 * 8 * 8) * 4);
        // 32 tokens: two whole blocks of rows, but with a state only one (the 32nd token is the decoder's).
        let tokens: Vec<u32> = (0..32).collect();
        assert_eq!(block_keys(&small_spec(), &tokens).len(), 2);
        assert_eq!(block_keys(&spec, &tokens).len(), 1);
        assert_eq!(block_keys(&spec, &tokens[..17]).len(), 1);
        assert!(block_keys(&spec, &[]).is_empty());
        let mut empty = spec.clone();
        empty.layers[0].tensors[1].shape = vec![1, 0, 8];
        assert!(unsupported(&empty)[0].contains("holds nothing"), "{:?}", unsupported(&empty));
    }

    /// small_spec with layer 0 a DeepSeek-V4.1 layer: a packed 32-row window and 4 pooled rows per block.
    fn pooled_spec() -> CacheSpec {
        let mut spec = small_spec();
        let packed = |name: &str, dtype: Dtype, shape: Vec<u64>| TensorSpec {
            name: name.into(),
            dtype: dtype as i32,
            shape,
            token_axis: 1,
            extent: Extent::PerBlock as i32,
        };
        spec.layers[0] = LayerSpec {
            index: 0,
            cache_class: "LayerCache".into(),
            kind: CacheKind::Pooled as i32,
            window: 32,
            tensors: vec![
                packed("window", Dtype::U32, vec![1, 32, 16]),
                packed("window_scales", Dtype::U8, vec![1, 32, 2]),
                packed("compress_kv", Dtype::U32, vec![1, 4, 8]),
            ],
            from_inputs: true,
            ..Default::default()
        };
        spec.spec_fingerprint = fingerprint(&spec);
        spec
    }

    #[test]
    fn a_pooled_layer_holds_whole_blocks_only_and_no_block_ends_with_the_last_token() {
        let spec = pooled_spec();
        assert_eq!(unsupported(&spec), Vec::<String>::new());
        assert_eq!(block_tensor(&spec, 0, "window").unwrap().shape, vec![1, 32, 16]);
        assert_eq!(block_tensor(&spec, 0, "compress_kv").unwrap().shape, vec![1, 4, 8]);
        // A tail has no window or pools of its own: neither the tensors nor the tail exist.
        assert!(rows_tensor(&spec, 0, "window", 5).is_none());
        assert_eq!(rows_tensor(&spec, 1, "keys", 5).unwrap().shape, vec![1, 3, 5, 64]);
        assert!(tail_unsupported(&spec).unwrap().starts_with("layer 0 (LayerCache)"));
        assert_eq!(tail_unsupported(&hybrid_spec()), None);
        assert_eq!(block_bytes(&spec, Payload::Cache, 16), 16 * 2 * 3 * 64 * 4 + (32 * 16 * 4 + 32 * 2 + 4 * 8 * 4));
        let tokens: Vec<u32> = (0..32).collect();
        assert_eq!(block_keys(&spec, &tokens).len(), 1);
        assert_eq!(block_keys(&spec, &tokens[..17]).len(), 1);
        // The decoder computes a pooled layer from one block's inputs, as it does rows.
        assert_eq!(payload_unsupported(&spec, Payload::LayerInputs), None);
        assert_eq!(tensors_per_block(&spec, Payload::LayerInputs), 2);
        assert!(payload_tensor(&spec, Payload::LayerInputs, 0, LAYER_INPUT, 16).is_some());
        let mut empty = spec.clone();
        empty.layers[0].tensors[2].shape = vec![1, 0, 8];
        assert!(unsupported(&empty)[0].contains("holds nothing"), "{:?}", unsupported(&empty));
        // A tail promised by a layer whose tensors exist for whole blocks only is malformed.
        let mut tail = spec.clone();
        tail.layers[0].takes_tail = true;
        assert!(unsupported(&tail)[0].contains("whole block's only"), "{:?}", unsupported(&tail));
    }

    #[test]
    fn a_layer_is_read_by_its_traits_and_extents_never_its_kind() {
        // The same layer under another kind's name (a kind Rust has never heard of) behaves alike.
        let mut renamed = pooled_spec();
        renamed.layers[0].kind = 99;
        renamed.layers[0].cache_class = "SomeNewCache".into();
        assert_eq!(unsupported(&renamed), Vec::<String>::new());
        assert_eq!(block_bytes(&renamed, Payload::Cache, 16), block_bytes(&pooled_spec(), Payload::Cache, 16));
        assert!(tail_unsupported(&renamed).is_some() && !chains_blocks(&renamed));
        assert_eq!(block_keys(&renamed, &(0..32).collect::<Vec<_>>()).len(), 1);
        // A tensor that does not say how it grows is refused; a spec that says nothing of its
        // traits is trusted with nothing: no tail, no layer inputs, no block ending with the last token.
        let mut silent = small_spec();
        silent.layers[1].tensors[0].extent = Extent::Unspecified as i32;
        assert_eq!(unsupported(&silent), vec!["layer 1: tensor keys: no extent".to_owned()]);
        let mut cautious = small_spec();
        let layer = &mut cautious.layers[1];
        (layer.rewindable, layer.takes_tail, layer.from_inputs) = (false, false, false);
        assert!(tail_unsupported(&cautious).is_some() && chains_blocks(&cautious));
        assert!(payload_unsupported(&cautious, Payload::LayerInputs).is_some());
        assert_eq!(block_keys(&cautious, &(0..32).collect::<Vec<_>>()).len(), 1);
        assert!(!chains_blocks(&small_spec()) && chains_blocks(&hybrid_spec()) && !chains_blocks(&pooled_spec()));
    }

    #[test]
    fn unsupported_layers_are_named_with_their_reason() {
        let mut spec = small_spec();
        assert_eq!(unsupported(&spec), Vec::<String>::new());
        spec.layers[1].kind = CacheKind::Unsupported as i32;
        spec.layers[1].cache_class = "ArraysCache".into();
        spec.layers[1].unsupported_reason = "ArraysCache: recurrent state".into();
        spec.layers[0].tensors[1].shape = vec![1, 3, 2, 64];
        spec.decoder_code = None;
        let found = unsupported(&spec);
        assert_eq!(found.len(), 3, "{found:?}");
        assert!(found[0].contains("decoder's code"), "{found:?}");
        assert!(found[1].starts_with("layer 0: tensor values"), "{found:?}");
        assert_eq!(found[2], "layer 1: ArraysCache: recurrent state");
    }

    #[test]
    fn block_tensor_shape_spans_the_block() {
        let spec = small_spec();
        let expected = block_tensor(&spec, 1, "values").unwrap();
        assert_eq!(expected.shape, vec![1, 3, 16, 64]);
        assert_eq!(expected.byte_len(), 3 * 16 * 64 * 4);
        assert!(block_tensor(&spec, 2, "keys").is_none());
        assert!(block_tensor(&spec, 0, "queries").is_none());
        assert_eq!(bytes_per_token(&spec), 2 * 2 * 3 * 64 * 4);
    }

    #[test]
    fn layer_inputs_are_one_hidden_row_per_token_and_layer_in_the_activation_dtype() {
        let spec = small_spec();
        assert_eq!(payload_unsupported(&spec, Payload::LayerInputs), None);
        let input = payload_tensor(&spec, Payload::LayerInputs, 1, LAYER_INPUT, 5).unwrap();
        assert_eq!(input, Expected { dtype: Dtype::Bf16, shape: vec![5, 576] });
        // A cache tensor is not a layer input, nor the other way round.
        assert!(payload_tensor(&spec, Payload::LayerInputs, 1, "keys", 5).is_none());
        assert!(payload_tensor(&spec, Payload::Cache, 1, LAYER_INPUT, 5).is_none());
        assert!(payload_tensor(&spec, Payload::LayerInputs, 2, LAYER_INPUT, 5).is_none());
        assert_eq!((tensors_per_block(&spec, Payload::Cache), tensors_per_block(&spec, Payload::LayerInputs)), (4, 2));
        assert_eq!(block_bytes(&spec, Payload::LayerInputs, 16), 16 * 2 * 576 * 2);
        assert_eq!(block_bytes(&spec, Payload::Cache, 16), 16 * bytes_per_token(&spec));
        // A recurrent state chains blocks: the decoder cannot compute it from one block's inputs.
        let refused = payload_unsupported(&hybrid_spec(), Payload::LayerInputs).unwrap();
        assert!(refused.starts_with("layer 0 keeps a recurrent state (ArraysCache)"), "{refused}");
        assert_eq!(payload_unsupported(&hybrid_spec(), Payload::Cache), None);
        let mut undeclared = spec.clone();
        undeclared.input_dtype = Dtype::Unspecified as i32;
        assert!(payload_unsupported(&undeclared, Payload::LayerInputs).unwrap().contains("activation dtype"));
    }
}
