"""The decoder's cache, computed inside the prefill engine's process with the decoder's own code.

The reconstruction bundle (written by the decoder adapter, fetched by prefilld with GetBundle)
carries the decoder's mlx-lm config and the parameters its cache path depends on.
`pdbridge_cache.layers.CachePath` instantiates the decoder's model class from it with mlx-lm's own
loader and runs, per layer, the decoder's input norm and attention module into an empty instance of
the decoder's cache class: whatever mlx-lm computes for that model (RoPE variants, q/k norms,
biases, latent caches, KV quantization, bf16) is what comes out, bit for bit (MLX's CPU kernels are
per-token sequential, so the chunk a token is computed in does not change its bits).

Only import this module where MLX may run: it imports ``mlx.core``.
"""

from __future__ import annotations

import hashlib

import mlx.core as mx
from pdbridge_cache.kinds import TOKEN_AXIS
from pdbridge_cache.layers import BundleError as CodecBundleError
from pdbridge_cache.layers import CachePath
from pdbridge_cache.format import proto_dtype
from pdbridge_cache.proto import bridge_pb2, engine_pb2
from pdbridge_cache.safetensors_io import dtype_name

from . import protocol
from .handoff import HostHandoff

# A layer's tensor in a block of layer inputs (the decoder names it so).
LAYER_INPUT = "input"


class BundleError(Exception):
    """The bundle cannot be used; `failure` is a `PluginFailure` (protocol's names)."""

    def __init__(self, failure: int, message: str):
        super().__init__(message)
        self.failure = failure


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load(path: str, expected_sha256: str | None, dense_weights: bool = False) -> CachePath:
    """The decoder's cache path from the bundle at `path`, checked against its expected digest.
    `dense_weights`: quantized weights dequantized once (mlx-lm's `dequantize_model`), for a GPU:
    there the cache is not the decoder's bits anyway (another backend's kernels), and dense GEMMs
    run 2-4x faster than MLX's quantized matmul on CUDA; on the decoder's own backend it gives up
    bit-exactness."""
    try:
        digest = file_sha256(path)
    except OSError as e:
        raise BundleError(protocol.BUNDLE_UNREADABLE, f"{path}: {e}") from None
    if expected_sha256 and digest != expected_sha256.lower():
        raise BundleError(protocol.BUNDLE_MISMATCH, f"bundle sha256 {digest} != expected {expected_sha256}")
    try:
        cache_path = CachePath.from_bundle(path)
    except CodecBundleError as e:
        failure = protocol.BUNDLE_UNREADABLE if e.unreadable else protocol.BUNDLE_MISMATCH
        raise BundleError(failure, str(e)) from None
    except Exception as e:  # a file MLX cannot parse
        raise BundleError(protocol.BUNDLE_UNREADABLE, f"{path}: {e}") from None
    if dense_weights:
        from mlx_lm.utils import dequantize_model

        dequantize_model(cache_path.model)
    return cache_path


def captured_states(hidden, capture_layer_ids: list[int], layers: list[int], handoff=None,
                    event=None) -> mx.array:
    """The captured states of `layers` (out of the engine's `capture_layer_ids`) as one MLX array
    [T, len(layers), hidden] in the engine's dtype; the cache path casts it to the decoder's.
    `hidden`: numpy, or a torch tensor on the host or (with the `event` its producer recorded) a
    GPU, handed over by `handoff` (`handoff.HostHandoff` by default). bf16 travels as its bits:
    no float32 copy, and the same values (every bf16 is exact in float32, so the cast the cache
    path makes sees what it saw)."""
    states = (handoff or HostHandoff()).to_mlx(hidden, event)
    order = [capture_layer_ids.index(layer) for layer in layers]
    return states if order == list(range(states.shape[1])) else states[:, mx.array(order), :]


def block(path: CachePath, hidden: mx.array, offset: int, streams: list | None = None,
          states: dict | None = None, only_states: bool = False) -> list:
    """One block's tensors (`wire` turns them into the message): `hidden` = [T, len(path.layers),
    hidden] (`captured_states`) at positions offset..offset+T; `states` the request's recurrent
    states, advanced (see `CachePath.block`). (layer, name, array) rows, layers ascending and each
    layer's tensors in its codec's order."""
    return path.block(hidden, offset, streams, states, only_states)


def blocks(path: CachePath, hidden: mx.array, offset: int, block_tokens: int, streams: list | None = None) -> list:
    """Consecutive whole blocks (`hidden`: [k * block_tokens, layers, hidden]) computed in one call
    and cut into each block's rows, in order. Tokens per call decide a GPU's rate (calls of
    256 tokens run at a quarter of the rate of 8,192-token ones on MLX's CUDA backend); a token's
    rows do not depend on the tokens computed beside it (on the CPU, bit for bit), so the cut
    blocks are what one call per block gives. Not for a path with a state or pools (`per_block`:
    its tensors are not rows to cut), which is computed block by block. mlx-lm's caches keep every
    row of one call (a fresh sliding window too); should one keep fewer, the blocks are computed
    one by one instead."""
    count = hidden.shape[0] // block_tokens
    if count > 1 and not path.per_block:
        rows = path.block(hidden, offset, streams)
        if all(a.shape[TOKEN_AXIS] == hidden.shape[0] for _, _, a in rows):
            cut = [slice(None)] * (TOKEN_AXIS + 1)
            out = []
            for k in range(count):
                cut[TOKEN_AXIS] = slice(k * block_tokens, (k + 1) * block_tokens)
                out.append([(layer, name, a[tuple(cut)]) for layer, name, a in rows])
            return out
    return [block(path, hidden[k * block_tokens:(k + 1) * block_tokens], offset + k * block_tokens, streams)
            for k in range(count)]


def layer_inputs(path: CachePath, hidden: mx.array) -> list:
    """One block's layer inputs, for a decoder that computes its cache itself (`hidden`:
    [T, len(path.layers), hidden], `captured_states`): each layer's cast to the decoder's
    activation dtype, the cast its cache path starts with, so from them the decoder computes what
    `block` would on its backend. Rows as `block` gives them."""
    return [(layer, LAYER_INPUT, mx.array(hidden[:, j, :]).astype(path.dtype)) for j, layer in enumerate(path.layers)]


def wire(rows: list, handoff=None) -> tuple[list, list]:
    """A block's rows as its frame: `PluginTensor`s and the payload, every tensor's bytes back to
    back in one buffer laid out in MLX (so a GPU's block leaves in one copy, not one per tensor or
    a strided read per cut block)."""
    headers, flat, at = [], [], 0
    for layer, name, array in rows:
        nbytes = array.nbytes
        dtype = bridge_pb2.Dtype.Value(proto_dtype(dtype_name(array.dtype)))
        headers.append(engine_pb2.PluginTensor(layer=layer, name=name, dtype=dtype, shape=array.shape,
                                               offset=at, nbytes=nbytes))
        flat.append(mx.flatten(array).view(mx.uint8))
        at += nbytes
    payload = mx.concatenate(flat) if len(flat) > 1 else flat[0]
    mx.eval(payload)
    return headers, [(handoff or HostHandoff()).to_host(payload)]
