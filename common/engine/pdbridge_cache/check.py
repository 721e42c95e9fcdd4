"""Same-input conformance: is a reconstructed block the decoder's own cache, bit for bit?

The decoder prefills a prompt natively (mlx-lm's `generate_step`, its chunking, its cache classes)
while each layer's input is recorded; the cache path rebuilt from the decoder's bundle (what the
prefill plugin runs) then reconstructs every block — and the partial one after them, as a prompt's
tail — from those same inputs, and each tensor is compared with the decoder's cache: rows with the
native cache's rows, a recurrent layer's state (a pooled layer's window and groups) with the
decoder's own after that block, from its block-by-block prefill (the same run the inputs come from).
Used by the tests and by `bench/models_decoder.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from .kinds import PER_TOKEN, codec_for
from .layers import CachePath


class _RecordInput:
    """Stands in for a decoder block's input norm and records what it is given: the residual
    stream entering the block, the input of the block's cache path. (The norm, not the block: some
    models hand out a fresh list of their blocks, so the blocks themselves cannot be swapped.)"""

    def __init__(self, norm: Any, sink: list):
        self.norm, self.sink = norm, sink

    def __call__(self, x):
        self.sink.append(x)
        return self.norm(x)


def native_prefill(model: Any, tokens: list[int], prefill_step_size: int, kv_args: dict,
                   block_tokens: int | None = None) -> tuple[list, list, list]:
    """The decoder's caches after prefilling `tokens` as a native generation does, each layer's
    input for the tokens it processed, and, with `block_tokens`, the prompt prefilled block by
    block (as the decoder exports it) and each layer's block tensors after every block but of its
    rows: ([cache per layer], [mx [T, hidden] per layer], [{layer: {name: array}} per block])."""
    blocks = list(model.layers)
    inputs: list[list] = [[] for _ in blocks]
    norms = [block.input_layernorm for block in blocks]
    step = block_tokens or len(tokens)
    ends = []
    try:
        for block, norm, sink in zip(blocks, norms, inputs):
            block.input_layernorm = _RecordInput(norm, sink)
        cache = make_prompt_cache(model)
        for lo in range(0, len(tokens), step):
            chunk = tokens[lo:lo + step]
            for _ in generate_step(mx.array(chunk), model, prompt_cache=cache, max_tokens=0,
                                   prefill_step_size=prefill_step_size, **kv_args):
                pass
            if block_tokens:
                ends.append({layer: codec_for(c).block_tensors(c, len(chunk)) for layer, c in enumerate(cache)
                             if codec_for(c).extent != PER_TOKEN})
    finally:
        for block, norm in zip(blocks, norms):
            block.input_layernorm = norm
    hidden = [mx.concatenate(x, axis=1)[0] for x in inputs]
    mx.eval(hidden, [c.state for c in cache], ends)
    return cache, hidden, ends


@dataclass
class Conformance:
    tensors_exact: int = 0
    tensors_total: int = 0
    max_ulp: int = 0  # over floating tensors; packed codes count only as exact or not

    def add(self, got: mx.array, want: mx.array) -> None:
        self.tensors_total += 1
        if got.shape != want.shape or got.dtype != want.dtype:
            self.max_ulp = max(self.max_ulp, 2**31)
            return
        if mx.array_equal(got, want).item():
            self.tensors_exact += 1
            return
        if mx.issubdtype(got.dtype, mx.floating):
            bits = {2: mx.int16, 4: mx.int32}[got.dtype.size]
            diff = np.abs(np.array(got.view(bits), dtype=np.int64) - np.array(want.view(bits), dtype=np.int64))
            self.max_ulp = max(self.max_ulp, int(diff.max()))


def same_input(model: Any, cache_path: CachePath, tokens: list[int], block_tokens: int,
               prefill_step_size: int, kv_args: dict) -> Conformance:
    """Reconstructs every block of `tokens` (the last one partial, if the length says so) from the
    decoder's own layer inputs with `cache_path` and compares each tensor with the decoder's native
    cache: rows where that cache still holds them (a sliding window keeps only its last rows), a
    state (or a pooled layer's window and the groups the block closed) with the native cache's after
    the block's last token. With such layers the native prefill runs block by block, as the decoder
    exports; otherwise in one go, chunked as generation chunks it (not along block boundaries)."""
    by_block = block_tokens if cache_path.per_block else None
    cache, hidden, ends = native_prefill(model, tokens, prefill_step_size, kv_args, by_block)
    native = [codec_for(c).tensors(c) if codec_for(c).extent == PER_TOKEN else {} for c in cache]
    result = Conformance()
    processed = hidden[0].shape[0]
    states = cache_path.new_states()
    for k, lo in enumerate(range(0, processed, block_tokens)):
        hi = min(lo + block_tokens, processed)
        block_inputs = mx.stack([hidden[layer][lo:hi] for layer in cache_path.layers], axis=1)
        for layer, name, got in cache_path.block(block_inputs, lo, states=states):
            codec = codec_for(cache[layer])
            if codec.extent != PER_TOKEN:
                result.add(got, ends[k][layer][name])
                continue
            want, axis = native[layer][name], codec.token_axis
            first = cache[layer].offset - want.shape[axis]  # the first token the cache still holds
            if lo >= first:
                result.add(got, want[(slice(None),) * axis + (slice(lo - first, hi - first),)])
    return result
