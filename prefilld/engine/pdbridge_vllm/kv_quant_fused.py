"""`kv_quant.quantize`'s ``gpu`` rule as one Triton kernel: each row read once, codes, scales and
biases written once.

Why: the torch version is a chain of float32 element-wise ops and reductions over whole blocks; on
an H100 it took ~30-45 ms of kernel time per 8K-token step of an 8B model beside vLLM's forward
(BENCHMARKS.md, the kv route's profile), where a pass that reads each bf16 row once takes about a
millisecond.

Same arithmetic as `kv_quant.quantize` (float32, IEEE division `div_rn`, round half away from zero,
the same selects), so the bytes are the same: `Fused.quantize` proves it on the first input of each
(dtype, bits, group) by comparing the two byte for byte, and uses the kernel only where they agree
(a disagreement is logged once and the torch version used from then on). The fast tier runs the
kernel in Triton's interpreter against the torch version (`test_kv_quant_fused.py`).
"""

from __future__ import annotations

import logging

import torch

from . import kv_quant

logger = logging.getLogger("vllm.pdbridge_vllm")

_GROUPS_PER_PROGRAM = 16

try:  # vLLM's CUDA and CPU builds both bring Triton; without it the torch version quantizes
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    @triton.jit
    def _round_half_away(x):
        # trunc: float32 magnitudes from 2^23 on are integers already
        whole = tl.where(tl.abs(x) < 8388608.0, x.to(tl.int32).to(tl.float32), x)
        sign = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
        return whole + tl.where(tl.abs(x - whole) >= 0.5, sign, 0.0)

    @triton.jit
    def _quantize_groups(w_ptr, codes_ptr, scales_ptr, biases_ptr, groups,
                         GROUP: tl.constexpr, BITS: tl.constexpr, N_BINS: tl.constexpr,
                         GROUPS_PER_PROGRAM: tl.constexpr):
        PER_WORD: tl.constexpr = 32 // BITS
        n_bins = N_BINS
        g = tl.program_id(0) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
        live = g < groups
        col = tl.arange(0, GROUP)
        x = tl.load(w_ptr + g[:, None] * GROUP + col[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        w_min = tl.min(x, axis=1)
        w_max = tl.maximum(tl.max(x, axis=1), 0.0)  # MLX's GPU kernels: the max starts at 0
        wider_min = tl.abs(w_min) > tl.abs(w_max)
        scale = tl.maximum(tl.math.div_rn(w_max - w_min, n_bins), 1e-7)
        scale = tl.where(wider_min, scale, -scale)
        edge = tl.where(wider_min, w_min, w_max)
        q0 = _round_half_away(tl.math.div_rn(edge, scale))
        at_zero = q0 == 0
        scale = tl.where(at_zero, scale, tl.math.div_rn(edge, tl.where(at_zero, 1.0, q0)))
        bias = tl.where(at_zero, 0.0, edge)
        q = _round_half_away(tl.math.div_rn(x - bias[:, None], scale[:, None]))
        q = tl.minimum(tl.maximum(q, 0.0), n_bins).to(tl.uint32)
        shifts = (tl.arange(0, PER_WORD) * BITS).to(tl.uint32)
        words = tl.sum(tl.reshape(q, (GROUPS_PER_PROGRAM, GROUP // PER_WORD, PER_WORD)) << shifts[None, None, :],
                       axis=2)  # disjoint bits: the sum is their OR
        word = tl.arange(0, GROUP // PER_WORD)
        tl.store(codes_ptr + g[:, None] * (GROUP // PER_WORD) + word[None, :], words, mask=live[:, None])
        tl.store(scales_ptr + g, scale, mask=live)  # float32: torch rounds them to the input's dtype
        tl.store(biases_ptr + g, bias, mask=live)


def quantize(w: torch.Tensor, group_size: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`kv_quant.quantize(w, group_size, bits, "gpu")` by the Triton kernel (same shapes, dtypes
    and bytes)."""
    if bits not in (2, 4, 8) or w.shape[-1] % group_size or group_size % (32 // bits):
        raise ValueError(f"cannot quantize width {w.shape[-1]} in groups of {group_size} at {bits} bits")
    if triton is None:
        raise RuntimeError("Triton is not installed")
    rows = w.contiguous().view(-1, group_size)
    groups = rows.shape[0]
    lead = tuple(w.shape[:-1])
    codes = torch.empty(lead + (w.shape[-1] * bits // 32,), dtype=torch.int32, device=w.device)
    scales = torch.empty(lead + (w.shape[-1] // group_size,), dtype=torch.float32, device=w.device)
    biases = torch.empty_like(scales)
    grid = (-(-groups // _GROUPS_PER_PROGRAM),)
    _quantize_groups[grid](rows, codes, scales, biases, groups, GROUP=group_size, BITS=bits,
                           N_BINS=float(2**bits - 1), GROUPS_PER_PROGRAM=_GROUPS_PER_PROGRAM)
    return codes.view(torch.uint32), scales.to(w.dtype), biases.to(w.dtype)


class Fused:
    """The kv route's quantizer: the kernel where it was shown to give `kv_quant.quantize`'s bytes
    on this device, else the torch version."""

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        self._devices = devices  # where the kernel is tried (tests: "cpu", in Triton's interpreter)
        self._agrees: dict[tuple, bool] = {}

    def quantize(self, w: torch.Tensor, group_size: int, bits: int, rule: str):
        """`kv_quant.quantize(w, group_size, bits, rule)`'s bytes."""
        if rule != kv_quant.GPU or w.device.type not in self._devices:
            return kv_quant.quantize(w, group_size, bits, rule)
        key = (w.dtype, group_size, bits)
        agrees = self._agrees.get(key)
        if agrees is None:
            return self._first(key, w, group_size, bits)
        return quantize(w, group_size, bits) if agrees else kv_quant.quantize(w, group_size, bits, rule)

    def _first(self, key: tuple, w: torch.Tensor, group_size: int, bits: int):
        reference = kv_quant.quantize(w, group_size, bits, kv_quant.GPU)
        try:
            fused = quantize(w, group_size, bits)
            agrees = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(fused, reference))
        except Exception as e:  # no Triton for this device: the torch version, said once
            logger.warning("pdbridge: the fused KV quantizer cannot run here (%s): torch's ops quantize", e)
            agrees = False
        else:
            if not agrees:
                logger.warning("pdbridge: the fused KV quantizer's bytes differ from torch's for %s, %d bits, "
                               "group %d: torch's ops quantize", w.dtype, bits, group_size)
        self._agrees[key] = agrees
        return reference
