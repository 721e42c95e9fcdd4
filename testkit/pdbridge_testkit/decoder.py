"""The decoder's side: the adapter's reconstruction bundle and the decoder's own cache (mlx-lm)."""

from __future__ import annotations

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
