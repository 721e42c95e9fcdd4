"""Cache kinds: what a store block holds for one layer, per mlx-lm cache class.

Each codec is one of the decoder's cache classes, declared once (`Codec`): its kind (the proto's
`CacheKind`, a name), how its tensors grow (`extent`: one slice per token along `token_axis`, the
same shape whatever the rows, or a whole block's) and its traits (`rewindable`, `takes_tail`,
`from_inputs`; see `format.TRAITS`). From that declaration alone `describe` writes the layer's
`LayerSpec`, which decoded, prefilld, the cache path and the adapter read instead of the kind. Each
codec then does what only it knows: the tensors a cache holds (`tensors`; those of the block
ending where the cache ends, `block_tensors`), how an empty cache of the same class and parameters
is made (`fresh`), how the decoder's module fills one from a block's normed layer input
(`compute`), how a restore joins the blocks' tensors (`join`, generic by extent) and how the
decoder's cache is rebuilt after tokens [0, n) (`restore`). A new cache class is one more codec
here (and, if no kind names it yet, a `CacheKind` value); everything else goes through `codec_for`.

A layer whose class has no codec is described as unsupported, with the reason; prefilld then
refuses to bridge the model at the handshake, naming the layer (verdict native, never a wrong
cache).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import deepseek_v41
from mlx_lm.models.cache import (
    ArraysCache, ChunkedKVCache, KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache,
)

# The kinds (pdbridge.v1.CacheKind's names), extents and the token axis, for this module's users.
from .format import (
    FIXED, PER_BLOCK, PER_TOKEN, POOLED, ROWS, SNAPSHOT, TOKEN_AXIS, TRAITS, UNSUPPORTED, proto_dtype,
)
from .safetensors_io import dtype_name


class UnsupportedCache(Exception):
    """The layer's cache has no codec; the message is the reason the spec publishes."""


def _along(axis: int, lo: int | None, hi: int | None) -> tuple:
    """An index taking [lo, hi) along `axis`."""
    return (slice(None),) * axis + (slice(lo, hi),)


class Codec:
    """One mlx-lm cache class. The class attributes are its declaration, which the spec publishes;
    the methods are what only it knows. Defaults are the cautious ones (a state: fixed tensors, no
    rewind, no tail, not from layer inputs)."""

    kind: str = UNSUPPORTED
    extent: str = FIXED  # how every tensor of the cache grows with the rows a block holds
    token_axis: int = 0  # the axis tokens (PER_TOKEN) or blocks (PER_BLOCK) concatenate on
    rewindable = False
    takes_tail = False
    from_inputs = False
    module = "self_attn"  # the decoder block's module that writes the cache

    def traits(self) -> dict[str, bool]:
        return {name: bool(getattr(self, name)) for name in TRAITS}

    def params(self, cache: Any) -> dict:
        """The cache's parameters, as LayerSpec fields (window, keep, kv_bits, kv_group_size)."""
        return {}

    def problem(self, cache: Any) -> str | None:
        """Why the cache, after exactly one block, cannot be stored block by block; None if it can."""
        return None

    def fresh(self, cache: Any) -> Any:
        raise NotImplementedError

    def tensors(self, cache: Any) -> dict[str, mx.array]:
        """Everything the cache holds, by tensor name (per token: every token's rows, in order)."""
        raise NotImplementedError

    def block_tensors(self, cache: Any, block_tokens: int) -> dict[str, mx.array]:
        """The tensors of a block ending where the cache ends: the last `block_tokens` rows, or the
        fixed tensors as they are; a per-block codec says which of its rows are the block's."""
        tensors = self.tensors(cache)
        if self.extent == PER_TOKEN:
            return {k: a[_along(self.token_axis, -block_tokens, None)] for k, a in tensors.items()}
        return tensors

    def compute(self, module: Any, x: mx.array, offset: int, cache: Any) -> dict[str, mx.array]:
        """Runs the decoder's `module` on `x` (a block's normed layer input at positions offset..)
        into `cache` (empty, or a state carried from the blocks before) and returns the block's
        tensors (lazy)."""
        raise NotImplementedError

    def join(self, parts: list[mx.array], n: int) -> mx.array:
        """One tensor of consecutive blocks from token 0 joined for a cache of n tokens: rows
        concatenate (past n dropped), whole blocks concatenate, a fixed tensor is the last block's."""
        if self.extent == PER_TOKEN:
            return mx.concatenate(parts, axis=self.token_axis)[_along(self.token_axis, None, n)]
        if self.extent == PER_BLOCK:
            return mx.concatenate(parts, axis=self.token_axis)
        return parts[-1]

    def restore(self, template: Any, tensors: dict[str, mx.array], n: int, dtype: mx.Dtype) -> Any:
        """The decoder's cache after tokens [0, n) from its joined tensors, in activation `dtype`."""
        raise NotImplementedError

    def describe(self, index: int, cache: Any) -> dict:
        """The layer's `LayerSpec` (proto3 JSON as a dict) from a cache that holds exactly one block:
        class, parameters, traits and, per tensor, the dtype and the shape as its extent says (one
        token's, the tensor's, or one block's)."""
        tensors = []
        for name, array in self.tensors(cache).items():
            shape = list(array.shape)
            if self.extent == PER_TOKEN:
                shape[self.token_axis] = 1
            tensors.append({"name": name, "dtype": proto_dtype(dtype_name(array.dtype)), "shape": shape,
                            "token_axis": 0 if self.extent == FIXED else self.token_axis, "extent": self.extent})
        return {**_layer(index, cache), **self.params(cache), "kind": self.kind, "unsupported_reason": "",
                "tensors": tensors, **self.traits()}


class _Recorded(Exception):
    """Raised by the recorder once the attention module has handed over its keys and values."""


class _Recorder:
    """Stands in for the cache of an attention module: gives the keys and values to `inner` (an
    empty cache of the decoder's class, so a QuantizedKVCache quantizes exactly as the decoder's
    does) and then aborts the attention, so queries, SDPA and the output projection never run."""

    def __init__(self, inner: Any, offset: int):
        self.inner = inner
        self.offset = offset  # the position of the block's first token, for RoPE

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self.inner.update_and_fetch(keys, values)
        raise _Recorded


class _Rows(Codec):
    """What every per-token cache shares: one row per token on axis 2 of every tensor, computed by
    the attention module from the block's own tokens; a restore concatenates the blocks' rows."""

    kind = ROWS
    extent = PER_TOKEN
    token_axis = TOKEN_AXIS
    rewindable = takes_tail = from_inputs = True

    def compute(self, module: Any, x: mx.array, offset: int, cache: Any) -> dict[str, mx.array]:
        try:
            module(x, mask=None, cache=_Recorder(cache, offset))
        except _Recorded:
            return self.tensors(cache)
        raise RuntimeError("the attention module never wrote its cache")


class _Plain(_Rows):
    """KVCache: keys and values, one row per token."""

    def fresh(self, cache: KVCache) -> KVCache:
        return KVCache()

    def tensors(self, cache: KVCache) -> dict[str, mx.array]:
        n = cache.offset
        return {"keys": cache.keys[..., :n, :], "values": cache.values[..., :n, :]}

    def restore(self, template: KVCache, rows: dict[str, mx.array], n: int, dtype: mx.Dtype) -> KVCache:
        cache = KVCache()
        # An exact-size buffer is valid: the next update grows it by whole steps.
        cache.state = (rows["keys"], rows["values"], n)
        return cache

class _Quantized(_Rows):
    """QuantizedKVCache: per token, packed uint32 codes plus per-group scales and biases (MLX affine
    quantization along the head width), for keys and for values."""

    names = ("keys", "keys_scales", "keys_biases", "values", "values_scales", "values_biases")

    def params(self, cache: QuantizedKVCache) -> dict:
        return {"kv_bits": cache.bits, "kv_group_size": cache.group_size}

    def fresh(self, cache: QuantizedKVCache) -> QuantizedKVCache:
        return QuantizedKVCache(group_size=cache.group_size, bits=cache.bits)

    def tensors(self, cache: QuantizedKVCache) -> dict[str, mx.array]:
        n = cache.offset
        parts = [a[..., :n, :] for a in (*cache.keys, *cache.values)]
        return dict(zip(self.names, parts))

    def restore(self, template: QuantizedKVCache, rows: dict[str, mx.array], n: int,
                dtype: mx.Dtype) -> QuantizedKVCache:
        cache = self.fresh(template)
        keys, values = tuple(rows[k] for k in self.names[:3]), tuple(rows[k] for k in self.names[3:])
        cache.state = (keys, values, n, template.group_size, template.bits)
        return cache


class _Rotating(_Rows):
    """RotatingKVCache (sliding window): blocks hold every token's rows, so the window can be rebuilt
    at any block boundary; the decoder keeps the first `keep` rows and the last `max_size - keep`."""

    def params(self, cache: RotatingKVCache) -> dict:
        return {"window": cache.max_size, "keep": cache.keep}

    def fresh(self, cache: RotatingKVCache) -> RotatingKVCache:
        return RotatingKVCache(max_size=cache.max_size, keep=cache.keep)

    def tensors(self, cache: RotatingKVCache) -> dict[str, mx.array]:
        keys, values, offset, keep, _, idx = cache.state

        def temporal(v: mx.array) -> mx.array:  # as RotatingKVCache orders its buffer
            if idx == v.shape[TOKEN_AXIS]:
                return v
            if idx < offset:
                return mx.concatenate([v[..., :keep, :], v[..., idx:, :], v[..., keep:idx, :]], axis=2)
            return v[..., :idx, :]

        return {"keys": temporal(keys), "values": temporal(values)}

    def restore(self, template: RotatingKVCache, rows: dict[str, mx.array], n: int,
                dtype: mx.Dtype) -> RotatingKVCache:
        keep, size = template.keep, template.max_size

        def window(v: mx.array) -> mx.array:
            if n <= size:
                return v
            return mx.concatenate([v[..., :keep, :], v[..., n - (size - keep):, :]], axis=2)

        cache = self.fresh(template)
        keys, values = window(rows["keys"]), window(rows["values"])
        cache.state = (keys, values, n, keep, size, keys.shape[TOKEN_AXIS])
        return cache


class _Chunked(_Rows):
    """ChunkedKVCache (Llama 4's chunked-attention layers): keys and values, one row per token, of
    which the decoder keeps the last `chunk_size` (before each forward pass it trims to them;
    `start_position` is the first one's token) — all a query can attend to, since a token sees only
    its own chunk. Blocks hold every token's rows, so a cache restores at any token: the last
    `chunk_size` rows, as the decoder's own cache holds them after its next trim."""

    def fresh(self, cache: ChunkedKVCache) -> ChunkedKVCache:
        return ChunkedKVCache(cache.chunk_size)

    def tensors(self, cache: ChunkedKVCache) -> dict[str, mx.array]:
        held = cache.offset - cache.start_position
        return {"keys": cache.keys[..., :held, :], "values": cache.values[..., :held, :]}

    def restore(self, template: ChunkedKVCache, rows: dict[str, mx.array], n: int,
                dtype: mx.Dtype) -> ChunkedKVCache:
        cache = self.fresh(template)
        start = max(0, n - template.chunk_size)
        cache.state = (rows["keys"][..., start:, :], rows["values"][..., start:, :], n, template.chunk_size, start)
        return cache


class _Recurrent(Codec):
    """ArraysCache of a recurrent layer (gated delta-net, SSM): arrays every token updates — a scan
    over the whole prefix, not rows. A block holds them after its last token (`state0`, `state1`, …,
    whole), so a cache restores at any block boundary, a tail included; mlx-lm cannot rewind one, so
    a state is only ever used at the very position it was taken at, and it chains every block
    before it (not from one block's layer inputs). Written by the block's recurrent module."""

    kind = SNAPSHOT
    extent = FIXED
    takes_tail = True
    module = "linear_attn"

    def fresh(self, cache: ArraysCache) -> ArraysCache:
        return ArraysCache(len(cache.cache))

    def tensors(self, cache: ArraysCache) -> dict[str, mx.array]:
        return {f"state{i}": a for i, a in enumerate(cache.cache)}

    def compute(self, module: Any, x: mx.array, offset: int, cache: ArraysCache) -> dict[str, mx.array]:
        module(x, None, cache)  # advances the state; the output is never evaluated
        return self.tensors(cache)

    def restore(self, template: ArraysCache, tensors: dict[str, mx.array], n: int, dtype: mx.Dtype) -> ArraysCache:
        cache = self.fresh(template)
        cache.cache = [tensors[f"state{i}"] for i in range(len(template.cache))]
        return cache


class _DeepseekV41(Codec):
    """DeepSeek-V4.1's LayerCache: a sliding window of KV rows rounded to fp8 values, and in a layer
    that pools its own KV, one compressed row (rounded to fp4 values) per closed group of `ratio`
    tokens plus, on an index layer, one index key per group; the open group's raw rows wait in
    `pending_*`. Every row of a block depends only on the block's tokens and position, so a block
    holds the window after its last token (its own last rows when it is at least a window long)
    and the groups it closed: restorable at any block boundary, never inside a block (so, like a
    state, no stored block ends with a prompt's last token, and there is no tail). `describe` runs
    one block through the cache: a ratio that does not divide the block (a group would straddle
    two) or a block shorter than the window is refused there.

    Stored at the values' own precision with MLX's microscaling formats, which hold those values
    exactly (checked on every pack): the window as mxfp8 (e4m3, a power-of-two scale per 32), the
    compressed rows as nvfp4 (e2m1, an e4m3 scale per 16), the index keys as mxfp4 (e2m1, a
    power-of-two scale per 32)."""

    kind = POOLED
    extent = PER_BLOCK
    token_axis = 1
    from_inputs = True
    # field -> (quantization mode, group size): the rounding mlx-lm applies to it.
    formats = {"window": ("mxfp8", 32), "compress_kv": ("nvfp4", 16), "index_k": ("mxfp4", 32)}

    def params(self, cache: deepseek_v41.LayerCache) -> dict:
        return {"window": cache.window_size}

    def fresh(self, cache: deepseek_v41.LayerCache) -> deepseek_v41.LayerCache:
        return deepseek_v41.LayerCache(cache.window_size)

    def problem(self, cache: deepseek_v41.LayerCache) -> str | None:
        if cache.pending_kv is not None and cache.pending_kv.shape[1]:
            return (f"a block of {cache.offset} tokens leaves {cache.pending_kv.shape[1]} in an open compression "
                    "group: the pool ratio must divide the block")
        if cache.window.shape[1] < cache.window_size:
            return f"a block of {cache.offset} tokens is shorter than the sliding window of {cache.window_size}"
        return None

    def compute(self, module: Any, x: mx.array, offset: int, cache: deepseek_v41.LayerCache) -> dict[str, mx.array]:
        """Runs the decoder's attention module into `cache`. Lazily: evaluating the cache evaluates
        its KV path only, never the queries, the indexer's scores or the attention, so the window
        indices they would read are a stand-in."""
        nowhere = mx.full((1, x.shape[1], 1), -1, mx.int32)
        module(x, start_pos=offset, window_idx=nowhere, cache=cache, shared={})
        return self.block_tensors(cache, x.shape[1])

    def tensors(self, cache: deepseek_v41.LayerCache) -> dict[str, mx.array]:
        return self.pack({f: getattr(cache, f) for f in self.formats if getattr(cache, f) is not None})

    def block_tensors(self, cache: deepseek_v41.LayerCache, block_tokens: int) -> dict[str, mx.array]:
        """The window, and the groups the block closed (every block closes as many); the cache ends
        at a multiple of `block_tokens`."""
        fields = {}
        for field in self.formats:
            rows = getattr(cache, field)
            if rows is not None and field != "window":
                rows = rows[:, rows.shape[1] * (cache.offset - block_tokens) // cache.offset:]
            if rows is not None:
                fields[field] = rows
        return self.pack(fields)

    def pack(self, fields: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for field, rows in fields.items():
            mode, group = self.formats[field]
            codes, scales = mx.quantize(rows, group_size=group, mode=mode)
            back = mx.dequantize(codes, scales, group_size=group, mode=mode, dtype=rows.dtype)
            if not mx.array_equal(back, rows).item():
                raise ValueError(f"{field} holds values that {mode} cannot hold exactly: not mlx-lm's rounding")
            out |= {field: codes, f"{field}_scales": scales}
        return out

    def restore(self, template: deepseek_v41.LayerCache, tensors: dict[str, mx.array], n: int,
                dtype: mx.Dtype) -> deepseek_v41.LayerCache:
        cache = self.fresh(template)
        for field, (mode, group) in self.formats.items():
            if field not in tensors:
                continue
            codes, scales = tensors[field], tensors[f"{field}_scales"]
            if field == "window":  # every block holds a whole window: the last block's is the one at n
                codes, scales = codes[:, -template.window_size:], scales[:, -template.window_size:]
            setattr(cache, field, mx.dequantize(codes, scales, group_size=group, mode=mode, dtype=dtype))
        cache.offset = n
        return cache


# Exact classes only: a subclass may store something else.
_CODECS: dict[type, Codec] = {
    KVCache: _Plain(), QuantizedKVCache: _Quantized(), RotatingKVCache: _Rotating(), ChunkedKVCache: _Chunked(),
    ArraysCache: _Recurrent(), deepseek_v41.LayerCache: _DeepseekV41(),
}

_WHY_NOT = {
    "CacheList": "a list of sub-caches per layer",
}


def codec_for(cache: Any) -> Codec:
    """The codec for `cache`'s class; UnsupportedCache names why there is none."""
    codec = _CODECS.get(type(cache))
    if codec is None:
        name = type(cache).__name__
        raise UnsupportedCache(f"{name}: {_WHY_NOT.get(name, 'no pd-bridge codec for this cache class')}")
    return codec


def _layer(index: int, cache: Any) -> dict:
    """What every LayerSpec states, before its codec fills in its own."""
    return {"index": index, "cache_class": type(cache).__name__, "window": 0, "keep": 0, "kv_bits": 0,
            "kv_group_size": 0, "tensors": []}


def describe(index: int, cache: Any) -> dict:
    """A LayerSpec (as a dict in proto3 JSON, ready for `json_format.ParseDict`) for a cache that
    holds exactly one block of tokens (`Codec.describe`), or an unsupported layer with its reason
    (no traits: the cautious answer to each)."""
    try:
        codec = codec_for(cache)
        if problem := codec.problem(cache):
            raise UnsupportedCache(f"{type(cache).__name__}: {problem}")
    except UnsupportedCache as e:
        return {**_layer(index, cache), "kind": UNSUPPORTED, "unsupported_reason": str(e),
                **dict.fromkeys(TRAITS, False)}
    return codec.describe(index, cache)


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


def restore(templates: list, parts: list[dict[str, list[mx.array]]], n: int, dtype: mx.Dtype) -> list:
    """The decoder's caches after tokens [0, n), from each layer's tensors of consecutive blocks
    starting at token 0 (rows past n are dropped; a state or pooled blocks must end at n), in the
    decoder's activation `dtype`."""
    caches = []
    for template, layer in zip(templates, parts):
        codec = codec_for(template)
        caches.append(codec.restore(template, {name: codec.join(p, n) for name, p in layer.items()}, n, dtype))
    return caches
