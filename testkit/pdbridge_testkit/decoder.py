"""The decoder's side: the adapter's reconstruction bundle and the decoder's own cache (mlx-lm), as
arrays or as the store's block files."""

from __future__ import annotations

import os
from pathlib import Path

from . import MLX_DIR


def decoder_bundle(bundle_dir: Path, model_dir: Path = MLX_DIR) -> tuple[str, str]:
    """The reconstruction bundle exactly as decoded's decoder adapter exports it (float32 decoder,
    like prefilld would fetch with GetBundle) for the test model or `model_dir`: (path, sha256)."""
    import mlx.core as mx
    from pdbridge_mlx.engine import Engine

    engine = Engine(str(model_dir), block_tokens=256, dtype=mx.float32, bundle_dir=str(bundle_dir))
    return str(engine.bundle_path), engine.bundle_sha256


def decoder_spec(bundle_dir: Path, block_tokens: int, kv_bits: int | None = None, model_dir: Path = MLX_DIR) -> dict:
    """The decoder adapter's spec of the test model (or `model_dir`) in float32, its KV cache
    quantized to `kv_bits` if given, as proto3 JSON: what prefilld hands the kv route."""
    import mlx.core as mx
    from google.protobuf import json_format
    from pdbridge_mlx.engine import Engine

    engine = Engine(str(model_dir), block_tokens=block_tokens, dtype=mx.float32, bundle_dir=str(bundle_dir),
                    kv_bits=kv_bits)
    return json_format.MessageToDict(engine.info().spec, preserving_proto_field_name=True)


class CaptureInput:
    """Stands in for one mlx-lm TransformerBlock and records its input (the residual stream)."""

    def __init__(self, block, sink: list):
        self.block, self.sink, self.use_sliding = block, sink, block.use_sliding

    def __call__(self, x, *args, **kwargs):
        self.sink.append(x)
        return self.block(x, *args, **kwargs)


def decoder_native_cache(tokens: list[int], model_dir: Path = MLX_DIR):
    """The decoder's own cache for `tokens`: mlx-lm prefill of the test model's 4-bit folder (or
    `model_dir`) in float32, one call. Returns ([(keys, values)] per layer as numpy float32 [1, n_kv, T, head_dim], the
    decoder's own layer inputs as float32 [T, n_layers, hidden])."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = load(str(model_dir))
    model.set_dtype(mx.float32)  # already fp32 scales/biases/norms; makes the activation dtype explicit
    inputs: list = []
    model.model.layers = [CaptureInput(b, inputs) for b in model.model.layers]
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    T = len(tokens)
    out = [(c.keys[..., :T, :], c.values[..., :T, :]) for c in cache]
    mx.eval(out, inputs)
    hidden = np.stack([np.array(h[0]) for h in inputs], axis=1)
    return [(np.array(k), np.array(v)) for k, v in out], hidden


def export_blocks(engine, tokens: list[int], out_dir: str | Path, *, block_tokens: int | None = None,
                  spec_fingerprint: str = "", keys: list[str] | None = None) -> list[str]:
    """The decoder's native cache of `tokens`, computed by the adapter's `engine`
    (`pdbridge_mlx.engine.Engine`) as its native generation would, written as one block file per
    whole block (`block-NNNNNN.safetensors` under `out_dir`, the store's format): the reference
    bridged blocks are held to. `spec_fingerprint` and `keys` (hex, one per block at least) go into
    each block's metadata, the predecessor's key as `parent`. Returns the files, in order."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache
    from pdbridge_cache import blockfile, kinds
    from pdbridge_cache.format import PER_TOKEN, ROOT_KEY
    from pdbridge_cache.proto import engine_pb2
    from pdbridge_cache.safetensors_io import serialize, write_atomic
    from pdbridge_mlx.engine import PREFILL_STEP_SIZE

    block_tokens = block_tokens or engine.block_tokens
    n = len(tokens) // block_tokens
    if keys is not None and len(keys) < n:
        raise ValueError(f"keys must be a list of at least {n} hex strings")
    os.makedirs(out_dir, exist_ok=True)
    cache = make_prompt_cache(engine.model)
    # A recurrent layer's state or a pooled layer's window after each block: the prompt is prefilled
    # block by block (the cache comes out the same whatever the chunking), its rows as a native
    # generation would.
    chunks = [tokens[i * block_tokens:(i + 1) * block_tokens] for i in range(n)] if engine.per_block else [tokens]
    states: list[dict] = []
    for chunk in chunks if n else []:
        # max_tokens=0 stops right after the chunk's last token is processed.
        for _ in generate_step(mx.array(chunk), engine.model, prompt_cache=cache, max_tokens=0,
                               prefill_step_size=PREFILL_STEP_SIZE, **engine.kv_args):
            pass
        states.append({layer: kinds.codec_for(c).block_tensors(c, block_tokens) for layer, c in enumerate(cache)
                       if kinds.codec_for(c).extent != PER_TOKEN})
    prefilled = sum(len(c) for c in chunks) if n else 0
    rows = {layer: kinds.codec_for(c).tensors(c) for layer, c in enumerate(cache)
            if n and kinds.codec_for(c).extent == PER_TOKEN}
    for layer, r in rows.items():
        if any(a.shape[kinds.TOKEN_AXIS] != prefilled for a in r.values()):
            raise ValueError(f"layer {layer}'s {type(cache[layer]).__name__} no longer holds every prompt "
                             "token; its blocks cannot be exported")
    files = []
    for i in range(n):
        lo, hi = i * block_tokens, (i + 1) * block_tokens
        state = states[i if engine.per_block else 0]
        tensors = sorted(
            [(f"{layer}.{name}", a[..., lo:hi, :]) for layer, r in rows.items() for name, a in r.items()]
            + [(f"{layer}.{name}", a) for layer, t in state.items() for name, a in t.items()],
            key=lambda named: int(named[0].split(".")[0]),
        )
        metadata = blockfile.metadata(engine_pb2.BlockMetadata(
            index=i, token_ids=tokens[lo:hi], spec_fingerprint=spec_fingerprint,
            key=keys[i] if keys else "", parent=(keys[i - 1] if i else ROOT_KEY) if keys else "",
            data_sha256=blockfile.data_sha256(dict(tensors)),
        ))
        path = os.path.join(os.path.abspath(out_dir), f"block-{i:06}.safetensors")
        write_atomic(path, serialize(tensors, metadata))
        files.append(path)
    return files
