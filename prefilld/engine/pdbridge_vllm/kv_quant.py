"""mlx-lm's KV quantization (MLX affine, ``mx.quantize``) in torch, on whatever device holds the rows.

The `kv` route lays vLLM's own K/V out as the decoder's cache without MLX on the prefill box; for a
decoder whose cache is a ``QuantizedKVCache`` that means quantizing exactly as MLX does. MLX's
kernels round differently per backend, so there are two rules, picked by the decoder's MLX device
(``DecoderCode.device``):

* ``cpu`` (MLX's CPU kernel): a group's min and max, ``rint`` (half to even), codes clipped to
  ``[0, 2^bits - 1]``.
* ``gpu`` (MLX's Metal and CUDA kernels): the max starts at 0 (an all-negative group spans
  ``[min, 0]``), ``round`` (half away from zero).

Both: float32 arithmetic; ``scale = max((max - min) / n_bins, 1e-7)``, negated unless the min has
the larger magnitude; the larger-magnitude edge is made exact (``scale = edge / rint(edge /
scale)``, ``bias = edge``, or bias 0 when that rounds to 0); codes packed LSB first into uint32;
scales and biases stored in the input's dtype. Byte-identical to ``mx.quantize`` on the same input
(prefilld/engine/tests/test_kv_quant.py, with golden files both read).
"""

from __future__ import annotations

import torch

CPU, GPU = "cpu", "gpu"
RULES = (CPU, GPU)
_EPS = 1e-7


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    # C's round(): exact, unlike floor(x + 0.5) (0.49999997 + 0.5 rounds up in float32).
    whole = torch.trunc(x)
    return whole + torch.where((x - whole).abs() >= 0.5, torch.sign(x), torch.zeros_like(x))


def quantize(w: torch.Tensor, group_size: int, bits: int, rule: str = CPU
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mx.quantize(w, group_size, bits)`` (affine) along the last axis: (codes uint32 [...,
    D * bits / 32], scales [..., D / group_size], biases [..., D / group_size]), the last two in
    ``w``'s dtype. Power-of-two bits only (mlx-lm's kv_bits are 4 or 8)."""
    if rule not in RULES:
        raise ValueError(f"quantize rule {rule!r} is not one of {RULES}")
    if bits not in (2, 4, 8) or w.shape[-1] % group_size or group_size % (32 // bits):
        raise ValueError(f"cannot quantize width {w.shape[-1]} in groups of {group_size} at {bits} bits")
    groups = w.float().unflatten(-1, (-1, group_size))
    n_bins = float(2**bits - 1)
    # A tensor on w's device, not a Python float: torch's CUDA division by a CPU scalar multiplies
    # by its reciprocal, which is 1 ulp off IEEE division (MLX's) for some groups.
    n_bins_divisor = torch.full((), n_bins, device=w.device)
    w_min = groups.amin(-1)
    w_max = groups.amax(-1)
    if rule == GPU:
        w_max = w_max.clamp_min(0.0)
    wider_min = w_min.abs() > w_max.abs()
    scale = ((w_max - w_min) / n_bins_divisor).clamp_min(_EPS)
    scale = torch.where(wider_min, scale, -scale)
    edge = torch.where(wider_min, w_min, w_max)
    rounder = torch.round if rule == CPU else _round_half_away  # torch.round: half to even
    q0 = rounder(edge / scale)
    at_zero = q0 == 0
    scale = torch.where(at_zero, scale, edge / q0)
    bias = torch.where(at_zero, torch.zeros_like(edge), edge)
    codes = rounder((groups - bias[..., None]) / scale[..., None]).clamp(0.0, n_bins)
    per_word = 32 // bits
    codes = codes.to(torch.int64).flatten(-2).unflatten(-1, (-1, per_word))
    shifts = torch.arange(0, 32, bits, device=w.device, dtype=torch.int64)
    # Codes occupy disjoint bits, so the sum is their OR; int64 holds 32 bits, then the low 32 as uint32.
    words = (codes << shifts).sum(-1).to(torch.int32).view(torch.uint32)
    return words, scale.to(w.dtype), bias.to(w.dtype)
