"""What pd-bridge's files and the adapters' protocol spell the same on every side, written once.

Pure Python (no MLX, no protobuf), so anything may import it: the decode adapter, the prefill
plugin, their tests and the benches. Names that are also in proto/bridge.proto say so; the
Rust side's copies are the proto's generated types and `decoded`'s store.
"""

from __future__ import annotations

# Cache kinds: the names of `pdbridge.v1.CacheKind`, as a spec's proto3 JSON spells them.
ROWS = "CACHE_KIND_ROWS"  # a block holds its tokens' rows of every tensor
SNAPSHOT = "CACHE_KIND_SNAPSHOT"  # a block holds the layer's recurrent state after its last token
POOLED = "CACHE_KIND_POOLED"  # a block holds the window after its last token and the groups it pooled
UNSUPPORTED = "CACHE_KIND_UNSUPPORTED"  # the layer cannot be bridged; the spec says why

# Extents: the names of `pdbridge.v1.Extent`, how a tensor's shape follows the rows R a block holds.
PER_TOKEN = "EXTENT_PER_TOKEN"  # R along the token axis (the spec's shape is one token's)
FIXED = "EXTENT_FIXED"  # the same shape whatever R (a recurrent state)
PER_BLOCK = "EXTENT_PER_BLOCK"  # a whole block's shape; a partial block has none

# A layer's traits: `pdbridge.v1.LayerSpec`'s fields of the same names, each unset (False) when
# the spec says nothing. `rewindable`: a restored cache can drop rows, so a stored block may end
# with a prompt's last token; `takes_tail`: a partial block can be stored; `from_inputs`: a block
# is computed from that block's layer inputs alone (no state carried from the blocks before it).
TRAITS = ("rewindable", "takes_tail", "from_inputs")

# Element types: the safetensors dtype names files carry, and `pdbridge.v1.Dtype`'s names for them.
SAFETENSORS_DTYPES = ("F32", "F16", "BF16", "U32", "I32", "U8")
PROTO_DTYPES = {name: f"DTYPE_{name}" for name in SAFETENSORS_DTYPES}

# The token axis of every mlx-lm attention cache tensor: [batch, heads, tokens, width].
TOKEN_AXIS = 2

# Parent key of block 0 (`BlockKey::ROOT` in decoded's store); block files' metadata is
# `pdbridge_cache.blockfile`'s.
ROOT_KEY = "00" * 32

# The reconstruction bundle: the decoder's parameters its cache path depends on.
BUNDLE_FORMAT = "pdbridge-bundle-v2"  # metadata "format"

# Files whose bytes define how text becomes token ids, hashed in this order (the spec's
# tokenizer fingerprint), as prefilld hashes its model's.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def tensor_shape(tensor: dict, rows: int, block_tokens: int) -> tuple[int, ...] | None:
    """The shape of a spec's tensor (a `pdbridge.v1.TensorSpec` as a proto3-JSON dict) in a block of
    `rows` tokens, as its extent says; None where it has none (a whole block's tensor in a partial
    block). `common::spec::rows_tensor` is the Rust side of the same rule."""
    shape = [int(d) for d in tensor["shape"]]
    extent = tensor.get("extent")
    if extent == PER_TOKEN:
        shape[int(tensor.get("token_axis", 0))] = rows
    elif extent == PER_BLOCK and rows != block_tokens or extent not in (PER_TOKEN, FIXED, PER_BLOCK):
        return None
    return tuple(shape)


def proto_dtype(safetensors_name: str) -> str:
    """`pdbridge.v1.Dtype`'s name for a safetensors dtype name ("F32" -> "DTYPE_F32")."""
    try:
        return PROTO_DTYPES[safetensors_name]
    except KeyError:
        raise ValueError(f"dtype {safetensors_name} has no pd-bridge wire name") from None


def safetensors_dtype(proto_name: str) -> str:
    """The safetensors dtype name for a `pdbridge.v1.Dtype` name ("DTYPE_F32" -> "F32")."""
    name = proto_name.removeprefix("DTYPE_")
    if name not in PROTO_DTYPES or proto_name == name:
        raise ValueError(f"{proto_name} is not a pdbridge.v1.Dtype name")
    return name
