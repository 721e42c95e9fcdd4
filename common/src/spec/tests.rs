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
            device: "cpu".into(),
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

#[test]
fn the_kv_route_serves_keys_and_values_per_token_only() {
    assert_eq!(kv_unsupported(&small_spec()), Vec::<String>::new());
    let mut quantized = small_spec();
    let tensor = |name: &str, dtype: Dtype, width: u64| TensorSpec {
        name: name.into(),
        dtype: dtype as i32,
        shape: vec![1, 3, 1, width],
        token_axis: 2,
        extent: Extent::PerToken as i32,
    };
    for layer in &mut quantized.layers {
        (layer.cache_class, layer.kv_bits, layer.kv_group_size) = ("QuantizedKVCache".into(), 4, 64);
        layer.tensors = ["keys", "values"]
            .iter()
            .flat_map(|kv| {
                [(*kv).to_owned(), format!("{kv}_scales"), format!("{kv}_biases")]
                    .into_iter()
                    .enumerate()
                    .map(|(i, name)| if i == 0 { tensor(&name, Dtype::U32, 8) } else { tensor(&name, Dtype::F32, 1) })
            })
            .collect();
    }
    assert_eq!(kv_unsupported(&quantized), Vec::<String>::new());
    quantized.layers[1].kv_bits = 3;
    assert!(kv_unsupported(&quantized)[0].contains("3-bit"), "{:?}", kv_unsupported(&quantized));

    let hybrid = kv_unsupported(&hybrid_spec());
    assert_eq!(hybrid.len(), 1, "{hybrid:?}");
    assert!(hybrid[0].starts_with("layer 0 (ArraysCache)") && hybrid[0].contains("reconstruct route"), "{hybrid:?}");
    let mut latent = small_spec();
    latent.layers[0].tensors[1].shape = vec![1, 1, 1, 64];
    assert!(kv_unsupported(&latent)[0].contains("latent"), "{:?}", kv_unsupported(&latent));
}
