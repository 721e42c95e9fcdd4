"""Cache kinds: what a store block holds for one layer, per mlx-lm cache class.

Each codec knows one of the decoder's cache classes and nothing else: which tensors a block holds
(`rows`: every tensor of the cache, token axis 2, in temporal order), how to make an empty cache
of the same class and parameters (`fresh`, what reconstruction feeds), and how to rebuild the
decoder's cache from the rows of tokens [0, n) (`restore`). A new cache class is one more codec
here; the decoder adapter, the vLLM plugin and the tests all go through `codec_for`.

A layer whose class has no codec is described as unsupported, with the reason; prefilld then
refuses to bridge the model at the handshake, naming the layer (verdict native, never a wrong
cache).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

from .safetensors_io import dtype_name

ROWS = "rows"  # a block holds its tokens' rows of every tensor
UNSUPPORTED = "unsupported"  # the layer cannot be bridged; the spec says why
TOKEN_AXIS = 2  # [batch, heads, tokens, width] in every mlx-lm attention cache


class UnsupportedCache(Exception):
    """The layer's cache has no codec; the message is the reason the spec publishes."""


class _Plain:
    """KVCache: keys and values, one row per token."""

    def params(self, cache: KVCache) -> dict:
        return {}

    def fresh(self, cache: KVCache) -> KVCache:
        return KVCache()

    def rows(self, cache: KVCache) -> dict[str, mx.array]:
        n = cache.offset
        return {"keys": cache.keys[..., :n, :], "values": cache.values[..., :n, :]}

    def restore(self, template: KVCache, rows: dict[str, mx.array], n: int) -> KVCache:
        cache = KVCache()
        # An exact-size buffer is valid: the next update grows it by whole steps.
        cache.state = (rows["keys"], rows["values"], n)
        return cache


class _Quantized:
    """QuantizedKVCache: per token, packed uint32 codes plus per-group scales and biases (MLX affine
    quantization along the head width), for keys and for values."""

    names = ("keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases")

    def params(self, cache: QuantizedKVCache) -> dict:
        return {"kv_bits": cache.bits, "kv_group_size": cache.group_size}

    def fresh(self, cache: QuantizedKVCache) -> QuantizedKVCache:
        return QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)

    def rows(self, cache: QuantizedKVCache) -> dict[str, mx.array]:
        n = cache.offset
        parts = [a[..., :n, :] for a in (*cache.keys, *cache.values)]
        return dict(zip(self.names, parts))

    def restore(self, template: QuantizedKVCache, rows: dict[str, mx.array], n: int) -> QuantizedKVCache:
        cache = self.fresh(template)
        keys, values = tuple(rows[k] for k in self.names[:3]), tuple(rows[k] for k in self.names[3:])
        cache.state = (keys, values, n, template.group_size, template.bits)
        return cache


class _Rotating:
    """RotatingKVCache (sliding window): blocks hold every token's rows, so the window can be rebuilt
    at any block boundary; the decoder keeps the first `keep` rows and the last `max_size - keep`."""

    def params(self, cache: RotatingKVCache) -> dict:
        return {"window": cache.max_size, "keep": cache.keep}

    def fresh(self, cache: RotatingKVCache) -> RotatingKVCache:
        return RotatingKVCache(max_size=cache.max_size, keep=cache.keep)

    def rows(self, cache: RotatingKVCache) -> dict[str, mx.array]:
        keys, values, offset, keep, _, idx = cache.state

        def temporal(v: mx.array) -> mx.array:  # as RotatingKVCache orders its buffer
            if idx == v.shape[TOKEN_AXIS]:
                return v
            if idx < offset:
                return mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
            return v[..., :idx, :]

        return {"keys": temporal(keys), "values": temporal(values)}

    def restore(self, template: RotatingKVCache, rows: dict[str, mx.array], n: int) -> RotatingKVCache:
        keep, size = template.keep, template.max_size

        def window(v: mx.array) -> mx.array:
            if n <= size:
                return v
            return mx.concatenate([v[..., :keep, :], v[..., n - (size - keep):, :]], axis=2)

        cache = self.fresh(template)
        keys, values = window(rows["keys"]), window(rows["values"])
        cache.state = (keys, values, n, keep, size, keys.shape[TOKEN_AXIS])
        return cache


# Exact classes only: a subclass may store something else.
_CODECS: dict[type, Any] = {KVCache: _Plain(), QuantizedKVCache: _Quantized(), RotatingKVCache: _Rotating()}

_WHY_NOT = {
    "ArraysCache": "recurrent state (a scan over every earlier token, not per-token rows)",
    "CacheList": "a list of sub-caches per layer",
    "ChunkedKVCache": "chunked attention cache",
}


def codec_for(cache: Any):
    """The codec for `cache`'s class; UnsupportedCache names why there is none."""
    codec = _CODECS.get(type(cache))
    if codec is None:
        name = type(cache).__name__
        raise UnsupportedCache(f"{name}: {_WHY_NOT.get(name, 'no pd-bridge codec for this cache class')}")
    return codec


def describe(index: int, cache: Any) -> dict:
    """A LayerSpec (as a dict) for a cache that holds at least one token: its class, its parameters
    and, per tensor, the dtype and the shape of one token's row."""
    spec = {"index": index, "cache_class": type(cache).__name__, "window": 0, "keep": 0, "kv_bits": 0,
            "kv_group_size": 0, "tensors": []}
    try:
        codec = codec_for(cache)
    except UnsupportedCache as e:
        return {**spec, "kind": UNSUPPORTED, "unsupported_reason": str(e)}
    tensors = []
    for name, rows in codec.rows(cache).items():
        shape = list(rows.shape)
        shape[TOKEN_AXIS] = 1
        tensors.append({"name": name, "dtype": dtype_name(rows.dtype), "shape": shape, "token_axis": TOKEN_AXIS})
    return {**spec, **codec.params(cache), "kind": ROWS, "unsupported_reason": "", "tensors": tensors}


def decoder_caches(model: Any, kv_bits: int | None, kv_group_size: int) -> list:
    """The caches the decoder runs with: the model's own (`make_prompt_cache`), quantized as
    mlx-lm's `generate_step(kv_bits=...)` quantizes them, from the first token."""
    caches = make_prompt_cache(model)
    if kv_bits:
        for i, c in enumerate(caches):
            if type(c) is KVCache:
                caches[i] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)
            elif hasattr(c, "to_quantized"):  # generate_step would raise mid-generation
                raise ValueError(f"layer {i}: mlx-lm cannot quantize a {type(c).__name__}")
    return caches


def restore(templates: list, rows: list[dict[str, mx.array]], n: int) -> list:
    """The decoder's caches after tokens [0, n), from each layer's rows of those tokens."""
    return [codec_for(t).restore(t, r, n) for t, r in zip(templates, rows)]
